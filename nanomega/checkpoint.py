"""Checkpoints: parameters, optimizer state and run metadata, stored by dotted leaf name.

    <out_dir>/ckpt-00000500/params.safetensors  {dotted parameter name: tensor}, e.g. "layers.0.attn.wq.weight"
                            optim.safetensors   {dotted optimizer-state name: tensor}, e.g. "adam.mu.lm_head.weight"
                            meta.json           {"format": 2, "world_size": 1, "step", "data_position", "rng", "config"}

Storing by name lets anything that agrees on names (sharding plans, HF conversion) read the files, and turns a
config mismatch into an error naming the tensor instead of a silent misload. A parallel run (world_size > 1)
writes each rank's local shards to its own files (`params-rank00001.safetensors`, `optim-rank00001.safetensors`),
still by name; each file's header records where each of its pieces lies in the whole tensor (global shape
and offset), and index.json gathers those of every file. It resumes in any layout, serial included: each
rank reads only the byte ranges of the pieces that overlap its own (`_load_resharded`).

Crash safety: a save is written into `ckpt-XXXXXXXX.tmp-<pid>/`, fsynced, then renamed, so a directory named
`ckpt-XXXXXXXX` is always complete (meta.json is written last); a parallel save is renamed only after every
rank has said its files are complete (`_save_sharded`). `Saver(background=True)` writes while training goes
on, from a host copy taken first.

Format 2 names optimizer state by what it is ("adam.mu.<param>", "lr.count"); format 1 named it by the
position of its transform in the chain ("1.mu.<param>"), which moved when clipping was toggled. `load`
reads a format-1 optimizer file through a renaming the caller supplies (train.py passes
optim.format1_state_names); parameters are named alike in both formats.
"""
from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import shutil
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nanomega.tree import named_leaves, tree_flatten, tree_unflatten

