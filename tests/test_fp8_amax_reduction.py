"""Delayed fp8 scaling reduces its amaxes once per step, not once per operand, linear and micro-batch.

Each layout's real step runs for one simulated rank on torch's fake process group under FakeTensorMode (as
nanomega/sim/estimate.py and nanomega/sim/contracts.py run it: every collective completes at once, nothing is
allocated), and a dispatch mode records every collective issued from parallel/fp8.py (the amax syncs and the
histories' reduction) with the size of its group. The expected counts are derived from the model:

    first step   (histories empty: this step's amaxes scale it, so each is synced as it is taken)
                 per float8 linear and micro-batch, one for each of x and w (forward) and dy (backward)
                 that some mesh dim splits: 3 under FSDP x TP
    later steps  1: every history's newest column over the stage's whole mesh (parallel/fp8.py, "the group")

The values are the parity tests' to check (tests/test_parallel.py, tests/test_pipeline.py: the delayed cases,
whose final parameters include every history).
"""
from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import parity
from nanomega.config import parse_args
from nanomega.sim.estimate import _in_child
from nanomega.sim.fake_world import fake_world
from nanomega.models import init
from nanomega.models.fp8 import is_amax_history
from nanomega.parallel.mesh import model_config
from nanomega.train.step import make_step_fns, step_options
from nanomega.tree import leaf_names

DELAYED = ["--model.fp8=delayed", "--model.fp8_amax_history=4"]
# (args, world size, ranks of one pipeline stage, amaxes synced per linear and micro-batch on the first step:
# those of the operands some mesh dim splits; FSDP's weights are gathered whole before the linear)
LAYOUTS = {
    # tokens over dp_shard (x, dy), features over tp (w; x of a row-parallel linear, dy of a column-parallel one)
    "fsdp2_tp2": (["--parallel.dp_shard=2", "--parallel.tp=2"], 4, 4, 3),
    # sequence parallel gathers the sequence before a column-parallel linear (x whole; w and dy split on N) and
    # a row-parallel output's gradient comes back whole (x and w split on K): wq, wk, wv, w_gate, w_up are
    # column-parallel, wo and w_down row-parallel
    "tp2_sp": (["--parallel.tp=2", "--parallel.sequence_parallel=true"], 2, 2, 2),
    # tokens over dp_shard (x, dy); each stage reduces its own blocks' histories over its own ranks
    "pp2_fsdp2": (["--parallel.pp=2", "--parallel.dp_shard=2"], 4, 2, 2),
}
FP8_MODULE = os.path.join("nanomega", "parallel", "fp8.py")


class AmaxCollectives(TorchDispatchMode):
    """Each collective issued from parallel/fp8.py: (step, op, size of its process group)."""

    def __init__(self):
        super().__init__()
        self.step, self.calls = None, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d") and func._overloadpacket.__name__ != "wait_tensor" and \
                any(frame.filename.endswith(FP8_MODULE) for frame in traceback.extract_stack()):
            group = dist.distributed_c10d._resolve_process_group(args[-1])
            self.calls.append((self.step, func._overloadpacket.__name__, group.size()))
        return func(*args, **(kwargs or {}))


def record(args: list[str], world: int, rank: int, steps: int = 3) -> list:
    """The amax collectives of `steps` train steps of BASE + DELAYED + args on `rank` of `world`, simulated."""
    cfg = parse_args(parity.BASE + DELAYED + args)
    device, fake, mode = torch.device("cpu"), FakeTensorMode(allow_non_fake_inputs=True), AmaxCollectives()
    with fake_world(world, rank):
        from nanomega.parallel.setup import setup_parallel   # registers the hints' runtimes
        model_cfg = model_config(cfg)
        params, opt, par = setup_parallel(cfg, model_cfg, device, lambda: fake)
        with fake, mode:
            state = opt.init(params)
            fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(cfg.train), "compile": False})
            t = cfg.train
            for step in range(steps):
                mode.step = step
                micro = []
                for _ in range(t.grad_accum):
                    tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1))
                    micro.append((tokens[:, :-1], tokens[:, 1:]))
                _, grads, stats = fns.grads(params, micro)
                params, state = fns.update(grads, state, params, stats)
    return mode.calls, leaf_names(params)


def histories(names) -> int:
    """How many float8 linears scale by delayed scaling: one amax history each."""
    return sum(is_amax_history(n) for n in names)


@pytest.mark.parametrize("layout", [name if name == "fsdp2_tp2" else pytest.param(name, marks=pytest.mark.slow)
                                    for name in LAYOUTS])        # one layout fast (4 s), the others slow
def test_delayed_scaling_reduces_its_amaxes_once_per_step_after_the_first(layout):
    args, world, stage, synced = LAYOUTS[layout]
    calls, names = _in_child(record, args, world, 0)
    cfg = parse_args(parity.BASE + DELAYED + args)
    # every block's 7 linears (wq, wk, wv, wo, w_gate, w_up, w_down) run in float8
    assert histories(leaf_names(init(model_config(cfg), device="meta"))) == 7 * cfg.model.n_layers
    linears = histories(names)                    # this rank's: its pipeline stage's blocks
    assert linears > 0
    per_step = [[c for c in calls if c[0] == step] for step in range(3)]
    # the first step: every amax synced as it is taken (of x, w, dy: those split over some rank)
    assert len(per_step[0]) == synced * linears * cfg.train.grad_accum, per_step[0]
    assert all(op == "all_reduce" for _, op, _ in per_step[0])
    # after it: one all-reduce (max) of all the histories' newest amaxes, over the stage's whole mesh
    for step in (1, 2):
        assert [(op, size) for _, op, size in per_step[step]] == [("all_reduce", stage)], per_step[step]
