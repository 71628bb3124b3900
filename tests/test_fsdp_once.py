"""FSDP gathering once per step (parallel.fsdp_gather="per_step", parallel/fsdp.py OncePerStep), and gradient
accumulation into one buffer (train/step.py GradientSums).

- Parity: on gloo, FSDP 2 with 2 micro-batches (with full or selective recomputation, a bf16 reduction), HSDP 2 x 2,
  and pp 2 x FSDP 2 with 4 micro-batches (1F1B; ZB-V, whose weight pass is torch's, with recomputation) train like
  the serial run (tests/test_parallel.py's bounds; a bf16 reduction: its bf16 bound), the setting on and off in
  the same launch.
- Counts: the simulator's record of one step (nanomega/sim/estimate.py: the real step on fake tensors) holds one
  all-gather and one reduce-scatter per FSDP unit per step with the setting (a stage's units under pp), against
  every micro-batch's gathers (and regathers for the backward) and reduce-scatters without it.
- Memory: what per_step holds more at the peak stays within fsdp.per_step_bytes, the planner's bound
  (gather_once_default); one process and DDP hold one set of gradients at the backward's peak, not the running
  sum beside the last micro-batch's, and compute the same bits as the sum made after each backward.
- Bad input: an unknown fsdp_gather, per_step without FSDP.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import parity
import test_fsdp_memory as fm
import test_parallel as tp
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel.fsdp import gather_once_default, per_step_bytes
from nanomega.parallel.mesh import model_config
from nanomega.sim import estimate
from nanomega.tree import named_leaves
from ranks import crash_report, torchrun
from tiers import slow

ROOT = Path(__file__).resolve().parent.parent
ONCE = ["--parallel.fsdp_gather=per_step"]
DEEP = ["--model.n_layers=4", "--train.grad_accum=4"]      # tests/test_pipeline.py's model: a block per stage
CASES = {   # name -> args (besides parity.BASE: 2 layers, 2 micro-batches), world size
    "fsdp2_once": (["--parallel.dp_shard=2", *ONCE], 2),
    "fsdp2": (["--parallel.dp_shard=2"], 2),
    "fsdp2_once_ac": (["--parallel.dp_shard=2", "--train.activation_checkpointing=full", *ONCE], 2),
    "fsdp2_once_selective_bf16_reduce": (["--parallel.dp_shard=2", "--train.activation_checkpointing=selective",
                                          "--train.reduce_dtype=bfloat16", *ONCE], 2),
    "hsdp_once": (["--parallel.dp_replicate=2", "--parallel.dp_shard=2", *ONCE], 4),
    "pp2_fsdp2_once": (["--parallel.pp=2", "--parallel.dp_shard=2", *DEEP, *ONCE], 4),
    "pp2_fsdp2": (["--parallel.pp=2", "--parallel.dp_shard=2", *DEEP], 4),
    "pp2_zbv_fsdp2_once_ac": (["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v",
                               "--parallel.dp_shard=2", "--train.activation_checkpointing=full", *DEEP, *ONCE], 4),
}

# a bf16 reduction rounds every micro-batch's sum (here: the step's) to bf16: tests/test_parallel.py's bf16 bounds
BF16_REDUCE = {"value_tol": tp.BF16_VALUE_TOL, "param_tol": tp.BF16_PARAM_TOL}


def parity_cases(item) -> list:
    """A case of CASES, for tests/conftest.py's parity_launch (the session's one launch per world size)."""
    args, world = CASES[item.callspec.params["name"]]
    return [(world, "train", args + ["--optim.name=adamw"])]


@pytest.fixture(scope="module")
def results(parity_launch):
    return {name: parity_launch.get(("train", tuple(args + ["--optim.name=adamw"])))
            for name, (args, _) in CASES.items()}


def serial(deep: bool) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return parity.run((DEEP if deep else []) + ["--optim.name=adamw"])
    finally:
        torch.set_num_threads(threads)


@slow
@pytest.mark.parametrize("name", list(CASES))
def test_gathering_once_per_step_trains_like_the_serial_run(results, name):
    got = results[name]
    assert "error" not in got, got.get("error")
    bounds = BF16_REDUCE if "bf16" in name else {"value_tol": 1e-5, "param_tol": 1e-5}
    tp.assert_trains_like(got, serial(deep=name.startswith("pp")), **bounds)


# ---------------------------------------------------------------- collectives per step, in the simulator

TINY = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_heads=4",
        "--model.n_kv_heads=2", "--model.ffn_dim=128", "--model.max_seq_len=16", "--train.batch_size=2",
        "--train.seq_len=16", "--train.compile=false", "--train.device=cpu", "--parallel.dp_shard=2"]


def counts(*args: str) -> dict:
    result = estimate._in_child(estimate.simulate_rank, parse_args(TINY + list(args)), 0)
    return {k: v["count"] for k, v in result["collectives"].items()}, result


@pytest.mark.parametrize("pp", [1, pytest.param(2, marks=slow)])
def test_a_unit_is_gathered_and_reduce_scattered_once_per_step(pp):
    """4 blocks, 4 micro-batches; rank 0 holds the embedding and the blocks (pp 1: also the head; pp 2: blocks 0-1).
    Per micro-batch every unit is gathered for the forward and, but the embedding, again for the backward (FSDP2's
    reshard_after_forward), and reduce-scattered: 4 x (units + units - 1) and 4 x units; per step, one each."""
    m, args = 4, ["--model.n_layers=4", "--train.grad_accum=4", f"--parallel.pp={pp}"]
    units = 1 + 4 + 1 if pp == 1 else 1 + 2
    before, _ = counts(*args)
    after, _ = counts(*args, *ONCE)
    assert (before["all_gather"], before["reduce_scatter"]) == (m * (2 * units - 1), m * units)
    assert (after["all_gather"], after["reduce_scatter"]) == (units, units)


@slow     # two simulations (8 s); the once-per-step counts stay in the fast tier
def test_what_per_step_holds_more_is_within_the_planners_bound():
    """The peak with per_step exceeds per_micro_batch's by no more than per_step_bytes (the gathered parameters and
    unsharded gradients of every unit), the bound gather_once_default weighs, and by a good part of it (here 0.49:
    per micro-batch holds the sharded running sum and a unit or two gathered, which per step does not add)."""
    args = ["--model.n_layers=4", "--train.grad_accum=4"]
    _, before = counts(*args)
    _, after = counts(*args, *ONCE)
    bound = per_step_bytes(parse_args(TINY + args + ONCE))
    assert 0.25 * bound <= after["peak_bytes"] - before["peak_bytes"] <= bound
    cfg = parse_args(TINY + args + ONCE)
    assert gather_once_default(cfg, gpu_bytes=before["peak_bytes"] + bound, peak_bytes=before["peak_bytes"])
    assert not gather_once_default(cfg, gpu_bytes=before["peak_bytes"] + bound - 1, peak_bytes=before["peak_bytes"])


def test_the_planners_rule_needs_fsdp_and_several_micro_batches():
    one = parse_args(TINY + ["--train.grad_accum=1"])
    ddp = parse_args(TINY[:-1] + ["--parallel.dp_replicate=2", "--train.grad_accum=4"])
    assert not gather_once_default(one, gpu_bytes=1e18, peak_bytes=0)
    assert not gather_once_default(ddp, gpu_bytes=1e18, peak_bytes=0)


def test_per_step_bytes_counts_the_stage_by_hand():
    """fp32 parameters and gradients (4 + 4 bytes) of every parameter, the model's count; under tp 2 every matrix
    halves (the norms stay whole); under pp 2 the larger pipeline rank's share (the same blocks; the embedding's
    table against the head's and the final norm)."""
    cfg = parse_args(TINY + ["--model.n_layers=4", "--train.grad_accum=4"])
    leaves = named_leaves(init(model_config(cfg), device="meta"))
    total = sum(x.numel() for x in leaves.values())
    norms = sum(x.numel() for x in leaves.values() if x.dim() == 1)
    assert per_step_bytes(cfg) == 8 * total
    tp2 = parse_args(TINY + ["--model.n_layers=4", "--train.grad_accum=4", "--parallel.tp=2"])
    assert per_step_bytes(tp2) == 8 * (norms + (total - norms) / 2)
    pp2 = parse_args(TINY + ["--model.n_layers=4", "--train.grad_accum=4", "--parallel.pp=2"])
    stage0 = sum(x.numel() for n, x in leaves.items() if n.startswith("tok_embed") or n.split(".")[:2] in
                 (["layers", "0"], ["layers", "1"]))
    assert per_step_bytes(pp2) == 8 * (total - stage0) > 8 * stage0    # the head's stage: the final norm's 64 more


