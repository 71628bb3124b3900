"""Context parallel (nanomega.parallel.context) against the serial computation.

- The load-balanced layout: every position held once, the same causal work on every rank, a clear error
  when the sequence does not split into 2 * cp chunks.
- On a mesh: the batch's load-balanced order cut in contiguous chunks gives each rank its shard; the
  model's hints are the serial maths on plain tensors; what cp does not support is refused.
- Attention on real ranks: one torchrun launch of 4 processes (gloo; tests/context_worker.py) runs
  both methods for every case, each block by the CPU's fused flash kernel and by the plain matmul-and-exp
  fallback, with cp=4 over the world and cp=2 on the sub-groups of a 2x2 mesh;
  outputs and gradients of q, k, v, unsharded, must equal causal SDPA on the whole sequence here,
  in float64 (to 1e-12), float32 (to 1e-5) and bfloat16 (to 3e-2: the output's own rounding), with
  GQA, one kv head, and value heads narrower or wider than the query/key heads (MLA).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from context_worker import CASES, METHODS
from ranks import crash_report, torchrun
from nanomega.hints import causal_attention, linear, sequence_order
from nanomega.parallel.context import _blocks, attention, load_balanced_order, shard_indices

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("cp4", "cp2mesh")
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}   # relative to the largest value


# ------------------------------------------------------------------ the layout

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_position_is_held_by_exactly_one_rank(cp):
    held = torch.cat([shard_indices(24, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(24))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_every_rank_has_the_same_causal_work(cp):
    """A query at position p attends p + 1 keys; every rank's sum of those is the same."""
    work = {int((shard_indices(48, cp, r) + 1).sum()) for r in range(cp)}
    assert len(work) == 1


def test_rank_r_holds_chunks_r_and_its_mirror():
    assert shard_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match=r"train.seq_len=12 is not divisible by 2 \* parallel.cp = 8; "
                                         r"use a multiple of 8"):
        shard_indices(12, 4, 0)
    with pytest.raises(ValueError, match="rank=2 is not a rank of parallel.cp=2"):
        shard_indices(16, 2, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ring_computes_each_visible_pair_once_and_skips_hidden_blocks(cp):
    """Over the cp chunks a rank sees, its blocks cover exactly the causally visible (query, key)
    pairs, no block is entirely hidden, every block is whole or the fused kernels' causal square (no mask is
    made: the plan lives through the backward), and every rank computes 2*cp + 1 chunk-by-chunk blocks: the
    serial causal work, cp*(2*cp + 1) such blocks, split evenly."""
    T = 32
    c = T // (2 * cp)
    for r in range(cp):
        q_pos = shard_indices(T, cp, r)
        n_blocks, pairs = 0, 0
        for j in range(cp):
            k_pos = shard_indices(T, cp, j)
            covered = torch.zeros(len(q_pos), len(k_pos), dtype=torch.int64)
            for qs, ks, causal, visible, documents in _blocks(q_pos, k_pos):
                assert documents is None    # (without documents' bounds no block is masked by them)
                block = torch.ones(qs.stop - qs.start, ks.stop - ks.start, dtype=torch.bool)
                block = block.tril() if causal else block if visible is None else visible
                assert visible is None      # the layout's blocks are all the fused kernels' (no mask)
                assert block.any()
                covered[qs, ks] += block
                n_blocks, pairs = n_blocks + 1, pairs + block.numel()
            assert torch.equal(covered, (q_pos[:, None] >= k_pos[None, :]).long())
        assert n_blocks == 2 * cp + 1 and pairs == (2 * cp + 1) * c * c


@pytest.mark.parametrize("method", METHODS)
def test_positions_in_any_order_give_causal_attention_by_position(method):
    """Positions the layout never gives (shuffled) make blocks neither whole nor causal squares: those run by the
    plain kernel with their mask, the rest fused; the result is causal attention by position. One process."""
    import torch.distributed as dist
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(3))
        positions = torch.randperm(16, generator=gen)
        assert any(visible is not None for _, _, _, visible, _ in _blocks(positions, positions))
        out = attention(q, k, v, positions[None], method=method)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    finally:
        dist.destroy_process_group()
    mask = positions[:, None] >= positions[None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want_grads = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_unknown_method_and_bad_shapes_are_refused():
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="'flash' is not one of"):
        attention(q, q, q, torch.arange(8)[None], method="flash")
    with pytest.raises(ValueError, match="Hkv dividing H"):
        attention(q, k, v, torch.arange(8)[None])
    with pytest.raises(ValueError, match=r"positions must be \[cp, 8\]"):
        attention(q, q, q, torch.arange(4)[None])


