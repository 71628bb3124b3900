"""Sampling: greedy equals a hand-written argmax loop, top-k=1 is greedy, padding ids never come out; sample.py and
the end-of-run sample stop at the tokenizer's EOS / end-of-turn (a real `tokenizers` tokenizer) and at --stop."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from nanomega import checkpoint
from nanomega.config import Config, ModelConfig, to_dict
from nanomega.data.tokenizer import EOT, ByteTokenizer, load_tokenizer, train_bpe
from nanomega.eval.generate import default_prompt, sample, stopper
from nanomega.models import forward, init

CFG = ModelConfig(vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
                  init_std=0.5)


def test_greedy_matches_argmax_loop_and_crops_context():
    params = init(CFG, 0)
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    out = sample(params, CFG, prompt, 20, temperature=0)  # runs past max_seq_len=16: context is cropped
    ref = prompt
    with torch.no_grad():
        for _ in range(20):
            logits = forward(params, ref[:, -16:], CFG)[:, -1, :100]
            ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


def test_stop_ends_generation_at_the_token_it_names_on_the_cache_and_past_it():
    params = init(CFG, 0)
    prompt = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))
    whole = sample(params, CFG, prompt, 20, temperature=0)            # the cache to 16 tokens, then recomputed
    for n in (1, 4, 11, 15):                                          # inside the cache and past max_seq_len
        seen = []
        out = sample(params, CFG, prompt, 20, temperature=0, stop=lambda new: seen.append(new.shape[1]) or
                     new.shape[1] == n)
        assert torch.equal(out, whole[:, :5 + n]) and seen == list(range(1, n + 1))
        assert torch.equal(sample(params, CFG, prompt, 20, temperature=0, recompute=True,
                                  stop=lambda new: new.shape[1] == n), out)


def test_top_k_one_is_greedy_and_seeded_sampling_is_deterministic():
    params = init(CFG, 1)
    prompt = torch.zeros(3, 1, dtype=torch.long)
    greedy = sample(params, CFG, prompt, 8, temperature=0)
    assert torch.equal(sample(params, CFG, prompt, 8, 1.5, top_k=1, generator=torch.Generator().manual_seed(5)),
                       greedy)
    a = sample(params, CFG, prompt, 8, 1.0, 10, torch.Generator().manual_seed(7))
    b = sample(params, CFG, prompt, 8, 1.0, 10, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_padding_ids_are_never_sampled():
    params = init(CFG, 2)
    with torch.no_grad():                      # make the padding rows (100..127) the most likely tokens
        params["lm_head"]["weight"][100:] = 50.0 * params["lm_head"]["weight"][:28].sign()
    out = sample(params, CFG, torch.zeros(4, 1, dtype=torch.long), 30, 1.0, 0, torch.Generator().manual_seed(0))
    assert int(out.max()) < 100


def test_sample_command_reads_a_checkpoint(tmp_path):
    cfg = Config(model=ModelConfig(d_model=32, n_layers=1, n_heads=4, ffn_dim=64, max_seq_len=16))
    params = init(cfg.model, 0)
    path = checkpoint.save(tmp_path, 3, params, (), {"config": to_dict(cfg), "data_position": 0,
                                                       "rng": checkpoint.rng_state()}, keep=1)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "sample.py", f"--ckpt={path}", "--tokens=10", "--temperature=0",
                           "--prompt=ab"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = sample(params, cfg.model, torch.tensor([[97, 98]]), 10, temperature=0)[0].tolist()
    assert bytes(expected).decode("utf-8", errors="replace") in done.stdout


END = "<|im_end|>"
TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]


def chat_run(tmp_path, eos_named_by: str):
    """A run folder whose tokenizer is a real `tokenizers` BPE with an end-of-turn token, named either as the EOS
    (tokenizer_config.json, SmolLM2-Instruct's way) or beside the EOS in generation_config.json (Llama 3's
    and Qwen's instruct models' way), and a random model's checkpoint for it."""
    bpe = train_bpe(TEXTS, 300)
    bpe.tok.add_special_tokens([END])
    folder = tmp_path / "source"
    bpe.save(folder)
    end = bpe.tok.token_to_id(END)
    if eos_named_by == "eos_token":
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": END}))
    else:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [bpe.eos_id, end]}))
    tok = load_tokenizer(str(folder))
    assert end in tok.stop_ids
    cfg = Config(model=ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                   ffn_dim=64, max_seq_len=64, init_std=0.5))
    tok.save(tmp_path / "run" / "tokenizer")        # the run keeps it; generation_config.json goes with it
    return tok, end, cfg, folder / "tokenizer.json"


def run_sample_script(monkeypatch, capsys, *args) -> str:
    import sample as sample_script
    monkeypatch.setattr(sys, "argv", ["sample.py", *args])
    sample_script.main()
    return capsys.readouterr().out.split("\n", 1)[1].split("\n" + "-" * 40)[0]


