"""FSDP per unit: a unit's parameters are gathered just before it runs, and freed after it.

One idea in ~470 lines: the packed buckets, the gather's autograd function, the prefetch and the re-gather
under recomputation only make sense together, so they stay in one file read top to bottom.

The model runs as a sequence of units (models/transformer.py `units`: the embedding, each block, the
head), each called through the train step's runner. On a mesh the runner hands each unit its
parameters in their compute placements (`UnitGather`). Those sharded over a data-parallel mesh dim
(dp_shard; edp for FSDP-sharded experts) are cast from the fp32 shards to train.param_dtype (a bf16
run moves half the bytes) and gathered together: each rank's shards, padded to DTensor's chunk size,
are packed into one flat buffer and all-gathered in ONE collective per unit and mesh dim (FSDP2's
`foreach_all_gather`), then cut back into whole parameters. The backward packs all of the unit's
gradients the same way, in train.reduce_dtype, and reduce-scatters them in one collective as soon as
autograd has all of them (when the unit's backward is done); each comes back a partial sum over
dp_replicate, which HSDP reduces once per step, on the shard (parallel/buckets.py).

What a unit's backward needs of its gathered parameters (a matmul saves its weight to compute the
input's gradient) would keep every gathered unit alive from its forward to its backward: at the
start of the backward, the whole model. With parallel.reshard_after_forward (FSDP2's default) the
unit runs under `Regather`, saved-tensor hooks that store, in place of a gathered parameter (or a view
of one), which unit and parameter it is and where in it the view lies; the backward gathers the unit
again (one collective, the first time one of its saved views is needed) and drops each parameter when
its last saved view has been used. Held between forward and backward: the shards only. Under
activation recomputation the recomputed function gathers again instead (nanomega/train/step.py), from a
gather launched ahead of it (RecomputedGather).

This is torch FSDP2's behaviour written over DTensor and functional collectives and
torch.autograd.graph's saved_tensors_hooks, rather than fully_shard's module hooks, because the model
is functions, not modules.

What overlaps (functional collectives are asynchronous: a collective starts when it is called and is
waited for at the first use of its result, as FSDP2 runs them on a side stream):
  forward    the step hands the forward's unit list to `UnitGather.prefetching` (Prefetch): when unit k
             is gathered, unit k + 1's all-gather is launched too, so it is in flight while unit k
             computes (one unit ahead: at most two units gathered at once);
  backward   a hook on each unit's output fires when the backward reaches the unit: it launches the
             gather again of the unit before it (the next one the backward reaches), a Regather's or a
             RecomputedGather's, so it is in flight while this unit's backward runs (one unit ahead);
             each unit's reduce-scatter is not waited for until the next unit's is launched (one in
             flight, InFlight): the backward of the unit before it runs meanwhile, and no more than
             one unit's whole gradients wait in a send buffer. Its gradients are handed back as Deferred
             tensors: views of the pending result (Bucket.reduce_scatter packs each in its shard's layout),
             cast to the shard's dtype where a reduce_dtype differs, computed at their first read (InFlight's
             wait, the micro-batches' sum, the reducer), so handing them back waits for nothing;
  micro-batches  under gradient accumulation a micro-batch's last reduce-scatter (the embedding's) is added to
             the earlier micro-batches' sum where that sum is next read (`accumulate`: by the next micro-batch,
             or the reducer), so it overlaps the next micro-batch's forward;
  pipeline   parallel/pipeline.py runs each stage's forward inside `prefetching` too: one unit ahead inside a
             stage, its forward and its backward, as without pp.
Under activation recomputation every gather is launched outside the recomputed region, in the forward and
in the backward alike; the recomputed function only unpacks a launched gather (RecomputedGather).
memory_tracker's schedule records where each collective is launched and waited (tests/test_overlap.py).

Float8 gathers (train.fp8=tensorwise): the blocks' dense float8 weights are sent in e4m3, a quarter of
fp32's bytes and half of bf16's (torchao's float8 all-gather for FSDP2). Their tensorwise scales need
the whole parameter's amax: one all-reduce (max) of the unit's shard amaxes over the dims that shard
them, then each shard is cast with its scale, gathered as bytes and dequantized. The linear layer
quantizes that weight again with the same amax, which gives back the same float8 values: the maths is
the serial run's (models/fp8.py), with a quarter of the gather traffic. Only tensorwise: a per-row or
per-block weight scale would be re-derived in the backward along the other dim, from already rounded
values.

Ours, not torch's fully_shard: re-decided 2026-12-03 with torch 2.13, and kept, its time gap measured.
Measured by `python bench/home_made.py` (2026-12-03 11:54, 2 loaded CPU cores at load ~9, torch 2.13;
bench/results/home_made.md) on 2 gloo processes, a 4-layer d-256 model, one forward + backward, against
fully_shard on nn.Modules whose units call the same unit functions, one fully_shard per unit and one at the
root:
  same maths   the gradient shards are fully_shard's, bitwise (max |difference| 0);
  memory       the pass's peak above its start, by torch's MemTracker for both: 66.1 MiB against 65.5, and
               31.3 against 34.2 under full recomputation;
  collectives  11 all-gathers, 6 reduce-scatters and one all-reduce (the loss) per pass against 12 and 6
               (the last unit's backward follows its forward: it is not gathered again);
  prefetch     ours launches 5/6 of the forward's gathers and 4/5 of the backward's ahead of their use, with
               or without recomputation; fully_shard as it comes 0/6 and 5/6 (its implicit forward
               prefetch is a CUDA stream running ahead of the CPU: on a CPU each gather is waited at once), 5/6
               with set_modules_to_forward_prefetch;
  time         869 ms per pass against 706 (23% slower; 1,055 against 890 with recomputation), the compute alone
               equal (460 and 456 ms without FSDP). Before the reduce-scatter's buffer stopped being zero-filled:
               1,101 against 857 (29%). Where the rest goes, by torch.profiler on rank 0 over 2 passes of each
               side (self CPU time per pass, same run):
                 DTensor dispatch  85 ms: every op of a unit runs on DTensors (the batch is a DTensor sharded
                                   over dp, the gathered parameters Replicate), each through DTensor's Python
                                   dispatch ("PythonSubclass", ~1,000 calls a pass at ~85 us); fully_shard
                                   computes on plain tensors. The price of one DTensor program for every layout
                                   (the design card's); on a GPU it is host time, hidden while the GPU is busier.
                 gloo's path       ~30 ms: funcol's all_gather_single / reduce_scatter_single reach gloo's
                                   *coalesced* collectives, which copy through extra buffers: a 4 MB block's
                                   gather 9.2 ms against 4.6 for dist.all_gather_into_tensor (fully_shard's),
                                   its reduce-scatter 12.5 against 9.4 (/tmp microbenchmark, 15 rounds). On
                                   NCCL the coalesced call of one tensor is the same kernel in a group: CPU only;
                 zero fill         23 ms, fixed: the reduce-scatter's packed buffer was new_zeros (5.7 ms of
                                   page-touching for a block's 4 MB), written in full anyway; now new_empty,
                                   only uneven chunks' padding zeroed.
               Small or none: the prefetch (without it 875 ms); copies (cat and copy_ 67 ms a pass against
               57: one copy into and one out of the packed buffer per parameter, as fully_shard's copy-in and
               copy-out); the Python of _GatherUnit and its backward (~12 ms a pass). The gap's size moves with
               the machine's load from run to run;
  size         751 (422) lines (code) with buckets.py, against fully_shard's 5,726 (3,885) in 9 files.
Why it stays: fully_shard hooks nn.Module, and the model is functions. Adopting it means a module around every
unit (the benchmark's is ~25 lines) and FSDP's state living in modules, not in the plan that also places TP, EP
and the optimizer's shards. The float8 gather per unit with one amax all-reduce has no fully_shard equivalent
without torchao's Float8Linear weight subclass (a module swap and a dependency). The same Bucket packs ZeRO-1's
reduce-scatter, and Regather serves the zero-bubble pipeline's two-pass backward. What fully_shard has that
this lacks: CPU offload, reshard_after_forward to a smaller mesh, and a compiled path (SimpleFSDP's DTensor
parametrization plus inductor's FSDP bucketing passes, in torchtitan; ours compiles per block because the
hooks cannot be traced). None of these was measured here. What is left of the gap is DTensor's dispatch (a
design choice, host time) and gloo's coalesced collectives (CPU only); a GPU run should measure it again.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from nanomega.models import fp8
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor, chunk_bounds
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


def _wait(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, Deferred):
        return t.materialize()
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class Deferred(torch.Tensor):
    """A tensor computed at its first use by any op, `compute(source)`, where `source` is a pending
    collective's result (funcol's AsyncCollectiveTensor): a reduce-scatter's gradient shard, cast back from
    train.reduce_dtype to the shard's dtype; a micro-batch's gradient added to the earlier ones' sum
    (`accumulate`). Handing it on (to autograd, into a DTensor, to a gradient hook) runs nothing, so the
    collective stays in flight until something reads the value, as a funcol result is waited for at its
    first use; a cast or a sum computed where it is handed over would wait at once. memory_tracker lets it
    compute itself (`unwraps_itself`), so its schedule sees the wait where it happens."""

    unwraps_itself = True

    @staticmethod
    def __new__(cls, compute, source: torch.Tensor, dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(cls, source.shape, dtype=dtype, device=source.device)
        r.compute, r.source = compute, source
        return r

    @property
    def ready(self) -> bool:
        return self.compute is None

    def materialize(self) -> torch.Tensor:
        """The value (computed once; the pending result is dropped then)."""
        if self.compute is not None:
            self.source, self.compute = self.compute(self.source), None
        return self.source

    def __tensor_flatten__(self):
        return ["source"], None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Deferred({self.materialize()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = torch.utils._pytree.tree_map_only(Deferred, Deferred.materialize, (args, kwargs or {}))
        return func(*args, **kwargs)


def _pending(t: torch.Tensor):
    """t's local tensor if it is a Deferred not yet computed, else None."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local if isinstance(local, Deferred) and not local.ready else None


