"""Memory and communication of the train step, per rank, simulated: the real step under FakeTensorMode
with torch's fake process group, in one CPU process, allocating nothing.

    python -m nanomega.sim.estimate --config=llama3_8b --parallel.dp_shard=8 --train.seq_len=8192 \\
        --train.activation_checkpointing=full --train.param_dtype=bfloat16 [--json] [--ranks=auto|all|0,7]
    python -m nanomega.sim.estimate --config=llama3_405b --parallel.pp=8 --parallel.tp=8 --parallel.dp_shard=2 ...

It builds what train.py's setup() builds (nanomega/parallel/setup.py: the mesh, each rank keeping its
shards, under pipeline parallel its stages only; the optimizer; make_step_fns) and runs one step of
train.py's loop (fns.grads, then fns.update) once per simulated rank, on fake tensors: shapes, dtypes and
storages are real, the data is not. (train.py's loop frees each step's gradients after its update, so the
next step starts from the held parameters and optimizer state alone: the first step's peak is every
step's.) Every collective and every point-to-point transfer completes at once on the fake process group
(torch.testing's FakeStore + backend "fake", whose send and recv return finished work): so pipeline
parallel runs its real runtime (parallel/pipeline.py walking its schedule's action list, each stage's
activations held from its F to its B or W, the receive buffers allocated as they are), and context
parallel's ring passes its K/V chunks as the real ring does.

What is counted is nanomega/sim/memory_tracker.py's: every storage an op creates, by category (parameters,
gradients, optimizer state, gathered parameters, activations, temporaries), and each collective's bytes
(point-to-point sends as "send").

Limits: eager only (a compiled step saves and fuses differently); the allocator's rounding and
fragmentation, CUDA context, NCCL buffers and workspaces are not counted (the preflight leaves a margin).
Fake tensors carry no values, so where the step's shapes follow its data the simulator takes a stand-in:
- a mixture of experts routes as if balanced (every expert gets N * top_k / E tokens): expert parallel's
  all-to-all is sized so (parallel/experts.py, Exchange.balanced), and float8 experts slice their rows so;
- token dropping (model.capacity_factor > 0) keeps the capacity-bounded worst case, every expert full in
  every sequence (models/moe.py, kept_assignments): a real run keeps as many or fewer;
- context parallel's ring plans its blocks from the layout's positions, which are not data.
Simulated against measured gloo runs of the same small layouts (tests/test_estimate.py): within 10% for
DDP, FSDP, TP, EP (balanced and dropping), pp (1F1B), cp (both methods) and dense float8 (every recipe).
A pipeline's ranks are simulated one at a time, as the others: the bubble costs no memory, and a stage
waiting for its neighbour is not timed here (nanomega/sim/step_time.py's job).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from nanomega import optim
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel.mesh import MESH_DIMS, model_config, validate_layout
from nanomega.sim.memory_tracker import CATEGORIES, HELD, MemoryTracker
from nanomega.train.step import make_step_fns, step_options

# ---------------------------------------------------------------- the step, as train.py runs it

def build(cfg, device: torch.device, tensors=contextlib.nullcontext):
    """train.py's setup(): (model_cfg, params, opt, par), on the process group already initialised.
    The mesh is built outside `tensors` (the fake mode): DeviceMesh reads its rank grid's values."""
    model_cfg = model_config(cfg)
    if cfg.parallel.world_size == 1:
        with tensors():
            params = init(model_cfg, cfg.train.seed, device)
        return model_cfg, params, optim.build(cfg.optim, cfg.train.steps), None
    from nanomega.parallel.setup import setup_parallel  # each shard allocated alone, as on an accelerator;
    return (model_cfg, *setup_parallel(cfg, model_cfg, device, tensors))   # under pp this rank's stages only


def track_step(cfg, tracker: MemoryTracker, device: torch.device, tensors=contextlib.nullcontext) -> dict:
    """Build the run and take one step of train.py's loop under `tracker`; `tensors` is the context the
    tensors are made in (FakeTensorMode to simulate, nothing to measure a real run)."""
    built = list(build(cfg, device, tensors))
    with tensors():
        return _track_steps(cfg, tracker, device, built)


