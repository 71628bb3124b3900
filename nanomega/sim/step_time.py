"""Time of the train step, per layout, modelled from the simulator's own run of the step (nanomega/sim/estimate.py).
One idea in one file of ~950 lines: one trace replayed on two clocks; the trace, the replay, a pipeline's replay
across its stages, the optimizer's amortized refreshes and the command line all read the same op and collective
records, so they stay together.

    python -m nanomega.sim.step_time --config=llama3_8b --parallel.dp_shard=8 --train.batch_size=16 \\
        --train.activation_checkpointing=selective --train.param_dtype=bfloat16 --gpu=h100 [--compiled] [--fp8] [--json]

One trace, many timings. `trace(cfg)` runs the real step of one rank under fake tensors and the fake process
group (estimate.track_step) with `StepTrace`, a MemoryTracker that also writes down, in the order the step
issues them:
    each op         its FLOPs (torch.utils.flop_counter's formula for matmuls; attention below), the bytes it
                    reads and writes (inputs + outputs; views move nothing), its class (matmul, attention,
                    pointwise, other) and whether it ran in the backward
    each collective its kind, the bytes this rank sends (ring algorithms, memory_tracker's count), its group's
                    global ranks, where in the op stream it was launched and where its result was first waited
                    for (memory_tracker's schedule: FSDP's prefetch one unit ahead, reduce-scatters left in
                    flight in the backward are as the code schedules them). Point-to-point transfers (context
                    parallel's ring) are entries of kind "send": bytes, the pair of ranks, launched at the
                    send, waited at the first op that reads the received buffer (Work.wait is no op).
                    Context parallel's all-gathers of K/V and their reduce-scatters, and expert parallel's
                    all-to-alls, are ordinary collectives of the trace.
`time_step(trace, device)` then replays the stream on two clocks, compute and communication:
    op          max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)) + a per-kernel overhead
    collective  bytes sent / (link bandwidth x bus efficiency) + a start-up latency, on one communication
                stream (collectives share the links); it starts when launched and the link is free, and the
                compute clock waits for it where its result is first used: what it adds there is its exposure
The link: NVLink when every rank of the group is in one node, else the network (8 GPUs a node, global rank
r in node r // 8: the mesh's innermost dims, tp then cp then dp_shard, are the intra-node ones, as in
torchrun's and DeviceMesh's rank order). An all-to-all (expert parallel's dispatch and combine) is no ring: each
peer gets its own slice, so across nodes the slices for the peers in the rank's own node go over NVLink while
the others cross the network at once (off_node_share: an ep group of 64 over 8 nodes sends 56/63 of its bytes
over the network, one of 8 inside a node sends all of them over NVLink).
MoE experts: a grouped GEMM (torch._grouped_mm, nanomega's grouped_mm) is class "grouped", charged at the peak x
Efficiency.grouped_matmul, a constant fixed before the MoE comparison (devices.py): small expert shapes do not
reach a large GEMM's rate.
Overlap: every collective is waited where the code waits for it, so an all-to-all that the code waits for at
once (nanomega's experts today: dispatch, then the experts' GEMMs need its rows) is exposed whole. The one named
term that changes this is time_step's `hidden` (predict's variant key "hidden"): collective kinds overlapped with
work the trace does not show beside them (another micro-batch's forward or backward, as Megatron's
moe_a2a_overlap and Kimi K2's interleaved 1F1B run the all-to-all), waited at the step's end instead; they still
queue on the one communication stream, so what the compute cannot cover stays exposed. Off by default; a
change that overlaps the all-to-all in the code shows it in the trace instead, where it is launched and waited.
A causal attention kernel (is_causal) costs half of the square's FLOPs (torch's formula counts the square); one
with a mask (document masking, whose kernel cannot skip) or none (a context-parallel block every query sees) the
whole square.
Compiled (torch.compile), priced per kernel by one rule fixed before the published comparison (fused_kernels):
Inductor fuses a run of fusible ops (pointwise-tagged ops; the row reductions it emits as one loop: sum, mean,
amax, var, softmax and log-softmax, layer and RMS norms, the loss's nll; casts and copies) into one kernel, which
reads each tensor its ops read and did not make once and writes each tensor it made that a later op (or a
collective, or nothing: the step's output) reads once, at HBM bandwidth, for one kernel's overhead. The run ends
at any other op (matmuls, attention, grouped GEMMs, embeddings, gathers and scatters: their own kernels, so a
norm fuses with its neighbours' pointwise ops but not into the matmul), at a collective's launch or wait, and
where the forward meets the backward; the optimizer's update is not fused (torchtitan's foreach AdamW runs
eagerly beside its compiled model). Not modelled: Inductor's recomputation of fused ops in the backward (its
min-cut partitioner), matmul epilogues (max-autotune's templates), and CUDA graphs.
"fp8" runs every matmul that does not touch the vocabulary (the blocks', not the output head's, as
torchtitan's and Transformer Engine's recipes leave it) at the device's fp8 peak; the scaling's own casts
are charged as the ops they are (compiled: inside the fused kernels).

Pipeline parallel, replayed across the stages (predict; its sends complete at once on the fake process group, so
the trace of one rank cannot show the waits between stages). Each stage is composed from pp=1 traces of one and
two blocks: "base" (the embedding, the head and loss, the step's constant work) and what one block adds, each
split by time_step's "pipe" record into forward and backward (with the waits inside them: tensor parallel's
collectives), the embedding's ops apart (aten.embedding and its backward: the first stage's), the update, and
the step-end reduction's seconds (collectives the forward or backward launched and nothing before the step's
end waits for, and the data-parallel reductions launched in the last backward, waited there or not). Virtual
stage s gets its own blocks (parallel.pp_layers, or mesh.stages_layers' split as the runtime makes it), the
first the embedding, the last the head and loss; per micro-batch, F and B times. The
schedule's action lists (parallel/schedules.py, imported) are replayed on those times (replay_pipeline: each
rank runs its list in order, an action starts when its rank is free and its input has arrived), a transfer
between ranks taking one micro-batch's residual stream over NVLink or the network by the global ranks it joins
(pp is the mesh's outermost dim: pipeline rank r's ranks start at r x world / pp; with sequence parallel the
stream is split over tp). Each virtual stage's data-parallel reduction is launched as its last backward ends
(parallel/pipeline.py's weight_pass flushes it there) on its rank's one communication stream, so the cool-down
hides what it can; the step ends when every rank has finished its actions and reductions, plus the slowest
rank's update (the clip norm joins the stages). Reported: bubble_s (the busiest rank's idle time, transfers
free), "send" (what the transfers add), the reductions' tail past the last action by kind, the in-action waits
of the busiest rank. Not modelled: the code's lockstep transfer batches (a send waits for its batch:
schedules.p2p_program), a transfer's contention with the reductions, tied embeddings shared by the first and last
stage (nanomega refuses them under pp). ZB-V is refused: its split backward (I, W) has no trace of its own.
Large models: `predict(..., layers=(a, b))` simulates a and b blocks and extrapolates every figure linearly
to n_layers (the blocks are identical: each adds the same ops, collectives and bytes).

The optimizer's share (bench/optimizer_cost.py): every figure comes back split by the step's phases
(estimate.track_step's "forward_backward" and "update"): compute, collective time and bytes, and the exposure
of each phase's collectives; the phases sum to the step. Dense factorizations that flop_counter does not count
(eigh, QR, Cholesky, LU solve, inverse: Shampoo's roots, SOAP's bases) are class "linalg", on their standard
LAPACK FLOP counts (linalg_flops) at the device's fp32 peak x Efficiency.linalg; a float32 matmul (the matrix
optimizers' factors and rotations) runs at the fp32 peak, as torch's default (no TF32) runs it on a GPU.
Periodic work: the optimizers choose "refresh now?" with optim.linalg.branch, which on fake tensors runs both
branches; StepTrace writes down, for each op, the branch functions it ran inside (their qualified names), and
time_step(drop=...) charges nothing for the ops of the branches named, so one trace gives the steady step (the
refresh dropped) and the refresh step (the keep dropped): amortized = steady + (refresh - steady) / frequency
(each optimizer registers which branch is which, optim.REGISTRY[name].branches; update_cost() does the sums).

Not modelled: compute slowed by concurrent communication (SM and HBM contention), stragglers, data loading,
the allocator, and host (Python) overheads beyond the per-kernel constant.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

import torch
from torch.utils import flop_counter
from torch.utils.weak import WeakIdKeyDictionary

from nanomega import optim
from nanomega.optim import linalg as optim_linalg
from nanomega.sim.counting import flops_per_token
from nanomega.sim.devices import Device, Efficiency
from nanomega.sim.devices import device as device_named
from nanomega.sim.memory_tracker import MemoryTracker, _storages

aten = torch.ops.aten
GPUS_PER_NODE = 8
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
_GROUPED = {aten._grouped_mm, aten._scaled_grouped_mm}     # an MoE's experts: class "grouped" (module doc)


_EMBEDDING = {aten.embedding, aten.embedding_dense_backward}   # the first pipeline stage's own work (module doc)
# Inductor's fusible ops besides the pointwise-tagged ones ("Compiled", module doc): the row reductions it emits as
# one loop (norms, softmax, the loss's), and casts and copies
_FUSIBLE = {aten.sum, aten.mean, aten.amax, aten.amin, aten.var_mean, aten.var, aten._softmax, aten._log_softmax,
            aten._softmax_backward_data, aten._log_softmax_backward_data, aten.native_layer_norm,
            aten.native_layer_norm_backward, aten._fused_rms_norm, aten._fused_rms_norm_backward,
            aten.linalg_vector_norm, aten.logsumexp, aten.nll_loss_forward, aten.nll_loss_backward, aten._to_copy,
            aten.copy_, aten.clone}
_P2P = (torch.ops.c10d.send.default, torch.ops.c10d.recv_.default)
_NO_KERNEL = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten._unsafe_view, aten.detach,
              aten.lift_fresh, aten.alias}


# Standard FLOP counts of the dense factorizations, per matrix of rows m x cols n (square: n x n), summed over a
# batch. LAPACK Working Note 41 (Blackford & Dongarra, "Installation Guide for LAPACK", table of operation
# counts) and Golub & Van Loan, Matrix Computations (4th ed.) 5.2.2, 5.1.6, 8.3:
#   QR, R and the thin Q (geqrf + orgqr, m >= n)   2mn^2 - 2n^3/3 each: 4mn^2 - 4n^3/3 (square: 8n^3/3)
#   QR, R only (mode "r")                          2mn^2 - 2n^3/3
#   symmetric eigh with eigenvectors (syevd)        9n^3 (tridiagonal reduction 4n^3/3, its back-transformation
#                                                   and the divide-and-conquer update of the vectors: GVL's ~9n^3)
#   symmetric eigenvalues only                      4n^3/3 (the reduction; the tridiagonal solve is O(n^2))
#   Cholesky (potrf)                                n^3/3
#   LU solve with k right-hand sides (gesv)         2n^3/3 + 2n^2 k;   inverse (getrf + getri)  2n^3
_FACTORIZATIONS = {aten.linalg_qr, aten._linalg_eigh, aten.linalg_cholesky_ex, aten.cholesky, aten._linalg_solve_ex,
                   aten.linalg_inv_ex, aten.inverse}


def linalg_flops(packet, args, kwargs, out) -> float | None:
    """FLOPs of one factorization op (the counts above), or None if `packet` is not one."""
    if packet not in _FACTORIZATIONS:
        return None
    a = args[0]
    batch = math.prod(a.shape[:-2])
    m, n = a.shape[-2], a.shape[-1]
    if packet is aten.linalg_qr:
        k = min(m, n)
        r = 2 * max(m, n) * k * k - 2 * k ** 3 / 3
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "reduced")
        return batch * (r if mode == "r" else 2 * r)
    if packet is aten._linalg_eigh:
        vectors = args[2] if len(args) > 2 else kwargs.get("compute_v", True)
        return batch * (9 * n ** 3 if vectors else 4 * n ** 3 / 3)
    if packet in (aten.linalg_cholesky_ex, aten.cholesky):
        return batch * n ** 3 / 3
    if packet is aten._linalg_solve_ex:
        b = args[1]
        rhs = 1 if b.dim() == a.dim() - 1 else b.shape[-1]
        return batch * (2 * n ** 3 / 3 + 2 * n * n * rhs)
    if packet in (aten.linalg_inv_ex, aten.inverse):
        return batch * 2 * n ** 3
    return None


def _leaves(tree) -> list:
    from torch.utils._pytree import tree_flatten
    return tree_flatten(tree)[0]


def _bytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(tree) if isinstance(t, torch.Tensor))


def op_cost(func, args, kwargs, out) -> tuple[str, float, int]:
    """(class, FLOPs, bytes read and written) of one aten op on (local) tensors."""
    packet, name = func._overloadpacket, func.__name__
    if func.is_view or packet in _NO_KERNEL or not any(isinstance(t, torch.Tensor) for t in _leaves(out)):
        return "view", 0.0, 0       # metadata, views and allocations: no kernel, no traffic
    inputs = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    seen = {id(t.untyped_storage()) for t in inputs}
    moved = _bytes(inputs) + _bytes([t for t in _leaves(out) if isinstance(t, torch.Tensor)
                                     and id(t.untyped_storage()) not in seen])   # in place: written once
    if packet in _MATMULS:
        return "matmul", float(flop_counter.flop_registry[packet](*args, **kwargs, out_val=out)), moved
    if packet in _GROUPED or name.startswith("nanomega::grouped_mm"):
        # [M, K] x [E, K, N] with offsets: every row meets one expert; the weight gradient [K, M] x [M, N] -> [E, K, N]
        a, b = args[0], args[1]
        return "grouped", 2.0 * a.shape[0] * a.shape[-1] * b.shape[-1], moved
    factorization = linalg_flops(packet, args, kwargs, out)
    if factorization is not None:
        return "linalg", float(factorization), moved
    if "scaled_dot_product" in name and "attention" in name:
        if "backward" in name:
            g, q, k, v = (t.shape for t in args[:4])
            flops = flop_counter.sdpa_backward_flop_count(g, q, k, v)
        else:
            flops = flop_counter.sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
        # causal: the kernel skips the hidden half; with a mask (documents, a context-parallel block by position) or
        # none (a block every query sees) it computes the whole square
        return "attention", flops / 2 if _causal(func, args, kwargs) else flops, moved
    # foreach ops (the optimizers' element-wise maths over lists of tensors) carry no pointwise tag: they stay
    # "other", charged their bytes even when compiled, as torchtitan's eager foreach AdamW runs beside its
    # compiled model (bench/published.py's rows)
    return ("pointwise" if torch.Tag.pointwise in func.tags else "other"), 0.0, moved


def _causal(func, args, kwargs) -> bool:
    """An attention kernel's is_causal argument (by its schema's name: each fused kernel has it at its own place)."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return True
    i = names.index("is_causal")
    return bool(kwargs["is_causal"] if "is_causal" in kwargs else args[i] if i < len(args) else False)


