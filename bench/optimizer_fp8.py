"""The optimizers under float8: AdamW, Muon, Shampoo and SOAP, each in bf16 and with every FP8 recipe.

    python bench/optimizer_fp8.py                     # the study (resumable: finished stages are kept)
    python bench/optimizer_fp8.py --size default      # the same on configs/default.py at its budget (~4 h, 1 core)
    python bench/optimizer_fp8.py --steps 20 --recipes rowwise --lrs-per-opt 1 --seeds 1 --out /tmp/f --runs /tmp/fr

Model and budget (--size): "small" (the default) is bench/optimizers.py's model (d_model 128, 0.85M parameters)
at its middle horizon, 300 steps of 8 x 128 tokens, where that study's fp32 lr sweeps centre the grids;
"default" is configs/default.py as it is (3.3M parameters, 280 steps of 16 x 256 tokens, as bench/fp8.py). Both
run with bf16 autocast, compiled. Each optimizer's lr is its best in bf16: an lr grid at seed 0 (bench/optimizers.py's
method: three lrs a factor 2 apart, extended while the best sits on an edge) and a second seed at the best. Then, at
that lr, each FP8 recipe (--model.fp8=tensorwise, rowwise, blockwise, delayed: the blocks' linear layers in float8,
nanomega/models/fp8.py) with the same seeds. Each recipe's runs for all four optimizers are one bench/optimizers.py
study (--lrs OPT=best, --model.fp8=...), so every run is the same `train.train` the optimizer study makes, with its
schedule and evaluation.

Also Muon with bf16 weights (--train.param_dtype=bfloat16: the fp32 master cast to bf16 before each unit runs,
so the float8 quantization starts from bf16), in bf16 and under tensorwise (--no-cast: not). Not measured:
parameters stored in bf16 with no fp32 master (the update rounded into bf16 weights): nanomega always keeps
an fp32 master.

The table: per optimizer, bf16's final validation loss (mean of the seeds ± half their range) and each
recipe's difference from it, in % (within 1.5%: bench/fp8.py's goal for AdamW); the plot: the same as bars.
On this CPU float8 is emulated (dequantized operands, fp32 accumulation: float8's numbers, not its speed).

Results: bench/results/optimizer_fp8.{json,md,png} (--size default: optimizer_fp8_default.*), and each stage's
study (bench/optimizers.py's optimizers.{json,md,png}) in bench/results/optimizer_fp8/<size>/<bf16|recipe|cast-...>/: a stage found there is not
rerun. Runs and logs go to --runs/<size>/<stage>/, with a stage's partial JSON while it is cut short: rerun, it resumes.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import results_io  # noqa: E402
import optimizers as study  # noqa: E402

OPTIMIZERS = ("adamw",) + study.MATRIX     # AdamW (the reference) and every whole-matrix optimizer
RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
# Per size, each grid's middle and the steps. small: the optimizer study's fp32 bests at 300 steps
# (bench/results/optimizers.md: AdamW 0.004, Muon 0.04, Shampoo 0.003, SOAP 0.003). default: AdamW's around
# configs/default.py's tuned 2e-3; Shampoo's around bench/results/variants_default_budget.md's best (1.5e-3);
# Muon's and SOAP's around the small model's bests, one step lower for the wider model.
SIZES = {"small": (300, {"adamw": (2e-3, 4e-3, 8e-3), "muon": (0.02, 0.04, 0.08), "shampoo": (1.5e-3, 3e-3, 6e-3),
                         "soap": (1.5e-3, 3e-3, 6e-3)}),
         "default": (280, {"adamw": (1e-3, 2e-3, 4e-3), "muon": (0.01, 0.02, 0.04), "shampoo": (7.5e-4, 1.5e-3, 3e-3),
                           "soap": (1.5e-3, 3e-3, 6e-3)})}
GOAL = 0.015


def run_study(name: str, args, lrs: dict, recipe: str | None, extra: tuple = ()) -> dict:
    """One bench/optimizers.py study of the optimizers in `lrs` (resumed if cut short); its optimizers.json, kept
    in --out/optimizer_fp8/<name>/ (its runs and logs in --runs/<name>/)."""
    out, runs = Path(args.out) / "optimizer_fp8" / args.size / name, Path(args.runs) / args.size / name
    if not (out / "optimizers.json").is_file():
        argv = ["--resume", f"--size={args.size}", "--compile", f"--horizons={args.steps}",
                f"--optimizers={','.join(lrs)}", f"--seeds={args.seeds}", *extra,
                f"--runs={runs}", f"--out={out}", "--train.dtype=bfloat16",
                *(f"--lrs={o}={','.join(f'{x:g}' for x in v)}" for o, v in lrs.items()),
                *([f"--model.fp8={recipe}"] if recipe else []), *(["--extend=0"] if recipe else [])]
        print(f"{name}: bench/optimizers.py {' '.join(argv)}", flush=True)
        code = study.main(argv)
        if code and not (out / "optimizers.json").is_file():
            sys.exit(f"error: the {name} study failed (exit {code}); its runs and logs are in {runs}")
    return json.loads((out / "optimizers.json").read_text())


def fp8_refusal(size: str, recipe: str) -> str | None:
    """Why `recipe` cannot run this size's model (train.py refuses it before any work), or None: blockwise scales
    128 x 128 weight blocks, and the small model's key and value projections have 64 rows."""
    from nanomega.parallel.mesh import validate_fp8
    try:
        validate_fp8(study.size_config(size, f"--model.fp8={recipe}"))
    except ValueError as e:
        return str(e)
    return None