def _track_steps(cfg, tracker, device, built: list) -> dict:
    t = cfg.train
    (model_cfg, params, opt, par), built[:] = built, []    # the loop's references only: the update frees them
    state = opt.init(params)
    tracker.label(params, "parameters")
    tracker.label(state, "optimizer_state")
    fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(t), "compile": False})   # eager: see the module doc
    gen = torch.Generator().manual_seed(t.seed)
    with tracker:
        micro = []
        for _ in range(t.grad_accum):
            tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
            micro.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        with tracker.in_phase("forward_backward"):
            loss, grads, stats = fns.grads(params, micro)
        tracker.label(grads, "gradients")
        with tracker.in_phase("update"):
            params, state = fns.update(grads, state, params, stats)
        tracker.label(params, "parameters")
        tracker.label(state, "optimizer_state")
        held = {k: tracker.current[k] for k in HELD}   # what the optimizer received and keeps
        del loss, micro, tokens, grads     # as train.py's loop does after the update
    return {**tracker.result(), "held_after": held}


# ---------------------------------------------------------------- simulation

@contextlib.contextmanager
def fake_world(world_size: int, rank: int, backend: str = "fake"):
    """This process as `rank` of `world_size` on torch's fake process group (collectives complete at once);
    backend "cpu:fake,meta:fake" takes meta tensors too (nanomega/sim/contracts.py)."""
    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if world_size > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def simulate_rank(cfg, rank: int = 0) -> dict:
    """The tracker's result for `rank` of the layout, on fake tensors (nothing is allocated)."""
    if dist.is_initialized():
        raise RuntimeError("nanomega.sim.estimate simulates in a process without a process group; run it with python, "
                           "not torchrun")
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(cfg.parallel.world_size, rank):
        try:
            return track_step(cfg, MemoryTracker(), torch.device("cpu"), lambda: fake)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            # fake tensors hold no values: a step whose shapes follow its data cannot be simulated
            raise ValueError(f"this step reads tensor values to choose shapes ({err.func}), which fake tensors "
                             "do not have, so it cannot be simulated; the plan's per-rank parameter, gradient "
                             "and state bytes (parallel/memory.py) do not need them") from None


def _in_child(fn, *args):
    """fn(*args) in a forked process: torch keeps process-wide state per process group (device meshes,
    flattened sub-meshes by name) that a second process group in the same process would find stale."""
    return _start_child(fn, *args)()


