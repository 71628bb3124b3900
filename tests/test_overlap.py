"""What each collective overlaps: where the train step launches it and where it waits for it.

Functional collectives start when called and are waited for at the first use of their result, so what can
run while one is in flight is the compute issued between the two. The simulator (nanomega/estimate.py: the
real step on fake tensors, a fake process group) records, for every collective, its launch and its first
wait in the op stream and the compute ops between (memory_tracker's schedule: matmuls, attention, embedding
lookups). tests/test_comm_counts.py checks what is issued and in which order; these check that what is
issued ahead is not waited for at once. The model is tests/parity.py's (2 blocks; units: the embedding,
each block, the head), one micro-batch unless a test says otherwise.

The simulator does not build a pipeline (estimate.py's `build` makes one Parallel over the whole mesh, and
`estimate` refuses pp: the point-to-point buffers in flight are not checked against a measured run); the
pipeline tests run one pipeline rank's step as nanomega/contracts.py does (parallel/setup.py on fake tensors
and the fake process group) under the same tracker: the op order needs nothing more.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parity
from nanomega import estimate
from nanomega.config import parse_args
from nanomega.memory_tracker import MemoryTracker
from nanomega.parallel.mesh import model_config

FSDP_AC = ["--parallel.dp_shard=2", "--train.activation_checkpointing=full", "--train.grad_accum=1"]
N_UNITS = 1 + 2 + 1   # the embedding, 2 blocks, the head


def schedule(args: list[str], kind: str) -> list[dict]:
    """The step's collectives of `kind` (memory_tracker's schedule, rank 0), in launch order."""
    cfg = parse_args(parity.BASE + args)
    result = estimate._in_child(estimate.simulate_rank, cfg, 0)
    return [e for e in result["schedule"] if e["phase"] == "forward_backward" and e["kind"] == kind]


def pipeline_reductions(args: list[str], rank: int = 0) -> list[dict]:
    """The data-parallel gradient reductions (parallel/buckets.py's collectives) of one pipeline rank's step,
    in launch order, as the tracker's schedule records them (module doc). The model has 4 blocks, the step
    4 micro-batches (tests/test_pipeline.py's)."""
    cfg = parse_args(parity.BASE + ["--model.n_layers=4", "--train.grad_accum=4"] + args)
    return estimate._in_child(_pipeline_reductions, cfg, rank)


def _pipeline_reductions(cfg, rank: int) -> list[dict]:
    fake, device = FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    tracker, launched = MemoryTracker(), []
    with estimate.fake_world(cfg.parallel.world_size, rank):
        from nanomega.parallel.setup import setup_parallel   # (registers the hints' runtimes: in this child only)
        model_cfg = model_config(cfg)
        params, opt, pipe = setup_parallel(cfg, model_cfg, device, lambda: fake)
        make_reducer = pipe.par.reducer

        def reducer():     # the step's reducer, noting which of the schedule's collectives it launches
            made = make_reducer()
            launch = made._launch

            def noted(key):
                first = len(tracker.schedule)
                launch(key)
                launched.extend(range(first, len(tracker.schedule)))
            made._launch = noted
            return made
        pipe.par.reducer = reducer
        with fake:
            estimate._track_steps(cfg, tracker, device, [model_cfg, params, opt, pipe])
    return [tracker.schedule[i] for i in launched]


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


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_the_last_micro_batch_reduce_scatters_stay_in_flight_under_gradient_accumulation(layout):
    """FSDP (and HSDP) with 2 micro-batches: the last micro-batch's reduce-scatters are not waited for as the
    gradient hook hands them to the reducer (which adds the earlier micro-batch's sum where it first needs the
    values: parallel/buckets.py), so each has the backward of the unit before it to overlap, as with one
    micro-batch; only the step's last (the embedding's, read by the optimizer) has nothing after it."""
    dims = ["--parallel.dp_shard=2"] + (["--parallel.dp_replicate=2"] if layout == "hsdp" else [])
    scatters = [e for e in schedule(dims + ["--train.grad_accum=2"], "reduce_scatter") if e["backward"]]
    assert len(scatters) == 2 * N_UNITS
    assert [e["compute"] >= 1 for e in scatters] == [True] * (2 * N_UNITS - 1) + [False], scatters


PIPELINES = {   # pp 2 x DDP 2; rank 0 holds stage 0 and, under pp_virtual = 2, a later stage
    "interleaved": ["--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"],
    "zb_v": ["--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v"],     # the weights' gradients in W
}


@pytest.mark.parametrize("layout", PIPELINES)
def test_a_pipeline_stage_reduces_its_gradients_while_the_schedule_still_runs(layout):
    """Under pipeline parallel a stage's buckets are launched as its last backward (B, or W under ZB-V) ends
    (parallel/pipeline.py), not after the whole schedule: the later stage's reduction (one bucket) runs while
    the rank's other stage computes its remaining backwards; only the rank's last has nothing after it."""
    reductions = pipeline_reductions(["--parallel.pp=2", "--parallel.dp_replicate=2"] + PIPELINES[layout])
    assert [e["kind"] for e in reductions] == ["all_reduce"] * 2, reductions      # one bucket per stage
    assert [e["compute"] >= 1 for e in reductions] == [True, False], reductions


def test_a_pipeline_stage_launches_its_full_buckets_during_its_last_backward():
    """1F1B, one stage per rank, 20 kB buckets: as DDP's (nanomega/step.py), each gradient of the stage's last
    backward enters a bucket as soon as autograd has it, so every bucket but the last is launched inside that
    backward; each overlaps what is left of it, but the one the stage's last gradient (the embedding's)
    overfilled, launched when nothing is left."""
    reductions = pipeline_reductions(["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.bucket_mb=0.02"])
    assert len(reductions) >= 3
    assert [e["backward"] for e in reductions] == [True] * (len(reductions) - 1) + [False], reductions
    assert all(e["compute"] >= 1 for e in reductions[:-2]), reductions
