"""Data preparation's throughput against the tokenizer's own batch encoding, on the same text and workers.

    python bench/prepare_throughput.py                          # 8 MB of the standard library, 1 and 2 workers
    python bench/prepare_throughput.py --mb 32 --workers 1 2 4 --tokenizer path/to/tokenizer.json

"prepare" is `python -m nanomega.data prepare` end to end (nanomega/data/prepare.py): reading the files, N worker
processes encoding ~1 MB chunks, the ids written to train.bin / val.bin with their document starts and
meta.json. "encode_batch" is the `tokenizers` library alone on the same documents, already in memory, with N
threads (RAYON_NUM_THREADS=N, in a fresh process): `[e.ids for e in tokenizer.encode_batch(docs)]` in batches
of 1,000 documents, nothing read or written; and the same with encode_batch_fast (no character offsets), which
prepare's workers call (HFTokenizer.encode_batch), so the last column is the cost of prepare's own work.
Tokens per second of each (the text's tokens, EOS not counted), best of --repeats; the ratio
prepare / encode_batch is the figure (goal >= 0.8). The tokenizer is a byte-level BPE of --vocab trained on
the same text (cached under --cache-dir), unless --tokenizer names one.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402  (bench/results_io.py, beside this file)

from nanomega.data.sources import builtin_corpus_files  # noqa: E402
from nanomega.data.prepare import prepare  # noqa: E402
from nanomega.data.tokenizer import load_tokenizer  # noqa: E402

REFERENCE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
docs = [open(p, "rb").read().decode("utf-8", errors="replace") for p in json.load(open(sys.argv[2]))]
docs = [d for d in docs if d]
best = None
out = {}
for name in ("encode_batch", "encode_batch_fast"):
    encode, best = getattr(tok, name), None
    for _ in range(int(sys.argv[3])):
        start = time.perf_counter()
        n = 0
        for a in range(0, len(docs), 1000):
            n += sum(len(e.ids) for e in encode(docs[a:a + 1000], add_special_tokens=False))
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    out[name] = {"tokens": n, "seconds": best}
print(json.dumps(out))
"""


def tables(doc: dict) -> str:
    r = doc["results"]
    rows = [[w["workers"], f"{w['prepare_tokens_per_s']:,.0f}", f"{w['encode_batch_tokens_per_s']:,.0f}",
             f"{w['ratio']:.2f}", f"{w['encode_batch_fast_tokens_per_s']:,.0f}", f"{w['ratio_fast']:.2f}"]
            for w in r["rows"]]
    return (f"{r['mb']:.1f} MB of text ({r['documents']:,} documents, {r['tokens']:,} tokens with EOS), tokenizer "
            f"{r['tokenizer']} (vocabulary {r['vocab_size']:,}); best of {r['repeats']}\n\n"
            + results_io.table(["workers", "prepare tokens/s", "encode_batch tokens/s", "prepare / encode_batch",
                                "encode_batch_fast tokens/s", "prepare / encode_batch_fast"], "rrrrrr", rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=8.0, help="megabytes of standard-library source to encode")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokenizer", default="", help="a tokenizer.json or folder (default: a BPE trained on the text)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--cache-dir", default=None)
    results_io.add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        return results_io.render(args.render, tables)
    files, size = [], 0
    for f in builtin_corpus_files():
        if size >= args.mb * 1e6:
            break
        files.append(f)
        size += f.stat().st_size
    spec = args.tokenizer or f"train:{args.vocab}"
    tok = load_tokenizer(spec, corpus=files, cache_dir=args.cache_dir)
    doc = results_io.start("prepare_throughput")
    results = {"mb": size / 1e6, "documents": 0, "tokens": 0, "tokenizer": spec, "vocab_size": tok.vocab_size,
               "repeats": args.repeats, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(Path(tmp) / "tok")
        listing = Path(tmp) / "files.json"
        listing.write_text(json.dumps([str(f) for f in files]))
        for workers in args.workers:
            best = None
            for k in range(args.repeats):
                start = time.perf_counter()
                meta = prepare([str(f) for f in files], str(Path(tmp) / "tok"), Path(tmp) / f"out{workers}-{k}",
                               workers=workers, val_fraction=0.05, progress=False)
                seconds = time.perf_counter() - start
                best = seconds if best is None else min(best, seconds)
            env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "TOKENIZERS_PARALLELISM": "true"}
            ref = json.loads(subprocess.run(
                [sys.executable, "-c", REFERENCE, str(Path(tmp) / "tok" / "tokenizer.json"), str(listing),
                 str(args.repeats)], env=env, capture_output=True, text=True, check=True).stdout)
            n_docs, n = meta["n_documents"], ref["encode_batch"]["tokens"]
            assert n + n_docs == meta["n_tokens"] == ref["encode_batch_fast"]["tokens"] + n_docs, (ref, meta)
            row = {"workers": workers, "prepare_seconds": best, "prepare_tokens_per_s": n / best}
            for name, r in ref.items():
                row[f"{name}_seconds"], row[f"{name}_tokens_per_s"] = r["seconds"], n / r["seconds"]
            row["ratio"] = row["prepare_tokens_per_s"] / row["encode_batch_tokens_per_s"]
            row["ratio_fast"] = row["prepare_tokens_per_s"] / row["encode_batch_fast_tokens_per_s"]
            results["rows"].append(row)
            results["documents"], results["tokens"] = n_docs, meta["n_tokens"]
            print(row, flush=True)
    doc["results"] = results
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
