"""Data: every source a run can name, as (train, val) token splits. One idea in one file of ~500 lines: each
source kind below is a short branch of the same resolution (`load_splits`) and its checks, so a reader sees every
kind a path can be in one place; the byte layouts are formats.py's, the batches sampler.py's.

Every source ends up as two 1-D integer token sequences (train, val): arrays, memory-mapped where they
come from files, or formats.TokenStream where a split is several pieces. Sources, chosen by `data.path`
(layouts and commands in docs/data.md):
  ""            the built-in corpus: this interpreter's standard library *.py files, packed
                once into a cached uint16 file and split by document;
  a text folder every non-hidden file under it, split by document like the built-in corpus;
  a prepared folder  meta.json + train.bin / val.bin (`python -m nanomega.data prepare`, nanomega/data/prepare.py),
                its splits as given;
  a token folder .bin / .npy / .idx files (never read as text; a folder mixing them with text is refused):
                nanoGPT's train.bin + val.bin (headerless uint16; meta.pkl's vocab_size checked),
                modded-nanogpt / llm.c shards (*train*.bin and *val*.bin, each concatenated in name order),
                or Megatron indexed datasets (prefix.bin + prefix.idx, split by document);
  *.bin / *.npy pre-tokenized ids (a shard by its header, else raw uint16; a 1-D integer array), split by position;
  prefix.idx    a Megatron indexed dataset (also prefix.bin, or the bare prefix), split by document;
  anything else a text file, split by position (the last val_fraction goes to val);
  "w1 p1 w2 p2" a blend, Megatron-style: each source read as above, training sequences drawn by weight
                (Blend), validation every source's held-out part one after another.
Batches are drawn from the splits by nanomega/data/sampler.py.
Text is read by the run's tokenizer (data.tokenizer, run_tokenizer; nanomega/data/tokenizer.py): bytes by default,
documents joined with a NUL byte (token 0), which never occurs in source code or text; another tokenizer's
ids, documents joined by its EOS, are encoded once and cached by its sha256. Token documents are joined as
they are (Megatron's and the shards' documents carry their own EOS / BOS).
A source that names its validation part (val.bin, *val* shards) is used as it is, not split again;
`data.val_path` reads validation from a separate source of any kind and leaves data.path whole for training.
"""
from __future__ import annotations

import hashlib
import math
import os
import pickle
import re
import sys
import sysconfig
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import numpy as np

from nanomega.data.formats import (SHARD_LAYOUTS, TokenStream, documents_in_val, is_shard, prepared_meta, read_indexed,
                                   read_prepared, read_token_file, token_dtype)
from nanomega.data.prepare import held_out_note, in_val, tail_tokens
from nanomega.data.tokenizer import ByteTokenizer, load_tokenizer, read_text, separator_id

SEPARATOR = 0            # token between documents
_EXCLUDED_DIRS = ("site-packages", "dist-packages")   # third-party code differs between machines
_CACHE_VERSION = 1       # bump when the packed format changes, so stale caches are not reused


class Splits(NamedTuple):
    train: np.ndarray          # or a formats.TokenStream
    val: np.ndarray | None     # None only inside this module: a source read whole (data.val_path given)


# ---------------------------------------------------------------- sources

