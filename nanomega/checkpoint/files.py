"""The checkpoint's files: their names, the format number, where a rank's piece lies, finding the latest.

Shared by saving.py and loading.py; the layout itself is the package's docstring.
"""
from __future__ import annotations

import base64
import json
import random
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

FORMAT = 2
LAST_OLD_READER = "12e7aa1"   # the last commit that reads format 1 and pre-resharding checkpoints
PARAMS_FILE, OPTIM_FILE, META_FILE = "params.safetensors", "optim.safetensors", "meta.json"
INDEX_FILE = "index.json"    # a parallel checkpoint's map of every stored piece (_write_index)
BOXES = "nanomega.boxes"    # a parallel rank file's metadata: {name: [global shape, global offset of its part]}
FINAL = re.compile(r"ckpt-(\d{8,})")                   # :08d grows past 8 digits, never shrinks
ASIDE = re.compile(r"(ckpt-\d{8,})\.(tmp|old)-\d+")    # in-progress writes and replaced checkpoints


class CheckpointMismatch(ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (names, shapes, dtypes, format)."""


class CheckpointNotSaved(OSError):
    """A parallel save that some rank could not complete: nothing was published, the latest checkpoint is
    the one before."""


def rank_files(rank: int) -> tuple[str, str]:
    """A parallel run's files of one rank (a serial run's are PARAMS_FILE, OPTIM_FILE)."""
    return f"params-rank{rank:05d}.safetensors", f"optim-rank{rank:05d}.safetensors"


def box(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """(global shape, global offset of this rank's part) of a leaf: a DTensor's shard, or a whole tensor."""
    if not isinstance(x, DTensor):
        return list(x.shape), [0] * x.ndim
    _, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    return list(x.shape), list(offset)


def complete(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [(int(m[1]), p) for p in out_dir.iterdir()
             if (m := FINAL.fullmatch(p.name)) and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest(out_dir) -> Path | None:
    """The newest complete checkpoint in out_dir, or None."""
    return found[-1] if (found := complete(Path(out_dir))) else None


def read_meta(path) -> dict:
    return json.loads((Path(path) / META_FILE).read_text())


def pieces_from_headers(path: Path, kind: str) -> dict:
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
