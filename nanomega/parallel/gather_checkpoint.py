"""A parallel run's checkpoint as whole parameters, in one process: for sampling and evaluation.

A parallel checkpoint holds each rank's local shards by name (`params-rank0000N.safetensors`), and each rank
file's header records where each of its pieces lies in the whole tensor (its global shape and offset:
checkpoint.files' boxes). A whole tensor is those pieces put back in their places, one tensor at a time
(`open_tensors`), with no process group and nothing to know of the layout that cut them.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open

from nanomega.checkpoint import PARAMS_FILE, CheckpointMismatch, check_readable, read_meta
from nanomega.checkpoint.files import pieces_from_headers
from nanomega.config import from_dict
from nanomega.models import init
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
    put together from the rank files' pieces one tensor at a time. The files are memory-mapped (safe_open), so
    what is held is that one tensor: an export of a model larger than host memory writes it tensor by
    tensor (nanomega/hf/transfer.py)."""
    path = Path(path)
    meta = read_meta(path)
    cfg = from_dict(meta["config"])
    world = meta.get("world_size", 1)
    if world != cfg.parallel.world_size or world == 1:
        raise CheckpointMismatch(f"checkpoint {path.name} is not a parallel checkpoint of its config "
                                 f"(world_size {world}); read it with checkpoint.load")
    check_readable(path)     # its rank files record where their pieces lie
    serial = named_leaves(init(cfg.model, device="meta"))
    pieces = pieces_from_headers(path, PARAMS_FILE)     # name -> [(file, global shape, offset, local shape)]
    with contextlib.ExitStack() as stack:
        files = {}

        def read(name: str) -> torch.Tensor:
            t = torch.empty(pieces[name][0][1])         # the shape the ranks trained (vocab padded for tp)
            for file, _, offset, local in pieces[name]:
                if file not in files:
                    files[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                t[tuple(slice(o, o + n) for o, n in zip(offset, local))] = files[file].get_tensor(name)
            # Tensor parallel may have padded the vocabulary further; those rows are zero (never trained).
            return t[:serial[name].shape[0]] if t.shape != serial[name].shape else t
        yield read
