"""Data preparation: text files, folders and JSONL tokenized once into a folder training reads directly.

    python -m nanomega.data prepare corpus/ more.jsonl --tokenizer=train:8192 --out=data/mine --workers 4
    python train.py --data.path=data/mine          # the folder's tokenizer becomes the run's

Inputs: a text file is one document; a folder is every non-hidden file under it (sorted by path); a *.jsonl
file is one document per line, its text under --field. Each document's ids are followed by the tokenizer's
EOS (so a document starts right after an EOS); a tokenizer with BOS and no EOS puts BOS before each document
instead. A document goes to validation when the first 8 bytes (little-endian) of sha256(key) modulo 10,000
fall below val_fraction x 10,000, the key being its path under the input folder (the rule data.py splits
text folders by, so both agree) or, for JSONL, "<path>:<line number>": stable across runs and machines, and
independent of every other document. A small corpus in which the rule picks no document holds out its last one
(one document: its tail, tail_tokens) and says so, as data.path's text folders do (sources.document_sides).

The folder (formats.py reads it; docs/data.md):
    meta.json              format, version, tokenizer identity, vocab_size, eos/bos ids, dtype, counts, files
    train.bin, val.bin     the ids, headerless little-endian, uint16 when the vocabulary fits, else uint32
    train.docs.npy, ...    each split's document starts (int64), so a reader can begin at a document
    tokenizer/             the tokenizer (tokenizer.save), so the folder says how to decode itself

Worker processes tokenize chunks of documents (about 256 kB of text each) with the tokenizer's encode_batch;
the parent reads the inputs and writes the chunks in input order. This module imports only the ground
layer (tokenizer, formats), so data.py's `python -m nanomega.data prepare` can point down to it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nanomega.data.formats import PREPARED_FORMAT, PREPARED_META, PREPARED_VERSION, token_dtype
from nanomega.data.tokenizer import RUN_FOLDER, ByteTokenizer, load_tokenizer, read_text, separator_id

CHUNK_BYTES = 1 << 18        # text per task: pickling it costs little, and the last tasks leave few workers idle
_TOKEN_SUFFIXES = (".bin", ".npy", ".idx")


MIN_TAIL = 1025     # tokens a one-document corpus holds out at least (up to half of it): one 1,024-token sequence


def in_val(key: str, val_fraction: float) -> bool:
    """The document split rule (module docstring); data.py's _split_documents uses it too. hashlib, not
    hash(): Python salts str hashes per process, and the split must never move."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 10_000 < val_fraction * 10_000


def held_out_note(what: str, n_documents: int, val_fraction: float, held: str) -> str:
    """The line a small corpus prints when the rule put no document into validation and one was held out (the
    last, in input order; with one document, its tail): sources.py and prepare say it alike."""
    return (f"data: no document of {what} fell into the validation split ({n_documents} documents, val_fraction="
            f"{val_fraction}); holding out {held} for validation instead")


