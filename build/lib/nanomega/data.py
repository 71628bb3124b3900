"""Data: a byte tokenizer, token splits on disk, and a seekable random sampler.

Every source ends up as two 1-D integer arrays (train, val). Sources, chosen by `data.path`:
  ""            the built-in corpus: this interpreter's standard library *.py files, packed
                once into a cached uint16 file and split by document;
  a folder      every non-hidden file under it, split by document like the built-in corpus;
  *.bin / *.npy pre-tokenized ids (raw uint16 little-endian / a 1-D integer array), split by position;
  anything else a text file read as UTF-8 bytes, split by position (the last val_fraction goes to val).
Documents are joined with a NUL byte (token 0), which never occurs in source code or text.

The sampler is a pure function of (seed, position), so resuming from a checkpoint only needs the
number of sequences consumed so far.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from nanomega.config import DataConfig

SEPARATOR = 0            # token between documents
_EXCLUDED_DIRS = ("site-packages", "dist-packages")   # third-party code differs between machines
_CACHE_VERSION = 1       # bump when the packed format changes, so stale caches are not reused


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no files, and every string round-trips."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        # Ids >= 256 can come from a model with a padded vocabulary; they mean nothing here.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class Splits(NamedTuple):
    train: np.ndarray
    val: np.ndarray


# ---------------------------------------------------------------- sources

def builtin_corpus_files() -> list[Path]:
    """Standard-library *.py files, sorted by relative path, same on any machine with this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _split_documents(root: Path, files: list[Path], val_fraction: float, what: str) -> Splits:
    """Join documents with NUL into a train and a val stream, assigning each document by its path."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for f in files:
        # hashlib, not hash(): Python salts str hashes per process, and the split must never move.
        digest = hashlib.sha256(f.relative_to(root).as_posix().encode("utf-8")).digest()
        parts[int.from_bytes(digest[:8], "little") % 10_000 < val_fraction * 10_000].append(f.read_bytes())
    if not any(parts[False] + parts[True]):
        raise ValueError(f"{what} is empty: {len(files)} files and no bytes; point --data.path at some text")
    for is_val, name in ((False, "train"), (True, "val")):
        if not parts[is_val]:
            raise ValueError(f"{what}: no document fell into the {name} split ({len(files)} documents, "
                             f"data.val_fraction={val_fraction}); add more files or change --data.val_fraction")
    streams = [np.frombuffer(bytes([SEPARATOR]).join(parts[v]), dtype=np.uint8).astype(np.uint16)
               for v in (False, True)]
    return Splits(*streams)


def _split_by_position(tokens: np.ndarray, val_fraction: float, min_val: int, what: str) -> Splits:
    """The last val_fraction of the stream (at least min_val tokens) is validation."""
    if len(tokens) == 0:
        raise ValueError(f"{what} is empty; point --data.path at a file with data in it")
    n_val = max(math.ceil(len(tokens) * val_fraction), min_val, 1)
    if n_val >= len(tokens):
        raise ValueError(f"{what} has {len(tokens)} tokens; after holding out {n_val} for validation "
                         "the train split is empty; use more data or a smaller --data.val_fraction")
    return Splits(tokens[:-n_val], tokens[-n_val:])


def _load_pretokenized(path: Path) -> np.ndarray:
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size % 2:
            raise ValueError(f"{path} has {size} bytes, an odd number, so it is not uint16 tokens; "
                             ".bin files must hold raw uint16 little-endian ids (use .npy for other dtypes)")
        if size == 0:
            raise ValueError(f"{path} is empty; point --data.path at a file with tokens in it")
        return np.memmap(path, dtype="<u2", mode="r")
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{path} holds a {tokens.ndim}-D {tokens.dtype} array; a .npy token file must be "
                         "a 1-D integer array (flatten it and cast, e.g. arr.reshape(-1).astype(np.uint16))")
    return tokens     # kept in its own dtype: vocabularies above 65535 do not fit uint16


def _atomic_write(path: Path, array: np.ndarray) -> None:
    # Write under a temporary name and rename, so a crash or a concurrent run never sees half a file.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    array.astype("<u2").tofile(tmp)
    os.replace(tmp, path)


def _load_builtin(data_cfg: DataConfig) -> Splits:
    files = builtin_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    # The cache name covers everything the packed tokens depend on, so a change means a new file.
    key = hashlib.sha256(f"v{_CACHE_VERSION} val_fraction={data_cfg.val_fraction}\n".encode())
    for f in files:
        key.update(f"{f.relative_to(root).as_posix()}\t{f.stat().st_size}\n".encode())
    cache = Path(os.path.expanduser(data_cfg.cache_dir or "~/.cache/nanomega"))
    stem = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{key.hexdigest()[:16]}"
    paths = Splits(cache / f"{stem}.train.bin", cache / f"{stem}.val.bin")
    if not all(p.exists() for p in paths):
        splits = _split_documents(root, files, data_cfg.val_fraction, f"the built-in corpus ({root})")
        cache.mkdir(parents=True, exist_ok=True)
        for p, arr in zip(paths, splits):
            _atomic_write(p, arr)
    return Splits(*(np.memmap(p, dtype="<u2", mode="r") for p in paths))


def load_splits(data_cfg: DataConfig, seq_len: int = 0) -> Splits:
    """Train and val token arrays for `data_cfg.path` (see the module docstring for the sources).

    `seq_len`, if given, makes a position-split file hold out at least one sequence for validation.
    """
    if not 0 < data_cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={data_cfg.val_fraction} must be between 0 and 1 (exclusive)")
    if not data_cfg.path:
        return _load_builtin(data_cfg)
    path = Path(os.path.expanduser(data_cfg.path))
    if not path.exists():
        raise FileNotFoundError(f"data.path={data_cfg.path!r} does not exist; give an existing text file, "
                                "folder, .bin or .npy, or --data.path= for the built-in corpus")
    min_val = seq_len + 1 if seq_len else 1
    if path.is_dir():
        # Hidden files and folders are version-control or editor state, not data.
        files = [p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
        if not files:
            raise ValueError(f"folder {path} is empty (no non-hidden files); put text files in it")
        files.sort(key=lambda p: p.relative_to(path).as_posix())
        return _split_documents(path, files, data_cfg.val_fraction, f"folder {path}")
    if path.suffix in (".bin", ".npy"):
        return _split_by_position(_load_pretokenized(path), data_cfg.val_fraction, min_val, str(path))
    tokens = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.uint16)
    return _split_by_position(tokens, data_cfg.val_fraction, min_val, f"text file {path}")


def check_vocab(splits: Splits, vocab_size: int) -> None:
    """Fail early on ids the embedding cannot look up (they would crash or silently wrap on GPU)."""
    for name, tokens in zip(("train", "val"), splits):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} split has token id {lo if lo < 0 else hi} but model.vocab_size={vocab_size} allows "
                             f"0..{vocab_size - 1}; use data tokenized for this model or a larger --model.vocab_size")


def _too_short(name: str, n_tokens: int, seq_len: int) -> ValueError:
    return ValueError(f"{name} split has {n_tokens} tokens but train.seq_len={seq_len} needs at least "
                      f"{seq_len + 1}; use more data, a smaller --train.seq_len or a larger --data.val_fraction")


def require_length(splits: Splits, seq_len: int) -> None:
    """One sequence needs seq_len + 1 tokens (inputs plus the shifted targets)."""
    for name, tokens in (("train", splits.train), ("validation", splits.val)):
        if len(tokens) < seq_len + 1:
            raise _too_short(name, len(tokens), seq_len)


# ---------------------------------------------------------------- batches

def _rows(tokens, starts, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    rows = torch.from_numpy(rows)
    return rows[:, :-1], rows[:, 1:]


class TokenSampler:
    """Random windows of seq_len + 1 tokens, a pure function of (seed, position).

    Epoch e cuts the stream at shift_e + k * seq_len (k < n_windows) and visits those windows in
    the order perm_e; shift_e and perm_e come from a generator seeded by (seed, e), so successive
    epochs see different cuts and orders. Sequence number i is window perm_e[i % n_windows] of
    epoch e = i // n_windows. n_windows leaves room for any shift in [0, seq_len) when the data
    allows, so each epoch skips under two windows' worth of tokens at the ends.
    """

    def __init__(self, tokens, seq_len: int, seed: int):
        if len(tokens) < seq_len + 1:
            raise _too_short("train", len(tokens), seq_len)
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.n_windows = max(1, (len(tokens) - 1) // seq_len - 1)
        self.max_shift = min(seq_len - 1, len(tokens) - 1 - self.n_windows * seq_len)
        self._cached = None   # (epoch, shift, perm): a speed-up only, never changes results

    def epoch_of(self, position: int) -> int:
        return position // self.n_windows

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._cached is None or self._cached[0] != epoch:
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            shift = int(torch.randint(0, self.max_shift + 1, (1,), generator=g))
            perm = torch.randperm(self.n_windows, generator=g).numpy()
            self._cached = (epoch, shift, perm)
        return self._cached[1], self._cached[2]

    def batch(self, position: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences position .. position + batch_size - 1 as (x, y) int64 [B, T]; may span epochs."""
        starts = []
        for i in range(position, position + batch_size):
            epoch, j = divmod(i, self.n_windows)
            shift, perm = self._epoch(epoch)
            starts.append(shift + int(perm[j]) * self.seq_len)
        return _rows(self.tokens, starts, self.seq_len)


def eval_batches(tokens, seq_len: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows spread evenly over the split, so every evaluation measures the same text.

    If fewer than batch_size * n_batches windows fit, fewer full batches are used (same shapes, so a
    compiled model is not recompiled); if not even one full batch fits, one smaller batch.
    """
    if len(tokens) < seq_len + 1:
        raise _too_short("validation", len(tokens), seq_len)
    available = (len(tokens) - 1) // seq_len        # non-overlapping windows that fit
    if available >= batch_size:
        n_batches = min(n_batches, available // batch_size)
    else:
        n_batches, batch_size = 1, available
    total = n_batches * batch_size
    last = len(tokens) - seq_len - 1                # the largest valid start
    starts = [k * last // (total - 1) if total > 1 else 0 for k in range(total)]
    return [_rows(tokens, starts[b * batch_size:(b + 1) * batch_size], seq_len) for b in range(n_batches)]