def _start_child(fn, *args):
    """Start fn(*args) in a forked process (see _in_child); returns the function that waits for its result,
    so several ranks can be simulated at once (nanomega/sim/contracts.py)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", fn(*args)))
        except ValueError as err:
            send.send(("value", str(err)))
        except BaseException as err:   # noqa: BLE001  (reported by the parent)
            import traceback
            send.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        finally:
            send.close()

    proc = ctx.Process(target=child)
    proc.start()
    send.close()

    def result():
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = "error", f"the simulation process died (exit code {proc.join() or proc.exitcode})"
        proc.join()
        if status == "value":
            raise ValueError(value)
        if status == "error":
            raise RuntimeError(f"simulating rank {args[1]}: {value}")
        return value
    return result


def role_ranks(cfg, which: str = "auto") -> list[int]:
    """The ranks to simulate: "all", a comma-separated list, or "auto": the first and the last index on every
    mesh dim (DTensor gives the first ranks of an uneven split the larger chunks, the last the smaller; tp ranks
    hold different vocabulary rows), and under pipeline parallel the first rank of every stage (each holds other
    layers, and the schedule keeps a different number of micro-batches in flight on each)."""
    p = cfg.parallel
    sizes = [getattr(p, d) for d in MESH_DIMS]
    if which == "all":
        return list(range(p.world_size))
    if which != "auto":
        ranks = sorted({int(r) for r in which.split(",")})
        if any(not 0 <= r < p.world_size for r in ranks):
            raise ValueError(f"--ranks={which}: every rank must be in [0, {p.world_size - 1}]")
        return ranks

    def rank_at(coords):    # the mesh is row-major over MESH_DIMS
        r = 0
        for c, size in zip(coords, sizes):
            r = r * size + c
        return r
    ranks = {rank_at([stage] + [0] * (len(sizes) - 1)) for stage in range(p.pp)}
    for corner in range(2 ** len(sizes)):
        ranks.add(rank_at([(size - 1) * ((corner >> i) & 1) for i, size in enumerate(sizes)]))
    return sorted(ranks)


def estimate(cfg, ranks: str = "auto") -> dict:
    """Simulate every rank of role_ranks(cfg, ranks); the largest peak and its split on top."""
    validate_layout(cfg, cfg.parallel.world_size)
    chosen = role_ranks(cfg, ranks)
    if cfg.parallel.world_size == 1:    # no process group: nothing stays behind in this process
        per_rank = {chosen[0]: simulate_rank(cfg, chosen[0])}
    else:
        per_rank = {r: _in_child(simulate_rank, cfg, r) for r in chosen}
    top = max(per_rank, key=lambda r: per_rank[r]["peak_bytes"])
    from nanomega.sim.counting import count_params
    return {"world_size": cfg.parallel.world_size, "n_params": count_params(model_config(cfg)),
            "peak_rank": top, "peak_bytes": per_rank[top]["peak_bytes"], "by_category": per_rank[top]["by_category"],
            "collectives": per_rank[top]["collectives"],
            "collectives_by_phase": per_rank[top].get("collectives_by_phase", {}), "ranks": per_rank}


GiB = 2 ** 30


def what_to_change(cfg, result: dict) -> str:
    """The settings that shrink the largest parts of the simulated peak, largest first."""
    split, p, t = result["by_category"], cfg.parallel, cfg.train
    held = split["parameters"] + split["gradients"] + split["optimizer_state"]
    advice = {
        "held": (held, f"shard parameters, gradients and optimizer state over more ranks "
                       f"(--parallel.dp_shard={p.dp_shard * 2}: {held / GiB:,.1f} GiB of the peak)"),
        "activations": (split["activations"] + split["temporary"],
                        ("recompute activations (--train.activation_checkpointing=full: "
                         if t.activation_checkpointing == "none" else "a smaller micro-batch (")
                        + f"activations and temporaries are {(split['activations'] + split['temporary']) / GiB:,.1f} "
                        f"GiB of the peak)"),
        "batch": (split["activations"],
                  f"a smaller micro-batch (--train.batch_size={t.batch_size // 2} with --train.grad_accum="
                  f"{t.grad_accum * 2} keeps the tokens per step)" if t.batch_size // 2 % p.dp == 0 and t.batch_size > p.dp
                  else f"shorter sequences (--train.seq_len={t.seq_len // 2}; the micro-batch is already one "
                       f"sequence per data-parallel rank)"),
        "gathered": (split["gathered_parameters"], f"bf16 gathers (--train.param_dtype=bfloat16: gathered parameters "
                                                   f"are {split['gathered_parameters'] / GiB:,.1f} GiB)"),
    }
    if t.param_dtype != "float32" or p.dp_shard == 1:   # only FSDP's gathers follow param_dtype
        advice.pop("gathered")
    order = sorted(advice.values(), key=lambda a: -a[0])
    return "try " + "; or ".join(text for size, text in order if size > 0) + "; or pick a smaller --config"




def describe(result: dict) -> str:
    lines = [f"{result['n_params'] / 1e9:.3f}B parameters, {result['world_size']} rank(s); peak "
             f"{result['peak_bytes'] / GiB:.2f} GiB on rank {result['peak_rank']}"]
    head = "rank | peak GiB (phase) | " + " | ".join(CATEGORIES)
    lines += [head, "-" * len(head)]
    for r, res in result["ranks"].items():
        lines.append(f"{r} | {res['peak_bytes'] / GiB:.2f} ({res['peak_phase']}) | "
                     + " | ".join(f"{res['by_category'][c] / GiB:.2f}" for c in CATEGORIES))
    comm = result["collectives"]
    if comm:
        lines.append(f"collectives per step on rank {result['peak_rank']} (bytes sent, ring algorithms): "
                     + ", ".join(f"{k} {v['count']}x {v['bytes_sent'] / GiB:.3f} GiB" for k, v in sorted(comm.items())))
    schedule = [e for e in result["ranks"][result["peak_rank"]].get("schedule", []) if e["phase"] != "update"]
    if schedule:   # memory_tracker's schedule: what each collective of forward and backward can overlap
        kinds = sorted({e["kind"] for e in schedule})
        lines.append("forward + backward, launched ahead of their first use (>= 1 matmul, attention or embedding "
                     "between launch and wait) / all: " + ", ".join(
                         f"{k} {sum(bool(e['compute']) for e in schedule if e['kind'] == k)}/"
                         f"{sum(e['kind'] == k for e in schedule)}" for k in kinds))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    want_json, ranks, rest = False, "auto", []
    for a in argv:
        if a == "--json":
            want_json = True
        elif a.startswith("--ranks="):
            ranks = a.split("=", 1)[1]
        else:
            rest.append(a)
    try:
        cfg = parse_args(rest)
        start = time.perf_counter()
        result = estimate(cfg, ranks)
    except ValueError as err:
        sys.exit(f"error: {err}")
    result["seconds"] = round(time.perf_counter() - start, 2)
    if want_json:
        print(json.dumps({**result, "ranks": {str(k): v for k, v in result["ranks"].items()}}))
    else:
        print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
