"""Time of the train step, per layout, modelled from the simulator's own run of the step (nanomega/sim/estimate.py).
One idea in one file of ~620 lines: one trace replayed on two clocks; the trace, the replay, the optimizer's
amortized refreshes and the command line all read the same op and collective records, so they stay together.

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
Attention is causal and runs as a flash kernel: half of the square's FLOPs (torch's formula counts the
square; the CPU kernel the simulator runs takes a mask). "Compiled" (torch.compile) is modelled by one
switch: pointwise ops are fused into their neighbours, so their bytes and kernel overheads are not charged.
"fp8" runs every matmul that does not touch the vocabulary (the blocks', not the output head's, as
torchtitan's and Transformer Engine's recipes leave it) at the device's fp8 peak; the scaling's own casts
are not charged (compiled runs fuse them).

Pipeline parallel (its sends complete at once on the fake process group, so the waits between stages come
from the schedule): `predict` simulates one stage, a pp=1 layout with
n_layers / pp blocks and the step's micro-batches, and stretches its compute by the schedule's bubble from
nanomega/parallel/schedules.py's own action lists (simulate(), with the stage's forward and backward times).
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
        return "attention", flops / 2, moved      # causal: the flash kernel skips the masked half
    # foreach ops (the optimizers' element-wise maths over lists of tensors) carry no pointwise tag: they stay
    # "other", charged their bytes even when compiled, as torchtitan's eager foreach AdamW runs beside its
    # compiled model (bench/published.py's rows)
    return ("pointwise" if torch.Tag.pointwise in func.tags else "other"), 0.0, moved


class StepTrace(MemoryTracker):
    """MemoryTracker that also records each op's cost and each collective's bytes and group (module doc)."""

    def __init__(self):
        super().__init__()
        # per op of the tracker's stream: (class, flops, bytes, backward, a matmul's operand dims, whether a
        # matmul is float32, the step's phase, the optim.linalg.branch functions it ran inside, outermost first)
        self.op_costs: list[tuple] = []
        self._group_ranks: list[int] = []
        self._pending_recv = WeakIdKeyDictionary()   # a receive buffer's storage -> its transfer's schedule entry

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
                                  self.phase, path))
        return out

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

    from nanomega.sim.estimate import fake_world, track_step
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


def op_seconds(cls: str, flops: float, moved: int, dev: Device, eff: Efficiency, compiled=False, fp8=False,
               bf16_only=False, fp32=False) -> float:
    """One op's time: its roofline on the device (module doc). fp32: a float32 matmul (no tensor cores)."""
    if cls == "view":
        return 0.0
    if compiled and cls == "pointwise":
        return 0.0                                  # fused into a neighbour (module doc)
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


def time_step(tr: dict, dev: Device, eff: Efficiency = Efficiency(), compiled: bool = False, fp8: bool = False,
              vocab_dims: frozenset = frozenset(), drop: frozenset = frozenset(),
              hidden: frozenset = frozenset()) -> dict:
    """Replay one rank's trace on a compute clock and a communication clock (module doc). drop: qualified names
    of optim.linalg.branch functions whose ops cost nothing (the branch not taken in the step timed).
    hidden: collective kinds overlapped with other work than the code's next op (module doc, "Overlap"):
    waited at the step's end; empty (the default): every collective waited where the code waits for it.
    "phases": per phase of the step, compute_s, exposed_s (of its collectives), comm_s and comm_bytes."""
    if fp8 and dev.fp8_flops is None:
        raise ValueError(f"{dev.name} has no fp8 tensor cores; drop fp8")
    ops = tr["ops"]
    sched = sorted((dict(e) for e in tr["schedule"]), key=lambda e: e["launched"])
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

    def phase(name):
        return phases.setdefault(name or "", {"compute_s": 0.0, "exposed_s": 0.0, "comm_s": 0.0, "comm_bytes": 0.0})

    def wait(e):
        nonlocal t
        stall = max(0.0, ends[id(e)] - t)
        exposed[e["kind"]] = exposed.get(e["kind"], 0.0) + stall
        phase(e.get("phase"))["exposed_s"] += stall
        timeline[e["_at"]]["exposed_s"] = stall
        t += stall

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
            waits.setdefault(len(ops) if at_end else max(e["waited"], i), []).append(e)
        for e in waits.pop(i, []):
            wait(e)
        if i == len(ops):
            break
        cls, flops, moved, backward, dims = ops[i][:5]
        wide, where, path = ops[i][5:8] if len(ops[i]) > 5 else (False, "", ())
        if drop and not drop.isdisjoint(path):
            continue                     # a branch this step does not take
        head = bool(vocab_dims & dims)   # the output head's matmuls (a vocabulary-sized dim) stay bf16 under fp8
        dt = op_seconds(cls, flops, moved, dev, eff, compiled, fp8, bf16_only=head, fp32=wide)
        t += dt
        flops_total += flops
        compute["backward" if backward else "forward"] += dt
        phase(where)["compute_s"] += dt
    for rest in waits.values():
        for e in rest:
            wait(e)
    return {"step_s": t, "compute_s": sum(compute.values()), "forward_s": compute["forward"],
            "backward_s": compute["backward"], "exposed_s": exposed, "flops": flops_total, "collectives": timeline,
            "phases": phases}