# ---------------------------------------------------------------- bad input

def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="fsdp_gather='once' is not one of"):
        parse_args(TINY + ["--parallel.fsdp_gather=once"])


def test_per_step_without_fsdp_is_refused():
    with pytest.raises(ValueError, match="set parallel.dp_shard > 1"):
        parse_args(TINY[:-1] + ["--parallel.dp_replicate=2", *ONCE])


# ---------------------------------------------------------------- accumulation into one buffer (not FSDP's)

def test_one_process_sums_in_place_bit_for_bit():
    """The serial step with 3 micro-batches (tied embeddings: a gradient autograd sums from two uses) computes the
    same losses, norms and parameters, torch.equal, as the sum made after each backward (deferred.add_in_place off:
    tests/test_fsdp_memory.py's former path covers the layouts on gloo)."""
    import nanomega.train.step as step
    args = ["--train.grad_accum=3", "--model.tie_embeddings=true", "--optim.name=adamw"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        new = parity.run(args)
        in_place, step.add_in_place = step.add_in_place, lambda total, g, n=1: False
        try:
            former = parity.run(args)
        finally:
            step.add_in_place = in_place
    finally:
        torch.set_num_threads(threads)
    assert (new["losses"], new["grad_norms"]) == (former["losses"], former["grad_norms"])
    assert all(torch.equal(new["params"][n], former["params"][n]) for n in former["params"])


def memory_cfg(*args: str):
    """tests/test_fsdp_memory.py's model (its bytes counted there by hand) on the layout `args`."""
    return parse_args([a for a in fm.ARGS if a != "--parallel.dp_shard=2"] + list(args))


def held_gradients(*args: str) -> tuple[int, int]:
    """(gradients at the forward-backward's peak, gradients handed to the optimizer) of rank 0, simulated."""
    cfg = memory_cfg(*args)
    result = estimate._in_child(estimate.simulate_rank, cfg, 0)
    return result["phases"]["forward_backward"]["by_category"]["gradients"], result["held_after"]["gradients"]


@pytest.mark.parametrize("layout", [[], pytest.param(["--parallel.tp=2"], marks=slow)])
def test_accumulated_gradients_peak_at_one_set_without_fsdp(monkeypatch, layout):
    """One process and TP 2, 2 micro-batches, tests/test_fsdp_memory.py's model: the backward's peak holds one set
    of gradients (one process: exactly what the optimizer gets; TP: within 2% of it, a replicated gradient's
    partial sum beside its reduction), where the sum made after each backward held the last micro-batch's set
    beside the sum (the former path: 2.0 and 2.9 sets here)."""
    peak, handed = held_gradients(*layout, "--train.grad_accum=2")
    assert peak == handed if not layout else handed <= peak <= 1.02 * handed
    import nanomega.train.step as step
    monkeypatch.setattr(step, "add_in_place", lambda total, g, n=1: False)
    former, _ = held_gradients(*layout, "--train.grad_accum=2")
    assert former >= 1.9 * handed


GLOO_CASES = {"tp2": ["--parallel.tp=2"], "fsdp2_per_step": ["--parallel.dp_shard=2", *ONCE]}


@slow
def test_measured_on_gloo_the_peaks_are_the_simulated_ones(tmp_path):
    """A real step on 2 gloo ranks under memory_tracker (estimate.track_step without fake tensors), tests/
    test_fsdp_memory.py's model, 2 micro-batches: TP 2's backward holds one set of gradients at its peak (35.2 MB;
    49.2 MB with the gradients summed after each backward), and each case's peak and categories are the
    simulator's, byte for byte."""
    proc = torchrun(2, __file__, tmp_path)
    assert proc.returncode == 0, crash_report(proc.stderr)
    measured = json.loads((tmp_path / "peaks.json").read_text())
    for name, args in GLOO_CASES.items():
        peak, gradients, handed = measured[name]
        simulated = estimate._in_child(estimate.simulate_rank, memory_cfg(*args, "--train.grad_accum=2"), 0)
        assert peak == simulated["peak_bytes"], name
        assert gradients == simulated["phases"]["forward_backward"]["by_category"]["gradients"], name
    peak, gradients, handed = measured["tp2"]
    assert handed <= gradients <= 1.02 * handed


def _measure(out_dir: str) -> None:
    import os
    from nanomega.sim.estimate import track_step
    from nanomega.sim.memory_tracker import MemoryTracker
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    measured = {}
    for name, args in GLOO_CASES.items():
        r = track_step(memory_cfg(*args, "--train.grad_accum=2"), MemoryTracker(), torch.device("cpu"))
        measured[name] = (r["peak_bytes"], r["phases"]["forward_backward"]["by_category"]["gradients"],
                          r["held_after"]["gradients"])
    if int(os.environ["RANK"]) == 0:
        (Path(out_dir) / "peaks.json").write_text(json.dumps(measured))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys
    _measure(sys.argv[1])
