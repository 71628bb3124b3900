"""The step's data-parallel gradient reductions, in buckets launched while the backward runs.

After the last micro-batch a gradient is a partial sum over the mesh dims it must still be reduced
over: dp_replicate under DDP and HSDP (FSDP's reduce-scatter over dp_shard has already run, per
unit), tp for the norm weights under sequence parallel. A `GradientReducer` moves every gradient to
its optimizer placements as DTensor's redistribute would, but packs gradients that need the same
collective into flat buffers of at most parallel.bucket_mb (PyTorch DDP's bucket_cap_mb, 25 MB by
default; Megatron's gradient buckets) and issues one collective per bucket:
    Partial -> Replicate    one all-reduce over the partial dims (flattened into one group), in place
    Partial -> Shard(f)     ZeRO-1 (distributed optimizer): one reduce-scatter over dp_replicate of
                            the rank-ordered chunks of every gradient in the bucket (packing.Bucket)
in train.reduce_dtype. Anything else falls back to DTensor's redistribute, one gradient at a time (HSDP
with the distributed optimizer, whose dp_replicate shard splits a dim dp_shard splits already).

The step feeds the reducer from gradient hooks on the parameters during the last micro-batch's
backward (nanomega/train/step.py; under pipeline parallel, each stage's last backward: parallel/pipeline.py):
a gradient enters as soon as autograd has it, buckets fill in the order the backward produces gradients
(the head's first, as DDP's rebuilt buckets), and a bucket's collective is launched, without waiting, as
soon as the next gradient would overfill it, so it runs while the backward goes on. `flush` launches
the partly filled buckets (a pipeline stage whose backward is done); `finish` launches what is still
open, waits, and unpacks. Every rank runs the same backward, so every rank fills and launches the same
buckets in the same order.

A gradient enters as its parts: the last micro-batch's `g` and the sum of the micro-batches before it;
the step's gradient, (earlier + g) / n (summed in order, then divided: the serial step's arithmetic), is
taken where it is first needed: when its bucket is packed, or, for a gradient already in its optimizer
placements (FSDP's, reduce-scattered by its unit's backward), in `finish`. So the hook reads nothing:
a `g` that is a pending reduce-scatter's result stays in flight while the rest of the backward runs,
instead of being waited for by the sum as autograd hands it over.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

from nanomega.parallel.deferred import cast_back, resolved
from nanomega.parallel.mesh import group_over
from nanomega.parallel.packing import Bucket
from nanomega.parallel.plan import as_dtensor

c10d = torch.ops._c10d_functional


def _mean(earlier, g, n: int):
    """The step's gradient from its parts: the micro-batches summed in order, then divided by their number
    (computed: an FSDP gradient is a deferred.Deferred until read)."""
    total = g if earlier is None else earlier + g
    return total / n if n > 1 else resolved(total)


def _plan(g: DTensor, target: tuple):
    """("all_reduce", dims) or ("reduce_scatter", (dim,)) that takes g to `target`, else None."""
    moves = [(d, p, t) for d, (p, t) in enumerate(zip(g.placements, target)) if p != t]
    if moves and all(p.is_partial() and t == Replicate() for _, p, t in moves):
        return "all_reduce", tuple(d for d, _, _ in moves)
    if len(moves) == 1 and moves[0][1].is_partial() and isinstance(moves[0][2], Shard):
        d, _, t = moves[0]
        if not any(p == t for i, p in enumerate(g.placements) if i != d):   # no other mesh dim splits that dim
            return "reduce_scatter", (d,)
    return None


class GradientReducer:
    """Takes each gradient as it is ready (`add`), launches full buckets, and hands back every gradient
    in its optimizer placements (`finish`). One reducer per step."""

    def __init__(self, layouts: dict, bucket_bytes: float, reduce_dtype: torch.dtype):
        self.layouts, self.cap, self.reduce_dtype = layouts, bucket_bytes, reduce_dtype
        self.parts, self.out = {}, {}   # name -> (earlier, g, n) until its bucket is packed; name -> result
        self.in_place = {}     # name -> (earlier, g, n) of a gradient that needs no collective here: summed in finish
        self.open = {}         # (mesh, kind, dims, dtype) -> (names, bytes) of the bucket being filled
        self.launched = []     # (unpack, pending): in launch order

    def add(self, name: str, g: DTensor, earlier: DTensor | None = None, n: int = 1) -> None:
        """The step's gradient of `name` is (earlier + g) / n: g the last micro-batch's, earlier the sum of
        those before it (None: g is the only one). Read no value here (module doc)."""
        target = self.layouts[name].optimizer
        if tuple(g.placements) == target:
            self.in_place[name] = earlier, g, n
            return
        how = _plan(g, target)
        if how is None:
            g = _mean(earlier, g, n)
            self.out[name] = g.to(self.reduce_dtype).redistribute(self.layouts[name].mesh, target).to(g.dtype)
            return
        self.parts[name] = earlier, g, n
        key = (g.device_mesh, *how, g.dtype)
        size = g.to_local().numel() * self.reduce_dtype.itemsize
        names, used = self.open.get(key, ((), 0))
        if names and used + size > self.cap:
            self._launch(key)
            names, used = (), 0
        self.open[key] = (*names, name), used + size

    def flush(self) -> None:
        """Launch every partly filled bucket, without waiting: every gradient still to come goes elsewhere."""
        for key in list(self.open):
            self._launch(key)

    def finish(self) -> dict:
        """Launch what is still open, wait for every bucket: {name: gradient in optimizer placements}."""
        self.flush()
        # the buckets are in flight; the gradients they do not carry are summed now, which is where a
        # pending reduce-scatter (FSDP's last unit) is first waited for
        for name, parts in self.in_place.items():
            self.out[name] = _mean(*parts)
        self.in_place = {}
        for unpack, pending in self.launched:
            self.out.update(unpack(pending))
        self.launched = []
        return self.out

    def _launch(self, key) -> None:
        mesh, kind, dims, _ = key
        names, _ = self.open.pop(key)
        grads = [_mean(*self.parts.pop(n)) for n in names]
        if kind == "all_reduce":
            self.launched.append(self._all_reduce(names, grads, mesh, dims))
        else:
            self.launched.append(self._reduce_scatter(names, grads, dims))

    def _all_reduce(self, names, grads, mesh, dims):
        flat = torch.cat([g.to_local().to(self.reduce_dtype).reshape(-1) for g in grads])
        # in place: the bucket is the only copy, and the gradients packed into it are not kept (their shapes
        # and dtypes are): the step holds its gradient sums and the buckets launched, not both whole
        c10d.all_reduce_(flat, "sum", funcol._resolve_group_name(group_over(mesh, list(dims))))
        kept = [(g.to_local().shape, g.dtype) for g in grads]

        def unpack(flat):
            summed = c10d.wait_tensor(flat)
            out, offset = {}, 0
            for n, (shape, dtype) in zip(names, kept):
                local = summed[offset:offset + shape.numel()].view(shape).to(dtype)
                offset += local.numel()
                out[n] = as_dtensor(local, mesh, self.layouts[n].optimizer, self.layouts[n].shape)
            return out
        return unpack, flat

    def _reduce_scatter(self, names, grads, dims):
        bucket = Bucket(names, self.layouts, dims, role="optimizer")
        shards = bucket.reduce_scatter([g.to_local().to(self.reduce_dtype) for g in grads])
        dtypes = [g.dtype for g in grads]     # (not the gradients: _all_reduce's reason)

        def unpack(shards):
            return {n: as_dtensor(cast_back(s, dtype), bucket.mesh, self.layouts[n].optimizer, self.layouts[n].shape)
                    for n, dtype, s in zip(names, dtypes, shards)}
        return unpack, shards
