"""Activation recomputation changes no number: with any policy, on any block, the loss and every gradient
are bitwise those of the run that keeps its activations (eager, and compiled against compiled), for the
dense, MoE and latent-attention families. Memory is checked where it is measured (tests/test_estimate.py
and bench/memory.py); here, that a recomputed block really runs its forward again in its backward."""
from __future__ import annotations

import pytest
import torch

import parity
from nanomega.models import recompute
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.models import transformer
from nanomega.models.transformer import loss_and_stats
from nanomega.train.step import make_runner
from nanomega.tree import tree_leaves
from tiers import slow

FAMILIES = {
    "dense": [],
    "moe": ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32", "--model.shared_ffn_dim=32",
            "--model.aux_loss_coef=0.01"],
    "mla": ["--model.attention=mla", "--model.q_lora_rank=16", "--model.kv_lora_rank=16", "--model.qk_nope_dim=8",
            "--model.qk_rope_dim=4", "--model.v_head_dim=8", "--model.n_kv_heads=4"],
}


def loss_and_grads(cfg, params, mode, every=1, compile=False):
    run = make_runner(mode, every)

    def loss(p, x, y):
        return loss_and_stats(p, x, y, cfg.model, run)[0]
    fn = torch.compile(loss) if compile else loss
    x, y = parity.batches(cfg, 0)[0]
    value = fn(params, x, y)
    grads = torch.autograd.grad(value, tree_leaves(params), allow_unused=True)
    return value, grads


def assert_bitwise(got, want):
    assert torch.equal(got[0], want[0]), (got[0].item(), want[0].item())
    for a, b in zip(got[1], want[1]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode, every", [("full", 1), ("selective", 1), ("full", 2)])
def test_recomputation_is_bitwise_the_run_that_keeps_activations(family, mode, every):
    cfg = parse_args(parity.BASE + FAMILIES[family])
    params = init(cfg.model, 0)
    assert_bitwise(loss_and_grads(cfg, params, mode, every), loss_and_grads(cfg, params, "none"))


@slow
def test_compiled_recomputation_is_bitwise_the_compiled_run_without_it():
    cfg = parse_args(parity.BASE)
    params = init(cfg.model, 0)
    torch._dynamo.reset()
    want = loss_and_grads(cfg, params, "none", compile=True)
    assert_bitwise(loss_and_grads(cfg, params, "selective", compile=True), want)


@pytest.mark.parametrize("mode, every, recomputed", [("full", 1, [0, 1]), ("full", 2, [0]), ("selective", 1, [0, 1]),
                                                     ("none", 1, [])])
def test_a_recomputed_block_runs_its_forward_again_in_the_backward(monkeypatch, mode, every, recomputed):
    cfg = parse_args(parity.BASE)
    params = init(cfg.model, 0)
    calls, block = [], transformer.block

    def counting_block(layer, *args):
        weight = layer["attn_norm"]["weight"]    # the leaf itself: float32 casts to float32 are no copies
        calls.append(next(i for i, p in enumerate(params["layers"]) if p["attn_norm"]["weight"] is weight))
        return block(layer, *args)
    monkeypatch.setattr(transformer, "block", counting_block)
    value, _ = loss_and_grads(cfg, params, mode, every)
    assert calls == [0, 1] + sorted(recomputed, reverse=True)   # the backward visits blocks last to first


def test_which_blocks_are_recomputed():
    assert [recompute.recomputes(f"layers.{i}", "full", 3) for i in range(7)] == [1, 0, 0, 1, 0, 0, 1]
    assert not recompute.recomputes("", "full", 1)         # the embedding and the head
    assert not recompute.recomputes("layers.0", "none", 1)


def test_selective_policy_saves_matmuls_and_attention_and_recomputes_the_rest():
    aten = torch.ops.aten
    policy = recompute._policy
    save, again = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE, torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.mm.default) == save
    assert policy(None, aten._scaled_dot_product_flash_attention_for_cpu.default) == save
    for op in (aten.mul.Tensor, aten.silu.default, aten._fused_rms_norm.default, aten._to_copy.default,
               torch.ops._c10d_functional.all_gather_into_tensor.default):
        assert policy(None, op) == again, op
