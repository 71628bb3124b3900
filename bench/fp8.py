"""FP8 convergence: the default model trained in bf16 and with each float8 recipe, same steps, side by side.

    python bench/fp8.py                                   # the default budget (280 steps), ~30 min on 2 cores
    python bench/fp8.py --steps 20 --recipes rowwise --out /tmp/smoke     # smoke test

Every run is `train.train(cfg, quiet=True)` in this process on the built-in corpus with configs/default.py
(3.3M parameters, 280 steps of 16 x 256 tokens, compile on), `--train.dtype=bfloat16` (autocast) for all of
them; the fp8 runs add `--model.fp8=<recipe>`: the blocks' linear layers in float8 (nanomega/models/fp8.py),
the embedding, head, norms and attention in bf16. The table gives the final validation loss, its ratio to
bf16's (the goal: within 1.5%), and tokens/s (median over log windows, compilation excluded).

On this CPU float8 is emulated, not fast: torch._scaled_mm upcasts and multiplies in fp32, and every
quantization is extra work, so fp8 runs *slower* than bf16 here; its speed needs an fp8 GPU (bench/gpu.sh).

Output, in --out (bench/results/): fp8.json (every run's curves), fp8.md (the table) and fp8.png (validation
and training loss against steps); --render JSON writes the .md again. Run folders and logs go to --runs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import results_io  # noqa: E402
from optimizers import one_run, summarize   # noqa: E402  (the study's runner: one train.train run, its metrics)

from nanomega.config import named_config, parse_args   # noqa: E402
from nanomega.data.sources import load_splits   # noqa: E402
from nanomega.run.metrics import read_metrics   # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")


def plot(runs: dict, path: Path) -> str:
    plt = results_io.pyplot()
    if plt is None:
        return results_io.NO_PNG
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run in runs.items():
        a.plot(run["eval_steps"], run["val_loss"], marker="o", ms=3, label=name)
        steps, losses = zip(*run["train_loss"]) if run["train_loss"] else ((), ())
        b.plot(steps, losses, lw=1, label=name)
    a.set_ylabel("validation loss (nats/byte)")
    b.set_ylabel("training loss (nats/byte)")
    for ax in (a, b):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Default model, bf16 autocast vs float8 recipes, built-in corpus")
    return results_io.save_figure(plt, fig, path)


def tables(doc: dict) -> str:
    runs, tokens_per_step = doc["runs"], doc["tokens_per_step"]
    ref, ref_s = runs["bf16"]["final_val_loss"], runs["bf16"]["s_per_step"]
    rows = []
    for name, run in runs.items():
        loss, ratio = run["final_val_loss"], run["final_val_loss"] / ref - 1
        rows.append([name, f"{loss:.4f}", f"{ratio:+.2%}", "yes" if abs(ratio) <= 0.015 else "no",
                     f"{tokens_per_step / run['s_per_step']:,.0f}", f"{ref_s / run['s_per_step']:.2f}x"])
    return (f"{doc['steps']} steps of configs/default.py ({tokens_per_step:,} tokens/step), bf16 autocast, compiled; "
            "fp8: the blocks' linear layers in float8"
            + (f"; overrides {' '.join(doc['overrides'])}" if doc["overrides"] else "") + "\n\n"
            + results_io.table(["run", "final val loss", "vs bf16", "within 1.5%", "tokens/s", "vs bf16"], "lrrlrr",
                               rows)
            + "\n\ntokens/s: median over log windows, compilation excluded. On a CPU float8 is emulated "
              "(torch._scaled_mm upcasts): these tokens/s are not float8's speed.")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=0, help="train.steps (0: the default config's)")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--runs", default=str(ROOT / "runs" / "bench_fp8"), help="each run's folder and log")
    ap.add_argument("--reuse", action="store_true", help="summarize runs already finished in --runs, not rerun them")
    results_io.add_arguments(ap)
    args, overrides = ap.parse_known_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("fp8")
    base = named_config("default")
    steps = args.steps or base.train.steps
    common = ["--config=default", "--train.dtype=bfloat16", f"--train.steps={steps}", "--train.sample_tokens=0",
              f"--train.eval_every={max(1, steps // 8)}", "--train.log_every=10", "--train.ckpt_every=100000"]
    splits = load_splits(parse_args(common).data)
    out = Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in ["bf16"] + args.recipes.split(","):
        fp8 = [] if name == "bf16" else [f"--model.fp8={name}"]
        cfg = parse_args(common + fp8 + [f"--train.out_dir={out / name}"] + overrides)
        records = read_metrics(out / name / "metrics.jsonl") if (out / name / "metrics.jsonl").is_file() else []
        if args.reuse and records and records[-1]["step"] == steps and "val_loss" in records[-1]:
            t = cfg.train
            runs[name] = {**summarize(records, t.batch_size * t.grad_accum * t.seq_len), "error": None,
                          "final_val_loss": records[-1]["val_loss"], "train_loss": [(r["step"], r["loss"]) for r in records]}
        else:
            runs[name] = one_run(cfg, splits, out / f"{name}.log")
        print(f"{name}: final validation loss {runs[name]['final_val_loss']:.4f}"
              + (f" ({runs[name]['error']})" if runs[name]["error"] else ""), flush=True)
    t = parse_args(common + overrides).train
    doc.update(steps=steps, overrides=overrides, tokens_per_step=t.batch_size * t.grad_accum * t.seq_len, runs=runs)
    results_io.write(doc, tables(doc), args.out)
    print(plot(runs, Path(args.out) / "fp8.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