def builtin_corpus_files() -> list[Path]:
    """Standard-library *.py files, sorted by relative path, same on any machine with this Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _join(docs: list[bytes], tok) -> np.ndarray:
    """Documents as one token stream joined by the tokenizer's EOS (its BOS where it has none). The byte
    tokenizer's stream is the bytes themselves joined by NUL, as it always was; another tokenizer reads
    each document with tokenizer.read_text (bad UTF-8 replaced) and encodes it without special tokens."""
    if tok is None or isinstance(tok, ByteTokenizer):
        return np.frombuffer(bytes([SEPARATOR]).join(docs), dtype=np.uint8).astype(np.uint16)
    separator = separator_id(tok)
    if separator is None:
        raise ValueError(f"tokenizer {tok.name} has neither an EOS nor a BOS token to separate documents with; "
                         "give its tokenizer_config.json an eos_token")
    ids = []
    for a in range(0, len(docs), 256):      # a batch at a time: the encodings of a whole corpus would not fit
        ids += tok.encode_batch([read_text(d) for d in docs[a:a + 256]])
    for doc in ids[:-1]:
        doc.append(separator)
    return np.fromiter(chain.from_iterable(ids), dtype=token_dtype(tok.vocab_size), count=sum(map(len, ids)))


def document_sides(root: Path, files: list[Path], val_fraction: float, what: str) -> list[bool] | None:
    """Which documents are validation, by path (the rule prepare.in_val writes out). A small corpus in which
    the rule picks none holds out its last non-empty document instead (prepare does the same), and says so;
    None: there is one non-empty document, whose tail is held out (_split_documents)."""
    sides = [in_val(f.relative_to(root).as_posix(), val_fraction) for f in files]
    if any(sides) or not files:
        return sides
    filled = [i for i, f in enumerate(files) if f.stat().st_size]
    if len(filled) == 1:
        return None
    if filled:
        sides[filled[-1]] = True
        print(held_out_note(what, len(files), val_fraction,
                            f"the last document, {files[filled[-1]].relative_to(root).as_posix()},"))
    return sides


def _split_documents(root: Path, files: list[Path], val_fraction: float | None, what: str, tok=None,
                     min_val: int = 1, sides: list[bool] | None = None) -> Splits:
    """Join documents with the separator (_join) into a train and a val stream, each document on the side
    document_sides gives it (given as `sides`, or found here); one document is split by position like a text file.

    val_fraction None reads every document into train (val None): the source is used whole."""
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    if val_fraction is None:
        joined = _join([f.read_bytes() for f in files], tok)
        if not len(joined):
            raise ValueError(f"{what} is empty: {len(files)} files and no bytes; point it at some text")
        return Splits(joined, None)
    sides = sides if sides is not None else document_sides(root, files, val_fraction, what)
    if sides is None:     # one document: its tail, as a text file's (at least one sequence, at most half)
        doc = _join([f.read_bytes() for f in files if f.stat().st_size], tok)
        n_val = tail_tokens(len(doc), val_fraction, min_val)
        if n_val == 0:
            raise ValueError(f"{what} holds one document of {len(doc)} token(s): too little to train and validate on")
        print(held_out_note(what, len(files), val_fraction, f"the last {n_val:,} tokens of its one document"))
        return Splits(doc[:-n_val], doc[-n_val:])
    for f, side in zip(files, sides):       # with prepare's rule, so a folder splits alike read here or prepared
        parts[side].append(f.read_bytes())
    if not any(parts[False] + parts[True]):
        raise ValueError(f"{what} is empty: {len(files)} files and no bytes; point --data.path at some text")
    for is_val, name in ((False, "train"), (True, "val")):
        if not parts[is_val]:
            raise ValueError(f"{what}: no document fell into the {name} split ({len(files)} documents, "
                             f"data.val_fraction={val_fraction}); add more files or change --data.val_fraction")
    return Splits(*(_join(parts[v], tok) for v in (False, True)))


def _split_by_position(tokens, val_fraction: float | None, min_val: int, what: str) -> Splits:
    """The last val_fraction of the stream (at least min_val tokens) is validation; None: all is train."""
    if len(tokens) == 0:
        raise ValueError(f"{what} is empty; point --data.path at a file with data in it")
    if val_fraction is None:
        return Splits(tokens, None)
    n_val = max(math.ceil(len(tokens) * val_fraction), min_val, 1)
    if n_val >= len(tokens):
        raise ValueError(f"{what} has {len(tokens)} tokens; after holding out {n_val} for validation "
                         "the train split is empty; use more data or a smaller --data.val_fraction")
    cut = len(tokens) - n_val
    if isinstance(tokens, TokenStream):    # views, so a split of many shards reads nothing
        return Splits(tokens.window(0, cut), tokens.window(cut, len(tokens)))
    return Splits(tokens[:cut], tokens[cut:])


def _atomic_write(path: Path, array: np.ndarray, dtype="<u2") -> None:
    # Write under a temporary name and rename, so a crash or a concurrent run never sees half a file.
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    array.astype(dtype).tofile(tmp)
    os.replace(tmp, path)


def _is_bytes(tok) -> bool:
    return tok is None or isinstance(tok, ByteTokenizer)


def _cache_dir(data_cfg) -> Path:
    return Path(os.path.expanduser(data_cfg.cache_dir or "~/.cache/nanomega"))


def _load_builtin(data_cfg, tok=None) -> Splits:
    files = builtin_corpus_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    # The cache name covers everything the packed tokens depend on, so a change means a new file.
    key = hashlib.sha256(f"v{_CACHE_VERSION} val_fraction={data_cfg.val_fraction}\n".encode())
    if not _is_bytes(tok):     # the byte tokenizer's name is left as it was, so its caches stay valid
        key.update(f"tokenizer={tok.identity()['sha256']}\n".encode())
    for f in files:
        key.update(f"{f.relative_to(root).as_posix()}\t{f.stat().st_size}\n".encode())
    cache = _cache_dir(data_cfg)
    stem = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{key.hexdigest()[:16]}"
    paths = Splits(cache / f"{stem}.train.bin", cache / f"{stem}.val.bin")
    dtype = token_dtype(256 if _is_bytes(tok) else tok.vocab_size)
    if not all(p.exists() for p in paths):
        splits = _split_documents(root, files, data_cfg.val_fraction, f"the built-in corpus ({root})", tok)
        cache.mkdir(parents=True, exist_ok=True)
        for p, arr in zip(paths, splits):
            _atomic_write(p, arr, dtype)
    return Splits(*(np.memmap(p, dtype=dtype, mode="r") for p in paths))


def _tokenized(build, files: list[Path], tok, cache: Path, settings: str) -> Splits:
    """Text read by a tokenizer other than bytes is encoded once and kept in `cache` (.npy files named by the
    files' paths, sizes and times, the tokenizer's sha256 and the split settings); bytes are read as before."""
    if _is_bytes(tok):
        return build()
    key = hashlib.sha256(f"v{_CACHE_VERSION} {settings} tokenizer={tok.identity()['sha256']}\n".encode())
    for f in files:
        stat = f.stat()
        key.update(f"{f.resolve()}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    stem = cache / f"text-{key.hexdigest()[:16]}"
    train, val = stem.with_suffix(".train.npy"), stem.with_suffix(".val.npy")
    if not train.exists():
        splits = build()
        cache.mkdir(parents=True, exist_ok=True)
        for path, arr in ((val, splits.val), (train, splits.train)):    # train last: it marks a complete pair
            if arr is not None:
                tmp = path.with_name(f"{path.name}.tmp{os.getpid()}.npy")
                np.save(tmp, arr)
                os.replace(tmp, path)
    return Splits(np.load(train, mmap_mode="r"), np.load(val, mmap_mode="r") if val.exists() else None)


_TOKEN_SUFFIXES = (".bin", ".npy", ".idx")
_NANOGPT_META = "meta.pkl"
_VAL_NAME = re.compile(r"(^|[^a-z])(val|valid|validation)([^a-z]|$)")   # val.bin, fineweb_val_000000.bin


def _visible_files(root: Path) -> list[Path]:
    # Hidden files and folders are version-control or editor state, not data.
    files = [p for p in root.rglob("*") if p.is_file()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_indexed(prefixes: list[Path], root: Path, val_fraction: float | None, what: str) -> Splits:
    """Megatron indexed datasets, whole documents assigned to train or val (formats.documents_in_val,
    salted by the prefix's path under root), each split's documents in file then index order."""
    sources, picked = [], {False: [], True: []}
    for k, prefix in enumerate(prefixes):
        tokens, starts, lengths = read_indexed(prefix)
        sources.append(tokens)
        in_val = (documents_in_val(prefix.relative_to(root).as_posix(), len(starts), val_fraction)
                  if val_fraction is not None else np.zeros(len(starts), dtype=bool))
        for side in (False, True):
            keep = in_val == side
            picked[side].append((np.full(int(keep.sum()), k), starts[keep], lengths[keep]))
    streams = [TokenStream(sources, *(np.concatenate([p[i] for p in picked[side]]) for i in range(3)), documents=True)
               for side in (False, True)]
    if len(streams[0]) + len(streams[1]) == 0:
        raise ValueError(f"{what} holds no tokens; point --data.path at a dataset with documents in it")
    if val_fraction is None:
        return Splits(streams[0], None)
    for side, name in ((0, "train"), (1, "val")):
        if len(streams[side]) == 0:
            n_docs = sum(len(p[0]) for p in picked[False] + picked[True])
            raise ValueError(f"{what}: no document fell into the {name} split ({n_docs} documents, "
                             f"data.val_fraction={val_fraction}); change --data.val_fraction or give "
                             "validation separately with --data.val_path")
    return Splits(*streams)


def _read_token_folder(path: Path, files: list[Path], val_fraction: float | None, min_val: int) -> Splits:
    """A folder of token files: nanoGPT's, shards, or Megatron prefixes (see the module docstring)."""
    nanogpt = (path / "train.bin").is_file() and (path / "val.bin").is_file()
    if nanogpt:     # nanoGPT's data folders also hold prepare.py, input.txt and meta.pkl: not data to read
        files = [path / "train.bin", path / "val.bin"]
    text = [f for f in files if f.suffix not in _TOKEN_SUFFIXES and f.name != _NANOGPT_META]
    tokens = [f for f in files if f.suffix in _TOKEN_SUFFIXES]
    if text:
        raise ValueError(f"folder {path} mixes token files ({', '.join(f.name for f in tokens[:3])}...) with "
                         f"other files ({', '.join(f.relative_to(path).as_posix() for f in text[:3])}...); a folder "
                         "is read either as text or as tokens: move the text files out, or tokenize them")
    indexes = [f for f in tokens if f.suffix == ".idx"]
    if indexes:
        prefixes = [f.with_suffix("") for f in indexes]
        strays = [f for f in tokens if f.suffix != ".idx" and f.with_suffix("") not in prefixes]
        if strays:
            raise ValueError(f"folder {path} holds Megatron indexed datasets (.idx) and other token files "
                             f"({', '.join(f.name for f in strays[:3])}) with no .idx; keep one format per folder")
        return _read_indexed(prefixes, path, val_fraction, f"folder {path}")
    val_files = [f for f in tokens if _VAL_NAME.search(f.stem.lower())]
    train_files = [f for f in tokens if f not in val_files]
    if not train_files:
        raise ValueError(f"folder {path} holds only validation files ({', '.join(f.name for f in val_files[:3])}); "
                         "add training shards (names without 'val', e.g. fineweb_train_000001.bin)")
    bins = [f for f in tokens if f.suffix == ".bin"]
    headed = [f for f in bins if is_shard(f)]
    if headed and len(headed) < len(bins):   # one format per folder: a headerless one here is a damaged header
        bare = [f for f in bins if f not in headed]
        magic = int(np.fromfile(bare[0], dtype="<i4", count=1)[0]) if bare[0].stat().st_size >= 4 else None
        raise ValueError(f"folder {path} holds shards with a header ({headed[0].name}...) and .bin files without "
                         f"one ({', '.join(f.name for f in bare[:3])}; {bare[0].name} starts with {magic}, not a "
                         f"shard magic {sorted(SHARD_LAYOUTS)}); rewrite the damaged shards or move them out")
    train = TokenStream.concat([read_token_file(f) for f in train_files])
    if val_files:
        return Splits(train, TokenStream.concat([read_token_file(f) for f in val_files]))
    return _split_by_position(train, val_fraction, min_val, f"folder {path}")


def _read(path: Path, val_fraction: float | None, min_val: int, tok=None, cache: Path | None = None) -> Splits:
    """One source; val_fraction None reads it whole (val None unless the source names its own). Text is
    read with the tokenizer `tok` (None: bytes); a prepared folder's splits are used as they are."""
    bare_prefix = path.with_name(path.name + ".idx")
    if not path.exists() and bare_prefix.exists():      # Megatron's --data-path names the bare prefix
        return _read_indexed([path], path.parent, val_fraction, f"indexed dataset {path}")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; give an existing text file, folder, .bin, .npy or "
                                "Megatron prefix, or --data.path= for the built-in corpus")
    if path.is_dir() and prepared_meta(path) is not None:
        train, val, _ = read_prepared(path)
        return Splits(train, val)
    if path.is_dir():
        files = _visible_files(path)
        if not files:
            raise ValueError(f"folder {path} is empty (no non-hidden files); put text files in it")
        if any(f.suffix in _TOKEN_SUFFIXES for f in files):
            return _read_token_folder(path, files, val_fraction, min_val)
        what = f"folder {path}"       # the sides are found (and a hold-out said) even when the tokens are cached
        sides = document_sides(path, files, val_fraction, what) if val_fraction is not None else None
        return _tokenized(lambda: _split_documents(path, files, val_fraction, what, tok, min_val, sides), files, tok,
                          cache, f"folder val_fraction={val_fraction} min_val={min_val}")
    if path.suffix == ".idx" or (path.suffix == ".bin" and path.with_suffix(".idx").exists()):
        return _read_indexed([path.with_suffix("")], path.parent, val_fraction, f"indexed dataset {path}")
    if path.suffix in (".bin", ".npy"):
        return _split_by_position(read_token_file(path), val_fraction, min_val, str(path))
    return _tokenized(lambda: _split_by_position(_join([path.read_bytes()], tok), val_fraction, min_val,
                                                 f"text file {path}"),
                      [path], tok, cache, f"file val_fraction={val_fraction} min_val={min_val}")


