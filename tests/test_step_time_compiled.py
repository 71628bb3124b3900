"""The step-time model's compiled step (nanomega/sim/step_time.py: fused_kernels, "Compiled" in its module doc),
against kernels worked out by hand and the eager step of the same trace.

- A chain of pointwise ops between two matmuls is one kernel: one read of its input, one write of its output;
  its intermediates move nothing. A tensor it writes that a later op reads is written; a side input is read.
- A norm (a row reduction) fuses with its neighbours' pointwise ops, not into the matmul; a collective's launch
  or wait splits a chain; the optimizer's update is not fused.
- On a real trace the compiled step is faster than the eager one and slower than its unfusible ops alone.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                                       # noqa: E402
from nanomega.sim.devices import Efficiency, device                          # noqa: E402
from nanomega.sim.step_time import fused_kernels, op_seconds, time_step, trace   # noqa: E402

N = 1 << 20
H100 = device("h100")


def _op(cls, reads, writes, fusible=None, phase="forward_backward", backward=False, flops=0.0):
    moved = sum(size for _, size in reads + writes)
    fusible = cls == "pointwise" if fusible is None else fusible
    return (cls, flops, moved, backward, frozenset(), False, phase, (), False, fusible, (tuple(reads), tuple(writes)))


def _chain():
    """x (1) = matmul; a (2) = silu(x); b (3) = a * g (g: 4, a side input); y (5) = b + 1; matmul reads y."""
    return [_op("matmul", [(0, N)], [(1, N)], flops=1e9),
            _op("pointwise", [(1, N)], [(2, N)]),
            _op("pointwise", [(2, N), (4, N)], [(3, N)]),
            _op("pointwise", [(3, N)], [(5, N)]),
            _op("matmul", [(5, N)], [(6, N)], flops=1e9)]


def test_a_pointwise_chain_is_one_kernel_with_one_read_and_one_write():
    assert fused_kernels(_chain(), set()) == {1: (4, 3 * N)}      # reads x and g, writes y; a and b stay inside


def test_a_tensor_read_after_the_kernel_is_written_by_it():
    ops = _chain() + [_op("pointwise", [(3, N)], [(7, N)], backward=True)]   # b saved for the backward
    assert fused_kernels(ops, set())[1] == (4, 4 * N)
    assert fused_kernels(ops, set())[5] == (6, 2 * N)              # the backward's op: its own kernel


def test_a_norm_fuses_with_its_pointwise_neighbours_not_into_the_matmul():
    """h (2) = x + r (residual); s (3) = mean(h^2) over rows (a reduction: d times smaller); y (4) = h * s; a
    matmul reads y and the residual stream goes on with h: reads x, r; writes h and y."""
    d = 1024
    ops = [_op("matmul", [(0, N)], [(1, N)], flops=1e9),
           _op("pointwise", [(1, N), (9, N)], [(2, N)]),
           _op("other", [(2, N)], [(3, N // d)], fusible=True),
           _op("pointwise", [(2, N), (3, N // d)], [(4, N)]),
           _op("matmul", [(4, N)], [(5, N)], flops=1e9),
           _op("pointwise", [(2, N), (5, N)], [(6, N)])]
    kernels = fused_kernels(ops, set())
    assert kernels[1] == (4, 4 * N)
    assert 0 not in kernels and 4 not in kernels                   # the matmuls stay their own kernels


def test_a_collective_splits_a_chain_and_the_update_is_not_fused():
    ops = _chain()
    assert fused_kernels(ops, {2}) == {1: (2, 2 * N), 2: (4, 3 * N)}   # a launch before op 2: two kernels
    update = [_op("pointwise", [(1, N)], [(2, N)], phase="update"), _op("pointwise", [(2, N)], [(3, N)],
                                                                          phase="update")]
    assert fused_kernels(update, set()) == {}


def test_the_compiled_chain_is_timed_as_its_kernel():
    eff = Efficiency()
    tr = {"ops": _chain(), "schedule": []}
    matmuls = 2 * op_seconds("matmul", 1e9, 2 * N, H100, eff)
    kernel = 3 * N / (H100.hbm_bandwidth * eff.hbm) + eff.kernel_s
    assert time_step(tr, H100, eff, compiled=True)["step_s"] == pytest.approx(matmuls + kernel)
    eager = sum(op_seconds(op[0], op[1], op[2], H100, eff) for op in _chain())
    assert time_step(tr, H100, eff)["step_s"] == pytest.approx(eager)


def test_a_compiled_step_lies_between_its_unfused_ops_and_the_eager_step():
    tiny = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
            "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
            "--train.batch_size=4", "--train.seq_len=64", "--train.compile=false"]
    tr = trace(parse_args(tiny))
    eff = Efficiency()
    eager = time_step(tr, H100, eff)["step_s"]
    compiled = time_step(tr, H100, eff, compiled=True)["step_s"]
    kernels = fused_kernels(tr["ops"], set())
    inside = {k for start, (end, _) in kernels.items() for k in range(start, end)}
    unfused = sum(op_seconds(op[0], op[1], op[2], H100, eff, fp32=op[5]) for i, op in enumerate(tr["ops"])
                  if i not in inside)
    assert unfused < compiled < eager
    assert len(kernels) < sum(1 for op in tr["ops"] if op[9])      # fewer kernels than fusible ops