# ------------------------------------------------------------------ on a mesh: the batch order and the rules

@pytest.mark.parametrize("cp", [1, 2, 4])
def test_contiguous_chunks_of_the_load_balanced_order_are_the_ranks_shards(cp):
    """parallelize places the batch permuted by load_balanced_order and cut into cp contiguous chunks
    (DTensor's Shard(1)): chunk r must be rank r's shard."""
    x = torch.randn(2, 32, 3)
    placed = x.index_select(1, load_balanced_order(32, cp))
    chunks = placed.chunk(cp, dim=1)
    for r in range(cp):
        assert torch.equal(chunks[r], x.index_select(1, shard_indices(32, cp, r)))


def test_the_hints_are_the_serial_maths_on_plain_tensors():
    """Without a mesh sequence_order is the identity, causal_attention is causal SDPA and linear F.linear, bit for
    bit."""
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 6)
    table = torch.randn(16, 4)
    assert sequence_order(table, torch.zeros(2, 16, dtype=torch.long)) is table
    assert torch.equal(causal_attention(q, k, v, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert torch.equal(causal_attention(q[:, :2], k, v, scale=0.3),
                       F.scaled_dot_product_attention(q[:, :2], k, v, is_causal=True, scale=0.3))
    x, w, b = torch.randn(2, 16, 8), torch.randn(6, 8), torch.randn(6)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("args,message", [
    (["--parallel.cp=2", "--parallel.ep=4", "--model.n_experts=4"],     # experts fold onto dp x cp ranks only
     r"parallel.ep=4 must divide the 2 ranks that hold different tokens \(dp_replicate \* dp_shard \* cp;"),
    (["--parallel.cp=2", "--model.n_experts=4", "--model.capacity_factor=1.0"],
     r"token dropping decides per sequence .* context parallel"),
])
def test_what_context_parallel_does_not_support_is_refused_before_any_work(args, message):
    from nanomega.config import parse_args
    from nanomega.parallel.mesh import validate_layout
    with pytest.raises(ValueError, match=message):
        validate_layout(parse_args(args))


# ------------------------------------------------------------------ the block kernels, simulated as a GPU runs them

def simulated_attention(method, kernels, dtype, dqk=128, dv=128, cp=2, tl=32768, documents=False):
    """One rank of cp (torch's fake process group, fake tensors: nothing allocated) runs `attention` forward and
    backward with `kernels_of(kernels)`, B 1, 8 query heads, 2 kv heads, tl tokens a rank, with packed documents
    (fake: no values) if asked; -> (tracker's peak in bytes, a Counter of the names of the ops run)."""
    import collections
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nanomega.parallel.context import documents_of, kernels_of
    from nanomega.sim.fake_world import fake_world
    from nanomega.sim.memory_tracker import MemoryTracker
    ops = collections.Counter()

    class Ops(MemoryTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.__name__.split(".")[0]] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    positions = load_balanced_order(cp * tl, cp).view(cp, -1)
    with fake_world(cp, 0), FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 8, tl, dqk, dtype=dtype, requires_grad=True)
        k = torch.empty(1, 2, tl, dqk, dtype=dtype, requires_grad=True)
        v = torch.empty(1, 2, tl, dv, dtype=dtype, requires_grad=True)
        grad_out = torch.empty(1, 8, tl, dv, dtype=dtype)
        packed = documents_of(torch.zeros(1, cp * tl, dtype=torch.bool)) if documents else None
        tracker = Ops()
        with tracker, kernels_of(kernels):
            torch.autograd.grad(attention(q, k, v, positions, method=method, documents=packed), (q, k, v), grad_out)
    return tracker.result()["peak_bytes"], ops


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype,dqk,dv,kernel", [
    (torch.bfloat16, 128, 128, "_scaled_dot_product_flash_attention"),        # llama
    (torch.bfloat16, 192, 128, "_scaled_dot_product_flash_attention"),        # MLA: v padded to 192
    (torch.float32, 128, 128, "_scaled_dot_product_efficient_attention"),     # no flash in fp32
    (torch.bfloat16, 320, 320, "_scaled_dot_product_efficient_attention"),    # heads over flash's 256
])
def test_on_a_gpu_each_block_is_a_fused_kernel_holding_no_scores(method, dtype, dqk, dv, kernel):
    """Simulated as a GPU runs it, every block is a fused kernel, forward and backward, and the peak grows as T
    (twice the tokens, at most 2.2 times the peak), not as a block's scores (T^2)."""
    peak, ops = simulated_attention(method, "cuda", dtype, dqk, dv)
    assert {kernel, kernel + "_backward"} <= ops.keys() and not {"bmm", "logsumexp"} & ops.keys(), sorted(ops)
    assert simulated_attention(method, "cuda", dtype, dqk, dv, tl=2 * 32768)[0] <= 2.2 * peak