_BLEND_PERIOD = 10_000     # blend weights are kept to 1 / _BLEND_PERIOD


class Blend:
    """Several training sources mixed by weight, Megatron-style (--data.path="0.7 a.bin 0.3 dir/").

    Of every _BLEND_PERIOD sequences, source k gives quota_k = w_k * period (rounded by largest
    remainders, so the quotas add up), in the order of Megatron's blending rule (build_blending_indices:
    sequence j comes from the source with the largest w_k * max(j, 1) - taken_k) applied to the rounded
    weights w_k = quota_k / period, which makes every period take exactly its quotas (Megatron's
    unrounded rule can end a period one sequence off, e.g. weights 0.9353 / 0.0647). Sequence i of the blend
    is therefore sequence (i // period) * quota_k + (its rank among source k's in the period) of source
    k: a pure function of i, so a resumed run continues every source where it was, and each source's own
    sampler walks its epochs without repeating a window.
    """

    def __init__(self, parts: list, weights: list[float], names: list[str]):
        if len(parts) != len(weights) or not weights or min(weights) <= 0:
            raise ValueError(f"blend weights {weights} must be positive, one per source")
        w = np.asarray(weights, dtype=np.float64) / sum(weights)
        quota = np.floor(w * _BLEND_PERIOD).astype(np.int64)
        short = _BLEND_PERIOD - int(quota.sum())
        quota[np.argsort(-(w * _BLEND_PERIOD - quota), kind="stable")[:short]] += 1
        if quota.min() == 0:
            raise ValueError(f"blend weight {min(weights)} of {names[int(np.argmin(quota))]} is below "
                             f"1/{_BLEND_PERIOD} of the total; raise it or drop the source")
        order, rank, taken = np.empty(_BLEND_PERIOD, np.int64), np.empty(_BLEND_PERIOD, np.int64), np.zeros_like(quota)
        for j in range(_BLEND_PERIOD):   # in integers, on the rounded weights: each period takes exactly its quotas
            k = int(np.argmax(quota * max(j, 1) - taken * _BLEND_PERIOD))
            order[j], rank[j] = k, taken[k]
            taken[k] += 1
        assert np.array_equal(taken, quota), (taken, quota)
        self.parts, self.names, self.quota, self.order, self.rank = parts, names, quota, order, rank

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def locate(self, i: int) -> tuple[int, int]:
        """(source, that source's sequence number) of the blend's sequence i."""
        block, j = divmod(i, _BLEND_PERIOD)
        k = int(self.order[j])
        return k, block * int(self.quota[k]) + int(self.rank[j])


