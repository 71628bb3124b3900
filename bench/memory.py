"""Memory per rank of each parallel layout (parameters, gradients, optimizer state), measured and analytic,
and its train-step throughput on this machine.

    python bench/memory.py                        # default config, AdamW/Muon/SOAP, 10 layouts, ~2.5 min on 2 cores
    python bench/memory.py --optimizers adamw --layouts serial,ddp2,zero1-dp2 --steps 1 --out /tmp/smoke
    python bench/memory.py --optimizers adamw,muon --layouts serial,fsdp2,fsdp2-tp2 --model.n_layers=2

Each layout runs the real step (train.setup, make_step_fns, eager, CPU, gloo) for --warmup + --steps steps on
random tokens. This script launches the workers itself: one plain process for the serial layout, then one
`torchrun --standalone` per world size that runs its layouts one after another on one process group.
After the last step every rank sums the bytes it holds, and the table shows the largest rank:
    params   to_local() of every parameter DTensor (storage placements)
    grads    to_local() of the gradients the optimizer receives (optimizer placements, after the
             data-parallel reduce); "bwd grads" is what the backward produced before that reduce
    state    every tensor of the optimizer state (ParallelOptimizer keeps plain local tensors)
The analytic column is computed in this process from the sharding plan alone, no process group, by
nanomega.sim.rank_bytes.bytes_per_rank (the count train.py's memory preflight uses): for each parameter
of N elements, 4N bytes of fp32 parameter / (product of the mesh dims its storage placement shards) + 4N
of gradient / (the same for its optimizer placement) + its optimizer state (optim.build's, measured on
meta tensors) / (optimizer placement's product). Muon, Shampoo and SOAP keep whole-matrix state for their
hidden matrices on one owner rank when the state is data-parallel sharded, owners chosen by
ParallelOptimizer's rule (largest matrix first to the least-loaded owner, by elements); the analytic
value is the most loaded owner. Under tensor parallel every tp rank keeps the whole-matrix state, except
Muon with parallel.muon_tp=distributed (layout tp2-muon_tp, Muon only), which keeps it split like the
parameters. Megatron's reference (bf16 parameters,
fp32 gradients, fp32 master weights and Adam moments: 18 B/param, 6 + 12/d with the distributed optimizer
over d data-parallel ranks, divided by the model-parallel shards) is printed beside AdamW: a formula, not a
measurement.
Throughput is the global batch's tokens over the median timed step (each step between two barriers, after
the warm-up), eager, with cores / world_size threads per process (at least 1: 4 processes on 2 cores share
them), as a ratio to the serial run of the same optimizer: on one CPU host that ratio shows communication
and oversubscription costs, not a speed-up to expect across machines. docs/parallelism.md explains each layout.
Results: <out>/memory.json and .md (--render JSON writes the .md again).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega, configs/ and train.py of this checkout

import torch  # noqa: E402

import results_io  # noqa: E402
from nanomega import optim  # noqa: E402

MiB = 2**20
# name -> (processes, overrides)
LAYOUTS = {
    "serial": (1, []),
    "ddp2": (2, ["--parallel.dp_replicate=2"]),
    "fsdp2": (2, ["--parallel.dp_shard=2"]),
    "zero1-dp2": (2, ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"]),
    "tp2": (2, ["--parallel.tp=2"]),
    "tp2-sp": (2, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "tp2-muon_tp": (2, ["--parallel.tp=2", "--parallel.muon_tp=distributed"]),   # Muon on tp shards (Muon only)
    "hsdp2x2": (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),
    "dp2-tp2": (4, ["--parallel.dp_replicate=2", "--parallel.tp=2"]),
    "fsdp2-tp2": (4, ["--parallel.dp_shard=2", "--parallel.tp=2"]),
}
DEFAULT_LAYOUTS = "serial,ddp2,fsdp2,zero1-dp2,tp2,tp2-sp,tp2-muon_tp,hsdp2x2,dp2-tp2,fsdp2-tp2"
OPTIMIZERS = tuple(optim.REGISTRY)      # every registered optimizer (nanomega/optim/registry.py)
# layouts that differ from another only for some optimizers: muon_tp for those that run on tp shards
ONLY = {"tp2-muon_tp": tuple(name for name, spec in optim.REGISTRY.items() if spec.tp_shards)}
FIXED = ["--train.compile=false", "--train.device=cpu", "--train.grad_accum=1"]


def case_args(rest: list[str], layout: str, optimizer: str, total_steps: int) -> list[str]:
    return rest + LAYOUTS[layout][1] + [f"--optim.name={optimizer}", f"--train.steps={total_steps}"] + FIXED


# ---------------------------------------------------------------- measured: the worker, one process per rank

def local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor
    from nanomega.tree import tree_leaves
    return sum((x.to_local() if isinstance(x, DTensor) else x).nbytes
               for x in tree_leaves(tree) if isinstance(x, torch.Tensor))


def measure(argv: list[str], warmup: int, steps: int) -> dict:
    """One layout x optimizer on this process group: this rank's bytes after the last step, and seconds."""
    import train
    from nanomega.config import parse_args
    from nanomega.train.step import make_step_fns

    cfg = parse_args(argv)
    torch.manual_seed(cfg.train.seed)
    model_cfg, params, opt, par = train.setup(cfg, torch.device("cpu"))
    seen = {}
    if par is not None:            # record the gradients as the backward hands them to the reduce (step.py)
        make_reducer = par.reducer

        def reducer():                 # one per step: the last step's bytes are the ones kept
            r = make_reducer()
            add, seen["grads_backward"] = r.add, 0

            def counted(name, g, *earlier_and_n):
                seen["grads_backward"] += local_bytes([g])
                add(name, g, *earlier_and_n)
            r.add = counted
            return r
        par.reducer = reducer
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, compile=False, par=par)
    t = cfg.train
    gen = torch.Generator().manual_seed(t.seed)   # the same global batch on every rank; par.batch slices it
    tokens = [torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen) for _ in range(2)]
    batches = [[(x[:, :-1], x[:, 1:])] for x in tokens]
    barrier = torch.distributed.barrier if par is not None else (lambda: None)
    losses, seconds = [], []
    for i in range(warmup + steps):
        barrier()                  # every rank starts the step together; the slowest one ends it
        start = time.perf_counter()
        loss, grads, _ = fns.grads(params, batches[i % 2])
        params, state = fns.update(grads, state, params)
        losses.append(loss.item())
        barrier()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    out = {"params": local_bytes(params), "grads": local_bytes(grads),
           "grads_backward": seen.get("grads_backward", local_bytes(grads)), "state": local_bytes(state),
           "seconds": seconds, "losses": losses, "tokens_per_step": t.batch_size * t.seq_len}
    del params, state, grads, fns, opt, par
    return out


