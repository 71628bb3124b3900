"""--train.profile (nanomega/run/profile.py) and the measured split (nanomega/run/measured.py): the trace holds the
profiled steps' matmuls, one trace per rank, and the split's parts add up to each step as the trace times it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ranks
import train as train_script
from nanomega import optim
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.run.measured import predicted_parts, read_trace, split
from nanomega.sim.devices import Device, Efficiency
from nanomega.train.step import make_step_fns
from test_train import tiny_args
from tiers import slow

ROOT = Path(__file__).resolve().parent.parent
MATMULS = ("aten::mm", "aten::addmm")


def events(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def in_step(evs: list[dict], step: int) -> list[dict]:
    span = next(e for e in evs if e["name"] == f"ProfilerStep#{step}")
    return [e for e in evs if span["ts"] <= e["ts"] < span["ts"] + span["dur"]]


@pytest.fixture(scope="module")
def profiled(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled") / "run"
    torch.set_num_threads(1)
    cfg = parse_args(tiny_args(corpus, out, "--train.steps=3", "--train.profile=2:3"))
    train_script.train(cfg, quiet=True)
    return cfg, out


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def test_profile_traces_each_chosen_step_with_its_matmuls(profiled):
    """Steps 2 and 3 of 3 are in the chrome trace, each holding exactly the matmuls one step of the same model
    dispatches (counted by a dispatch mode on the step functions), and step 1 is not traced."""
    cfg, out = profiled
    files = sorted(p.name for p in (out / "profile").iterdir())
    assert files == ["run.json", "trace-rank0.json"]
    evs = events(out / "profile" / "trace-rank0.json")
    assert not any(e["name"] == "ProfilerStep#1" for e in evs)
    model_cfg = cfg.model
    params = init(model_cfg, 0, torch.device("cpu"))
    opt = optim.build(cfg.optim, cfg.train.steps)
    fns = make_step_fns(model_cfg, opt)
    x = torch.randint(0, model_cfg.vocab_size, (cfg.train.batch_size, cfg.train.seq_len))
    state = opt.init(params)
    with CountMatmuls() as counter:
        loss, grads, stats = fns.grads(params, [(x, x)])
        fns.update(grads, state, params, stats, keep=torch.isfinite(loss))
    assert counter.count > 0
    for step in (2, 3):
        inside = in_step(evs, step)
        assert sum(e["name"] in MATMULS for e in inside) == counter.count
        assert {"nanomega: forward_backward", "nanomega: update"} <= {e["name"] for e in inside}
    info = json.loads((out / "profile" / "run.json").read_text())
    assert info["steps"] == [2, 3] and info["world_size"] == 1 and info["config"]["train"]["profile"] == "2:3"


def test_profile_is_off_by_default_and_a_bad_range_is_refused():
    assert parse_args([]).train.profile == ""
    with pytest.raises(ValueError, match=r"steps 1 to 3 \(train.steps\)"):
        parse_args(["--train.steps=3", "--train.profile=2:4"])
    with pytest.raises(ValueError, match="not a step or a range"):
        parse_args(["--train.profile=two"])
    assert parse_args(["--train.steps=9", "--train.profile=4:6"]).train.profile == "4:6"


def test_no_profile_folder_without_the_setting(corpus, tmp_path, one_thread):
    out = tmp_path / "plain"
    train_script.train(parse_args(tiny_args(corpus, out, "--train.steps=1")), quiet=True)
    assert not (out / "profile").exists()


def hand_made_trace(path: Path) -> None:
    """One step of 1000 us on the main thread (tid 1) with a gloo thread (tid 2); the expected split by hand."""
    def x(name, ts, dur, tid=1, cat="cpu_op", dims=None):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "cat": cat,
                "args": {"Input Dims": dims or [[4]]}}
    evs = [x("ProfilerStep#7", 0, 1000, cat="user_annotation"),
           x("nanomega: forward_backward", 0, 500, cat="user_annotation"),
           x("aten::mm", 0, 100),
           x("_c10d_functional::all_reduce_", 100, 10), x("c10d::allreduce_", 101, 8),
           x("_c10d_functional::all_gather_into_tensor", 110, 5, dims=[[8]]),
           x("aten::mm", 115, 185),
           x("_c10d_functional::wait_tensor", 300, 150),             # waits for the all-reduce ([4])
           x("_c10d_functional::wait_tensor", 450, 50, dims=[[8]]),  # and the all-gather ([8])
           x("gloo:recv", 520, 60, tid=2),                           # main thread idle 500-600: 60 us of it p2p
           x("nanomega: update", 600, 300, cat="user_annotation"),
           x("aten::_foreach_add_", 600, 200), x("_c10d_functional::all_reduce", 800, 20),
           x("_c10d_functional::wait_tensor", 820, 30)]               # 850-1000: host
    path.write_text(json.dumps({"traceEvents": evs}))


def test_read_trace_splits_a_hand_made_trace(tmp_path):
    hand_made_trace(tmp_path / "t.json")
    m = read_trace(tmp_path / "t.json")[7]
    us = 1e-6
    assert m["step_s"] == pytest.approx(1000 * us)
    assert m["compute_s"] == pytest.approx((100 + 185) * us)
    assert m["update_s"] == pytest.approx(200 * us)
    assert m["exposed_s"] == pytest.approx({"all_reduce": (10 + 150 + 20 + 30) * us, "all_gather": (5 + 50) * us,
                                            "send": 60 * us})
    assert m["host_s"] == pytest.approx((40 + 150) * us)
    assert m["compute_s"] + m["update_s"] + m["host_s"] + sum(m["exposed_s"].values()) == pytest.approx(m["step_s"])


def test_measured_split_adds_up_and_stands_beside_the_prediction(profiled):
    cfg, out = profiled
    dev = Device("test CPU", 2e10, None, 1e12, 1e10, 1e9, 1e9, fp32_flops=2e10)
    eff = Efficiency(kernel_s=5e-6, collective_s=1e-4)
    result = split(out, (dev, eff, {}))
    steps = result["measured"][0]
    assert sorted(steps) == [2, 3]
    for m in steps.values():
        parts = m["compute_s"] + m["update_s"] + m["host_s"] + m["pipeline_idle_s"] + sum(m["exposed_s"].values())
        assert parts == pytest.approx(m["step_s"], rel=1e-6)   # timestamps: ~1 ns apart
        assert m["compute_s"] > 0 and m["update_s"] > 0 and m["exposed_s"] == {}     # one process: no collectives
    pred = result["predicted"]
    assert pred == predicted_parts(cfg, dev, eff)
    assert pred["compute_s"] + pred["update_s"] == pytest.approx(pred["step_s"])   # serial: compute and update only


@slow
def test_two_gloo_ranks_write_two_traces_and_the_command_splits_them(corpus, tmp_path):
    """DDP on 2 gloo ranks: a trace per rank, each with the step's matmuls and its gradients' all-reduce waits;
    `python -m nanomega.run.measured` measures this CPU and prints both ranks' steps beside the prediction."""
    out = tmp_path / "ddp"
    done = ranks.torchrun(2, "train.py", *tiny_args(corpus, out, "--train.steps=3", "--train.profile=3",
                                                    "--parallel.dp_replicate=2"))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        evs = in_step(events(out / "profile" / f"trace-rank{rank}.json"), 3)
        assert any(e["name"] in MATMULS for e in evs)
        assert read_trace(out / "profile" / f"trace-rank{rank}.json")[3]["exposed_s"]["all_reduce"] > 0
    shown = subprocess.run([sys.executable, "-m", "nanomega.run.measured", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-3000:]
    rows = [line for line in shown.stdout.splitlines() if line.startswith(("| 0 | 3 |", "| 1 | 3 |"))]
    assert len(rows) == 2 and "all_reduce" in shown.stdout
