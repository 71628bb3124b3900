"""Low-precision optimizer state: each optimizer's fp32 state against bf16 state, its memory and its final loss.

    python bench/optimizer_state.py                          # 14 runs of 1,000 steps, ~35 min on 2 cores
    python bench/optimizer_state.py --seeds 2                # and a second seed of every row
    python bench/optimizer_state.py --seeds 2 --variants fp32 --keep    # add seed 1 of the fp32 rows only
    python bench/optimizer_state.py --steps 20 --optimizers soap --out /tmp/smoke      # smoke test

The optimizer study's protocol (bench/optimizers.py, imported, not copied): its small model (SMALL), its
1,000-step horizon, eager, each optimizer at its best learning rate in bench/results/optimizers.json. Rows:
  fp32     every state leaf as computed (the reference)
  state    optim.state_dtype=bfloat16: momentum buffers (AdamW's and the graft's first moment, Muon's
           momentum, SOAP's m and v; Adam's second moment stays fp32)
  factors  optim.factor_dtype=bfloat16: Shampoo's and SOAP's Kronecker factors
  bases    optim.basis_dtype=bfloat16: Shampoo's inverse roots, SOAP's eigenbases
  all      the three together
(factors, bases and all for Shampoo and SOAP only: the others have neither.) Columns: state bytes per parameter
(opt.init on meta tensors, nanomega.optim.memory), the measured peak of one eager step (the study's
measured_peak: nanomega.sim.estimate's MemoryTracker, every storage from creation to release), and the final
validation loss with its difference from the same optimizer's fp32 row at the same seed. Beside it, the study's
own seed spread of that optimizer at that lr (the two seeds' max - min in optimizers.json): a difference inside
it is noise as far as these runs can tell. Where the fp32 row ran two seeds or more here, their spread is given
too ("fp32 spread here"): the study's figures come from its own day's code.

Output, in --out (bench/results/): optimizer_state.json (every run) and optimizer_state.md (the table), both
written again after every run, so an interrupted run keeps what it measured; --render JSON rewrites the .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import results_io  # noqa: E402
from optimizers import MATRIX, SMALL, measured_peak, memory, one_run, run_config   # noqa: E402  (the study's pieces)

from nanomega.run import preflight  # noqa: E402
from nanomega import optim  # noqa: E402
from nanomega.config import parse_args, to_dict  # noqa: E402

OPTIMIZERS = ("adamw",) + MATRIX     # AdamW (the reference) and every whole-matrix optimizer (the registry's)
VARIANTS = {  # row name: OptimConfig fields set to bfloat16
    "fp32": (),
    "state": ("state_dtype",),
    "factors": ("factor_dtype",),
    "bases": ("basis_dtype",),
    "all": ("state_dtype", "factor_dtype", "basis_dtype"),
}
# the optimizers with factors and bases: those whose settings store them in a dtype of their own
MATRIX_STATE = tuple(name for name in OPTIMIZERS if "factor_dtype" in optim.setting_names(name))


def rows(names, variants=tuple(VARIANTS)) -> list[tuple[str, str]]:
    return [(n, v) for n in names for v in variants if n in MATRIX_STATE or v in ("fp32", "state")]


def study_reference(path: Path, names) -> dict:
    """Each optimizer's best lr at the study's longest horizon, with its seeds' finals and spread."""
    study = json.loads(path.read_text())
    summary = study["summary"][str(max(study["horizons"]))]
    missing = [n for n in names if n not in summary]
    if missing:
        raise ValueError(f"{path} has no summary for {missing}: run bench/optimizers.py for them first")
    return {"path": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
            "meta": study.get("meta"), "horizon": max(study["horizons"]),
            **{n: {k: summary[n][k] for k in ("best_lr", "finals", "mean", "spread")} for n in names}}


