"""Mixture of experts on the CPU: how fast each dispatch runs one layer, and what MoE buys at equal tokens.

    python bench/moe.py --part all                      # both parts (the README's figures)
    python bench/moe.py --part dispatch --reps 5        # part 1 only (updates "dispatch" in the JSON)
    python bench/moe.py --part quality --steps 40 --out /tmp/smoke     # part 2, shortened (a smoke test)

Part 1, dispatch: forward + backward of one MoE layer's routed experts (moe.routed_moe: router, top-k,
sort by expert, the experts, weighted scatter back; backward into the input, the router and the experts,
from a fixed random output gradient), eager, on random inputs (N(0, 1)) and weights (N(0, 0.02)), in fp32
and under bf16 autocast (parameters fp32, as train.dtype=bfloat16). Variants:
    grouped_mm    dropless, expert_kernel="grouped_mm": one torch._grouped_mm per projection
    loop          dropless, one matmul per expert and projection: expert_kernel="auto" where the grouped GEMM
                  does not run (a GPU before Hopper), made here by hiding it (moe.grouped_mm_available)
    padded-cf1.25 capacity_factor=1.25, pad_to_capacity=True: every expert gets exactly C rows per
                  sequence, three batched matmuls over [E, B*C, d] (drop_policy "probs")
    padded-cf1.0  the same at capacity_factor=1.0
    dense         a dense SwiGLU MLP of ffn = top_k * expert_ffn_dim: the same active matmul FLOPs,
                  no router, no dispatch (the ceiling a dispatch can hope for)
Shapes: "small" is part 2's layer (d 256, 8 experts top-2, expert ffn 384, 16 x 256 tokens), "large" a
bigger CPU layer (d 512, 8 experts top-2, expert ffn 512, 16 x 512 = 8192 tokens). Each variant's first
iteration (which also gives its output and dropped fraction) is untimed, then --warmup untimed and --reps timed
rounds; a round times one iteration of every (variant, dtype) in turn (A B C A B C),
so a busy machine slows all alike, and each reports its median. Columns:
    tokens/s      B*T over the median iteration (forward + backward)
    ms            the median iteration
    GFLOP/s       useful active FLOPs per second: 6 * 3 * d * ffn * top_k per token (padding and dropped
                  assignments are not counted: a padded variant does more arithmetic than this)
    vs grouped    tokens/s over grouped_mm's in the same shape and dtype
    dropped       assignments (token, choice) dropped over capacity / all assignments, in the first round
    max|Δ|        loop only: max |output of loop - output of grouped_mm| on the same inputs (a sanity
                  check: ~1e-6 in fp32; bf16 rounds differently)
A variant that raises is shown as failed; a padded variant that fails with drop_policy "probs" is retried
with "position" (marked). torch.set_num_threads is set to the cores this process may use.

Part 2, quality at equal tokens: train.train(cfg, quiet=True) on the built-in corpus, fp32, the default
config's optimizer (AdamW lr 2e-3, warmup 50 of 280 steps then cosine, weight decay 0.1, clipping 1.0),
seed 0, --steps steps of 16 x 256 tokens (default 280, warmup scaled to steps * 50/280), compile as --compile
(default on: the default training path), 4 evaluations of 20 batches. Two models with the same attention (d 256, 4 layers, 8 heads / 4 kv heads):
    dense  configs/default.py: SwiGLU ffn 768
    moe    configs/tiny_mixtral.py: every layer 8 experts top-2 of expert ffn 384 (dropless, grouped_mm), softmax router, aux loss
           1e-2 (micro-batch), z-loss 1e-3: the same active parameters and FLOPs per token as dense, plus
           a 2048-parameter router per layer
Columns: params (all; without the padded vocabulary rows), active params (per token: top_k of n_experts
experts), validation cross-entropy (nats/byte) at each evaluation, tokens/s (median over log windows but the
first, which holds the compilation; evaluation excluded), first window's s (compilation + 10 steps), wall
s (the whole train.train call: compilation, evaluations and checkpoints included) and the final step's
expert_load_cv per layer (std / mean of the assignments each expert got in that step; 0 = perfectly even).

Results: <out>/moe.json (a part that runs replaces its own key only; a part kept from an earlier run keeps
that run's date and command) and <out>/moe.md (the tables; --render JSON writes it again). Each training
run writes into a fresh folder under /tmp (its metrics.jsonl and log stay there).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega, train.py and configs/ of this checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nanomega.config import ModelConfig, named_config, to_dict  # noqa: E402
from nanomega.run.metrics import read_metrics  # noqa: E402
from nanomega.sim.counting import count_params  # noqa: E402
from nanomega.models import moe  # noqa: E402

import results_io  # noqa: E402

SHAPES = {   # name -> (d_model, n_experts, top_k, expert_ffn_dim, batch, seq)
    "small": (256, 8, 2, 384, 16, 256),
    "large": (512, 8, 2, 512, 16, 512),
}
VARIANTS = {  # name -> ModelConfig fields (None: the dense reference)
    "grouped_mm": {"expert_kernel": "grouped_mm"},
    "loop": {"expert_kernel": "auto"},      # with the grouped GEMM hidden (make_forward)
    "padded-cf1.25": {"capacity_factor": 1.25, "pad_to_capacity": True},
    "padded-cf1.0": {"capacity_factor": 1.0, "pad_to_capacity": True},
    "dense": None,
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# --compile's default: train.py's default path (the MoE loss compiles as one graph: moe.grouped_mm).
COMPILE = "on"


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# ---------------------------------------------------------------- part 1: dispatch

def layer(shape, seed: int = 0):
    d, E, k, f, B, T = shape
    g = torch.Generator().manual_seed(seed)

    def w(*s):
        return (torch.randn(*s, generator=g) * 0.02).requires_grad_()
    p = {"router": {"weight": w(E, d)}, "experts": {"w_gate": w(E, f, d), "w_up": w(E, f, d), "w_down": w(E, d, f)}}
    dense = {"w_gate": w(k * f, d), "w_up": w(k * f, d), "w_down": w(d, k * f)}
    x = torch.randn(B, T, d, generator=g).requires_grad_()
    gy = torch.randn(B, T, d, generator=g)
    return p, dense, x, gy


def make_forward(name: str, shape, p, dense, dtype, policy: str = "probs"):
    """() -> (output [B, T, d] fp32, dropped fraction or None), under the variant's dtype."""
    d, E, k, f, B, T = shape
    fields = VARIANTS[name]
    ctx = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype else contextlib.nullcontext
    if fields is None:
        def forward(x):
            with ctx():
                h = F.silu(F.linear(x, dense["w_gate"])) * F.linear(x, dense["w_up"])
                return F.linear(h, dense["w_down"]).float(), None
        return forward
    cfg = ModelConfig(d_model=d, n_experts=E, top_k=k, expert_ffn_dim=f, max_seq_len=T, drop_policy=policy,
                      **fields)
    cfg.validate()

    hidden = (mock.patch.object(moe, "grouped_mm_available", lambda rows: False) if name == "loop"
              else contextlib.nullcontext())

    def forward(x):
        with ctx(), hidden:
            y, stats = moe.routed_moe(p, x, cfg)
        return y.float(), float(stats.dropped) / (B * T * k)
    return forward


