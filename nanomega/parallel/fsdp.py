"""FSDP per unit: a unit's parameters are gathered just before it runs, and freed after it.

The model runs as a sequence of units (models/transformer.py `units`: the embedding, each block, the
head), each called through the train step's runner. On a mesh the runner hands each unit its
parameters in their compute placements (`UnitGather`). Those sharded over a data-parallel mesh dim
(dp_shard; edp for FSDP-sharded experts) are cast from the fp32 shards to train.param_dtype (a bf16
run moves half the bytes) and gathered together: each rank's shards, padded to DTensor's chunk size,
are packed into one flat buffer and all-gathered in ONE collective per unit and mesh dim (FSDP2's
`foreach_all_gather`), then cut back into whole parameters. The backward packs all of the unit's
gradients the same way, in train.reduce_dtype, and reduce-scatters them in one collective as soon as
autograd has all of them (when the unit's backward is done); each comes back a partial sum over
dp_replicate, which HSDP reduces once per step, on the shard (parallelize.Parallel.reduce).

What a unit's backward needs of its gathered parameters (a matmul saves its weight to compute the
input's gradient) would keep every gathered unit alive from its forward to its backward: at the
start of the backward, the whole model. With parallel.reshard_after_forward (FSDP2's default) the
unit runs under `Regather`, saved-tensor hooks that store, in place of a gathered parameter (or a view
of one), which unit and parameter it is and where in it the view lies; the backward gathers the unit
again (one collective, the first time one of its saved views is needed) and drops each parameter when
its last saved view has been used. Held between forward and backward: the shards only. Under
activation recomputation the gather is part of the recomputed function instead (nanomega/step.py).

This is torch FSDP2's behaviour written over DTensor and functional collectives and
torch.autograd.graph's saved_tensors_hooks, rather than fully_shard's module hooks, because the model
is functions, not modules. Not done: prefetching the next unit's gather during the current unit's
compute (the runner sees one unit at a time), so on this CPU nothing overlaps.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Shard

from nanomega.parallel.plan import as_dtensor, chunk_bounds
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class Bucket:
    """Parameters that one mesh dim shards (a unit's under FSDP; a bucket of ZeRO-1's gradients), and
    how to pack them: parameter i is split on its dim dims[i] of global length lengths[i], in chunks of
    ceil(length / k)."""

    def __init__(self, names: list, layouts: dict, mesh_dim: int, role: str = "storage"):
        self.names, self.mesh_dim = names, mesh_dim
        first = layouts[names[0]]
        self.mesh = first.mesh
        self.k, self.coord = self.mesh.size(mesh_dim), self.mesh.get_local_rank(mesh_dim)
        self.layouts = [layouts[n] for n in names]
        # the dim the mesh dim splits in the placements of `role` (ZeRO-1's reduce-scatter: "optimizer")
        self.dims = [getattr(lay, role)[mesh_dim].dim for lay in self.layouts]
        self.lengths = [lay.shape[d] for lay, d in zip(self.layouts, self.dims)]

    def _chunk(self, i: int) -> int:
        return -(-self.lengths[i] // self.k)

    def gather(self, shards: list) -> list:
        """This rank's local shards -> the local tensors of the parameters gathered over the mesh dim."""
        rows = []
        for i, x in enumerate(shards):
            y = x.movedim(self.dims[i], 0)
            pad = self._chunk(i) - y.shape[0]
            rows.append((torch.cat([y, y.new_zeros(pad, *y.shape[1:])]) if pad else y).reshape(-1))
        flat = torch.cat(rows)
        gathered = _wait(funcol.all_gather_single(flat, 0, (self.mesh, self.mesh_dim))).view(self.k, -1)
        out, offset = [], 0
        for i, x in enumerate(shards):
            rest = x.movedim(self.dims[i], 0).shape[1:]
            size = self._chunk(i) * rest.numel()
            part = gathered[:, offset:offset + size].reshape(self.k, self._chunk(i), *rest)
            offset += size
            whole = torch.cat([part[j, :chunk_bounds(self.lengths[i], self.k, j)[1]] for j in range(self.k)])
            out.append(whole.movedim(0, self.dims[i]).contiguous())
        return out

    def reduce_scatter(self, grads: list) -> list:
        """Local gradients of the gathered parameters (partial sums over the mesh dim) -> this rank's
        chunk of each, summed over the mesh dim: one reduce-scatter of one packed buffer, written in
        place (row j: every gradient's chunk j, padded), so the step holds the gradients and one buffer."""
        sizes = [self._chunk(i) * g.movedim(self.dims[i], 0).shape[1:].numel() for i, g in enumerate(grads)]
        flat = grads[0].new_zeros(self.k, sum(sizes))
        offset = 0
        for i, g in enumerate(grads):
            y = g.movedim(self.dims[i], 0)
            if self.lengths[i] % self.k == 0:     # even chunks: one copy
                flat[:, offset:offset + sizes[i]].copy_(y.reshape(self.k, sizes[i]))
            else:
                for j in range(self.k):
                    start, length = chunk_bounds(self.lengths[i], self.k, j)
                    n = length * y.shape[1:].numel()
                    flat[j, offset:offset + n].copy_(y[start:start + length].reshape(-1))
            offset += sizes[i]
        flat = flat.reshape(-1)
        mine = _wait(funcol.reduce_scatter_single(flat, "sum", 0, (self.mesh, self.mesh_dim)))
        out, offset = [], 0
        for i, g in enumerate(grads):
            rest = g.movedim(self.dims[i], 0).shape[1:]
            size = self._chunk(i) * rest.numel()
            length = chunk_bounds(self.lengths[i], self.k, self.coord)[1]
            chunk = mine[offset:offset + size].reshape(self._chunk(i), *rest)[:length]
            offset += size
            out.append(chunk.movedim(0, self.dims[i]).contiguous())
        return out

    def as_compute(self, i: int, local: torch.Tensor) -> DTensor:
        return as_dtensor(local, self.mesh, self.layouts[i].compute, self.layouts[i].shape)


