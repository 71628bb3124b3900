"""A real job, end to end, as a user runs it (issue 25's "done when"): a Hugging Face model folder with a
tokenizer trained there by `tokenizers`, a text corpus prepared with that tokenizer, a fine-tune from the
folder with train.py, validation in bits per byte, a sample decoded to text, export back to Hugging Face
(`from_pretrained`, `AutoTokenizer`), and a multiple-choice task scored through the lm-eval adapter.

Every step is checked against the library the user would compare with: transformers computes the first
batch's loss and the exported model's logits, `tokenizers`/AutoTokenizer encode and decode, lm-eval scores."""
from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

import train as train_script
from nanomega import checkpoint
from nanomega.run import preflight
from nanomega.config import parse_args
from nanomega.data.sampler import TokenSampler, eval_batches
from nanomega.eval.evaluate import load_run, multiple_choice, read_task
from nanomega.eval.generate import sample
from nanomega.hf.transfer import export
from nanomega.data.prepare import main as prepare_main

transformers = pytest.importorskip("transformers")
lm_eval = pytest.importorskip("lm_eval")

VOCAB = 384
STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOCUMENTS = ["textwrap.py", "calendar.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py",
             "keyword.py", "difflib.py", "struct.py", "copy.py", "heapq.py", "numbers.py", "queue.py", "sched.py"]


def make_model_folder(folder: Path, corpus: Path) -> None:
    """What a user downloads: config.json, safetensors weights, tokenizer.json and tokenizer_config.json.
    The tokenizer is a byte-level BPE trained here with `tokenizers` (the library, not nanomega)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    fast.save_pretrained(folder)
    eot = tok.token_to_id("<|endoftext|>")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=eot, eos_token_id=eot, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def write_task(path: Path) -> None:
    """A HellaSwag-layout multiple-choice file: which ending continues a line of Python."""
    rows = [("def main", ["():", "= (", "import", "+ +"], 0), ("import", ["os", "(", ":", "="], 0),
            ("for i in", ["range(10):", ") (", ":=", "def"], 0), ("return", ["None", "def (", "import", ": :"], 0),
            ("class Foo", ["(object):", "=", "import", "+"], 0), ("if x ==", ["0:", "def", "import", "("], 0)]
    with open(path, "w") as f:
        for ctx, endings, label in rows:
            f.write(json.dumps({"ctx": ctx, "endings": endings, "label": label}) + "\n")


@pytest.mark.slow
def test_a_hugging_face_model_fine_tuned_on_prepared_text_and_evaluated(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in DOCUMENTS:
        (corpus / name).write_bytes((STDLIB / name).read_bytes())
    folder, data, run, out = tmp_path / "model", tmp_path / "data", tmp_path / "run", tmp_path / "exported"
    make_model_folder(folder, corpus)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)

    # 1. Prepare the corpus with the model's tokenizer: each document, as `tokenizers` encodes it, behind EOS.
    assert prepare_main(["prepare", str(corpus), f"--tokenizer={folder}", f"--out={data}", "--workers=2",
                         "--val-fraction=0.2"]) == 0
    meta = json.loads((data / "meta.json").read_text())
    assert meta["vocab_size"] == VOCAB and meta["eos_id"] == hf_tok.eos_token_id

    # 2. Fine-tune from the folder; its tokenizer is the run's by default.
    args = [f"--train.init_from={folder}", f"--data.path={data}", f"--train.out_dir={run}", "--train.steps=40",
            "--train.batch_size=8", "--train.seq_len=64", "--train.eval_every=5", "--train.eval_batches=2",
            "--train.log_every=1", "--train.ckpt_every=40", "--train.compile=false", "--train.sample_tokens=0",
            "--optim.lr=1e-2", "--optim.warmup_steps=3", f"--data.cache_dir={tmp_path / 'cache'}"]
    train_script.main(args)
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]

    # The first loss is transformers' loss of the same model on the same first batch.
    cfg = parse_args(args)
    splits = preflight.load_data(cfg)
    x, y = TokenSampler(splits.train, 64, cfg.train.seed, cfg.data.align, vocab_size=VOCAB).batch(0, 8)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model(input_ids=x).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).double(), y.reshape(-1)).item()
    assert records[0]["step"] == 1 and abs(records[0]["loss"] - want) < 1e-4 * want

    # Validation in bits per byte falls; it is nats per token / ln 2 / the bytes of text per token, counted here
    # by transformers' decoding of the validation targets (special tokens stand for no text).
    evals = [r for r in records if "val_bpb" in r]
    assert len(evals) == 8 and evals[-1]["val_bpb"] < 0.95 * evals[0]["val_bpb"]
    targets = [y for _, y in eval_batches(splits.val, 64, 8, 2)]
    n_bytes = sum(len(hf_tok.decode(row, skip_special_tokens=True).encode()) for y in targets for row in y.tolist())
    bytes_per_token = n_bytes / sum(y.numel() for y in targets)
    assert evals[-1]["val_bpb"] == pytest.approx(evals[-1]["val_loss"] / math.log(2) / bytes_per_token, rel=1e-3)

    # 3. The sample decodes with the run's tokenizer: what AutoTokenizer decodes from the same ids.
    params, run_cfg, tokenizer, ckpt = load_run(run, torch.device("cpu"))
    prompt = torch.tensor([tokenizer.encode("def ")])
    ids = sample(params, run_cfg.model, prompt, 20, temperature=0)[0].tolist()
    text = tokenizer.decode(ids)
    assert text.startswith("def ") and text == hf_tok.decode(ids)

    # 4. Export: transformers loads the weights and the tokenizer, and computes the same logits.
    export(run, out)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    from nanomega.models import forward
    with torch.no_grad():
        assert torch.allclose(back(input_ids=x[:2]).logits, forward(params, x[:2], run_cfg.model)[..., :VOCAB],
                              atol=1e-5, rtol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(out)("def main():")["input_ids"] == hf_tok("def main():")["input_ids"]

    # 5. lm-eval scores a local multiple-choice task on the checkpoint; the same numbers as our own evaluator.
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    write_task(task_dir / "python_mc.jsonl")
    (task_dir / "python_mc.yaml").write_text(
        "task: python_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task_dir / 'python_mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{ctx}}'\ndoc_to_choice: '{{endings}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    import nanomega.eval.lm_eval_adapter  # noqa: F401  (registers the model "nanomega")
    from lm_eval.tasks import TaskManager
    results = lm_eval.simple_evaluate(model="nanomega", model_args={"run": str(run)}, tasks=["python_mc"],
                                      task_manager=TaskManager(include_path=str(task_dir)), batch_size=4)
    scored = results["results"]["python_mc"]
    ours = multiple_choice(params, run_cfg.model, tokenizer, read_task(task_dir / "python_mc.jsonl"),
                           torch.device("cpu"))
    assert scored["acc,none"] == pytest.approx(ours["acc"]) and scored["acc_norm,none"] == pytest.approx(ours["acc_norm"])
