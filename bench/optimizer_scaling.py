"""Does the matrix optimizers' advantage over AdamW shrink as the model grows? The optimizer study at four sizes.

    python bench/optimizer_scaling.py                 # the study (budget below), resumable: finished sizes are kept
    python bench/optimizer_scaling.py --plan          # sizes, parameters, steps and tokens; nothing runs
    python bench/optimizer_scaling.py --sizes xs --tokens-per-param 0.2 --seeds 1 --lrs-per-opt 1 --out /tmp/s

Method: bench/optimizers.py's, run once per size (each size is one call of its main(), with its lr grid,
the extension of a best lr that sits on the grid's edge, and a second seed at the best lr), for AdamW, Muon,
Shampoo and SOAP. The four sizes are configs/default.py's LLaMA-style byte model, 4 layers, at widths 32, 64,
128 and 192 (head_dim 32, SwiGLU 3 x d; non-embedding parameters 0.054M, 0.197M, 0.788M and 1.72M: 32x; the
embedding and head, 2 x 256 x d, are left out of the count, as the scaling literature does). Every size
trains on --tokens-per-param x its non-embedding parameters (default 1.0: 0.05M to 1.7M tokens, half an
epoch of the built-in corpus at most) in batches of 8 x 128 tokens, so steps grow with size (53 to 1,682)
and each run's warmup and cosine decay are scaled to its steps (bench/optimizers.py). Why so small and so
short: the compute grows as parameters x tokens, i.e. as the square of the size at a fixed ratio, and the
study was sized for about two hours of 2 idle cores (the largest size is most of it). Measured on 2026-12-03,
one thread beside other work: xs 3 min, s 9, m 67; l about twice m. Each size's lr grids
are the 0.85M study's best lrs at its horizon nearest the size's steps (bench/results/optimizers.json: 100,
300 or 1,000) x {1/2, 1, 2}. The matrix optimizers' AdamW part (embeddings, head, norms: 23% of the smallest
model's parameters) runs at AdamW's best lr of the same size (--adam-lr=adamw): at a fixed 2e-3, as in the
0.85M study, the smallest size's matrix optimizers stalled at 3.6 nats/byte whatever their own lr while
AdamW at 0.016 reached 2.8 (a first run, 2026-12-03).

Output: per optimizer and size, the steps at which the mean curve of the seeds reaches AdamW's mean final
loss over AdamW's steps (the study's ratio: below 1 is faster), and the same per seed (each seed's curve
against AdamW's mean final loss) for the spread. Then, per optimizer, the least-squares line
ratio = a + b log10(N), with b's standard error from the residuals (2 degrees of freedom) and b's range over
every choice of one seed per size (2^4 fits), set beside the published trend: Wen et al., "Fantastic
Pretraining Optimizers and Where to Find Them" (2025): matrix optimizers' speed-up over AdamW from 1.4x at
0.1B to 1.1x at 1.2B parameters, i.e. a steps ratio from 0.71 to 0.91, b = +0.18 per decade. A positive b
is an advantage that shrinks with size.

Results: bench/results/optimizer_scaling.{json,md,png}, and each size's own study (bench/optimizers.py's
optimizers.{json,md,png}) in bench/results/optimizer_scaling/<size>/: a size whose optimizers.json is there is
not rerun. Each run's folder and log go to --runs/<size>/, with the partial JSON of a size cut short: rerun, it
resumes from there (only the run that was cut is lost); a partial JSON committed beside a size's results
(optimizers.partial.json) seeds that resume in a fresh checkout. Compute: measured per size in the JSON
(study_minutes), and in the table's last line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import results_io  # noqa: E402
import optimizers as study  # noqa: E402

from nanomega.config import parse_args  # noqa: E402
from nanomega.sim.counting import count_params  # noqa: E402

# name: (d_model, n_layers, n_heads, n_kv_heads, ffn_dim); head_dim 32 throughout, ffn 3 x d (SwiGLU)
SIZES = {
    "xs": (32, 4, 1, 1, 96),
    "s": (64, 4, 2, 1, 192),
    "m": (128, 4, 4, 2, 384),
    "l": (192, 4, 6, 2, 576),
}
OPTIMIZERS = ("adamw",) + study.MATRIX     # AdamW (the reference) and every whole-matrix optimizer
BATCH, SEQ = 8, 128
PUBLISHED = {"source": "Wen et al. 2025, Fantastic Pretraining Optimizers and Where to Find Them",
             "params": (0.1e9, 1.2e9), "speedup": (1.4, 1.1)}


def published_slope() -> float:
    (n0, n1), (s0, s1) = PUBLISHED["params"], PUBLISHED["speedup"]
    return (1 / s1 - 1 / s0) / math.log10(n1 / n0)


def size_overrides(name: str) -> list[str]:
    d, layers, heads, kv, ffn = SIZES[name]
    return [f"--model.d_model={d}", f"--model.n_layers={layers}", f"--model.n_heads={heads}",
            f"--model.n_kv_heads={kv}", f"--model.ffn_dim={ffn}", f"--model.max_seq_len={SEQ}",
            f"--train.seq_len={SEQ}", f"--train.batch_size={BATCH}"]


def non_embedding_params(name: str) -> int:
    model = parse_args(["--config=default", *size_overrides(name)]).model
    return count_params(model) - 2 * model.vocab_size * model.d_model


def steps_for(name: str, tokens_per_param: float) -> int:
    return max(20, round(tokens_per_param * non_embedding_params(name) / (BATCH * SEQ)))


def base_lrs(path: Path, steps: int) -> dict:
    """Each optimizer's best lr in the 0.85M-parameter study at its horizon nearest `steps` (in log steps): at
    these sizes the best lr moves more with the horizon than with the width (that study's sweeps)."""
    doc = json.loads(path.read_text())
    nearest = min(doc["horizons"], key=lambda h: abs(math.log(h / steps)))
    return {name: doc["summary"][str(nearest)][name]["best_lr"] for name in OPTIMIZERS}


def seed_ratios(size_doc: dict) -> dict:
    """Per optimizer: each seed's steps to AdamW's mean final loss, over the steps (None: not reached)."""
    steps = size_doc["horizons"][0]
    summary = size_doc["summary"][str(steps)]
    target = summary["adamw"]["mean"]
    out = {}
    for name, row in summary.items():
        runs = [r for r in size_doc["runs"] if r["optimizer"] == name and r["lr"] == row["best_lr"]]
        reach = [study.steps_to_reach(r["eval_steps"], r["val_loss"], target) for r in runs]
        out[name] = [x / steps if x else None for x in reach]
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x: (a, b, standard error of b; nan with fewer than 3 points)."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    if n < 3:
        return a, b, float("nan")
    resid = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, math.sqrt(resid / (n - 2) / sxx)


def trends(sizes: dict) -> dict:
    """Per optimizer: the fitted line over sizes of the mean-curve ratio, and b over every one-seed-per-size
    choice. Sizes where the optimizer never reached AdamW's final loss are left out of the fit (and listed)."""
    out = {}
    for name in OPTIMIZERS[1:]:
        pts = [(math.log10(s["non_embedding_params"]), s["summary"][name].get("steps_ratio"), s["seed_ratios"][name])
               for s in sizes.values() if name in s["summary"]]
        usable = [(x, y, per) for x, y, per in pts if y]
        row = {"sizes_used": len(usable), "sizes_not_reached": len(pts) - len(usable)}
        if len(usable) >= 2:
            a, b, se = fit([p[0] for p in usable], [p[1] for p in usable])
            slopes = [fit([p[0] for p in usable], list(choice))[1]
                      for choice in itertools.product(*[[r for r in p[2] if r] or [p[1]] for p in usable])]
            row.update(intercept=a, slope=b, slope_se=se, slope_min=min(slopes), slope_max=max(slopes),
                       seed_choices=len(slopes))
        out[name] = row
    return out


def tables(doc: dict) -> str:
    sizes = doc["sizes"]
    lines = [f"{doc['tokens_per_param']:g} tokens per non-embedding parameter, {BATCH} x {SEQ} tokens a step, "
             f"{doc['seeds']} seeds at each best lr; ratio: steps to AdamW's mean final loss over AdamW's steps "
             "(mean curve; per seed in brackets)", "",
             "| size | non-emb. params | steps (tokens) | " + " | ".join(OPTIMIZERS) + " |",
             "|---|--:|--:|" + "--:|" * len(OPTIMIZERS)]
    for key, s in sizes.items():
        cells = []
        for name in OPTIMIZERS:
            row = s["summary"].get(name)
            if not row:
                cells.append("—")
            elif name == "adamw":
                cells.append(f"{row['mean']:.4f} (lr {row['best_lr']:g}{', edge' if row['edge'] else ''})")
            else:
                per = ", ".join(f"{r:.2f}" if r else "n/r" for r in s["seed_ratios"][name])
                cells.append(f"{study.ratio(row.get('steps_ratio'))} [{per}] (lr {row['best_lr']:g}"
                             f"{', edge' if row['edge'] else ''})")
        lines.append(f"| {key} | {s['non_embedding_params'] / 1e6:.3f}M | {s['steps']:,} "
                     f"({s['steps'] * BATCH * SEQ / 1e6:.2f}M) | " + " | ".join(cells) + " |")
    lines += ["", "AdamW's column: its mean final validation loss (nats/byte) and best lr.", "",
              "Trend: ratio = a + b log10(non-embedding parameters), least squares over the sizes; b per decade "
              f"(positive: the advantage shrinks with size). Published (matrix optimizers, {PUBLISHED['source']}): "
              f"b = {published_slope():+.2f} per decade (speed-up 1.4x at 0.1B to 1.1x at 1.2B).", "",
              "| optimizer | b per decade ± s.e. | b over seed choices | ratio at smallest → largest (fitted) | "
              "sizes fitted |", "|---|--:|--:|--:|--:|"]
    lo, hi = (math.log10(min(s["non_embedding_params"] for s in sizes.values())),
              math.log10(max(s["non_embedding_params"] for s in sizes.values())))
    for name, t in doc["trends"].items():
        if "slope" not in t:
            lines.append(f"| {name} | — | — | — | {t['sizes_used']} (needs 2) |")
            continue
        se = f" ± {t['slope_se']:.3f}" if math.isfinite(t["slope_se"]) else ""
        not_reached = f" ({t['sizes_not_reached']} not reached)" if t["sizes_not_reached"] else ""
        lines.append(f"| {name} | {t['slope']:+.3f}{se} | {t['slope_min']:+.3f} to {t['slope_max']:+.3f} "
                     f"({t['seed_choices']}) | {t['intercept'] + t['slope'] * lo:.2f} → "
                     f"{t['intercept'] + t['slope'] * hi:.2f} | {t['sizes_used']}"
                     f"{not_reached} |")
    minutes = {k: s["study_minutes"] for k, s in sizes.items()}
    lines += ["", f"Compute: {sum(minutes.values()):.0f} min in all (" +
              ", ".join(f"{k} {m:.0f}" for k, m in minutes.items()) + ")."]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> str:
    plt = results_io.pyplot()
    if plt is None:
        return results_io.NO_PNG
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs_all = [s["non_embedding_params"] for s in doc["sizes"].values()]
    for name in OPTIMIZERS[1:]:
        pts = [(s["non_embedding_params"], s["summary"][name].get("steps_ratio"), s["seed_ratios"][name])
               for s in doc["sizes"].values() if name in s["summary"]]
        line = ax.plot([p[0] for p in pts if p[1]], [p[1] for p in pts if p[1]], "o", label=name)[0]
        for x, _, per in pts:
            ax.plot([x] * len([r for r in per if r]), [r for r in per if r], "_", color=line.get_color(), ms=10)
        t = doc["trends"][name]
        if "slope" in t:
            xs = [min(xs_all), max(xs_all)]
            ax.plot(xs, [t["intercept"] + t["slope"] * math.log10(x) for x in xs], "-", color=line.get_color(), lw=1)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlim(min(xs_all) / 1.5, max(xs_all) * 1.5)
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("steps to AdamW's final loss / AdamW's steps")
    ax.set_title(f"{doc['tokens_per_param']:g} tokens per parameter; published trend: {published_slope():+.2f}/decade")
    ax.grid(alpha=0.3)
    ax.legend()
    return results_io.save_figure(plt, fig, path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, from {tuple(SIZES)}")
    ap.add_argument("--tokens-per-param", type=float, default=1.0, help="training tokens per non-embedding parameter")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--lrs-per-opt", type=int, default=3, help="lrs per grid: 3 is {best/2, best, best*2}")
    ap.add_argument("--base", default=str(ROOT / "bench" / "results" / "optimizers.json"),
                    help="the study whose best lrs centre the grids")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "optimizer-scaling"), help="each size's study (kept)")
    ap.add_argument("--plan", action="store_true", help="print the sizes, parameters, steps and tokens; run nothing")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    names = [n for n in args.sizes.split(",") if n]
    if bad := [n for n in names if n not in SIZES]:
        sys.exit(f"error: unknown size(s) {bad}; choose from {tuple(SIZES)}")
    if args.tokens_per_param <= 0 or args.seeds < 1 or args.lrs_per_opt < 1:
        sys.exit("error: --tokens-per-param must be > 0, --seeds and --lrs-per-opt >= 1")
    for name in names:
        print(f"{name}: d_model {SIZES[name][0]}, {SIZES[name][1]} layers, {non_embedding_params(name) / 1e6:.3f}M "
              f"non-embedding parameters, {steps_for(name, args.tokens_per_param):,} steps "
              f"({steps_for(name, args.tokens_per_param) * BATCH * SEQ / 1e6:.2f}M tokens)", flush=True)
    if args.plan:
        return 0
    doc = results_io.start("optimizer_scaling")
    sizes, centres = {}, {}
    for name in names:
        out, runs = Path(args.out) / "optimizer_scaling" / name, Path(args.runs) / name   # results kept, runs not
        steps = steps_for(name, args.tokens_per_param)
        lrs = centres[name] = base_lrs(Path(args.base), steps)
        if not (out / "optimizers.json").is_file():
            kept, partial = out / "optimizers.partial.json", runs / "optimizers.partial.json"
            if kept.is_file() and not partial.is_file():     # a size cut short in another checkout (committed)
                runs.mkdir(parents=True, exist_ok=True)
                shutil.copy(kept, partial)
            grid = [f"--lrs={o}={','.join(f'{lrs[o] * k:.3g}' for k in study.pick_lrs((0.5, 1, 2), args.lrs_per_opt))}"
                    for o in OPTIMIZERS]
            code = study.main(["--resume", "--adam-lr=adamw", f"--horizons={steps}",
                               f"--optimizers={','.join(OPTIMIZERS)}", f"--seeds={args.seeds}",
                               *grid, f"--runs={runs}", f"--out={out}", *size_overrides(name)])
            if code and not (out / "optimizers.json").is_file():
                sys.exit(f"error: the study of size {name} failed (exit {code}); its logs are in {runs}")
        size_doc = json.loads((out / "optimizers.json").read_text())
        sizes[name] = {"non_embedding_params": non_embedding_params(name), "steps": steps,
                       "shape": dict(zip(("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"), SIZES[name])),
                       "summary": size_doc["summary"][str(steps)], "seed_ratios": seed_ratios(size_doc),
                       "study_minutes": size_doc["study_minutes"], "study_meta": size_doc["meta"]}
    doc.update(tokens_per_param=args.tokens_per_param, seeds=args.seeds, grid_centres=centres, sizes=sizes,
               trends=trends(sizes), published=dict(PUBLISHED, slope=published_slope()))
    results_io.write(doc, tables(doc), args.out)
    print(plot(doc, Path(args.out) / "optimizer_scaling.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
