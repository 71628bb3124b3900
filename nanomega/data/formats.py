"""Token files other projects write, read by their published layouts (docs/data.md), memory-mapped.

  raw uint16    nanoGPT's train.bin / val.bin: headerless little-endian uint16 ids;
  shard         modded-nanogpt / llm.c: 256 little-endian int32 (magic, version, token count, zeros), then
                the ids: magic 20240520 version 1 = uint16 (GPT-2), magic 20240801 version 7 = uint32 (Llama 3);
  indexed       Megatron's indexed dataset, prefix.idx + prefix.bin: the .idx holds b"MMIDIDX\\x00\\x00", a
                uint64 version (1), a uint8 dtype code, uint64 sequence and document counts, then int32
                sequence lengths, int64 sequence byte offsets and int64 document boundaries (indices into
                the sequences, starting at 0, one more than the documents);
  .npy          a 1-D integer array;
  prepared      ours (`python -m nanomega.data prepare`, nanomega/data/prepare.py): a folder with meta.json (format
                "nanomega-prepared", version 1, dtype, vocab_size, tokenizer) naming train and val token files
                (headerless little-endian, in meta.json's dtype: uint16 ones are also nanoGPT's train.bin /
                val.bin) and each split's int64 document starts (.npy).

Nothing here loads a corpus into memory: files are np.memmap'd and a split that is not one contiguous
piece of one file (several shards, the documents of an indexed dataset) is a TokenStream of views.
This module imports nothing from nanomega (the ground layer), so data.py can build on it.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

SHARD_HEADER_INTS = 256
SHARD_LAYOUTS = {20240520: (1, np.dtype("<u2"), "modded-nanogpt / llm.c GPT-2 shard"),
                 20240801: (7, np.dtype("<u4"), "llm.c Llama 3 shard")}
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                8: np.uint16}


class TokenStream:
    """Segments of token arrays read as one 1-D stream: `stream[a:b]` is an ndarray, `len()` its length.

    Segment k is sources[source[k]][start[k]:start[k] + length[k]]; the per-segment arrays are int64,
    so a split of a million documents costs 32 MB of index and no tokens. `documents` says that every
    segment is one document (Megatron's indexed datasets), so a sampler can start sequences at them.
    """

    def __init__(self, sources: list[np.ndarray], source, start, length, documents: bool = False):
        self.sources, self.documents = sources, documents
        self.source, self.start, self.length = (np.asarray(a, dtype=np.int64) for a in (source, start, length))
        self.ends = np.cumsum(self.length)
        self.dtype = np.result_type(*(s.dtype for s in sources))

    @classmethod
    def concat(cls, arrays: list[np.ndarray]) -> "TokenStream | np.ndarray":
        """The arrays one after another (shards in order); a single array is returned as it is."""
        if len(arrays) == 1:
            return arrays[0]
        return cls(arrays, range(len(arrays)), [0] * len(arrays), [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def window(self, a: int, b: int) -> "TokenStream":
        """Tokens a..b-1 as a stream of views, nothing read (a split by position of a stream)."""
        first = int(np.searchsorted(self.ends, a, side="right"))
        last = int(np.searchsorted(self.ends, b, side="left"))
        sl = slice(first, last + 1)
        begins = self.ends[sl] - self.length[sl]
        start = self.start[sl] + np.maximum(a - begins, 0)
        length = np.maximum(np.minimum(self.ends[sl], b) - np.maximum(begins, a), 0)
        return TokenStream(self.sources, self.source[sl], start, length, self.documents)

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            key = int(key) + (len(self) if key < 0 else 0)
            return self[key:key + 1][0]
        a, b, step = key.indices(len(self))
        if step != 1:
            raise IndexError("a TokenStream is read in contiguous slices only")
        part = self.window(a, max(a, b))
        pieces = [self.sources[s][st:st + n] for s, st, n in zip(part.source, part.start, part.length) if n > 0]
        return np.concatenate(pieces).astype(self.dtype, copy=False) if pieces else np.zeros(0, self.dtype)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)


def is_shard(path: Path) -> bool:
    """Whether the file starts with a shard magic (a headerless uint16 file would have to start 55432, 308)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<i", head)[0] in SHARD_LAYOUTS


def read_shard(path: Path) -> np.ndarray:
    """The ids of a modded-nanogpt / llm.c shard, after checking its magic, version and length."""
    header = np.fromfile(path, dtype="<i4", count=SHARD_HEADER_INTS)
    if len(header) < 3 or int(header[0]) not in SHARD_LAYOUTS:
        known = ", ".join(f"{m} (version {v}, {what})" for m, (v, _, what) in SHARD_LAYOUTS.items())
        raise ValueError(f"{path} does not start with a shard magic (its first int32 is "
                         f"{int(header[0]) if len(header) else 'missing'}; known: {known}); write shards with "
                         "a 256-int32 header, or name a headerless uint16 file train.bin / val.bin")
    magic, version, n_tokens = (int(x) for x in header[:3])
    expected_version, dtype, what = SHARD_LAYOUTS[magic]
    if version != expected_version:
        raise ValueError(f"{path}: magic {magic} ({what}) has version {expected_version}, but this header says "
                         f"version {version}; rewrite the shard with version {expected_version}")
    expected = SHARD_HEADER_INTS * 4 + n_tokens * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{path} has {size:,} bytes but its header says {n_tokens:,} {dtype.name} tokens, "
                         f"so {expected:,} bytes are expected (1,024 of header); the shard is "
                         f"{'truncated' if size < expected else 'longer than its header'}: copy or write it again")
    return np.memmap(path, dtype=dtype, mode="r", offset=SHARD_HEADER_INTS * 4, shape=(n_tokens,))


