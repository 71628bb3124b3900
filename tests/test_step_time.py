"""The step-time model (nanomega/sim/step_time.py) against references that do not use it.

- FLOPs: a traced step's matmul and attention FLOPs equal the analytic count, 6 x the matmul parameters x the
  tokens plus causal attention's (forward 2 matmuls, the flash backward 2.5 times the forward, half the square).
- A collective's time is its bytes over the link by hand, NVLink inside a node and the network across nodes.
- Exposure: a collective waited at once adds all of its time to the step; one launched a unit ahead is hidden up
  to the compute in between; in a real FSDP trace the first gather (nothing to prefetch behind) is exposed whole
  and the prefetched ones less.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                           # noqa: E402
from nanomega.sim.devices import DEVICES, Efficiency, device         # noqa: E402
from nanomega.sim.step_time import collective_seconds, op_seconds, time_step, trace   # noqa: E402
from tiers import slow, tiered                                   # noqa: E402

TINY = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
        "--train.batch_size=2", "--train.seq_len=64", "--train.compile=false"]
H100 = device("h100")


def test_step_flops_are_six_n_tokens_plus_causal_attention():
    cfg = parse_args(TINY)
    m, t = cfg.model, cfg.train
    tr = trace(cfg)
    traced = sum(flops for cls, flops, *_ in tr["ops"] if cls in ("matmul", "attention"))
    d, h, kv, dh, f, L = m.d_model, m.n_heads, m.n_kv_heads, m.d_model // m.n_heads, m.ffn_dim, m.n_layers
    matmul_params = L * (d * h * dh + 2 * d * kv * dh + h * dh * d + 3 * d * f) + d * m.vocab_size   # blocks + head
    tokens = t.batch_size * t.seq_len
    square = 2 * 2 * t.batch_size * h * t.seq_len ** 2 * dh          # QK^T and PV, one layer's forward, unmasked
    attention = L * (1 + 2.5) * square / 2                            # flash backward: 2.5x; causal: half
    assert traced == pytest.approx(6 * matmul_params * tokens + attention, rel=1e-12)


def test_a_collective_takes_its_bytes_over_the_link():
    eff = Efficiency()
    sent = 3e9
    inside = collective_seconds(sent, list(range(8)), H100, eff)
    across = collective_seconds(sent, [0, 8], H100, eff)
    assert inside == pytest.approx(sent / (450e9 * 0.80) + 20e-6)     # NVLink 4: 450 GB/s a direction
    assert across == pytest.approx(sent / (50e9 * 0.80) + 20e-6)      # 400 Gb/s NDR per GPU
    assert collective_seconds(sent, [5], H100, eff) == 0.0            # a group of one sends nothing


def _synthetic(launched: int, waited: int, n_ops: int = 4, flops: float = 1e12) -> dict:
    ops = [("matmul", flops, 0, False, frozenset())] * n_ops
    sched = [{"kind": "all_gather", "launched": launched, "waited": waited, "bytes_sent": 4e9, "ranks": [0, 1]}]
    return {"ops": ops, "schedule": sched}


def test_a_collective_waited_at_once_is_fully_exposed():
    eff = Efficiency()
    comm = collective_seconds(4e9, [0, 1], H100, eff)
    op = op_seconds("matmul", 1e12, 0, H100, eff)
    r = time_step(_synthetic(launched=2, waited=2), H100, eff)
    assert r["exposed_s"]["all_gather"] == pytest.approx(comm)
    assert r["step_s"] == pytest.approx(4 * op + comm)


@pytest.mark.parametrize("ahead", [1, 3])
def test_a_collective_launched_ahead_is_hidden_up_to_the_compute_between(ahead):
    eff = Efficiency()
    comm = collective_seconds(4e9, [0, 1], H100, eff)
    op = op_seconds("matmul", 1e12, 0, H100, eff)
    r = time_step(_synthetic(launched=0, waited=ahead), H100, eff)
    assert r["exposed_s"]["all_gather"] == pytest.approx(max(0.0, comm - ahead * op))
    assert r["step_s"] == pytest.approx(4 * op + max(0.0, comm - ahead * op))


@slow   # 1.6 s alone, 5 s on a loaded 2-core machine: a 2-rank trace in a child process
def test_fsdp_prefetch_hides_gathers_behind_the_unit_before():
    """Tiny FSDP 2 on fake tensors with slow links, so that gathers outlast the compute: the first forward
    gather is exposed whole, each prefetched one (compute between its launch and its wait) less."""
    cfg = parse_args(TINY + ["--parallel.dp_shard=2", "--train.activation_checkpointing=none"])
    tr = trace(cfg)
    slow_net = dataclasses.replace(DEVICES["h100"], network_bandwidth=2e8, nvlink_bandwidth=2e8)
    r = time_step(tr, slow_net, Efficiency())
    forward = [(e, c) for e, c in zip(sorted(tr["schedule"], key=lambda e: e["launched"]), r["collectives"])
               if e["kind"] == "all_gather" and not e["backward"] and e["phase"] == "forward_backward"]
    first, first_timed = forward[0]
    # nothing but a few small ops (casts, views) between its launch and its wait
    assert first["compute"] == 0 and first_timed["exposed_s"] == pytest.approx(first_timed["seconds"], rel=0.05)
    ahead = [c for e, c in forward if e["compute"] > 0]
    assert ahead and all(c["exposed_s"] < c["seconds"] for c in ahead)


def _nvlink_seconds(sent):     # H100 NVLink 4 (450 GB/s a direction) at the bus efficiency 0.80, 20 us start-up
    return sent / (450e9 * 0.80) + 20e-6


# 1.1 s and 1.7 s alone, 6-8 s on a loaded 2-core machine (2-rank traces in a child process): the ring is slow tier
@pytest.mark.parametrize("method", tiered([("all_gather",), ("ring",)], fast={("all_gather",)}))
def test_context_parallel_kv_traffic_is_traced_and_timed(method):
    """cp 2 on the tiny model (fp32): each rank's K|V chunk is [B, Hkv, T/2, 2 dh]. The all-gather method gathers
    it once per block in the forward (sending its own chunk) and reduce-scatters its gradient in the backward;
    the ring passes it once per block in the forward and, in the backward, K|V once and dK|dV twice (the last
    shift brings a chunk's gradient home). Each is timed as its bytes over NVLink (ranks 0 and 1: one node)."""
    cfg = parse_args(TINY + ["--parallel.cp=2", f"--parallel.cp_method={method}",
                             "--train.activation_checkpointing=none"])
    m, t = cfg.model, cfg.train
    chunk = t.batch_size * m.n_kv_heads * (t.seq_len // 2) * 2 * (m.d_model // m.n_heads) * 4
    tr = trace(cfg)
    r = time_step(tr, H100, Efficiency())
    timed = list(zip(sorted(tr["schedule"], key=lambda e: e["launched"]), r["collectives"]))
    if method == "all_gather":
        kv = [(e, c) for e, c in timed if e["kind"] in ("all_gather", "reduce_scatter")]
        expected = {("all_gather", False): m.n_layers, ("reduce_scatter", True): m.n_layers}
    else:
        kv = [(e, c) for e, c in timed if e["kind"] == "send"]
        expected = {("send", False): m.n_layers, ("send", True): 3 * m.n_layers}
        # a shift overlaps the block computed on the chunk in hand: it is waited for ops later
        assert all(e["waited"] > e["launched"] for e, _ in kv if not e["backward"])
    counts = {}
    for e, c in kv:
        counts[e["kind"], e["backward"]] = counts.get((e["kind"], e["backward"]), 0) + 1
        assert e["ranks"] == [0, 1] and e["bytes_sent"] == chunk
        assert c["seconds"] == pytest.approx(_nvlink_seconds(chunk))
    assert counts == expected


@slow   # 1.1 s alone, 7 s on a loaded 2-core machine: a 2-rank trace in a child process
def test_expert_parallel_all_to_alls_are_traced_and_timed():
    """ep 2 x FSDP 2, 4 experts, top-2, balanced routing: each MoE layer's dispatch and combine all-to-alls carry
    a rank's B/2 x T x top_k token copies of d_model fp32, half of them to the other rank, forward and backward;
    each is timed over NVLink, and over the network when the same bytes cross nodes."""
    cfg = parse_args(TINY + ["--parallel.dp_shard=2", "--parallel.ep=2", "--model.n_experts=4", "--model.top_k=2",
                             "--train.activation_checkpointing=none"])
    m, t = cfg.model, cfg.train
    tokens = t.batch_size // 2 * t.seq_len * m.top_k * m.d_model * 4 // 2
    tr = trace(cfg)
    r = time_step(tr, H100, Efficiency())
    timed = [(e, c) for e, c in zip(sorted(tr["schedule"], key=lambda e: e["launched"]), r["collectives"])
             if e["kind"] == "all_to_all" and e["bytes_sent"] > 64]      # not the per-expert counts' exchange
    assert len(timed) == 4 * m.n_layers
    for e, c in timed:
        assert e["ranks"] == [0, 1] and e["bytes_sent"] == tokens
        assert c["seconds"] == pytest.approx(_nvlink_seconds(tokens))
    assert collective_seconds(tokens, [0, 8], H100, Efficiency()) == pytest.approx(tokens / (50e9 * 0.80) + 20e-6)
