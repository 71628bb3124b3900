"""FSDP per unit: a unit's parameters are gathered just before it runs, and freed after it.

The model runs as a sequence of units (models/transformer.py `units`: the embedding, each block, the
head), each called through the train step's runner. On a mesh the runner hands each unit its
parameters gathered to their compute placements (`gather_unit`): an all-gather over dp_shard (and
over edp for FSDP-sharded experts) per parameter, after casting the fp32 shard to train.param_dtype,
so a bf16 run moves half the bytes. The gather's backward reduce-scatters that parameter's gradient
(in train.reduce_dtype) as soon as autograd has summed it, i.e. when the unit's backward is done,
and leaves it a partial sum over dp_replicate (HSDP reduces that once per step, on the shard).

What a unit's backward needs of its gathered parameters (a matmul saves its weight to compute the
input's gradient) would keep every gathered unit alive from its forward to its backward: at the
start of the backward, the whole model. With parallel.reshard_after_forward (FSDP2's default) the
unit runs under `Regather`, saved-tensor hooks that store, in place of a gathered parameter (or a view
of one), the name of its shard and where in it the view lies; the backward gathers the parameter
again (once per unit, the first time one of its saved views is needed) and drops it when the last one
has been used. Held between forward and backward: the shards only. Under activation recomputation
the gather is part of the recomputed function instead (nanomega/step.py), which has the same effect.

This is torch FSDP2's behaviour written over DTensor redistributions and torch.autograd.graph's
saved_tensors_hooks rather than over fully_shard's module hooks, because the model is functions, not
modules. Not done (yet): coalescing a unit's gathers into one collective, and prefetching the next
unit's gather during the current unit's compute.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from nanomega.tree import map_with_name


class _Gather(torch.autograd.Function):
    """shard -> its compute placements in `dtype`; the gradient comes back in `reduce_dtype`, reduced
    to `grad_placements` (storage, but a partial sum over dp_replicate: DTensor's own backward would go
    to the storage placements, an all-reduce of the whole gradient over dp_replicate per micro-batch,
    before the reduce-scatter over dp_shard), then cast to the shard's dtype."""

    @staticmethod
    def forward(ctx, shard, mesh, compute, grad_placements, dtype, reduce_dtype):
        ctx.mesh, ctx.grad_placements, ctx.shard_dtype, ctx.reduce_dtype = mesh, grad_placements, shard.dtype, reduce_dtype
        return shard.to(dtype).redistribute(mesh, compute)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(ctx.reduce_dtype).redistribute(ctx.mesh, ctx.grad_placements)
        return grad.to(ctx.shard_dtype), None, None, None, None, None


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
    gathered again (module doc). `track(name, shard, gathered)` registers each gathered parameter."""

    def __init__(self, gather_again):
        self.gather_again = gather_again   # (name, shard) -> the gathered parameter, without autograd
        self.forward_storages = {}          # storage address -> (name, shard, gathered), while the unit runs
        self.pending, self.regathered = {}, {}
        super().__init__(self._pack, self._unpack)

    def track(self, name: str, shard: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        address = _address(_local(gathered))
        if address:
            self.forward_storages[address] = (name, shard, gathered)
        return gathered

    def __exit__(self, *exc):
        self.forward_storages = {}    # the forward is over: hold no gathered parameter
        return super().__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        local = _local(t)
        found = self.forward_storages.get(_address(local))
        if found is None:
            return t
        name, shard, gathered = found
        self.pending[name] = self.pending.get(name, 0) + 1
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
        offset = local.storage_offset() - _local(gathered).storage_offset()
        return name, shard, spec, local.shape, local.stride(), offset

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        name, shard, spec, size, stride, offset = saved
        if name not in self.regathered:
            self.regathered[name] = self.gather_again(name, shard)
        whole = _local(self.regathered[name])
        self.pending[name] -= 1
        if not self.pending[name]:     # the last saved view of it: the unit's backward is (nearly) done
            del self.regathered[name]
        local = whole.as_strided(size, stride, whole.storage_offset() + offset)
        if spec is None:
            return local
        mesh, placements, shape, full_stride = spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=full_stride)


class UnitGather:
    """Gathers a unit's parameters to their compute placements (module doc), for Parallel.gather."""

    def __init__(self, layouts: dict, grad_placements: dict, param_dtype: torch.dtype, reduce_dtype: torch.dtype):
        self.layouts, self.grad_placements = layouts, grad_placements
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def needs_gather(self, name: str, x: torch.Tensor) -> bool:
        return tuple(x.placements) != self.layouts[name].compute

    def __call__(self, prefix: str, params: dict, regather: Regather | None = None) -> dict:
        def gather(leaf: str, x):
            name = f"{prefix}.{leaf}" if prefix else leaf
            if not self.needs_gather(name, x):
                return x.to(self.param_dtype)   # nothing to gather (DDP, TP): the cast only
            layout = self.layouts[name]
            gathered = _Gather.apply(x, layout.mesh, layout.compute, self.grad_placements[name],
                                     self.param_dtype, self.reduce_dtype)
            return gathered if regather is None else regather.track(name, x, gathered)
        return map_with_name(gather, params)

    def gather_again(self, name: str, shard: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return shard.detach().to(self.param_dtype).redistribute(self.layouts[name].mesh, self.layouts[name].compute)
