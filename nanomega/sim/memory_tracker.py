"""Memory of any torch code, by what each byte is for, and the collectives it issues: on real or fake tensors.

    tracker = MemoryTracker()
    tracker.label(params, "parameters")        # tensors made before tracking began
    with tracker:
        ...                                    # a train step, DTensors included
    tracker.result()                           # {"peak_bytes", "peak_phase", "by_category", "phases", "collectives",
                                               #  "schedule"}

A TorchDispatchMode: it sees every op, reads only sizes and storage lifetimes (so fake tensors work), and
is what nanomega/sim/estimate.py's simulator and the benchmarks' measured peaks share.

What is counted: every storage an op creates, from its creation to its release, in one category:
    parameters           the parameter leaves (storage placements), before and after the update
    gradients            what a backward leaves behind (reduce-scattered per block or whole), summed
                         over micro-batches, as the optimizer receives them
    optimizer_state      opt.init's and opt.update's state
    gathered_parameters  made from parameters alone outside the update: all-gathers, casts, copies
    activations          saved by autograd for the backward (torch.autograd.graph.saved_tensors_hooks)
    temporary            the rest: batches, buffers freed within an op or a block, recomputation
and one workspace no op returns: a GPU's fused attention backward (flash, memory-efficient, cuDNN) holds an
fp32 accumulator of dq and the rows' fp32 sums while it runs (FlashAttention-2 also whole-head dk, dv under
GQA), charged as a temporary for the op's duration (`attention_workspace`).
The peak is the largest sum of live bytes, its split the categories of what was live at that moment.
Collectives: per kind, the count and the bytes this rank sends per step, as ring algorithms send them
(all-gather and reduce-scatter (n-1)/n of the whole buffer, all-reduce twice that, all-to-all all
but its own chunk); point-to-point sends (pipeline stages, the context-parallel ring) as "send", whole.
Schedule: for each collective, in launch order, where in the op stream it was launched and where its result
was first waited for (c10d wait_tensor: a functional collective is waited at the first use of its result),
and how many ops, and compute ops (COMPUTE: matmuls, attention, embedding lookups) among them, ran in between:
what can overlap it, as the code schedules it. A collective waited right after its launch has 0 compute ops
between; one launched ahead (FSDP's prefetch, a reduce-scatter left in flight) has the compute it overlaps.
Under a fake mode functional collectives would wait at once (they take it for tracing); the tracker keeps
them in flight as an eager step does.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten as pytree_flatten
from torch.utils.weak import WeakIdKeyDictionary

import nanomega.models.moe  # noqa: F401  (registers nanomega::grouped_mm: the experts' GEMM in fp32, COMPUTE)

CATEGORIES = ("parameters", "gradients", "optimizer_state", "gathered_parameters", "activations", "temporary")
HELD = ("parameters", "gradients", "optimizer_state")

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
# the compute a collective can overlap, counted in the schedule (all ops are counted too): matmuls, attention,
# embedding lookups, and their backward
COMPUTE = frozenset({
    aten.embedding.default, aten.embedding_dense_backward.default,
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten._grouped_mm.default,
    aten._scaled_mm.default, aten._scaled_grouped_mm.default, torch.ops.nanomega.grouped_mm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
})
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
# the GPU's fused attention backward kernels: (grad_out, query, key, value, ...) each
FUSED_ATTENTION_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
})


def attention_workspace(func, args) -> int:
    """Bytes a fused attention backward allocates for itself while it runs, no op returning them: an fp32
    accumulator of dq [B, H, Tq, Dqk] and fp32 row sums (rowsum(dO * O)) [B, H, Tq], as FlashAttention-2
    (dq_accum, softmax_d), the CUTLASS memory-efficient kernel (its fp32 grad-q workspace, delta) and cuDNN
    (dQ accumulator, softmax sums) keep them; FlashAttention-2 under grouped-query attention also computes dk
    and dv for every query head (dk_expanded, dv_expanded) before summing them per key head. Tile rounding
    (FlashAttention-2 rounds Tq up to 128 and Dqk to 32) is left out."""
    q, k, v = args[1:4]
    b, h, tq, d = q.shape
    nbytes = 4 * b * h * tq * (d + 1)
    if func is aten._scaled_dot_product_flash_attention_backward.default and k.shape[1] != h:
        nbytes += b * h * k.shape[2] * (k.shape[-1] + v.shape[-1]) * k.element_size()
    return nbytes


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
        self.schedule: list[dict] = []          # per collective, in launch order (module doc)
        self._unwaited = WeakIdKeyDictionary()  # a pending collective's output storage -> (its entry, compute then)
        self.ops, self.compute = 0, 0           # the op stream so far: ops, and COMPUTE ops among them
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
        self._hold(rec, lambda key: weakref.ref(storage, lambda _: self._free(key)))
        return rec

    def _hold(self, rec: _Record, release=lambda key: None) -> int:
        """Count rec live (release(key): what frees it) and the peak it makes; its key for _free."""
        key = id(rec)
        self._live[key] = (rec, release(key))
        self.current[rec.category] += rec.nbytes
        peak = self.peaks.setdefault(self.phase, [0, [], False])
        if self.total > peak[0]:
            peak[0], peak[2] = self.total, True
        return key

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
                "collectives_by_phase": self.collectives_by_phase, "schedule": self.schedule}

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
        restore = [lambda: delattr(prop, "_propagate_tensor_meta_non_cached")]
        if self._fake_on_entry is not None:
            # Functional collectives take an active fake mode for tracing and wait at once; an eager step waits
            # at the first use of the result. Keep them in flight, so the schedule is the one the code makes
            # (but for differentiable collectives, whose wrapper's fake kernel would cut the graph).
            wait_at_once = funcol._maybe_wrap_tensor
            funcol._maybe_wrap_tensor = lambda t: (wait_at_once(t) if torch.compiler.is_compiling() or t.requires_grad
                                                   else funcol.AsyncCollectiveTensor(t))
            restore.append(lambda: setattr(funcol, "_maybe_wrap_tensor", wait_at_once))
        self._restore = lambda: [undo() for undo in restore]
        return super().__enter__()

    def __exit__(self, *exc):
        self._restore()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor or t is funcol.AsyncCollectiveTensor or getattr(t, "unwraps_itself", False) for t in types):
            # let DTensor turn itself into local ops, and a pending collective's result wait (for any op but a
            # view; or compute what waits for it: parallel/deferred.py's Deferred), which come back here
            return NotImplemented
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
            self._launched(_KIND[func], backward, out)
        elif func is torch.ops.c10d.send.default:   # point to point (pipeline stages, the cp ring): all of it sent
            self._tally("send", sum(t.numel() * t.element_size() for t in args[0]))
        elif func is c10d.wait_tensor.default:
            self._waited(args[0])
        else:
            self.ops += 1
            self.compute += func in COMPUTE
        inputs = [self._records.get(st) for a in pytree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                  for st in _storages(a)]
        from_params = bool(inputs) and all(r is not None and r.category in ("parameters", "gathered_parameters")
                                           for r in inputs)
        category = "gathered_parameters" if from_params and self.phase != "update" else "temporary"
        for t in pytree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st, category, backward, func.__name__)
        if func in FUSED_ATTENTION_BACKWARD:     # its workspace, live while it runs beside its outputs
            self._free(self._hold(_Record(attention_workspace(func, args), "temporary", backward, func.__name__)))
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
        self._tally(kind, sent)

    def _tally(self, kind: str, sent: float) -> None:
        for c in (self.collectives.setdefault(kind, {"count": 0, "bytes_sent": 0}),
                  self.collectives_by_phase.setdefault(self.phase, {}).setdefault(kind, {"count": 0, "bytes_sent": 0})):
            c["count"] += 1
            c["bytes_sent"] += int(sent)

    def _launched(self, kind: str, backward: bool, out) -> None:
        entry = {"kind": kind, "phase": self.phase, "backward": backward, "launched": self.ops, "waited": None,
                 "ops": None, "compute": None}
        self.schedule.append(entry)
        for t in pytree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._unwaited[st] = entry, self.compute

    def _waited(self, t: torch.Tensor) -> None:
        """The first wait for a collective's result (later ones find it done)."""
        for st in _storages(t):
            entry, compute = self._unwaited.pop(st, (None, 0))
            if entry is not None and entry["waited"] is None:
                entry["waited"], entry["ops"] = self.ops, self.ops - entry["launched"]
                entry["compute"] = self.compute - compute


def _resolve(group):
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group)


def _storages(t: torch.Tensor):
    if isinstance(t, DTensor):
        t = t._local_tensor
    return get_untyped_storages(t)