def _blend_spec(spec: str) -> list[tuple[float, str]] | None:
    """"0.7 a.bin 0.3 dir/" -> [(0.7, "a.bin"), (0.3, "dir/")]; None for a single path."""
    words = spec.split()
    if len(words) < 2:
        return None
    try:
        float(words[0])
    except ValueError:
        return None      # a path with a space in it
    if len(words) % 2:
        raise ValueError(f"data.path={spec!r} is not weight-path pairs (Megatron's '0.7 a 0.3 b'); "
                         "give a weight before every path")
    pairs = []
    for weight, path in zip(words[::2], words[1::2]):
        try:
            pairs.append((float(weight), path))
        except ValueError:
            raise ValueError(f"data.path={spec!r}: {weight!r} is not a weight; write weight-path pairs") from None
    return pairs


def load_splits(data_cfg, seq_len: int = 0, tok=None) -> Splits:
    """Train and val token sequences for `data_cfg.path` and `data_cfg.val_path` (see the module docstring).

    `seq_len`, if given, makes a position-split file hold out at least one sequence for validation. Text
    sources are read with the tokenizer `tok` (run_tokenizer; None: bytes).
    """
    if not 0 < data_cfg.val_fraction < 1:
        raise ValueError(f"data.val_fraction={data_cfg.val_fraction} must be between 0 and 1 (exclusive)")
    min_val = seq_len + 1 if seq_len else 1
    hold_out = None if data_cfg.val_path else data_cfg.val_fraction
    if not data_cfg.path:
        splits = _load_builtin(data_cfg, tok)
    elif blend := _blend_spec(data_cfg.path):
        parts = []
        for _, p in blend:
            try:
                parts.append(_read(Path(os.path.expanduser(p)), hold_out, min_val, tok, _cache_dir(data_cfg)))
            except FileNotFoundError as e:
                raise FileNotFoundError(f"data.path={data_cfg.path!r}: {e}") from None
        weights, names = [w for w, _ in blend], [p for _, p in blend]
        # Validation mixes every source's held-out part by the same weights as training (eval_batches).
        splits = Splits(Blend([s.train for s in parts], weights, names),
                        None if hold_out is None else Blend([s.val for s in parts], weights, names))
    else:
        path = Path(os.path.expanduser(data_cfg.path))
        try:
            splits = _read(path, hold_out, min_val, tok, _cache_dir(data_cfg))
        except FileNotFoundError as e:
            raise FileNotFoundError(f"data.path={data_cfg.path!r}: {e}") from None
    if not data_cfg.val_path:
        return splits
    try:
        val = _read(Path(os.path.expanduser(data_cfg.val_path)), None, 1, tok, _cache_dir(data_cfg))
    except FileNotFoundError as e:
        raise FileNotFoundError(f"data.val_path={data_cfg.val_path!r}: {e}") from None
    # A source that names its own validation part (val.bin, *val* shards) gives that part; any other, all of it.
    return Splits(splits.train, val.val if val.val is not None else val.train)