def worker(out_path: str, cases_json: str) -> None:
    """Every case in order on this process group; rank 0 writes {name: {per_rank: [...]} or {error}}."""
    import traceback
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // world))
    spec = json.loads(cases_json)
    results = {}
    for case in spec["cases"]:
        try:
            record = measure(case["args"], spec["warmup"], spec["steps"])
        except Exception:
            record = {"error": traceback.format_exc()}
        if world > 1:
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, record)
        else:
            gathered = [record]
        errors = [r["error"] for r in gathered if "error" in r]
        results[case["name"]] = {"error": errors[0]} if errors else {"per_rank": gathered, "threads":
                                                                     torch.get_num_threads()}
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"  {case['name']}: " + ("FAILED" if errors else
                  f"median step {statistics.median(gathered[0]['seconds']):.2f} s"), flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_path).write_text(json.dumps(results))
    if world > 1:
        torch.distributed.barrier()     # no rank tears gloo down while another still works
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------- analytic: the plan alone, no process group

def analytic(argv: list[str]) -> dict:
    """Bytes per rank from the sharding plan alone (nanomega.sim.rank_bytes, as train.py's preflight counts)."""
    from nanomega.config import parse_args
    from nanomega.sim.counting import count_params
    from nanomega.sim.rank_bytes import bytes_per_rank
    from nanomega.parallel.mesh import model_config

    cfg = parse_args(argv)
    held = bytes_per_rank(cfg)
    return {**held._asdict(), "n_params": count_params(model_config(cfg), padded=True)}


def megatron_reference(layout: str) -> tuple[float, str]:
    """Megatron's bytes/param for bf16 params + fp32 grads, master weights and Adam moments (not measured)."""
    _, over = LAYOUTS[layout]

    def get(key: str) -> int:
        return next((int(a.split("=")[1]) for a in over if a.startswith(f"--parallel.{key}=")), 1)
    dp_r, dp_s, tp = get("dp_replicate"), get("dp_shard"), get("tp")
    distopt = "--parallel.distributed_optimizer=true" in over
    if dp_s > 1:                    # ZeRO-3 / FSDP: every piece over the sharded dp ranks
        value, text = 18 / dp_s, f"18/{dp_s}"
    elif distopt:
        value, text = 6 + 12 / dp_r, f"6+12/{dp_r}"
    else:
        value, text = 18.0, "18"
    if tp > 1:
        value, text = value / tp, f"({text})/{tp}" if "/" in text or "+" in text else f"{text}/{tp}"
    return value, text


