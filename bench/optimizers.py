"""Optimizer study: SGD, AdamW, Muon, Shampoo and SOAP on the default model, same tokens and schedule, lr sweeps.

    python bench/optimizers.py                                        # the full study (budget below)
    python bench/optimizers.py --optimizers adamw,sgd --steps 10 --lrs-per-opt 1     # smoke test, ~1 minute
    python bench/optimizers.py --optimizers muon --lrs muon=0.02,0.03 --train.batch_size=8

Every run is `train.train(cfg, quiet=True)` in this process on the built-in corpus with configs/default.py's
LLaMA-style model (3.3M parameters), `--steps` steps of batch x seq tokens, the same warmup + cosine schedule
(warmup = steps * 50/280, as the default config), weight decay 0.1 and clipping 1.0, compile on. What differs:

    sgd      lr {0.03, 0.1, 0.3}, momentum 0.9, no weight decay (coupled L2 at 0.1 would shrink weights lr*0.1/step)
    adamw    lr {1e-3, 2e-3, 4e-3} (betas 0.9, 0.95); 2e-3 is the tuned default
    muon     lr {0.02, 0.04, 0.08}, momentum 0.95, Nesterov, spectral scale
    shampoo  lr {3e-4, 1e-3, 3e-3}, Adam grafting, precondition every 10 steps
    soap     lr {1e-3, 3e-3, 1e-2}, precondition every 10 steps
    (Literature-style starting grids, sgd {0.1, 0.3, 1}, muon {0.01, 0.02, 0.04}, shampoo {1e-3, 3e-3, 1e-2}, had
    their best on an edge in a first study; see GRIDS.)
    Matrix optimizers (muon, shampoo, soap) own the hidden matrices; embeddings, LM head and norms go to
    AdamW at lr * adam_lr_ratio, with the ratio set per run so that the AdamW part always gets 2e-3.

Output: ONE markdown table (per optimizer: best lr by final validation loss, that loss, the step at which it
first reaches AdamW's best final validation loss, linearly interpolated between eval points, median seconds per
step, optimizer-state bytes per parameter, analytic memory), a PNG of validation loss against steps and against
wall-clock (best run per optimizer) and a JSON of every run, in --out (each run's folder there is replaced).

Memory is analytic, not measured: fp32 parameters + fp32 gradients + the optimizer state as opt.init builds it
(nanomega.optim.memory on meta tensors). Activations (the same for every optimizer) and the update's transient
buffers (Newton-Schulz, eigendecompositions) are not in it. RSS is not used: getrusage's maxrss is process-wide
and monotonic, and the runs share one process so that the loss is compiled once.

Time: seconds per step is the median over log windows (metrics tokens_per_s; evaluation excluded), so it is
free of compilation. The loss is compiled once, before the first run; each run's optimizer update compiles on
its first step: a run's compile time is its first window's excess over the median ("compile s" in the table:
the sum over the optimizer's runs), and the wall-clock curve is training time without evaluation and without
that excess.

Budget, measured on this 2-core CPU (the first full study, 100 steps of 16 x 256 tokens): s/step sgd 0.63, adamw
0.62, muon 0.72, shampoo 0.79, soap 0.80; an optimizer's update compiles on its first two lrs (18-30 s for sgd,
adamw, muon; ~40 s for shampoo, soap: the lr is a graph constant), and from the third on dynamo makes the lr a
graph input (no recompile); evaluations and the final checkpoint add ~11 s a run. That study took 31 minutes,
~26 without another job that overlapped two of its runs, so the default is now 85 steps (348K tokens,
warmup 15) x 5 optimizers x 3 lrs = 15 runs, ~23 minutes. Nothing else heavy may run meanwhile: s/step is
what the machine gives. Shrink with --steps, --optimizers, --lrs-per-opt (1 = the middle lr of each grid).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega, train.py and configs/ of this checkout

import torch  # noqa: E402

import train as train_script  # noqa: E402
from nanomega import optim  # noqa: E402
from nanomega.config import parse_args, to_dict  # noqa: E402
from nanomega.data import TokenSampler  # noqa: E402
from nanomega.metrics import count_params, read_metrics  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.optim.memory import param_count, state_bytes  # noqa: E402
from nanomega.step import make_step_fns  # noqa: E402

OPTIMIZERS = ("sgd", "adamw", "muon", "shampoo", "soap")
# Refined after a first 100-step study (final val loss by lr): sgd {0.1: 2.89, 0.3: 2.94, 1.0: 3.88}, adamw
# {1e-3: 2.21, 2e-3: 2.17, 4e-3: 2.27}, muon {0.01: 2.19, 0.02: 2.05, 0.04: 1.95}, shampoo {1e-3: 2.43, 3e-3: 2.52,
# 1e-2: 2.58}, soap {1e-3: 2.25, 3e-3: 2.17, 1e-2: 2.38}: grids whose best sat on an edge moved one step out.
GRIDS = {
    "sgd": (0.03, 0.1, 0.3),
    "adamw": (1e-3, 2e-3, 4e-3),
    "muon": (0.02, 0.04, 0.08),
    "shampoo": (3e-4, 1e-3, 3e-3),
    "soap": (1e-3, 3e-3, 1e-2),
}
SETTINGS = {  # per-optimizer OptimConfig fields on top of the default config's
    "sgd": {"momentum": 0.9, "weight_decay": 0.0},
    "adamw": {},
    "muon": {"muon_momentum": 0.95},
    "shampoo": {},
    "soap": {},
}
MATRIX = ("muon", "shampoo", "soap")
ADAM_LR = 2e-3  # the non-matrix parameters' AdamW lr under a matrix optimizer (the default config's tuned lr)
DEFAULT_STEPS, DEFAULT_EVAL_BATCHES = 85, 5


def pick_lrs(grid, k: int) -> list[float]:
    """k values of a grid, middle first, then outwards (1: the middle; 2: middle and lower), ascending."""
    mid = (len(grid) - 1) // 2
    order = sorted(range(len(grid)), key=lambda i: (abs(i - mid), i))
    return sorted(grid[i] for i in order[:k])


def run_config(base, name: str, lr: float, args, out_dir: Path):
    o = {"name": name, "lr": lr, "warmup_steps": max(1, round(args.steps * 50 / 280)), **SETTINGS[name]}
    if name in MATRIX:
        o["adam_lr_ratio"] = ADAM_LR / lr
    t = {"steps": args.steps, "eval_every": args.eval_every, "eval_batches": args.eval_batches,
         "log_every": args.log_every, "ckpt_every": args.steps, "keep_checkpoints": 1, "sample_tokens": 0,
         "compile": not args.no_compile, "resume": False, "out_dir": str(out_dir)}
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


def plot(best: dict, path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib; a bench-only dependency)"
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in best.items():
        label = f"{name} (lr {run['lr']:g})"
        a.plot(run["eval_steps"], run["val_loss"], marker="o", ms=3, label=label)
        b.plot(run["train_seconds"], run["val_loss"], marker="o", ms=3, label=label)
    a.set_xlabel("step")
    b.set_xlabel("training seconds (no evaluation, no compilation)")
    for ax in (a, b):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Best lr of each optimizer, default model, built-in corpus")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Other arguments: --section.key=value overrides of configs/default.py")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="train steps per run (the token budget)")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    ap.add_argument("--lrs-per-opt", type=int, default=3, help="how many lrs of each grid (1 = the middle one)")
    ap.add_argument("--lrs", action="append", default=[], metavar="OPT=LR,LR",
                    help="replace an optimizer's lr grid, e.g. --lrs muon=0.02,0.03 (repeatable)")
    ap.add_argument("--eval-every", type=int, default=0, help="default: max(5, steps/10)")
    ap.add_argument("--eval-batches", type=int, default=DEFAULT_EVAL_BATCHES)
    ap.add_argument("--log-every", type=int, default=0, help="metrics window for s/step (default: eval_every/2)")
    ap.add_argument("--no-compile", action="store_true", help="eager runs (compile is on by default)")
    ap.add_argument("--out", default="runs/bench-optimizers", help="run folders, JSON and PNG go here")
    args, rest = ap.parse_known_args(argv)
    try:
        names = [n for n in args.optimizers.split(",") if n]
        if bad := [n for n in names if n not in OPTIMIZERS]:
            raise ValueError(f"unknown optimizer(s) {bad}; choose from {OPTIMIZERS}")
        grids, replaced = dict(GRIDS), set()
        for spec in args.lrs:
            key, _, values = spec.partition("=")
            if key not in OPTIMIZERS or not values:
                raise ValueError(f"--lrs {spec!r}: expected OPT=LR,LR,... with OPT one of {OPTIMIZERS}")
            grids[key] = tuple(float(v) for v in values.split(","))
            replaced.add(key)
        if not names:
            raise ValueError("--optimizers is empty")
        if args.steps < 1 or args.lrs_per_opt < 1:
            raise ValueError("--steps and --lrs-per-opt must be >= 1")
        args.eval_every = args.eval_every or max(5, args.steps // 10)
        args.log_every = args.log_every or max(1, args.eval_every // 2)
        base = parse_args(["--config=default", *rest])
    except ValueError as err:
        sys.exit(f"error: {err}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("recompile_limit", "cache_size_limit"):      # one update graph per run, all in this process
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
            break

    plan = [(n, lr) for n in names for lr in (grids[n] if n in replaced else pick_lrs(grids[n], args.lrs_per_opt))]
    t = base.train
    print(f"optimizer study: {count_params(base.model) / 1e6:.2f}M-parameter model, {args.steps} steps x "
          f"{t.batch_size * t.grad_accum} x {t.seq_len} tokens, eval every {args.eval_every} steps "
          f"({args.eval_batches} batches), {'eager' if args.no_compile else 'compiled'}, "
          f"{torch.get_num_threads()} threads; {len(plan)} runs", flush=True)
    splits = train_script.load_data(base)
    loss_compile = 0.0
    if not args.no_compile:
        loss_compile = warm_up_loss(base, splits)
        print(f"loss compiled in {loss_compile:.1f} s (once for all runs)", flush=True)

    runs, doc_path = [], out / "optimizers.json"
    study_start = time.perf_counter()
    for i, (name, lr) in enumerate(plan, 1):
        cfg = run_config(base, name, lr, args, out / f"{name}-lr{lr:g}")
        result = {"optimizer": name, "lr": lr, **one_run(cfg, splits, out / f"{name}-lr{lr:g}.log"),
                  "memory": memory(cfg), "optim": to_dict(cfg.optim)}
        runs.append(result)
        status = (f"val {result['final_val_loss']:.4f}" if not result["error"] else f"FAILED ({result['error']})")
        print(f"[{i}/{len(plan)}] {name} lr {lr:g}: {status}, {result['s_per_step']:.3f} s/step, compile "
              f"{result['compile_s']:.1f} s, {result['run_seconds']:.0f} s in all", flush=True)
        doc = {"model": to_dict(base.model), "train": to_dict(base.train), "steps": args.steps,
               "loss_compile_s": loss_compile, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "process_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "runs": runs}
        doc_path.write_text(json.dumps(doc, indent=1))      # after every run: an interrupted study keeps its runs

    best = {}
    for r in runs:
        if r["optimizer"] not in best or r["final_val_loss"] < best[r["optimizer"]]["final_val_loss"]:
            best[r["optimizer"]] = r
    target = best["adamw"]["final_val_loss"] if "adamw" in best else None
    print(f"\n| optimizer | best lr | final val loss | steps to AdamW's {target:.4f} | s/step | compile s | "
          f"state B/param | params+grads+state MiB |" if target is not None and math.isfinite(target) else
          "\n| optimizer | best lr | final val loss | steps to AdamW's best | s/step | compile s | state B/param | "
          "params+grads+state MiB |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for name, r in best.items():
        reach = steps_to_reach(r["eval_steps"], r["val_loss"], target) if target and math.isfinite(target) else None
        r["steps_to_adamw_best"] = reach
        lrs = ", ".join(f"{x['lr']:g}: {x['final_val_loss']:.3f}" for x in runs if x["optimizer"] == name)
        val = f"{r['final_val_loss']:.4f}" if math.isfinite(r["final_val_loss"]) else f"failed: {r['error']}"
        m = r["memory"]
        print(f"| {name} | {r['lr']:g} | {val} | {f'{reach:.0f}' if reach is not None else '—'} | "
              f"{r['s_per_step']:.3f} | {sum(x['compile_s'] for x in runs if x['optimizer'] == name):.1f} | "
              f"{m['state_bytes_per_param']:.2f} | "
              f"{m['params_grads_state_bytes'] / 2**20:.1f} |")
        r["sweep"] = lrs
    print("\nSweeps (lr: final val loss): " + "; ".join(f"{n} {r['sweep']}" for n, r in best.items()))
    print(f"{len(runs)} runs in {(time.perf_counter() - study_start) / 60:.1f} min after {loss_compile:.0f} s of loss "
          f"compilation. s/step: median over {args.log_every}-step windows, evaluation excluded; compile s: the "
          f"optimizer's update compilations, each run's first-window excess, summed over its runs. Memory is "
          f"analytic: fp32 params + grads + optimizer state (activations and transient update buffers excluded).")
    doc_path.write_text(json.dumps(doc, indent=1))
    print(plot(best, out / "optimizers.png"))
    print(f"wrote {doc_path}")
    return 0 if all(not r["error"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