class _GatherUnit(torch.autograd.Function):
    """A bucket's shards (fp32 DTensors, storage placements) -> the parameters in their compute
    placements in `dtype`, with one all-gather; the backward reduce-scatters all the gradients in
    `reduce_dtype` with one collective and hands each back in the shard's dtype and its gradient
    placements (storage, but a partial sum over dp_replicate)."""

    @staticmethod
    def forward(ctx, bucket, grad_placements, dtype, reduce_dtype, *shards):
        ctx.bucket, ctx.grad_placements, ctx.reduce_dtype = bucket, grad_placements, reduce_dtype
        ctx.shard_dtypes = [s.dtype for s in shards]
        gathered = bucket.gather([s.to_local().to(dtype) for s in shards])
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
        shards = bucket.reduce_scatter(local)
        return (None, None, None, None, *(
            as_dtensor(s.to(dtype), bucket.mesh, placements, lay.shape)
            for s, dtype, placements, lay in zip(shards, ctx.shard_dtypes, ctx.grad_placements, bucket.layouts)))


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
    gathered again (module doc). `track(bucket, shards, gathered)` registers each bucket's gather."""

    def __init__(self, gather_again):
        self.gather_again = gather_again   # (bucket, shards) -> the gathered local tensors, without autograd
        self.forward_storages = {}          # storage -> (bucket, shards, i, gathered local), while the unit runs
        self.pending, self.regathered = {}, {}
        super().__init__(self._pack, self._unpack)

    def track(self, bucket: Bucket, shards: list, gathered: tuple) -> tuple:
        for i, g in enumerate(gathered):
            if address := _address(_local(g)):
                self.forward_storages[address] = (bucket, shards, i, _local(g))
        return gathered

    def __exit__(self, *exc):
        self.forward_storages = {}    # the forward is over: hold no gathered parameter
        return super().__exit__(*exc)

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
            for j, whole in enumerate(self.gather_again(bucket, shards)):
                if self.pending.get((bucket, j)):
                    self.regathered[bucket, j] = whole
        whole = self.regathered[bucket, i]
        self.pending[bucket, i] -= 1
        if not self.pending[bucket, i]:     # its last saved view: free it
            del self.regathered[bucket, i]
        local = whole.as_strided(size, stride, whole.storage_offset() + offset)
        if spec is None:
            return local
        mesh, placements, shape, full_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=full_stride)


def fsdp_mesh_dim(layout) -> int | None:
    """The mesh dim whose Shard storage the compute placements gather (FSDP), or None."""
    dims = [d for d, (s, c) in enumerate(zip(layout.storage, layout.compute)) if s != c]
    if not dims:
        return None
    if len(dims) > 1 or not isinstance(layout.storage[dims[0]], Shard):
        raise ValueError(f"a unit gathers over one mesh dim from Shard placements; got {layout}")
    return dims[0]


class UnitGather:
    """Gathers a unit's parameters to their compute placements (module doc), for Parallel.gather."""

    def __init__(self, layouts: dict, grad_placements: dict, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.layouts, self.grad_placements = layouts, grad_placements
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def __call__(self, prefix: str, params: dict, regather: Regather | None = None) -> dict:
        leaves, spec = tree_flatten(params)
        names = [f"{prefix}.{n}" if prefix else n for n in named_leaves(params)]
        out = [x.to(self.param_dtype) for x in leaves]   # what needs no gather (DDP, TP): the cast only
        buckets: dict = {}
        for j, (name, x) in enumerate(zip(names, leaves)):
            dim = fsdp_mesh_dim(self.layouts[name])
            if dim is not None:
                buckets.setdefault((id(self.layouts[name].mesh), dim), []).append(j)
        for (_, dim), members in buckets.items():
            bucket = Bucket([names[j] for j in members], self.layouts, dim)
            shards = [leaves[j] for j in members]
            gathered = _GatherUnit.apply(bucket, [self.grad_placements[n] for n in bucket.names],
                                         self.param_dtype, self.reduce_dtype, *shards)
            if regather is not None:
                regather.track(bucket, shards, gathered)
            for j, g in zip(members, gathered):
                out[j] = g
        return tree_unflatten(out, spec)

    def gather_again(self, bucket: Bucket, shards: list) -> list:
        with torch.no_grad():
            return bucket.gather([s.detach().to_local().to(self.param_dtype) for s in shards])
