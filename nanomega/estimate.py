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

What is counted (MemoryTracker, which measures real runs too): every storage an op creates, from its
creation to its release, in one category:
    parameters           the parameter leaves (storage placements), before and after the update
    gradients            what a backward leaves behind (reduce-scattered per block or whole), summed
                         over micro-batches, as the optimizer receives them
    optimizer_state      opt.init's and opt.update's state
    gathered_parameters  made from parameters alone outside the update: all-gathers, casts, copies
    activations          saved by autograd for the backward (torch.autograd.graph.saved_tensors_hooks)
    temporary            the rest: batches, buffers freed within an op or a block, recomputation
The peak is the largest sum of live bytes, its split the categories of what was live at that moment.
Collectives: per kind, the count and the bytes this rank sends per step, as ring algorithms send them
(all-gather and reduce-scatter (n-1)/n of the whole buffer, all-reduce twice that, all-to-all all
but its own chunk).

Limits: eager only (a compiled step saves and fuses differently); the allocator's rounding and
fragmentation, CUDA context, NCCL buffers and workspaces are not counted (the preflight leaves a margin);
a mixture of experts is simulated with balanced routing (every expert gets N * top_k / E tokens), since
fake tensors carry no routing decisions: expert parallel's all-to-all is sized so (parallel/experts.py,
Exchange.balanced). Token dropping is refused: how many assignments survive is the routing's to decide.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten as pytree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from nanomega import optim
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel.mesh import MESH_DIMS, build_mesh, model_config, validate_layout
from nanomega.parallel.plan import as_dtensor
from nanomega.step import make_step_fns, step_options
from nanomega.tree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_state", "gathered_parameters", "activations", "temporary")
HELD = ("parameters", "gradients", "optimizer_state")

c10d = torch.ops._c10d_functional
# per kind: the fraction of the (input, output) buffer this rank sends, for a group of n
_SENT = {
    "all_gather": lambda n, inp, out: out * (n - 1) / n,
    "reduce_scatter": lambda n, inp, out: inp * (n - 1) / n,
    "all_reduce": lambda n, inp, out: 2 * inp * (n - 1) / n,
}
_KIND = {
    c10d.all_gather_into_tensor.default: "all_gather", c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce", c10d.all_reduce_.default: "all_reduce",
    c10d.all_reduce_coalesced.default: "all_reduce", c10d.all_reduce_coalesced_.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all", c10d.broadcast.default: "broadcast",
    c10d.broadcast_.default: "broadcast",
}
_AUTOGRAD_COLLECTIVES = {
    torch.ops._c10d_functional_autograd.all_to_all_single.default: "all_to_all",
    torch.ops._c10d_functional_autograd.all_gather_into_tensor.default: "all_gather",
    torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default: "reduce_scatter",
}
_KIND.update(_AUTOGRAD_COLLECTIVES)


def _group_size(name) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(name).size()


class _Record:
    __slots__ = ("nbytes", "category", "in_backward", "op")

    def __init__(self, nbytes: int, category: str, in_backward: bool, op: str = ""):
        self.nbytes, self.category, self.in_backward, self.op = nbytes, category, in_backward, op


