"""Checkpoints: parameters, optimizer state and run metadata, stored by dotted leaf name.

    <out_dir>/ckpt-00000500/params.safetensors  {dotted parameter name: tensor}, e.g. "layers.0.attn.wq.weight"
                            optim.safetensors   {dotted optimizer-state name: tensor}, e.g. "adam.mu.lm_head.weight"
                            meta.json           {"format": 2, "world_size": 1, "step", "data_position", "rng", "config",
                                                 "files": {file: {"bytes", "crc32"}}}

Storing by name lets anything that agrees on names (sharding plans, HF conversion) read the files, and turns a
config mismatch into an error naming the tensor instead of a silent misload. A parallel run (world_size > 1)
writes each rank's local shards to its own files (`params-rank00001.safetensors`, `optim-rank00001.safetensors`),
still by name; each file's header records where each of its pieces lies in the whole tensor (global shape
and offset), and index.json gathers those of every file. It resumes in any layout, serial included: each
rank reads only the byte ranges of the pieces that overlap its own (loading.py).

Crash safety: a save is written into `ckpt-XXXXXXXX.tmp-<pid>/`, fsynced, then renamed, so a directory named
`ckpt-XXXXXXXX` is always complete (meta.json is written last); a parallel save is renamed only after every
rank has said its files are complete (saving.py). `Saver(background=True)` writes while training goes
on, from a host copy taken first.

Format 2 names optimizer state by what it is ("adam.mu.<param>", "lr.count"). Older checkpoints (format 1, which
named it by the position of its transform in the chain, and parallel ones written before resharding existed) are
refused by `check_readable`, naming the commit that still reads them (loading.py).

A damaged file (truncated, corrupted; its length, header and CRC-32 are checked against what meta.json's
"files" recorded at save time) is refused before any tensor is read, naming the file and the newest intact
checkpoint, with the command that resumes from it; nothing is skipped or deleted (integrity.py says why).

The package: files.py (names, format, finding), saving.py, loading.py (resharding included), integrity.py.
"""
from __future__ import annotations

from nanomega.checkpoint.files import (FORMAT, INDEX_FILE, META_FILE, OPTIM_FILE, PARAMS_FILE, CheckpointMismatch,
                                       CheckpointNotSaved, box, latest, read_meta, rng_state, set_rng_state)
from nanomega.checkpoint.integrity import CheckpointDamaged, check_intact
from nanomega.checkpoint.loading import check_readable, load, placed_like
from nanomega.checkpoint.saving import Saver, alone, save

__all__ = ["FORMAT", "INDEX_FILE", "META_FILE", "OPTIM_FILE", "PARAMS_FILE", "CheckpointDamaged", "CheckpointMismatch",
           "CheckpointNotSaved", "Saver", "alone", "box", "check_intact", "check_readable", "latest", "load",
           "placed_like", "read_meta", "rng_state", "save", "set_rng_state"]
