"""Memory and communication of the train step, per rank, simulated: the real step under FakeTensorMode
with torch's fake process group, in one CPU process, allocating nothing.

    python -m nanomega.estimate --config=llama3_8b --parallel.dp_shard=8 --train.seq_len=8192 \\
        --train.activation_checkpointing=full --train.param_dtype=bfloat16 [--json] [--ranks=auto|all|0,7]

It builds what train.py's setup() builds (model_config, Parallel, init with each rank keeping its
shard, ParallelOptimizer, make_step_fns) and runs one step of train.py's loop (fns.grads, then
fns.update) once per simulated rank, on fake tensors: shapes, dtypes and storages are real, the data
is not. (train.py's loop frees each step's gradients after its update, so the next step starts from the
held parameters and optimizer state alone: the first step's peak is every step's.) Every
collective completes at once on the fake process group (torch.testing's FakeStore + backend "fake").

What is counted is nanomega/memory_tracker.py's: every storage an op creates, by category (parameters,
gradients, optimizer state, gathered parameters, activations, temporaries), and each collective's bytes.

Limits: eager only (a compiled step saves and fuses differently); the allocator's rounding and
fragmentation, CUDA context, NCCL buffers and workspaces are not counted (the preflight leaves a margin);
a mixture of experts is simulated with balanced routing (every expert gets N * top_k / E tokens), since
fake tensors carry no routing decisions: expert parallel's all-to-all is sized so (parallel/experts.py,
Exchange.balanced). Token dropping is refused: how many assignments survive is the routing's to decide.
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
from nanomega.memory_tracker import CATEGORIES, HELD, MemoryTracker
from nanomega.models import init
from nanomega.parallel.mesh import MESH_DIMS, build_mesh, model_config, validate_layout
from nanomega.step import make_step_fns, step_options


# ---------------------------------------------------------------- the step, as train.py runs it

def build(cfg, device: torch.device, tensors=contextlib.nullcontext):
    """train.py's setup(): (model_cfg, params, opt, par), on the process group already initialised.
    The mesh is built outside `tensors` (the fake mode): DeviceMesh reads its rank grid's values."""
    model_cfg = model_config(cfg)
    if cfg.parallel.world_size == 1:
        with tensors():
            params = init(model_cfg, cfg.train.seed, device)
        return model_cfg, params, optim.build(cfg.optim, cfg.train.steps), None
    from nanomega.parallel.optimizer import ParallelOptimizer
    from nanomega.parallel.parallelize import Parallel
    par = Parallel(cfg, build_mesh(cfg, device.type), init(model_cfg, device="meta"))
    with tensors():   # each shard allocated alone, as on an accelerator (Parallel.shard)
        params = init(model_cfg, cfg.train.seed, "cpu", place=lambda name, part: par.shard(name, part, device))
    return model_cfg, params, ParallelOptimizer(cfg, par, cfg.train.steps), par


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
    backend "cpu:fake,meta:fake" takes meta tensors too (nanomega/contracts.py)."""
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
        raise RuntimeError("nanomega.estimate simulates in a process without a process group; run it with python, "
                           "not torchrun")
    m = cfg.model
    if m.n_experts and m.capacity_factor:
        # the kept assignments are a nonzero() over the routing (models/moe.py): a shape fake tensors cannot give
        raise ValueError(
            f"token dropping (--model.capacity_factor={m.capacity_factor}) keeps as many assignments as the "
            "routing decides, which fake tensors do not carry; simulate the dropless step "
            "(--model.capacity_factor=0): under balanced routing a capacity factor >= 1 drops nothing, so it "
            "moves the same rows (--model.pad_to_capacity=true pads every expert to its capacity: more)")
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
    so several ranks can be simulated at once (nanomega/contracts.py)."""
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
    hold different vocabulary rows), i.e. at most 8 ranks."""
    p = cfg.parallel
    sizes = [getattr(p, d) for d in MESH_DIMS]
    if which == "all":
        return list(range(p.world_size))
    if which != "auto":
        ranks = sorted({int(r) for r in which.split(",")})
        if any(not 0 <= r < p.world_size for r in ranks):
            raise ValueError(f"--ranks={which}: every rank must be in [0, {p.world_size - 1}]")
        return ranks
    ranks = {0}
    for corner in range(2 ** len(sizes)):
        coords = [(size - 1) * ((corner >> i) & 1) for i, size in enumerate(sizes)]
        ranks.add((coords[0] * sizes[1] + coords[1]) * sizes[2] + coords[2])
    return sorted(ranks)


def estimate(cfg, ranks: str = "auto") -> dict:
    """Simulate every rank of role_ranks(cfg, ranks); the largest peak and its split on top."""
    validate_layout(cfg, cfg.parallel.world_size)
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:
        # pipeline parallel's point-to-point transfers complete at once on the fake process group (so a
        # stage's activations in flight would come out, unchecked), and context parallel's ring plans its
        # blocks from position values: neither is validated against a measured run yet
        raise ValueError("pipeline and context parallel (parallel.pp, parallel.cp) are not simulated yet; simulate "
                         "one stage's layout without them (parallel.pp=1, parallel.cp=1) and its layers "
                         "(--model.n_layers) to bound a stage's peak")
    chosen = role_ranks(cfg, ranks)
    if cfg.parallel.world_size == 1:    # no process group: nothing stays behind in this process
        per_rank = {chosen[0]: simulate_rank(cfg, chosen[0])}
    else:
        per_rank = {r: _in_child(simulate_rank, cfg, r) for r in chosen}
    top = max(per_rank, key=lambda r: per_rank[r]["peak_bytes"])
    from nanomega.metrics import count_params
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