def row(doc: dict, name: str) -> dict:
    r = doc["summary"][str(doc["horizons"][0])][name]
    return {"lr": r["best_lr"], "edge": r["edge"], "finals": r["finals"], "mean": r["mean"], "spread": r["spread"],
            "s_per_step": r["s_per_step"], "sweep": r["sweep"]}


def weight_quantization(runs: Path, steps: int, results: dict) -> dict:
    """How each optimizer's trained weights take float8: every fp8 linear weight of its bf16 runs at the best lr
    (each seed's final checkpoint), quantized to E4M3 as the recipes quantize a weight (axis 1, the contracted
    in-features): the relative error ||W - dequant(quant(W))|| / ||W|| under tensorwise and rowwise scales, the share
    of nonzero entries flushed to zero by the tensorwise scale, and the crest factor amax / rms that sets it; means
    over matrices and seeds. Muon's update has equal singular values and Adam's follows its largest entries, so the
    trained weights' spread, and with it float8's error on them, may differ by optimizer."""
    from safetensors.torch import load_file
    from nanomega.models import fp8

    found = {}
    for name, res in results.items():
        if name not in OPTIMIZERS:
            continue
        files = sorted((runs / "bf16").glob(f"{steps}-{name}-lr{res['bf16']['lr']:g}-seed*/ckpt-{steps:08d}/"
                                            "params.safetensors"))
        rows = []
        for f in files:
            for key, w in load_file(f).items():
                if not fp8.is_fp8_linear(key) or w.ndim != 2:
                    continue
                w, row = w.float(), {}
                for recipe in ("tensorwise", "rowwise"):
                    q, scale = fp8.quantize(w, fp8.E4M3, recipe, axis=1, weight=True)
                    back = q.float() * scale
                    row[recipe] = float((w - back).norm() / w.norm())
                    if recipe == "tensorwise":
                        row["flushed"] = float(((back == 0) & (w != 0)).float().mean())
                row["crest"] = float(w.abs().max() / w.pow(2).mean().sqrt())
                rows.append(row)
        if rows:
            found[name] = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} | {"matrices": len(rows),
                                                                                    "seeds": len(files)}
    return found


