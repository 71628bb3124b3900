"""Document-masked attention (--data.mask=document): a packed row with the mask is its documents run alone.

A document opens at each separator token (hints.document_mask); every reference here runs each document as a
sequence of its own, in float64. RoPE depends on distances only, so a document's numbers are the same at any offset
up to the fp32 rounding of the angle tables (positions do not restart: Llama 3's choice); learned positions do see
the offset, so for them the check is that no token of another document changes a document's logits.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanomega.config import ModelConfig, parse_args
from nanomega.data.tokenizer import ByteTokenizer
from nanomega.hints import same_document
from nanomega.models import forward, init, loss_fn
from nanomega.tree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train as train_script   # noqa: E402
from tiers import slow   # noqa: E402

SEP = 3
FAMILIES = {
    "gqa": dict(n_kv_heads=2),
    "qwen3": dict(qk_norm=True, qkv_bias=True, head_dim=16, tie_embeddings=True),
    "mla": dict(attention="mla", q_lora_rank=16, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8),
}


def tiny(**fields) -> ModelConfig:
    return ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=64, **fields)


def float64(params):
    return tree_map(lambda t: t.detach().double(), params)


def packed_rows(gen, lengths_per_row) -> list[list[list[int]]]:
    """Rows of documents, each opened by the separator and filled with non-separator ids."""
    def doc(n):
        ids = torch.randint(4, 40, (n,), generator=gen).tolist()
        return [SEP] + ids
    return [[doc(n) for n in lengths] for lengths in lengths_per_row]


def per_token_losses(params, rows, cfg) -> torch.Tensor:
    """Cross-entropy of every position predicting the next token of its row: [B, T - 1], no reduction."""
    tokens = torch.tensor(rows)
    logits = forward(params, tokens[:, :-1], cfg)[..., :cfg.vocab_size]
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_packed_row_with_the_mask_is_its_documents_run_alone(family):
    cfg = tiny(**FAMILIES[family])
    params = float64(init(cfg, 0))
    masked = dataclasses.replace(cfg, document_separator=SEP)
    # rows of different layouts: three documents, many short ones, one document; the last token of a row opens
    # nothing, so each row holds a whole number of documents plus the next separator (the last target)
    rows = packed_rows(torch.Generator().manual_seed(0), [[5, 2, 9], [1, 1, 3, 2, 1, 2, 2], [18]])
    packed = [sum(docs, []) + [SEP] for docs in rows]
    assert len({len(r) for r in packed}) == 1
    with torch.no_grad():
        got = per_token_losses(params, packed, masked)
        unmasked = per_token_losses(params, packed, cfg)
        want = torch.stack([torch.cat([per_token_losses(params, [d + [SEP]], cfg)[0] for d in docs]) for docs in rows])
        mean = loss_fn(params, torch.tensor(packed)[:, :-1], torch.tensor(packed)[:, 1:], masked)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)     # fp32 RoPE angles at other offsets: ~4e-9
    torch.testing.assert_close(mean.double(), want.mean(), rtol=0, atol=1e-6)   # the loss (fp32), evaluation's too
    assert (unmasked - want).abs().max() > 1e-3                  # without the mask, documents see each other


def test_with_learned_positions_no_other_document_reaches_a_documents_logits():
    cfg = tiny(position="learned", norm="layernorm", mlp="gelu", bias=True, document_separator=SEP)
    params = float64(init(cfg, 0))
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(4, 40, (n,), generator=gen) for n in (6, 7, 5))
    b2 = torch.randint(4, 40, (7,), generator=gen)
    sep = torch.tensor([SEP])
    row = lambda middle: torch.cat([sep, a, sep, middle, sep, c])[None]   # noqa: E731
    with torch.no_grad():
        one, two = forward(params, row(b), cfg), forward(params, row(b2), cfg)
    in_b = slice(len(a) + 1, len(a) + 2 + len(b))
    assert torch.equal(one[:, :in_b.start], two[:, :in_b.start])       # before: causal anyway
    assert torch.equal(one[:, in_b.stop:], two[:, in_b.stop:])         # after: only the mask keeps b out
    assert (one[:, in_b] - two[:, in_b]).abs().max() > 1e-3


def test_same_document_opens_a_document_at_each_separator():
    opens = torch.tensor([[False, False, True, False, True, True]])
    mask = same_document(opens)[0, 0]
    document = [0, 0, 1, 1, 2, 3]
    want = torch.tensor([[s <= t and document[s] == document[t] for s in range(6)] for t in range(6)])
    assert torch.equal(mask, want)


# ---------------------------------------------------------------- the setting, end to end, and its refusals

@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Path:
    """A folder of short text documents: the byte tokenizer joins them with NUL, its separator."""
    folder = tmp_path_factory.mktemp("docs") / "texts"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 5))
    return folder


def args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.ffn_dim=64", "--model.max_seq_len=64", "--train.seq_len=64", "--train.batch_size=4",
            "--train.compile=false", "--train.eval_batches=1", "--train.sample_tokens=0", "--train.steps=2",
            "--train.eval_every=2", f"--data.path={data}", f"--data.cache_dir={out.parent}",
            f"--train.out_dir={out}", *extra]


def test_data_mask_document_sets_the_tokenizers_separator_and_trains_with_it(documents, tmp_path):
    tok, records = ByteTokenizer(), {}
    for mask in ("causal", "document"):
        # a sharper init than the default, so that what attention sees shows in the loss
        cfg = parse_args(args(documents, tmp_path / mask, f"--data.mask={mask}", "--model.init_std=0.3"))
        assert cfg.model.document_separator == (tok.eos_id if mask == "document" else -1)
        records[mask] = train_script.train(cfg, train_script.load_data(cfg, tok), quiet=True, tok=tok)
    assert tok.eos_id == 0      # NUL, which joins the folder's documents
    # the same batches, seed and steps: the mask alone moves the loss
    assert abs(records["document"]["loss"] - records["causal"]["loss"]) > 1e-2
    meta = json.loads(next((tmp_path / "document").glob("ckpt-*/meta.json")).read_text())
    assert meta["config"]["model"]["document_separator"] == 0      # what sample.py and evaluation read back


@pytest.fixture(scope="module")
def no_separator(tmp_path_factory) -> Path:
    """A tokenizer folder with neither an EOS nor a BOS token: a word-level vocabulary and no special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder = tmp_path_factory.mktemp("tokenizer")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "lorem": 1, "ipsum": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("case, message", [
    ("no_separator", "has neither an EOS nor a BOS token"),
    ("one_document", "never holds it"),
    ("by_hand", "is set by --data.mask=document"),
    ("another_id", "separates documents with token 0"),
])
def test_a_mask_that_cannot_apply_is_refused_before_work(documents, no_separator, tmp_path, case, message):
    out = tmp_path / "run"
    extra = {"no_separator": ["--data.mask=document", f"--data.tokenizer={no_separator}"],
             "one_document": ["--data.mask=document"], "by_hand": ["--model.document_separator=0"],
             "another_id": ["--data.mask=document", "--model.document_separator=5"]}[case]
    data = documents / "doc07.txt" if case == "one_document" else documents     # one file: one document
    with pytest.raises(SystemExit) as refused:
        train_script.main(args(data, out, *extra))
    assert message in str(refused.value)
    assert not out.exists()       # refused before anything was written