def read_raw_uint16(path: Path) -> np.ndarray:
    """nanoGPT's headerless uint16 little-endian ids."""
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path} has {size} bytes, an odd number, so it is not uint16 tokens; .bin files must "
                         "hold raw uint16 little-endian ids or a shard header (use .npy for other dtypes)")
    if size == 0:
        raise ValueError(f"{path} is empty; point --data.path at a file with tokens in it")
    return np.memmap(path, dtype="<u2", mode="r")


def read_npy(path: Path) -> np.ndarray:
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"{path} holds a {tokens.ndim}-D {tokens.dtype} array; a .npy token file must be "
                         "a 1-D integer array (flatten it and cast, e.g. arr.reshape(-1).astype(np.uint16))")
    return tokens     # kept in its own dtype: vocabularies above 65535 do not fit uint16


def read_token_file(path: Path) -> np.ndarray:
    """A .npy array, a shard (by its magic) or a headerless uint16 .bin."""
    if path.suffix == ".npy":
        return read_npy(path)
    return read_shard(path) if is_shard(path) else read_raw_uint16(path)


def read_indexed(prefix: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's prefix.bin + prefix.idx as (tokens, document starts, document lengths), in tokens."""
    idx, bin_ = prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")
    for f in (idx, bin_):
        if not f.exists():
            raise FileNotFoundError(f"{f} does not exist: a Megatron indexed dataset is a .bin and a .idx "
                                    "with the same prefix")
    with open(idx, "rb") as f:
        head = f.read(9 + 8 + 1 + 8 + 8)
    if head[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx} starts with {head[:9]!r}, not Megatron's {INDEX_MAGIC!r}; write it with "
                         "Megatron's preprocess_data.py (the mmap indexed dataset)")
    if len(head) < 34:
        raise ValueError(f"{idx} has {len(head)} bytes, fewer than the 34 of the header; write it again")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise ValueError(f"{idx} has index version {version}; only version 1 is known; write it with "
                         "Megatron's preprocess_data.py")
    if code not in INDEX_DTYPES or np.dtype(INDEX_DTYPES[code]).kind not in "iu":
        integer_codes = ", ".join(f"{k} {np.dtype(v).name}" for k, v in INDEX_DTYPES.items() if np.dtype(v).kind in "iu")
        raise ValueError(f"{idx} has dtype code {code}; token ids need an integer code ({integer_codes})")
    dtype = np.dtype(INDEX_DTYPES[code])
    need = 34 + n_seq * (4 + 8) + n_doc * 8
    if idx.stat().st_size < need:
        raise ValueError(f"{idx} has {idx.stat().st_size:,} bytes but its header's {n_seq:,} sequences and "
                         f"{n_doc:,} document boundaries need {need:,}; the index is truncated: write it again")
    lengths = np.memmap(idx, dtype="<i4", mode="r", offset=34, shape=(n_seq,))
    pointers = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 4 * n_seq, shape=(n_seq,))
    bounds = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 12 * n_seq, shape=(n_doc,))
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    # Megatron's writer lays sequences end to end, so a document is one run of the .bin; check it is.
    if n_doc < 1 or bounds[0] != 0 or bounds[-1] != n_seq or np.any(np.diff(bounds) < 0) \
            or not np.array_equal(pointers, ends[:-1] * dtype.itemsize):
        raise ValueError(f"{idx}: the sequence offsets or document boundaries are not Megatron's contiguous "
                         "layout (offsets the running sum of lengths, boundaries rising from 0 to the sequence "
                         "count); write the dataset again with preprocess_data.py")
    if bin_.stat().st_size != ends[-1] * dtype.itemsize:
        raise ValueError(f"{bin_} has {bin_.stat().st_size:,} bytes but {idx} indexes {int(ends[-1]):,} "
                         f"{dtype.name} tokens ({int(ends[-1]) * dtype.itemsize:,} bytes); the pair does not "
                         "match (truncated or from different runs): write both again")
    tokens = np.memmap(bin_, dtype=dtype.newbyteorder("<"), mode="r") if ends[-1] else np.zeros(0, dtype)
    starts = ends[np.asarray(bounds[:-1])]
    return tokens, starts, ends[np.asarray(bounds[1:])] - starts


