"""Checkpoint stall: how long training waits per save, synchronous against asynchronous (--train.async_save).

    python bench/checkpoint.py                                  # GPT-2 124M + AdamW state, ~1.5 GB per save
    python bench/checkpoint.py --config=default --steps-between 1 --rounds 2 --out /tmp/smoke   # smoke test
    python bench/checkpoint.py --dir /fast/disk --out runs/checkpoint      # another disk; results elsewhere

A round is what training does around one save: the save call, then --steps-between train steps (eager, AdamW,
random tokens at the config's batch and sequence, or --batch/--seq), then waiting for the save to be
published (for an asynchronous save only: `Saver.wait`, which train.py reaches at its next save or at the
end). Modes: "none" (the steps alone), "sync" (`checkpoint.save`: training waits for the whole write) and
"async" (`checkpoint.Saver(background=True)`: training waits for the host copy, then the write runs beside
the steps). The stall per save is a mode's median round minus the median "none" round, so it includes what
the background thread takes from the steps (on a 2-core CPU the writer competes with the matmuls for
memory bandwidth and the GIL-free serialisation for a core). Rounds interleave the modes (none, sync, async,
none, ...), each ending with its save published, so a busy machine slows all alike and one mode's write
never overlaps another mode's round. Also shown: the blocking part of each save call (the host copy for
async), and the write's own seconds (sync: the call; async: copy to published). Results: <out>/checkpoint.json
and .md (--render JSON writes the .md again).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega and configs/ of this checkout

import torch  # noqa: E402

import results_io  # noqa: E402

from nanomega import checkpoint, optim  # noqa: E402
from nanomega.config import named_config  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.train.step import make_step_fns  # noqa: E402
from nanomega.tree import tree_leaves  # noqa: E402

MODES = ("none", "sync", "async")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="gpt2_124m", help="a named config (configs/); its model and optimizer")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps-between", type=int, default=3, help="train steps after each save (before its wait)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per mode (median)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("checkpoint")

    cfg = named_config(args.config)
    model_cfg = cfg.model
    params = init(model_cfg, cfg.train.seed)
    opt = optim.build(cfg.optim, total_steps=10**6)
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt)
    gen = torch.Generator().manual_seed(0)

    def train_step():
        nonlocal params, state
        x = torch.randint(0, model_cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
        _, grads, stats = fns.grads(params, [(x[:, :-1], x[:, 1:])])
        params, state = fns.update(grads, state, params, stats)

    n_params = sum(p.numel() for p in tree_leaves(params))
    nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(params) + tree_leaves(state))
    root = Path(args.dir or tempfile.mkdtemp(prefix="nanomega-ckpt-bench-"))
    print(f"{args.config}: {n_params / 1e6:.1f}M parameters, {nbytes / 2**30:.2f} GiB per save "
          f"(parameters + {cfg.optim.name} state); step {args.batch} x {args.seq} tokens, eager; writing to {root}")
    train_step()      # warm-up: allocator, first-call costs
    savers = {"sync": checkpoint.Saver(background=False), "async": checkpoint.Saver(background=True)}
    rounds: dict = {m: [] for m in MODES}
    calls: dict = {m: [] for m in MODES}
    writes: dict = {m: [] for m in MODES}
    step = 0
    try:
        for _ in range(args.rounds):
            for mode in MODES:
                start = time.perf_counter()
                if mode != "none":
                    step += 1
                    savers[mode].save(root / mode, step, params, state, {"step": step}, keep=1)
                    calls[mode].append(time.perf_counter() - start)
                for _ in range(args.steps_between):
                    train_step()
                if mode != "none":
                    savers[mode].wait()
                    writes[mode].append(_written_after(root / mode, step) - start)
                rounds[mode].append(time.perf_counter() - start)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(rounds["none"])
    step_s = base / args.steps_between
    rows = []
    for mode in MODES:
        stall = statistics.median(rounds[mode]) - base
        rows.append({"mode": mode, "round_s": statistics.median(rounds[mode]), "stall_s": stall,
                     "stall_steps": stall / step_s, "call_s": statistics.median(calls[mode]) if calls[mode] else 0.0,
                     "write_s": statistics.median(writes[mode]) if writes[mode] else 0.0})
    doc.update(config=args.config, params=n_params, bytes_per_save=nbytes, batch=args.batch, seq=args.seq,
               steps_between=args.steps_between, rounds=args.rounds, rows=rows,
               dir=args.dir or f"a temporary folder in {tempfile.gettempdir()}")
    results_io.write(doc, tables(doc), args.out)
    return 0


def tables(doc: dict) -> str:
    rows = {r["mode"]: r for r in doc["rows"]}
    step_s = rows["none"]["round_s"] / doc["steps_between"]
    lines = [f"{doc['config']}: {doc['params'] / 1e6:.1f}M parameters, {doc['bytes_per_save'] / 2**30:.2f} GiB per "
             f"save (parameters + optimizer state); {doc['rounds']} rounds per mode, each a save then "
             f"{doc['steps_between']} eager steps of {doc['batch']} x {doc['seq']} tokens; step {step_s:.2f} s (median of the 'none' rounds)",
             "", results_io.table(["mode", "round s", "stall per save s", "stall in steps", "blocking call s",
                                   "write s (to published)"], "lrrrrr",
                                  [[r["mode"], f"{r['round_s']:.2f}", f"{r['stall_s']:.2f}", f"{r['stall_steps']:.2f}",
                                    f"{r['call_s']:.2f}", f"{r['write_s']:.2f}"] for r in doc["rows"]])]
    sync, asyn = rows["sync"]["stall_s"], rows["async"]["stall_s"]
    if sync > 0:
        lines += ["", f"async stalls {asyn / sync:.0%} of what sync does ({asyn:.2f} s vs {sync:.2f} s per save)"]
    lines += ["", "Stall: a mode's median round minus the median round without a save; rounds interleave the modes."]
    return "\n".join(lines)


def _written_after(out_dir: Path, step: int) -> float:
    """perf_counter time at which ckpt-<step>'s meta.json (written last, before the rename) was modified."""
    meta = out_dir / f"ckpt-{step:08d}" / checkpoint.META_FILE
    return time.perf_counter() - (time.time() - meta.stat().st_mtime)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