def tables(doc: dict) -> str:
    head = ["optimizer", "lr", "bf16 final val loss"] + [f"{r} (vs bf16)" for r in doc["recipes"]]
    rows = []
    for name, res in doc["results"].items():
        ref = res["bf16"]
        edge = " (edge)" if ref["edge"] and len(ref["sweep"]) >= 3 else " (no sweep)" if len(ref["sweep"]) < 3 else ""
        cells = [name, f"{ref['lr']:g}{edge}", f"{ref['mean']:.4f} ± {ref['spread'] / 2:.4f}"]
        for recipe in doc["recipes"]:
            r = res.get(recipe)
            if not r or not math.isfinite(r["mean"]):
                cells.append("failed" if r else "refused" if recipe in doc.get("refused", {}) else "—")
                continue
            d = r["mean"] / ref["mean"] - 1
            cells.append(f"{r['mean']:.4f} ({d:+.2%}{'' if abs(d) <= GOAL else ', over 1.5%'})")
        rows.append(cells)
    cast = [f"{n}: in bf16 {res['bf16']['mean'] / doc['results']['muon']['bf16']['mean'] - 1:+.2%} against Muon with "
            "fp32 weights" for n, res in doc["results"].items() if n.startswith("muon, ") and "bf16" in res]
    sweeps = "; ".join(f"{n} " + ", ".join(f"{float(lr):g}: {v:.3f}" for lr, v in res["bf16"]["sweep"].items())
                       for n, res in doc["results"].items())
    model = ("configs/default.py" if doc.get("size", "default") == "default" else
             f"bench/optimizers.py's small model (d_model {doc['model']['d_model']})")
    return (f"{doc['steps']} steps of {model} ({doc['tokens_per_step']:,} tokens/step), bf16 autocast, "
            f"compiled, {doc['seeds']} seeds; fp8: the blocks' linear layers in float8 at the optimizer's bf16-best lr\n\n"
            + results_io.table(head, "lrr" + "r" * len(doc["recipes"]), rows)
            + f"\n\nFinal validation loss in nats/byte, mean of the seeds (± half their range for bf16); in brackets the "
              f"difference from the same optimizer in bf16{' (' + '; '.join(cast) + ')' if cast else ''}. "
              f"bf16 lr sweeps at seed 0: {sweeps}. Compute: "
              f"{doc['minutes']:.0f} min of runs."
            + "".join(f" {r}: refused, as train.py refuses it: {why}" for r, why in doc.get("refused", {}).items())
            + weights_table(doc.get("weights") or {}))


def weights_table(weights: dict) -> str:
    if not weights:
        return ""
    rows = [[n, f"{w['crest']:.1f}", f"{w['tensorwise']:.4f}", f"{w['rowwise']:.4f}", f"{w['flushed'] * 1e6:.1f} ppm",
             f"{w['matrices']} ({w['seeds']} seeds)"] for n, w in weights.items()]
    return ("\n\nThe trained weights in float8 (E4M3, each bf16 run's final fp8 linear weights at the best lr; means "
            "over matrices and seeds):\n\n"
            + results_io.table(["optimizer", "crest amax/rms", "rel. error tensorwise", "rel. error rowwise",
                                "flushed to 0 (tensorwise)", "matrices"], "lrrrrr", rows))


