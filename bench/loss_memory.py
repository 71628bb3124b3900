"""The loss in chunks (model.loss_chunk), measured on this CPU: the forward + backward's peak with whole logits
against chunks of tokens, at a vocabulary large enough for the logits to dominate.

    python bench/loss_memory.py                       # chunk 0 (whole logits) against 1024, ~1 min on 2 cores
    python bench/loss_memory.py --chunks 0 256 1024 4096 --vocab 32768 --seq 1024 --batch 8

One process per setting (so each process's peak resident memory is its own): one eager serial step of train.py's
loop (nanomega.sim.estimate.track_step on real tensors) of a 2-layer model (d 128) with full recomputation, so the
vocabulary-sized tensors are most of the peak, as they are for llama3_8b at long sequences (docs/memory.md).
Three figures per setting: the peak of the forward and backward by MemoryTracker (every storage an op makes, on
real tensors), the simulator's peak for the same flags (fake tensors), and the process's peak resident memory
from the OS (getrusage: the tracker's independent check, with the interpreter and torch's own ~300 MiB).
Results: bench/results/loss_memory.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import results_io  # noqa: E402

MiB = 2 ** 20


def flags(chunk: int, vocab: int, seq: int, batch: int) -> list[str]:
    return [f"--model.vocab_size={vocab}", "--model.d_model=128", "--model.n_layers=2", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--model.ffn_dim=256", f"--model.max_seq_len={seq}", f"--train.seq_len={seq}",
            f"--train.batch_size={batch}", "--train.activation_checkpointing=full", f"--model.loss_chunk={chunk}",
            "--train.compile=false", "--train.device=cpu"]    # measured on the CPU: simulated with its kernels


def measure(args: list[str]) -> dict:
    """One setting, in this process: the tracked peak, the simulated peak, the process's peak resident memory."""
    import torch
    from nanomega.config import parse_args
    from nanomega.sim.estimate import simulate_rank, track_step
    from nanomega.sim.memory_tracker import MemoryTracker
    torch.set_num_threads(1)
    cfg = parse_args(args)
    real = track_step(cfg, MemoryTracker(), torch.device("cpu"))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # before the simulation (fake: none)
    sim = simulate_rank(cfg)
    return {"measured": real["phases"]["forward_backward"]["peak_bytes"],
            "simulated": sim["phases"]["forward_backward"]["peak_bytes"], "max_rss": rss}


def tables(doc: dict) -> str:
    s = doc["settings"]
    base = doc["rows"][0]
    rows = [[("whole logits" if r["chunk"] == 0 else f"{r['chunk']:,} tokens"), f"{r['measured'] / MiB:,.1f}",
             f"{r['simulated'] / MiB:,.1f}", f"{r['max_rss'] / MiB:,.0f}", f"{base['measured'] / r['measured']:.2f}x"]
            for r in doc["rows"]]
    return (f"One eager serial step, vocabulary {s['vocab']:,}, {s['batch']} x {s['seq']:,} tokens, 2 layers, d 128, full "
            f"recomputation, CPU. Peak of the forward + backward (MiB): tracked on real tensors, simulated on fake "
            f"ones, and the process's peak resident memory (the OS's count, interpreter and torch included).\n\n"
            + results_io.table(["loss", "tracked peak", "simulated", "process peak RSS", "whole / this (tracked)"],
                               "lrrrr", rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 1024])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--one", help=argparse.SUPPRESS)      # a child process: one setting's flags as JSON
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(json.loads(a.one))))
        return 0
    doc = results_io.start("loss_memory")
    doc["settings"] = {"vocab": a.vocab, "seq": a.seq, "batch": a.batch}
    doc["rows"] = []
    for chunk in a.chunks:
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(flags(chunk, a.vocab, a.seq, a.batch))],
                              capture_output=True, text=True, check=True)
        doc["rows"].append({"chunk": chunk, **json.loads(done.stdout.strip().splitlines()[-1])})
    results_io.write(doc, tables(doc), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
