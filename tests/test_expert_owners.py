"""Expert matrices with owners (parallel/ownership.py): under FSDP 4 x ep 2 each expert's Muon / SOAP state lives
whole on one of its 2 edp ranks, not on both. Against the serial run, for the parity harness's Mixtral-style
("moe") and DeepSeek-V3-style ("deepseek") models (tests/test_parallel.py builds and bounds the cases):
training with Muon, and the update alone with Muon and SOAP (bitwise; SOAP end to end is ill-posed, as
test_parallel.py says); the state each rank holds, measured on gloo, is the accountant's (sim/rank_bytes.py)
and what a rank holding E/4 whole experts holds (FSDP 4 x ep 4); a checkpoint written with owners over edp 2
resumes at ep 4 and at ep 1 on the uninterrupted run."""
from __future__ import annotations

import shutil

import pytest
import torch

import parity
import train as train_script
from nanomega.config import parse_args
from nanomega.parallel.mesh import validate_layout
from nanomega.sim.rank_bytes import bytes_per_rank
from test_parallel import (LAYOUTS, assert_trains_like, case_args, case_name, own_rounding, relative, result_of,
                           serial)
from test_parallel_train import MOE, PER_EXPERT, REORDERED_FACTOR, per_expert_state, run_train
from test_train import read_metrics, tiny_args
from tiers import selected, slow, tiered

LAYOUT = "fsdp4_ep2"          # 4 processes: experts Shard(0) on ep 2, Shard(1) on edp 2 (FSDP)
TRAIN = ["muon+moe", "muon+deepseek"]
OPTIMIZER = [("muon+moe",), ("soap+moe",), ("muon+deepseek",), ("soap+deepseek",)]


def case_of(item) -> tuple:
    kind = "optimizer" if item.originalname == "test_expert_owners_update_bitwise_as_the_serial_optimizer" else "train"
    return kind, LAYOUT, item.callspec.params["opt"]


def parity_cases(item) -> list:
    """The parity case (4 processes) a collected test reads, for tests/conftest.py's parity_launch: in the session's
    one 4-process launch, with tests/test_parallel.py's (which shares some of them: they run once)."""
    kind, layout, opt = case_of(item)
    return [(4, kind, case_args(kind, layout, opt))]


@pytest.fixture(scope="module")
def results(request, parity_launch):
    """{case name: result} of the cases the selected tests need."""
    return {case_name(*c): parity_launch[c[0], tuple(case_args(*c))] for c in selected(request, "results", case_of)}


@pytest.mark.parametrize("opt", tiered(OPTIMIZER, {("muon+moe",)}))
def test_expert_owners_update_bitwise_as_the_serial_optimizer(results, opt):
    got, want = result_of(results, "optimizer", LAYOUT, opt), serial("optimizer", opt)
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), f"{name}: {relative(got['params'][name], p):.2e}"
    for a, b in zip(got["losses"], want["losses"]):
        assert abs(a - b) <= 1e-6 * b


@slow
@pytest.mark.parametrize("opt", TRAIN)
def test_expert_owners_train_like_the_serial_run_and_hold_a_quarter_of_the_experts(results, opt):
    """Losses, gradient norms and parameters as test_parallel.py bounds them; the state bytes of the most loaded
    rank, measured, are the accountant's, and those of FSDP 4 x ep 4, where each rank holds 1 of the 4 experts
    whole: each expert's state on one of the 2 edp ranks, not on both."""
    got = result_of(results, "train", LAYOUT, opt)
    assert_trains_like(got, serial("train", opt), 1e-5, 1e-5, **own_rounding(opt))
    args = parity.BASE + case_args("train", LAYOUT, opt)
    assert got["bytes"][2] == bytes_per_rank(parse_args(args)).state
    assert got["bytes"][2] == bytes_per_rank(parse_args(args + ["--parallel.ep=4"])).state


# Saved with owners over edp 2 at step 2, resumed where a rank holds whole experts (ep 4: edp 1) and where each
# expert's owner is one of 4 edp ranks (ep 1): Muon's momentum of an owner's range of experts is a box of the
# whole stacked weight (ParallelOptimizer.state_box); SOAP's per-expert state is named by global expert.
FSDP4 = ["--parallel.dp_shard=4"]


@slow
@pytest.mark.parametrize("resumed_as,extra", [
    ([*FSDP4, "--parallel.ep=4"], [*MOE, "--optim.name=muon"]),
    (FSDP4, [*PER_EXPERT, "--optim.name=soap"]),
], ids=["muon-ep4", "soap-ep1"])
def test_a_checkpoint_with_expert_owners_resumes_at_another_ep(corpus, tmp_path, one_thread, resumed_as, extra):
    """Steps 3-4 after the resume are those of the run that never stopped (losses and gradient norms <= 1e-5;
    SOAP up to REORDERED_FACTOR x what the serial run differs from it, as test_parallel_train.py explains), and
    SOAP's state of each expert at step 4, by its global name, is that run's."""
    common = ["--train.steps=4", "--train.ckpt_every=2", "--train.eval_every=100", "--train.keep_checkpoints=5",
              *extra]
    soap = "--optim.name=soap" in extra
    serial_records = {}
    if soap:
        train_script.train(parse_args(tiny_args(corpus, tmp_path / "serial", *common)), quiet=True)
        serial_records = {r["step"]: r for r in read_metrics(tmp_path / "serial" / "metrics.jsonl")}
    out = tmp_path / "run"
    run_train(tiny_args(corpus, out, *common, *FSDP4, "--parallel.ep=2"))
    unchanged = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    shutil.move(out / "ckpt-00000004", tmp_path / "unchanged")     # as if it had stopped after step 2
    run_train(tiny_args(corpus, out, *common, *resumed_as, "--train.resume=true"))
    records = read_metrics(out / "metrics.jsonl")[4:]
    assert [r["step"] for r in records] == [3, 4]
    for r in records:
        for key in ("loss", "grad_norm"):
            want = unchanged[r["step"]][key]
            own = abs(serial_records[r["step"]][key] - want) if soap else 0.0
            assert abs(r[key] - want) <= max(1e-5 * want, REORDERED_FACTOR * own), (r["step"], key, r[key], want)
    want_state, got_state = per_expert_state(tmp_path / "unchanged"), per_expert_state(out / "ckpt-00000004")
    assert got_state.keys() == want_state.keys()
    assert bool(got_state) == soap            # per-expert names are SOAP's (and Shampoo's), not Muon's
    for name, t in got_state.items():
        assert (t.double() - want_state[name].double()).norm() <= 1e-3 * want_state[name].double().norm(), name


def test_owners_on_a_layout_that_cannot_have_them_are_refused_before_any_process():
    """Owners take whole matrices (dense ones over dp_shard, experts over edp); parallel.muon_tp=distributed keeps
    Muon's matrices split over tp on every rank. With FSDP both cannot hold: the preflight's layout check refuses
    it, naming the setting to change, before a process group or a parameter exists."""
    cfg = parse_args([*MOE, "--model.n_heads=4", "--model.n_kv_heads=2", "--parallel.dp_shard=2", "--parallel.tp=2",
                      "--parallel.ep=2", "--parallel.sequence_parallel=true", "--optim.name=muon",
                      "--parallel.muon_tp=distributed"])
    with pytest.raises(ValueError, match="use muon_tp=duplicated"):
        validate_layout(cfg, world_size=4)
