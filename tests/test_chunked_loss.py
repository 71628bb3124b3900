"""The head's loss in chunks (nanomega/models/loss.py) is today's whole-logits loss: value and gradients against
float64 maths and against model.loss_chunk=0, serially, in bf16, for tied and MoE models, and split over the
vocabulary as tensor parallel splits it (two ranks played by two threads, their reductions exchanged)."""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F

from nanomega.config import Config, ModelConfig, TrainConfig
from nanomega.models import transformer
from nanomega.models.loss import linear_cross_entropy
from nanomega.tree import tree_flatten
from tiers import slow

VOCAB, PADDED, D = 37, 48, 16     # 11 padding columns


def _problem(n=23, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g, dtype=dtype)
    w = torch.randn(PADDED, D, generator=g, dtype=dtype) * 0.5
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    return x, w, targets


def _float64_loss(x, w, targets):
    """The sum of cross-entropies in float64, padding columns sliced off (never targets, no probability)."""
    logits = x.double() @ w.double()[:VOCAB].t()
    return F.cross_entropy(logits, targets, reduction="sum")


def _grads(loss_fn, x, w):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = loss_fn(x, w)
    return (loss, *torch.autograd.grad(loss, [x, w]))


@pytest.mark.parametrize("chunk", [1, 5, 23, 100])
def test_chunked_loss_and_gradients_equal_float64_maths(chunk):
    x, w, targets = _problem()
    want = _grads(lambda x, w: _float64_loss(x, w, targets), x.double(), w.double())
    got = _grads(lambda x, w: linear_cross_entropy(x, w, targets, VOCAB, chunk), x, w)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)
    assert got[2][VOCAB:].abs().max() == 0     # padding rows of the head get no gradient


def _model(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, vocab_multiple=16, d_model=D, n_layers=2, n_heads=2, max_seq_len=16,
                       **kw)


def _loss_and_grads(cfg, tokens, targets):
    params = transformer.init(cfg, seed=1)
    leaves, _ = tree_flatten(params)
    for leaf in leaves:
        leaf.requires_grad_(True)
    loss = transformer.loss_fn(params, tokens, targets, cfg)
    return loss, torch.autograd.grad(loss, leaves, allow_unused=True)


@pytest.mark.parametrize("model", [{}, {"tie_embeddings": True},
                                   {"n_experts": 4, "top_k": 2, "aux_loss_coef": 0.01, "z_loss_coef": 0.001}],
                         ids=["untied", "tied", "moe_router_losses"])
def test_chunked_objective_equals_the_whole_logits_objective(model):
    g = torch.Generator().manual_seed(2)
    tokens, targets = (torch.randint(0, VOCAB, (3, 9), generator=g) for _ in range(2))
    cfg = _model(**model)
    want = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=0), tokens, targets)
    got = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=4), tokens, targets)   # 27 tokens: 7 chunks
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for a, b in zip(got[1], want[1]):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_chunked_objective_under_bf16_autocast_is_the_whole_logits_one_within_bf16_rounding():
    g = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, VOCAB, (2, 12), generator=g) for _ in range(2))
    cfg = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=0), tokens, targets)
        got = _loss_and_grads(dataclasses.replace(cfg, loss_chunk=5), tokens, targets)
    assert got[0].dtype == torch.float32                    # the loss in fp32, as the whole-logits one
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=0)
    for a, b in zip(got[1], want[1]):    # bf16 matmuls; the head's gradient summed over chunks in bf16
        scale = b.abs().max().clamp_min(1e-12)
        assert (a - b).abs().max() / scale < 2e-2


def test_vocab_split_over_two_ranks_gives_the_whole_vocabulary_loss_and_gradients():
    """Each "rank" holds half the head's rows; the per-token max, sum and target logit are exchanged between
    them (what tensor parallel's all-reduces do); x's gradient is the sum of the ranks' partial sums."""
    x, w, targets = _problem(n=19, seed=4)
    ranks, rows = 2, PADDED // 2
    barrier, board = threading.Barrier(ranks), {}
    results = [None] * ranks

    def reduce_for(rank):
        calls = iter(range(10 ** 6))

        def reduce(t, op):
            key = next(calls)
            board[key, rank] = t.clone()
            barrier.wait()
            parts = [board[key, r] for r in range(ranks)]
            barrier.wait()
            return torch.stack(parts).amax(0) if op == "max" else torch.stack(parts).sum(0)
        return reduce

    def rank_run(rank):
        shard = w[rank * rows:(rank + 1) * rows]
        results[rank] = _grads(lambda x, s: linear_cross_entropy(x, s, targets, VOCAB, 4, vocab_start=rank * rows,
                                                                 reduce=reduce_for(rank)), x, shard)

    threads = [threading.Thread(target=rank_run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = _grads(lambda x, w: _float64_loss(x, w, targets), x.double(), w.double())
    for rank in range(ranks):
        torch.testing.assert_close(results[rank][0].double(), want[0], rtol=1e-6, atol=0)   # the same loss on each
    grad_x = sum(r[1] for r in results)
    grad_w = torch.cat([r[2] for r in results])
    torch.testing.assert_close(grad_x.double(), want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_w.double(), want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [-1, 2.5])
def test_a_bad_loss_chunk_is_refused_with_what_to_set(value):
    with pytest.raises(ValueError, match=r"model.loss_chunk=.* must be a whole number of tokens >= 0"):
        Config(model=_model(loss_chunk=value), train=TrainConfig(seq_len=8, batch_size=2)).validate()


# On a mesh, several chunks per rank (tests/parity.py's 4 x 16 tokens per micro-batch): each layout's run with
# model.loss_chunk small against the serial run with the whole logits (loss_chunk=0), as tests/test_parallel.py
# compares layouts. tp splits the vocabulary (251, padded for tp), sp and cp the sequence, FSDP the batch, pp the
# blocks (the last stage's head runs with the loss).
MESH_CASES = {
    "fsdp2_tp2_sp_chunk5": ["--parallel.dp_shard=2", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                            "--model.loss_chunk=5"],
    "cp2_tp2_chunk3": ["--parallel.cp=2", "--parallel.tp=2", "--model.loss_chunk=3"],
    "pp2_fsdp2_chunk7": ["--parallel.pp=2", "--parallel.dp_shard=2", "--model.loss_chunk=7"],
}


def parity_cases(item) -> list:
    """MESH_CASES (4 processes each), for tests/conftest.py's parity_launch: the session's one 4-process launch."""
    return [(4, "train", args) for args in MESH_CASES.values()]


@slow
def test_chunked_loss_on_a_mesh_trains_like_the_serial_whole_logits_run(parity_launch):
    import parity
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # as the ranks run (matmul results can depend on the thread count)
    try:
        want = parity.run(["--model.loss_chunk=0"])
    finally:
        torch.set_num_threads(threads)
    for name, args in MESH_CASES.items():
        got = parity_launch["train", tuple(args)]
        assert "error" not in got, got.get("error")
        for key in ("losses", "grad_norms"):
            for step, (a, b) in enumerate(zip(got[key], want[key])):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {key} {a} vs serial {b}"
        for leaf, p in want["params"].items():
            error = ((got["params"][leaf] - p).norm() / max(p.norm().item(), 1e-3 * p.numel() ** 0.5)).item()
            assert error <= 1e-5, f"{name}: {leaf} {error:.2e} from the serial run"
