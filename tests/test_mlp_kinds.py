"""A new MLP kind in one place: ReLU^2 (Primer, So et al. 2021: relu(x W_up)^2 W_down) is declared in this file
alone, and the model, its parameters, the sharding plan and training take it from the registry
(nanomega/models/mlp.py) with no other file changed.

It is checked as every built-in kind is (tests/test_models.py's assert_mlp_kind: forward against float64,
parameter names and shapes at its default width, tensor-parallel dims), then trained: the loss falls over a few
serial steps, and under tensor parallel (tp=2, with and without sequence parallel, torchrun on gloo; the slow
tier) it trains like the serial run. The worker processes run this file itself (`python tests/test_mlp_kinds.py
OUT CASES`, the parity harness's main), so they register ReLU^2 exactly as pytest's process does.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import parity                                                           # noqa: E402
from nanomega.config import ModelConfig, parse_args                     # noqa: E402
from nanomega.models.layers import linear                               # noqa: E402
from nanomega.models.mlp import KINDS, MLPKind, register                # noqa: E402
from nanomega.run.preflight import preflight                            # noqa: E402
from nanomega.train.step import make_step_fns, step_options             # noqa: E402
from ranks import crash_report, torchrun                                # noqa: E402
from tiers import slow                                                  # noqa: E402
import train                                                            # noqa: E402


def relu2(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return linear(p["w_down"], F.relu(linear(p["w_up"], x, cfg)).square(), cfg)


RELU2 = register(MLPKind("relu2", relu2, column=("w_up",), row=("w_down",), width=lambda d: 4 * d))


def relu2_reference(w: dict, x: torch.Tensor) -> torch.Tensor:
    """relu(x W_up^T + b)^2 W_down^T + b in float64, written out: max(h, 0) * max(h, 0)."""
    h = (x @ w["w_up.weight"].T + w.get("w_up.bias", 0)).clamp(min=0)
    return (h * h) @ w["w_down.weight"].T + w.get("w_down.bias", 0)


ARGS = ["--model.mlp=relu2", "--optim.name=sgd"]   # SGD: a step linear in the gradient keeps rounding rounding
LAYOUTS = {"tp2": ["--parallel.tp=2"], "tp2_sp": ["--parallel.tp=2", "--parallel.sequence_parallel=true"]}


def test_relu2_matches_its_float64_reference_shapes_and_sharding():
    from test_models import MLPCase, assert_mlp_kind

    assert KINDS["relu2"] is RELU2
    # no published ReLU^2 model to take a width from: Primer keeps the Transformer's 4 d
    assert_mlp_kind("relu2", MLPCase(relu2_reference, {"w_up": "column", "w_down": "row"}, (512, 2048)))
    assert_mlp_kind("relu2", MLPCase(relu2_reference, {"w_up": "column", "w_down": "row"}, (512, 2048), bias=True))


def test_relu2_trains_serially():
    """Eight steps of the train step (train.setup, make_step_fns: what train.py runs) on one batch: the loss falls
    at every step, by more than a nat in all (from ln 251 = 5.5, the uniform guess)."""
    cfg = parse_args(parity.BASE + ["--model.mlp=relu2", "--optim.name=adamw", "--optim.lr=0.01", "--train.steps=8"])
    model_cfg, params, opt, par = train.setup(cfg, torch.device("cpu"))
    assert [n for n in params["layers"][0]["mlp"]] == ["w_up", "w_down"]
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, par=par, **step_options(cfg.train))
    micro, losses = parity.batches(cfg, 0), []
    for _ in range(cfg.train.steps):
        loss, grads, stats = fns.grads(params, micro)
        params, state = fns.update(grads, state, params, stats)
        losses.append(loss.item())
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 1.0, losses


def test_an_unknown_kind_is_refused_before_any_work_with_the_known_ones(tmp_path):
    """The command line takes any model.mlp (config sits below the registry); train.py's preflight refuses an
    unknown one at the parameter count, its first look at the model, naming the registered kinds."""
    cfg = parse_args(parity.BASE + ["--model.mlp=relu3", f"--train.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"model.mlp='relu3' is not a registered MLP kind; choose one of "
                                         r"\['gelu', 'relu2', 'swiglu'\]"):
        preflight(cfg, torch.device("cpu"))
    assert not (tmp_path / "run").exists()


def test_a_matrix_name_keeps_its_role_and_a_kind_name_its_kind():
    """The sharding plan reads a matrix's role from its name, so a kind that turns w_up into a row-parallel matrix
    is refused, as is a second kind under a registered name; neither is registered."""
    with pytest.raises(ValueError, match=r"w_down column parallel \(another kind has it row parallel\); w_up row "
                                         r"parallel \(another kind has it column parallel\)"):
        register(MLPKind("upside_down", relu2, column=("w_down",), row=("w_up",), width=lambda d: 4 * d))
    with pytest.raises(ValueError, match="an MLP kind named 'relu2' is already registered"):
        register(MLPKind("relu2", relu2, column=("w_up",), row=("w_down",), width=lambda d: 2 * d))
    assert "upside_down" not in KINDS and KINDS["relu2"] is RELU2


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    """{layout: the parity harness's result} of one 2-process torchrun of this file."""
    out = tmp_path_factory.mktemp("relu2")
    cases = [{"name": name, "args": ARGS + args} for name, args in LAYOUTS.items()]
    proc = torchrun(2, Path(__file__), out, json.dumps(cases), timeout=600)
    assert proc.returncode == 0, crash_report(proc.stderr)
    return {name: torch.load(out / f"{name}.pt") for name in LAYOUTS}


@slow     # one 2-process launch, ~30 s on 2 shared cores
@pytest.mark.parametrize("layout", LAYOUTS)
def test_relu2_under_tensor_parallel_trains_like_the_serial_run(tensor_parallel, layout):
    """tests/test_parallel.py's bounds: losses and gradient norms within 1e-5 relative at every step, every final
    parameter within 1e-5 (||a - b|| / ||b||, b's scale at least 1e-3 per entry)."""
    got = tensor_parallel[layout]
    assert "error" not in got, got.get("error")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # as the workers run
    try:
        want = parity.run(ARGS)
    finally:
        torch.set_num_threads(threads)
    for key in ("losses", "grad_norms"):
        assert len(got[key]) == 3
        for step, (a, b) in enumerate(zip(got[key], want[key])):
            assert abs(a - b) <= 1e-5 * abs(b), f"{key} at step {step}: {a} vs serial {b}"
    assert got["params"].keys() == want["params"].keys()
    for name, b in want["params"].items():
        a = got["params"][name]
        assert (a - b).norm() <= 1e-5 * max(b.norm().item(), 1e-3 * b.numel() ** 0.5), name
    # each rank holds half of the parameters (norms aside): were the MLP's matrices (a seventh of the model)
    # replicated rather than split as the kind declares, it would hold 0.63 of them
    assert got["bytes"][0] < 0.55 * want["bytes"][0], (got["bytes"], want["bytes"])


if __name__ == "__main__":
    parity.main(sys.argv[1], sys.argv[2])