def _sources(data_cfg) -> list[str]:
    """The paths data.path and data.val_path name ("" for the built-in corpus), blends unpacked."""
    paths = [p for _, p in _blend_spec(data_cfg.path) or [(1, data_cfg.path)]]
    return paths + ([data_cfg.val_path] if data_cfg.val_path else [])


def _text_corpus(data_cfg) -> list[Path]:
    """The text files a "train:<vocab>" tokenizer learns from: data.path's documents (all of them)."""
    if not data_cfg.path:
        return builtin_corpus_files()
    path = Path(os.path.expanduser(data_cfg.path))
    files = _visible_files(path) if path.is_dir() else [path]
    if _blend_spec(data_cfg.path) or not path.exists() or any(f.suffix in _TOKEN_SUFFIXES for f in files) \
            or prepared_meta(path) is not None:
        raise ValueError(f"data.tokenizer={data_cfg.tokenizer} trains a BPE on text, but data.path={data_cfg.path!r} "
                         "is not one text file or folder of text; train it while preparing the text (python -m "
                         f"nanomega.data prepare TEXT... --tokenizer={data_cfg.tokenizer} --out=DIR) and train on DIR")
    return files


def run_tokenizer(data_cfg):
    """The run's tokenizer (data.tokenizer): "train:<vocab>" is trained on data.path's text once and cached."""
    corpus = _text_corpus(data_cfg) if data_cfg.tokenizer.startswith("train:") else None
    return load_tokenizer(data_cfg.tokenizer, corpus=corpus, cache_dir=_cache_dir(data_cfg))


