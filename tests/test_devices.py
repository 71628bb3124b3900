"""CUDA readiness, checked without a GPU.

- Each torchrun rank picks GPU LOCAL_RANK, queries its memory there and binds its process group to it:
  nothing opens a context on GPU 0 for another rank (torch.cuda is replaced by recorders).
- The train step (gradients and optimizer update, dense and MoE, five optimizers) runs with every
  tensor on the "meta" device, and every optimizer state tensor sits on the parameters' device after
  init and after the update. The device check is what catches a mix-up: a 0-dim CPU tensor (a step
  count, say) mixes with tensors of any device in most ops, so running on meta alone would not fail.
"""
from __future__ import annotations

import pytest
import torch

import parity
from nanomega.run import preflight
from nanomega import optim
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel import mesh
from nanomega.train.step import make_step_fns
from nanomega.tree import named_leaves


@pytest.fixture
def rank3_of_4(monkeypatch):
    """A process torchrun started as local rank 3 on a machine whose CUDA is mocked."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_a_rank_picks_its_own_gpu(rank3_of_4):
    assert mesh.pick_device("auto") == torch.device("cuda", 3)
    assert mesh.pick_device("cuda") == torch.device("cuda", 3)
    assert mesh.pick_device("cuda:1") == torch.device("cuda", 1)    # an explicit index is kept
    assert mesh.pick_device("cpu") == torch.device("cpu")


def test_the_memory_query_asks_the_ranks_own_gpu(rank3_of_4, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (1, 80 * 2**30))
    assert preflight.available_memory(mesh.pick_device("auto")) == 80 * 2**30
    assert asked == [torch.device("cuda", 3)]


def test_the_process_group_is_bound_to_the_ranks_gpu(rank3_of_4, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, device_id=None: calls.append(("init", backend, device_id)))
    mesh.init_distributed(mesh.pick_device("auto"))
    mesh.init_distributed("cuda")       # a bare device type means this rank's GPU too
    gpu = torch.device("cuda", 3)
    assert calls == [("set_device", gpu), ("init", "nccl", gpu)] * 2


MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32", "--model.shared_ffn_dim=32",
       "--model.aux_loss_coef=0.01", "--model.z_loss_coef=0.001", "--model.expert_bias_rate=0.01"]
CASES = [(opt, family) for opt in ("adamw", "muon", "soap", "shampoo", "sgd") for family in ("dense", "moe")]


def off_device(tree, device: torch.device) -> dict:
    return {n: x.device for n, x in named_leaves(tree).items() if x.device != device}


@pytest.mark.parametrize("opt_name,family", CASES)
def test_the_train_step_runs_on_the_parameters_device(opt_name, family):
    cfg = parse_args(parity.BASE + [f"--optim.name={opt_name}", "--optim.sgd.momentum=0.9"]
                     + (MOE if family == "moe" else []))
    meta = torch.device("meta")
    params = init(cfg.model, cfg.train.seed, meta)
    opt = optim.build(cfg.optim, cfg.train.steps)
    state = opt.init(params)
    assert off_device(state, meta) == {}
    fns = make_step_fns(cfg.model, opt)
    micro = [(x.to(meta), y.to(meta)) for x, y in parity.batches(cfg, 0)]
    loss, grads, stats = fns.grads(params, micro)
    new_params, new_state = fns.update(grads, state, params, stats)
    assert loss.device == meta and off_device(grads, meta) == {} and off_device(stats, meta) == {}
    assert off_device(new_params, meta) == {}
    assert off_device(new_state, meta) == {}
    # the update produced a new state of the same structure (every stage ran, none was skipped)
    assert named_leaves(new_state).keys() == named_leaves(state).keys()
    assert all(a is not b for a, b in zip(named_leaves(new_state).values(), named_leaves(state).values())
               if a.ndim == 0)