FORMAT = 2
READABLE_FORMATS = (1, 2)
PARAMS_FILE, OPTIM_FILE, META_FILE = "params.safetensors", "optim.safetensors", "meta.json"
INDEX_FILE = "index.json"    # a parallel checkpoint's map of every stored piece (_write_index)
BOXES = "nanomega.boxes"    # a parallel rank file's metadata: {name: [global shape, global offset of its part]}
_FINAL = re.compile(r"ckpt-(\d{8,})")                   # :08d grows past 8 digits, never shrinks
_ASIDE = re.compile(r"(ckpt-\d{8,})\.(tmp|old)-\d+")    # in-progress writes and replaced checkpoints


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (names, shapes, dtypes, format)."""


# ---------------------------------------------------------------- RNG state

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_state() -> dict:
    """Torch CPU (and CUDA) generators and Python's `random`, as JSON-safe values."""
    version, internal, gauss = random.getstate()
    state = {"torch": _b64(torch.get_rng_state()), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    # A run saved on N GPUs may resume on fewer, or on CPU: restore what this machine has.
    if torch.cuda.is_available():
        for i, s in enumerate(state.get("cuda", [])[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)


# ---------------------------------------------------------------- saving

def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)     # works for directories too: makes their entries durable
    os.fsync(fd)
    os.close(fd)


def _flat_tensors(tree, what: str, copy: bool = False) -> dict:
    """{dotted name: contiguous CPU tensor} of a tree; a DTensor is stored as this rank's shard. copy=True
    takes a snapshot the caller may keep while training changes the tree (an asynchronous save): CPU
    tensors are cloned, accelerator ones copied into pinned host memory, all copies awaited at once."""
    named = named_leaves(tree)
    if len(named) != len(tree_flatten(tree)[0]):    # two leaves with one dotted name would overwrite each other
        raise ValueError(f"{what} has duplicate dotted leaf names; cannot save it by name")
    if bad := [n for n, x in named.items() if not isinstance(x, torch.Tensor)]:
        raise TypeError(f"{what} leaf {bad[0]!r} is a {type(named[bad[0]]).__name__}, not a tensor")
    # safetensors needs contiguous CPU tensors; detach so no autograd graph is kept alive.
    local = {name: (x.to_local() if isinstance(x, DTensor) else x).detach() for name, x in named.items()}
    if not copy:
        return {name: x.contiguous().cpu() for name, x in local.items()}
    pin = any(x.device.type == "cuda" for x in local.values())
    out = {name: torch.empty(x.shape, dtype=x.dtype, pin_memory=pin and x.device.type == "cuda").copy_(
        x, non_blocking=x.device.type == "cuda") for name, x in local.items()}
    if pin:
        torch.cuda.synchronize()
    return out


def _rank_files(rank: int) -> tuple[str, str]:
    """A parallel run's files of one rank (a serial run's are PARAMS_FILE, OPTIM_FILE)."""
    return f"params-rank{rank:05d}.safetensors", f"optim-rank{rank:05d}.safetensors"


def alone(ok: bool) -> bool:
    """`agree` of a single process: its own answer."""
    return ok


def _write_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    if metadata is None:
        save_file(tensors, str(path))
    else:
        save_file(tensors, str(path), metadata=metadata)
    _fsync(path)


def box(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """(global shape, global offset of this rank's part) of a leaf: a DTensor's shard, or a whole tensor."""
    if not isinstance(x, DTensor):
        return list(x.shape), [0] * x.ndim
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return list(x.shape), list(offset)


def _boxes(tree, box_of=None) -> dict:
    """safetensors metadata of a parallel rank's file: where each of its tensors lies in the whole one.
    box_of(name, leaf) -> (global shape, offset) for leaves that are local shards of plain tensors
    (the parallel optimizer's state: ParallelOptimizer.state_box); DTensors say it themselves."""
    box_of = box_of or (lambda name, x: box(x))
    return {BOXES: json.dumps({name: box(x) if isinstance(x, DTensor) else box_of(name, x)
                               for name, x in named_leaves(tree).items()})}


def _snapshot(params, opt_state, sharded: bool, state_box=None, copy: bool = False):
    """(file index, {name: CPU tensor}, safetensors metadata) for the params file, then the optimizer's: all a
    save writes. Lazily, one tree at a time, so a synchronous save from a GPU holds one tree's host copy
    at once; an asynchronous one takes list() of it with copy=True, detached from the live trees."""
    yield 0, _flat_tensors(params, "params", copy), _boxes(params) if sharded else None
    yield 1, _flat_tensors(opt_state, "optimizer state", copy), _boxes(opt_state, state_box) if sharded else None


def _write_trees(snapshot, directory: Path, files: tuple[str, str]) -> None:
    for index, tensors, metadata in snapshot:
        _write_tensors(tensors, directory / files[index], metadata)


def _publish(tmp: Path, final: Path, meta_text: str, tag: int) -> None:
    """meta.json last, everything fsynced, then one rename: a directory named ckpt-N is always complete.
    Re-saving a step moves the old copy aside and deletes it only once the new one is in place."""
    (tmp / META_FILE).write_text(meta_text)
    _fsync(tmp / META_FILE)
    _fsync(tmp)
    old = final.with_name(f"{final.name}.old-{tag}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old.exists() and not final.exists():
            old.rename(final)
        raise
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _clean_aside(out_dir: Path) -> None:
    """Remove leftovers of interrupted saves; ours has finished and one writer per out_dir is assumed."""
    for p in out_dir.iterdir():
        if (m := _ASIDE.fullmatch(p.name)) and p.is_dir():
            if m[2] == "old" and not (out_dir / m[1]).exists():
                p.rename(out_dir / m[1])    # crashed between moving the old copy aside and renaming the new one in
            else:
                shutil.rmtree(p, ignore_errors=True)


def _prune(out_dir: Path, final: Path, keep: int) -> None:
    """Clean up interrupted saves and keep the newest `keep` checkpoints (<= 0: all). The checkpoint just
    written always survives, even if newer ones exist (a rerun from an earlier step)."""
    _clean_aside(out_dir)
    if keep > 0:
        others = [p for p in _complete(out_dir) if p != final]
        for p in others[:max(len(others) - (keep - 1), 0)]:
            shutil.rmtree(p, ignore_errors=True)


def save(out_dir, step: int, params, opt_state, meta: dict, keep: int, rank: int = 0, world_size: int = 1,
         agree=alone, state_box=None) -> Path:
    """Write ckpt-<step:08d> atomically, then keep only the newest `keep` (<= 0: keep all). Returns its path.

    One process writes and publishes alone (`_save_serial`). With world_size > 1 every rank calls this with
    its shards and `agree(ok) -> bool`, true when every rank passed true (an all-reduce over all ranks,
    with a timeout: train.py's `agreement`): each writes its own files into one temporary directory, and
    rank 0 publishes it, and prunes, only once every rank's files are complete (`_save_sharded`).
    `Saver(background=True)` does the same while training goes on."""
    snapshot = _snapshot(params, opt_state, world_size > 1, state_box)
    return _save(Path(out_dir), step, snapshot, _meta_text(meta, world_size, step), keep, rank, world_size, agree)


def _meta_text(meta: dict, world_size: int, step: int) -> str:
    # Serialized before anything is written: a non-JSON value should fail before gigabytes are.
    return json.dumps({**meta, "format": FORMAT, "world_size": world_size, "step": int(step)}, indent=2)


def _save(out_dir: Path, step: int, snapshot, meta_text: str, keep: int, rank: int, world_size: int, agree) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"ckpt-{int(step):08d}"
    if world_size == 1:
        _save_serial(snapshot, meta_text, final)
    else:
        _save_sharded(snapshot, meta_text, final, rank, agree)
        if rank != 0:
            return final
    _prune(out_dir, final, keep)
    return final


class Saver:
    """`save`, optionally in the background: `saver.save(...)` takes a host copy of this rank's shards (the
    only time training waits), then a thread writes the files, agrees with the other ranks and publishes,
    while the next steps run. One save is in flight at a time: the next `save`, and `wait()` at the end of
    training, first wait for the one before, and raise its error there (CheckpointNotSaved, OSError).
    The copy costs host memory the size of the rank's parameters and optimizer state until written.
    The thread is not a daemon, so a process that stops for another reason still finishes the write.
    Every rank of a parallel run saves at the same steps, so their threads meet in the same agreements.

    Torch's own asynchronous save (torch.distributed.checkpoint.async_save) writes its own format; this
    keeps safetensors by name, and safetensors' writer releases the GIL while it writes."""

    def __init__(self, background: bool):
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, out_dir, step: int, params, opt_state, meta: dict, keep: int, rank: int = 0,
             world_size: int = 1, agree=alone, state_box=None) -> Path:
        self.wait()
        if not self.background:
            return save(out_dir, step, params, opt_state, meta, keep, rank, world_size, agree, state_box)
        meta_text = _meta_text(meta, world_size, step)
        snapshot = list(_snapshot(params, opt_state, world_size > 1, state_box, copy=True))
        out_dir = Path(out_dir)

        def write():
            try:
                _save(out_dir, step, snapshot, meta_text, keep, rank, world_size, agree)
            except BaseException as err:     # noqa: BLE001  (raised in the training thread by wait())
                self._error = err
        self._thread = threading.Thread(target=write, name=f"nanomega-save-{step}")
        self._thread.start()
        return out_dir / f"ckpt-{int(step):08d}"

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise what it raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if (err := self._error) is not None:
            self._error = None
            raise err


def _save_serial(snapshot, meta_text: str, final: Path) -> None:
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_trees(snapshot, tmp, (PARAMS_FILE, OPTIM_FILE))
        _publish(tmp, final, meta_text, tag=os.getpid())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class CheckpointNotSaved(OSError):
    """A parallel save that some rank could not complete: nothing was published, the latest checkpoint is
    the one before."""


def _save_sharded(snapshot, meta_text: str, final: Path, rank: int, agree) -> None:
    """Three agreements, which every rank reaches whatever fails on it (an exception becomes its "no"),
    so none waits for a rank that gave up: the temporary directory exists; every rank's files are written
    and fsynced; rank 0 has indexed and published. A rank that dies, or hangs, makes the others' `agree`
    fail at its timeout. Only when every rank said yes to its files does rank 0 publish; otherwise the
    temporary directory is removed and the previous checkpoint stays the latest."""
    tmp = final.with_name(f"{final.name}.tmp-0")     # ranks share one directory name; pid 0 is never ours
    error = None

    def step(ok: bool, what: str) -> None:
        if not agree(ok):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointNotSaved(f"{final.name} was not saved: {'this rank' if not ok else 'another rank'} "
                                     f"failed to {what}" + (f" ({error!r})" if error else "")
                                     + "; nothing was published, the latest checkpoint is unchanged")
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as err:
        error = err
    step(error is None, "create the temporary directory")
    try:
        _write_trees(snapshot, tmp, _rank_files(rank))
    except Exception as err:          # noqa: BLE001  (becomes this rank's "no"; raised below on every rank)
        error = err
    step(error is None, "write its files")
    try:
        if rank == 0:
            _write_index(tmp)
            _publish(tmp, final, meta_text, tag=0)
    except Exception as err:          # noqa: BLE001
        error = err
    step(error is None, "publish")


def _write_index(directory: Path) -> None:
    """index.json: {"params.safetensors" | "optim.safetensors": {name: [[rank file, global shape, offset,
    local shape], ...]}}, from every rank file's header, so a loading rank opens only the files that hold
    its pieces (without it, every header is read: `_pieces`)."""
    index = {kind: {name: [[file.name, *where] for file, *where in found] for name, found in
                    _pieces_from_headers(directory, kind).items()} for kind in (PARAMS_FILE, OPTIM_FILE)}
    (directory / INDEX_FILE).write_text(json.dumps(index))
    _fsync(directory / INDEX_FILE)


# ---------------------------------------------------------------- finding and loading

def _complete(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [(int(m[1]), p) for p in out_dir.iterdir()
             if (m := _FINAL.fullmatch(p.name)) and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest(out_dir) -> Path | None:
    """The newest complete checkpoint in out_dir, or None."""
    return found[-1] if (found := _complete(Path(out_dir))) else None


def read_meta(path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


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
            out.append(_placed_like(t, dref, requires_grad))
    return tree_unflatten(out, spec)


def _placed_like(t: torch.Tensor, like, requires_grad: bool) -> torch.Tensor:
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
                "rename_format1_state=lambda names, meta: optim.format1_state_names("
                "config.from_dict(meta['config']).optim, names) to checkpoint.load")
        rename = lambda stored: rename_format1_state(stored, meta)   # noqa: E731
    params_file, optim_file = (PARAMS_FILE, OPTIM_FILE) if world_size == 1 else _rank_files(rank)
    params = _load_tree(path, params_file, params_like, "the model", requires_grad=True)
    opt_state = None if opt_state_like is None else _load_tree(path, optim_file, opt_state_like,
                                                                "the optimizer state", requires_grad=False,
                                                                rename=rename)
    return params, opt_state, meta


# ---------------------------------------------------------------- resharding: any layout into any other

def reshardable(path: Path, meta: dict) -> bool:
    """A serial checkpoint, or a parallel one whose files record where each piece lies (format 2 from the
    resharding change on)."""
    if meta.get("world_size", 1) == 1:
        return True
    with safe_open(str(Path(path) / _rank_files(0)[0]), framework="pt") as f:
        return BOXES in (f.metadata() or {})


def _pieces(path: Path, kind: str) -> dict:
    """{name: [(file, global shape, offset, local shape)]} over the checkpoint's files of `kind`
    (PARAMS_FILE or OPTIM_FILE, a serial file or every rank's): from the index, or else the headers."""
    if (path / INDEX_FILE).is_file():
        index = json.loads((path / INDEX_FILE).read_text())[kind]
        return {name: [(path / file, *where) for file, *where in found] for name, found in index.items()}
    return _pieces_from_headers(path, kind)


def _pieces_from_headers(path: Path, kind: str) -> dict:
    serial = (path / kind).is_file()
    files = [path / kind] if serial else sorted(path.glob(kind.replace(".safetensors", "-rank*.safetensors")))
    out: dict = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            boxes = json.loads((f.metadata() or {}).get(BOXES, "{}"))
            for name in f.keys():
                local = list(f.get_slice(name).get_shape())
                shape, offset = boxes.get(name, (local, [0] * len(local)))
                out.setdefault(name, []).append((file, shape, offset, local))
    return out


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
            out.append(_placed_like(t, ref, requires_grad))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return tree_unflatten(out, spec)