def check_prepared(data_cfg, vocab_size: int, tok=None) -> None:
    """Prepared folders among the sources, from their meta.json alone (no token is read): a vocabulary larger
    than the model's is refused, and so is a run tokenizer `tok` other than the one the folder was made with."""
    for p in _sources(data_cfg):
        folder = Path(os.path.expanduser(p)) if p else None
        meta = prepared_meta(folder) if folder is not None and folder.is_dir() else None
        if meta is None:
            continue
        made_with = meta["tokenizer"]
        if meta["vocab_size"] > vocab_size:
            raise ValueError(f"{folder} was prepared with tokenizer {made_with['name']} of {meta['vocab_size']:,} ids "
                             f"(its meta.json), but model.vocab_size={vocab_size:,}; set --model.vocab_size="
                             f"{meta['vocab_size']} or more, or prepare the data with this model's tokenizer")
        if tok is not None and tok.identity()["sha256"] != made_with["sha256"]:
            raise ValueError(f"{folder} was prepared with tokenizer {made_with['name']} (sha256 "
                             f"{made_with['sha256'][:12]}...), but the run's is {tok.name} "
                             f"({tok.identity()['sha256'][:12]}...); drop --data.tokenizer (the folder's own is the "
                             f"default: {folder / meta['tokenizer_folder']}) or prepare the data again with this tokenizer")


