"""The memory simulator (nanomega/sim/estimate.py) against measured runs.

The simulated peak of each rank (fake tensors, fake process group, one process) equals, within 10%, the
peak the same tracker measures on real tensors in real gloo processes started by torchrun, in every layout
(DDP, FSDP, TP, EP with and without token dropping, pp, cp with both methods, dense and expert float8), some
with and without activation checkpointing (expert parallel's simulation routes every expert the same number
of tokens, the real run as its router decides); a pipeline rank holds as many micro-batches' activations as
its schedule's action list keeps in flight; and the tracker itself agrees with counts that do not
use it: the bytes of parameters, gradients and AdamW state from the parameter count, the plan's
per-rank bytes (parallel/memory.py), and the operating system's peak resident memory of a real step.

Run as a script under torchrun, this file is the measuring worker:
    torchrun --nproc-per-node N tests/test_estimate.py OUT CASES_JSON
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.sim import estimate                       # noqa: E402
from nanomega.sim.memory_tracker import MemoryTracker   # noqa: E402
from nanomega.config import parse_args              # noqa: E402
from nanomega.sim.counting import count_params           # noqa: E402
from nanomega.sim.rank_bytes import bytes_per_rank  # noqa: E402
from nanomega.parallel.mesh import model_config     # noqa: E402
import ranks                                         # noqa: E402
from tiers import slow                                # noqa: E402

# Activations matter (seq 128, d 64, 2 layers, 2 micro-batches) and the vocabulary (251) must be padded under tp.
# A CPU run: measured on the CPU, so simulated with the CPU's kernels (a GPU run's attention: test_sim_attention.py).
SMALL = ["--model.vocab_size=251", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
         "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128", "--model.max_seq_len=128",
         "--train.batch_size=4", "--train.seq_len=128", "--train.grad_accum=2", "--train.compile=false",
         "--train.device=cpu"]
# Expert parallel: 4 experts, top 2, 2 per rank (tests/test_comm_counts.py's MoE). The simulation sizes the token
# all-to-all by balanced routing; the real run routes as its router decides (at init, with random tokens, close
# to balanced: its peak moves by the imbalance of the rows each rank's experts receive, under 1% here).
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32", "--model.shared_ffn_dim=32",
       "--model.aux_loss_coef=0.01", "--model.z_loss_coef=0.001"]
LAYOUTS = {
    1: {"serial": []},
    2: {"ddp2": ["--parallel.dp_replicate=2"], "fsdp2": ["--parallel.dp_shard=2"],
        "tp2_sp": ["--parallel.tp=2", "--parallel.sequence_parallel=true"],
        "ep2": ["--parallel.dp_replicate=2", "--parallel.ep=2", *MOE],
        # float8 experts loop over their blocks of rows, sliced by host counts: the simulator's balanced stand-in
        "ep2_fp8": ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.fp8=tensorwise", *MOE],
        # token dropping: the simulator fills every expert to its capacity (C = 32 of the ~64 assignments each expert
        # gets per sequence here), which the real run's near-uniform router at init does too
        "ep2_drop": ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.capacity_factor=0.5", *MOE],
        # 1F1B over 2 micro-batches: stage 0 holds both in flight, stage 1 one; the real pipeline runtime, its
        # point-to-point transfers completing at once on the fake process group
        "pp2": ["--parallel.pp=2"],
        "cp2_all_gather": ["--parallel.cp=2"], "cp2_ring": ["--parallel.cp=2", "--parallel.cp_method=ring"],
        # dense float8 under FSDP, every recipe (blockwise scales 128 x 128 blocks: widths of 128)
        **{f"fsdp2_fp8_{recipe}": ["--parallel.dp_shard=2", f"--model.fp8={recipe}"]
           for recipe in ("tensorwise", "rowwise", "delayed")},
        "fsdp2_fp8_blockwise": ["--parallel.dp_shard=2", "--model.fp8=blockwise", "--model.d_model=128",
                                "--model.n_kv_heads=4", "--model.ffn_dim=256"]},
    4: {"fsdp2_tp2": ["--parallel.dp_shard=2", "--parallel.tp=2"],
        "cp2_fsdp2": ["--parallel.cp=2", "--parallel.dp_shard=2"]},     # FSDP over dp_shard x cp: 1/4 each
}
AC = {"no_ac": ["--train.activation_checkpointing=none"], "full_ac": ["--train.activation_checkpointing=full"]}
WITH_AC = ("serial", "fsdp2", "fsdp2_tp2", "ep2")   # the 60 s budget: AC on four layouts, off on all six


def cases(world: int) -> dict:
    return {f"{name}/{ac}": SMALL + layout + ac_args for name, layout in LAYOUTS[world].items()
            for ac, ac_args in AC.items() if ac == "no_ac" or name in WITH_AC}


def measure(cfg) -> dict:
    return estimate.track_step(cfg, MemoryTracker(), torch.device("cpu"))


def worker(out: str, spec: str) -> None:
    """Under torchrun: measure every case on real tensors; rank r writes OUT/<r>.json."""
    torch.distributed.init_process_group("gloo")
    rank, results = torch.distributed.get_rank(), {}
    for name, args in json.loads(spec).items():
        results[name] = measure(parse_args(args))
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def torchrun(world: int, out: Path, spec: dict) -> list[dict]:
    out.mkdir()
    done = ranks.torchrun(world, Path(__file__).resolve(), out, json.dumps(spec), timeout=300)
    assert done.returncode == 0, ranks.crash_report(done.stderr)
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


@slow
def test_simulated_peaks_match_measured_real_runs(tmp_path):
    """Every rank of every layout, AC on and off: the simulated peak within 10% of the measured one (the
    split by category too, within 10% of the peak), and the simulation never allocates the bytes it reports."""
    measured = {name: {0: measure(parse_args(args))} for name, args in cases(1).items()}
    for world in (2, 4):
        per_rank = torchrun(world, tmp_path / str(world), cases(world))
        for name in cases(world):
            measured[name] = {r: per_rank[r][name] for r in range(world)}
    worst = 0.0
    for world in LAYOUTS:
        for name, args in cases(world).items():
            cfg = parse_args(args)
            # a layout's ranks simulated at once, one process each (as nanomega/sim/contracts.py checks them)
            sims = ({rank: estimate._start_child(estimate.simulate_rank, cfg, rank) for rank in measured[name]}
                    if world > 1 else {0: lambda: estimate.simulate_rank(cfg, 0)})
            for rank, real in measured[name].items():
                sim = sims[rank]()
                rel = abs(sim["peak_bytes"] - real["peak_bytes"]) / real["peak_bytes"]
                worst = max(worst, rel)
                assert rel <= 0.10, (name, rank, sim["peak_bytes"], real["peak_bytes"])
                for k in estimate.CATEGORIES:
                    assert abs(sim["by_category"][k] - real["by_category"][k]) <= 0.10 * real["peak_bytes"], \
                        (name, rank, k, sim["by_category"], real["by_category"])
                assert sum(sim["by_category"].values()) == sim["peak_bytes"]
    print(f"worst relative peak difference, simulated vs measured: {worst:.2e}")


def test_held_bytes_equal_the_parameter_count_and_the_plan():
    """After a step the tracker holds 4 B/param of parameters, 4 of gradients and 8 of AdamW moments (+ the
    step count and clip norm scalars): from count_params, serially; and per rank, the plan's bytes_per_rank
    (parallel/memory.py, no tracker, no step) for FSDP 8 x TP 2 on 16 simulated ranks."""
    cfg = parse_args(SMALL)
    n = count_params(model_config(cfg))
    held = estimate.simulate_rank(cfg)["held_after"]
    assert held["parameters"] == 4 * n and held["gradients"] == 4 * n
    assert 8 * n <= held["optimizer_state"] <= 8 * n + 64
    cfg = parse_args(SMALL + ["--parallel.dp_shard=8", "--parallel.tp=2", "--train.batch_size=8"])
    plan = bytes_per_rank(cfg)
    held = estimate._in_child(estimate.simulate_rank, cfg, 0)["held_after"]
    assert held["parameters"] == pytest.approx(plan.params, rel=1e-6)
    assert held["gradients"] == pytest.approx(plan.grads, rel=1e-6)
    assert held["optimizer_state"] == pytest.approx(plan.state, rel=1e-3)


# A 4-layer model whose parameters outweigh one sequence's activations (d 512, vocabulary 4096) and one at
# sequence 1024 where activations dominate: FSDP over 2 ranks, AdamW, rank 0 simulated.
PEAK = ["--model.vocab_size=4096", "--model.d_model=512", "--model.n_layers=4", "--model.n_heads=8",
        "--model.n_kv_heads=4", "--model.ffn_dim=2048", "--train.batch_size=2", "--train.compile=false",
        "--parallel.dp_shard=2"]


def step_adds(args, prefetch: bool = True) -> tuple[int, int]:
    """(peak of the forward and backward, that peak above what the rank holds between steps) of rank 0,
    simulated. (The update's own peak, old and new AdamW moments at once, is the same in every case.)
    prefetch=False: every unit's gather waited for as it is launched, none ahead (the forked child inherits it)."""
    import contextlib
    from nanomega.parallel.parallelize import Parallel
    with pytest.MonkeyPatch.context() as patch:
        if not prefetch:
            patch.setattr(Parallel, "prefetching", lambda self, units: contextlib.nullcontext())
        result = estimate._in_child(estimate.simulate_rank, parse_args(PEAK + args), 0)
    peak = result["phases"]["forward_backward"]["peak_bytes"]
    return peak, peak - sum(result["held_after"].values())


@pytest.mark.slow      # 11 s: the simulator's other fast tests cover its categories and collectives
def test_per_unit_gathering_and_recomputation_lower_the_step_peak():
    """Per-unit gathering frees each unit's parameters after its forward: at sequence 128 (parameters
    dominate) the forward and backward's addition to the held bytes falls by more than half against keeping every
    gather until its backward (what one whole-model gather held); prefetching one unit ahead costs at most
    one more unit gathered (a block: 12 d^2 parameters, fp32, whole on each rank); at sequence 1024 full
    recomputation lowers the peak further, and selective lies between."""
    short = ["--model.max_seq_len=128", "--train.seq_len=128"]
    keep, keep_adds = step_adds(short + ["--parallel.reshard_after_forward=false"])
    unit, unit_adds = step_adds(short, prefetch=False)
    assert unit < keep and unit_adds < 0.5 * keep_adds, (unit, keep, unit_adds, keep_adds)
    ahead, _ = step_adds(short)
    d = 512
    block = (d * d + 2 * d * d // 2 + d * d + 3 * d * 4 * d) * 4     # wq, wk and wv (half the heads), wo, the MLP
    assert unit <= ahead <= unit + block, (unit, ahead, block)
    long = ["--model.max_seq_len=1024", "--train.seq_len=1024"]
    none, _ = step_adds(long)
    selective, _ = step_adds(long + ["--train.activation_checkpointing=selective"])
    full, _ = step_adds(long + ["--train.activation_checkpointing=full"])
    assert full < selective < none, (full, selective, none)


RSS = """
import gc, json, sys, torch
sys.path.insert(0, {root!r})
from nanomega.sim import estimate
from nanomega.sim.memory_tracker import MemoryTracker
from nanomega.config import parse_args
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
cfg = parse_args({args!r})
estimate.track_step(cfg, MemoryTracker(), torch.device("cpu"))   # code pages, thread pools: warm
gc.collect()
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")      # the peak resident set starts again from now
result = estimate.track_step(cfg, MemoryTracker(), torch.device("cpu"))
print(json.dumps({{"tracked": result["peak_bytes"], "rss_delta": status("VmHWM:") - base}}))
"""


def test_tracked_peak_agrees_with_the_operating_systems_peak_resident_memory():
    """A real serial step, the second in its process: the tracker's peak against the growth of the peak
    resident set over the resident set before it (Linux's VmHWM, reset through /proc/self/clear_refs), with
    glibc's malloc returning large blocks at once (mmap threshold 64 KiB). The resident set also holds
    allocator overhead and kernels' own workspaces, which no tensor shows."""
    args = ["--model.n_layers=2", "--train.batch_size=8", "--train.seq_len=256", "--train.compile=false"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RSS.format(root=str(ROOT), args=args)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    print(got)
    assert got["rss_delta"] == pytest.approx(got["tracked"], rel=0.10), got


def test_cli_prints_one_json_object_and_refuses_bad_ranks(capsys):
    estimate.main(SMALL + ["--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["peak_bytes"] == sum(doc["by_category"].values()) and set(doc["by_category"]) == set(estimate.CATEGORIES)
    with pytest.raises(SystemExit, match=r"--ranks=5: every rank must be in \[0, 1\]"):
        estimate.main(SMALL + ["--parallel.dp_shard=2", "--ranks=5"])


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])


def test_the_updates_collectives_are_counted_apart_and_follow_the_optimizer():
    """collectives_by_phase["update"]: under ZeRO-1 every optimizer all-gathers its updated shards; Muon's
    whole-matrix owners add the all-to-all that brings each matrix to its owner and back, and AdamW has
    none. The two phases add up to the step's collectives."""
    base = SMALL + ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"]
    adamw, muon = (estimate.estimate(parse_args(base + [f"--optim.name={name}"]), ranks="0")
                   for name in ("adamw", "muon"))
    assert "all_to_all" not in adamw["collectives_by_phase"]["update"]
    assert muon["collectives_by_phase"]["update"]["all_to_all"]["count"] >= 2
    for run in (adamw, muon):
        assert run["collectives_by_phase"]["update"]["all_gather"]["bytes_sent"] > 0
        for kind, total in run["collectives"].items():
            assert sum(p.get(kind, {}).get("bytes_sent", 0) for p in run["collectives_by_phase"].values()) == \
                total["bytes_sent"]


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_shampoo_and_soap_steps_simulate(name):
    """Their updates read values eagerly (whether to refresh; the eigh retries on a failure), which fake
    tensors cannot give: the simulation runs both branches of each such choice instead (optim.linalg.branch).
    So the forward + backward peak is within 10% of the real step's (measured by the same tracker), the
    update's simulated peak is an upper bound of the real one (both branches' buffers: 1.74x for Shampoo
    here, whose fp64 retry never runs for real), and the state held is opt.init's (nanomega.optim.memory on
    meta tensors, no tracker)."""
    from nanomega import optim
    from nanomega.models import init
    from nanomega.optim.memory import state_bytes
    cfg = parse_args(SMALL + [f"--optim.name={name}", "--optim.precondition_frequency=1"])
    sim, real = estimate.simulate_rank(cfg, 0), measure(cfg)
    got, want = sim["phases"]["forward_backward"]["peak_bytes"], real["phases"]["forward_backward"]["peak_bytes"]
    assert abs(got - want) <= 0.10 * want, (got, want)
    assert sim["phases"]["update"]["peak_bytes"] >= real["phases"]["update"]["peak_bytes"]
    meta = init(model_config(cfg), 0, device="meta")
    held = state_bytes(optim.build(cfg.optim, cfg.train.steps).init(meta))
    assert sim["held_after"]["optimizer_state"] == real["held_after"]["optimizer_state"] == held


def test_autocast_copies_of_gathered_weights_are_counted_and_param_dtype_frees_them():
    """Under FSDP, autocast (--train.dtype=bfloat16 with fp32 parameters) casts each gathered weight for its matmul
    and autograd saves that bf16 copy for the backward, outside the re-gather's reach: every unit's copy lives from
    its forward to its backward, whole on each rank (N bytes in bf16, not N/dp). The simulator runs the real step,
    so its peak counts them (as gathered parameters: made from parameters alone); casting before the gather
    (--train.param_dtype=bfloat16) makes the saved weight the gathered one, freed with its unit."""
    fsdp = SMALL + ["--parallel.dp_shard=2", "--model.d_model=128", "--model.ffn_dim=512", "--model.n_layers=4",
                    "--train.seq_len=32", "--model.max_seq_len=32", "--train.grad_accum=1"]
    m = model_config(parse_args(fsdp))
    # one block's matmul weights in bf16, whole: wq, wo (d x d), wk, wv (d x d/2: 2 of 4 kv heads), the MLP (3 d x f)
    block = (2 * m.d_model ** 2 + 2 * m.d_model * m.d_model // 2 + 3 * m.d_model * m.ffn_dim) * 2
    gathered = {name: estimate.estimate(parse_args(fsdp + args), "0")["ranks"][0]["phases"]["forward_backward"]
                ["by_category"]["gathered_parameters"]
                for name, args in {"fp32": [], "autocast": ["--train.dtype=bfloat16"],
                                   "param_bf16": ["--train.param_dtype=bfloat16"]}.items()}
    # at the backward's peak every block but the last (whose backward has begun) still holds its copies
    assert gathered["autocast"] - gathered["fp32"] >= (m.n_layers - 1) * block, (gathered, block)
    assert gathered["param_bf16"] < gathered["fp32"], gathered


@slow   # six simulated pipeline ranks, ~15 s
def test_pipeline_activations_in_flight_follow_the_schedules_action_list():
    """Under pp each rank holds the activations of every forward whose backward has not run: at its peak, as
    many micro-batches as the schedule's own action list keeps in flight (schedules.peak_in_flight: GPipe all
    m, 1F1B pp - rank), each a stage's worth of one micro-batch, measured alone (m = 1). The simulator runs the
    real pipeline runtime, so the activations at the peak are that count times one micro-batch's, within 10%."""
    from nanomega.parallel import schedules
    pp, m = 2, 4
    args = SMALL + ["--model.n_layers=4", f"--parallel.pp={pp}"]

    def activations(schedule: str, micro: int, rank: int) -> int:
        cfg = parse_args(args + [f"--parallel.pp_schedule={schedule}", f"--train.grad_accum={micro}"])
        phase = estimate._in_child(estimate.simulate_rank, cfg, rank)["phases"]["forward_backward"]
        return phase["by_category"]["activations"]
    one = {r: activations("1f1b", 1, r) for r in range(pp)}
    for name in ("gpipe", "1f1b"):
        in_flight = schedules.peak_in_flight(schedules.SCHEDULES[name](pp, m))
        assert in_flight == ({r: m for r in range(pp)} if name == "gpipe" else {r: pp - r for r in range(pp)})
        for r in range(pp):
            got = activations(name, m, r)
            assert got == pytest.approx(in_flight[r] * one[r], rel=0.10), (name, r, got, in_flight[r], one[r])


def test_auto_ranks_cover_every_corner_of_the_mesh_and_every_pipeline_stage():
    """The mesh is row-major over MESH_DIMS (pp, dp_replicate, dp_shard, cp, tp): FSDP 8 x TP 2's last rank is
    15 (dp_shard 7, tp 1), and under pp every stage's first rank is simulated (stages hold different layers)."""
    assert estimate.role_ranks(parse_args(["--parallel.dp_shard=8", "--parallel.tp=2"])) == [0, 1, 14, 15]
    cfg = parse_args(["--model.n_layers=4", "--parallel.pp=4", "--parallel.dp_shard=2"])
    assert estimate.role_ranks(cfg) == [0, 1, 2, 4, 6, 7]


def test_llama3_405b_config_counts_the_published_shapes():
    """configs/llama3_405b.py against Llama 3.1 405B's published shapes (126 layers, d 16384, 128 query and 8 kv
    heads of 128, SwiGLU 53248, untied vocabulary 128256), counted here by hand: 405.85B parameters."""
    d, f, vocab, layers, kv = 16384, 53248, 128256, 126, 8 * 128
    block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d       # wq, wo; wk, wv; the MLP; two norms
    cfg = parse_args(["--config=llama3_405b"])
    assert count_params(model_config(cfg)) == layers * block + 2 * vocab * d + d == 405_853_388_800
    assert (cfg.model.rope_scaling, cfg.model.rope_factor, cfg.model.rope_original_max_len) == ("llama3", 8.0, 8192)


def test_the_plan_counts_a_pipeline_ranks_own_stages():
    """Under pp a rank holds only its stages' parameters: bytes_per_rank equals the most loaded stage rank's
    simulated held bytes after a step (pp 2 x FSDP 2; before, it counted the whole model on every rank)."""
    cfg = parse_args(SMALL + ["--parallel.pp=2", "--parallel.dp_shard=2", "--train.grad_accum=2",
                              "--train.batch_size=4"])
    plan = bytes_per_rank(cfg)
    held = [estimate._in_child(estimate.simulate_rank, cfg, r)["held_after"] for r in (0, 2)]   # each stage's first
    top = max(held, key=lambda h: h["parameters"] + h["gradients"] + h["optimizer_state"])
    assert top["parameters"] == pytest.approx(plan.params, rel=1e-6)
    assert top["gradients"] == pytest.approx(plan.grads, rel=1e-6)
    assert top["optimizer_state"] == pytest.approx(plan.state, rel=1e-3)
    whole = bytes_per_rank(parse_args(SMALL + ["--parallel.dp_shard=2", "--train.batch_size=4"]))
    assert plan.params < 0.8 * whole.params      # a stage is a part of the model