def tail_tokens(n: int, val_fraction: float, min_val: int = MIN_TAIL) -> int:
    """How many tokens a one-document corpus of n tokens holds out: val_fraction of it, at least min_val, at
    most half (0 when there are fewer than 2)."""
    return min(max(math.ceil(n * val_fraction), min_val), n // 2)


def find_inputs(inputs: list[str]) -> list[tuple[Path, str]]:
    """(file, its key prefix) for every input file: a folder's non-hidden files by relative path."""
    found = []
    for spec in inputs:
        path = Path(os.path.expanduser(spec))
        if not path.exists():
            raise FileNotFoundError(f"input {spec} does not exist; give text files, folders or .jsonl files")
        if path.is_dir():
            files = sorted((p for p in path.rglob("*") if p.is_file()
                            and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                           key=lambda p: p.relative_to(path).as_posix())
            if not files:
                raise ValueError(f"input folder {spec} holds no (non-hidden) files; put text files in it")
            found += [(f, f.relative_to(path).as_posix()) for f in files]
        else:
            found.append((path, path.name))
    tokens = [f for f, _ in found if f.suffix in _TOKEN_SUFFIXES]
    if tokens:
        raise ValueError(f"{tokens[0]} is already token ids ({len(tokens)} such files among the inputs); prepare "
                         "reads text and JSONL: train on token files directly with --data.path, or leave them out")
    return found


def _check_jsonl(path: Path, field: str) -> None:
    """The first document line of a JSONL file has `field` as a string: a wrong --field is refused at once."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                _document(line, field, path, number)
                return


def _document(line: bytes, field: str, path, number: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}:{number} is not JSON ({e}); a .jsonl file holds one JSON object per line") from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}:{number} has no text field {field!r} (it has {keys}); pass --field with the "
                         "name of the field that holds the document's text")
    return record[field]


def _text(raw: bytes, field: str | None, path, number: int) -> str:
    """A document's text: a JSONL line's field, or a whole text file (tokenizer.read_text: bad UTF-8 replaced)."""
    return _document(raw, field, path, number) if field is not None else read_text(raw)


def _chunks(files: list[tuple[Path, str]], field: str):
    """Tasks for the workers, in input order: lists of (key, raw bytes, JSONL field or None, path, line number),
    ~CHUNK_BYTES each."""
    chunk, size = [], 0
    for path, key in files:
        if path.suffix == ".jsonl":
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        chunk.append((f"{key}:{number}", line, field, str(path), number))
                        size += len(line)
                    if size >= CHUNK_BYTES:
                        yield chunk
                        chunk, size = [], 0
        else:
            data = path.read_bytes()
            chunk.append((key, data, None, str(path), 0))
            size += len(data)
        if size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def encode_chunk(tok, chunk, val_fraction: float, dtype) -> tuple:
    """One task: (train ids, train document lengths, val ids, val lengths, text bytes read), separators included."""
    texts, sides, n_bytes = [], [], 0
    as_bytes = isinstance(tok, ByteTokenizer)
    for key, raw, field, path, number in chunk:
        # the byte tokenizer's ids are a text file's bytes as they are (as when data.path reads it): no decoding
        text = raw if as_bytes and field is None else _text(raw, field, path, number)
        n_bytes += len(raw)
        if text:         # an empty document would be a lone separator
            texts.append(text)
            sides.append(in_val(key, val_fraction))
    ids = [list(t) if isinstance(t, bytes) else tok.encode(t) for t in texts] if as_bytes else tok.encode_batch(texts)
    if tok.eos_id is not None:
        for doc in ids:
            doc.append(tok.eos_id)
    else:
        ids = [[tok.bos_id, *doc] for doc in ids]
    out = []
    for side in (False, True):
        docs = [doc for doc, s in zip(ids, sides) if s == side]
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        out += [np.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum())), lengths]
    return (*out, n_bytes)


_WORKER: dict = {}   # inside a worker process only: its tokenizer, loaded once (pickled per task it is ~10 MB)


def _start_worker(folder: str) -> None:
    _WORKER["tok"] = load_tokenizer(folder)


def _work(task) -> tuple:
    chunk, val_fraction, dtype = task
    return encode_chunk(_WORKER["tok"], chunk, val_fraction, dtype)


def prepare(inputs: list[str], tokenizer: str, out, field: str = "text", workers: int = 1,
            val_fraction: float = 0.005, cache_dir=None, progress: bool = True) -> dict:
    """Tokenize `inputs` into the folder `out` (module docstring); returns its meta.json contents."""
    out = Path(out)
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction={val_fraction} must be in [0, 1)")
    if workers < 1:
        raise ValueError(f"--workers={workers} must be at least 1")
    if (out / PREPARED_META).exists():
        raise ValueError(f"{out} already holds prepared data ({PREPARED_META}); choose another --out or remove it")
    files = find_inputs(inputs)
    total = sum(f.stat().st_size for f, _ in files)
    if total == 0:
        raise ValueError(f"the inputs ({len(files)} files) hold no bytes; point prepare at some text")
    for path, _ in files:
        if path.suffix == ".jsonl":
            _check_jsonl(path, field)
    corpus = None
    if tokenizer.startswith("train:"):     # the BPE learns from the same documents it will encode
        if any(f.suffix == ".jsonl" for f, _ in files):
            corpus = [_text(*item[1:]) for chunk in _chunks(files, field) for item in chunk]
        else:
            corpus = [f for f, _ in files]
    tok = load_tokenizer(tokenizer, corpus=corpus, cache_dir=cache_dir)
    if separator_id(tok) is None:
        raise ValueError(f"tokenizer {tok.name} has neither an EOS nor a BOS token, so documents cannot be told "
                         "apart; give its tokenizer_config.json an eos_token, or use another tokenizer")
    dtype = token_dtype(tok.vocab_size)

    out.mkdir(parents=True, exist_ok=True)
    tok.save(out / RUN_FOLDER)          # the workers load it from here, and readers later
    names = {"train": ("train.bin", "train.docs.npy"), "val": ("val.bin", "val.docs.npy")}
    sinks = {s: open(out / f"{names[s][0]}.tmp", "wb") for s in names}
    lengths = {s: [] for s in names}
    tasks = ((chunk, val_fraction, dtype) for chunk in _chunks(files, field))
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not progress)
    pool = None
    # Each worker encodes on one thread: the processes are the parallelism, so N workers use N cores. The
    # setting is read by `tokenizers` at each call, and inherited at fork (which also keeps it from warning
    # that it was forked after using threads); it is put back when done.
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        if workers == 1:
            results = (encode_chunk(tok, *task) for task in tasks)
        else:
            pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, (str(out / RUN_FOLDER),))
            results = pool.imap(_work, tasks)
        for train_ids, train_len, val_ids, val_len, n_bytes in results:
            train_ids.tofile(sinks["train"])
            val_ids.tofile(sinks["val"])
            lengths["train"].append(train_len)
            lengths["val"].append(val_len)
            bar.update(n_bytes)
        if pool is not None:
            pool.close()
            pool.join()
    except BaseException:
        if pool is not None:
            pool.terminate()
        for f in sinks.values():
            f.close()
        for s in names:
            (out / f"{names[s][0]}.tmp").unlink(missing_ok=True)
        raise
    finally:
        bar.close()
        os.environ.pop("TOKENIZERS_PARALLELISM") if before is None else os.environ.update(TOKENIZERS_PARALLELISM=before)
    for f in sinks.values():
        f.close()
    held = _hold_out(out, names, lengths, val_fraction, dtype) if val_fraction > 0 else None
    splits = {}
    for s, (tokens, docs) in names.items():
        n = np.concatenate(lengths[s]) if lengths[s] else np.zeros(0, np.int64)
        np.save(out / docs, np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64) if len(n) else n)
        os.replace(out / f"{tokens}.tmp", out / tokens)
        splits[s] = {"tokens": tokens, "docs": docs, "n_tokens": int(n.sum()), "n_documents": len(n)}
    n_docs = splits["train"]["n_documents"] + splits["val"]["n_documents"]
    problem = None
    if n_docs == 0:
        problem = "no document has any text (every one is empty); check the inputs and --field"
    elif splits["train"]["n_documents"] == 0 or (val_fraction > 0 and splits["val"]["n_documents"] == 0):
        side = "train" if splits["train"]["n_documents"] == 0 else "validation"
        problem = (f"no document fell into the {side} split ({n_docs} documents, --val-fraction={val_fraction}); "
                   "add documents or change --val-fraction")
    if problem:
        for s in names.values():
            for name in s:
                (out / name).unlink(missing_ok=True)
        shutil.rmtree(out / RUN_FOLDER, ignore_errors=True)
        raise ValueError(problem)
    meta = {"format": PREPARED_FORMAT, "version": PREPARED_VERSION, "tokenizer": tok.identity(),
            "tokenizer_folder": RUN_FOLDER, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
            "separator": "eos after each document" if tok.eos_id is not None else "bos before each document",
            "dtype": dtype.name, "val_fraction": val_fraction,
            "split": "sha256(key)[:8] little-endian % 10000 < val_fraction * 10000; key = path, or path:line for JSONL",
            "inputs": [str(i) for i in inputs], "field": field, "splits": splits, "held_out": held,
            "n_tokens": splits["train"]["n_tokens"] + splits["val"]["n_tokens"], "n_documents": n_docs}
    tmp = out / f"{PREPARED_META}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / PREPARED_META)       # last: a folder with meta.json is complete
    return meta


def _hold_out(out: Path, names: dict, lengths: dict, val_fraction: float, dtype) -> str | None:
    """When the split rule put no document into validation (a small corpus), the last train document moves
    there, or with one document its tail (tail_tokens): the written train.bin.tmp loses it, val.bin.tmp gets it.
    Returns what was held out, None when nothing needed to be."""
    train_len = np.concatenate(lengths["train"]) if lengths["train"] else np.zeros(0, np.int64)
    if sum(map(len, lengths["val"])) or len(train_len) == 0 or (len(train_len) == 1 and train_len[0] < 2):
        return None         # validation has documents, or nothing can be held out (refused below)
    n = int(train_len.sum())
    moved = int(train_len[-1]) if len(train_len) > 1 else tail_tokens(n, val_fraction)
    train_file, val_file = (out / f"{names[s][0]}.tmp" for s in ("train", "val"))
    with open(train_file, "r+b") as f:
        f.seek((n - moved) * dtype.itemsize)
        val_file.write_bytes(f.read())
        f.truncate((n - moved) * dtype.itemsize)
    if len(train_len) > 1:
        lengths["train"], lengths["val"] = [train_len[:-1]], [train_len[-1:]]
        held = "the last document"
    else:
        lengths["train"], lengths["val"] = [np.array([n - moved])], [np.array([moved])]
        held = f"its last {moved:,} tokens"
    print(held_out_note("the inputs", len(train_len), val_fraction, held))
    return held


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanomega.data", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text, folders and JSONL into a prepared folder")
    p.add_argument("inputs", nargs="+", help="text files, folders of them, .jsonl files")
    p.add_argument("--tokenizer", default="bytes", help="bytes | a tokenizer.json | a model folder | train:<vocab>")
    p.add_argument("--out", required=True, help="the folder to write")
    p.add_argument("--field", default="text", help="the JSONL field holding each document's text")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)), help="worker processes")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of documents held out for validation")
    p.add_argument("--cache-dir", default=None, help="where train:<vocab> keeps trained tokenizers")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.inputs, args.tokenizer, args.out, args.field, args.workers, args.val_fraction,
                       args.cache_dir)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    s = meta["splits"]
    print(f"wrote {args.out}: {s['train']['n_tokens']:,} train / {s['val']['n_tokens']:,} val tokens "
          f"({meta['n_documents']:,} documents, {meta['dtype']}, vocabulary {meta['vocab_size']:,}); "
          f"train on it with: python train.py --data.path={args.out}")
    return 0
