"""Peak memory per rank inside the train step, measured on real runs beside the simulator's figure.

    python bench/peak.py                        # AdamW at sequence 1024 and 128, SGD at 128 (~4 min on 2 cores)
    python bench/peak.py --runs sgd:128 --layers 2 --d-model 256 --out /tmp/smoke      # smoke test

A 4-layer LLaMA-style model (d 512, 13.1M parameters) under FSDP over 2 gloo processes (torchrun), one step
of train.py's loop (forward + backward over the micro-batches, then the update), per run (--runs: optimizer
and sequence length) in six memory settings:
    keep gathers    parallel.reshard_after_forward=false: every unit's gathered parameters live from
                    its forward to its backward, so at the end of the forward the whole model is
                    gathered on every rank (what one whole-model gather at the start of the step held)
    per unit        the default: each unit's parameters gathered just before it runs, freed after its
                    forward, gathered again for its backward, the next unit's gather launched one unit
                    ahead
    per unit, no prefetch   one unit gathered at a time: made here by running the step outside
                    Parallel.prefetching (no_prefetch), every gather waited for as it is launched
    + selective AC  matmul and attention outputs kept, the rest recomputed (nanomega/models/recompute.py)
    + full AC       every block's forward recomputed in its backward
    + full AC, bf16 gathers   train.param_dtype=bfloat16: the gathers and the compute in bf16
Measured by nanomega.sim.estimate's MemoryTracker (every storage an op creates, from creation to release)
on the real tensors of rank 0; "simulated" runs the same flags on fake tensors (python -m
nanomega.sim.estimate). "held" is what the rank keeps between steps (16 B/param / 2 for AdamW); "step adds"
is the forward and backward's peak above it: what a layout's gathering and activation policy cost. The
update's peak is shown apart, and for each run beside the whole-tree update it replaced ("whole update": the same
setting with opt.update + apply_updates over all parameters at once, new parameters and moments beside the old,
as a compiled update or a matrix optimizer still runs) against the in-place one (step.optimizer_step: one
parameter's temporaries at a time); the step's peak is the larger of the forward + backward's and the update's.
The simulated figures come from nanomega.sim.estimate.estimate(cfg, ranks="0"). Results: <out>/peak.json and .md
(one table with every run side by side, then each run's detail; --render JSON writes the .md again).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_io  # noqa: E402

SETTINGS = {
    "keep gathers": ["--parallel.reshard_after_forward=false"],
    "per unit": [],
    "per unit, no prefetch": [],       # with no_prefetch()
    "per unit + selective AC": ["--train.activation_checkpointing=selective"],
    "per unit + full AC": ["--train.activation_checkpointing=full"],
    "per unit + full AC, bf16 gathers": ["--train.activation_checkpointing=full", "--train.param_dtype=bfloat16"],
}


RUNS = "adamw:1024,adamw:128,sgd:128"   # optimizer:sequence, the README's three column groups
WHOLE = "per unit + full AC, bf16 gathers"   # the setting also measured with the whole-tree update


def base_args(a, optim: str, seq: int) -> list[str]:
    return [f"--model.d_model={a.d_model}", f"--model.n_layers={a.layers}", "--model.n_heads=8", "--model.n_kv_heads=4",
            f"--model.ffn_dim={4 * a.d_model}", f"--model.max_seq_len={seq}", f"--train.seq_len={seq}",
            "--train.batch_size=2", "--train.device=cpu", "--train.compile=false", "--parallel.dp_shard=2",
            f"--optim.name={optim}"] + (["--optim.momentum=0"] if optim == "sgd" else [])


def no_prefetch(name: str):
    """The "no prefetch" setting's variant (no flag says it): Parallel.prefetching made a no-op while the case runs
    (a forked simulator child inherits it); any other setting, nothing."""
    import contextlib
    from unittest import mock
    from nanomega.parallel.parallelize import Parallel
    if not name.endswith("/per unit, no prefetch"):
        return contextlib.nullcontext()
    return mock.patch.object(Parallel, "prefetching", lambda self, units: contextlib.nullcontext())


def worker(out: str, spec: str) -> None:
    import torch
    from nanomega.sim import estimate
    from nanomega.sim.memory_tracker import MemoryTracker
    from nanomega.config import parse_args
    torch.distributed.init_process_group("gloo")
    results = {}
    for name, args in json.loads(spec).items():
        cfg, cpu = parse_args(args), torch.device("cpu")
        if not name.endswith("|whole"):
            with no_prefetch(name):
                results[name] = estimate.track_step(cfg, MemoryTracker(), cpu)
            continue
        built = list(estimate.build(cfg, cpu))
        built[2].leaf_by_leaf = None     # the ParallelOptimizer runs opt.update over the whole tree (step.make_update)
        results[name] = estimate._track_steps(cfg, MemoryTracker(), cpu, built)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


MiB = 2**20


def fwd_bwd(result: dict) -> int:
    return result["phases"]["forward_backward"]["peak_bytes"]


def held(result: dict) -> int:
    return sum(result["held_after"].values())


def update(result: dict) -> int:
    return result["phases"]["update"]["peak_bytes"]


def update_table(runs: list) -> str:
    """The update's peak, whole-tree against in place, and the step's peak (fwd + bwd or update) with each."""
    rows = []
    for r in runs:
        whole, now = r["whole_update"], r["measured"][WHOLE]
        rows.append([f"{r['optim']}, seq {r['seq']}", f"{held(now) / MiB:,.1f}", f"{update(whole) / MiB:,.1f}",
                     f"{update(now) / MiB:,.1f}", f"{update(r['simulated'][WHOLE]) / MiB:,.1f}",
                     f"{update(whole) / update(now):.2f}x", f"{max(update(whole), fwd_bwd(whole)) / MiB:,.1f}",
                     f"{max(update(now), fwd_bwd(now)) / MiB:,.1f}"])
    return results_io.table(["run", "held", "update peak, whole tree", "in place", "in place simulated",
                             "ratio", "step peak, whole tree", "in place"], "lrrrrrrr", rows)


def tables(doc: dict) -> str:
    """One table with every run side by side (the README's), then each run's detail."""
    runs, names = doc["runs"], list(doc["settings"])
    head, rows = ["setting"], []
    for r in runs:
        label = f"{r['optim']}, seq {r['seq']}"
        head += [f"{label}: fwd+bwd peak (simulated)", "adds", "vs keep"]
    for name in names:
        row = [name]
        for r in runs:
            real, sim, keep = r["measured"][name], r["simulated"][name], r["measured"][names[0]]
            row += [f"{fwd_bwd(real) / MiB:,.1f} ({fwd_bwd(sim) / MiB:,.1f})",
                    f"{(fwd_bwd(real) - held(real)) / MiB:,.1f}", f"{fwd_bwd(real) / fwd_bwd(keep):.2f}x"]
        rows.append(row)
    m = doc["model"]
    parts = [f"FSDP over 2 gloo processes, {m['layers']} layers, d {m['d_model']} ({m['params'] / 1e6:.1f}M "
             "parameters), batch 2 (one sequence per rank), eager; rank 0, MiB. Peak of the forward + backward, "
             "measured on real tensors (simulated on fake ones, same flags); adds: that peak above what the rank "
             "holds between steps; vs keep: against the first setting.",
             results_io.table(head, "l" + "r" * (len(head) - 1), rows)]
    for r in runs:
        detail = []
        for name in names:
            real, sim = r["measured"][name], r["simulated"][name]
            split = real["phases"]["forward_backward"]["by_category"]
            detail.append([name, f"{fwd_bwd(real) / MiB:,.1f}", f"{fwd_bwd(sim) / MiB:,.1f}",
                           f"{held(real) / MiB:,.1f}",
                           f"{(fwd_bwd(real) - held(real)) / MiB:,.1f}", f"{split['gathered_parameters'] / MiB:,.1f}",
                           f"{split['activations'] / MiB:,.1f}", f"{real['phases']['update']['peak_bytes'] / MiB:,.1f}",
                           f"{sim['phases']['update']['peak_bytes'] / MiB:,.1f}",
                           f"{fwd_bwd(real) / fwd_bwd(r['measured'][names[0]]):.2f}x"])
        parts += [f"{r['optim']}, sequence {r['seq']}:", results_io.table(
            ["setting", "fwd+bwd peak", "simulated", "held", "fwd+bwd adds", "gathered²", "activations²",
             "update peak", "update simulated", "fwd+bwd vs keep gathers"], "lrrrrrrrrr", detail)]
    parts.append("² at the forward + backward peak (measured)")
    if all("whole_update" in r for r in runs):
        parts += [f"The update ({WHOLE}), measured, MiB: the whole-tree update (opt.update + apply_updates over every "
                  "parameter: new parameters and moments beside the old) against the in-place one "
                  "(step.optimizer_step); ratio: whole / in place; step peak: the larger of the forward + backward's "
                  "and the update's.",
                  update_table(runs)]
    return "\n\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--runs", default=RUNS, help="comma-separated optimizer:sequence pairs; optimizer adamw, or "
                                                     "sgd (plain, no state: what gathering adds shows alone)")
    results_io.add_arguments(parser)
    a = parser.parse_args()
    if a.render:
        return results_io.render(a.render, tables)
    from nanomega.config import parse_args
    from nanomega.sim.estimate import estimate
    from nanomega.sim.counting import count_params
    from nanomega.parallel.mesh import model_config
    runs = [(o, int(seq)) for o, seq in (r.split(":") for r in a.runs.split(",") if r)]
    doc = results_io.start("peak")
    spec = {f"{o}:{seq}/{name}": base_args(a, o, seq) + extra for o, seq in runs for name, extra in SETTINGS.items()}
    spec.update({f"{o}:{seq}/{WHOLE}|whole": base_args(a, o, seq) + SETTINGS[WHOLE] for o, seq in runs})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "measured.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", str(out), json.dumps(spec)]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL)
        measured = json.loads(out.read_text())
    print(f"measured {len(measured)} cases", flush=True)
    first = parse_args(next(iter(spec.values())))
    doc.update(model={"layers": a.layers, "d_model": a.d_model, "params": count_params(model_config(first))},
               settings=SETTINGS, runs=[])
    for o, seq in runs:
        keys = {name: f"{o}:{seq}/{name}" for name in SETTINGS}
        doc["runs"].append({"optim": o, "seq": seq, "args": {n: spec[k] for n, k in keys.items()},
                            "measured": {n: measured[k] for n, k in keys.items()},
                            "whole_update": measured[f"{o}:{seq}/{WHOLE}|whole"],
                            "simulated": {n: simulated(estimate, spec, k) for n, k in keys.items()}})
    results_io.write(doc, tables(doc), a.out)
    return 0


def simulated(estimate, spec: dict, key: str) -> dict:
    from nanomega.config import parse_args
    with no_prefetch(key):
        # beside a CPU measurement: simulated with the CPU's kernels, not a GPU's (nanomega/sim/estimate.py)
        return estimate(parse_args(spec[key] + ["--train.device=cpu"]), ranks="0")["ranks"][0]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