def plot(doc: dict, path: Path) -> str:
    plt = results_io.pyplot()
    if plt is None:
        return results_io.NO_PNG
    fig, ax = plt.subplots(figsize=(8, 4.5))
    recipes = [r for r in doc["recipes"] if r not in doc.get("refused", {})]
    names, width = list(doc["results"]), 0.8 / len(recipes)
    for i, recipe in enumerate(recipes):
        ys = [100 * (doc["results"][n][recipe]["mean"] / doc["results"][n]["bf16"]["mean"] - 1)
              if recipe in doc["results"][n] and math.isfinite(doc["results"][n][recipe]["mean"]) else float("nan")
              for n in names]
        ax.bar([j + (i - (len(recipes) - 1) / 2) * width for j in range(len(names))], ys, width, label=recipe)
    for n, j in zip(names, range(len(names))):
        ref = doc["results"][n]["bf16"]
        half = 100 * ref["spread"] / 2 / ref["mean"]
        ax.fill_between([j - 0.45, j + 0.45], -half, half, color="grey", alpha=0.25, lw=0)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), [n.replace(", ", "\n").replace(" (param_dtype)", "") for n in names])
    ax.set_ylabel("final val loss vs bf16 (%)")
    ax.set_title("float8 recipes per optimizer (grey: bf16's seed half-range)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return results_io.save_figure(plt, fig, path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--size", choices=tuple(SIZES), default="small",
                    help="small: bench/optimizers.py's model at 300 steps; default: configs/default.py at 280")
    ap.add_argument("--steps", type=int, default=0, help="train steps (0: the size's: 300 small, 280 default)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lrs-per-opt", type=int, default=3, help="bf16 grid size (1: the middle lr only)")
    ap.add_argument("--cast", action=argparse.BooleanOptionalAction, default=True,
                    help="also Muon with bf16 weights (train.param_dtype=bfloat16) in bf16 and under tensorwise")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "optimizer-fp8"), help="every study's runs (kept)")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    recipes = [r for r in args.recipes.split(",") if r]
    if bad := [r for r in recipes if r not in RECIPES]:
        sys.exit(f"error: unknown recipe(s) {bad}; choose from {RECIPES}")
    args.steps = args.steps or SIZES[args.size][0]
    if args.steps < 1 or args.seeds < 1 or args.lrs_per_opt < 1:
        sys.exit("error: --steps, --seeds and --lrs-per-opt must be >= 1")
    name = "optimizer_fp8" if args.size == "small" else f"optimizer_fp8_{args.size}"   # one results file per size
    doc = results_io.start(name)
    grids = {n: tuple(study.pick_lrs(SIZES[args.size][1][n], args.lrs_per_opt)) for n in OPTIMIZERS}
    refused = {r: why for r in recipes if (why := fp8_refusal(args.size, r))}     # known before any run
    bf16 = run_study("bf16", args, grids, None)
    results = {n: {"bf16": row(bf16, n)} for n in OPTIMIZERS}
    minutes = bf16["study_minutes"]
    for recipe in recipes:
        if recipe in refused:
            print(f"{recipe}: not run, train.py refuses it for this model: {refused[recipe]}", flush=True)
            continue
        best = {n: (results[n]["bf16"]["lr"],) for n in OPTIMIZERS}
        fp8 = run_study(recipe, args, best, recipe)
        minutes += fp8["study_minutes"]
        for n in OPTIMIZERS:
            results[n][recipe] = row(fp8, n)
    # Where the float8 cast meets the optimizer: Muon's small, equal-singular-value updates land in the fp32
    # master either way; with train.param_dtype=bfloat16 each unit's weights are cast to bf16 before the float8
    # quantization (FSDP2's mixed-precision policy), so an update below bf16's resolution of a weight reaches the
    # float8 cast only once enough of them accumulate in the master.
    if args.cast:
        lr = {"muon": (results["muon"]["bf16"]["lr"],)}
        row_name = "muon, bf16 weights (param_dtype)"
        results[row_name] = {}
        for recipe in ("bf16", *[r for r in recipes if r == "tensorwise"]):
            cast = run_study(f"cast-{recipe}", args, lr, None if recipe == "bf16" else recipe,
                             ("--train.param_dtype=bfloat16",))
            minutes += cast["study_minutes"]
            results[row_name][recipe] = row(cast, "muon")
    doc.update(size=args.size, model=bf16.get("model"), steps=args.steps, seeds=args.seeds, recipes=recipes,
               tokens_per_step=bf16["tokens_per_step"], results=results, minutes=minutes, refused=refused,
               weights=weight_quantization(Path(args.runs) / args.size, args.steps, results))
    results_io.write(doc, tables(doc), args.out)
    print(plot(doc, Path(args.out) / f"{name}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