# ---------------------------------------------------------------- the launcher

def launch(world: int, cases: list[dict], warmup: int, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        spec = json.dumps({"cases": cases, "warmup": warmup, "steps": steps})
        script = str(Path(__file__).resolve())
        if world == 1:
            cmd = [sys.executable, script, "--worker", str(out), spec]
            env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                   script, "--worker", str(out), spec]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(cmd, env=env, cwd=Path(script).parent.parent, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()        # torchrun passes SIGTERM on to its workers (each in a session of its own)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return {c["name"]: {"error": f"timed out after {timeout:.0f} s"} for c in cases}
        if not out.exists():
            return {c["name"]: {"error": f"worker exited with {proc.returncode}, no results"} for c in cases}
        return json.loads(out.read_text())


def fmt_pair(measured: float, expected: float) -> str:
    return f"{measured / MiB:.2f} ({expected / MiB:.2f})"


def tables(doc: dict) -> str:
    """The table, its notes and the loss check, from the results document alone."""
    rows = doc["rows"]
    serial_tps = {r["optimizer"]: r["tokens_per_s"] for r in rows if r["layout"] == "serial" and "tokens_per_s" in r}
    lines = [f"config {' '.join([doc['config']] + doc['overrides'])}: batch {doc['batch_size']} x seq {doc['seq_len']} "
             f"tokens/step, CPU, {doc['cores']} cores, {doc['warmup']} warm-up + {doc['steps']} timed steps per case, "
             "eager", "",
             "| layout | ranks | optimizer | params MiB | grads MiB¹ | bwd grads MiB² | state MiB | total MiB | "
             "B/param | Megatron ref B/param³ | tokens/s | vs serial |", "|---|--:|---|" + "--:|" * 9]
    for row in rows:
        head = f"| {row['layout']} | {row['ranks']} | {row['optimizer']} |"
        if "error" in row:
            lines.append(head + f" failed: {row['error'].strip().splitlines()[-1][:150]} |")
            continue
        ms, e = row["measured"], row["analytic"]
        e_total = e["params"] + e["grads"] + e["state"]
        ref = row.get("megatron_ref_bytes_per_param")
        base = serial_tps.get(row["optimizer"])
        lines.append(head + f" {fmt_pair(ms['params'], e['params'])} | {fmt_pair(ms['grads'], e['grads'])} | "
                     f"{fmt_pair(ms['grads_backward'], e['grads_backward'])} | {fmt_pair(ms['state'], e['state'])} | "
                     f"{fmt_pair(ms['total'], e_total)} | "
                     f"{ms['total'] / e['n_params']:.2f} ({e_total / e['n_params']:.2f}) | "
                     + (f"{ref[1]} = {ref[0]:.2f}" if ref else "") + f" | {row['tokens_per_s']:,.0f} | "
                     + (f"{row['tokens_per_s'] / base:.2f}x" if base else "—") + " |")
    loads, cores = doc["load_average_1min"], doc["cores"]
    took = f"this run took {doc['run_seconds']:.0f} s; " if doc.get("run_seconds") else ""
    lines += ["", "Each cell: measured, the largest rank (analytic). ¹ As the optimizer receives them: after the data-"
              "parallel reduce (all-reduce, or reduce-scatter to 1/d under ZeRO-1). ² As the backward leaves them, "
              "before that reduce, not counted in total: a transient full-size partial sum under DDP/ZeRO-1; under "
              "TP the vocab-parallel embedding's backward makes its gradient whole [V, d] on every tp rank (above "
              "analytic where no FSDP reduce-scatter has sliced it yet). ³ Megatron's formula for bf16 params + fp32 "
              "grads, master weights and Adam (18 B/param; 6 + 12/d with the distributed optimizer; /tp for tensor "
              "parallel; 18/d for ZeRO-3): a reference, not measured; nanomega keeps fp32 params as the master copy "
              "(16 B/param). "
              "Analytic: 4 B params / storage shards + 4 B grads / optimizer shards + state / optimizer shards per "
              "parameter (AdamW 8 B); Muon/SOAP whole-matrix state from optim/memory.py on the most loaded owner. "
              f"tokens/s: global tokens over the median of {doc['steps']} timed step(s) after {doc['warmup']} warm-up, "
              f"eager, {cores} cores shared by all ranks (cores/ranks threads each, at least 1); {took}1-minute "
              f"load average {loads[0]:.1f} before it (above {cores}: other work shared the cores), {max(loads):.1f} "
              "at most during it (its own processes included)."]
    check = doc.get("loss_max_abs_diff_vs_serial")
    if check:
        lines.append("Losses against the serial run (same batches), max |difference| over steps and layouts: "
                     + ", ".join(f"{o} {d:.1e}" for o, d in check.items()))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Other arguments: --config=NAME and --section.key=value overrides")
    ap.add_argument("--optimizers", default="adamw,muon,soap", help=f"comma-separated, from: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated, from: {', '.join(LAYOUTS)}")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case, after the warm-up (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per case first (>= 1)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds allowed per launched world size")
    results_io.add_arguments(ap)
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2])
        return 0
    args, rest = ap.parse_known_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("memory")
    optimizers = [x for x in args.optimizers.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    from nanomega.config import parse_args
    from nanomega.parallel.mesh import validate_layout
    try:
        if bad := [x for x in optimizers if x not in OPTIMIZERS] + [x for x in layouts if x not in LAYOUTS]:
            raise ValueError(f"unknown optimizer(s) or layout(s) {bad}")
        if args.steps < 1 or args.warmup < 1:
            raise ValueError("--steps and --warmup must be >= 1")
        cases = {(lay, o): case_args(rest, lay, o, args.warmup + args.steps) for lay in layouts for o in optimizers
                 if o in ONLY.get(lay, OPTIMIZERS)}
        for (lay, _), a in cases.items():       # every layout's rules, before any process starts
            validate_layout(parse_args(a), LAYOUTS[lay][0])
        expected = {k: analytic(a) for k, a in cases.items()}
    except ValueError as err:
        sys.exit(f"error: {err}")
    cfg = parse_args(rest)
    name = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), "default")
    t = cfg.train
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"config {' '.join([name] + [a for a in rest if not a.startswith('--config=')])}: "
          f"{expected[next(iter(expected))]['n_params'] / 1e6:.2f}M parameters (vocabulary padded), batch "
          f"{t.batch_size} x seq {t.seq_len} = {t.batch_size * t.seq_len} tokens/step | CPU, {cores} cores, "
          f"torch {torch.__version__} | {args.warmup} warm-up + {args.steps} timed steps per case, eager", flush=True)

    measured, wall, loads = {}, time.perf_counter(), [os.getloadavg()[0]]
    for world in sorted({LAYOUTS[lay][0] for lay in layouts}):
        group = [{"name": f"{lay}/{o}", "args": a} for (lay, o), a in cases.items() if LAYOUTS[lay][0] == world]
        print(f"{world} process(es): {len(group)} case(s); load average {os.getloadavg()[0]:.1f}", flush=True)
        measured.update(launch(world, group, args.warmup, args.steps, args.timeout))
        loads.append(os.getloadavg()[0])

    rows, serial_tps = [], {}
    for (lay, o) in cases:
        r, e = measured.get(f"{lay}/{o}", {"error": "not run"}), expected[(lay, o)]
        row = {"layout": lay, "optimizer": o, "ranks": LAYOUTS[lay][0], "overrides": LAYOUTS[lay][1],
               "analytic": e}
        if "error" in r:
            row["error"] = r["error"]
            rows.append(row)
            continue
        ranks = r["per_rank"]
        row["per_rank"] = [{k: x[k] for k in ("params", "grads", "grads_backward", "state")} for x in ranks]
        row["measured"] = {k: max(x[k] for x in ranks) for k in ("params", "grads", "grads_backward", "state")}
        row["measured"]["total"] = max(x["params"] + x["grads"] + x["state"] for x in ranks)
        row["step_seconds"] = ranks[0]["seconds"]
        row["tokens_per_s"] = ranks[0]["tokens_per_step"] / statistics.median(ranks[0]["seconds"])
        row["threads_per_rank"] = r["threads"]
        row["losses"] = ranks[0]["losses"]
        if lay == "serial":
            serial_tps[o] = row["tokens_per_s"]
        if o in ("adamw",):
            row["megatron_ref_bytes_per_param"] = megatron_reference(lay)
        rows.append(row)

    check = {}
    for o in optimizers:
        ref = next((r["losses"] for r in rows if (r["optimizer"], r["layout"]) == (o, "serial") and "losses" in r),
                   None)
        if ref:
            check[o] = max((max(abs(a - b) for a, b in zip(r["losses"], ref)) for r in rows
                            if r["optimizer"] == o and "losses" in r), default=0.0)
    doc.update(config=name, overrides=[a for a in rest if not a.startswith("--config=")], batch_size=t.batch_size,
               seq_len=t.seq_len, steps=args.steps, warmup=args.warmup, cores=cores, load_average_1min=loads,
               run_seconds=time.perf_counter() - wall, torch=torch.__version__, loss_max_abs_diff_vs_serial=check,
               rows=rows)
    results_io.write(doc, tables(doc), args.out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
