"""The step-time model's mixture-of-experts terms (nanomega/sim/step_time.py) against references that do not use it.

- A grouped GEMM is charged 2 M K N FLOPs at the grouped efficiency, by hand.
- An all-to-all across nodes sends its off-node slices over the network while the others go over NVLink, by hand.
- The overlap term: an all-to-all waited at once is exposed whole; named in `hidden`, only what the compute
  cannot cover is.
- Composition: a model whose first blocks are dense, timed from one- and two-block simulations, gives the same
  step, FLOPs and peak as simulating every block; the peak of many micro-batches is the peak of two.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                                  # noqa: E402
from nanomega.sim.devices import Efficiency, device                      # noqa: E402
from nanomega.sim.step_time import (collective_seconds, off_node_share, op_cost, op_seconds, predict,  # noqa: E402
                                    time_step)

H100 = device("h100")
MOE = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_heads=4",
       "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64", "--model.n_experts=4",
       "--model.top_k=2", "--model.expert_ffn_dim=96", "--train.batch_size=2", "--train.seq_len=64",
       "--train.compile=false", "--train.activation_checkpointing=none"]


def test_a_grouped_gemm_is_charged_its_flops_at_the_grouped_efficiency():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a = torch.empty(600, 256, dtype=torch.bfloat16)            # 600 rows over 4 experts
        b = torch.empty(4, 256, 384, dtype=torch.bfloat16)
        offs = torch.tensor([150, 300, 450, 600], dtype=torch.int32)
        out = torch._grouped_mm(a, b, offs=offs)
        cls, flops, _ = op_cost(torch.ops.aten._grouped_mm.default, (a, b), {"offs": offs}, out)
    assert (cls, flops) == ("grouped", 2 * 600 * 256 * 384)
    eff = Efficiency()
    assert eff.grouped_matmul == 0.55                                # fixed before the comparison (devices.py)
    big = 2 * 600 * 256 * 384 * 1e6                                  # compute-bound: the rate decides
    assert op_seconds("grouped", big, 0, H100, eff) == pytest.approx(big / (989e12 * 0.55) + 4e-6)
    assert op_seconds("grouped", big, 0, H100, eff, fp8=True) == pytest.approx(big / (1979e12 * 0.55) + 4e-6)


def test_an_all_to_all_across_nodes_sends_its_off_node_slices_over_the_network():
    eff, sent = Efficiency(), 2e9
    # 64 ranks over 8 nodes: 56 of a rank's 63 peers are in other nodes
    assert off_node_share(list(range(64))) == pytest.approx(56 / 63)
    across = collective_seconds(sent, list(range(64)), H100, eff, "all_to_all")
    assert across == pytest.approx(max(sent * 56 / 63 / 50e9, sent * 7 / 63 / 450e9) / 0.80 + 20e-6)
    # one node: every slice over NVLink; a ring collective across nodes: all of it over the network
    assert collective_seconds(sent, list(range(8)), H100, eff, "all_to_all") == pytest.approx(
        sent / (450e9 * 0.80) + 20e-6)
    assert collective_seconds(sent, list(range(64)), H100, eff, "all_gather") == pytest.approx(
        sent / (50e9 * 0.80) + 20e-6)


def _exchange(n_ops: int = 6) -> dict:
    """Matmuls with one all-to-all launched before the first and waited by the second (as dispatch is)."""
    ops = [("matmul", 1e12, 0, False, frozenset())] * n_ops
    sched = [{"kind": "all_to_all", "launched": 0, "waited": 0, "bytes_sent": 2e9, "ranks": list(range(16))}]
    return {"ops": ops, "schedule": sched}


def test_an_all_to_all_waited_at_once_is_exposed_unless_named_hidden():
    eff = Efficiency()
    comm = collective_seconds(2e9, list(range(16)), H100, eff, "all_to_all")
    op = op_seconds("matmul", 1e12, 0, H100, eff)
    as_coded = time_step(_exchange(), H100, eff)
    assert as_coded["exposed_s"]["all_to_all"] == pytest.approx(comm)
    assert as_coded["step_s"] == pytest.approx(6 * op + comm)
    hidden = time_step(_exchange(), H100, eff, hidden=frozenset({"all_to_all"}))
    assert hidden["exposed_s"].get("all_to_all", 0.0) == pytest.approx(max(0.0, comm - 6 * op))
    assert hidden["step_s"] == pytest.approx(max(6 * op, comm))


def test_leading_dense_blocks_are_composed_from_two_block_simulations():
    """4 blocks, the first 2 dense (DeepSeek-V3's shape in small): predict(layers=(1, 2)) simulates one and two MoE
    blocks and a dense one before a MoE one; its step, FLOPs and peak equal the 4-block simulation's."""
    cfg = parse_args(MOE + ["--model.n_layers=4", "--model.first_dense_layers=2"])
    whole = predict(cfg, "h100")
    composed = predict(cfg, "h100", layers=(1, 2))
    assert composed["compute_s"] == pytest.approx(whole["compute_s"], rel=1e-6)
    assert composed["step_s"] == pytest.approx(whole["step_s"], rel=1e-6)
    assert composed["peak_bytes"] == pytest.approx(whole["peak_bytes"], rel=0.02)


@pytest.mark.slow
def test_the_peak_of_many_micro_batches_is_the_peak_of_three():
    """The peak stops growing once a micro-batch runs beside the previous one's accumulated gradients and the next
    one's prefetched parameters: three micro-batches reach it (linear growth from two would not stop)."""
    cfg = parse_args(MOE + ["--model.n_layers=2", "--train.grad_accum=6"])
    whole = predict(cfg, "h100")
    composed = predict(cfg, "h100", micro=(2, 3))
    assert composed["peak_bytes"] == pytest.approx(whole["peak_bytes"], rel=1e-3)
    assert composed["step_s"] == pytest.approx(whole["step_s"], rel=1e-6)
