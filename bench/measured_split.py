"""The measured split beside the predicted one on five gloo layouts (nanomega/run/measured.py).

    python bench/measured_split.py                 # DDP, FSDP 2, tp 2, pp 2 (1F1B), ep 2 (MoE); ~3 min on 2 cores
    python bench/measured_split.py --render bench/results/measured_split.json

Each layout: `torchrun --nproc-per-node=2 train.py` on a small eager model (4 blocks of d_model 128, 8 x 128
tokens a step; pp: 4 micro-batches; ep: 4 experts, top 2), 5 steps with --train.profile=4:5 (steps 1-3 warm up),
one OpenMP thread a rank. Then every rank's trace is split (measured.read_trace) and step_time predicts the same
config on this CPU (measured.cpu_device, measured once by 2 processes at once, used for every layout). The table
gives each part measured (the mean over the ranks and the profiled steps) / predicted and their ratio.
Results: <out>/measured_split.json and .md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_io  # noqa: E402

from nanomega.run.measured import cpu_device, split  # noqa: E402
from nanomega.run.metrics import read_metrics  # noqa: E402

MODEL = ["--model.d_model=128", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=256", "--model.max_seq_len=128", "--train.seq_len=128", "--train.batch_size=8",
         "--train.compile=false", "--train.eval_batches=1", "--train.eval_every=1000", "--train.sample_tokens=0",
         "--train.log_every=1", "--train.ckpt_every=1000", "--train.steps=5", "--train.profile=4:5"]
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=128", "--model.shared_ffn_dim=0"]
LAYOUTS = {"DDP 2": ["--parallel.dp_replicate=2"],
           "FSDP 2": ["--parallel.dp_shard=2"],
           "tp 2": ["--parallel.tp=2"],
           "pp 2 (1F1B)": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--train.grad_accum=4"],
           "ep 2 (MoE)": ["--parallel.dp_replicate=2", "--parallel.ep=2", *MOE]}
PARTS = ["compute", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "pipeline idle", "update",
         "host gaps", "step"]


def flat(parts: dict) -> dict:
    """A measured_parts / predicted_parts dict as {part: seconds} over PARTS."""
    out = {"compute": parts["compute_s"], "pipeline idle": parts["pipeline_idle_s"], "update": parts["update_s"],
           "host gaps": parts["host_s"], "step": parts["step_s"]}
    for kind, v in parts["exposed_s"].items():
        out[kind] = out.get(kind, 0.0) + v
    return {p: out.get(p, 0.0) for p in PARTS}


def run_layout(name: str, flags: list[str], folder: Path, cache: Path, device) -> dict:
    out = folder / name.split()[0].lower()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train.py", *MODEL,
           *flags, f"--train.out_dir={out}", f"--data.cache_dir={cache}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    result = split(out, device)
    # the same run's steps 2-3, not profiled (metrics.jsonl, one step a record): what the profiler itself costs
    tokens = 8 * 128 * (4 if "--train.grad_accum=4" in flags else 1)
    plain = [tokens / r["tokens_per_s"] for r in read_metrics(out / "metrics.jsonl") if r["step"] in (2, 3)]
    rows = [flat(m) for steps in result["measured"].values() for m in steps.values()]
    measured = {p: sum(r[p] for r in rows) / len(rows) for p in PARTS}
    return {"flags": flags, "measured": measured, "unprofiled_step": sum(plain) / len(plain),
            "predicted": flat(result["predicted"]),
            "per_rank_step": {str(rank): {str(s): flat(m) for s, m in steps.items()}
                              for rank, steps in result["measured"].items()}}


def tables(doc: dict) -> str:
    d = doc["device"]
    lines = ["Per part: measured / predicted ms (ratio measured / predicted); measured is the mean over both ranks "
             "and the two profiled steps; step unprofiled: the same run's steps 2-3 (metrics.jsonl), to show the "
             "profiler's own cost.", "",
             "| layout | " + " | ".join(PARTS) + " | step unprofiled |", "|---|" + "---|" * (len(PARTS) + 1)]
    for name, r in doc["results"].items():
        cells = []
        for p in PARTS:
            m, q = r["measured"][p] * 1e3, r["predicted"][p] * 1e3
            ratio = f" ({m / q:.1f}x)" if q > 1e-3 else ""
            cells.append("-" if m < 0.05 and q < 0.05 else f"{m:.1f} / {q:.1f}{ratio}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['unprofiled_step'] * 1e3:.1f} |")
    lines += ["", f"Device entry (step_time on this CPU, 2 processes x 1 thread at once): matmul "
              f"{d['matmul_flops'] / 1e9:.1f} GFLOP/s, copy {d['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"{d['op_s'] * 1e6:.1f} us an op, gloo all-reduce {d['gloo_bytes_per_s'] / 1e9:.2f} GB/s + "
              f"{d['gloo_latency_s'] * 1e6:.0f} us."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    results_io.add_arguments(ap)
    ap.add_argument("--only", default="", help="comma-separated layout names' first words (DDP,FSDP,tp,pp,ep)")
    args = ap.parse_args()
    if args.render:
        sys.exit(results_io.render(args.render, tables))
    doc = results_io.start("measured_split")
    dev, eff, figures = cpu_device(2, 1)
    doc["device"] = figures
    doc["results"] = {}
    chosen = {w.lower() for w in args.only.split(",") if w}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in LAYOUTS.items():
            if chosen and name.split()[0].lower() not in chosen:
                continue
            doc["results"][name] = run_layout(name, flags, Path(tmp), Path(tmp) / "cache", (dev, eff, figures))
            print(name, {p: round(v * 1e3, 1) for p, v in doc["results"][name]["measured"].items()}, flush=True)
    results_io.write(doc, tables(doc), args.out)


if __name__ == "__main__":
    main()