def splitmix64(keys: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 keys, vectorized (wrapping arithmetic): a stable hash per key."""
    z = keys.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def documents_in_val(name: str, n_docs: int, val_fraction: float) -> np.ndarray:
    """Which documents of the indexed dataset `name` are validation: splitmix64(salt + index) % 10000 <
    val_fraction * 10000, the salt the first 8 bytes (little-endian) of sha256(name). Stable across runs
    and machines, and a document's side does not depend on the others."""
    salt = int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")
    with np.errstate(over="ignore"):
        keys = np.arange(n_docs, dtype=np.uint64) + np.uint64(salt)
        return splitmix64(keys) % np.uint64(10_000) < val_fraction * 10_000


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


PREPARED_FORMAT, PREPARED_VERSION = "nanomega-prepared", 1
PREPARED_META = "meta.json"


def prepared_meta(folder: Path) -> dict | None:
    """The meta.json of a folder nanomega's prepare wrote, or None for any other folder."""
    path = Path(folder) / PREPARED_META
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == PREPARED_FORMAT else None


def read_prepared(folder: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train tokens, val tokens, meta) of a prepared folder, memory-mapped in meta.json's dtype, each file's
    length checked against its token count."""
    folder = Path(folder)
    meta = prepared_meta(folder)
    if meta is None:
        raise ValueError(f"{folder} has no {PREPARED_META} of format {PREPARED_FORMAT!r}")
    if meta.get("version") != PREPARED_VERSION:
        raise ValueError(f"{folder / PREPARED_META} has version {meta.get('version')}; this nanomega reads version "
                         f"{PREPARED_VERSION}: prepare the data again with python -m nanomega.data prepare")
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    splits = []
    for name in ("train", "val"):
        split = meta["splits"][name]
        file = folder / split["tokens"]
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing ({folder / PREPARED_META} names it); prepare the data again")
        size, expected = file.stat().st_size, split["n_tokens"] * dtype.itemsize
        if size != expected:
            raise ValueError(f"{file} has {size:,} bytes but {PREPARED_META} says {split['n_tokens']:,} {dtype.name} "
                             f"tokens ({expected:,} bytes); the folder is damaged: prepare the data again")
        tokens = np.memmap(file, dtype=dtype, mode="r") if size else np.zeros(0, dtype)
        if size and (folder / split["docs"]).is_file():   # where documents start: data.align=bos reads no tokens
            tokens.document_starts = np.load(folder / split["docs"], mmap_mode="r")
        splits.append(tokens)
    return splits[0], splits[1], meta