def _extrapolate(a: dict, b: dict, la: int, lb: int, n: int) -> dict:
    """Every number of a result at n layers from results at la and lb (linear in layers: identical blocks)."""
    return _combine([(1 - (n - la) / (lb - la), a), ((n - la) / (lb - la), b)])


def _combine(terms: list[tuple[float, dict]]) -> dict:
    """sum(weight x result) over every number of the results (missing numbers count 0)."""
    def go(xs):
        if isinstance(xs[0], dict):
            keys = set().union(*xs)
            return {k: go([x.get(k, 0.0) for x in xs]) for k in keys}
        return sum(w * x for (w, _), x in zip(terms, xs))
    return go([r for _, r in terms])


def predict(cfg, gpu: str = "h100", eff: Efficiency = Efficiency(), compiled: bool = False, fp8: bool = False,
            layers: tuple[int, int] | None = None, micro: tuple[int, int] | None = None,
            variants=None, stage: tuple[int, int] | None = None) -> dict | list[dict]:
    """Step time, tokens/s per GPU, MFU, exposed communication by kind, bubble and peak memory of cfg's layout.

    layers=(a, b): simulate a and b blocks and extrapolate to the config's n_layers (module doc); micro=(a, b) the
    same in micro-batches (train.grad_accum: each adds the same ops; the step's end, its reductions and update,
    is the constant part; the peak is mb micro-batches', not extrapolated: (2, 3) reaches it). variants: a
    list of dicts of (compiled, fp8, eff, drop, hidden: time_step's) to time from the same trace; then a list of
    results comes back. stage=(blocks, dense): the pipeline stage timed holds `blocks` blocks, the first `dense` of
    them dense (a stage of uneven pipeline splits, or one past a model's leading dense layers); by default
    n_layers / pp blocks with the model's first_dense_layers."""
    from nanomega.parallel import schedules
    from nanomega.parallel.mesh import model_config
    dev = device_named(gpu)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    if stage is None:
        if p.pp > 1 and m.n_layers % p.pp:
            raise ValueError(f"parallel.pp={p.pp} does not divide model.n_layers={m.n_layers}; give the stage to "
                             "time as stage=(blocks, dense blocks)")
        stage = (m.n_layers // p.pp, min(m.first_dense_layers, m.n_layers // p.pp))
    stage_layers, dense = stage
    stage_world = p.world_size // p.pp
    one_stage = dataclasses.replace(cfg, parallel=dataclasses.replace(p, pp=1, pp_virtual=1, pp_layers=()))

    def at(n_layers, grad_accum, n_dense):
        c = dataclasses.replace(one_stage, model=dataclasses.replace(one_stage.model, n_layers=n_layers,
                                                                   first_dense_layers=n_dense),
                                train=dataclasses.replace(one_stage.train, grad_accum=grad_accum))
        return timed(trace(c))
    vocab_dims = frozenset({m.vocab_size, m.vocab_size // p.tp, m.padded_vocab, m.padded_vocab // p.tp})
    runs = [(variant.get("compiled", compiled), variant.get("fp8", fp8), variant.get("eff", eff),
             frozenset(variant.get("drop", ())), frozenset(variant.get("hidden", ())))
            for variant in (variants or [{}])]

    def timed(tr):
        out = []
        for c, f, e, d, h in runs:
            r = time_step(tr, dev, e, c, f, vocab_dims, drop=d, hidden=h)
            r.pop("collectives")     # per collective: not extrapolated
            r["peak_bytes"], r["by_category"] = tr["peak_bytes"], tr["by_category"]
            out.append(r)
        return out

    def at_layers(grad_accum):
        if not layers:
            return at(stage_layers, grad_accum, dense)
        if not 0 < dense < stage_layers:     # identical blocks
            la, lb = layers
            return [_extrapolate(x, y, la, lb, stage_layers)
                    for x, y in zip(at(la, grad_accum, min(dense, la)), at(lb, grad_accum, min(dense, lb)))]
        # leading dense blocks, then MoE ones: one MoE block (x1), two (x2), and a dense one before a MoE one (y2)
        # give the rest, two blocks at most: base = 2 x1 - x2, a MoE block x2 - x1, a dense block y2 - x1
        moe = stage_layers - dense
        return [_combine([(2.0 - dense - moe, x1), (moe - 1.0, x2), (float(dense), y2)])
                for x1, x2, y2 in zip(at(1, grad_accum, 0), at(2, grad_accum, 0), at(2, grad_accum, 1))]
    if micro:
        ma, mb = micro
        results = []
        for x, y in zip(at_layers(ma), at_layers(mb)):
            r = _extrapolate(x, y, ma, mb, t.grad_accum)
            # the peak stops growing after a few micro-batches (one runs beside the accumulated gradients and the
            # next one's prefetch): the peak of mb micro-batches stands for more; extrapolated, each would add the
            # accumulation buffer again. micro=(2, 3) reaches it (tests/test_step_time_moe.py)
            r["peak_bytes"], r["by_category"] = y["peak_bytes"], y["by_category"]
            results.append(r)
    else:
        results = at_layers(t.grad_accum)
    model_flops = flops_per_token(model_config(cfg), t.seq_len)   # train.py's MFU count: active parameters
    tokens_per_gpu = t.batch_size * t.seq_len * t.grad_accum / p.world_size
    out = []
    for r in results:
        bubble = 0.0
        if p.pp > 1:
            kind = p.pp_schedule
            args = (p.pp, t.grad_accum) + ((p.pp_virtual,) if kind == "interleaved_1f1b" else ())
            if kind == "zb_v":
                raise ValueError("zb_v is not timed yet: its split backward (I, W) has no trace of its own")
            v = p.pp_virtual
            f_micro = r["forward_s"] / t.grad_accum / v
            b_micro = r["backward_s"] / t.grad_accum / v
            # scale to integers (microseconds) so simulate() stays exact and fast
            tl = schedules.simulate(schedules.SCHEDULES[kind](*args), t_f=max(1, round(f_micro * 1e6)),
                                    t_b=max(1, round(b_micro * 1e6)))
            bubble = float(tl.bubble)
            r["step_s"] = r["step_s"] + r["compute_s"] * bubble / (1 - bubble)
            in_flight = max(schedules.peak_in_flight(schedules.SCHEDULES[kind](*args)).values())
            # a stage holds the activations of every micro-batch in flight, the simulation those of one
            extra = (in_flight / v - 1) * r["by_category"]["activations"] * (1 if t.grad_accum > 1 else 0)
            r["peak_bytes"] += extra
            r["by_category"] = {**r["by_category"], "activations": r["by_category"]["activations"] + extra}
        step = r["step_s"]
        out.append({"gpu": dev.name, "step_s": step, "tokens_per_s_per_gpu": tokens_per_gpu / step,
                    "mfu": model_flops * tokens_per_gpu / step / dev.bf16_flops,
                    "tflops_per_gpu": model_flops * tokens_per_gpu / step / 1e12,
                    "compute_s": r["compute_s"], "exposed_s": {k: v for k, v in r["exposed_s"].items() if v > 0},
                    "bubble": bubble, "peak_bytes": r["peak_bytes"], "by_category": r["by_category"],
                    "phases": r["phases"],
                    "fits": r["peak_bytes"] <= dev.hbm_bytes, "stage_world": stage_world})
    return out if variants else out[0]


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
        waits["pipeline bubble"] = r["compute_s"] * r["bubble"] / (1 - r["bubble"])
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