def _with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    return DTensor(local, t._spec, requires_grad=False) if isinstance(t, DTensor) else local


def resolved(t: torch.Tensor) -> torch.Tensor:
    """t with its value computed, if it is (a DTensor of) a Deferred: what to hand to code that may be
    compiled (the optimizer's update)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    return _with_local(t, local.materialize()) if isinstance(local, Deferred) else t


def accumulate(total: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """total + g: a micro-batch's gradient added to the earlier micro-batches' sum (nanomega/train/step.py).
    Where g is a reduce-scatter still in flight (FSDP's last unit of the micro-batch: InFlight has computed
    the others), the sum is deferred to its first use (the next micro-batch's sum, or the reducer), so the
    collective overlaps the next micro-batch's forward instead of being waited for here. The same
    elementwise sum of the same local tensors as DTensor's (placements equal), so the same numbers."""
    pending = _pending(g)
    if pending is None or not isinstance(total, DTensor) or (total.placements, total.dtype) != (g.placements, g.dtype):
        return total + g
    earlier = _wait(total._local_tensor)   # computed by now: its micro-batch's collective is long done
    return _with_local(g, Deferred(lambda p: earlier + p, pending, g.dtype))


class Bucket:
    """Parameters that one mesh dim shards (a unit's under FSDP; a bucket of ZeRO-1's gradients), and
    how to pack them: parameter i is split on its dim dims[i] of global length lengths[i], in chunks of
    ceil(length / k)."""

    def __init__(self, names: list, layouts: dict, mesh_dim: int, role: str = "storage", fp8: bool = False):
        self.names, self.mesh_dim, self.fp8 = names, mesh_dim, fp8
        first = layouts[names[0]]
        self.mesh = first.mesh
        self.k, self.coord = self.mesh.size(mesh_dim), self.mesh.get_local_rank(mesh_dim)
        self.layouts = [layouts[n] for n in names]
        # the dim the mesh dim splits in the placements of `role` (ZeRO-1's reduce-scatter: "optimizer")
        self.dims = [getattr(lay, role)[mesh_dim].dim for lay in self.layouts]
        self.lengths = [lay.shape[d] for lay, d in zip(self.layouts, self.dims)]

    def _chunk(self, i: int) -> int:
        return -(-self.lengths[i] // self.k)

    def launch_gather(self, shards: list):
        """This rank's local shards, packed into one buffer (each padded to its chunk), and their
        all-gather started: the pending result, for `unpack_gather` (funcol's AsyncCollectiveTensor:
        waited on at first use, so compute can run while it is in flight). A float8 bucket sends each
        shard in e4m3 with its whole parameter's tensorwise scale (module doc): (pending, scales, dtype)."""
        if not self.fp8:
            return self._launch(shards)
        amax = torch.stack([x.detach().float().abs().amax() for x in shards])
        sharded = [d for d in range(self.mesh.ndim) if any(lay.storage[d].is_shard() for lay in self.layouts)]
        amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", group_over(self.mesh, sharded)))
        quantized = [fp8.quantize(x, fp8.E4M3, "tensorwise", 1, amax=a) for x, a in zip(shards, amax)]
        return self._launch([q.view(torch.uint8) for q, _ in quantized]), [s for _, s in quantized], shards[0].dtype

    def _launch(self, shards: list) -> torch.Tensor:
        rows = []
        for i, x in enumerate(shards):
            y = x.movedim(self.dims[i], 0)
            pad = self._chunk(i) - y.shape[0]
            rows.append((torch.cat([y, y.new_zeros(pad, *y.shape[1:])]) if pad else y).reshape(-1))
        return funcol.all_gather_single(torch.cat(rows), 0, (self.mesh, self.mesh_dim))

    def unpack_gather(self, pending, shards: list) -> list:
        """Wait for a launched gather and cut it into the local tensors of the whole parameters (a float8
        bucket's dequantized, in the dtype its shards were sent from)."""
        if self.fp8:
            pending, scales, dtype = pending
            return [(q.view(fp8.E4M3).float() * s).to(dtype) for q, s in zip(self._unpack(pending, shards), scales)]
        return self._unpack(pending, shards)

    def _unpack(self, pending: torch.Tensor, shards: list) -> list:
        gathered = _wait(pending).view(self.k, -1)
        out, offset = [], 0
        for i, x in enumerate(shards):
            rest = x.movedim(self.dims[i], 0).shape[1:]
            size = self._chunk(i) * rest.numel()
            part = gathered[:, offset:offset + size].reshape(self.k, self._chunk(i), *rest)
            offset += size
            whole = torch.cat([part[j, :chunk_bounds(self.lengths[i], self.k, j)[1]] for j in range(self.k)])
            out.append(whole.movedim(0, self.dims[i]).contiguous())
        return out

    def gather(self, shards: list) -> list:
        """This rank's local shards -> the local tensors of the parameters gathered over the mesh dim."""
        return self.unpack_gather(self.launch_gather(shards), shards)

    def reduce_scatter(self, grads: list) -> list:
        """Local gradients of the gathered parameters (partial sums over the mesh dim) -> this rank's
        chunk of each, summed over the mesh dim: one reduce-scatter of one packed buffer, written in
        place (row j: every gradient's chunk j, padded), so the step holds the gradients and one buffer.
        Each chunk is packed in its shard's own layout (not moved to dim 0), so what comes back is a view
        of the pending result: nothing waits for the reduce-scatter before a gradient is read."""
        sizes = [self._chunk(i) * g.numel() // self.lengths[i] for i, g in enumerate(grads)]
        # not zero-filled: every element is written below, the padding of uneven chunks apart (zeroed there);
        # a zero fill of the whole buffer cost 5.7 ms of a 4 MB block's reduce-scatter (bench/home_made.py)
        flat = grads[0].new_empty(self.k, sum(sizes))
        offset = 0
        for i, g in enumerate(grads):
            d, chunk = self.dims[i], self._chunk(i)
            if self.lengths[i] % self.k == 0:     # even chunks: one copy
                rows = flat[:, offset:offset + sizes[i]].view(self.k, *g.shape[:d], chunk, *g.shape[d + 1:])
                rows.copy_(g.unflatten(d, (self.k, chunk)).movedim(d, 0))
            else:
                for j in range(self.k):
                    part = g.narrow(d, *chunk_bounds(self.lengths[i], self.k, j))
                    flat[j, offset:offset + part.numel()].view(part.shape).copy_(part)
                    flat[j, offset + part.numel():offset + sizes[i]].zero_()
            offset += sizes[i]
        mine = funcol.reduce_scatter_single(flat.reshape(-1), "sum", 0, (self.mesh, self.mesh_dim))
        out, offset = [], 0
        for i, g in enumerate(grads):
            shape = list(g.shape)
            shape[self.dims[i]] = chunk_bounds(self.lengths[i], self.k, self.coord)[1]
            out.append(mine[offset:offset + torch.Size(shape).numel()].view(shape))
            offset += sizes[i]
        return out

    def as_compute(self, i: int, local: torch.Tensor) -> DTensor:
        return as_dtensor(local, self.mesh, self.layouts[i].compute, self.layouts[i].shape)


class InFlight:
    """The one reduce-scatter left in flight (FSDP2 keeps one): launching the next waits for it, so its
    input, the unit's whole gradients, is freed then, not held until the optimizer reads the shards, and
    computes its gradients (Deferred: the cast back from reduce_dtype; FSDP2 casts after the wait on its
    reduce-scatter stream), so no more than one unit's gradients are held in reduce_dtype. Weak
    references: a gradient already read (and so computed) is not kept alive by it."""

    def __init__(self):
        self.last = []

    def replace(self, results: list) -> None:
        for ref in self.last:
            if (previous := ref()) is not None:
                previous.materialize()
        self.last = [weakref.ref(r) for r in results]


class _GatherUnit(torch.autograd.Function):
    """A bucket's shards (fp32 DTensors, storage placements) -> the parameters in their compute
    placements in `dtype`, with one all-gather; the backward reduce-scatters all the gradients in
    `reduce_dtype` with one collective and hands each back in the shard's dtype and its gradient
    placements (storage, but a partial sum over dp_replicate). `pending`: the gather, already launched
    by the prefetch (else launched here); `in_flight`: the step's InFlight reduce-scatter."""

    @staticmethod
    def forward(ctx, bucket, grad_placements, dtype, reduce_dtype, pending, in_flight, *shards):
        ctx.bucket, ctx.grad_placements, ctx.reduce_dtype = bucket, grad_placements, reduce_dtype
        ctx.in_flight = in_flight
        ctx.shard_dtypes = [s.dtype for s in shards]
        local = [s.to_local() for s in shards]
        if pending is None:
            pending = bucket.launch_gather([x.to(dtype) for x in local])
        gathered = bucket.unpack_gather(pending, local)
        ctx.local_shapes = [x.shape for x in gathered]
        return tuple(bucket.as_compute(i, x) for i, x in enumerate(gathered))

    @staticmethod
    def backward(ctx, *grads):
        bucket = ctx.bucket
        local = []
        for i, g in enumerate(grads):
            if g is None:    # a parameter the unit did not use
                local.append(torch.zeros(ctx.local_shapes[i], dtype=ctx.reduce_dtype, device=bucket.mesh.device_type))
                continue
            # a partial sum over the gathered dim (reduced here), the gradient placements elsewhere
            want = tuple(Partial() if d == bucket.mesh_dim else p for d, p in enumerate(ctx.grad_placements[i]))
            if tuple(g.placements) != want:
                g = g.redistribute(bucket.mesh, want)
            local.append(g.to_local().to(ctx.reduce_dtype))
        # each shard's gradient, computed at its first use: the pending result cast to the shard's dtype
        # (a view of it where the dtypes agree), so nothing here waits for the reduce-scatter
        shards = [Deferred(functools.partial(_cast_back, dtype=dtype), s, dtype)
                  for s, dtype in zip(bucket.reduce_scatter(local), ctx.shard_dtypes)]
        ctx.in_flight.replace(shards)
        return (None, None, None, None, None, None, *(
            _dtensor(s, bucket.mesh, placements, lay.shape)
            for s, placements, lay in zip(shards, ctx.grad_placements, bucket.layouts)))


def _dtensor(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    """plan.as_dtensor without an op on `local` (DTensor.from_local takes a view of it, which would compute
    a Deferred)."""
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _cast_back(pending: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _wait(pending).to(dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _address(t: torch.Tensor) -> int:
    """Which storage t is a view of (the same for every view; fake tensors have one too); 0 for what
    cannot be a gathered parameter: an empty tensor, or a tensor subclass with no storage of its own
    (an all-to-all's pending AsyncCollectiveTensor)."""
    if not t.numel():
        return 0
    try:
        return t.untyped_storage()._cdata
    except RuntimeError:
        return 0


class Regather(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks under which a unit's gathered parameters are not kept for its backward but
    gathered again (module doc). `track(key, bucket, shards, gathered)` registers each bucket's gather;
    `prefetch` launches the gathers again ahead of the backward (Prefetch)."""

    def __init__(self, launch, unpack):
        self.launch, self.unpack = launch, unpack   # (bucket, shards) -> pending; (bucket, pending, shards) -> locals
        self.forward_storages = {}          # storage -> (bucket, shards, i, gathered local), while the unit runs
        self.buckets = []                   # (bucket, shards) of each gather, in order
        self.pending, self.regathered, self.launched = {}, {}, {}
        self.gathered_again = set()         # the buckets the backward has gathered again
        super().__init__(self._pack, self._unpack)

    def track(self, key, bucket: Bucket, shards: list, gathered: tuple) -> tuple:
        """(key: unused here, the saved views name their bucket.)"""
        self.buckets.append((bucket, shards))
        for i, g in enumerate(gathered):
            if address := _address(_local(g)):
                self.forward_storages[address] = (bucket, shards, i, _local(g))
        return gathered

    def __exit__(self, *exc):
        self.forward_storages = {}    # the forward is over: hold no gathered parameter
        # nor the shards of a bucket none of whose views was saved: the backward never gathers it again,
        # and this object is in a cycle with its hooks (freed by the garbage collector only, and so
        # possibly after the update that replaces those shards)
        self.buckets = [(b, s) for b, s in self.buckets if any(self.pending.get((b, i)) for i in range(len(b.names)))]
        return super().__exit__(*exc)

    def prefetch(self):
        """Launch the gather of every bucket whose saved views the backward will need (FSDP2's
        backward prefetch), without waiting for it."""
        for bucket, shards in self.buckets:
            needed = any(self.pending.get((bucket, i)) for i in range(len(bucket.names)))
            if needed and bucket not in self.launched and bucket not in self.gathered_again:
                self.launched[bucket] = self.launch(bucket, shards)

    def _pack(self, t: torch.Tensor):
        local = _local(t)
        found = self.forward_storages.get(_address(local))
        if found is None:
            return t
        bucket, shards, i, whole = found
        self.pending[bucket, i] = self.pending.get((bucket, i), 0) + 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        return bucket, shards, i, spec, local.shape, local.stride(), local.storage_offset() - whole.storage_offset()

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        bucket, shards, i, spec, size, stride, offset = saved
        if (bucket, i) not in self.regathered:   # the first saved view of this unit: gather it all again
            # or a view needed again after its unit was freed: a backward in two passes over one graph
            # (pipeline's zero-bubble schedule: the input's gradient, later the weights'), kept from then on
            again = bucket in self.gathered_again
            self.gathered_again.add(bucket)
            # hold no shard past its use: the hooks refer to this object (a cycle that only the garbage
            # collector breaks), and it must not keep the step's parameters alive after their update
            self.buckets = [(b, s) for b, s in self.buckets if b is not bucket]
            pending = self.launched.pop(bucket, None)
            pending = self.launch(bucket, shards) if pending is None else pending
            for j, whole in enumerate(self.unpack(bucket, pending, shards)):
                if again or self.pending.get((bucket, j)):
                    self.regathered[bucket, j] = whole
        whole = self.regathered[bucket, i]
        self.pending[bucket, i] -= 1
        if self.pending[bucket, i] == 0:     # its last saved view: free it
            del self.regathered[bucket, i]
        local = whole.as_strided(size, stride, whole.storage_offset() + offset)
        if spec is None:
            return local
        mesh, placements, shape, full_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=full_stride)


class RecomputedGather:
    """A recomputed unit's gathers for its recomputation in the backward, launched ahead from outside the
    recomputed region (Prefetch), where its forward's were launched too: the recomputed function only
    unpacks, the same ops in the forward and in the recomputation (selective recomputation replays the
    forward's saved ops by position; a float8 gather's amax all-reduce is such an op)."""

    def __init__(self, launch):
        self.launch = launch        # (bucket, shards) -> pending
        self.buckets = {}           # bucket key -> (bucket, shards), from the forward
        self.launched = {}          # bucket key -> pending gather

    def track(self, key, bucket: Bucket, shards: list, gathered: tuple) -> tuple:
        self.buckets[key] = bucket, shards
        return gathered

    def prefetch(self):
        for key, (bucket, shards) in self.buckets.items():
            if key not in self.launched:
                self.launched[key] = self.launch(bucket, shards)

    def take(self) -> dict:
        """The launched gathers, for the recomputation (which launches, inside itself, any not launched)."""
        launched, self.launched, self.buckets = self.launched, {}, {}   # hold no shard past its use
        return launched


class Prefetch:
    """The units of one forward, in order (models/transformer.py `units`), so that the gather of unit
    k + 1 is launched before unit k computes (FSDP2's forward prefetch: one unit ahead), and, in the
    backward, the gather again of unit k - 1 before unit k computes its backward (FSDP2's backward
    prefetch): a hook on unit k's output (`after`) fires when its gradient is complete, before any of the
    unit's backward runs, and launches, from outside any recomputed region, the gathers of unit k (if
    still needed) and of unit k - 1 (a Regather's or a RecomputedGather's)."""

    def __init__(self, units: list):
        self.units = units
        self.current = -1          # the unit the forward runs now
        self.launched = {}         # unit index -> {bucket key: pending gather}
        self.again = {}            # unit index -> its Regather or RecomputedGather

    def enter(self, prefix: str, leaves: list) -> int:
        k = self.current = self.current + 1
        name, params = self.units[k]
        if name != prefix or any(a is not b for a, b in zip(tree_flatten(params)[0], leaves)):
            raise RuntimeError(f"unit {k} of the forward is {name!r}, but {prefix!r} ran: the forward must "
                               "run its units in the order models.transformer.units lists them")
        return k

    def to_launch(self, k: int) -> list[int]:
        """Which of units k and k + 1 to launch the gathers of now (not yet launched)."""
        return [j for j in (k, k + 1) if j < len(self.units) and j not in self.launched]

    def backward_reaches(self, k: int, grad=None) -> None:
        """Unit k's backward is about to run: its gather again (launched already, but for the backward's
        first unit) and unit k - 1's, one unit ahead."""
        for again in (self.again.pop(k, None), self.again.get(k - 1)):
            if again is not None:
                again.prefetch()


def fsdp_mesh_dim(layout) -> int | None:
    """The mesh dim whose Shard storage the compute placements gather (FSDP), or None."""
    dims = [d for d, (s, c) in enumerate(zip(layout.storage, layout.compute)) if s != c]
    if not dims:
        return None
    if len(dims) > 1 or not isinstance(layout.storage[dims[0]], Shard):
        raise ValueError(f"a unit gathers over one mesh dim from Shard placements; got {layout}")
    return dims[0]


class UnitGather:
    """Gathers a unit's parameters to their compute placements (module doc), for Parallel.gather.
    Inside `prefetching(units)` the gathers run one unit ahead of the forward (Prefetch)."""

    def __init__(self, layouts: dict, grad_placements: dict, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                 fp8_gather=lambda name: False):
        self.layouts, self.grad_placements, self.fp8_gather = layouts, grad_placements, fp8_gather
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.ahead = None     # the Prefetch of the forward running now, if any
        self.in_flight = InFlight()

    @contextlib.contextmanager
    def prefetching(self, units: list):
        self.ahead = Prefetch(units)
        try:
            yield
        finally:
            self.ahead = None

    def before(self, prefix: str, params: dict) -> None:
        """Called as the forward reaches a unit, outside any recomputation: launch its gather and the
        next unit's, where not launched already (Prefetch). A no-op outside `prefetching`."""
        if self.ahead is None:
            return
        k = self.ahead.enter(prefix, tree_flatten(params)[0])
        for j in self.ahead.to_launch(k):
            leaves, buckets = self.buckets(*self.ahead.units[j])
            self.ahead.launched[j] = {key: self.launch(b, [leaves[i] for i in js]) for key, b, js in buckets}

    def after(self, output) -> None:
        """Called with the output of the unit the forward has just run: when its gradient is complete, the
        backward's gathers are launched one unit ahead (Prefetch.backward_reaches). A no-op outside
        `prefetching`."""
        first = output[0] if isinstance(output, (tuple, list)) else output   # a block's: (x, router stats)
        if self.ahead is not None and isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(functools.partial(self.ahead.backward_reaches, self.ahead.current))

    def buckets(self, prefix: str, params: dict) -> tuple[list, list]:
        """The unit's leaves and [(key, Bucket, leaf indices)]: one bucket per mesh and mesh dim that
        FSDP gathers over (the dense mesh's dp_shard; the expert mesh's edp)."""
        leaves = tree_flatten(params)[0]
        names = [f"{prefix}.{n}" if prefix else n for n in named_leaves(params)]
        members: dict = {}
        for j, name in enumerate(names):
            dim = fsdp_mesh_dim(self.layouts[name])
            if dim is not None:
                members.setdefault((id(self.layouts[name].mesh), dim, self.fp8_gather(name)), []).append(j)
        return leaves, [(key, Bucket([names[j] for j in js], self.layouts, key[1], fp8=key[2]), js)
                        for key, js in members.items()]

    def launch(self, bucket: Bucket, shards: list):
        """Start the gather of a bucket's shards (DTensors) in param_dtype, outside autograd."""
        with torch.no_grad():
            return bucket.launch_gather([s.detach().to_local().to(self.param_dtype) for s in shards])

    def unpack(self, bucket: Bucket, pending: torch.Tensor, shards: list) -> list:
        with torch.no_grad():
            return bucket.unpack_gather(pending, [s.to_local() for s in shards])

    def __call__(self, prefix: str, params: dict, again: Regather | RecomputedGather | None = None) -> dict:
        """The unit's parameters in compute placements. `again`: how the backward gathers them again, a
        Regather (freed after the forward) or a RecomputedGather (the unit is recomputed, and this is called
        again by its recomputation, in the backward)."""
        leaves, buckets = self.buckets(prefix, params)
        out = [x.to(self.param_dtype) for x in leaves]   # what needs no gather (DDP, TP): the cast only
        recomputing = torch._C._current_graph_task_id() != -1
        launched = {}
        if recomputing:
            launched = again.take() if isinstance(again, RecomputedGather) else {}
        elif self.ahead is not None:     # the forward, prefetching
            k = self.ahead.current
            launched = self.ahead.launched.pop(k, {})
            if again is not None:
                self.ahead.again[k] = again
        for key, bucket, js in buckets:
            shards = [leaves[j] for j in js]
            gathered = _GatherUnit.apply(bucket, [self.grad_placements[n] for n in bucket.names],
                                         self.param_dtype, self.reduce_dtype, launched.get(key), self.in_flight,
                                         *shards)
            if again is not None and not recomputing:
                again.track(key, bucket, shards, gathered)
            for j, g in zip(js, gathered):
                out[j] = g
        return tree_unflatten(out, tree_flatten(params)[1])