class StepTrace(MemoryTracker):
    """MemoryTracker that also records each op's cost and each collective's bytes and group (module doc)."""

    def __init__(self):
        super().__init__()
        # per op of the tracker's stream: (class, flops, bytes, backward, a matmul's operand dims, whether a
        # matmul is float32, the step's phase, the optim.linalg.branch functions it ran inside, outermost first,
        # whether it is the embedding's lookup or its gradient, whether Inductor fuses it, and the tensors it reads
        # and writes as (storage number, bytes): the "Compiled" rule's input)
        self.op_costs: list[tuple] = []
        self._group_ranks: list[int] = []
        self._pending_recv = WeakIdKeyDictionary()   # a receive buffer's storage -> its transfer's schedule entry
        self._numbers = WeakIdKeyDictionary()        # a storage -> its number in the op records (io)
        self._next_number = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.ops
        if self._pending_recv and func not in _P2P:
            self._first_use_of_received(args, kwargs)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func in _P2P:
            self._point_to_point(func, args)
        if self.ops > before:      # an op of the stream the schedule indexes (collectives and waits are not)
            cls, flops, moved = op_cost(func, args, kwargs or {}, out)
            dims = frozenset(d for a in args[:3] if isinstance(a, torch.Tensor) for d in a.shape
                             ) if cls == "matmul" else frozenset()
            wide = cls == "matmul" and any(t.dtype == torch.float32 for t in _leaves(out) if isinstance(t, torch.Tensor))
            path = _branch_path() if self.phase == "update" else ()
            self.op_costs.append((cls, flops, moved, torch._C._current_graph_task_id() != -1, dims, wide,
                                  self.phase, path, func._overloadpacket in _EMBEDDING,
                                  cls == "pointwise" or func._overloadpacket in _FUSIBLE,
                                  (self._io((args, kwargs)), self._io(out)) if cls != "view" else ((), ())))
        return out

    def _io(self, tree) -> tuple:
        """(storage number, bytes) of each tensor in tree; a storage keeps its number while it lives."""
        out = []
        for t in _leaves(tree):
            if isinstance(t, torch.Tensor):
                storage = next(iter(_storages(t)), None)
                if storage is not None:
                    number = self._numbers.get(storage)
                    if number is None:
                        number = self._numbers[storage] = self._next_number
                        self._next_number += 1
                    out.append((number, t.numel() * t.element_size()))
        return tuple(out)

    def _count(self, func, args, kwargs, out) -> None:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _resolve_process_group
        self._sent_before = sum(c["bytes_sent"] for c in self.collectives.values())
        super()._count(func, args, kwargs, out)
        self._group_ranks = dist.get_process_group_ranks(_resolve_process_group(args[-1]))

    def _launched(self, kind, backward, out) -> None:
        super()._launched(kind, backward, out)
        self.schedule[-1]["bytes_sent"] = sum(c["bytes_sent"] for c in self.collectives.values()) - self._sent_before
        self.schedule[-1]["ranks"] = self._group_ranks


    def _point_to_point(self, func, args) -> None:
        """A send or receive (the cp ring's K/V and dK/dV; c10d's send/recv_ ops, args (tensors, group, peer,
        tag)) as a schedule entry: its bytes, the pair of global ranks it crosses, launched here. Its wait is
        not an op (Work.wait), so the first op that reads the received buffer is taken as where it is waited.
        A receive posted with the send before it (batch_isend_irecv: the ring's shift) joins that send's entry:
        both directions cross their links at once."""
        import torch.distributed as dist
        tensors, group, peer = args[0], args[1], args[2]
        if not isinstance(group, dist.ProcessGroup):
            group = dist.ProcessGroup.unbox(group)      # the dispatcher hands over the boxed script object
        ranks = [dist.get_rank(), dist.get_process_group_ranks(group)[peer]]
        sent = _bytes(tensors)
        last = self.schedule[-1] if self.schedule else None
        if func is _P2P[1] and last is not None and last["kind"] == "send" and last["launched"] == self.ops - 1 \
                and not last.get("_received"):
            entry = last        # the receive half of a shift: recv_ is an op of the stream, the send is not
        else:
            entry = {"kind": "send", "phase": self.phase, "backward": torch._C._current_graph_task_id() != -1,
                     "launched": self.ops, "waited": None, "ops": None, "compute": None, "bytes_sent": sent,
                     "ranks": ranks}
            self.schedule.append(entry)
        if func is _P2P[1]:
            entry["_received"] = True
            for t in tensors:
                for st in _storages(t):
                    self._pending_recv[st] = entry

    def _first_use_of_received(self, args, kwargs) -> None:
        for t in _leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    entry = self._pending_recv.pop(st, None)
                    if entry is not None and entry["waited"] is None:
                        entry["waited"] = self.ops


