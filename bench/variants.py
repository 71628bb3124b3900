"""Optimizer variants against AdamW, one change at a time: the Shampoo ablation, and Muon's variants.

    python bench/variants.py                                    # the Shampoo ablation + AdamW, 100 steps (~25 min)
    python bench/variants.py --variants adamw,muon,muon_polar_express,normuon      # Muon's variants
    python bench/variants.py --steps 280 --variants adamw,first_moment --lrs 1e-3,2e-3,4e-3 --adamw-lrs 1e-3,2e-3,4e-3
    python bench/variants.py --variants base,inv_root_2 --steps 10                  # smoke test

Every run is bench/optimizers.py's (`train.train` in this process, the default model and corpus, warmup +
cosine, weight decay 0.1, clipping 1.0; eager unless --compile; the AdamW part of Shampoo's runs at 2e-3). "base" is the study's Shampoo (STUDY_SHAMPOO, the optim defaults before this ablation): factors G G^T per side, EMA beta 0.95, inverse roots
-1/4 by eigh (eigenvalues floored at 1e-6 x the largest, + eps 1e-12) every 10 steps from step 10, this
step's gradient preconditioned, each block grafted to Adam's norm (b1 0.9, b2 0.95), momentum 0.9 on the
grafted direction. Each other variant changes one thing (VARIANTS), except the last two, which combine the
changes that helped. All at one lr (--lrs: each variant at each lr), against AdamW at its tuned 2e-3, at
equal steps. Muon's variants (optim.ns_coefficients, optim.normuon_beta2) run at their own lr (MUON_LR,
the study's best at 100 steps; --muon-lrs). Prints one table (final validation loss, the difference to
AdamW's, steps to reach AdamW's final loss), and writes variants.json into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench/optimizers.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # nanomega, train.py and configs/

import torch  # noqa: E402

import optimizers as study  # noqa: E402
import train as train_script  # noqa: E402
from nanomega.config import parse_args, to_dict  # noqa: E402

# The study's Shampoo, which the ablation starts from (the optim defaults until the ablation changed them)
STUDY_SHAMPOO = {"shampoo_precondition": "gradient", "shampoo_momentum": 0.9, "start_preconditioning_step": 10}
FIRST_MOMENT = {"shampoo_precondition": "first_moment", "shampoo_momentum": 0.0}
VARIANTS = {   # name: (what changes, OptimConfig fields on top of the study's shampoo)
    "adamw": ("AdamW (the reference)", {"name": "adamw"}),
    "base": ("the study's Shampoo", {}),
    "inv_root_2": ("roots -1/2 per side instead of -1/4", {"shampoo_inv_root": 2}),
    "eps_1e-6": ("eps 1e-6 added to the factors' eigenvalues (was 1e-12)", {"shampoo_eps": 1e-6}),
    "graft_none": ("no grafting: P as it is (lr x 10: P is ~orthogonal, like Muon's)", {"shampoo_graft": "none"}),
    "start_1": ("preconditioning from step 1 (was 10)", {"start_preconditioning_step": 1}),
    "freq_1": ("roots refreshed every step (was every 10)", {"precondition_frequency": 1}),
    "sum": ("factors summed, AdaGrad-style (EMA 0.95 before)", {"shampoo_beta": 1.0}),
    "momentum_0": ("no momentum after the graft (configs/default_shampoo.py)", {"shampoo_momentum": 0.0}),
    "first_moment": ("precondition Adam's first moment, no momentum after (Distributed Shampoo's order)",
                     FIRST_MOMENT),
    "first_moment_inv_root_2": ("first_moment + roots -1/2", {**FIRST_MOMENT, "shampoo_inv_root": 2}),
    "modded_nanogpt": ("first_moment + b1 0.95 (modded-nanogpt's DistributedShampoo betas)",
                       {**FIRST_MOMENT, "beta1": 0.95}),
    "first_moment_start_1": ("first_moment + preconditioning from step 1",
                             {**FIRST_MOMENT, "start_preconditioning_step": 1}),
    "muon": ("Muon (momentum 0.95, Keller Jordan's Newton-Schulz)", {"name": "muon", "muon_momentum": 0.95}),
    "muon_polar_express": ("Muon with Polar Express's per-step coefficients",
                           {"name": "muon", "muon_momentum": 0.95, "ns_coefficients": "polar_express"}),
    "normuon": ("NorMuon: Muon + per-neuron second moment (beta2 0.95)",
                {"name": "muon", "muon_momentum": 0.95, "normuon_beta2": 0.95}),
}
SHAMPOO_VARIANTS = [v for v, (_, f) in VARIANTS.items() if f.get("name", "shampoo") == "shampoo"]
LR_SCALE = {"graft_none": 10.0}
MUON_LR = 0.04


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variants", default=",".join(["adamw", *SHAMPOO_VARIANTS]),
                    help=f"comma-separated, from {list(VARIANTS)} (default: adamw and Shampoo's)")
    ap.add_argument("--lrs", default="1e-3", help="Shampoo lrs (each variant at each); AdamW runs at each too "
                                                 "when --adamw-lrs is given, else at 2e-3")
    ap.add_argument("--adamw-lrs", default="", help="AdamW's lrs (default: 2e-3 only)")
    ap.add_argument("--muon-lrs", default="", help=f"Muon variants' lrs (default: {MUON_LR} only)")
    ap.add_argument("--eval-batches", type=int, default=study.DEFAULT_EVAL_BATCHES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=("default", "small"), default="default",
                    help="small: bench/optimizers.py's study model (half width, 8 x 128 tokens)")
    ap.add_argument("--compile", action="store_true", help="compile each run's step (default eager: on 2 cores a "
                                                           "run's update compiles for ~100 s, longer than 100 steps)")
    ap.add_argument("--out", default="runs/bench-variants")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if bad := [v for v in names if v not in VARIANTS]:
        sys.exit(f"error: unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    lrs = [float(x) for x in args.lrs.split(",") if x]
    adamw_lrs = [float(x) for x in args.adamw_lrs.split(",") if x] or [study.ADAM_LR]
    muon_lrs = [float(x) for x in args.muon_lrs.split(",") if x] or [MUON_LR]
    args.eval_every = max(5, args.steps // 10)
    args.log_every = max(1, args.eval_every // 2)
    args.no_compile = not args.compile
    base = parse_args(["--config=default", *(study.SMALL if args.size == "small" else []), f"--train.seed={args.seed}"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
            break
    splits = train_script.load_data(base)
    print(f"Optimizer variants: {args.steps} steps x {base.train.batch_size} x {base.train.seq_len} tokens, seed "
          f"{args.seed}, variants {names}, lrs {lrs}", flush=True)
    if args.compile:
        study.warm_up_loss(base, splits)
    runs, start = [], time.perf_counter()
    def lrs_of(v):
        kind = VARIANTS[v][1].get("name", "shampoo")
        return adamw_lrs if kind == "adamw" else muon_lrs if kind == "muon" else [x * LR_SCALE.get(v, 1.0) for x in lrs]
    plan = [(v, lr) for v in names for lr in lrs_of(v)]
    for i, (variant, lr) in enumerate(plan, 1):
        what, fields = VARIANTS[variant]
        name = fields.get("name", "shampoo")
        cfg = study.run_config(base, name, lr, args, out / f"{variant}-lr{lr:g}")
        start_from = STUDY_SHAMPOO if name == "shampoo" else {}
        changes = {**start_from, **{k: v for k, v in fields.items() if k != "name"}}
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **changes))
        result = {"variant": variant, "what": what, "lr": lr, **study.one_run(cfg, splits, out / f"{variant}-lr{lr:g}.log"),
                  "optim": to_dict(cfg.optim)}
        runs.append(result)
        print(f"[{i}/{len(plan)}] {variant} lr {lr:g}: "
              + (f"val {result['final_val_loss']:.4f}" if not result["error"] else f"FAILED ({result['error']})")
              + f", {result['run_seconds']:.0f} s", flush=True)
        (out / "variants.json").write_text(json.dumps({"steps": args.steps, "seed": args.seed, "runs": runs},
                                                              indent=1))
    adamw = [r for r in runs if r["variant"] == "adamw"]
    target = min((r["final_val_loss"] for r in adamw), default=None)
    print(f"\n| variant | what changes | lr | final val loss | vs AdamW {'' if target is None else f'({target:.4f})'} "
          "| steps to AdamW's final loss |")
    print("|---|---|--:|--:|--:|--:|")
    for r in runs:
        loss = r["final_val_loss"]
        reach = study.steps_to_reach(r["eval_steps"], r["val_loss"], target) if target is not None else None
        diff = f"{loss - target:+.4f}" if target is not None and math.isfinite(loss) else "—"
        print(f"| {r['variant']} | {r['what']} | {r['lr']:g} | {loss:.4f} | {diff} | "
              f"{f'{reach:.0f}' if reach is not None else '—'} |")
    print(f"\n{len(runs)} runs in {(time.perf_counter() - start) / 60:.1f} min; wrote {out / 'variants.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
