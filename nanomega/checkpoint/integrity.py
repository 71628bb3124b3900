"""Damaged checkpoints: found before any tensor is read, and refused with the way back to the newest intact one.

A published `ckpt-XXXXXXXX` is complete when written (saving.py), but a file can still be damaged afterwards: a
copy to or from object storage cut short, a full disk on a filesystem that does not fsync what it says, a bad
sector. Before this module, loading one gave safetensors' own traceback ("MetadataIncompleteBuffer", "invalid
JSON in header") or, for flipped data bytes, nothing at all.

Policy: **refuse**, naming the damaged file, what is wrong with it, and the newest intact checkpoint with the
command that resumes from it. Not skip-with-a-warning, because skipping loses progress silently (the steps since
the older checkpoint are trained again, and a warning scrolls past in a job's log), and because the run that
skipped would, on reaching the damaged step again, replace the damaged checkpoint (`_publish` moves the old copy
aside and deletes it), destroying what a user might still repair (the file may merely be mid-copy). Torchtitan and
Megatron users expect a resumed run to continue where it stopped or to stop; the refusal keeps everything on disk
and costs one command: `mv ckpt-N ckpt-N.damaged`, which no pruning or cleanup touches (the names
files.FINAL and files.ASIDE match are the only ones they handle), then the same `--train.resume=true` run.

What is checked, per safetensors file, in this order, reading only its header unless a checksum is recorded:
- its byte length against the length the save recorded in meta.json's "files" (checkpoints written before
  this module record none, and get the checks below only);
- the header: its 8-byte length fits the file, it is JSON, and every tensor's data_offsets span exactly
  shape x dtype bytes, the spans tile the data buffer without gap or overlap (as the safetensors format
  requires) and end at the file's end, so a truncated file is found even without a recorded length;
- its CRC-32 against the one recorded at save time, which finds flipped bytes anywhere in the file, header or
  data. CRC-32, not a cryptographic hash: this guards against accidents, not adversaries, and zlib's runs at
  ~2.3 GB/s on this machine (blake2b ~1.1; `python -c` in the report of the change), about a disk's read
  speed. A loading rank checksums only its share: a parallel rank in its own layout its own two
  files; a resharding rank every world_size-th file, so the job reads each file in full once, not once per rank.
Also meta.json and index.json must parse. train.py's preflight checks the latest checkpoint's lengths and headers
before data or parameters are touched (checksummed nothing: it costs a read of the headers only); `load` checks
again, with the checksums, before its first tensor.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

from nanomega.checkpoint.files import INDEX_FILE, META_FILE, CheckpointMismatch, complete

FILES = "files"    # meta.json's key: {safetensors file name: {"bytes": length, "crc32": checksum}}
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class CheckpointDamaged(CheckpointMismatch):
    """A checkpoint file that is not as it was saved (truncated, corrupted, missing). A CheckpointMismatch, so
    whoever stops on a checkpoint that cannot be loaded stops on this too (train.py)."""


def file_sums(file: Path) -> dict:
    """{"bytes": length, "crc32": checksum} of a file, read in 64 MiB chunks."""
    crc, size = 0, 0
    with open(file, "rb") as f:
        while chunk := f.read(64 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def _header_problem(file: Path, size: int) -> str | None:
    """What is wrong with a safetensors file's header and its agreement with the file's length, or None."""
    if size < 8:
        return f"has {size} bytes, fewer than a safetensors header's length field (truncated)"
    with open(file, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n > size - 8:
            return f"has a header length of {n} bytes but only {size - 8} bytes follow it (truncated or corrupted)"
        text = f.read(n)
    try:
        entries = json.loads(text)
    except (UnicodeDecodeError, ValueError) as err:
        return f"has a header that is not valid JSON ({err}; corrupted)"
    if not isinstance(entries, dict):
        return "has a header that is not a JSON object (corrupted)"
    spans = []
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        try:
            start, end = entry["data_offsets"]
            need = math.prod(entry["shape"]) * _DTYPE_BYTES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"has a malformed header entry for tensor {name!r} (corrupted)"
        if end - start != need:
            return (f"says tensor {name!r} spans {end - start} bytes, but its shape {entry['shape']} of "
                    f"{entry['dtype']} needs {need} (corrupted header)")
        spans.append((start, end, name))
    at = 0
    for start, end, name in sorted(spans):
        if start != at:
            return f"has a gap or overlap in its data at tensor {name!r} (corrupted header)"
        at = end
    if at != size - 8 - n:
        return (f"has {size} bytes, but its header says its tensors end at byte {8 + n + at} "
                f"({'truncated' if at > size - 8 - n else 'extra bytes at the end'})")
    return None


def _problem(file: Path, recorded: dict | None, checksum: bool) -> str | None:
    if not file.is_file():
        return "is missing"
    size = file.stat().st_size
    if recorded is not None and size != recorded["bytes"]:
        return (f"has {size} bytes but was saved with {recorded['bytes']} "
                f"({'truncated' if size < recorded['bytes'] else 'bytes appended'})")
    if bad := _header_problem(file, size):
        return bad
    if checksum and recorded is not None and file_sums(file)["crc32"] != recorded["crc32"]:
        return "does not match the CRC-32 recorded when it was saved (bytes changed: corrupted)"
    return None


def damage(path: Path, checksummed=None) -> tuple[str, str] | None:
    """(file name, what is wrong) of the first damaged file of the checkpoint at `path`, or None when intact.
    checksummed(meta.json's dict) -> the file names whose CRC-32 is checked, or None for every file (the
    default); every file's header and length are checked."""
    jsons = {}
    for name in (META_FILE, INDEX_FILE):
        if name == META_FILE or (path / name).exists():
            try:
                jsons[name] = json.loads((path / name).read_text())
            except (OSError, UnicodeDecodeError, ValueError) as err:
                return name, f"cannot be read as JSON ({err})"
    if not isinstance(meta := jsons[META_FILE], dict):
        return META_FILE, "is not a JSON object"
    recorded = meta.get(FILES) or {}
    names = sorted({p.name for p in path.glob("*.safetensors")} | set(recorded))
    summed = None if checksummed is None else checksummed(meta)
    for name in names:
        if bad := _problem(path / name, recorded.get(name), summed is None or name in summed):
            return name, bad
    return None


def check_intact(path, checksummed=None) -> None:
    """Raise CheckpointDamaged when the checkpoint at `path` is damaged (`damage`), naming the file and the
    newest intact checkpoint beside it, with the command that resumes from that one. Nothing is moved or
    deleted: the module's policy."""
    path = Path(path)
    if (found := damage(path, checksummed)) is None:
        return
    name, what = found
    intact = next((p for p in reversed(complete(path.parent)) if p != path and damage(p) is None), None)
    if intact is None:
        way = (f"{path.parent} holds no intact checkpoint besides it: restore {name} from a copy, or start "
               "again without --train.resume")
    else:
        way = (f"the newest intact checkpoint is {intact}; to resume from it, move the damaged one aside "
               f"(kept, never pruned): `mv {path} {path}.damaged`, then rerun with --train.resume=true")
    raise CheckpointDamaged(f"checkpoint {path}: {name} {what}; nothing was loaded. {way[0].upper()}{way[1:]}")
