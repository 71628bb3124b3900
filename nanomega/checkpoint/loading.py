"""Loading: every tensor checked by name, shape and dtype against freshly initialised trees; any layout
into any other, each rank reading only the byte ranges of the stored pieces that overlap its own.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from nanomega.checkpoint.files import (BOXES, FORMAT, INDEX_FILE, LAST_OLD_READER, OPTIM_FILE, PARAMS_FILE,
                                       CheckpointMismatch, box, pieces_from_headers, rank_files, read_meta)
from nanomega.checkpoint.integrity import FILES, check_intact
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


def _load_tree(path: Path, file: str, like, owner: str, requires_grad: bool):
    """The tree `like` describes, from `file`."""
    _, spec = tree_flatten(like)
    expected = named_leaves(like)
    hint = "the checkpoint was written with a different config (see its meta.json)"
    with safe_open(str(path / file), framework="pt", device="cpu") as f:
        stored = set(f.keys())
        if missing := [n for n in expected if n not in stored]:
            raise CheckpointMismatch(f"checkpoint {path.name} lacks tensor {missing[0]!r} ({len(missing)} missing in all), "
                             f"which {owner} expects in {file}; {hint}")
        if extra := sorted(stored - set(expected)):
            raise CheckpointMismatch(f"checkpoint {path.name} has tensor {extra[0]!r} ({len(extra)} unexpected in all) "
                             f"in {file}, which {owner} does not have; {hint}")
        out = []
        for name, ref in expected.items():
            dref, ref = ref, ref.to_local() if isinstance(ref, DTensor) else ref
            t = f.get_tensor(name)
            if t.shape != ref.shape:
                raise CheckpointMismatch(f"checkpoint {path.name} tensor {name!r} has shape {tuple(t.shape)} but {owner} "
                                 f"expects {tuple(ref.shape)}; {hint}")
            if t.dtype != ref.dtype:
                raise CheckpointMismatch(f"checkpoint {path.name} tensor {name!r} has dtype {t.dtype} but {owner} "
                                 f"expects {ref.dtype}; {hint}")
            out.append(placed_like(t, dref, requires_grad))
    return tree_unflatten(out, spec)


def placed_like(t: torch.Tensor, like, requires_grad: bool) -> torch.Tensor:
    """A loaded local tensor on `like`'s device, as a DTensor with its placements if it is one. A "meta"
    like-tree (init(cfg, device="meta")) describes shapes only; such leaves stay on the CPU."""
    local = like.to_local() if isinstance(like, DTensor) else like
    t = t if local.device.type == "meta" else t.to(local.device)
    if isinstance(like, DTensor):
        t = DTensor.from_local(t, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                               stride=like.stride())
    return t.requires_grad_(True) if requires_grad else t


def load(path, params_like, opt_state_like=None, rank: int = 0, world_size: int = 1, layout: dict | None = None,
         state_box=None):
    """(params, opt_state, meta), checked name by name against freshly initialized trees (e.g. init(cfg),
    opt.init(params)) that give structure, shapes, dtypes and devices. Values are bitwise as saved.
    opt_state_like=None loads the parameters only (sampling, evaluation) and returns opt_state None.
    A parallel run passes its rank, world size and `layout`; a checkpoint of another layout is resharded."""
    path = Path(path)
    check_intact(path, checksummed=lambda meta: ())       # lengths and headers: what check_readable reads
    check_readable(path)                                  # before the checksums read every byte
    check_intact(path, checksummed=lambda meta: _read_whole(meta, rank, world_size, layout))
    meta = read_meta(path)
    if meta.get("world_size") != world_size or meta.get("layout") != layout:
        params = _load_resharded(path, PARAMS_FILE, params_like, "the model", requires_grad=True)
        opt_state = None if opt_state_like is None else _load_resharded(path, OPTIM_FILE, opt_state_like,
                                                                        "the optimizer state", requires_grad=False,
                                                                        box_of=state_box)
        return params, opt_state, meta
    params_file, optim_file = (PARAMS_FILE, OPTIM_FILE) if world_size == 1 else rank_files(rank)
    params = _load_tree(path, params_file, params_like, "the model", requires_grad=True)
    opt_state = None if opt_state_like is None else _load_tree(path, optim_file, opt_state_like,
                                                                "the optimizer state", requires_grad=False)
    return params, opt_state, meta


def check_readable(path) -> None:
    """Refuse, naming what to do, a checkpoint this version does not read: another format than FORMAT (format 1
    named the optimizer state by the position of its transform in the chain, "1.mu.<param>"), or a parallel
    checkpoint written before resharding existed, whose rank files do not record where their pieces lie. Both
    were read by nanomega up to commit LAST_OLD_READER."""
    path = Path(path)
    meta = read_meta(path)
    older = f"retrain, or resume it with nanomega at commit {LAST_OLD_READER}, the last that reads it"
    if meta.get("format") == 1:
        raise CheckpointMismatch(
            f"checkpoint {path.name} is format 1 (optimizer state named by its position in the chain, "
            f"'1.mu.<param>'), which this version no longer reads; {older}")
    if meta.get("format") != FORMAT:
        raise CheckpointMismatch(f"checkpoint {path.name} has format {meta.get('format')}; this version reads "
                                 f"format {FORMAT} only")
    if meta.get("world_size", 1) > 1:
        with safe_open(str(path / rank_files(0)[0]), framework="pt") as f:
            if BOXES not in (f.metadata() or {}):
                raise CheckpointMismatch(
                    f"checkpoint {path.name} was written by a parallel run before resharding existed (its rank files "
                    f"do not record where their pieces lie), which this version no longer reads; {older}, in the "
                    f"layout it was written with (world_size {meta['world_size']}, layout {meta.get('layout')})")


def _read_whole(meta: dict, rank: int, world_size: int, layout) -> set | None:
    """The files whose checksum a loading rank checks before reading (every file's header and length are
    checked): a parallel rank in the checkpoint's own layout reads only its two files; a resharding rank of a
    parallel run its share, every world_size-th file (each file is read in full once over the job, not once per
    rank: a damaged one stops the rank that found it, and torchrun the job); one process, every file (None)."""
    if world_size == 1:
        return None
    if meta.get("world_size") == world_size and meta.get("layout") == layout:
        return set(rank_files(rank))
    return set(sorted(meta.get(FILES, {}))[rank::world_size])


# ---------------------------------------------------------------- resharding: any layout into any other

def _pieces(path: Path, kind: str) -> dict:
    """{name: [(file, global shape, offset, local shape)]} over the checkpoint's files of `kind`
    (PARAMS_FILE or OPTIM_FILE, a serial file or every rank's): from the index, or else the headers."""
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())[kind]
        return {name: [(path / file, *where) for file, *where in found] for name, found in index.items()}
    return pieces_from_headers(path, kind)