@pytest.mark.parametrize("eos_named_by", ["eos_token", "generation_config"])
def test_sample_script_stops_at_the_end_of_turn_token(tmp_path, monkeypatch, capsys, eos_named_by):
    """The model is edited so that the end-of-turn token is the argmax where a token a was: rows a and END of the
    embedding and the output head swapped, the same model under the permutation a <-> END. Its greedy text is
    the unedited model's until a first comes, and there it must end."""
    tok, end, cfg, file = chat_run(tmp_path, eos_named_by)
    params = init(cfg.model, 0)
    prompt = tok.encode("def f1(x):")
    plain = sample(params, cfg.model, torch.tensor([prompt]), 30, temperature=0, recompute=True)[0, len(prompt):]
    plain = plain.tolist()
    stops = set(tok.stop_ids)
    k = next(k for k in range(3, 30) if plain[k] not in plain[:k] + prompt and not stops & {*plain[:k + 1]})
    a = plain[k]
    with torch.no_grad():
        for key in ("tok_embed", "lm_head"):
            w = params[key]["weight"]
            w[[a, end]] = w[[end, a]]
    meta = {"config": to_dict(cfg), "data_position": 0, "rng": checkpoint.rng_state(), "tokenizer": tok.identity()}
    path = checkpoint.save(tmp_path / "run", 1, params, (), meta, keep=1)
    stopped = sample(params, cfg.model, torch.tensor([prompt]), 30, temperature=0, stop=stopper(tok.stop_ids))
    assert stopped[0, len(prompt):].tolist() == plain[:k] + [end]           # generation ended at the token
    text = run_sample_script(monkeypatch, capsys, f"--ckpt={path}", "--prompt=def f1(x):", "--tokens=30",
                             "--temperature=0")
    assert text == Tokenizer.from_file(str(file)).decode(prompt + plain[:k], skip_special_tokens=False)


def test_sample_script_stops_at_a_stop_string(tmp_path, monkeypatch, capsys):
    tok, end, cfg, file = chat_run(tmp_path, "eos_token")
    params = init(cfg.model, 1)
    prompt = tok.encode("def f2(x):")
    plain = sample(params, cfg.model, torch.tensor([prompt]), 24, temperature=0)[0].tolist()
    assert end not in plain and tok.eos_id not in plain[len(prompt):]
    meta = {"config": to_dict(cfg), "data_position": 0, "rng": checkpoint.rng_state(), "tokenizer": tok.identity()}
    path = checkpoint.save(tmp_path / "run", 1, params, (), meta, keep=1)
    reference = Tokenizer.from_file(str(file)).decode(plain, skip_special_tokens=False)
    after = len(Tokenizer.from_file(str(file)).decode(prompt, skip_special_tokens=False))
    stop = reference[after + 12:after + 15]                 # three characters of the continuation
    text = run_sample_script(monkeypatch, capsys, f"--ckpt={path}", "--prompt=def f2(x):", "--tokens=24",
                             "--temperature=0", f"--stop={stop}")
    assert text == reference[:reference.find(stop, after)]


def test_the_end_of_run_prompt_is_the_setting_or_a_validation_documents_start(tmp_path, capsys):
    import train as train_script
    root = tmp_path / "texts"
    root.mkdir()
    for i in range(6):
        (root / f"doc_{i}.txt").write_text(f"Document number {i} begins here and goes on. " * 30)
    args = ["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
            "--model.ffn_dim=64", "--model.max_seq_len=64", "--train.seq_len=32", "--train.batch_size=2",
            "--train.compile=false", "--train.eval_batches=1", "--train.steps=1", "--train.sample_tokens=8",
            f"--data.path={root}", "--data.val_fraction=0.3"]
    train_script.main(args + [f"--train.out_dir={tmp_path / 'a'}", "--train.sample_prompt=Zebra crossing"])
    assert "--- sample ---\nZebra crossing" in capsys.readouterr().out
    train_script.main(args + [f"--train.out_dir={tmp_path / 'b'}"])
    from nanomega.data.prepare import in_val
    first_val = next(f for f in sorted(root.iterdir()) if in_val(f.name, 0.3))
    assert f"--- sample ---\n{first_val.read_text()[:16]}" in capsys.readouterr().out   # bytes: 16 of them
    assert default_prompt(ByteTokenizer(), "", None) == list(b"def ")      # bytes on the built-in corpus
    bpe = train_bpe(TEXTS, 300)
    val = [bpe.eos_id] + bpe.encode(TEXTS[5]) + [bpe.eos_id] + bpe.encode(TEXTS[6])
    assert default_prompt(bpe, "x", val) == bpe.encode(TEXTS[5])[:16]