def zero_grads(tensors) -> None:
    for t in tensors:
        t.grad = None


def bench_shape(shape_name: str, args) -> tuple[list[dict], dict]:
    shape = SHAPES[shape_name]
    d, E, k, f, B, T = shape
    p, dense, x, gy = layer(shape)
    leaves = [x, p["router"]["weight"], *p["experts"].values(), *dense.values()]
    cases, rows, errors = {}, [], {}
    for name in VARIANTS:
        for dt_name, dt in DTYPES.items():
            key = (name, dt_name)
            for policy in ("probs", "position") if VARIANTS[name] and "capacity_factor" in VARIANTS[name] else ("probs",):
                fwd = make_forward(name, shape, p, dense, dt, policy)
                try:
                    y, dropped = fwd(x)
                    y.backward(gy)
                except RuntimeError as err:
                    errors[f"{shape_name}/{name}/{dt_name}/{policy}"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                    continue
                finally:
                    zero_grads(leaves)
                cases[key] = {"forward": fwd, "policy": policy, "dropped": dropped, "y": y.detach(), "times": []}
                break

    def iteration(fwd) -> float:
        start = time.perf_counter()
        y, _ = fwd(x)
        y.backward(gy)
        seconds = time.perf_counter() - start
        zero_grads(leaves)
        return seconds

    for r in range(args.warmup + args.reps):
        for c in cases.values():
            seconds = iteration(c["forward"])
            if r >= args.warmup:
                c["times"].append(seconds)
    flops = 6 * 3 * d * f * k      # useful active matmul FLOPs per token, forward + backward
    for (name, dt_name), c in cases.items():
        base = cases.get(("grouped_mm", dt_name))
        med = statistics.median(c["times"])
        tps = B * T / med
        diff = (c["y"] - base["y"]).abs().max().item() if name == "loop" and base else None
        rows.append({"shape": shape_name, "variant": name, "dtype": dt_name, "drop_policy": c["policy"],
                     "tokens_per_s": tps, "ms": 1e3 * med, "gflops": tps * flops / 1e9,
                     "vs_grouped": tps * statistics.median(base["times"]) / (B * T) if base else None,
                     "dropped_fraction": c["dropped"], "max_abs_diff_vs_grouped": diff, "times_s": c["times"]})
    return rows, errors


def run_dispatch(args) -> dict:
    print(f"\n## Part 1: dispatch (forward + backward of one layer's routed experts, eager, CPU, "
          f"{torch.get_num_threads()} threads; one untimed iteration per variant, {args.warmup} warm-up + {args.reps} timed "
          f"interleaved rounds)\n",
          flush=True)
    rows, errors = [], {}
    for name in args.shapes.split(","):
        start = time.perf_counter()
        r, e = bench_shape(name, args)
        rows += r
        errors.update(e)
        print(f"  {name} {SHAPES[name]}: {time.perf_counter() - start:.0f} s", flush=True)
    part = {"threads": torch.get_num_threads(), "warmup": args.warmup, "reps": args.reps,
            "shapes": {n: dict(zip(("d_model", "n_experts", "top_k", "expert_ffn_dim", "batch", "seq"), SHAPES[n]))
                       for n in args.shapes.split(",")},
            "results": rows, "errors": errors}
    print(dispatch_table(part), flush=True)
    return part


def dispatch_table(part: dict) -> str:
    lines = ["| shape | variant | dtype | tokens/s | ms | GFLOP/s | vs grouped | dropped | max\\|Δ\\| |",
             "|---|---|---|--:|--:|--:|--:|--:|--:|"]
    for r in part["results"]:
        sh = part["shapes"][r["shape"]]
        shape = (f"{r['shape']} (d {sh['d_model']}, {sh['n_experts']}e top-{sh['top_k']}, ffn {sh['expert_ffn_dim']}, "
                 f"{sh['batch']}x{sh['seq']})")
        mark = " ²" if r["drop_policy"] != "probs" else ""
        ratio = f"{r['vs_grouped']:.2f}x" if r["vs_grouped"] else "—"
        dropped = "—" if r["dropped_fraction"] is None else f"{r['dropped_fraction']:.1%}"
        diff = "—" if r["max_abs_diff_vs_grouped"] is None else f"{r['max_abs_diff_vs_grouped']:.1e}"
        lines.append(f"| {shape} | {r['variant']}{mark} | {r['dtype']} | {r['tokens_per_s']:,.0f} | {r['ms']:,.0f} | "
                     f"{r['gflops']:.1f} | {ratio} | {dropped} | {diff} |")
    for key, msg in part["errors"].items():
        lines.append(f"| {key} | failed: {msg} |")
    notes = [f"Median of {part['reps']} interleaved rounds after one untimed iteration per variant and "
             f"{part['warmup']} warm-up rounds; fp32 vs bf16 autocast (parameters fp32), {part['threads']} threads. "
             "GFLOP/s counts 18·d·ffn·top_k useful FLOPs per token."]
    if any(r["drop_policy"] != "probs" for r in part["results"]):
        notes.append("² drop_policy \"position\": the same variant with \"probs\" failed (see the failed rows).")
    return "\n".join(lines + [""] + notes)


# ---------------------------------------------------------------- part 2: quality at equal tokens

def quality_configs(steps: int, compile: bool) -> dict:
    base = named_config("default")
    eval_every = max(1, steps // 4)
    t = {"steps": steps, "eval_every": eval_every, "ckpt_every": steps, "keep_checkpoints": 1, "sample_tokens": 0,
         "compile": compile, "dtype": "float32", "resume": False, "device": "cpu"}
    o = {"warmup_steps": max(1, round(steps * 50 / 280))}
    mo = named_config("tiny_mixtral").model      # the default's attention, 8 experts of 384, top-2
    assert dataclasses.replace(mo, n_experts=0, top_k=2, expert_ffn_dim=0, aux_loss_coef=0.0, z_loss_coef=0.0,
                               ffn_dim=base.model.ffn_dim) == base.model, "tiny_mixtral must share the default's attention"
    cfgs = {}
    for name, model in (("dense", base.model), ("moe", mo)):
        cfg = dataclasses.replace(base, model=model, optim=dataclasses.replace(base.optim, **o),
                                  train=dataclasses.replace(base.train, **t))
        cfg.validate()
        cfgs[name] = cfg
    return cfgs


def train_one(name: str, cfg, splits) -> dict:
    import train as train_script
    out = Path(tempfile.mkdtemp(prefix=f"nanomega-moe-{name}-"))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(out)))
    start = time.perf_counter()
    with open(out / "train.log", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train_script.train(cfg, splits=splits, quiet=True)
    wall = time.perf_counter() - start
    records = read_metrics(out / "metrics.jsonl")
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.train.seq_len
    windows, prev = [], 0      # (steps in the window, seconds), evaluation excluded
    for r in records:
        if r.get("tokens_per_s"):
            windows.append((r["step"] - prev, (r["step"] - prev) * tokens_per_step / r["tokens_per_s"]))
        prev = r["step"]
    later = windows[1:] or windows
    last = records[-1]
    return {"model": name, "params": count_params(cfg.model), "active_params": count_params(cfg.model, active=True),
            "evals": [(r["step"], r["val_loss"]) for r in records if "val_loss" in r],
            "final_val_loss": last.get("val_loss"), "final_train_loss": last["loss"],
            "tokens_per_s": sum(n for n, _ in later) * tokens_per_step / sum(s for _, s in later),
            "first_window_s": windows[0][1], "first_window_steps": windows[0][0], "wall_s": wall,
            "tokens": last["tokens"], "expert_load_cv": last.get("expert_load_cv"), "aux_loss": last.get("aux_loss"),
            "z_loss": last.get("z_loss"), "out_dir": str(out), "config": to_dict(cfg)}


def run_quality(args) -> dict:
    from nanomega.run import preflight
    compile = args.compile == "on"
    cfgs = quality_configs(args.steps, compile)
    t = cfgs["dense"].train
    print(f"\n## Part 2: quality at equal tokens ({args.steps} steps x {t.batch_size} x {t.seq_len} tokens, fp32, "
          f"compile {args.compile}, {torch.get_num_threads()} threads)\n", flush=True)
    splits = preflight.load_data(cfgs["dense"])
    runs = []
    for name, cfg in cfgs.items():
        run = train_one(name, cfg, splits)
        print(f"  {name}: final val {run['final_val_loss']:.4f}, {run['wall_s']:.0f} s ({run['out_dir']})", flush=True)
        runs.append(run)
    part = {"steps": args.steps, "compile": compile, "runs": runs}
    print(quality_table(part), flush=True)
    return part


def quality_table(part: dict) -> str:
    runs = part["runs"]
    steps = [s for s, _ in runs[0]["evals"]]
    lines = ["| model | params | active params | " + " | ".join(f"val@{s}" for s in steps)
             + " | tokens/s | first window s | wall s | final expert_load_cv per layer |",
             "|---|--:|--:|" + "--:|" * len(steps) + "--:|--:|--:|---|"]
    for r in runs:
        cv = "—" if r["expert_load_cv"] is None else ", ".join(f"{c:.3f}" for c in r["expert_load_cv"])
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['active_params'] / 1e6:.2f}M | "
                     + " | ".join(f"{v:.4f}" for _, v in r["evals"])
                     + f" | {r['tokens_per_s']:,.0f} | {r['first_window_s']:.0f} | {r['wall_s']:.0f} | {cv} |")
    delta = runs[1]["final_val_loss"] - runs[0]["final_val_loss"]
    return "\n".join(lines + ["", f"{part['steps']} steps, fp32, compile {'on' if part['compile'] else 'off'}. Final "
                                   f"validation loss, moe - dense: {delta:+.4f} nats/byte after {runs[0]['tokens']:,} "
                                   "training tokens each."])