class _PlainUnpickler(pickle.Unpickler):
    """nanoGPT's meta.pkl holds dicts, strings and ints only; refuse anything that would run code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain dicts, strings and "
                                     "numbers are read (nanoGPT's vocab_size, itos, stoi)")


def declared_vocab_size(data_cfg) -> int | None:
    """The largest vocab_size of nanoGPT's meta.pkl beside train.bin, in data.path (or its blend's sources)."""
    paths = [p for _, p in _blend_spec(data_cfg.path) or [(1, data_cfg.path)] if p]
    sizes = []
    for meta in (Path(os.path.expanduser(p)) / _NANOGPT_META for p in paths + [data_cfg.val_path] if p):
        if not meta.is_file():
            continue
        with open(meta, "rb") as f:
            content = _PlainUnpickler(f).load()
        size = content.get("vocab_size") if isinstance(content, dict) else None
        if not isinstance(size, int):
            raise ValueError(f"{meta} has no integer 'vocab_size' (nanoGPT writes one); add it or remove the file")
        sizes.append(size)
    return max(sizes, default=None)


_SCAN_LIMIT = 1 << 28     # tokens: a split up to this size is checked whole at start-up (about 0.2 s per 100M)


def _id_range(tokens, chunk: int = 1 << 24) -> tuple[int, int]:
    """min and max of a token sequence, read a chunk at a time (a memory map, a TokenStream)."""
    lo, hi = None, None
    for a in range(0, len(tokens), chunk):
        part = np.asarray(tokens[a:a + chunk])
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    return (lo, hi) if lo is not None else (0, 0)


def check_vocab(splits: Splits, vocab_size: int, declared: int | None = None) -> None:
    """Fail early on ids the embedding cannot look up (they would crash or silently wrap on GPU), and
    on a model smaller than the vocabulary the data declares (nanoGPT's meta.pkl: declared_vocab_size).

    Start-up reads no more than _SCAN_LIMIT tokens of a split: a larger one (a corpus of billions of
    tokens) is left to TokenSampler, which checks every batch it draws; an unsigned dtype whose largest
    value is below vocab_size needs no reading at all (uint16 ids under a 128k vocabulary)."""
    if declared is not None and declared > vocab_size:
        raise ValueError(f"the data's meta.pkl declares vocab_size={declared} but model.vocab_size={vocab_size}; "
                         f"set --model.vocab_size={declared} or more (nanoGPT pads to a multiple of 64)")
    for name, split in zip(("train", "val"), splits):
        for tokens in split.parts if isinstance(split, Blend) else [split]:
            kind = np.dtype(tokens.dtype)
            if (kind.kind == "u" and np.iinfo(kind).max < vocab_size) or len(tokens) > _SCAN_LIMIT:
                continue
            lo, hi = _id_range(tokens)
            if lo < 0 or hi >= vocab_size:
                raise out_of_vocab(f"{name} split", lo if lo < 0 else hi, vocab_size)


def check_documents(splits: Splits, separator: int, chunk: int = 1 << 24) -> None:
    """data.mask=document reads where documents open from the separator token (hints.document_mask): refuse
    training data in which it never occurs (one document, or a source that records its documents some other way,
    without a separator between them), where the mask would change nothing. Reads chunks up to the first hit."""
    parts = splits.train.parts if isinstance(splits.train, Blend) else [splits.train]
    for tokens in parts:
        if any((np.asarray(tokens[a:a + chunk]) == separator).any() for a in range(0, len(tokens), chunk)):
            return
    raise ValueError(f"data.mask=document keeps documents apart where token {separator} (the tokenizer's "
                     f"separator) opens one, but the training data ({len(splits.train):,} tokens) never holds it: "
                     "it is one document, or its documents were joined without a separator; use "
                     "--data.mask=causal, or prepare the data with python -m nanomega.data prepare, which writes one")


def out_of_vocab(where: str, token: int, vocab_size: int) -> ValueError:
    return ValueError(f"{where} has token id {token} but model.vocab_size={vocab_size} allows "
                      f"0..{vocab_size - 1}; use data tokenized for this model or a larger --model.vocab_size")


def too_short(name: str, n_tokens: int, seq_len: int) -> ValueError:
    return ValueError(f"{name} split has {n_tokens} tokens but train.seq_len={seq_len} needs at least "
                      f"{seq_len + 1}; use more data, a smaller --train.seq_len or a larger --data.val_fraction")


def require_length(splits: Splits, seq_len: int) -> None:
    """One sequence needs seq_len + 1 tokens (inputs plus the shifted targets)."""
    named = []
    for split, tokens in (("train", splits.train), ("validation", splits.val)):
        parts = zip(tokens.names, tokens.parts) if isinstance(tokens, Blend) else [("", tokens)]
        named += [(f"{split} ({n})" if n else split, t) for n, t in parts]
    for name, tokens in named:
        if len(tokens) < seq_len + 1:
            raise too_short(name, len(tokens), seq_len)

