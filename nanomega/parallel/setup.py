"""A rank's share of the run: the process group, the mesh, its parameters and its optimizer.

    params, opt, par = setup_parallel(cfg, model_cfg, device)    # under torchrun; train.py's setup()

Every rank draws only its shard of each parameter, on the CPU (`init(..., place=...)`, parallel.plan's
shard_index saying which part): the numbers are the serial run's, bitwise (models/init_streams.py), and
no rank draws or holds a whole parameter it does not keep. Under --train.init_from nothing random is
drawn: the Hugging Face weights overwrite it. `par` is what the step needs to run on the mesh
(parallelize.Layout): a `Parallel`, or under pipeline parallel a `Pipeline` (pipeline.py) holding this
rank's stages and, inside them, a `Parallel` over the stage's own sub-mesh when the other dims are used too.
"""
from __future__ import annotations

import contextlib

import torch

from nanomega import optim
from nanomega.config import Config
from nanomega.models import init
from nanomega.parallel.mesh import build_mesh, init_distributed, stage_mesh
from nanomega.parallel.optimizer import ParallelOptimizer
from nanomega.parallel.parallelize import Parallel
from nanomega.parallel.pipeline import Pipeline
from nanomega.tree import leaf_names


def setup_parallel(cfg: Config, model_cfg, device: torch.device, tensors=contextlib.nullcontext):
    """(params, opt, par) for this rank; model_cfg is parallel.mesh.model_config(cfg) (the padded vocabulary).
    The parameters are drawn inside `tensors()` (nanomega/sim/contracts.py: fake ones); the mesh, its process
    groups and the plan outside it, since they read the rank grid's values."""
    init_distributed(device)
    # a check on the meta device (nanomega/sim/contracts.py) keeps its mesh on the CPU: DTensor needs a device handle
    mesh = build_mesh(cfg, "cpu" if device.type == "meta" else device.type)
    if cfg.parallel.pp > 1:
        return setup_pipeline(cfg, model_cfg, mesh, device, tensors)
    par = Parallel(cfg, mesh, init(model_cfg, device="meta"))
    with tensors():
        params = init(model_cfg, cfg.train.seed, "cpu", place=lambda name, part: par.shard(name, part, device),
                      random=not cfg.train.init_from)
    return params, ParallelOptimizer(cfg, par, cfg.train.steps), par


def setup_pipeline(cfg: Config, model_cfg, mesh, device: torch.device, tensors=contextlib.nullcontext):
    """Under pipeline parallel: this rank's stages and their parameters, sharded within the stage's mesh if
    it has one; the Pipeline is `par`."""
    pipe = Pipeline(cfg, mesh, model_cfg)
    mine = pipe.keep(pipe.whole)
    sub = stage_mesh(mesh)
    pipe.par = Parallel(cfg, sub, mine) if sub is not None else None
    names = set(leaf_names(mine))

    def place(name, part):   # this rank's stages' parameters only, each drawn as the stage's mesh shards it
        if name not in names:
            return None
        return pipe.par.shard(name, part, device) if pipe.par else part().to(device).requires_grad_(True)
    with tensors():
        params = pipe.keep(init(model_cfg, cfg.train.seed, "cpu", place=place, random=not cfg.train.init_from))
    if pipe.par is not None:
        opt = ParallelOptimizer(cfg, pipe.par, cfg.train.steps, over_stages=pipe.norm_over_stages)
    else:
        opt = optim.build(cfg.optim, cfg.train.steps, norm=pipe.global_norm)
    return params, opt, pipe
