"""A parallel run's checkpoint as whole parameters, in one process: for sampling and evaluation.

A parallel checkpoint holds each rank's local shards by name (`params-rank0000N.safetensors`) and, in
meta.json, the config and layout. The sharding plan is data, so the shard of every rank can be
placed back without any process group: rank r sits at coordinate unravel(r) of the mesh (torchrun's
order, row-major, as `init_device_mesh` lays it out), and each mesh dim that shards a tensor splits
one of its dims in DTensor's chunks. (Resharding into another layout is the same idea, and a later
step; this reads the parameters only.)
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from nanomega.checkpoint import CheckpointMismatch, read_meta
from nanomega.config import from_dict
from nanomega.models import init
from nanomega.parallel.mesh import expert_grid, mesh_shapes, model_config
from nanomega.parallel.plan import layout_of, shard_index
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


def whole_params(path) -> tuple[dict, dict]:
    """(params tree of whole tensors for the run's serial model config, meta) of a checkpoint directory."""
    path = Path(path)
    meta = read_meta(path)
    cfg = from_dict(meta["config"])
    world = meta.get("world_size", 1)
    if world != cfg.parallel.world_size or world == 1:
        raise CheckpointMismatch(f"checkpoint {path.name} is not a parallel checkpoint of its config "
                                 f"(world_size {world}); read it with checkpoint.load")
    like = init(model_config(cfg), device="meta")    # the shapes the ranks trained (vocabulary padded for tp)
    mesh, experts = mesh_shapes(cfg)                    # stacked experts live on the expert mesh
    sizes = mesh.shape
    expert_ranks = expert_grid(cfg)[1] if experts is not None else None
    whole = {n: torch.empty(p.shape) for n, p in named_leaves(like).items()}
    for rank in range(world):
        coords = [int(c) for c in torch.unravel_index(torch.tensor(rank), tuple(sizes))]
        expert_coords = [int(c) for c in (expert_ranks == rank).nonzero()[0]] if experts is not None else None
        with safe_open(str(path / f"params-rank{rank:05d}.safetensors"), framework="pt") as f:
            for n in f.keys():      # a pipeline stage's rank holds its own stage's parameters only
                t = whole[n]
                layout = layout_of(n, t.shape, mesh, cfg, experts)
                on_experts = layout.mesh is experts     # the main mesh's layouts point at `mesh`
                index = shard_index(t.shape, layout.storage, *((expert_ranks.shape, expert_coords) if on_experts
                                                                 else (sizes, coords)))
                t[index] = f.get_tensor(n)
    # Tensor parallel may have padded the vocabulary further; those rows are zero (never trained).
    serial = named_leaves(init(cfg.model, device="meta"))
    out = {n: whole[n][:serial[n].shape[0]] if whole[n].shape != serial[n].shape else whole[n] for n in whole}
    _, spec = tree_flatten(init(cfg.model, device="meta"))
    return tree_unflatten([out[n] for n in serial], spec), meta
