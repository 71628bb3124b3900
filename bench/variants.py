"""Optimizer variants against AdamW, one change at a time: the Shampoo ablation, and Muon's variants.

    python bench/variants.py --name variants_shampoo_ablation           # the Shampoo ablation + AdamW (~29 min)
    python bench/variants.py --variants muon,muon_polar_express,normuon --adamw-loss 2.1666 --name variants_muon_100
    python bench/variants.py --size small --steps 300 --variants muon,muon_polar_express,normuon --muon-lrs 0.04 \\
        --eval-batches 20 --seeds 0,1 --adamw-loss 1.8984 --name variants_muon_300        # (~25 min)
    python bench/variants.py --steps 280 --variants adamw,first_moment_start_1 --adamw-lrs 1e-3,2e-3 \\
        --lrs 7.5e-4,1.5e-3,3e-3 --name variants_default_budget                            # (~40 min)
    python bench/variants.py --variants adamw,base --steps 10 --out /tmp/smoke             # smoke test

Every run is bench/optimizers.py's (`train.train` in this process, the default model and corpus, warmup +
cosine, weight decay 0.1, clipping 1.0; eager unless --compile; the AdamW part of Shampoo's runs at 2e-3).
"base" is the study's Shampoo (STUDY_SHAMPOO, the optim defaults before this ablation): factors G G^T per
side, EMA beta 0.95, inverse roots -1/4 by eigh (eigenvalues floored at 1e-6 x the largest, + eps 1e-12)
every 10 steps from step 10, this step's gradient preconditioned, each block grafted to Adam's norm (b1 0.9,
b2 0.95), momentum 0.9 on the grafted direction. Each other variant changes one thing (VARIANTS), except the
combinations of the changes that helped. All at one lr (--lrs: each variant at each lr), against AdamW at
its tuned 2e-3, at equal steps. Muon's variants (optim.ns_coefficients, optim.normuon_beta2) run at their own
lr (MUON_LR, the study's best at 100 steps; --muon-lrs). Every run at every seed of --seeds.

The reference is AdamW's final loss: the best AdamW lr's (mean over seeds) when adamw runs here, else
--adamw-loss (the same setup's AdamW from another set or the study). One table per set: per variant and lr,
the final validation loss (mean ± half-range over seeds), its difference to AdamW's, and the step where the
(mean) eval curve first reaches AdamW's final loss. Results: <out>/<name>.json (every run's curves) and .md;
--render JSON writes the .md again. Run folders, logs and the JSON so far go to --runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))          # bench/optimizers.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # nanomega, train.py and configs/

import torch  # noqa: E402

import optimizers as study  # noqa: E402
import results_io  # noqa: E402
from nanomega.run import preflight  # noqa: E402
from nanomega.config import to_dict  # noqa: E402
from nanomega.optim import REGISTRY, per_expert, register, setting  # noqa: E402
from nanomega.optim.registry import stored_dtype  # noqa: E402
from nanomega.optim.shampoo import ShampooSettings, scale_by_shampoo  # noqa: E402


@dataclass(frozen=True)
class AblationSettings(ShampooSettings):
    """Shampoo's settings and three choices the ablation settled, which are scale_by_shampoo's arguments and
    no run's flags (optim's Shampoo is the ablation's winner: first_moment, Adam's graft, roots -1/4)."""
    shampoo_precondition: str = setting("first_moment", choices=("gradient", "first_moment"))
    shampoo_graft: str = setting("adam", choices=("adam", "none"))
    shampoo_inv_root: int = setting(0, "[0, inf)", "0 = twice the parameter's rank")


def ablation_directions(s: AblationSettings, state_dtype, parts) -> dict:
    direction = scale_by_shampoo(s.beta1, s.beta2, s.eps, s.shampoo_momentum, s.shampoo_beta, s.shampoo_eps,
                                 s.precondition_frequency, s.start_preconditioning_step, s.shampoo_block_size,
                                 state_dtype=state_dtype, inv_root=s.shampoo_inv_root,
                                 precondition=s.shampoo_precondition, graft=s.shampoo_graft,
                                 factor_dtype=stored_dtype(s.factor_dtype), root_dtype=stored_dtype(s.basis_dtype))
    return {"shampoo": per_expert(direction, parts.first_expert)}


# Registered in this process only (the study trains in-process): the same state names as Shampoo's
SHAMPOO = "shampoo_ablation"
register(dataclasses.replace(REGISTRY["shampoo"], name=SHAMPOO, settings=AblationSettings,
                             directions=ablation_directions))

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
SHAMPOO_VARIANTS = [v for v, (_, f) in VARIANTS.items() if f.get("name", SHAMPOO) == SHAMPOO]
LR_SCALE = {"graft_none": 10.0}
MUON_LR = 0.04


def summarize(doc: dict) -> tuple[dict, list[dict]]:
    """The target (AdamW's final loss: the best AdamW lr's mean over seeds here, else --adamw-loss's) and one
    row per (variant, lr): the seeds' finals, their mean and half-range, and where their mean curve first
    reaches the target."""
    groups = {}
    for r in doc["runs"]:
        groups.setdefault((r["variant"], r["lr"]), []).append(r)
    rows = []
    for (variant, lr), runs in groups.items():
        finals = [r["final_val_loss"] for r in runs]
        ok = [r for r in runs if math.isfinite(r["final_val_loss"])]
        rows.append({"variant": variant, "what": runs[0]["what"], "lr": lr, "seeds": [r.get("seed") for r in runs],
                     "finals": finals, "mean": statistics.fmean(finals) if len(ok) == len(runs) else float("inf"),
                     "half_range": (max(finals) - min(finals)) / 2, "curve": study.mean_curve(ok) if ok else None})
    adamw = [r for r in rows if r["variant"] == "adamw"]
    if adamw:
        best = min(adamw, key=lambda r: r["mean"])
        target = {"loss": best["mean"], "source": f"AdamW at lr {best['lr']:g}, this set"}
    else:
        target = doc.get("target")
    for r in rows:
        c = r["curve"]
        r["steps_to_target"] = (study.steps_to_reach(c["eval_steps"], c["val_loss"], target["loss"])
                                if target and c else None)
    return target, rows


def tables(doc: dict) -> str:
    target, rows = summarize(doc)
    seeds = max(len(r["finals"]) for r in rows)
    loss_head = "final val loss" + (" (mean ± half-range)" if seeds > 1 else "")
    ref = f" ({target['loss']:.4f})" if target else ""
    out = []
    for r in rows:
        loss = f"{r['mean']:.4f}" + (f" ± {r['half_range']:.4f}" if len(r["finals"]) > 1 else "")
        diff = f"{r['mean'] - target['loss']:+.4f}" if target and math.isfinite(r["mean"]) else "—"
        reach = r["steps_to_target"]
        out.append([r["variant"], r["what"], f"{r['lr']:g}", loss if math.isfinite(r["mean"]) else "failed", diff,
                    f"{reach:.0f} ({reach / doc['steps']:.2f}x)" if reach is not None else "—"])
    size = "the study's small model (bench/optimizers.py)" if doc.get("size") == "small" else "configs/default.py"
    seed_list = ", ".join(str(x) for x in doc["seeds"])
    head = (f"{doc['steps']} steps, {size}, {doc['tokens_per_step']:,} tokens/step, eager, "
            f"seed{'s' if len(doc['seeds']) > 1 else ''} {seed_list}, {doc['eval_batches']} evaluation batches.")
    notes = ("Final val loss in nats/byte" + (", the mean over seeds ± half their range" if seeds > 1 else "")
             + "; steps to AdamW's final loss: where the (mean) eval curve first reaches it, linear between "
             "evaluations, and as a share of the steps. "
             + (f"AdamW's final loss: {target['loss']:.4f}, {target['source']}." if target else ""))
    return "\n\n".join([head, results_io.table(
        ["variant", "what changes", "lr", loss_head, f"vs AdamW{ref}", "steps to AdamW's final loss"], "llrrrr", out),
        notes])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--variants", default=",".join(["adamw", *SHAMPOO_VARIANTS]),
                    help=f"comma-separated, from {list(VARIANTS)} (default: adamw and Shampoo's)")
    ap.add_argument("--lrs", default="1e-3", help="Shampoo lrs (each variant at each); AdamW runs at each too "
                                                 "when --adamw-lrs is given, else at 2e-3")
    ap.add_argument("--adamw-lrs", default="", help="AdamW's lrs (default: 2e-3 only)")
    ap.add_argument("--muon-lrs", default="", help=f"Muon variants' lrs (default: {MUON_LR} only)")
    ap.add_argument("--adamw-loss", type=float, default=None,
                    help="AdamW's final loss to compare with when adamw is not among the variants (e.g. the "
                         "study's mean at this horizon, bench/results/optimizers.json)")
    ap.add_argument("--eval-batches", type=int, default=study.DEFAULT_EVAL_BATCHES)
    ap.add_argument("--seeds", default="0", help="comma-separated; every run at each seed")
    ap.add_argument("--size", choices=("default", "small"), default="default",
                    help="small: bench/optimizers.py's study model (half width, 8 x 128 tokens)")
    ap.add_argument("--compile", action="store_true", help="compile each run's step (default eager: on 2 cores a "
                                                           "run's update compiles for ~100 s, longer than 100 steps)")
    ap.add_argument("--name", default="variants", help="the results set: <out>/<name>.json and .md")
    ap.add_argument("--runs", default="runs/bench-variants", help="each run's folder and log, and the JSON so far")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    names = [v for v in args.variants.split(",") if v]
    if bad := [v for v in names if v not in VARIANTS]:
        sys.exit(f"error: unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    lrs = [float(x) for x in args.lrs.split(",") if x]
    adamw_lrs = [float(x) for x in args.adamw_lrs.split(",") if x] or [study.ADAM_LR]
    muon_lrs = [float(x) for x in args.muon_lrs.split(",") if x] or [MUON_LR]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    args.eval_every = max(5, args.steps // 10)
    args.log_every = max(1, args.eval_every // 2)
    args.no_compile = not args.compile
    base = study.size_config(args.size)
    t = base.train
    doc = results_io.start(args.name)
    doc.update(steps=args.steps, size=args.size, seeds=seeds, eval_batches=args.eval_batches,
               tokens_per_step=t.batch_size * t.grad_accum * t.seq_len, runs=[])
    if args.adamw_loss is not None:
        doc["target"] = {"loss": args.adamw_loss, "source": "given (--adamw-loss)"}
    out = Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), 64))
            break
    splits = preflight.load_data(base)
    print(f"Optimizer variants: {args.steps} steps x {t.batch_size} x {t.seq_len} tokens, seeds {seeds}, variants "
          f"{names}, lrs {lrs}", flush=True)
    if args.compile:
        study.warm_up_loss(base, splits)

    def lrs_of(v):
        kind = VARIANTS[v][1].get("name", SHAMPOO)
        return adamw_lrs if kind == "adamw" else muon_lrs if kind == "muon" else [x * LR_SCALE.get(v, 1.0) for x in lrs]
    plan = [(v, lr, seed) for seed in seeds for v in names for lr in lrs_of(v)]
    for i, (variant, lr, seed) in enumerate(plan, 1):
        what, fields = VARIANTS[variant]
        name = fields.get("name", SHAMPOO)
        tag = f"{variant}-lr{lr:g}-seed{seed}"
        cfg = study.run_config(base, name, lr, args, out / tag, seed)
        start_from = STUDY_SHAMPOO if name == SHAMPOO else {}
        changes = {**start_from, **{k: v for k, v in fields.items() if k != "name"}}
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **changes))
        result = {"variant": variant, "what": what, "lr": lr, "seed": seed,
                  **study.one_run(cfg, splits, out / f"{tag}.log"), "optim": to_dict(cfg.optim)}
        doc["runs"].append(result)
        print(f"[{i}/{len(plan)}] {variant} lr {lr:g} seed {seed}: "
              + (f"val {result['final_val_loss']:.4f}" if not result["error"] else f"FAILED ({result['error']})")
              + f", {result['run_seconds']:.0f} s", flush=True)
        (out / f"{args.name}.partial.json").write_text(json.dumps(doc, indent=1))
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