def _branch_path() -> tuple[str, ...]:
    """The functions optim.linalg.branch called that the current op runs inside, outermost first: the frame
    just inside each branch() frame on the Python stack is its true_fn or false_fn (module doc)."""
    path, frame, inner = [], sys._getframe(1), None
    while frame is not None:
        if frame.f_code is _BRANCH and inner is not None:
            path.append(inner.co_qualname)
        inner, frame = frame.f_code, frame.f_back
    return tuple(reversed(path))


_BRANCH = optim_linalg.branch.__code__


def _trace_rank(cfg, rank: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nanomega.sim.estimate import track_step
    from nanomega.sim.fake_world import fake_world
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(cfg.parallel.world_size, rank):
        tracer = StepTrace()
        result = track_step(cfg, tracer, torch.device("cpu"), lambda: fake)
    return {"ops": tracer.op_costs, "schedule": tracer.schedule, "peak_bytes": result["peak_bytes"],
            "by_category": result["by_category"]}


def trace(cfg, rank: int = 0) -> dict:
    """One rank's step as StepTrace records it (module doc), on fake tensors, in a child process."""
    from nanomega.parallel.mesh import validate_layout
    from nanomega.sim.estimate import _in_child
    validate_layout(cfg, cfg.parallel.world_size)
    if cfg.parallel.pp > 1:
        raise ValueError("step_time traces no pipeline step (a stage's waits for its neighbours come from the "
                         "schedule, not the trace): time a pipeline with predict(), which traces one stage "
                         "(parallel.pp=1)")
    return _in_child(_trace_rank, cfg, rank) if cfg.parallel.world_size > 1 else _trace_rank(cfg, rank)


def _intra_node(ranks: list[int]) -> bool:
    return len({r // GPUS_PER_NODE for r in ranks}) == 1


def off_node_share(ranks: list[int]) -> float:
    """The share of an all-to-all's bytes that leave the node: each peer gets its own slice, and of a rank's
    n - 1 peers, those in its node (the group spread evenly over its nodes) are reached over NVLink."""
    nodes = len({r // GPUS_PER_NODE for r in ranks})
    return 0.0 if len(ranks) <= 1 else (len(ranks) - len(ranks) / nodes) / (len(ranks) - 1)


def collective_seconds(bytes_sent: float, ranks: list[int], dev: Device, eff: Efficiency, kind: str = "") -> float:
    """A collective's time plus start-up. A ring collective: the bytes this rank sends over its group's slowest
    link. An all-to-all: the slices for peers in this node over NVLink while the rest cross the network."""
    if len(ranks) <= 1:
        return 0.0
    if _intra_node(ranks):
        return bytes_sent / (dev.nvlink_bandwidth * eff.bus) + eff.collective_s
    if kind == "all_to_all":
        out = off_node_share(ranks)
        return max(bytes_sent * out / dev.network_bandwidth,
                   bytes_sent * (1 - out) / dev.nvlink_bandwidth) / eff.bus + eff.collective_s
    return bytes_sent / (dev.network_bandwidth * eff.bus) + eff.collective_s


def op_seconds(cls: str, flops: float, moved: int, dev: Device, eff: Efficiency, fp8=False,
               bf16_only=False, fp32=False) -> float:
    """One op's time, eager: its roofline on the device (module doc). fp32: a float32 matmul (no tensor cores).
    Compiled steps price Inductor's fused kernels instead (fused_kernels)."""
    if cls == "view":
        return 0.0
    fp32_peak = dev.fp32_flops or dev.bf16_flops
    if cls == "linalg":
        rate = fp32_peak * eff.linalg
    elif cls == "grouped":
        rate = (dev.fp8_flops if fp8 else dev.bf16_flops) * eff.grouped_matmul
    elif cls == "matmul" and fp32:
        rate = fp32_peak * eff.matmul
    else:
        peak = dev.fp8_flops if fp8 and cls == "matmul" and not bf16_only else dev.bf16_flops
        rate = peak * (eff.attention if cls == "attention" else eff.matmul)
    return max(flops / rate, moved / (dev.hbm_bandwidth * eff.hbm)) + eff.kernel_s


def fused_kernels(ops: list, boundaries: set) -> dict[int, tuple[int, int]]:
    """The kernels a compiled step runs in place of its fusible ops ("Compiled", module doc): {index of a kernel's
    first op: (index past its last op, bytes it moves)}. A kernel is a run of fusible ops (views between them
    are free) in one phase and one direction, not across a collective's launch or wait (`boundaries`, op
    indices), nor in the update (the optimizer runs eagerly). It reads once each tensor its ops read that none of
    them wrote, and writes once each tensor they wrote that an op after it reads (or none does: a collective's
    input, the step's output); what its ops write and read among themselves stays in registers."""
    last_read: dict[int, int] = {}
    for i, op in enumerate(ops):
        for number, _ in (op[10][0] if len(op) > 10 else ()):
            last_read[number] = i
    kernels, i = {}, 0

    def fusible(k):
        return len(ops[k]) > 10 and ops[k][9] and ops[k][6] != "update"
    while i < len(ops):
        if not fusible(i):
            i += 1
            continue
        start, key, j = i, (ops[i][3], ops[i][6]), i
        while j < len(ops) and (j == start or j not in boundaries) and (
                fusible(j) and (ops[j][3], ops[j][6]) == key or ops[j][0] == "view"):
            j += 1
        while ops[j - 1][0] == "view":      # a kernel ends at its last fusible op
            j -= 1
        read, written = {}, {}
        for k in range(start, j):
            reads, writes = ops[k][10]
            for number, size in reads:
                if number not in written:
                    read[number] = max(read.get(number, 0), size)
            for number, size in writes:
                written[number] = max(written.get(number, 0), size)
        kept = sum(size for number, size in written.items() if last_read.get(number, len(ops)) >= j)
        kernels[start] = (j, sum(read.values()) + kept)
        i = j
    return kernels


def time_step(tr: dict, dev: Device, eff: Efficiency = Efficiency(), compiled: bool = False, fp8: bool = False,
              vocab_dims: frozenset = frozenset(), drop: frozenset = frozenset(),
              hidden: frozenset = frozenset(), data_parallel: frozenset = frozenset()) -> dict:
    """Replay one rank's trace on a compute clock and a communication clock (module doc). drop: qualified names
    of optim.linalg.branch functions whose ops cost nothing (the branch not taken in the step timed).
    hidden: collective kinds overlapped with other work than the code's next op (module doc, "Overlap"):
    waited at the step's end; empty (the default): every collective waited where the code waits for it.
    "phases": per phase of the step, compute_s, exposed_s (of its collectives), comm_s and comm_bytes.
    "pipe": the step as a pipeline replays it (predict); data_parallel: the global ranks of this rank's
    data-parallel group, whose reductions launched in the last backward are the step-end reduction."""
    if fp8 and dev.fp8_flops is None:
        raise ValueError(f"{dev.name} has no fp8 tensor cores; drop fp8")
    ops = tr["ops"]
    sched = sorted((dict(e) for e in tr["schedule"]), key=lambda e: e["launched"])
    fused = fused_kernels(ops, {i for e in sched for i in (e["launched"], e["waited"]) if i is not None}
                          ) if compiled else {}
    fused_until = 0
    launches = {}
    for e in sched:
        launches.setdefault(e["launched"], []).append(e)
    waits: dict[int, list] = {}
    t = comm_free = 0.0
    ends, exposed = {}, {}
    compute = {"forward": 0.0, "backward": 0.0}
    flops_total = 0.0

    timeline = []     # per collective: kind, seconds, seconds exposed
    phases: dict[str, dict] = {}
    # the step as a pipeline replays it (predict, module doc "Pipeline parallel"): the forward and backward ops'
    # time with the waits inside them, the embedding's apart; the update's; the step-end reductions' seconds
    pipe = {"forward": 0.0, "backward": 0.0, "embed_forward": 0.0, "embed_backward": 0.0, "update": 0.0,
            "reduce": {}, "exposed_in": {}, "exposed_update": {}}

    def phase(name):
        return phases.setdefault(name or "", {"compute_s": 0.0, "exposed_s": 0.0, "comm_s": 0.0, "comm_bytes": 0.0})

    # the step's end: after the last backward op (the gradients' last touches, the update), else the update
    backward_ops = [i for i, op in enumerate(ops) if op[3] and not (len(op) > 6 and op[6] == "update")]
    tail = backward_ops[-1] + 1 if backward_ops else next(
        (i for i, op in enumerate(ops) if len(op) > 6 and op[6] == "update"), len(ops))

    def in_update(i):
        return i is None or i >= tail
    # the last micro-batch's backward: from the last forward op before the step's end
    last_pass = next((i for i in range(tail - 1, -1, -1) if not ops[i][3]), -1) + 1

    def step_end_reduction(e):
        """Launched by the forward or backward and first needed at the step's end, or a data-parallel reduction
        launched in the last backward (the code may wait for its last bucket there: the pipeline's stage ends)."""
        if e.get("phase") == "update" or e["kind"] in hidden:
            return False
        return in_update(e["waited"]) or (e["kind"] in ("reduce_scatter", "all_reduce") and e["launched"] >= last_pass
                                          and len(e.get("ranks", ())) > 1 and set(e["ranks"]) <= data_parallel)

    def action(i):
        if i >= tail:
            return "update"
        embed = len(ops[i]) > 8 and ops[i][8]
        return ("embed_" if embed else "") + ("backward" if ops[i][3] else "forward")

    def add(bucket, kind, seconds):
        bucket[kind] = bucket.get(kind, 0.0) + seconds

    def wait(e, i):
        nonlocal t
        stall = max(0.0, ends[id(e)] - t)
        exposed[e["kind"]] = exposed.get(e["kind"], 0.0) + stall
        phase(e.get("phase"))["exposed_s"] += stall
        timeline[e["_at"]]["exposed_s"] = stall
        t += stall
        if e.get("_reduction"):
            return                       # the pipeline replays the step-end reductions itself
        if e.get("phase") == "update":
            pipe["update"] += stall
            add(pipe["exposed_update"], e["kind"], stall)
        else:                            # inside a forward or backward (hidden kinds: beside the backward's work)
            pipe["backward" if in_update(i) else action(i)] += stall
            add(pipe["exposed_in"], e["kind"], stall)

    for i in range(len(ops) + 1):
        for e in launches.get(i, []):
            start = max(t, comm_free)
            seconds = collective_seconds(e.get("bytes_sent", 0), e.get("ranks", []), dev, eff, e["kind"])
            comm_free = ends[id(e)] = start + seconds
            e["_at"] = len(timeline)
            timeline.append({"kind": e["kind"], "seconds": seconds, "exposed_s": 0.0})
            phase(e.get("phase"))["comm_s"] += seconds
            phase(e.get("phase"))["comm_bytes"] += e.get("bytes_sent", 0)
            at_end = e["waited"] is None or e["kind"] in hidden
            # launched by the forward or backward, first needed by the update: the data-parallel reduction
            e["_reduction"] = step_end_reduction(e)
            if e["_reduction"]:
                add(pipe["reduce"], e["kind"], seconds)
            waits.setdefault(len(ops) if at_end else max(e["waited"], i), []).append(e)
        for e in waits.pop(i, []):
            wait(e, i)
        if i == len(ops):
            break
        cls, flops, moved, backward, dims = ops[i][:5]
        wide, where, path = ops[i][5:8] if len(ops[i]) > 5 else (False, "", ())
        if drop and not drop.isdisjoint(path):
            continue                     # a branch this step does not take
        head = bool(vocab_dims & dims)   # the output head's matmuls (a vocabulary-sized dim) stay bf16 under fp8
        if i in fused:                   # the first op of a fused kernel: the kernel's time
            fused_until, kernel_bytes = fused[i]
            dt = kernel_bytes / (dev.hbm_bandwidth * eff.hbm) + eff.kernel_s
        elif i < fused_until or cls == "view":
            dt = 0.0                     # inside a fused kernel, or no kernel
        else:
            dt = op_seconds(cls, flops, moved, dev, eff, fp8, bf16_only=head, fp32=wide)
        t += dt
        flops_total += flops
        compute["backward" if backward else "forward"] += dt
        phase(where)["compute_s"] += dt
        pipe[action(i)] += dt
    for rest in waits.values():
        for e in rest:
            wait(e, len(ops))
    return {"step_s": t, "compute_s": sum(compute.values()), "forward_s": compute["forward"],
            "backward_s": compute["backward"], "exposed_s": exposed, "flops": flops_total, "collectives": timeline,
            "phases": phases, "pipe": pipe}


class Replay(NamedTuple):
    spans: dict        # pipeline rank -> [(start, end, action), ...]
    busy: dict         # rank -> seconds its actions take
    makespan: float    # when the last action ends
    ready: dict        # rank -> when its last action and its reductions are done


def replay_pipeline(schedule: dict, placement: list[int], forward: list[float], backward: list[float],
                    transfer=None, reduce: list[float] | None = None) -> Replay:
    """A pipeline step replayed across its ranks (module doc, "Pipeline parallel"): each rank runs its list of
    schedule actions in order; an action starts when its rank is free and its input has arrived: F of stage s
    the output of F of s-1, B of s its own F and the input gradient of B of s+1, plus transfer(src, dst)
    seconds when the two stages sit on different ranks (placement). forward[s], backward[s]: one micro-batch's
    seconds on virtual stage s. reduce[s]: seconds of stage s's data-parallel reduction, launched as its last
    backward ends (parallel/pipeline.py's weight_pass) on its rank's one communication stream, in launch order."""
    from nanomega.parallel import schedules
    n_stages = len(placement)
    if any(a.kind not in ("F", "B") for ops in schedule.values() for a in ops):
        raise ValueError("the replay times F and B actions; a split backward (I, W: zb_v) has no trace of its own")
    spans = schedules.timeline(schedule, lambda a: (forward if a.kind == "F" else backward)[a.stage],
                               transfer or 0.0)
    last_b = {}                                     # stage -> when its last backward ended
    for start, end, a in (x for sp in spans.values() for x in sp):
        if a.kind == "B":
            last_b[a.stage] = max(last_b.get(a.stage, 0.0), end)
    busy = {r: sum(end - start for start, end, _ in sp) for r, sp in spans.items()}
    makespan = max((sp[-1][1] for sp in spans.values() if sp), default=0.0)
    ready = {}
    for r, sp in spans.items():
        free = sp[-1][1] if sp else 0.0
        comm = 0.0
        for launch, s in sorted((last_b[s], s) for s in range(n_stages) if placement[s] == r and s in last_b):
            comm = max(comm, launch) + (reduce[s] if reduce else 0.0)
        ready[r] = max(free, comm)
    return Replay(spans, busy, makespan, ready)


# memory_tracker's categories that do not grow with the blocks: the unit or two FSDP holds gathered, one block's
# temporaries. Extrapolated linearly from one and two blocks they would add a gathered block per block (megatron_1t
# on FSDP 1,536: 993 GiB predicted for a rank holding 10), so a composed peak takes them from its largest trace.
TRANSIENT = ("gathered_parameters", "temporary")


def _peak_from(whole: dict, largest: dict) -> dict:
    """whole (a result composed from traces of fewer blocks) with its transient categories taken from the largest
    trace, not extrapolated, and its peak their sum with the rest (which do grow with the blocks: parameters,
    gradients, optimizer state, saved activations)."""
    # a category's split at the peak is a moment's: traces whose peaks fall in different phases (the update at one
    # block, the backward at two) can extrapolate a category below zero; none holds less than nothing
    cats = {k: max(0.0, v) for k, v in whole["by_category"].items()}
    for k in TRANSIENT:
        cats[k] = largest["by_category"].get(k, 0.0)
    return {**whole, "by_category": cats, "peak_bytes": sum(cats.values())}


def _extrapolate(a: dict, b: dict, la: int, lb: int, n: int) -> dict:
    """Every number of a result at n layers from results at la and lb (linear in layers: identical blocks)."""
    return _combine([(1 - (n - la) / (lb - la), a), ((n - la) / (lb - la), b)])


def _combine(terms: list[tuple[float, dict]]) -> dict:
    """sum(weight x result) over every number of the results (missing numbers count 0)."""
    def go(xs):
        if any(isinstance(x, dict) for x in xs):
            xs = [x if isinstance(x, dict) else {} for x in xs]     # a kind one result lacks: 0 in it
            keys = set().union(*xs)
            return {k: go([x.get(k, 0.0) for x in xs]) for k in keys}
        return sum(w * x for (w, _), x in zip(terms, xs))
    return go([r for _, r in terms])


def predict(cfg, gpu: str | Device = "h100", eff: Efficiency = Efficiency(), compiled: bool = False, fp8: bool = False,
            layers: tuple[int, int] | None = None, micro: tuple[int, int] | None = None,
            variants=None, stage: tuple[int, int] | None = None) -> dict | list[dict]:
    """Step time, tokens/s per GPU, MFU, exposed communication by kind, bubble and peak memory of cfg's layout.

    layers=(a, b): simulate a and b blocks and extrapolate to the config's n_layers (module doc); micro=(a, b) the
    same in micro-batches (train.grad_accum: each adds the same ops; the step's end, its reductions and update,
    is the constant part; the peak is mb micro-batches', not extrapolated: (2, 3) reaches it). variants: a
    list of dicts of (compiled, fp8, eff, drop, hidden: time_step's) to time from the same trace; then a list of
    results comes back. A pipeline (parallel.pp > 1) is replayed across its stages (module doc), each stage's
    blocks as parallel.pp_layers or the runtime's even split gives them (mesh.stages_layers), composed from one
    and two blocks when layers is not given. stage=(blocks, dense): every rank holds `blocks` blocks, the first
    `dense` of them dense, split evenly over its virtual stages (a layout the stages cannot express: Megatron's
    embedding and loss counted as blocks; the planner's dense blocks timed as MoE ones); without a pipeline,
    the step timed holds them."""
    from nanomega.parallel.mesh import model_config
    dev = gpu if isinstance(gpu, Device) else device_named(gpu)     # a Device: e.g. run/measured.py's CPU
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if p.pp > 1 and p.pp_schedule == "zb_v":
        raise ValueError("zb_v is not timed yet: its split backward (I, W) has no trace of its own; time "
                         "parallel.pp_schedule=1f1b or interleaved_1f1b")
    stage_world = p.world_size // p.pp
    one_stage = dataclasses.replace(cfg, parallel=dataclasses.replace(p, pp=1, pp_virtual=1, pp_layers=()))

    def at(n_layers, grad_accum, n_dense):
        c = dataclasses.replace(one_stage, model=dataclasses.replace(one_stage.model, n_layers=n_layers,
                                                                   first_dense_layers=n_dense),
                                train=dataclasses.replace(one_stage.train, grad_accum=grad_accum))
        return timed(trace(c))
    vocab_dims = frozenset({m.vocab_size, m.vocab_size // p.tp, m.padded_vocab, m.padded_vocab // p.tp})
    # rank 0's data-parallel ranks (mesh.MESH_DIMS: dp_replicate, dp_shard outside cp and tp)
    data_parallel = frozenset(k * p.cp * p.tp for k in range(p.dp_replicate * p.dp_shard))
    runs = [(variant.get("compiled", compiled), variant.get("fp8", fp8), variant.get("eff", eff),
             frozenset(variant.get("drop", ())), frozenset(variant.get("hidden", ())))
            for variant in (variants or [{}])]

    def timed(tr):
        out = []
        for c, f, e, d, h in runs:
            r = time_step(tr, dev, e, c, f, vocab_dims, drop=d, hidden=h, data_parallel=data_parallel)
            r.pop("collectives")     # per collective: not extrapolated
            r["peak_bytes"], r["by_category"] = tr["peak_bytes"], tr["by_category"]
            out.append(r)
        return out

    def over_micro(of_micro):
        """of_micro(grad_accum) at the step's micro-batches, or extrapolated from micro=(a, b) (docstring)."""
        if not micro:
            return of_micro(t.grad_accum)
        ma, mb = micro
        results = []
        for x, y in zip(of_micro(ma), of_micro(mb)):
            # the peak stops growing after a few micro-batches (one runs beside the accumulated gradients and the
            # next one's prefetch): the peak of mb micro-batches stands for more; extrapolated, each would add the
            # accumulation buffer again. micro=(2, 3) reaches it (tests/test_step_time_moe.py)
            results.append(_with_peak_of(_extrapolate(x, y, ma, mb, t.grad_accum), y))
        return results

    if p.pp > 1:
        stages = _pipeline_stages(cfg, stage)
        parts = over_micro(lambda grad_accum: _block_parts(at, layers, grad_accum, m, stages))
        results = [_replay(cfg, part, stages, dev, e) for part, (_, _, e, _, _) in zip(parts, runs)]
    else:
        stage_layers, dense = stage or (m.n_layers, min(m.first_dense_layers, m.n_layers))

        def at_layers(grad_accum):
            if not layers:
                return at(stage_layers, grad_accum, dense)
            if not 0 < dense < stage_layers:     # identical blocks
                la, lb = layers
                return [_peak_from(_extrapolate(x, y, la, lb, stage_layers), y)
                        for x, y in zip(at(la, grad_accum, min(dense, la)), at(lb, grad_accum, min(dense, lb)))]
            # leading dense blocks, then MoE ones: one MoE block (x1), two (x2), and a dense one before a MoE one
            # (y2) give the rest, two blocks at most: base = 2 x1 - x2, a MoE block x2 - x1, a dense block y2 - x1
            moe = stage_layers - dense
            return [_peak_from(_combine([(2.0 - dense - moe, x1), (moe - 1.0, x2), (float(dense), y2)]), x2)
                    for x1, x2, y2 in zip(at(1, grad_accum, 0), at(2, grad_accum, 0), at(2, grad_accum, 1))]
        results = over_micro(at_layers)
        for r in results:
            r["bubble"] = 0.0
    model_flops = flops_per_token(model_config(cfg), t.seq_len)   # train.py's MFU count: active parameters
    tokens_per_gpu = t.batch_size * t.seq_len * t.grad_accum / p.world_size
    out = []
    for r in results:
        step = r["step_s"]
        out.append({"gpu": dev.name, "step_s": step, "tokens_per_s_per_gpu": tokens_per_gpu / step,
                    "mfu": model_flops * tokens_per_gpu / step / dev.bf16_flops,
                    "tflops_per_gpu": model_flops * tokens_per_gpu / step / 1e12,
                    "compute_s": r["compute_s"], "exposed_s": {k: v for k, v in r["exposed_s"].items() if v > 0},
                    "bubble": r["bubble"], "peak_bytes": r["peak_bytes"], "by_category": r["by_category"],
                    "phases": r["phases"], "fits": r["peak_bytes"] <= dev.hbm_bytes, "stage_world": stage_world}
                   | ({"bubble_s": r["bubble_s"], "pipeline": r["pipeline"]} if "pipeline" in r else {}))
    return out if variants else out[0]


def _with_peak_of(r: dict, y: dict) -> dict:
    """r with y's peak (over_micro's rule); a pipeline's parts (_block_parts) part by part."""
    if "base" in r:
        return {k: _with_peak_of(r[k], y[k]) for k in r}
    r["peak_bytes"], r["by_category"] = y["peak_bytes"], y["by_category"]
    return r


def _pipeline_stages(cfg, stage: tuple[int, int] | None) -> list[tuple[float, float]]:
    """(blocks, dense blocks) of each virtual stage, in stage order (predict's docstring)."""
    from nanomega.parallel.mesh import stages_layers
    p, m = cfg.parallel, cfg.model
    n_stages = p.pp * p.pp_virtual
    if stage is not None:
        blocks, dense = stage
        return [(blocks / p.pp_virtual, dense / p.pp_virtual)] * n_stages
    sizes = stages_layers(cfg)      # parallel.pp_layers, checked, or the runtime's even split
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    dense = m.first_dense_layers if m.n_experts else 0
    return [(n, max(0, min(start + n, dense) - start)) for start, n in zip(starts, sizes)]


def _block_parts(at, layers, grad_accum: int, m, stages) -> list[dict]:
    """Per variant, {"base": the step without blocks (embedding, head, loss, the step's constant work), "block":
    what one block adds, "dense": what one dense block adds}, from one and two blocks (or layers=(a, b)); with
    dense and MoE blocks both present, from one MoE block (x1), two (x2) and a dense one before a MoE one (y2)."""
    if m.n_experts and any(d > 0 for _, d in stages) and any(n > d for n, d in stages):
        return [{"base": _combine([(2.0, x1), (-1.0, x2)]), "block": _combine([(1.0, x2), (-1.0, x1)]),
                 "dense": _combine([(1.0, y2), (-1.0, x1)]), "largest": x2}
                for x1, x2, y2 in zip(at(1, grad_accum, 0), at(2, grad_accum, 0), at(2, grad_accum, 1))]
    la, lb = layers or (1, 2)

    def dense(n):      # the blocks all of one kind: all dense (every stage's dense count is its size) or all MoE
        if not m.n_experts:
            return min(m.first_dense_layers, n)
        return n if all(n_s == d for n_s, d in stages) else 0
    xs, ys = (at(n, grad_accum, dense(n)) for n in (la, lb))
    out = []
    for x, y in zip(xs, ys):
        block = _combine([(1.0 / (lb - la), y), (-1.0 / (lb - la), x)])
        out.append({"base": _combine([(1.0, x), (-float(la), block)]), "block": block, "dense": block,
                    "largest": y})
    return out


def _replay(cfg, part: dict, stages: list[tuple[float, float]], dev: Device, eff: Efficiency) -> dict:
    """One variant's pipelined step (module doc, "Pipeline parallel") from its parts (_block_parts)."""
    from nanomega.parallel import schedules
    p, t, m = cfg.parallel, cfg.train, cfg.model
    n_stages, last = len(stages), len(stages) - 1
    base = part["base"]["pipe"]
    embed = m.padded_vocab * m.d_model + (m.max_seq_len * m.d_model if m.position == "learned" else 0)
    share = embed / (embed + m.padded_vocab * m.d_model + m.d_model)   # the embedding's of the reduction and update

    def scaled(d: dict, w: float) -> dict:
        return {k: v * w for k, v in d.items()}
    ends = {0: {"forward": base["embed_forward"], "backward": base["embed_backward"], "update": base["update"] * share,
                "reduce": scaled(base["reduce"], share), "exposed_update": scaled(base["exposed_update"], share)},
            last: {"forward": base["forward"], "backward": base["backward"], "update": base["update"] * (1 - share),
                   "reduce": scaled(base["reduce"], 1 - share), "exposed_in": base["exposed_in"],
                   "exposed_update": scaled(base["exposed_update"], 1 - share)}}

    def pipe_of(s):
        n, d = stages[s]
        terms = [(n - d, part["block"]["pipe"]), (d, part["dense"]["pipe"])]
        terms += [(1.0, ends[s])] if s == 0 else []
        return _combine(terms + ([(1.0, ends[last])] if s == last else []))
    pipes = [pipe_of(s) for s in range(n_stages)]

    def action(x, kind):
        return max(0.0, x[kind] + x.get("embed_" + kind, 0.0)) / t.grad_accum
    placement = schedules.stage_ranks(p.pp, p.pp_virtual, "loop")
    args = (p.pp, t.grad_accum) + ((p.pp_virtual,) if p.pp_schedule == "interleaved_1f1b" else ())
    schedule = schedules.SCHEDULES[p.pp_schedule](*args)
    forward = [action(x, "forward") for x in pipes]
    backward = [action(x, "backward") for x in pipes]
    reduce = [max(0.0, sum(x["reduce"].values())) for x in pipes]
    # one micro-batch's residual stream as a stage holds it (sequence parallel: split over tp, as Megatron sends it)
    tokens = t.batch_size // (p.dp_replicate * p.dp_shard) * t.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
    sent = tokens * m.d_model * (2 if "bfloat16" in (t.param_dtype, t.dtype) else 4)
    world = p.world_size // p.pp       # pipeline rank r's ranks are r x world .. (mesh.MESH_DIMS: pp outermost)

    def transfer(src, dst):
        return collective_seconds(sent, [placement[src] * world, placement[dst] * world], dev, eff, "send")
    timed = replay_pipeline(schedule, placement, forward, backward, transfer, reduce)
    alone = replay_pipeline(schedule, placement, forward, backward, None, reduce)     # transfers free
    ranks = {r: _combine([(1.0, pipes[s]) for s in range(n_stages) if placement[s] == r]) for r in range(p.pp)}
    busiest = max(timed.busy, key=timed.busy.get)
    updating = max(ranks, key=lambda r: ranks[r]["update"])
    update = max(0.0, ranks[updating]["update"])
    ready = max(timed.ready.values())
    bubble_s = max(0.0, alone.makespan - timed.busy[busiest])
    send_s = max(0.0, timed.makespan - alone.makespan)
    tail = max(0.0, ready - timed.makespan)
    exposed = dict(ranks[busiest]["exposed_in"])
    for kind, v in ranks[updating]["exposed_update"].items():
        exposed[kind] = exposed.get(kind, 0.0) + v
    last_ready = max(timed.ready, key=timed.ready.get)
    reductions = ranks[last_ready]["reduce"]
    for kind, v in reductions.items():      # the reductions' tail past the last action, by their kinds' shares
        exposed[kind] = exposed.get(kind, 0.0) + tail * v / (sum(reductions.values()) or 1.0)
    exposed["send"] = exposed.get("send", 0.0) + send_s
    compute = (timed.busy[busiest] - sum(ranks[busiest]["exposed_in"].values())
               + update - sum(ranks[updating]["exposed_update"].values()))
    # memory: the rank holding the most blocks, with the embedding and the head (the stage timed before the
    # replay), holding as many micro-batches' activations as the schedule keeps in flight
    held = {r: (sum(stages[s][0] for s in range(n_stages) if placement[s] == r),
                sum(stages[s][1] for s in range(n_stages) if placement[s] == r)) for r in range(p.pp)}
    n, d = max(held.values())
    whole = _peak_from(_combine([(1.0, part["base"]), (n - d, part["block"]), (d, part["dense"])]), part["largest"])
    in_flight = max(schedules.peak_in_flight(schedule).values())
    extra = (in_flight / p.pp_virtual - 1) * whole["by_category"]["activations"] * (1 if t.grad_accum > 1 else 0)
    return {"step_s": ready + update, "compute_s": compute, "exposed_s": exposed, "bubble_s": bubble_s,
            "bubble": bubble_s / alone.makespan if alone.makespan else 0.0,
            "peak_bytes": whole["peak_bytes"] + extra,
            "by_category": {**whole["by_category"], "activations": whole["by_category"]["activations"] + extra},
            "phases": whole["phases"],
            "pipeline": {"forward_s": forward, "backward_s": backward, "reduce_s": reduce, "send_s": transfer(0, 1)
                         if n_stages > 1 else 0.0, "makespan_s": timed.makespan, "update_s": update,
                         "exposed_in_actions_s": ranks[busiest]["exposed_in"],
                         "exposed_in_update_s": ranks[updating]["exposed_update"], "reduction_tail_s": tail}}


# The optimizers' optim.linalg.branch functions (qualified names) by the steps that take them, as each
# optimizer registers them (optim.REGISTRY[name].branches):
#   refresh   every refresh_every(settings)-th step (Shampoo's roots, SOAP's QR refresh of its bases)
#   keep      the other steps (the refresh's alternative: the old roots or bases, cloned)
#   first     step 1 only (SOAP: factors and eigh bases, no move);  later: every other step
#   success / failure   whether the fp32 root is finite (failure: its fp64 retry, never charged)
def branches() -> dict:
    return {name: role for spec in optim.REGISTRY.values() for name, role in spec.branches.items()}


STEPS = {"steady": {"refresh", "first", "failure"},      # per kind of step: the roles whose ops are dropped
         "refresh": {"keep", "first", "failure"},
         "first": {"later", "failure"}}


def branches_of(tr: dict) -> set[str]:
    """Every optim.linalg.branch function a trace's ops ran inside (to check branches() knows them all)."""
    return {name for op in tr["ops"] if len(op) > 7 for name in op[7]}


def update_cost(cfg, gpu: str = "h100", effs: tuple[Efficiency, ...] = (Efficiency(),), compiled: bool = False,
                layers: tuple[int, int] | None = None) -> list[dict]:
    """The step split into forward + backward and optimizer update, per step amortized over the optimizer's
    periodic work (module doc), one result per Efficiency in effs (all from one trace): {"steady", "refresh",
    "first"} (predict()'s result for each kind of step, the other kinds' branches dropped) and "amortized":
    step_s, and per phase compute_s, exposed_s, comm_s, comm_bytes = steady + (refresh - steady) /
    precondition_frequency (the optimizer's registered refresh_every; none: no periodic branch, refresh = steady);
    update_s = the update's compute and the exposure of its collectives, update_share = update_s / step_s.
    SOAP's first step (eigh bases) runs once a run: reported as "first", not amortized."""
    kinds = list(STEPS)
    roles = branches()
    variants = [{"eff": eff, "drop": {name for name, role in roles.items() if role in STEPS[k]}}
                for eff in effs for k in kinds]
    timed = predict(cfg, gpu, compiled=compiled, layers=layers, variants=variants)
    spec = optim.spec_of(cfg.optim.name)
    freq = spec.refresh_every(optim.check(cfg.optim)) if spec.refresh_every else 1
    zero = {"compute_s": 0.0, "exposed_s": 0.0, "comm_s": 0.0, "comm_bytes": 0.0}

    def amortized(steady, refresh):
        return steady + (refresh - steady) / freq
    out = []
    for i in range(len(effs)):
        runs = dict(zip(kinds, timed[i * len(kinds):(i + 1) * len(kinds)]))
        steady, refresh = runs["steady"], runs["refresh"]
        phases = {ph: {k: amortized(steady["phases"].get(ph, zero)[k], refresh["phases"].get(ph, zero)[k])
                       for k in zero} for ph in set(steady["phases"]) | set(refresh["phases"])}
        update = phases.get("update", zero)
        step_s = amortized(steady["step_s"], refresh["step_s"])
        update_s = update["compute_s"] + update["exposed_s"]
        out.append({**runs, "amortized": {"step_s": step_s, "update_s": update_s, "update_share": update_s / step_s,
                                          "phases": phases, "precondition_frequency": freq}})
    return out


def bottleneck(r: dict) -> str:
    """What the step waits for beyond compute: the most exposed collective kind, or the bubble, or nothing."""
    waits = dict(r["exposed_s"])
    if r["bubble"]:
        waits["pipeline bubble"] = r.get("bubble_s", r["compute_s"] * r["bubble"] / (1 - r["bubble"]))
    if not waits or max(waits.values()) < 0.01 * r["step_s"]:
        return "compute"
    kind = max(waits, key=waits.get)
    return f"{kind} ({waits[kind] / r['step_s']:.0%} of the step)"


def describe(r: dict) -> str:
    exposed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(r["exposed_s"].items())) or "none"
    return (f"{r['gpu']}: step {r['step_s'] * 1e3:,.1f} ms, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"MFU {r['mfu']:.1%} ({r['tflops_per_gpu']:.0f} TFLOP/s), compute {r['compute_s'] * 1e3:,.1f} ms, "
            f"exposed communication: {exposed}, bubble {r['bubble']:.1%}, peak {r['peak_bytes'] / 2**30:.1f} GiB; "
            f"bottleneck: {bottleneck(r)}")


def main(argv: list[str]) -> int:
    from nanomega.config import parse_args
    gpu, compiled, fp8, as_json, rest = "h100", False, False, False, []
    for a in argv:
        if a.startswith("--gpu="):
            gpu = a.split("=", 1)[1]
        elif a in ("--compiled", "--fp8"):
            compiled, fp8 = compiled or a == "--compiled", fp8 or a == "--fp8"
        elif a == "--json":
            as_json = True
        else:
            rest.append(a)
    try:
        r = predict(parse_args(rest), gpu, compiled=compiled, fp8=fp8)
    except ValueError as err:
        sys.exit(f"error: {err}")
    if as_json:
        import json
        print(json.dumps({**r, "compiled": compiled, "fp8": fp8}))
    else:
        print(describe(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
