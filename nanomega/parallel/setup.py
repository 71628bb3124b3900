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
    groups and the plan outside it, since they read the rank grid's values. Under pipeline parallel only this
    rank's stages are drawn, sharded within the stage's mesh if it has one, and the Pipeline is `par`."""
    init_distributed(device)
    # a check on the meta device (nanomega/sim/contracts.py) keeps its mesh on the CPU: DTensor needs a device handle
    mesh = build_mesh(cfg, "cpu" if device.type == "meta" else device.type)
    pipe = Pipeline(cfg, mesh, model_cfg) if cfg.parallel.pp > 1 else None
    mine = init(model_cfg, device="meta") if pipe is None else pipe.keep(pipe.whole)
    sub = mesh if pipe is None else stage_mesh(mesh)
    par = Parallel(cfg, sub, mine) if sub is not None else None
    names = set(leaf_names(mine))

    def place(name, part):   # this rank's parameters only, each drawn as its mesh shards it
        if name not in names:
            return None
        return par.shard(name, part, device) if par else part().to(device).requires_grad_(True)
    with tensors():
        params = init(model_cfg, cfg.train.seed, "cpu", place=place, random=not cfg.train.init_from)
    if pipe is None:
        return params, ParallelOptimizer(cfg, par, cfg.train.steps), par
    pipe.par = par
    if par is not None:
        opt = ParallelOptimizer(cfg, par, cfg.train.steps, over_stages=pipe.norm_over_stages)
    else:
        opt = optim.build(cfg.optim, cfg.train.steps, norm=pipe.global_norm)
    return pipe.keep(params), opt, pipe
