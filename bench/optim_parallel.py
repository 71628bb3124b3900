"""Optimizers x parallelism: time per step against serial, memory per rank, and what the update communicates.

    python bench/optim_parallel.py                                   # 5 optimizers x 6 layouts (~15 min, 2 cores)
    python bench/optim_parallel.py --optimizers muon --layouts serial,zero1 --steps 2 --out /tmp/smoke   # smoke test

For each optimizer and layout:
- time: train.py itself (python, or torchrun for the layouts), --steps eager steps of the default model at
  its batch (16 x 256), the median seconds per step over its log windows (bench/optimizers.py's
  summarize), and its ratio to the serial run of the same optimizer. On this 2-core CPU
  the ranks of a layout share the cores the serial run has alone, so the ratio measures the layout's
  overhead at equal hardware, not a speed-up.
- memory: the simulated step (nanomega.sim.estimate: the real step on fake tensors, one process): the peak per
  rank (the largest over the ranks it simulates) and the optimizer state each rank holds, also as a ratio
  of the serial run's ("state vs serial": 1/n where n ranks shard it, 1 where every rank keeps it all; in
  between where a part is duplicated, e.g. the matrices' state on every tp rank of their owner).
- communication: the collectives issued inside the optimizer update (estimate's "update" phase), bytes
  this rank sends per step as ring algorithms send them: the gradient-norm all-reduce, ZeRO-1's and the
  matrix owners' all-gathers and all-to-alls, Muon's Gram all-reduces under muon_tp=distributed.
The forward/backward's own collectives (FSDP gathers, gradient reductions, TP) are the same for every
optimizer and are left out. Results: <out>/optim_parallel.json and .md (--render JSON writes the .md again).
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
sys.path.insert(0, str(ROOT / "bench"))     # bench/optimizers.py

from nanomega import optim  # noqa: E402
from nanomega.config import parse_args  # noqa: E402
from nanomega.sim.estimate import estimate  # noqa: E402
from nanomega.run.metrics import read_metrics  # noqa: E402
import optimizers as study  # noqa: E402
import results_io  # noqa: E402

# every registered optimizer; coupled (L2) decay off, as the study runs SGD
OPTIMIZERS = {name: ["--optim.weight_decay=0"] if spec.coupled_decay else [] for name, spec in optim.REGISTRY.items()}
LAYOUTS = {
    "serial": [],
    "ddp2": ["--parallel.dp_replicate=2"],
    "zero1": ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"],
    "fsdp2": ["--parallel.dp_shard=2"],
    "tp2": ["--parallel.tp=2"],
    "fsdp2_tp2": ["--parallel.dp_shard=2", "--parallel.tp=2"],
}
MiB = 2 ** 20


def timed_run(args: list[str], ranks: int, out: Path, steps: int, tokens_per_step: int) -> float:
    """Median seconds per step of a real train.py run over its log windows (bench/optimizers.py's summarize)."""
    common = [f"--train.steps={steps}", "--train.log_every=2", "--train.eval_every=1000", "--train.compile=false",
              "--train.sample_tokens=0", f"--train.ckpt_every={steps * 10}", f"--train.out_dir={out}"]
    launcher = ([sys.executable] if ranks == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"])
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // ranks))}
    done = subprocess.run([*launcher, "train.py", *args, *common], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(args)} failed: {done.stderr[-1500:]}")
    return study.summarize(read_metrics(out / "metrics.jsonl"), tokens_per_step)["s_per_step"]


def tables(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(r["update_collectives"].items())) or "none"
        rows.append([r["optimizer"], r["layout"], r["ranks"], f"{r['s_per_step']:.2f}",
                     f"{r['vs_serial']:.2f}x" if r["vs_serial"] else "—", f"{r['peak_mib']:.1f}",
                     f"{r['state_mib']:.2f}",
                     f"{r['state_vs_serial']:.2f}x" if r["state_vs_serial"] else "—",
                     f"{r['update_bytes'] / MiB:.2f} ({kinds})"])
    return (f"The default model at its batch; s/step: median over log windows of {doc['steps']} eager steps of "
            "train.py; memory: nanomega.sim.estimate's simulated step, the largest rank; update sends: the collectives "
            "inside the optimizer update (ring-algorithm bytes per rank).\n\n" + results_io.table(
                ["optimizer", "layout", "ranks", "s/step", "vs serial", "peak MiB/rank (simulated)",
                 "optimizer state MiB/rank", "state vs serial", "update sends MiB/step (collectives)"], "llrrrrrrl",
                rows))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=8)
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("optim_parallel")
    doc.update(steps=args.steps, rows=[])
    rows = doc["rows"]
    with tempfile.TemporaryDirectory(prefix="nanomega-optim-parallel-") as tmp:
        for opt in args.optimizers.split(","):
            serial_s = serial_state = None
            for layout in args.layouts.split(","):
                flags = ["--config=default", f"--optim.name={opt}", *OPTIMIZERS[opt], *LAYOUTS[layout]]
                cfg = parse_args(flags)
                sim = estimate(cfg)
                per_rank = sim["ranks"].values()
                update = sim["collectives_by_phase"].get("update", {})
                t = cfg.train
                seconds = timed_run(flags, cfg.parallel.world_size, Path(tmp) / f"{opt}-{layout}", args.steps,
                                    t.batch_size * t.grad_accum * t.seq_len)
                serial_s = seconds if layout == "serial" else serial_s
                state_mib = max(r["held_after"]["optimizer_state"] for r in per_rank) / MiB
                serial_state = state_mib if layout == "serial" else serial_state
                row = {"optimizer": opt, "layout": layout, "ranks": cfg.parallel.world_size, "s_per_step": seconds,
                       "vs_serial": seconds / serial_s if serial_s else None,
                       "peak_mib": max(r["peak_bytes"] for r in per_rank) / MiB,
                       "state_mib": state_mib, "state_vs_serial": state_mib / serial_state if serial_state else None,
                       "update_bytes": sum(c["bytes_sent"] for c in update.values()),
                       "update_collectives": {k: c["count"] for k, c in update.items()}}
                rows.append(row)
                print(f"{opt} {layout}: {seconds:.2f} s/step, peak {row['peak_mib']:.1f} MiB, state "
                      f"{row['state_mib']:.1f} MiB, update sends {row['update_bytes'] / MiB:.2f} MiB", flush=True)
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
