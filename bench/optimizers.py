"""Optimizer study: SGD, AdamW, Muon, Shampoo and SOAP at three horizons, lr grids, two seeds, measured memory.

    python bench/optimizers.py                                   # the full study (~1 hour on 2 cores, below)
    python bench/optimizers.py --horizons 10 --optimizers adamw,soap --lrs-per-opt 1 --seeds 1 --out /tmp/smoke
    python bench/optimizers.py --size default --horizons 85 --seeds 1 --extend 0   # the first study's setup

Every run is `train.train(cfg, quiet=True)` in this process on the built-in corpus, with the same warmup +
cosine schedule (warmup = steps * 50/280, as configs/default.py), weight decay 0.1 and clipping 1.0. Model:
--size small (default) is configs/default.py's LLaMA-style model at half width (d 128, 4 layers, 4 heads,
2 kv heads, ffn 384: 0.85M parameters) on 8 x 128-byte batches, so that the longest horizon fits; --size
default is configs/default.py as it is (3.3M parameters, 16 x 256). Within a horizon every optimizer sees
the same model, tokens and schedule. What differs:

    sgd      lr {0.03, 0.1, 0.3}, momentum 0.9, no weight decay (coupled L2 at 0.1 would shrink weights lr*0.1/step)
    adamw    lr {1e-3, 2e-3, 4e-3} (betas 0.9, 0.95)
    muon     lr {0.02, 0.04, 0.08}, momentum 0.95, Nesterov, spectral scale
    shampoo  lr {3e-4, 1e-3, 3e-3}, Adam's first moment preconditioned, Adam grafting, roots every 10 steps
    soap     lr {1e-3, 3e-3, 1e-2}, precondition every 10 steps
    Matrix optimizers (muon, shampoo, soap) own the hidden matrices; embeddings, LM head and norms go to
    AdamW at lr * adam_lr_ratio, with the ratio set per run so that the AdamW part always gets 2e-3.

Protocol, per horizon (--horizons, default 100, 300 and 1,000 steps: 0.1M to 1M tokens, 10x) and optimizer:
the grid at seed 0; while the best lr is the grid's smallest or largest, one more lr further out by the
grid's own ratio (--extend, at most 2), so that no reported best lies on an edge; then seeds 1.. (--seeds) at
that best lr. A seed sets the initial weights and the order of the training batches; the validation batches
are the same for every run.

Output, in --out (bench/results/): optimizers.json (every run), optimizers.md and optimizers.png; --render
JSON writes the .md again from the JSON. The .md is ONE markdown table (per horizon and optimizer: best lr,
final validation loss as the mean over seeds and half its range, steps and training wall-clock at which the
seeds' mean curve first reaches AdamW's mean final loss, as ratios of AdamW's, median seconds per step,
optimizer-state bytes per parameter, and the MEASURED peak bytes of one step), the sweeps, and the goals of
the longest horizon (Muon <= 0.7x, SOAP <= 0.75x, Shampoo <= 0.85x AdamW's steps), met or not. The PNG: per
horizon, mean validation loss against steps and against training seconds. Each run's folder and log go to
--runs (replaced), with the study's JSON so far (optimizers.partial.json).

Memory: the step's peak is measured on real tensors by nanomega.sim.memory_tracker.MemoryTracker (every storage an
op creates, from creation to release: parameters, gradients, optimizer state, activations and the update's
transient buffers), over one eager step of train.py's loop, forward + backward and update apart. RSS is not
used: getrusage's maxrss is process-wide and monotonic, and the runs share one process. State bytes per
parameter are opt.init's (nanomega.optim.memory, on meta tensors).

Time: seconds per step is the median over log windows (metrics tokens_per_s; evaluation excluded), free of
compilation; the wall-clock curve is training time without evaluation and without the first window's
excess over the median (compilation, when --compile). Runs are eager for --size small, where compiling each
run's update (20-40 s) costs more than it saves. Nothing else heavy may run meanwhile: s/step is what the
machine gives.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega, train.py and configs/ of this checkout

import torch  # noqa: E402

import results_io  # noqa: E402

import train as train_script  # noqa: E402
from nanomega.run import preflight  # noqa: E402
from nanomega import optim  # noqa: E402
from nanomega.config import parse_args, to_dict  # noqa: E402
from nanomega.data.sampler import TokenSampler  # noqa: E402
from nanomega.run.metrics import read_metrics  # noqa: E402
from nanomega.sim.counting import count_params  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.optim.memory import param_count, state_bytes  # noqa: E402
from nanomega.train.step import make_step_fns  # noqa: E402

OPTIMIZERS = tuple(optim.REGISTRY)     # every registered optimizer (nanomega/optim/registry.py); AdamW first
# Refined after a first 100-step study (final val loss by lr): sgd {0.1: 2.89, 0.3: 2.94, 1.0: 3.88}, adamw
# {1e-3: 2.21, 2e-3: 2.17, 4e-3: 2.27}, muon {0.01: 2.19, 0.02: 2.05, 0.04: 1.95}, shampoo {1e-3: 2.43, 3e-3: 2.52,
# 1e-2: 2.58}, soap {1e-3: 2.25, 3e-3: 2.17, 1e-2: 2.38}: grids whose best sat on an edge moved one step out.
GRIDS = {   # tuned data, not a list of names: a new optimizer without a grid here needs --lrs NAME=...
    "sgd": (0.03, 0.1, 0.3),
    "adamw": (1e-3, 2e-3, 4e-3),
    "muon": (0.02, 0.04, 0.08),
    "shampoo": (3e-4, 1e-3, 3e-3),
    "soap": (1e-3, 3e-3, 1e-2),
}
SETTINGS = {  # per-optimizer OptimConfig fields on top of the default config's (none: its defaults)
    "sgd": {"momentum": 0.9, "weight_decay": 0.0},
    "adamw": {},
    "muon": {"muon_momentum": 0.95},
    "shampoo": {},
    "soap": {},
}
MATRIX = tuple(name for name in OPTIMIZERS if not optim.REGISTRY[name].elementwise)
ADAM_LR = 2e-3  # the non-matrix parameters' AdamW lr under a matrix optimizer (the default config's tuned lr)
DEFAULT_EVAL_BATCHES = 5   # bench/variants.py's, on the default model


def pick_lrs(grid, k: int) -> list[float]:
    """k values of a grid, middle first, then outwards (1: the middle; 2: middle and lower), ascending."""
    mid = (len(grid) - 1) // 2
    order = sorted(range(len(grid)), key=lambda i: (abs(i - mid), i))
    return sorted(grid[i] for i in order[:k])


def as_stored(config) -> dict:
    """A config as the partial JSON holds it (tuples become lists), so a resumed study compares like with like."""
    return json.loads(json.dumps(to_dict(config)))


def run_config(base, name: str, lr: float, args, out_dir: Path, seed: int | None = None):
    o = {"name": name, "lr": lr, "warmup_steps": max(1, round(args.steps * 50 / 280)), **SETTINGS.get(name, {})}
    if not optim.REGISTRY[name].elementwise:      # a whole-matrix optimizer (bench/variants.py registers one)
        o["adam_lr_ratio"] = getattr(args, "adam_lr_now", ADAM_LR) / lr
    t = {"steps": args.steps, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
         "log_every": args.log_every, "ckpt_every": args.steps, "keep_checkpoints": 1, "sample_tokens": 0,
         "compile": not args.no_compile, "resume": False, "out_dir": str(out_dir),
         "seed": base.train.seed if seed is None else seed}
    return dataclasses.replace(base, optim=dataclasses.replace(base.optim, **o),
                               train=dataclasses.replace(base.train, **t))


def memory(cfg) -> dict:
    """Analytic bytes: fp32 params, fp32 grads, optimizer state (opt.init on meta tensors: nothing allocated)."""
    params = init(cfg.model, 0, device="meta")
    n = param_count(params)
    try:
        state = state_bytes(optim.build(cfg.optim, cfg.train.steps).init(params))
    except (NotImplementedError, RuntimeError):       # an init that needs real tensors: the model is small
        state = state_bytes(optim.build(cfg.optim, cfg.train.steps).init(init(cfg.model, 0)))
    return {"params": n, "state_bytes": state, "state_bytes_per_param": state / n,
            "params_grads_state_bytes": 8 * n + state}


def summarize(records: list[dict], tokens_per_step: int) -> dict:
    """Eval curve, median s/step, compile excess and training wall-clock (evaluation excluded) from metrics."""
    windows, prev = [], 0
    for r in records:
        if r.get("tokens_per_s"):
            n = r["step"] - prev
            windows.append((r["step"], n, n * tokens_per_step / r["tokens_per_s"]))
        prev = r["step"]
    per_step = statistics.median(sec / n for _, n, sec in windows) if windows else float("nan")
    compile_s = max(0.0, windows[0][2] - windows[0][1] * per_step) if windows else 0.0
    clock, elapsed = {}, -compile_s
    for step, _, sec in windows:
        elapsed += sec
        clock[step] = elapsed
    evals = [(r["step"], r["val_loss"], clock.get(r["step"], float("nan"))) for r in records if "val_loss" in r]
    return {"eval_steps": [e[0] for e in evals], "val_loss": [e[1] for e in evals],
            "train_seconds": [e[2] for e in evals],
            "s_per_step": per_step, "compile_s": compile_s}


def steps_to_reach(steps, losses, target: float):
    """First step at which the eval curve reaches target, linear between eval points (from step 0 at +inf: the
    first eval point itself if it is already below). None if never."""
    for i, (s, v) in enumerate(zip(steps, losses)):
        if math.isfinite(v) and v <= target:
            if i == 0 or not math.isfinite(losses[i - 1]) or losses[i - 1] == v:
                return float(s)
            s0, v0 = steps[i - 1], losses[i - 1]
            return s0 + (s - s0) * (v0 - target) / (v0 - v)
    return None


def warm_up_loss(cfg, splits) -> float:
    """Compile the loss (forward + backward) once, so no run pays for it; returns the seconds it took."""
    start = time.perf_counter()
    params = init(cfg.model, 0)
    fns = make_step_fns(cfg.model, optim.build(cfg.optim, 1), compile=True, dtype=cfg.train.dtype)
    x, y = TokenSampler(splits.train, cfg.train.seq_len, 0).batch(0, cfg.train.batch_size)
    fns.grads(params, [(x, y)])
    return time.perf_counter() - start


def one_run(cfg, splits, log_path: Path) -> dict:
    out = Path(cfg.train.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    start, error = time.perf_counter(), None
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            train_script.train(cfg, splits=splits, quiet=True)
        except train_script.NonFiniteLoss as err:
            error = str(err).split(";")[0]
        except Exception as err:                          # a broken optimizer must not end the study
            error = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    total = time.perf_counter() - start
    records = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    summary = summarize(records, cfg.train.batch_size * cfg.train.grad_accum * cfg.train.seq_len)
    final = summary["val_loss"][-1] if summary["val_loss"] and not error and records[-1]["step"] == cfg.train.steps \
        else float("inf")
    final = final if math.isfinite(final) else float("inf")      # a NaN must not win the lr sweep
    return {**summary, "final_val_loss": final, "error": error, "run_seconds": total,
            "train_loss": [(r["step"], r["loss"]) for r in records]}


def measured_peak(cfg) -> dict:
    """Peak bytes of one eager step of train.py's loop on real tensors, by nanomega.sim.estimate's MemoryTracker:
    every storage an op creates, from creation to release (parameters, gradients, optimizer state,
    activations and the update's transient buffers: eigendecompositions, Newton-Schulz iterates)."""
    from nanomega.sim import estimate
    from nanomega.sim.memory_tracker import MemoryTracker
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    result = estimate.track_step(cfg, MemoryTracker(), torch.device("cpu"))
    phases = {name: p["peak_bytes"] for name, p in result["phases"].items()}
    return {"forward_backward_peak_bytes": phases["forward_backward"], "update_peak_bytes": phases["update"],
            "step_peak_bytes": max(phases.values()), "held_after_bytes": sum(result["held_after"].values())}


def grid_ratio(lrs) -> float:
    """The grid's geometric step, for extending it outwards (2 if it has one value)."""
    lrs = sorted(lrs)
    return (lrs[-1] / lrs[0]) ** (1 / (len(lrs) - 1)) if len(lrs) > 1 else 2.0


def mean_curve(runs: list[dict]) -> dict:
    """The seeds' eval curves averaged point by point (they share eval steps)."""
    n = min(len(r["val_loss"]) for r in runs)
    avg = lambda key: [statistics.fmean(r[key][i] for r in runs) for i in range(n)]   # noqa: E731
    return {"eval_steps": runs[0]["eval_steps"][:n], "val_loss": avg("val_loss"), "train_seconds": avg("train_seconds")}


def summarize_horizon(runs: list[dict], steps: int) -> dict:
    """Per optimizer at one horizon: best lr (seed 0), its seeds' finals, the mean curve, and steps and seconds
    to reach AdamW's mean final loss as ratios of AdamW's."""
    rows = {}
    for name in dict.fromkeys(r["optimizer"] for r in runs):
        mine = [r for r in runs if r["optimizer"] == name]
        sweep = {r["lr"]: r["final_val_loss"] for r in mine if r["seed"] == 0}
        best_lr = min(sweep, key=sweep.get)
        seeds = [r for r in mine if r["lr"] == best_lr]
        finals = [r["final_val_loss"] for r in seeds]
        ok = [r for r in seeds if math.isfinite(r["final_val_loss"])]
        rows[name] = {"best_lr": best_lr, "sweep": dict(sorted(sweep.items())), "finals": finals,
                      "mean": statistics.fmean(finals) if all(map(math.isfinite, finals)) else float("inf"),
                      "spread": max(finals) - min(finals), "curve": mean_curve(ok) if ok else None,
                      "s_per_step": statistics.median(r["s_per_step"] for r in seeds),
                      "memory": seeds[0]["memory"], "edge": best_lr in (min(sweep), max(sweep))}
    ref = rows.get("adamw")
    if ref and ref["curve"]:
        target, ref_seconds = ref["mean"], ref["curve"]["train_seconds"][-1]
        for row in rows.values():
            c = row["curve"]
            reach = steps_to_reach(c["eval_steps"], c["val_loss"], target) if c else None
            at = steps_to_reach(c["train_seconds"], c["val_loss"], target) if c else None
            row.update(target=target, steps_to_adamw=reach, steps_ratio=reach / steps if reach else None,
                       seconds_ratio=at / ref_seconds if at else None)
    return rows


def plot(horizons: dict, path: Path, title: str) -> str:
    plt = results_io.pyplot()
    if plt is None:
        return results_io.NO_PNG
    fig, axes = plt.subplots(len(horizons), 2, figsize=(12, 4.2 * len(horizons)), squeeze=False)
    for (steps, rows), (a, b) in zip(horizons.items(), axes):
        for name, row in rows.items():
            if not row["curve"]:
                continue
            c, label = row["curve"], f"{name} (lr {row['best_lr']:g})"
            a.plot(c["eval_steps"], c["val_loss"], marker="o", ms=3, label=label)
            b.plot(c["train_seconds"], c["val_loss"], marker="o", ms=3, label=label)
        finals = [row["mean"] for row in rows.values() if math.isfinite(row["mean"])]
        for ax in (a, b):
            ax.set_ylabel(f"val loss, {steps} steps")
            ax.set_ylim(min(finals) - 0.05, min(finals) + 1.2)   # the end of training, not step 0's ~5.5
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        a.set_xlabel("step")
        b.set_xlabel("training seconds (no evaluation, no compilation)")
    fig.suptitle(title)
    return results_io.save_figure(plt, fig, path, dpi=110)


def ratio(x) -> str:
    return f"{x:.2f}x" if x else "not reached"


def tables(doc: dict) -> str:
    """The study's table, the sweeps, the goals and the protocol line, from the results document alone."""
    horizons, tokens_per_step = {int(k): v for k, v in doc["summary"].items()}, doc["tokens_per_step"]
    lines = ["| steps (tokens) | optimizer | best lr | final val loss (mean ± half-spread) | steps to AdamW's final | "
             "wall-clock to it | s/step | state B/param | measured step peak MiB (fwd+bwd / update) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for steps, rows in horizons.items():
        for name, row in rows.items():
            m = row["memory"]
            val = (f"{row['mean']:.4f} ± {row['spread'] / 2:.4f}" if math.isfinite(row["mean"]) else "failed")
            lines.append(f"| {steps} ({steps * tokens_per_step / 1e6:.2f}M) | {name} | {row['best_lr']:g}"
                         f"{' (edge)' if row['edge'] else ''} | {val} | {ratio(row.get('steps_ratio'))} | "
                         f"{'—' if doc.get('kept_from') else ratio(row.get('seconds_ratio'))} | {row['s_per_step']:.3f} | "
                         f"{m['state_bytes_per_param']:.2f} | {m['step_peak_bytes'] / 2**20:.1f} "
                         f"({m['forward_backward_peak_bytes'] / 2**20:.1f} / {m['update_peak_bytes'] / 2**20:.1f}) |")
    lines += ["", "Sweeps at seed 0 (lr: final val loss):"]
    for steps, rows in horizons.items():
        lines.append(f"- {steps} steps: " + "; ".join(f"{n} " + ", ".join(
            f"{float(lr):g}: {v:.3f}" for lr, v in row["sweep"].items()) for n, row in rows.items()))
    longest = horizons[max(horizons)]
    if "adamw" in longest:
        lines += ["", f"Goals at {max(horizons)} steps (steps to AdamW's final loss): " + "; ".join(
            f"{n} <= {g}x: {longest[n]['steps_ratio']:.2f}x ({'met' if longest[n]['steps_ratio'] <= g else 'not met'})"
            if longest.get(n, {}).get("steps_ratio") else f"{n} <= {g}x: not reached"
            for n, g in GOALS.items() if n in longest)]
    kept = doc.get("kept_from")
    if kept:
        new = sorted({r["optimizer"] for r in doc["runs"]} - set(kept["optimizers"]))
        lines += ["", f"Rerun here: {', '.join(new)}. The {kept['runs']} runs of {', '.join(kept['optimizers'])} are "
                      f"kept from {kept['path']} (run {(kept.get('meta') or {}).get('date', '?')}), same model, "
                      "data and horizons; their s/step are that run's. Wall-clock ratios are not given: runs made at "
                      "different times, loads or thread counts cannot be timed against each other."]
    new_runs = f"{len(doc['runs']) - kept['runs']} new, " if kept else ""
    lines += ["", f"{len(doc['runs'])} runs ({new_runs}in {doc['study_minutes']:.1f} min). Final val loss: mean over "
              f"{doc['seeds']} seeds at the best lr (half-spread: half the range); the best lr is seed 0's; steps and "
              "wall-clock: where the seeds' mean curve first reaches AdamW's mean final loss (linear between evals), over AdamW's steps "
              "and training seconds; s/step: median over log windows, evaluation excluded. State: opt.init's bytes per "
              "parameter; measured peak: one eager step under nanomega.sim.memory_tracker.MemoryTracker."]
    return "\n".join(lines)


GOALS = {"muon": 0.7, "soap": 0.75, "shampoo": 0.85}   # the goals at the longest horizon, in AdamW's steps

# The study's model (--size small): the default model's shape at half width, on 8 x 128-token batches, so
# that 1,000 steps of every optimizer fit in an hour of this 2-core CPU (eager: ~0.1 s a step).
SMALL = ["--model.d_model=128", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=384",
         "--model.max_seq_len=128", "--train.seq_len=128", "--train.batch_size=8"]


def size_config(size: str, *overrides: str):
    """The study's config of --size ("small": SMALL on configs/default.py; "default": it as is), then overrides."""
    return parse_args(["--config=default", *(SMALL if size == "small" else []), *overrides])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Other arguments: --section.key=value overrides of configs/default.py")
    ap.add_argument("--horizons", default="100,300,1000", help="comma-separated train steps per run (budgets)")
    ap.add_argument("--size", choices=("small", "default"), default="small",
                    help="small: SMALL's half-width model on 8 x 128 tokens; default: configs/default.py as is")
    ap.add_argument("--seeds", type=int, default=2, help="seeds at each optimizer's best lr (the grid runs seed 0)")
    ap.add_argument("--extend", type=int, default=2,
                    help="grids of 3+ lrs whose best lies on an edge get up to this many lrs further out")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    ap.add_argument("--lrs-per-opt", type=int, default=3, help="how many lrs of each grid (1 = the middle one)")
    ap.add_argument("--lrs", action="append", default=[], metavar="OPT=LR,LR",
                    help="replace an optimizer's lr grid, e.g. --lrs muon=0.02,0.03 (repeatable)")
    ap.add_argument("--eval-batches", type=int, default=0, help="default: 20,480 tokens' worth")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile the step (default: on for --size default, off for small, where it costs more "
                         "than it saves)")
    ap.add_argument("--adam-lr", default=str(ADAM_LR), metavar="LR|adamw",
                    help="the lr of the matrix optimizers' AdamW part (embeddings, head, norms); 'adamw': AdamW's best "
                         "lr of the same horizon's sweep (adamw must then be in --optimizers, before them)")
    ap.add_argument("--keep-from", metavar="JSON",
                    help="an earlier study's optimizers.json: its runs of the optimizers NOT in --optimizers are kept "
                         "(not rerun) and summarized beside the new ones; it must have this study's model, data and "
                         "horizons (e.g. rerunning one optimizer after a fix)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the finished runs in --runs/optimizers.partial.json (an interrupted study of the same "
                         "model, data and settings) instead of running them again")
    ap.add_argument("--runs", default="runs/bench-optimizers",
                    help="each run's folder and log, and the study's JSON so far (optimizers.partial.json)")
    results_io.add_arguments(ap)
    args, rest = ap.parse_known_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("optimizers")
    try:
        names = [n for n in args.optimizers.split(",") if n]
        if bad := [n for n in names if n not in OPTIMIZERS]:
            raise ValueError(f"unknown optimizer(s) {bad}; choose from {OPTIMIZERS}")
        if bad := [n for n in names if n not in GRIDS and not any(s.startswith(n + "=") for s in args.lrs)]:
            raise ValueError(f"{bad} have no lr grid in GRIDS; give one with --lrs {bad[0]}=LR,LR,...")
        horizons = [int(h) for h in args.horizons.split(",") if h]
        grids = dict(GRIDS)
        for spec in args.lrs:
            key, _, values = spec.partition("=")
            if key not in OPTIMIZERS or not values:
                raise ValueError(f"--lrs {spec!r}: expected OPT=LR,LR,... with OPT one of {OPTIMIZERS}")
            grids[key] = tuple(float(v) for v in values.split(","))
        for key in set(grids) - {s.partition("=")[0] for s in args.lrs}:
            grids[key] = pick_lrs(grids[key], args.lrs_per_opt)
        if args.adam_lr == "adamw":
            if "adamw" not in names or any(names.index(n) < names.index("adamw") for n in MATRIX if n in names):
                raise ValueError("--adam-lr=adamw needs adamw in --optimizers before every matrix optimizer")
        else:
            float(args.adam_lr)
        if not names or not horizons:
            raise ValueError("--optimizers and --horizons may not be empty")
        if min(horizons) < 1 or args.lrs_per_opt < 1 or args.seeds < 1:
            raise ValueError("--horizons, --lrs-per-opt and --seeds must be >= 1")
        base = size_config(args.size, *rest)
    except ValueError as err:
        sys.exit(f"error: {err}")
    t = base.train
    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
    kept = []
    if args.keep_from:
        earlier = json.loads(Path(args.keep_from).read_text())
        model = to_dict(base.model)     # fields added since that run are compared at their defaults: absent there
        differ = {k: (v, model[k]) for k, v in earlier["model"].items() if model.get(k) != v}
        if tokens_per_step != earlier["tokens_per_step"]:
            differ["tokens_per_step"] = (earlier["tokens_per_step"], tokens_per_step)
        if set(horizons) - set(earlier["horizons"]):
            differ["horizons"] = (earlier["horizons"], horizons)
        if differ:
            sys.exit(f"error: --keep-from {args.keep_from} differs from this study in {differ} (there, here): its "
                     "runs are not comparable; rerun every optimizer instead")
        kept = [r for r in earlier["runs"] if r["optimizer"] not in names and r["horizon"] in horizons]
        doc["kept_from"] = {"path": args.keep_from, "runs": len(kept),
                            "optimizers": sorted({r["optimizer"] for r in kept}), "meta": earlier.get("meta")}
    args.no_compile = not (args.compile if args.compile is not None else args.size == "default")
    args.eval_batches = args.eval_batches or max(1, round(20480 / (t.batch_size * t.seq_len)))
    out = Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("recompile_limit", "cache_size_limit"):      # one update graph per run, all in this process
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
            break
    print(f"optimizer study: {count_params(base.model) / 1e6:.2f}M-parameter model, horizons {horizons} steps x "
          f"{tokens_per_step} tokens, {args.seeds} seeds at the best lr, {args.eval_batches} eval batches, "
          f"{'eager' if args.no_compile else 'compiled'}, {torch.get_num_threads()} threads", flush=True)
    splits = preflight.load_data(base)
    loss_compile = 0.0 if args.no_compile else warm_up_loss(base, splits)
    memory_of = {}        # the step's measured peak depends on the optimizer, not on the horizon
    runs, summaries = [], {}
    finished = {}         # (horizon, optimizer, lr, seed) -> a run of the interrupted study (--resume)
    partial = out / "optimizers.partial.json"
    if args.resume and partial.is_file():
        earlier = json.loads(partial.read_text())
        if earlier.get("model") != as_stored(base.model) or earlier.get("tokens_per_step") != tokens_per_step:
            sys.exit(f"error: --resume: {partial} is a study of another model or batch; remove it or drop --resume")
        finished = {(r["horizon"], r["optimizer"], r["lr"], r["seed"]): r for r in earlier["runs"]}
        print(f"resuming: {len(finished)} finished runs in {partial}", flush=True)
    study_start = time.perf_counter()

    def write():
        doc.update(model=to_dict(base.model), train=to_dict(base.train), horizons=horizons,
                   tokens_per_step=tokens_per_step, seeds=args.seeds, loss_compile_s=loss_compile,
                   torch=torch.__version__, threads=torch.get_num_threads(), runs=runs,
                   summary={str(k): v for k, v in summaries.items()},
                   study_minutes=(time.perf_counter() - study_start) / 60)
        # after every run: an interrupted study keeps its runs
        (out / "optimizers.partial.json").write_text(json.dumps(doc, indent=1))

    for steps in horizons:
        h_args = argparse.Namespace(**vars(args), steps=steps, eval_every=max(5, steps // 10))
        h_args.log_every = max(1, h_args.eval_every // 2)

        def one(name, lr, seed):
            tag = f"{steps}-{name}-lr{lr:g}-seed{seed}"
            cfg = run_config(base, name, lr, h_args, out / tag, seed)
            kept = finished.get((steps, name, lr, seed))
            now = as_stored(cfg.optim)
            if kept and kept["optim"] == now:                    # the same run, e.g. the same AdamW-part lr
                memory_of.setdefault(name, kept["memory"])
                runs.append(kept)
                print(f"[{steps} steps] {name} lr {lr:g} seed {seed}: kept from the interrupted study", flush=True)
                return kept["final_val_loss"]
            if kept:
                differ = {k: (kept["optim"].get(k), now.get(k)) for k in {*now, *kept["optim"]}
                          if kept["optim"].get(k) != now.get(k)}
                print(f"[{steps} steps] {name} lr {lr:g} seed {seed}: rerun, the interrupted study's run had other "
                      f"settings (then, now): {differ}", flush=True)
            if name not in memory_of:
                memory_of[name] = {**memory(cfg), **measured_peak(cfg)}
            result = {"horizon": steps, "optimizer": name, "lr": lr, "seed": seed,
                      **one_run(cfg, splits, out / f"{tag}.log"), "memory": memory_of[name],
                      "optim": to_dict(cfg.optim)}
            runs.append(result)
            write()
            status = f"val {result['final_val_loss']:.4f}" if not result["error"] else f"FAILED ({result['error']})"
            print(f"[{steps} steps, {(time.perf_counter() - study_start) / 60:.1f} min] {name} lr {lr:g} seed {seed}: "
                  f"{status}, {result['s_per_step']:.3f} s/step, {result['run_seconds']:.0f} s", flush=True)
            return result["final_val_loss"]

        h_args.adam_lr_now = ADAM_LR if args.adam_lr == "adamw" else float(args.adam_lr)
        for name in names:
            sweep = {lr: one(name, lr, 0) for lr in grids[name]}
            for _ in range(args.extend if len(sweep) >= 3 else 0):     # centre the grid on its best
                best, ratio = min(sweep, key=sweep.get), grid_ratio(sweep)
                if best not in (min(sweep), max(sweep)) or not math.isfinite(sweep[best]):
                    break
                lr = float(f"{best * ratio if best == max(sweep) else best / ratio:.3g}")
                sweep[lr] = one(name, lr, 0)
            best = min(sweep, key=sweep.get)
            for seed in range(1, args.seeds):
                one(name, best, seed)
            if name == "adamw" and args.adam_lr == "adamw":
                h_args.adam_lr_now = best
                print(f"[{steps} steps] the matrix optimizers' AdamW part runs at AdamW's best lr, {best:g}", flush=True)
        summaries[steps] = summarize_horizon(sorted(
            [r for r in kept + runs if r["horizon"] == steps], key=lambda r: OPTIMIZERS.index(r["optimizer"])), steps)
        write()

    runs[:0] = kept      # the table counts every run it summarizes; kept_from says which were not rerun
    write()
    results_io.write(doc, tables(doc), args.out)
    print(plot(summaries, Path(args.out) / "optimizers.png",
               f"Mean of {args.seeds} seeds at each optimizer's best lr, {count_params(base.model) / 1e6:.2f}M model, "
               f"{tokens_per_step} tokens/step, built-in corpus"))
    return 0 if all(not r["error"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
