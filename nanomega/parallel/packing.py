"""Packing: a bucket of sharded parameters moved in ONE collective, through one flat buffer.

FSDP gathers a unit's parameters and reduce-scatters their gradients (parallel/fsdp.py); ZeRO-1 reduce-scatters
a bucket of gradients (parallel/buckets.py). Both move many tensors split over one mesh dim (or two nested ones),
and one collective over one flat buffer costs one launch and one latency where a collective per tensor costs one
each (FSDP2's `foreach_all_gather` and `foreach_reduce`, Megatron's gradient buckets). A `Bucket` says how: each
rank's row of the buffer holds its chunk (DTensor's; the last ones shorter or empty) of every parameter, padded.

    gather          each rank's shards, moved to dim 0 and padded, concatenated: one all-gather; each whole
                    parameter is then cut out of the k rows (`unpack_gather`);
    reduce-scatter  each gradient's k chunks written straight into the k rows, in the gradient's own layout (not
                    moved to dim 0) and converted to the reduce dtype by that copy, so this rank's chunk of each
                    comes back as a view of the pending result: nothing is copied out of it, and nothing waits
                    for it before a gradient is read.

The buffer is the only copy (FSDP2 has a copy-in and a copy-out too). It is not zero-filled: every element is
written, the padding of uneven chunks apart (zeroed there); a zero fill cost 5.7 ms of a 4 MB block's
reduce-scatter on this CPU (bench/home_made.py, 2026-12-03).

Float8 gathers (model.fp8=tensorwise): the blocks' dense float8 weights are sent in e4m3, a quarter of fp32's
bytes and half of bf16's (torchao's float8 all-gather for FSDP2). Their tensorwise scales need the whole
parameter's amax: one all-reduce (max) of the bucket's shard amaxes over the dims that shard them, then each
shard is cast with its scale, gathered as bytes and dequantized. The linear layer quantizes that weight again
with the same amax, which gives back the same float8 values: the maths is the serial run's (models/fp8.py),
with a quarter of the gather traffic. Only tensorwise: a per-row or per-block weight scale would be re-derived
in the backward along the other dim, from already rounded values.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed._functional_collectives as funcol

from nanomega.models import fp8
from nanomega.parallel.deferred import waited
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import nested_bounds


class Bucket:
    """Parameters that one mesh dim shards (a unit's under FSDP; a bucket of ZeRO-1's gradients), or several
    splitting one dim in turn (FSDP over dp_shard x cp: one collective over the flattened group), and how to
    pack them: parameter i is split on its dim dims[i] of global length lengths[i], rank j of the k holding
    bounds[i][j] of it (DTensor's chunks of ceil(length / k), nested over several mesh dims: plan.nested_bounds),
    padded to chunks[i], the first rank's (the largest)."""

    def __init__(self, names: list, layouts: dict, mesh_dims: tuple, role: str = "storage", fp8: bool = False):
        self.names, self.fp8, self.mesh_dims = names, fp8, mesh_dims     # outer first
        self.mesh = layouts[names[0]].mesh
        sizes = [self.mesh.size(d) for d in self.mesh_dims]
        ranks = list(itertools.product(*map(range, sizes)))     # rank j of the group: coordinates, row-major
        self.k, self.coord = len(ranks), ranks.index(tuple(self.mesh.get_local_rank(d) for d in self.mesh_dims))
        self.group = group_over(self.mesh, list(self.mesh_dims))
        self.layouts = [layouts[n] for n in names]
        # the dim the mesh dims split in the placements of `role` (ZeRO-1's reduce-scatter: "optimizer")
        self.dims = [getattr(lay, role)[self.mesh_dims[0]].dim for lay in self.layouts]
        self.lengths = [lay.shape[d] for lay, d in zip(self.layouts, self.dims)]
        self.bounds = [[nested_bounds(n, sizes, r) for r in ranks] for n in self.lengths]
        self.chunks = [b[0][1] for b in self.bounds]     # DTensor's: ceil(length / k), nested
        self._slots: dict = {}

    def slots(self, i: int, device) -> tuple:
        """Where parameter i's rows sit in the k padded rows of the buffer, as index tensors on `device`:
        (rank, row within its chunk) of every global row in order, and of every padding row. Uneven chunks are
        then cut out or written with one indexing op each, not one per rank: at FSDP over 1,536 ranks a loop over
        the ranks issued 1,536 copies per parameter and a fake-tensor trace of one step took 270 s of CPU."""
        key = (i, str(device))
        if key not in self._slots:
            held = [(j, c, start + c) for j, (start, n) in enumerate(self.bounds[i]) for c in range(n)]
            held.sort(key=lambda x: x[2])
            pads = [(j, c) for j, (_, n) in enumerate(self.bounds[i]) for c in range(n, self.chunks[i])]
            as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device).reshape(-1, 2).unbind(1)
            self._slots[key] = (as_index([(j, c) for j, c, _ in held]), as_index(pads))
        return self._slots[key]

    def launch_gather(self, shards: list) -> tuple:
        """This rank's local shards, packed into one buffer (each padded to its chunk), and their
        all-gather started: (pending, scales, dtype) for `unpack_gather`, the pending result a funcol
        AsyncCollectiveTensor (waited on at first use, so compute can run while it is in flight). A float8
        bucket sends each shard in e4m3 with its whole parameter's tensorwise scale (module doc); else the
        scales and dtype are None."""
        scales = dtype = None
        if self.fp8:
            amax = torch.stack([x.detach().float().abs().amax() for x in shards])
            sharded = [d for d in range(self.mesh.ndim) if any(lay.storage[d].is_shard() for lay in self.layouts)]
            amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", group_over(self.mesh, sharded)))
            quantized = [fp8.quantize(x, fp8.E4M3, "tensorwise", 1, amax=a) for x, a in zip(shards, amax)]
            scales, dtype = [s for _, s in quantized], shards[0].dtype
            shards = [q.view(torch.uint8) for q, _ in quantized]
        rows = []
        for i, x in enumerate(shards):
            y = x.movedim(self.dims[i], 0)
            pad = self.chunks[i] - y.shape[0]
            rows.append((torch.cat([y, y.new_zeros(pad, *y.shape[1:])]) if pad else y).reshape(-1))
        return funcol.all_gather_single(torch.cat(rows), 0, self.group), scales, dtype

    def unpack_gather(self, launched: tuple, shards: list) -> list:
        """Wait for a launched gather and cut it into the local tensors of the whole parameters (a float8
        bucket's dequantized, in the dtype its shards were sent from)."""
        pending, scales, dtype = launched
        gathered = waited(pending).view(self.k, -1)
        out, offset = [], 0
        for i, x in enumerate(shards):
            rest = x.movedim(self.dims[i], 0).shape[1:]
            size = self.chunks[i] * rest.numel()
            part = gathered[:, offset:offset + size].reshape(self.k, self.chunks[i], *rest)
            offset += size
            if self.lengths[i] == self.k * self.chunks[i]:     # even chunks: the rows in order, a view
                whole = part.reshape(self.lengths[i], *rest)
            else:
                (ranks, rows), _ = self.slots(i, part.device)
                whole = part[ranks, rows]
            whole = whole.movedim(0, self.dims[i]).contiguous()
            out.append(whole if scales is None else (whole.view(fp8.E4M3).float() * scales[i]).to(dtype))
        return out

    def reduce_scatter(self, grads: list, dtype: torch.dtype | None = None) -> list:
        """Local gradients of the gathered parameters (partial sums over the mesh dim) -> this rank's
        chunk of each, summed over the mesh dim in `dtype` (train.reduce_dtype; default the first gradient's):
        one reduce-scatter of one packed buffer, written in place (row j: every gradient's chunk j, padded),
        so the step holds the gradients and one buffer. Each gradient is converted to `dtype` by its copy into
        the buffer, not cast first: a cast would be one more copy of every gradient of the unit (Mixtral's
        experts: 5.25 GiB at its FSDP 16 peak, docs/memory.md); the same rounding either way.
        What comes back are views of the pending result (module doc)."""
        sizes = [self.chunks[i] * g.numel() // self.lengths[i] for i, g in enumerate(grads)]
        flat = grads[0].new_empty(self.k, sum(sizes), dtype=dtype)    # not zero-filled (module doc)
        offset = 0
        for i, g in enumerate(grads):
            d, chunk = self.dims[i], self.chunks[i]
            rows = flat[:, offset:offset + sizes[i]].view(self.k, *g.shape[:d], chunk, *g.shape[d + 1:])
            if self.lengths[i] % self.k == 0:     # even chunks: one copy
                rows.copy_(g.unflatten(d, (self.k, chunk)).movedim(d, 0))
            else:     # each global row to its (rank, row) slot, the padding rows zeroed: two indexing ops
                (ranks, at), (pad_ranks, pad_at) = self.slots(i, g.device)
                between = (slice(None),) * d
                # advanced indices split by slices index the leading dim of the value: g's dim d moved first
                rows[(ranks, *between, at)] = g.movedim(d, 0).to(rows.dtype)
                if len(pad_ranks):
                    rows[(pad_ranks, *between, pad_at)] = 0
            offset += sizes[i]
        mine = funcol.reduce_scatter_single(flat.reshape(-1), "sum", 0, self.group)
        out, offset = [], 0
        for i, g in enumerate(grads):
            shape = list(g.shape)
            shape[self.dims[i]] = self.bounds[i][self.coord][1]
            out.append(mine[offset:offset + torch.Size(shape).numel()].view(shape))
            offset += sizes[i]
        return out
