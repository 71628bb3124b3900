"""What document masking (--data.mask=document) costs, as the step-time model and the memory simulator predict it.

    python bench/document_mask.py                      # both rows (~8 min on 2 loaded cores)
    python bench/document_mask.py --rows llama3_8b_fsdp8 --out /tmp/smoke

Each row is `python -m nanomega.sim.step_time <flags> --data.mask=causal|document --gpu=h100`: the real train step on
fake tensors, its kernels priced on an H100 (nanomega/sim/step_time.py). A causal kernel (is_causal) computes half
of the score square; a masked one, the whole of it (the memory-efficient kernel with a [T, T] mask cannot skip
blocks), and the additive mask, one [B, 1, T, T] per forward in the compute dtype, is held to the step's backward.
Predictions for GPUs, not measurements: docs/data.md says what they leave out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402

from nanomega.config import parse_args  # noqa: E402
from nanomega.sim.step_time import predict  # noqa: E402

BF16 = ["--train.param_dtype=bfloat16", "--train.dtype=bfloat16", "--train.compile=false"]
ROWS = {   # name: (layout, flags)
    "llama3_8b_fsdp8": ("Llama 3 8B, FSDP 8, seq 8192, full AC", [
        "--config=llama3_8b", "--parallel.dp_shard=8", "--train.seq_len=8192", "--train.batch_size=8",
        "--train.grad_accum=1", "--train.activation_checkpointing=full", *BF16]),
    "llama3_8b_cp2_fsdp4": ("Llama 3 8B, cp 2 x FSDP 4, seq 16384, full AC", [
        "--config=llama3_8b", "--parallel.cp=2", "--parallel.dp_shard=4", "--train.seq_len=16384",
        "--model.max_seq_len=16384", "--train.batch_size=4", "--train.grad_accum=1",
        "--train.activation_checkpointing=full", *BF16]),
}


def run_row(flags: list[str]) -> dict:
    out = {}
    for mask in ("causal", "document"):
        r = predict(parse_args(flags + [f"--data.mask={mask}"]), "h100")
        out[mask] = {"step_s": r["step_s"], "compute_s": r["compute_s"], "peak_bytes": r["peak_bytes"],
                     "mfu": r["mfu"]}
    return out


def tables(doc: dict) -> str:
    rows = []
    for name, row in doc["results"].items():
        c, d = row["causal"], row["document"]
        rows.append([ROWS[name][0] if name in ROWS else name, f"{c['step_s'] * 1e3:,.1f}", f"{d['step_s'] * 1e3:,.1f}",
                     f"{d['step_s'] / c['step_s']:.3f}", f"{c['peak_bytes'] / 2**30:.2f}",
                     f"{d['peak_bytes'] / 2**30:.2f}", f"{(d['peak_bytes'] - c['peak_bytes']) / 2**20:,.0f}"])
    return results_io.table(["layout (H100, bf16, predicted)", "step causal ms", "step document ms", "ratio",
                             "peak causal GiB", "peak document GiB", "peak grows MiB"], "lrrrrrr", rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    results_io.add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("document_mask")
    doc["results"] = {}
    for name in results_io.chosen(ap, args.rows, ROWS, "row"):
        doc["results"][name] = run_row(ROWS[name][1])
        results_io.write(doc, tables(doc), args.out, quiet=True)
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