def tables(doc: dict) -> str:
    runs, ref = doc["runs"], doc["reference"]
    fp32 = {(r["optimizer"], r["seed"]): r["final_val_loss"] for r in runs if r["variant"] == "fp32"}
    here = {}
    for (name, _), loss in fp32.items():
        here.setdefault(name, []).append(loss)
    body = []
    for r in runs:
        base = fp32.get((r["optimizer"], r["seed"]))
        diff = "" if base is None or r["variant"] == "fp32" else f"{r['final_val_loss'] - base:+.4f}"
        m = r["memory"]
        body.append([r["optimizer"], r["variant"], ", ".join(VARIANTS[r["variant"]]) or "-", f"{r['lr']:g}",
                     str(r["seed"]), f"{m['state_bytes_per_param']:.2f}", f"{m['step_peak_bytes'] / 2**20:.1f}",
                     f"{m['update_peak_bytes'] / 2**20:.1f}",
                     f"{r['final_val_loss']:.4f}" + (f" ({r['error']})" if r["error"] else ""), diff,
                     f"{ref[r['optimizer']]['spread']:.4f}",
                     f"{max(here[r['optimizer']]) - min(here[r['optimizer']]):.4f}"
                     if len(here.get(r["optimizer"], [])) > 1 else ""])
    return (f"{doc['steps']} steps of the optimizer study's small model ({doc['params']:,} parameters, "
            f"{doc['tokens_per_step']:,} tokens/step), eager, each optimizer at its best lr from {ref['path']}"
            + (f"; {doc['kept']['runs']} runs kept from `{doc['kept']['meta']['command']}` "
               f"({doc['kept']['meta']['date']})" if doc.get("kept") else "") + "\n\n"
            + results_io.table(["optimizer", "row", "bf16 fields", "lr", "seed", "state B/param",
                                "step peak MiB", "update peak MiB", "final val loss", "vs fp32", "study seed spread",
                                "fp32 spread here"], "lllrrrrrrrrr", body)
            + "\n\nstate B/param: opt.init's bytes / parameters (meta tensors). Peaks: one eager step measured by "
              "MemoryTracker (the study's measured_peak): the step peak is the larger of the forward-backward's and the "
              "update's. "
              "vs fp32: final val loss minus the same optimizer's fp32 row at the same seed. study seed spread: "
              f"max - min of the study's {len(ref['adamw']['finals']) if 'adamw' in ref else 2} seeds at that lr "
              "(optimizers.json): a difference inside it is noise as far as these runs can tell. fp32 spread here: "
              "max - min of this file's fp32 runs of that optimizer (its seeds), where it has two or more.")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=1000, help="train steps per run (the study's longest horizon)")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per row: all rows run seed 0 before any runs seed 1")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, from {OPTIMIZERS}")
    ap.add_argument("--study", default=str(ROOT / "bench" / "results" / "optimizers.json"),
                    help="the optimizer study's results: best lrs and seed spreads")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "bench-optimizer-state"), help="each run's folder and log")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated rows, from {tuple(VARIANTS)}")
    ap.add_argument("--keep", action="store_true",
                    help="keep the runs already in --out's optimizer_state.json (same steps) and run only the "
                         "missing (optimizer, row, seed)")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    names = [n for n in args.optimizers.split(",") if n]
    if bad := [n for n in names if n not in OPTIMIZERS]:
        sys.exit(f"error: unknown optimizer(s) {bad}; choose from {OPTIMIZERS}")
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        sys.exit(f"error: unknown row(s) {bad}; choose from {tuple(VARIANTS)}")
    if args.steps < 1 or args.seeds < 1:
        sys.exit("error: --steps and --seeds must be >= 1")
    try:
        reference = study_reference(Path(args.study), names)
    except (OSError, ValueError, KeyError) as err:
        sys.exit(f"error: {err}")
    doc = results_io.start("optimizer_state")
    base = parse_args(["--config=default", *SMALL])
    t = base.train
    tokens_per_step = t.batch_size * t.grad_accum * t.seq_len
    eval_every = max(5, args.steps // 10)    # the study's
    h_args = argparse.Namespace(steps=args.steps, eval_every=eval_every, log_every=max(1, eval_every // 2),
                                eval_batches=max(1, round(20480 / (t.batch_size * t.seq_len))), no_compile=True)
    out = Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    splits = preflight.load_data(base)
    runs, start = [], time.perf_counter()
    earlier = Path(args.out) / "optimizer_state.json"
    if args.keep and earlier.is_file():
        old = json.loads(earlier.read_text())
        if old["steps"] != args.steps:
            sys.exit(f"error: --keep: {earlier} ran {old['steps']} steps, this run {args.steps}; use another --out")
        runs = old["runs"]
        doc["kept"] = {"runs": len(runs), "meta": old["meta"]}
    done = {(r["optimizer"], r["variant"], r["seed"]) for r in runs}
    for seed in range(args.seeds):
        for name, variant in rows(names, variants):
            if (name, variant, seed) in done:
                continue
            lr = reference[name]["best_lr"]
            tag = f"{name}-{variant}-seed{seed}"
            cfg = run_config(base, name, lr, h_args, out / tag, seed)
            cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                     **{f: "bfloat16" for f in VARIANTS[variant]}))
            result = {"optimizer": name, "variant": variant, "lr": lr, "seed": seed,
                      "memory": {**memory(cfg), **measured_peak(cfg)}, **one_run(cfg, splits, out / f"{tag}.log"),
                      "optim": to_dict(cfg.optim)}
            runs.append(result)
            doc.update(steps=args.steps, params=result["memory"]["params"], tokens_per_step=tokens_per_step,
                       model=to_dict(base.model), reference=reference, runs=runs,
                       minutes=(time.perf_counter() - start) / 60)
            results_io.write(doc, tables(doc), args.out)     # after every run: an interrupted study keeps its runs
            print(f"[{(time.perf_counter() - start) / 60:.1f} min] {tag}: val {result['final_val_loss']:.4f}"
                  + (f" ({result['error']})" if result["error"] else ""), flush=True)
    return 0 if all(not r["error"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
