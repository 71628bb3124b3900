"""What each collective overlaps: where the train step launches it and where it waits for it.

Functional collectives start when called and are waited for at the first use of their result, so what can
run while one is in flight is the compute issued between the two. The simulator (nanomega/sim/estimate.py: the
real step on fake tensors, a fake process group) records, for every collective, its launch and its first
wait in the op stream and the compute ops between (memory_tracker's schedule: matmuls, attention, embedding
lookups). tests/test_comm_counts.py checks what is issued and in which order; these check that what is
issued ahead is not waited for at once. The model is tests/parity.py's (2 blocks; units: the embedding,
each block, the head), one micro-batch unless a test says otherwise.

The simulator does not build a pipeline (estimate.py's `build` makes one Parallel over the whole mesh, and
`estimate` refuses pp: the point-to-point buffers in flight are not checked against a measured run); the
pipeline tests run one pipeline rank's step as nanomega/sim/contracts.py does (parallel/setup.py on fake tensors
and the fake process group) under the same tracker: the op order needs nothing more.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parity
from ranks import crash_report, torchrun
from nanomega.sim import estimate
from nanomega.config import parse_args
from nanomega.sim.memory_tracker import MemoryTracker
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
    schedule, reductions = pipeline_schedule(args, rank)
    return [schedule[i] for i in reductions]


def pipeline_schedule(args: list[str], rank: int = 0) -> tuple[list[dict], list[int]]:
    """One pipeline rank's step (as pipeline_reductions): every collective the tracker's schedule records, in
    launch order, and the indices of the data-parallel gradient reductions among them."""
    cfg = parse_args(parity.BASE + ["--model.n_layers=4", "--train.grad_accum=4"] + args)
    return estimate._in_child(_pipeline_schedule, cfg, rank)


def _pipeline_schedule(cfg, rank: int) -> tuple[list[dict], list[int]]:
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
    return tracker.schedule, launched


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


@pytest.mark.parametrize("param_dtype,reduce_dtype", [("float32", "bfloat16"), ("bfloat16", "bfloat16")])
def test_reduce_scatters_in_another_dtype_than_the_shards_stay_in_flight(param_dtype, reduce_dtype):
    """A reduce-scatter in train.reduce_dtype other than the fp32 shards' is cast back where its gradients
    are first read (parallel/deferred.py's Deferred: when the next unit's reduce-scatter is launched, or by the
    optimizer), not as the unit's backward hands them to autograd: each but the step's last has the backward
    of the unit before it to overlap, as with fp32 reductions."""
    scatters = schedule(["--parallel.dp_shard=2", "--train.grad_accum=1", f"--train.param_dtype={param_dtype}",
                         f"--train.reduce_dtype={reduce_dtype}"], "reduce_scatter")
    assert len(scatters) == N_UNITS
    assert [e["compute"] >= 1 for e in scatters] == [True] * (N_UNITS - 1) + [False], scatters


def test_every_micro_batch_reduce_scatters_stay_in_flight_under_gradient_accumulation():
    """3 micro-batches: the middle one's last reduce-scatter (the embedding's) is not waited for by the sum of
    the micro-batches' gradients (nanomega/train/step.py adds it where the sum is first read: parallel/fsdp.py's
    accumulate), so it overlaps the next micro-batch's forward; only the step's last has nothing after it."""
    scatters = [e for e in schedule(["--parallel.dp_shard=2", "--train.grad_accum=3"], "reduce_scatter")
                if e["backward"]]
    assert len(scatters) == 3 * N_UNITS
    assert [e["compute"] >= 1 for e in scatters] == [True] * (3 * N_UNITS - 1) + [False], scatters


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fsdp_gathers_inside_a_pipeline_stage_are_launched_ahead_of_their_use(recompute):
    """pp 2 x FSDP 2, 1F1B: inside each of the last stage's forwards and backwards (2 blocks and the head,
    gathered again in the backward, by saved-tensor hooks or by the recomputation) the gathers run one unit
    ahead as outside pp (parallel/pipeline.py enters fsdp's Prefetch per stage forward): the first gather of
    each pass is waited for with no compute before it, every other is launched before the unit before it
    computes. The last stage alternates forward and backward, so each run of one direction is one pass."""
    entries, _ = pipeline_schedule(["--parallel.pp=2", "--parallel.dp_shard=2",
                                    f"--train.activation_checkpointing={recompute}"], rank=2)   # stage 1
    gathers = [e for e in entries if e["kind"] == "all_gather" and e["phase"] == "forward_backward"]
    passes = [list(run) for _, run in itertools.groupby(gathers, key=lambda e: e["backward"])]
    assert [len(p) for p in passes] == [3] * 8, gathers      # 4 micro-batches, forward and backward
    for p in passes:
        assert [e["compute"] >= 1 for e in p] == [False, True, True], p


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
    """1F1B, one stage per rank, 20 kB buckets: as DDP's (nanomega/train/step.py), each gradient of the stage's last
    backward enters a bucket as soon as autograd has it, so every bucket but the last is launched inside that
    backward; each overlaps what is left of it, but the one the stage's last gradient (the embedding's)
    overfilled, launched when nothing is left."""
    reductions = pipeline_reductions(["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.bucket_mb=0.02"])
    assert len(reductions) >= 3
    assert [e["backward"] for e in reductions] == [True] * (len(reductions) - 1) + [False], reductions
    assert all(e["compute"] >= 1 for e in reductions[:-2]), reductions


@pytest.mark.slow
def test_deferred_casts_and_sums_train_like_the_serial_run(tmp_path):
    """What the tests above leave in flight is still the serial run's maths: FSDP 2 with 3 micro-batches (a
    middle one, whose last gradients are summed where first read) trains like the serial run within the parity
    bound (1e-5 relative, fp32: losses, gradient norms, each parameter's norm of difference), and with bf16
    reductions (each gradient cast back where first read) within bf16's rounding of the gradients. SGD: an
    update proportional to the gradient, so a lost or doubled micro-batch moves every parameter."""
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    serial_args = ["--train.grad_accum=3", "--optim.name=sgd"]
    cases = {"fp32": [], "bf16": ["--train.reduce_dtype=bfloat16"]}
    batch = [{"name": name, "kind": "train", "args": ["--parallel.dp_shard=2", *serial_args, *args]}
             for name, args in cases.items()]
    proc = torchrun(2, root / "tests" / "parity.py", tmp_path, json.dumps(batch))
    assert proc.returncode == 0, crash_report(proc.stderr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as the workers
    try:
        for name, tol in (("fp32", 1e-5), ("bf16", 2 ** -8)):
            got = torch.load(tmp_path / f"{name}.pt")
            assert "error" not in got, got.get("error")
            want = parity.run(serial_args)
            for a, b in zip(got["losses"] + got["grad_norms"], want["losses"] + want["grad_norms"]):
                assert abs(a - b) <= tol * abs(b), (name, got["losses"], want["losses"], got["grad_norms"],
                                                    want["grad_norms"])
            for n, p in want["params"].items():
                assert (got["params"][n] - p).norm() <= tol * p.norm(), (name, n)
    finally:
        torch.set_num_threads(threads)
