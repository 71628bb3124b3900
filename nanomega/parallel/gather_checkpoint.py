"""A parallel run's checkpoint as whole parameters, in one process: for sampling and evaluation.

A parallel checkpoint holds each rank's local shards by name (`params-rank0000N.safetensors`) and, in
meta.json, the config and layout. The sharding plan is data, so the shard of every rank can be
placed back without any process group: rank r sits at coordinate unravel(r) of the mesh (torchrun's
order, row-major, as `init_device_mesh` lays it out), and each mesh dim that shards a tensor splits
one of its dims in DTensor's chunks, one tensor at a time (`open_tensors`). (Resharding into another
layout is the same idea, and a later step; this reads the parameters only.)
"""
from __future__ import annotations

import contextlib
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
    meta = read_meta(path)
    like = init(from_dict(meta["config"]).model, device="meta")
    with open_tensors(path) as read:
        params = tree_unflatten([read(n) for n in named_leaves(like)], tree_flatten(like)[1])
    return params, meta


@contextlib.contextmanager
def open_tensors(path):
    """Yields read(name): the whole tensor `name` (the serial model's shape) of a parallel checkpoint,
    put together from the rank files one tensor at a time. The files are memory-mapped (safe_open), so
    what is held is that one tensor: an export of a model larger than host memory writes it tensor by
    tensor (nanomega/hf/transfer.py)."""
    path = Path(path)
    meta = read_meta(path)
    cfg = from_dict(meta["config"])
    world = meta.get("world_size", 1)
    if world != cfg.parallel.world_size or world == 1:
        raise CheckpointMismatch(f"checkpoint {path.name} is not a parallel checkpoint of its config "
                                 f"(world_size {world}); read it with checkpoint.load")
    like = named_leaves(init(model_config(cfg), device="meta"))  # the shapes the ranks trained (vocab padded for tp)
    serial = named_leaves(init(cfg.model, device="meta"))
    mesh, experts = mesh_shapes(cfg)                    # stacked experts live on the expert mesh
    expert_ranks = expert_grid(cfg)[1] if experts is not None else None
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(path / f"params-rank{rank:05d}.safetensors"), framework="pt"))
                 for rank in range(world)]
        held = [set(f.keys()) for f in files]           # a pipeline stage's rank holds its own stage's parameters

        def read(name: str) -> torch.Tensor:
            t = torch.empty(like[name].shape)
            layout = layout_of(name, t.shape, mesh, cfg, experts)
            on_experts = layout.mesh is experts         # the main mesh's layouts point at `mesh`
            for rank, f in enumerate(files):
                if name not in held[rank]:
                    continue
                if on_experts:
                    grid, coords = expert_ranks.shape, [int(c) for c in (expert_ranks == rank).nonzero()[0]]
                else:
                    grid, coords = mesh.shape, [int(c) for c in torch.unravel_index(torch.tensor(rank), mesh.shape)]
                t[shard_index(t.shape, layout.storage, grid, coords)] = f.get_tensor(name)
            # Tensor parallel may have padded the vocabulary further; those rows are zero (never trained).
            return t[:serial[name].shape[0]] if t.shape != serial[name].shape else t
        yield read
