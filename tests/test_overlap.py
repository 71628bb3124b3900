"""What each collective overlaps: where the train step launches it and where it waits for it.

Functional collectives start when called and are waited for at the first use of their result, so what can
run while one is in flight is the compute issued between the two. The simulator (nanomega/estimate.py: the
real step on fake tensors, a fake process group) records, for every collective, its launch and its first
wait in the op stream and the compute ops between (memory_tracker's schedule: matmuls, attention, embedding
lookups). tests/test_comm_counts.py checks what is issued and in which order; these check that what is
issued ahead is not waited for at once. The model is tests/parity.py's (2 blocks; units: the embedding,
each block, the head), one micro-batch.
"""
from __future__ import annotations

import pytest

import parity
from nanomega import estimate
from nanomega.config import parse_args

FSDP_AC = ["--parallel.dp_shard=2", "--train.activation_checkpointing=full", "--train.grad_accum=1"]
N_UNITS = 1 + 2 + 1   # the embedding, 2 blocks, the head


def schedule(args: list[str], kind: str) -> list[dict]:
    """The step's collectives of `kind` (memory_tracker's schedule, rank 0), in launch order."""
    cfg = parse_args(parity.BASE + args)
    result = estimate._in_child(estimate.simulate_rank, cfg, 0)
    return [e for e in result["schedule"] if e["phase"] == "forward_backward" and e["kind"] == kind]


def in_flight_at(entries: list[dict], entry: dict) -> int:
    """How many of `entries` were launched before `entry` and not yet waited for when it was launched."""
    return sum(e["launched"] < entry["launched"] and (e["waited"] is None or e["waited"] > entry["launched"])
               for e in entries if e is not entry)


@pytest.fixture(scope="module")
def fsdp_ac_gathers():
    return schedule(FSDP_AC, "all_gather")


def test_every_gather_but_the_first_is_launched_ahead_of_its_use_under_full_recomputation(fsdp_ac_gathers):
    """FSDP with every block recomputed: in the forward, unit k + 1's gather is launched before unit k
    computes; in the backward, a unit's gather again (a recomputation's, or a unit freed after its forward)
    is launched before the unit after it computes its backward. Only the first of each pass, which nothing
    precedes, is waited for with no compute between."""
    forward = [e for e in fsdp_ac_gathers if not e["backward"]]
    backward = [e for e in fsdp_ac_gathers if e["backward"]]
    assert len(forward) == N_UNITS and len(backward) == N_UNITS - 1   # the embedding's backward needs no gather
    for gathers in (forward, backward):
        assert [e["compute"] >= 1 for e in gathers] == [False] + [True] * (len(gathers) - 1), gathers


def test_no_more_than_one_gather_is_ahead_under_full_recomputation(fsdp_ac_gathers):
    """The prefetch runs one unit ahead, not more: when a gather is launched, at most one other is pending
    (the unit about to compute), so at most two units are gathered at once."""
    assert max(in_flight_at(fsdp_ac_gathers, e) for e in fsdp_ac_gathers) == 1, fsdp_ac_gathers


def test_reduce_scatters_stay_in_flight_under_fsdp_times_tensor_parallel():
    """FSDP x TP stores column-parallel weights sharded on their input dim: a unit's reduce-scatter is waited
    for when the next unit's is launched (one in flight), not at once by the unpacking of that dim. Each but
    the last (the embedding's, read by the optimizer) has the backward of the unit before it to overlap."""
    scatters = schedule(["--parallel.dp_shard=2", "--parallel.tp=2", "--train.grad_accum=1"], "reduce_scatter")
    assert len(scatters) == N_UNITS
    assert all(e["compute"] >= 1 for e in scatters[:-1]), scatters