def tables(doc: dict) -> str:
    """Each part's table; a part kept from an earlier run than the document's says which."""
    out = []
    for key, title, table in (("dispatch", "Part 1: dispatch", dispatch_table), ("quality", "Part 2: quality at equal "
                              "tokens", quality_table)):
        if key in doc:
            m = doc[key].get("meta")
            since = f" (from an earlier run: {m['date']}, `{m['command']}`)" if m else ""
            out.append(f"## {title}{since}\n\n{table(doc[key])}")
    return "\n\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--part", choices=("dispatch", "quality", "all"), default="all")
    ap.add_argument("--shapes", default="small,large", help=f"dispatch shapes, from: {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=3, help="dispatch: timed rounds")
    ap.add_argument("--warmup", type=int, default=0, help="dispatch: untimed rounds first")
    ap.add_argument("--steps", type=int, default=280, help="quality: training steps of each model")
    ap.add_argument("--compile", choices=("on", "off"), default=COMPILE, help="quality: torch.compile the step")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    if args.reps < 1 or args.warmup < 0 or args.steps < 4:
        sys.exit("error: --reps must be >= 1, --warmup >= 0 and --steps >= 4")
    if bad := [s for s in args.shapes.split(",") if s not in SHAPES]:
        sys.exit(f"error: unknown shape(s) {bad}; choose from {', '.join(SHAPES)}")
    torch.set_num_threads(cores())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (cores available to this process)")
    path = Path(args.out) / "moe.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    earlier = doc.pop("meta", None)
    for key in ("dispatch", "quality"):      # a part this run does not redo keeps its own run's meta
        if key in doc and "meta" not in doc[key] and earlier:
            doc[key]["meta"] = earlier
    doc.update(results_io.start("moe"))
    if args.part in ("dispatch", "all"):
        doc["dispatch"] = run_dispatch(args)
    if args.part in ("quality", "all"):
        doc["quality"] = run_quality(args)
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
