"""Adding an optimizer is one file: Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"),
defined and registered here alone, trains, is checked, counted, sharded and resumed by the code as it is.

    c = b1 m + (1 - b1) g;  update = sign(c);  m <- b2 m + (1 - b2) g;  p <- p - lr (update + wd p)

Nothing outside this file names Lion: the registry (nanomega/optim/registry.py) carries it to config
checking, the memory accountant (sim/rank_bytes.py), the parallel optimizer and the checkpoints. The
2-process cases run this file under torchrun (its __main__ is tests/parity.py's worker), so the workers
register Lion by importing it, as any user's own optimizer module would be imported. docs/extending.md
walks through it.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import parity                                                   # noqa: E402
from tiers import slow                                          # noqa: E402
from nanomega import optim                                      # noqa: E402
from nanomega.config import OptimConfig, parse_args            # noqa: E402
from nanomega.optim import GradientTransformation, Optimizer, register, setting   # noqa: E402
from nanomega.optim.base import tree_zeros_like                 # noqa: E402
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten   # noqa: E402


# ---------------------------------------------------------------- the optimizer: all a new one needs

class LionState(NamedTuple):
    mu: dict


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, state_dtype=None) -> GradientTransformation:
    """updates -> sign(b1 m + (1 - b1) g), then m <- b2 m + (1 - b2) g (one buffer: half Adam's state)."""
    def init(params):
        return LionState(tree_zeros_like(params, state_dtype))

    def update(updates, state, params=None):
        g, spec = tree_flatten(updates)
        stored, mu_spec = tree_flatten(state.mu)
        m = [s.to(x.dtype) for s, x in zip(stored, g)]            # the maths in the gradient's dtype
        out = [torch.sign(torch.lerp(x, mi, b1)) for x, mi in zip(g, m)]
        mu = [torch.lerp(x, mi, b2).to(s.dtype) for x, mi, s in zip(g, m, stored)]
        return tree_unflatten(out, spec), LionState(tree_unflatten(mu, mu_spec))

    return GradientTransformation(init, update)


@dataclass(frozen=True)
class LionSettings:
    b1: float = setting(0.9, "[0, 1)", "the interpolation that is signed")
    b2: float = setting(0.99, "[0, 1)", "the momentum's EMA (Lion's own default, not Adam's)")


register(Optimizer("lion", LionSettings,
                   lambda s, state_dtype, parts: {"lion": scale_by_lion(s.b1, s.b2, state_dtype)}))


# ---------------------------------------------------------------- serial: the update rule, in float64

def test_lion_trains_as_its_update_rule_in_float64():
    """optim.build's Lion (clip off, constant lr, decoupled decay except on norms) against the rule written
    out in float64 on the same gradients, 20 steps: equal to fp32 rounding (no sign flips on these draws)."""
    gen = torch.Generator().manual_seed(0)
    params = {"layers": [{"w": torch.randn(8, 6, generator=gen), "norm": {"weight": torch.randn(6, generator=gen)}}]}
    grads = [{"layers": [{"w": torch.randn(8, 6, generator=gen), "norm": {"weight": torch.randn(6, generator=gen)}}]}
             for _ in range(20)]
    lr, wd, b1, b2 = 1e-2, 0.1, 0.8, 0.95
    opt = optim.build(OptimConfig(name="lion", lr=lr, weight_decay=wd, grad_clip=0.0, schedule="constant",
                                  warmup_steps=0, b1=b1, b2=b2), 20)
    state = opt.init(params)
    ref = {n: p.double() for n, p in named_leaves(params).items()}
    mom = {n: torch.zeros_like(p) for n, p in ref.items()}
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
        for n, gn in named_leaves(g).items():
            gn = gn.double()
            decay = 0.0 if "norm" in n else wd
            ref[n] = ref[n] - lr * (torch.sign(b1 * mom[n] + (1 - b1) * gn) + decay * ref[n])
            mom[n] = b2 * mom[n] + (1 - b2) * gn
    for n, p in named_leaves(params).items():
        torch.testing.assert_close(p.double(), ref[n], rtol=1e-6, atol=1e-6)
    for n, m in named_leaves(state["lion"].mu).items():
        torch.testing.assert_close(m.double(), mom[n], rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- config: its own settings, checked

def test_lion_has_its_own_settings_and_defaults():
    assert optim.check(OptimConfig(name="lion")) == LionSettings(b1=0.9, b2=0.99)   # not Adam's beta2=0.95
    assert optim.check(parse_args(["--optim.name=lion", "--optim.b2=0.98"]).optim).b2 == 0.98
    assert optim.check(parse_args(["--optim.name=lion", "--optim.b1=0"]).optim).b1 == 0.0   # an int, typed float


@pytest.mark.parametrize("args, message", [
    (["--optim.name=lino"], "optim.name='lino' is not a registered optimizer; known: adamw, lion, muon, sgd, "
                            "shampoo, soap"),
    (["--optim.name=lion", "--optim.beta2=0.9"], "optim.beta2 is not read by lion; lion reads optim.b1, optim.b2"),
    (["--optim.name=adamw", "--optim.b2=0.9"], "optim.b2 is not read by adamw; adamw reads optim.beta1"),
    (["--optim.name=lion", "--optim.b2=1"], "optim.b2=1.0 must lie in [0, 1)"),
])
def test_config_refuses_an_unknown_optimizer_and_a_setting_it_does_not_read(args, message):
    """Refused by the first check of train.py's preflight (validate_layout), before any work."""
    from nanomega.parallel.mesh import validate_layout
    with pytest.raises(ValueError) as err:
        validate_layout(parse_args(args))
    assert message in str(err.value)


# ---------------------------------------------------------------- memory: its state, counted

def test_the_memory_estimate_counts_lion_state_by_hand():
    """One fp32 buffer per parameter element (4 bytes), plus the chain's two scalars: the clip's fp32 norm and
    the learning rate's int64 count; under dp_shard=2 each rank holds half of every buffer (the dims split
    evenly here), the scalars whole."""
    from nanomega.sim.counting import count_params
    from nanomega.sim.rank_bytes import bytes_per_rank
    cfg = parse_args(parity.BASE + ["--optim.name=lion", "--model.vocab_size=256"])
    n = count_params(cfg.model)
    assert bytes_per_rank(cfg).state == 4 * n + 4 + 8
    sharded = parse_args(parity.BASE + ["--optim.name=lion", "--model.vocab_size=256", "--parallel.dp_shard=2"])
    assert bytes_per_rank(sharded).state == 4 * n / 2 + 4 + 8
    bf16 = parse_args(parity.BASE + ["--optim.name=lion", "--model.vocab_size=256", "--optim.state_dtype=bfloat16"])
    assert bytes_per_rank(bf16).state == 2 * n + 4 + 8


# ---------------------------------------------------------------- two ranks: FSDP and ZeRO-1 against serial

LAYOUTS = {"fsdp2": ["--parallel.dp_shard=2"],
           "zero1": ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"]}
LION = ["--optim.name=lion", "--optim.b1=0.8"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One torchrun launch of this file (its __main__: parity.main) with every layout, each as a training run
    and as the optimizer alone on seeded gradients; {case name: result}."""
    from ranks import crash_report, torchrun
    out = tmp_path_factory.mktemp("lion")
    cases = [{"name": f"{kind}-{layout}", "kind": kind, "args": args + LION}
             for layout, args in LAYOUTS.items() for kind in ("train", "optimizer")]
    proc = torchrun(2, Path(__file__), out, json.dumps(cases), timeout=900)
    assert proc.returncode == 0, crash_report(proc.stderr)
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


@slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lion_on_two_ranks_is_the_serial_optimizer(two_ranks, layout):
    """The optimizer alone, on the same seeded gradients: element-wise on each rank's shard (FSDP) or slice
    (ZeRO-1), then gathered, it is the serial Lion bit for bit."""
    got, want = two_ranks[f"optimizer-{layout}"], parity.run_optimizer(LION)
    assert "error" not in got, got.get("error")
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), name


@slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lion_on_two_ranks_trains_like_the_serial_run(two_ranks, layout):
    """Training: losses and gradient norms as the serial run's (1e-5), and each rank holds what the plan
    counts (sim/rank_bytes.py: parameters, gradients, Lion's sharded state)."""
    from nanomega.sim.rank_bytes import bytes_per_rank
    got, want = two_ranks[f"train-{layout}"], parity.run(LION)
    assert "error" not in got, got.get("error")
    for a, b in zip(got["losses"] + got["grad_norms"], want["losses"] + want["grad_norms"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    plan = bytes_per_rank(parse_args(parity.BASE + LAYOUTS[layout] + LION))
    assert got["bytes"] == [plan.params, plan.grads, plan.state]


# ---------------------------------------------------------------- resume: bitwise through train.py

def test_lion_resumes_bitwise(corpus, tmp_path):
    """4 straight steps == 2 steps, a checkpoint, and a resumed run to 4: losses and files bit for bit."""
    import train as train_script
    from nanomega.run.metrics import read_metrics
    out = tmp_path / "run"
    cfg = parse_args(["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.ffn_dim=64",
                      "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=4", "--train.compile=false",
                      "--train.eval_batches=2", "--train.sample_tokens=0", "--train.log_every=1",
                      "--train.peak_flops=1e12", "--optim.warmup_steps=2", f"--data.path={corpus}",
                      f"--data.cache_dir={corpus.parent}", f"--train.out_dir={out}", "--train.steps=4",
                      "--train.ckpt_every=2", "--train.eval_every=2", "--train.keep_checkpoints=5", *LION])
    train_script.train(cfg, quiet=True)
    straight = tmp_path / "straight-00000004"
    shutil.move(out / "ckpt-00000004", straight)        # as if the run had died after step 2
    straight_losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}
    train_script.train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=True)), quiet=True)
    records = read_metrics(out / "metrics.jsonl")[4:]
    assert [r["step"] for r in records] == [3, 4]
    assert all(r["loss"] == straight_losses[r["step"]] for r in records)
    for file in ("params.safetensors", "optim.safetensors"):
        a, b = load_file(straight / file), load_file(out / "ckpt-00000004" / file)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), file
    assert any(k.startswith("lion.mu.") for k in load_file(straight / "optim.safetensors"))


if __name__ == "__main__":      # a torchrun worker: Lion is registered above; parity runs the cases
    parity.main(sys.argv[1], sys.argv[2])