def _load_resharded(path: Path, kind: str, like, owner: str, requires_grad: bool, box_of=None):
    """The tree `like` describes (this rank's pieces in its own layout), read from a checkpoint of another
    layout: each leaf's part is assembled from the stored pieces that overlap it, reading only the
    overlapping byte ranges (safetensors slices), so no rank reads a whole tensor it does not hold."""
    pieces = _pieces(path, kind)
    _, spec = tree_flatten(like)
    hint = "the checkpoint was written with a different model or optimizer (see its meta.json)"
    out, handles = [], {}
    try:
        for name, ref in named_leaves(like).items():
            if name not in pieces:
                raise CheckpointMismatch(f"checkpoint {path.name} lacks tensor {name!r}, which {owner} expects; {hint}")
            shape, offset = box(ref) if isinstance(ref, DTensor) or box_of is None else box_of(name, ref)
            local = ref.to_local() if isinstance(ref, DTensor) else ref
            if (stored := pieces[name][0][1]) != shape:
                raise CheckpointMismatch(f"checkpoint {path.name} tensor {name!r} has shape {tuple(stored)} but {owner} "
                                         f"expects {tuple(shape)}; {hint}")
            t = torch.empty(local.shape, dtype=local.dtype)
            filled = []
            for file, _, src_offset, src_shape in pieces[name]:
                lo = [max(a, b) for a, b in zip(offset, src_offset)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(offset, local.shape, src_offset, src_shape)]
                disjoint = any(a >= b for a, b in zip(lo, hi))
                replica = any(all(f_lo[d] <= lo[d] and hi[d] <= f_hi[d] for d in range(len(lo))) for f_lo, f_hi in filled)
                if disjoint or replica:
                    continue     # no overlap, or a replica of a part already read
                if file not in handles:
                    handles[file] = safe_open(str(file), framework="pt").__enter__()
                source = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, src_offset))
                piece = handles[file].get_slice(name)[source] if source else handles[file].get_tensor(name)
                if piece.dtype != t.dtype:
                    raise CheckpointMismatch(f"checkpoint {path.name} tensor {name!r} has dtype {piece.dtype} but "
                                             f"{owner} expects {t.dtype}; {hint}")
                t[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))] = piece
                filled.append((lo, hi))
            covered = sum(math.prod(b - a for a, b in zip(f_lo, f_hi)) for f_lo, f_hi in filled)
            if covered < t.numel():
                raise CheckpointMismatch(f"checkpoint {path.name}: the stored pieces of {name!r} do not cover this "
                                         f"rank's part of it; {hint}")
            out.append(placed_like(t, ref, requires_grad))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return tree_unflatten(out, spec)