# ---------------------------------------------------------------- what the mask costs, as the simulator prices it

@slow     # four simulated steps (~5-15 s)
def test_the_step_time_model_prices_a_masked_kernel_at_the_whole_square_and_the_simulator_holds_the_mask():
    from nanomega.sim.step_time import trace
    tiny = ["--model.vocab_size=256", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.ffn_dim=160", "--model.max_seq_len=64", "--train.batch_size=2", "--train.seq_len=64",
            "--train.compile=false"]
    traced = {(mask, layers): trace(parse_args(tiny + [f"--data.mask={mask}", f"--model.n_layers={layers}"]))
              for mask in ("causal", "document") for layers in (1, 2)}
    m, t = parse_args(tiny).model, parse_args(tiny).train
    square = 2 * 2 * t.batch_size * m.n_heads * t.seq_len ** 2 * (m.d_model // m.n_heads)   # QK^T and PV
    for (mask, layers), tr in traced.items():
        flops = sum(f for cls, f, *_ in tr["ops"] if cls == "attention")     # forward 1, flash backward 2.5
        assert flops == pytest.approx(layers * 3.5 * square / (2 if mask == "causal" else 1), rel=1e-12)
    # the additive mask [B, 1, T, T] (fp32 here) lives through the step's backward, saved by every layer's SDPA: the
    # peak holds it once, whatever the depth (a boolean mask would be converted, and saved, once per layer)
    for layers in (1, 2):
        grown = traced["document", layers]["peak_bytes"] - traced["causal", layers]["peak_bytes"]
        assert grown == t.batch_size * t.seq_len ** 2 * 4

def test_the_separator_a_tokenizer_setting_names_is_the_one_its_tokenizer_has():
    from nanomega.data.tokenizer import separator_id, separator_of, train_bpe
    trained = train_bpe(["hello world " * 50, "foo bar baz " * 30], 300)      # what "train:<vocab>" builds
    assert separator_of("train:300") == separator_id(trained) == trained.eos_id
    assert separator_of("bytes") == separator_id(ByteTokenizer()) == 0