class MemoryTracker(TorchDispatchMode):
    """Live storages by category (module doc), their peak, and the collectives issued. Works on real and
    on fake tensors: it reads only sizes and storage lifetimes.

        tracker = MemoryTracker()
        tracker.label(params, "parameters")        # tensors made before tracking began
        with tracker:
            ...                                    # any torch code, DTensors included
        tracker.result()                           # peak bytes, by category, per phase; collectives
    """

    def __init__(self):
        super().__init__()
        self._records = WeakIdKeyDictionary()   # storage -> _Record
        self._live = {}                         # id(record) -> (record, weakref of its storage)
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.phase = ""
        self.peaks = {}                         # phase -> [peak bytes, the records live then, dirty]
        self.collectives: dict[str, dict] = {}
        self.collectives_by_phase: dict[str, dict] = {}     # phase -> kind -> count, bytes (the update's apart)
        self._was_backward = False
        self._fake_on_entry = None
        self._propagating = 0

    # ------------------------------------------------------------ storages

    def _add(self, storage, category: str, backward: bool = False, op: str = "") -> _Record:
        rec = self._records.get(storage)
        if rec is not None:
            return rec
        rec = _Record(storage.nbytes(), category, backward, op)
        self._records[storage] = rec
        key = id(rec)
        self._live[key] = (rec, weakref.ref(storage, lambda _, key=key: self._free(key)))
        self.current[category] += rec.nbytes
        peak = self.peaks.setdefault(self.phase, [0, [], False])
        if self.total > peak[0]:
            peak[0], peak[2] = self.total, True
        return rec

    def _free(self, key: int) -> None:
        # a peak is reached just before something is freed: remember what was live then
        self._snapshot()
        rec, _ = self._live.pop(key)
        self.current[rec.category] -= rec.nbytes

    def _snapshot(self) -> None:
        for peak in self.peaks.values():
            if peak[2]:
                peak[1], peak[2] = [r for r, _ in self._live.values()], False

    def _relabel(self, rec: _Record, category: str) -> None:
        self.current[rec.category] -= rec.nbytes
        rec.category = category
        self.current[category] += rec.nbytes

    @property
    def total(self) -> int:
        return sum(self.current.values())

    def label(self, tree, category: str) -> None:
        """Put every tensor storage of `tree` (DTensors: their local shards) in `category`."""
        for t in pytree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    rec = self._records.get(st)
                    if rec is None:
                        self._add(st, category)
                    elif rec.category != category:
                        self._relabel(rec, category)

    @contextlib.contextmanager
    def in_phase(self, name: str):
        self._snapshot()     # a pending peak belongs to the phase before
        before, self.phase = self.phase, name
        try:
            yield
        finally:
            self._snapshot()
            self.phase = before

    def result(self) -> dict:
        """The peak over phases and its split."""
        self._snapshot()
        phases = {}
        for phase, (peak, records, _) in self.peaks.items():
            split = dict.fromkeys(CATEGORIES, 0)
            for r in records:
                split[r.category] += r.nbytes
            largest = sorted(records, key=lambda r: -r.nbytes)[:5]
            phases[phase] = {"peak_bytes": sum(split.values()), "by_category": split,
                             "largest": [(r.category, r.op, r.nbytes) for r in largest]}
        top = max(phases, key=lambda k: phases[k]["peak_bytes"])
        return {"peak_bytes": phases[top]["peak_bytes"], "peak_phase": top, "by_category": phases[top]["by_category"],
                "phases": phases, "held_after": {k: self.current[k] for k in HELD}, "collectives": self.collectives,
                "collectives_by_phase": self.collectives_by_phase}

    # ------------------------------------------------------------ tracking

    def __enter__(self):
        from torch._guards import active_fake_mode
        self._fake_on_entry = active_fake_mode()
        # DTensor derives each op's global output shape by running it on fake global-shape tensors, in the
        # active fake mode if there is one: under simulation those ops would pass here as allocations (a
        # whole global batch or weight each). Mark them; eager real runs use a fresh fake mode, skipped below.
        prop = DTensor._op_dispatcher.sharding_propagator
        original = prop._propagate_tensor_meta_non_cached

        def propagate(op_schema):
            self._propagating += 1
            try:
                return original(op_schema)
            finally:
                self._propagating -= 1

        prop._propagate_tensor_meta_non_cached = propagate
        self._restore = lambda: delattr(prop, "_propagate_tensor_meta_non_cached")
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented       # let DTensor turn itself into local ops, which come back here
        kwargs = kwargs or {}
        from torch._guards import active_fake_mode
        if func is c10d.wait_tensor.default and active_fake_mode() is not None:
            out = args[0]           # the fake kernel returns a copy; eager waits in place
        else:
            out = func(*args, **kwargs)
        if self._propagating or active_fake_mode() is not self._fake_on_entry:
            return out             # DTensor's sharding propagation on fake global-shape tensors
        backward = torch._C._current_graph_task_id() != -1
        if backward != self._was_backward:
            # A backward starts: what the forward made and still holds is kept for it (activations). One
            # ends: what it made and still holds is gradients. Saved-tensor hooks cannot tell: the
            # innermost hooks alone see a saved tensor, and FSDP's re-gather and recomputation use their own.
            before, after = ("temporary", "activations") if backward else ("temporary", "gradients")
            for rec in list(self._records.values()):
                if rec.category == before and rec.in_backward != backward:
                    self._relabel(rec, after)
        self._was_backward = backward
        if func in _KIND:
            self._count(func, args, kwargs, out)
        inputs = [self._records.get(st) for a in pytree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                  for st in _storages(a)]
        from_params = bool(inputs) and all(r is not None and r.category in ("parameters", "gathered_parameters")
                                           for r in inputs)
        category = "gathered_parameters" if from_params and self.phase != "update" else "temporary"
        for t in pytree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st, category, backward, func.__name__)
        return out

    def _count(self, func, args, kwargs, out) -> None:
        kind = _KIND[func]
        if func in _AUTOGRAD_COLLECTIVES or kind == "all_to_all":
            inp, group = args[0], args[-1]
        else:
            inp, group = args[0], args[-1]
        n = _group_size(group)
        inputs = inp if isinstance(inp, (list, tuple)) else [inp]
        outs = out if isinstance(out, (list, tuple)) else [out]
        in_bytes = sum(t.numel() * t.element_size() for t in inputs)
        out_bytes = sum(t.numel() * t.element_size() for t in outs)
        if kind == "all_to_all":
            splits = args[2]    # input split sizes (rows), None for equal
            rows = inputs[0].shape[0] if inputs[0].dim() else 1
            mine = (splits[dist.get_rank(_resolve(group))] if splits else rows / n) / max(rows, 1)
            sent = in_bytes * (1 - mine)
        elif kind == "broadcast":
            sent = in_bytes
        else:
            sent = _SENT[kind](n, in_bytes, out_bytes)
        for c in (self.collectives.setdefault(kind, {"count": 0, "bytes_sent": 0}),
                  self.collectives_by_phase.setdefault(self.phase, {}).setdefault(kind, {"count": 0, "bytes_sent": 0})):
            c["count"] += 1
            c["bytes_sent"] += int(sent)


def _resolve(group):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group)


def _storages(t: torch.Tensor):
    if isinstance(t, DTensor):
        t = t._local_tensor
    return get_untyped_storages(t)


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

    def place(name, whole):
        shard = par.shard(name, whole, device)
        local = shard._local_tensor
        if local.untyped_storage().nbytes() == local.nbytes:
            return shard
        # On the CPU a shard of the first dim is a view that keeps the whole parameter's storage; on an
        # accelerator, the copy to it holds the shard alone. Count the accelerator's bytes.
        layout = par.layouts[name]
        return as_dtensor(local.clone(), layout.mesh, layout.storage, layout.shape).requires_grad_(True)

    with tensors():
        params = init(model_cfg, cfg.train.seed, "cpu", place=place)
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
def fake_world(world_size: int, rank: int):
    """This process as `rank` of `world_size` on torch's fake process group (collectives complete at once)."""
    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if world_size > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
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
                        (f"recompute activations (--train.activation_checkpointing=full: "
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