@pytest.mark.parametrize("method", METHODS)
def test_the_plain_block_kernel_holds_the_scores(method):
    """What the bound above tells apart: the plain kernel (matmul and exp) holds whole blocks' scores, so twice
    the tokens take more than 3 times the peak."""
    peak, ops = simulated_attention(method, "plain", torch.bfloat16)
    assert "bmm" in ops and simulated_attention(method, "plain", torch.bfloat16, tl=2 * 32768)[0] > 3 * peak


# ------------------------------------------------------------------ attention on real ranks

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One torchrun launch of 4 processes runs every layout, case and method; {name: result}."""
    out = tmp_path_factory.mktemp("context")
    proc = torchrun(4, ROOT / "tests" / "context_worker.py", out, timeout=300)
    assert proc.returncode == 0, crash_report(proc.stderr)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


def serial_attention(got: dict, case: str) -> dict:
    """Causal SDPA on the whole sequence in float64, and its gradients for the same upstream gradient."""
    q, k, v = (got[n].double().requires_grad_() for n in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=CASES[case][6],
                                         enable_gqa=q.shape[1] != k.shape[1])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), got["grad_out"].double())
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_attention_and_its_gradients_equal_serial_causal_attention(results, layout, case, method):
    """Each block by the CPU's fused flash kernel (what a CPU run takes), merged by the log-sum-exp."""
    assert_equals_serial(results[f"{layout}-{case}-{method}-device"], case)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plain_block_fallback_equals_serial_causal_attention(results, layout, case, method):
    """Each block by matmul and exp (float64 on a GPU, devices without a fused kernel)."""
    assert_equals_serial(results[f"{layout}-{case}-{method}-plain"], case)


def assert_equals_serial(got: dict, case: str):
    assert "error" not in got, got.get("error")
    dtype = CASES[case][7]
    tol = TOLERANCE[dtype]
    for name, want in serial_attention(got, case).items():
        assert got[name].dtype == dtype and got[name].shape == want.shape, name
        err = (got[name].double() - want).abs().max().item()
        assert err <= tol * max(1.0, want.abs().max().item()), f"{name}: max error {err:.2e}"


# ------------------------------------------------------------------ one sequence per data-parallel rank

@pytest.mark.slow     # 8 processes (~1-2 min on 2 cores)
def test_fsdp2_cp4_with_one_sequence_per_data_parallel_rank_trains_like_the_serial_run(tmp_path):
    """torchtitan's long-context layout, FSDP 2 x CP 4 with one sequence per data-parallel rank: a batch of 2 that
    cp=4 does not divide, which torch 2.13's DTensor could not reshape in a linear layer (context.linear_on_mesh).
    Against the serial run of the same batch, SGD (its step is linear in the gradient): losses and gradient norms
    within 1e-5 relative at every step, final parameters within 1e-5; both attention methods."""
    import json
    import parity
    serial_args = ["--optim.name=sgd", "--train.batch_size=2"]
    cases = [{"name": method, "kind": "train",
              "args": serial_args + ["--parallel.dp_shard=2", "--parallel.cp=4", f"--parallel.cp_method={method}"]}
             for method in METHODS]
    proc = torchrun(8, ROOT / "tests" / "parity.py", tmp_path, json.dumps(cases), timeout=900)
    assert proc.returncode == 0, crash_report(proc.stderr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # as the workers run
    try:
        want = parity.run(serial_args)
    finally:
        torch.set_num_threads(threads)
    for method in METHODS:
        got = torch.load(tmp_path / f"{method}.pt")
        assert "error" not in got, got.get("error")
        for key in ("losses", "grad_norms"):
            for a, b in zip(got[key], want[key], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (method, key, a, b)
        for name, p in want["params"].items():
            assert (got["params"][name] - p).norm() <= 1e-5 * max(p.norm().item(), 1e-3 * p.numel() ** 0.5), name
