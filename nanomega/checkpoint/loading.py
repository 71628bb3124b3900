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

from nanomega.checkpoint.files import (BOXES, INDEX_FILE, OPTIM_FILE, PARAMS_FILE, READABLE_FORMATS,
                                       CheckpointMismatch, box, pieces_from_headers, rank_files, read_meta)
from nanomega.checkpoint.integrity import FILES, check_intact
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


def _read(f, path: Path, name: str, stored):
    """The stored tensor(s) `stored` names for `name`: one name, or several that must hold one value."""
    if isinstance(stored, str):
        return f.get_tensor(stored)
    first, *others = (f.get_tensor(s) for s in stored)
    if not all(torch.equal(first, t) for t in others):
        raise CheckpointMismatch(f"checkpoint {path.name}: {', '.join(stored)} should all hold {name!r} but differ")
    return first


def _load_tree(path: Path, file: str, like, owner: str, requires_grad: bool, rename=None):
    """The tree `like` describes, from `file`. rename(stored names) -> {expected name: its stored name, a tuple
    of stored names holding one value, or None for a leaf the file's format lacks (it keeps like's value)}
    reads an older format."""
    _, spec = tree_flatten(like)
    expected = named_leaves(like)
    hint = "the checkpoint was written with a different config (see its meta.json)"
    with safe_open(str(path / file), framework="pt", device="cpu") as f:
        stored = list(f.keys())
        source = {n: n for n in stored} if rename is None else rename(stored)
        if missing := [n for n in expected if n not in source]:
            raise CheckpointMismatch(f"checkpoint {path.name} lacks tensor {missing[0]!r} ({len(missing)} missing in all), "
                             f"which {owner} expects in {file}; {hint}")
        used = {s for n in expected for s in ((source[n],) if isinstance(source[n], str) else source[n] or ())}
        if extra := sorted(set(stored) - used):
            raise CheckpointMismatch(f"checkpoint {path.name} has tensor {extra[0]!r} ({len(extra)} unexpected in all) "
                             f"in {file}, which {owner} does not have; {hint}")
        out = []
        for name, ref in expected.items():
            dref, ref = ref, ref.to_local() if isinstance(ref, DTensor) else ref
            t = ref.detach().cpu() if source[name] is None else _read(f, path, name, source[name])
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
         rename_format1_state=None, state_box=None):
    """(params, opt_state, meta), checked name by name against freshly initialized trees (e.g. init(cfg),
    opt.init(params)) that give structure, shapes, dtypes and devices. Values are bitwise as saved.
    opt_state_like=None loads the parameters only (sampling, evaluation) and returns opt_state None.
    A parallel run passes its rank, world size and `layout` (meta's "layout" must be equal).
    rename_format1_state(stored names, meta) -> {name: stored name or None} reads the optimizer state of a
    format-1 checkpoint (module doc); without it such a checkpoint's optimizer state is refused."""
    path = Path(path)
    check_intact(path, checksummed=lambda meta: _read_whole(meta, rank, world_size, layout))
    meta = read_meta(path)
    if meta.get("format") not in READABLE_FORMATS:
        raise CheckpointMismatch(f"checkpoint {path.name} has format {meta.get('format')}; this version reads "
                                 f"formats {READABLE_FORMATS}")
    if meta.get("world_size") != world_size or meta.get("layout") != layout:
        if not reshardable(path, meta):
            raise CheckpointMismatch(
                f"checkpoint {path.name} was written on {meta.get('world_size')} process(es) with layout "
                f"{meta.get('layout')}, but this run has {world_size} with layout {layout}, and it records no "
                "piece offsets (written before resharding existed); resume with the parallel settings it was "
                "written with")
        params = _load_resharded(path, PARAMS_FILE, params_like, "the model", requires_grad=True)
        opt_state = None if opt_state_like is None else _load_resharded(path, OPTIM_FILE, opt_state_like,
                                                                        "the optimizer state", requires_grad=False,
                                                                        box_of=state_box)
        return params, opt_state, meta
    rename = None
    if meta["format"] == 1 and opt_state_like is not None:
        if rename_format1_state is None:
            raise CheckpointMismatch(
                f"checkpoint {path.name} is format 1: its optimizer state is named by position in the chain "
                "('1.mu.<param>'), this version names it by what it is ('adam.mu.<param>'). Resume it with "
                "`python train.py --train.resume=true ...`, which renames it on load, or pass "
                "rename_format1_state=nanomega.optim.format1_renaming to checkpoint.load")
        rename = lambda stored: rename_format1_state(stored, meta)   # noqa: E731
    params_file, optim_file = (PARAMS_FILE, OPTIM_FILE) if world_size == 1 else rank_files(rank)
    params = _load_tree(path, params_file, params_like, "the model", requires_grad=True)
    opt_state = None if opt_state_like is None else _load_tree(path, optim_file, opt_state_like,
                                                                "the optimizer state", requires_grad=False,
                                                                rename=rename)
    return params, opt_state, meta


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

def reshardable(path: Path, meta: dict) -> bool:
    """A serial checkpoint, or a parallel one whose files record where each piece lies (format 2 from the
    resharding change on)."""
    if meta.get("world_size", 1) == 1:
        return True
    with safe_open(str(Path(path) / rank_files(0)[0]), framework="pt") as f:
        return BOXES in (f.metadata() or {})


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
