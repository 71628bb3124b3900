"""Optimizer step time: our Muon and SOAP updates, eager and compiled, against heavyball's, with matched settings.

    python bench/optimizer_step.py                              # both shape sets, muon and soap (2-core CPU: ~15 min)
    python bench/optimizer_step.py --shapes default             # the default model's shapes only (~4 min)
    python bench/optimizer_step.py --device cuda --out runs/gpu
    python bench/optimizer_step.py --train-step                 # whole train steps: each optimizer's overhead (~4 min)
    python bench/optimizer_step.py --shapes default --optimizers muon --rounds 1 --warmup 1 --out /tmp/smoke

Results: <out>/optimizer_step.json and .md (update alone), or optimizer_step_train.json and .md (--train-step);
--render JSON writes either's .md again.

Shapes: the hidden matrices (optim.hidden_matrix: attention and MLP projections; no embeddings, LM head or norms)
of "default" (configs/default.py, 3.3M parameters, 3.1M of them in 28 matrices) or "125m" (a LLaMA with d 768,
12 layers, 12 heads, ffn 2048, vocab 32000: 85M parameters in 84 matrices of 768 x 768, 2048 x 768, 768 x 2048).
Random gradients, --grad-pool of them used in turn, the same sequence for every variant; a step is the whole
update including the parameter write (ours: opt.update + params + updates, as train.py's update; heavyball:
opt.step() after setting .grad, the copy untimed).

Variants: ours eager, ours torch.compile'd (one graph for the whole update, as train.py), heavyball with its
kernels uncompiled (heavyball.utils.compile_mode = None) and as shipped (its per-kernel torch.compile; mode
--peer-compile-mode, "default" here rather than heavyball's "max-autotune-no-cudagraphs", whose autotuning
takes many minutes on a CPU). Our two variants share one state, heavyball's two one optimizer.

Matched settings (heavyball 3.x): constant lr, no weight decay, clipping, warmup or PaLM beta2 schedule, fp32 state.
  muon: momentum 0.95, Nesterov, 5 Newton-Schulz steps in bf16, update x sqrt(max(1, rows/cols)).
        Both use an EMA momentum; the Newton-Schulz coefficients differ (ours: Keller Jordan's fixed
        (3.4445, -4.7750, 2.0315); heavyball: five per-iteration sets), the matmul count does not.
  soap: betas (0.9, 0.95), shampoo_beta 0.95, eps 1e-8, preconditioner refresh every --precondition-frequency
        steps (heavyball: use_precond_schedule=False), max_precond_dim --max-precond-dim (default 2048: every
        side of these matrices is preconditioned), merge_dims, no 1-D preconditioning.

Timing: warm-up steps first (compilation, SOAP's first eigendecomposition), untimed. Then rounds interleave the
variants (A B C D A B C D ...), each running --steps-per-round consecutive steps; a variant's time per step is
the median over rounds of (round seconds / steps). SOAP refreshes its bases every precondition_frequency steps,
so rounds of that many steps (the default for soap) time the amortized step, refresh included; Muon's steps
are all alike (default 1 step per round). Exception: the 125m shapes on a CPU, where one SOAP step takes 10-17 s
(about a TFLOP of projections and factor products): 2 warm-up steps and 2 rounds of 1 step, i.e. plain steps
without a refresh (the table says so), and 2 rounds for Muon too.

--train-step: whole train steps instead (fns.grads then fns.update, as train.py's loop, compiled) of the default
model at its batch, 16 x 256 tokens, with optim.build's AdamW, Muon and SOAP
(their AdamW part included); interleaved rounds of 10 steps (one SOAP refresh each); each optimizer's step over
AdamW's in the same round, minus 1 (median over rounds), is what it adds to a train step.

"same work": after warm-up both sides have taken the same steps on the same gradients from the same weights;
the cosine between ours' and heavyball's parameter change is a sanity check that both do the same kind of
update (measured: 0.94 for Muon, 0.94 (default) / 0.90 (125m) for SOAP; the Newton-Schulz coefficients differ,
and at SOAP's first step ours emits a zero update but keeps G_1 in its moments while heavyball skips it). An
update that is skipped, broken or of another kind shows as a low cosine; hyperparameters do not: on these iid
gradients a Muon momentum of 0.5 instead of 0.95 still gives 0.98. The settings are matched by reading, above.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega and configs/ of this checkout

import warnings  # noqa: E402

import torch  # noqa: E402

import results_io  # noqa: E402

from nanomega import optim  # noqa: E402
from nanomega.config import ModelConfig  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.optim import schedules  # noqa: E402
from nanomega.tree import tree_flatten, tree_leaves, tree_unflatten  # noqa: E402

SHAPE_SETS = {
    "default": lambda: __import__("configs.default", fromlist=["config"]).config().model,
    "125m": lambda: ModelConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, ffn_dim=2048,
                                max_seq_len=2048),
}
OPTIMIZERS = ("muon", "soap")
VARIANTS = ("ours-eager", "ours-compiled", "heavyball-eager", "heavyball-compiled")
LR = 1e-3


def hidden_matrices(model_cfg: ModelConfig, device) -> dict:
    """{name: fp32 tensor} of the model's hidden matrices, values from the model's own init."""
    params = init(model_cfg, 0)
    from nanomega.tree import named_leaves
    return {n: p.detach().to(device) for n, p in named_leaves(params).items() if optim.hidden_matrix(n, p)}


# ---------------------------------------------------------------- ours

def our_optimizer(name: str, args):
    schedule = schedules.constant(LR, 0)
    if name == "muon":
        from nanomega.optim.muon import muon
        return muon(schedule, momentum=0.95, ns_steps=5, scale="spectral", nesterov=True)
    from nanomega.optim.soap import soap
    return soap(schedule, b1=0.9, b2=0.95, eps=1e-8, shampoo_beta=0.95,
                precondition_frequency=args.precondition_frequency, max_precond_dim=args.max_precond_dim,
                merge_dims=True)


def our_steps(name: str, params: dict, grads: list[dict], args):
    """{variant: step()} for ours eager and compiled, sharing one state."""
    opt = our_optimizer(name, args)
    state = {"params": {n: p.clone() for n, p in params.items()}}
    state["opt"] = opt.init(state["params"])

    def update_fn(g, s, p):      # train.py's update (nanomega.train.step), without its grad-norm metric
        updates, s = opt.update(g, s, p)
        _, spec = tree_flatten(p)
        return tree_unflatten(torch._foreach_add(tree_leaves(p), tree_leaves(updates)), spec), s

    def make(fn):
        def step():
            g = grads[state.setdefault("t", 0) % len(grads)]
            state["t"] += 1
            state["params"], state["opt"] = fn(g, state["opt"], state["params"])
        return step
    return {"ours-eager": make(update_fn), "ours-compiled": make(torch.compile(update_fn))}, \
        lambda: list(state["params"].values())


# ---------------------------------------------------------------- heavyball

def peer_steps(name: str, params: dict, grads: list[dict], args):
    import heavyball
    import heavyball.utils as hbu

    plist = [torch.nn.Parameter(p.clone()) for p in params.values()]
    common = dict(lr=LR, weight_decay=0.0, warmup_steps=0, gradient_clipping=None, update_clipping=None,
                  palm=False, storage_dtype="float32", compile_step=False, promote=False, caution=False, mars=False)
    if name == "muon":
        opt = heavyball.Muon(plist, betas=(0.95, 0.99), nesterov=True, heavyball_momentum=False, **common)
    else:
        opt = heavyball.SOAP(plist, betas=(0.9, 0.95), shampoo_beta=0.95, eps=1e-8,
                             precondition_frequency=args.precondition_frequency, use_precond_schedule=False,
                             max_precond_dim=args.max_precond_dim, merge_dims=True, precondition_1d=False, **common)
    pool, t = [list(g.values()) for g in grads], [0]

    def make(mode):
        def step():
            hbu.compile_mode = mode
            for p, g in zip(plist, pool[t[0] % len(pool)]):
                p.grad = g.clone()   # heavyball may write into .grad; ours never changes its inputs
            t[0] += 1
            opt.step()
        return step
    return {"heavyball-eager": make(None), "heavyball-compiled": make(args.peer_compile_mode)}, \
        lambda: [p.detach() for p in plist]


# ---------------------------------------------------------------- timing

def timed(step, steps: int, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return time.perf_counter() - start


def bench(name: str, shapes: str, args, device) -> list[dict]:
    model_cfg = SHAPE_SETS[shapes]()
    params = hidden_matrices(model_cfg, device)
    gen = torch.Generator().manual_seed(0)
    grads = [{n: (torch.randn(p.shape, generator=gen) * 1e-2).to(device) for n, p in params.items()}
             for _ in range(args.grad_pool)]
    n_params = sum(p.numel() for p in params.values())
    kinds = sorted({tuple(p.shape) for p in params.values()})
    # A SOAP step on the 125M shapes is 10-17 s on a 2-core CPU (~1 TFLOP of projections): there, time plain
    # steps only (no refresh within warm-up + rounds) and fewer rounds, unless told otherwise.
    slow = device.type == "cpu" and shapes == "125m"
    full_cycle = name == "soap" and not slow
    per_round = args.steps_per_round or (args.precondition_frequency if full_cycle else 1)
    warmup = args.warmup or (args.precondition_frequency + 1 if full_cycle else 2 if name == "soap" else 3)
    rounds = args.rounds or (2 if slow else 5)
    print(f"\n{name} on {shapes}: {len(params)} hidden matrices, {n_params / 1e6:.1f}M parameters, shapes "
          f"{', '.join('x'.join(map(str, k)) for k in kinds)}; {warmup} warm-up steps, {rounds} rounds "
          f"of {per_round} step(s)" + (" (plain steps: no basis refresh timed)" if name == "soap" and
                                       per_round < args.precondition_frequency else ""), flush=True)
    steps, errors, current = {}, {}, {}
    for make in (our_steps, peer_steps):
        try:
            made, current[make.__name__] = make(name, params, grads, args)
            steps.update(made)
        except Exception as err:                                # no heavyball, or an API it no longer has
            for v in VARIANTS:
                if v.startswith("ours" if make is our_steps else "heavyball"):
                    errors[v] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    steps = {v: s for v, s in steps.items() if v in args.variants}
    first = {}
    for v in list(steps):
        try:
            start = time.perf_counter()
            timed(steps[v], warmup, device)
            first[v] = time.perf_counter() - start
            print(f"  {v}: {warmup} warm-up steps {first[v]:.1f} s", flush=True)
        except Exception as err:
            errors[v] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            print(f"  {v}: failed: {errors[v]}", flush=True)
            del steps[v]
    agreement = None
    sides = [sum(v.startswith(k) for v in steps) for k in ("ours", "heavyball")]
    if len(current) == 2 and sides[0] == sides[1] > 0:          # both sides took the same number of steps
        start = [p.flatten() for p in params.values()]
        ours, peer = ([(a.float().flatten() - b) for a, b in zip(current[k](), start)] for k in current)
        agreement = torch.nn.functional.cosine_similarity(torch.cat(ours).double(), torch.cat(peer).double(),
                                                          dim=0).item()
        print(f"  same work? cosine of ours' and heavyball's parameter change after {sides[0] * warmup} steps: "
              f"{agreement:.3f}", flush=True)
    times = {v: [] for v in steps}
    for _ in range(rounds):
        for v in steps:
            times[v].append(timed(steps[v], per_round, device) / per_round)
    base = statistics.median(times["ours-eager"]) if "ours-eager" in times else None
    peer = statistics.median(times["heavyball-eager"]) if "heavyball-eager" in times else None
    rows = []
    for v, t in times.items():
        med = statistics.median(t)
        rows.append({"optimizer": name, "shapes": shapes, "variant": v, "ms": 1e3 * med, "warmup_s": first[v],
                     "vs_ours_eager": base / med if base else None, "vs_heavyball_eager": peer / med if peer else None,
                     "round_ms": [1e3 * x for x in t], "params": n_params, "matrices": len(params),
                     "steps_per_round": per_round, "rounds": rounds, "warmup_steps": warmup,
                     "update_cosine": agreement})
    rows += [{"optimizer": name, "shapes": shapes, "variant": v, "error": e} for v, e in errors.items()
             if v in args.variants]
    return rows


# ---------------------------------------------------------------- the update's share of a train step

STEP_VARIANTS = {   # name: OptimConfig fields (optim.build: the matrix optimizers' AdamW part included)
    "adamw": {"name": "adamw"},
    "muon": {"name": "muon"},
    "soap": {"name": "soap"},
}


def train_step_share(args, device) -> list[dict]:
    """Whole train steps of the default model at its batch (16 x 256): fns.grads then fns.update, as
    train.py's loop, compiled, for each STEP_VARIANTS entry; interleaved rounds, median ms. A variant's
    overhead is its step time over AdamW's in the same round, minus 1 (median over rounds): what the
    optimizer adds to a step."""
    from configs.default import config
    from nanomega.train.step import make_step_fns
    cfg = config()
    t = cfg.train
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.grad_pool):
        tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen).to(device)
        batches.append([(tokens[:, :-1], tokens[:, 1:])])
    steps, first = {}, {}
    for name, fields in STEP_VARIANTS.items():
        opt = optim.build(dataclasses.replace(cfg.optim, **fields), t.steps)
        fns = make_step_fns(cfg.model, opt, compile=not args.eager_train_step)
        state = {"params": init(cfg.model, 0, device=device), "t": 0}
        state["opt"] = opt.init(state["params"])

        def step(fns=fns, state=state):
            _, grads, stats = fns.grads(state["params"], batches[state["t"] % len(batches)])
            state["params"], state["opt"] = fns.update(grads, state["opt"], state["params"], stats)
            state["t"] += 1
        start = time.perf_counter()
        timed(step, args.warmup or 12, device)      # compilation, SOAP's first bases and first refresh
        first[name] = time.perf_counter() - start
        steps[name] = step
        print(f"  {name}: warm-up {first[name]:.1f} s", flush=True)
    rounds, per_round = args.rounds or 7, args.steps_per_round or 10   # 10: one SOAP refresh per round
    times = {v: [] for v in steps}
    for _ in range(rounds):
        for v in steps:
            times[v].append(timed(steps[v], per_round, device) / per_round)
    # paired by round: a round's variants ran back to back, so their ratio is free of the machine's drift
    return [{"variant": v, "ms": 1e3 * statistics.median(x),
             "overhead_vs_adamw": statistics.median(a / b for a, b in zip(x, times["adamw"])) - 1,
             "round_ms": [1e3 * y for y in x], "warmup_s": first[v], "rounds": rounds, "steps_per_round": per_round}
            for v, x in times.items()]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"from {OPTIMIZERS}")
    ap.add_argument("--shapes", default="default,125m", help=f"from {tuple(SHAPE_SETS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {VARIANTS}")
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default 5; 2 for 125m on CPU)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps per variant first (compilation, SOAP's "
                    "first bases and first refresh); default: muon 3, soap precondition_frequency + 1")
    ap.add_argument("--steps-per-round", type=int, default=0,
                    help="consecutive steps per variant per round (default: soap precondition_frequency, muon 1)")
    ap.add_argument("--precondition-frequency", type=int, default=10)
    ap.add_argument("--grad-pool", type=int, default=3, help="distinct random gradients, used in turn (a constant "
                    "gradient is degenerate for SOAP: rotated into its own eigenbasis it is diagonal)")
    ap.add_argument("--max-precond-dim", type=int, default=2048)
    ap.add_argument("--peer-compile-mode", default="default", help="torch.compile mode for heavyball's kernels")
    ap.add_argument("--device", default="cpu")
    results_io.add_arguments(ap)
    ap.add_argument("--train-step", action="store_true",
                    help="instead: whole compiled train steps of the default model, each optimizer's overhead vs AdamW")
    ap.add_argument("--eager-train-step", action="store_true", help="with --train-step: eager instead of compiled")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        return results_io.render(args.render, train_tables if "train_step" in doc else tables)
    names = [n for n in args.optimizers.split(",") if n]
    shape_sets = [s for s in args.shapes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    bad = ([n for n in names if n not in OPTIMIZERS] + [s for s in shape_sets if s not in SHAPE_SETS]
           + [v for v in args.variants if v not in VARIANTS])
    if bad or args.rounds < 0 or args.warmup < 0 or args.steps_per_round < 0:
        sys.exit(f"error: unknown {bad}" if bad else "error: --rounds, --warmup and --steps-per-round must be >= 0")
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", category=FutureWarning)    # inductor's own deprecation notices
    try:
        import heavyball
        peer = f"heavyball {getattr(heavyball, '__version__', '') or _dist_version('heavyball')}"
    except ImportError:
        peer = "heavyball not installed (pip install heavyball --no-deps; pip install opt-einsum --no-deps)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}; peer: {peer}", flush=True)
    if args.train_step:
        doc = results_io.start("optimizer_step_train")
        doc.update(torch=torch.__version__, threads=torch.get_num_threads(), device=str(device),
                   compiled=not args.eager_train_step, train_step=train_step_share(args, device))
        results_io.write(doc, train_tables(doc), args.out)
        return 0

    doc = results_io.start("optimizer_step")
    rows = []
    for shapes in shape_sets:
        for name in names:
            rows += bench(name, shapes, args, device)
    doc.update(torch=torch.__version__, threads=torch.get_num_threads(), device=str(device), peer=peer,
               args={k: v for k, v in vars(args).items() if k not in ("out", "render")}, results=rows)
    results_io.write(doc, tables(doc), args.out)
    return 1 if any("error" in r for r in rows) else 0


def tables(doc: dict) -> str:
    """Every variant's row, then per optimizer and shapes the four variants side by side."""
    ratio = lambda x: f"{x:.2f}x" if x else "—"  # noqa: E731
    long, wide = [], {}
    for r in doc["results"]:
        if "error" in r:
            long.append([r["optimizer"], r["shapes"], r["variant"], f"failed: {r['error']}", "", "", "", ""])
            continue
        long.append([r["optimizer"], r["shapes"], r["variant"], f"{r['ms']:,.1f}", ratio(r["vs_ours_eager"]),
                     ratio(r["vs_heavyball_eager"]), f"{r['warmup_s']:.1f}",
                     "—" if r["update_cosine"] is None else f"{r['update_cosine']:.3f}"])
        wide.setdefault((r["optimizer"], r["shapes"]), {})[r["variant"]] = r
    summary = []
    for (opt, shapes), v in wide.items():
        ours = min((v[k]["ms"] for k in ("ours-eager", "ours-compiled") if k in v), default=None)
        peer = min((v[k]["ms"] for k in ("heavyball-eager", "heavyball-compiled") if k in v), default=None)
        first = next(iter(v.values()))
        amortized = first["steps_per_round"] >= doc["args"]["precondition_frequency"] and opt == "soap"
        summary.append([f"{opt}{' (amortized over a refresh cycle)' if amortized else ''}", shapes,
                        *(f"{v[k]['ms']:,.1f}" if k in v else "—" for k in VARIANTS),
                        f"{peer / ours:.2f}x" if ours and peer else "—"])
    return "\n\n".join([
        f"{doc['device']}, {doc['threads']} threads, torch {doc['torch']}; peer: {doc['peer']}. ms per update, median "
        "over interleaved rounds.",
        results_io.table(["optimizer", "shapes", "ours eager", "ours compiled", "heavyball eager", "heavyball compiled",
                          "heavyball (best) / ours (best)"], "llrrrrr", summary),
        results_io.table(["optimizer", "shapes", "variant", "ms/step", "vs ours eager", "vs heavyball eager",
                          "warm-up s", "same work"], "lllrrrrr", long),
        "Ratios are speed-ups (> 1: faster than the reference). warm-up s: the untimed first steps (compilation, "
        "SOAP's first bases and refresh). same work: cosine between ours' and heavyball's parameter change after "
        "the same steps on the same gradients. JSON: every round's ms, rounds and steps per round."])


def train_tables(doc: dict) -> str:
    rows = doc["train_step"]
    return (results_io.table(["optimizer", "ms per train step", "overhead vs AdamW"], "lrr",
                             [[r["variant"], f"{r['ms']:,.1f}", f"{100 * r['overhead_vs_adamw']:+.1f}%"] for r in rows])
            + f"\n\nThe default model at its batch (16 x 256), {'compiled' if doc.get('compiled', True) else 'eager'}, "
              f"forward + backward + update; ms: median over {rows[0]['rounds']} interleaved rounds of "
              f"{rows[0]['steps_per_round']} steps; overhead: median over rounds of the ratio to AdamW's round.")


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
