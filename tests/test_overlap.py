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

Expert parallel's all-to-alls (parallel/experts.py's `overlapped`): with model.moe_overlap_chunks = K a layer's
routed rows go in K chunks, issued D0 D1 E0 D2 E1 C0 D3 E2 C1 ... E(K-1) C(K-2) C(K-1) (D dispatch, E the
chunk's experts, C combine); the backward runs the same nodes in reverse. With model.moe_sub_batches = S the
forward is a wavefront over S sub-batches (parallel/wavefront.py): the layers' ends hide behind other sub-batches'
attention, experts and heads, so at S = 4 no all-to-all of any MoE layer is waited for with no compute since launch.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parity
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


DEFERRED_SERIAL = ["--train.grad_accum=3", "--optim.name=sgd"]
DEFERRED = {name: ["--parallel.dp_shard=2", *DEFERRED_SERIAL, *args]
            for name, args in {"fp32": [], "bf16": ["--train.reduce_dtype=bfloat16"]}.items()}


@pytest.mark.slow
def test_deferred_casts_and_sums_train_like_the_serial_run(parity_launch):
    """What the tests above leave in flight is still the serial run's maths: FSDP 2 with 3 micro-batches (a
    middle one, whose last gradients are summed where first read) trains like the serial run within the parity
    bound (1e-5 relative, fp32: losses, gradient norms, each parameter's norm of difference), and with bf16
    reductions (each gradient cast back where first read) within bf16's rounding of the gradients. SGD: an
    update proportional to the gradient, so a lost or doubled micro-batch moves every parameter."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as the workers
    try:
        want = parity.run(DEFERRED_SERIAL)
        for name, tol in (("fp32", 1e-5), ("bf16", 2 ** -8)):
            got = parity_launch["train", tuple(DEFERRED[name])]
            assert "error" not in got, got.get("error")
            for a, b in zip(got["losses"] + got["grad_norms"], want["losses"] + want["grad_norms"]):
                assert abs(a - b) <= tol * abs(b), (name, got["losses"], want["losses"], got["grad_norms"],
                                                    want["grad_norms"])
            for n, p in want["params"].items():
                assert (got["params"][n] - p).norm() <= tol * p.norm(), (name, n)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- expert parallel: the all-to-all behind compute

MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32", "--model.shared_ffn_dim=32",
       "--model.aux_loss_coef=0.01", "--model.z_loss_coef=0.001"]
PADDED = ["--model.capacity_factor=1.25", "--model.pad_to_capacity=true", "--model.drop_policy=position"]
EP2 = ["--parallel.dp_replicate=2", "--parallel.ep=2", "--train.grad_accum=1"]
N_MOE_LAYERS = 2


def per_layer(entries: list[dict], backward: bool) -> list[list[bool]]:
    """Whether each all-to-all of one pass had compute to hide behind, per MoE layer, in launch order (the
    pass's entries split evenly: every layer issues the same ones)."""
    run = [e["compute"] >= 1 for e in entries if e["backward"] == backward]
    n = len(run) // N_MOE_LAYERS
    return [run[i * n:(i + 1) * n] for i in range(N_MOE_LAYERS)]


ROUTED_ONLY = [a for a in MOE if not a.startswith("--model.shared_ffn_dim")]      # Mixtral: no shared expert


@pytest.mark.parametrize("shared", [False, True], ids=["routed_only", "shared_expert"])
def test_whole_all_to_alls_are_waited_for_at_once_but_behind_the_shared_expert(shared):
    """The reference the chunks are measured against, model.moe_overlap_chunks=1: each layer's counts, dispatch and
    combine, and their gradients' exchanges, are waited for with no compute between; but the dispatch, where a
    shared expert runs while it is in flight (forward)."""
    a2a = schedule((MOE if shared else ROUTED_ONLY) + EP2, "all_to_all")
    assert per_layer(a2a, False) == [[False, shared, False]] * N_MOE_LAYERS, a2a      # counts, D0, C0
    assert per_layer(a2a, True) == [[False, False]] * N_MOE_LAYERS, a2a              # C0, D0


@pytest.mark.parametrize("shared", [False, True], ids=["routed_only", "shared_expert"])
def test_every_chunk_all_to_all_but_the_pipeline_ends_is_launched_before_compute_it_does_not_wait_for(shared):
    """ep 2, dropless, 4 chunks: in the forward each layer exchanges its counts once (the one host sync, for every
    chunk), then launches D0 D1 D2 C0 D3 C1 C2 C3, of which D1, D2, D3 have the chunk before's experts in
    flight with them and C0, C1 the chunk after's; in the backward C3 C2 C1 D3 C0 D2 D1 D0, of which C2, C1, C0
    have the chunk after's experts' backward and D3, D2 the chunk before's. What no chunk can hide (module doc,
    `overlapped`): the first dispatch, D1's gradient, the last combine and C2 in the forward; a shared expert,
    run between D0 and D1, hides D0 in the forward and D1's gradient."""
    a2a = schedule((MOE if shared else ROUTED_ONLY) + EP2 + ["--model.moe_overlap_chunks=4"], "all_to_all")
    hidden = [False, shared, True, True, True, True, True, False, False]          # counts, D0 D1 D2 C0 D3 C1 C2 C3
    assert per_layer(a2a, False) == [hidden] * N_MOE_LAYERS, a2a
    hidden = [False, True, True, True, True, True, shared, False]                # C3 C2 C1 D3 C0 D2 D1 D0
    assert per_layer(a2a, True) == [hidden] * N_MOE_LAYERS, a2a


def test_padded_chunks_overlap_as_row_chunks_do():
    """Token dropping padded to capacity (equal splits, no count exchange), with a shared expert: 3 chunks of the
    capacity slots follow the same order, all but C1 and C2 hidden in the forward, all but C2 and D0 in the
    backward."""
    a2a = schedule(MOE + PADDED + EP2 + ["--model.moe_overlap_chunks=3"], "all_to_all")
    assert per_layer(a2a, False) == [[True, True, True, True, False, False]] * N_MOE_LAYERS, a2a   # D0 D1 D2 C0 C1 C2
    assert per_layer(a2a, True) == [[False, True, True, True, True, False]] * N_MOE_LAYERS, a2a    # C2 C1 C0 D2 D1 D0


def test_no_more_than_one_dispatch_runs_ahead_of_the_experts():
    """The pipeline holds one chunk's rows in flight beyond the one computing: when a dispatch is launched, the
    other dispatches pending are at most the chunk about to compute (memory: two chunks' rows at once)."""
    fwd = [e for e in schedule(MOE + EP2 + ["--model.moe_overlap_chunks=4"], "all_to_all") if not e["backward"]]
    layer = fwd[:len(fwd) // N_MOE_LAYERS][1:]                                   # without the count exchange
    dispatches = [layer[i] for i in (0, 1, 2, 4)]                                # D0 D1 D2 D3 (launch order)
    assert max(in_flight_at(dispatches, e) for e in dispatches) == 1, layer


@pytest.mark.slow
def test_the_chunks_share_one_count_exchange_and_one_host_read_per_layer():
    """The layer's inherent host sync stays one: every chunk's counts go in one all-to-all and are read in one copy,
    so the step's host reads (nanomega/sim/contracts.py, fake process group on every rank) are those of the
    unchunked exchange, and NCCL's contracts hold (same shapes and order of collectives on every rank)."""
    from nanomega.sim import contracts
    cfg = parse_args(parity.BASE + MOE + ["--parallel.dp_shard=2", "--parallel.ep=2", "--model.moe_overlap_chunks=4"])
    result = contracts.check(cfg)
    assert result["violations"] == []
    budget = contracts.host_read_budget(cfg)
    assert budget == 2 * cfg.train.grad_accum * N_MOE_LAYERS      # 2 steps, each micro-batch's forward, each layer
    assert [res["syncs"].get("step", 0) for res in result["ranks"].values()] == [budget] * 2, result["ranks"]


@pytest.mark.parametrize("args,message", [
    (["--model.moe_overlap_chunks=0"], "whole number >= 1"),
    (["--model.moe_overlap_chunks=2"], "only parallel.ep > 1"),              # no all-to-all to split
])
def test_a_chunk_count_that_splits_nothing_is_refused_before_work(args, message):
    with pytest.raises(ValueError, match=message):
        parse_args(parity.BASE + MOE + args).validate()


def test_more_chunks_than_a_rank_has_tokens_is_refused():
    """ep 2 over the 2 data-parallel ranks of a micro-batch of 4 sequences of 16: each rank routes 32 tokens, which
    33 chunks cannot split; refused by the first forward (the simulator's, nanomega.estimate, runs it on fake
    tensors before any real one)."""
    with pytest.raises(ValueError, match="moe_overlap_chunks=33 splits this rank's 32 tokens; choose at most 32"):
        schedule(MOE + EP2 + ["--model.moe_overlap_chunks=33"], "all_to_all")


CHUNKED = {"rows": MOE, "dropping": MOE + ["--model.capacity_factor=1.0"], "padded": MOE + PADDED}
CHUNKS = {"rows": 4, "dropping": 4, "padded": 3}


def chunked_args(name: str, k: int) -> list[str]:
    return ["--parallel.dp_replicate=2", "--parallel.ep=2", "--optim.name=sgd", *CHUNKED[name],
            f"--model.moe_overlap_chunks={k}"]


@pytest.mark.slow
def test_chunked_all_to_alls_train_like_the_serial_run(parity_launch):
    """What the chunks leave in flight is still the serial run's maths: ep 2 with 4 chunks of the routed rows
    (dropless, and dropping over capacity) and with 3 chunks of padded capacity trains like the serial run within
    the parity bound (1e-5 relative, fp32: losses, gradient norms, each parameter's norm of difference). The
    first step's loss is bitwise the unchunked ep run's: each row meets the same expert in the same matmul
    arithmetic, only the experts' weight gradients are summed chunk by chunk (rounding, later steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as the workers
    try:
        for name, args in CHUNKED.items():
            whole, got = (parity_launch["train", tuple(chunked_args(name, k))] for k in (1, CHUNKS[name]))
            assert "error" not in got, got.get("error")
            assert got["losses"][0] == whole["losses"][0], (name, got["losses"], whole["losses"])
            assert_trains_like_serial(name, got, parity.run(["--optim.name=sgd", *args]))
    finally:
        torch.set_num_threads(threads)


def assert_trains_like_serial(name: str, got: dict, want: dict) -> None:
    """Losses and gradient norms within 1e-5 relative of the serial run's, each parameter within 1e-5 of its norm."""
    for a, b in zip(got["losses"] + got["grad_norms"], want["losses"] + want["grad_norms"]):
        assert abs(a - b) <= 1e-5 * abs(b), (name, got["losses"], want["losses"])
    for n, p in want["params"].items():
        assert (got["params"][n] - p).norm() <= 1e-5 * p.norm(), (name, n)


# ---------------------------------------------------------------- the wavefront: every all-to-all behind compute

def wavefront(args: list[str], sub_batches: int) -> list[dict]:
    """The all-to-alls of a step whose forward runs model.moe_sub_batches sub-batches (parallel/wavefront.py): 2
    sequences per sub-batch on each of the 2 data-parallel ranks."""
    return schedule(args + EP2 + [f"--model.moe_sub_batches={sub_batches}",
                                  f"--train.batch_size={4 * sub_batches}"], "all_to_all")


@pytest.mark.parametrize("shared", [False, True], ids=["routed_only", "shared_expert"])
def test_every_all_to_all_of_every_moe_layer_is_launched_before_compute_it_does_not_wait_for(shared):
    """4 sub-batches, dropless: each of the 2 MoE layers launches, per sub-batch, its count exchange, dispatch and
    combine in the forward (24) and the two gradients' exchanges in the backward (16), and every one has compute
    issued between its launch and its first wait: another sub-batch's attention, router, experts or head
    (wavefront.py's steps and `interleave`), whether or not a shared expert adds compute of its own."""
    a2a = wavefront(MOE if shared else ROUTED_ONLY, 4)
    forward = [e for e in a2a if not e["backward"]]
    backward = [e for e in a2a if e["backward"]]
    assert (len(forward), len(backward)) == (N_MOE_LAYERS * 4 * 3, N_MOE_LAYERS * 4 * 2), a2a
    assert all(e["compute"] >= 1 for e in forward + backward), a2a


def test_the_check_fails_on_the_chunks_alone():
    """The fault case: the same check on 4 chunks of one layer (no sub-batches) finds the layer's ends exposed."""
    a2a = schedule(ROUTED_ONLY + EP2 + ["--model.moe_overlap_chunks=4"], "all_to_all")
    assert not all(e["compute"] >= 1 for e in a2a), a2a


def test_three_sub_batches_leave_only_the_last_combine_of_the_forward_exposed():
    """S = 3: the stagger runs short at the end (wavefront.interleave): the last sub-batch's last combine has no
    head left to hide behind; every other exchange, and every gradient's, is hidden."""
    a2a = wavefront(ROUTED_ONLY, 3)
    exposed = [i for i, e in enumerate(a2a) if e["compute"] == 0]
    forward = [e for e in a2a if not e["backward"]]
    assert exposed == [len(forward) - 1], a2a


LAYOUTS = {     # model.moe_sub_batches beyond ep over replicated data parallel (parity.py's layouts)
    "fsdp2_ep2": ["--parallel.dp_shard=2", "--parallel.reshard_after_forward=false", "--parallel.ep=2"],
    "dp2_tp2_ep2": ["--parallel.dp_replicate=2", "--parallel.tp=2", "--parallel.ep=2"],          # experts split on tp
    "dp2_tp2_sp_ep4": ["--parallel.dp_replicate=2", "--parallel.tp=2", "--parallel.sequence_parallel=true",
                       "--parallel.ep=4"],
    "dp2_cp2_ep2": ["--parallel.dp_replicate=2", "--parallel.cp=2", "--parallel.ep=2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_all_to_all_is_behind_compute_in_every_layout_the_wavefront_runs(layout):
    """The same with a shared expert under FSDP (gathered once per unit, the next unit's gather ahead), tensor
    parallel with the experts split over tp, sequence parallel with ep folded onto tp, and context parallel."""
    a2a = schedule(MOE + LAYOUTS[layout] + ["--train.grad_accum=1", "--model.moe_sub_batches=4",
                                            "--train.batch_size=16"], "all_to_all")
    assert len(a2a) == N_MOE_LAYERS * 4 * 5 and all(e["compute"] >= 1 for e in a2a), a2a


@pytest.mark.slow
def test_the_wavefront_reads_the_counts_once_per_layer_and_sub_batch():
    """Each sub-batch exchanges its own counts: the step's host reads (nanomega/sim/contracts.py, fake process group on
    every rank) are S per MoE layer and forward, as contracts.host_read_budget allows, and NCCL's contracts hold
    (the same collectives in the same order on every rank, whichever sub-batch runs when)."""
    from nanomega.sim import contracts
    cfg = parse_args(parity.BASE + MOE + ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.moe_sub_batches=2"])
    result = contracts.check(cfg)
    assert result["violations"] == []
    budget = contracts.host_read_budget(cfg)
    assert budget == 2 * cfg.train.grad_accum * N_MOE_LAYERS * 2    # 2 steps, micro-batches, layers, sub-batches
    assert [res["syncs"].get("step", 0) for res in result["ranks"].values()] == [budget] * 2, result["ranks"]


@pytest.mark.parametrize("args,message", [
    (["--model.moe_sub_batches=2"], "only parallel.ep > 1 has"),
    (EP2 + ["--model.moe_sub_batches=4"], "splits each rank's 2 sequences .* into 4 sub-batches"),
    (["--parallel.dp_shard=2", "--parallel.ep=2", "--model.moe_sub_batches=2"], "reshard_after_forward"),
    (["--parallel.pp=2", "--parallel.ep=2", "--model.moe_sub_batches=2"], "pp > 1"),
    (EP2 + ["--model.moe_sub_batches=2", "--train.activation_checkpointing=full"], "activation_checkpointing"),
    (EP2 + ["--model.moe_sub_batches=2", "--model.moe_overlap_chunks=2"], "moe_overlap_chunks > 1"),
    (EP2 + ["--model.moe_sub_batches=2", "--train.compile=true"], "train.compile"),
    (EP2 + PADDED + ["--model.moe_sub_batches=2"], "pad_to_capacity"),
])
def test_a_wavefront_it_cannot_run_is_refused_before_work(args, message):
    with pytest.raises(ValueError, match=message):
        parse_args(parity.BASE + MOE + args).validate()


WAVEFRONT_COMMON = ["--optim.name=sgd", "--train.batch_size=16"]
# name -> (the serial run's model, the layout's args): ep 2 over dp 2 with each model, then LAYOUTS with a shared expert
WAVEFRONT = {name: (model, ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.moe_sub_batches=4",
                            *WAVEFRONT_COMMON, *model])
             for name, model in {"routed": ROUTED_ONLY, "shared": MOE,
                                 "dropping": MOE + ["--model.capacity_factor=1.0"]}.items()}
WAVEFRONT |= {name: (MOE, [*layout, "--model.moe_sub_batches=4", *WAVEFRONT_COMMON, *MOE])
              for name, layout in LAYOUTS.items()}


@pytest.mark.slow
def test_the_wavefront_trains_like_the_serial_run(parity_launch):
    """ep 2 with 4 sub-batches (dropless, with and without a shared expert, and dropping over capacity), and the
    layouts above with a shared expert, train like the serial run within the parity bound (1e-5 relative, fp32:
    losses, gradient norms, each parameter's norm of difference): the sub-batches' cross-entropy summed, then
    divided, and the router statistics the micro-batch's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as the workers
    try:
        serial = {}
        for name, (model, args) in WAVEFRONT.items():
            got = parity_launch["train", tuple(args)]
            assert "error" not in got, got.get("error")
            if tuple(model) not in serial:
                serial[tuple(model)] = parity.run([*WAVEFRONT_COMMON, *model])
            assert_trains_like_serial(name, got, serial[tuple(model)])
    finally:
        torch.set_num_threads(threads)


def parity_cases(item) -> list:
    """The parity cases of this file's training tests, for tests/conftest.py's parity_launch (which runs them in the
    session's one launch per world size): (world size, kind, args)."""
    cases = {"test_deferred_casts_and_sums_train_like_the_serial_run": DEFERRED.values(),
             "test_chunked_all_to_alls_train_like_the_serial_run":
                 [chunked_args(name, k) for name in CHUNKED for k in (1, CHUNKS[name])],
             "test_the_wavefront_trains_like_the_serial_run": [args for _, args in WAVEFRONT.values()]}
    return [(parse_args(parity.BASE + args).parallel.world_size, "train", args) for args in cases[item.originalname]]
