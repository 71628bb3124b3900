"""Float8 matmuls on a mesh: each rank multiplies its pieces, with the scales of the whole tensors.

The model calls the hint `fp8_linear(fp8.linear, x, w, recipe)` (nanomega/hints.py); on DTensors it
runs here. Each rank runs nanomega/models/fp8.py's `linear` on its local x and w, and passes it a `sync` that
takes the max of an amax over the ranks holding other pieces of the same tensor, so every rank uses
the scale the serial run computes (one scale per logical tensor, Megatron's amax reduction group):

    tensorwise   the whole tensor's amax, over every mesh dim that splits it (data parallel's batch,
                 context and sequence parallel's tokens, tensor parallel's features)
    rowwise      a row's amax over the dims that split the row: the contraction dim K split by tensor
                 parallel (a row-parallel layer's input and weight), the tokens M for the weight
                 gradient's contraction (split over data / context / sequence parallel)
    blockwise    none: 128-long tiles stay within a rank (the layout is refused otherwise)
    delayed      as tensorwise, for the amaxes it records (x, w, dy of each linear)

Each sync is a blocking all-reduce of a scalar (a vector for rowwise), so delayed scaling pays three per
linear and micro-batch, as tensorwise does, although its amaxes only enter the history, which scales later
steps. One reduction per step is enough for it and is the intended form: the train step already combines the
histories over micro-batches by max (step.py), and one all-reduce (max) of every history's newest column over
the data, context and tensor parallel ranks would give each rank the serial run's history. Only the first step
needs this step's amax synced (its history is empty); deciding that per layer without reading the history on
the host means scaling the first step differently (TransformerEngine starts at scale 1), which the parity
tests would see. Not built yet: it moves the reduction into step.py.

The placements of the result follow the matmul's algebra as DTensor's rules for F.linear would: tokens
split -> output split alike; a column-parallel weight (Shard(0) on tp) -> output Shard on its last dim;
a row-parallel pair (x and w both split on K) -> a partial sum on tp. The gradients leave the local
region the same way (x.to_local / w.to_local with the placements their maths implies), so tensor
parallel's reductions and FSDP's reduce-scatter run as for any linear layer.
"""
from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from nanomega.hints import register
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor


@register("fp8_linear")
def fp8_linear_on_mesh(fn, x: DTensor, w: DTensor, recipe: str, history=None, margin: int = 0) -> DTensor:
    mesh, last = x.device_mesh, x.ndim - 1
    if w.device_mesh != mesh:
        raise ValueError("an fp8 linear's input and weight must be on one mesh")
    out, x_grad, w_grad = [], [], []
    split = {"x": {None: [], 0: [], 1: []}, "w": {None: [], 0: [], 1: []}, "g": {None: [], 0: [], 1: []}}
    for dim, (px, pw) in enumerate(zip(x.placements, w.placements)):
        tokens = px.is_shard() and px.dim < last            # x split on its batch or sequence dims
        if tokens and pw.is_replicate():
            out.append(px), x_grad.append(px), w_grad.append(Partial())
            for operand in ("x", "g"):
                split[operand][None].append(dim), split[operand][0].append(dim)
        elif px.is_replicate() and pw == Shard(0):        # column parallel: output features split
            out.append(Shard(last)), x_grad.append(Partial()), w_grad.append(pw)
            for operand, axis in (("w", None), ("w", 0), ("g", None), ("g", 1)):
                split[operand][axis].append(dim)
        elif px == Shard(last) and pw == Shard(1):         # row parallel: the contraction split
            out.append(Partial()), x_grad.append(px), w_grad.append(pw)
            for operand, axis in (("x", None), ("x", 1), ("w", None), ("w", 1)):
                split[operand][axis].append(dim)
        elif px.is_replicate() and pw.is_replicate():
            out.append(Replicate()), x_grad.append(Replicate()), w_grad.append(Replicate())
        else:
            raise ValueError(f"an fp8 linear with input {px} and weight {pw} on mesh dim "
                             f"{mesh.mesh_dim_names[dim]} is not a layout nanomega plans")

    def sync(amax, operand, axis):
        dims = split[operand][axis]
        return amax if not dims else funcol.wait_tensor(funcol.all_reduce(amax, "max", group_over(mesh, dims)))

    if isinstance(history, DTensor):   # delayed scaling's amax history: replicated, the same on every rank
        history = history.to_local(grad_placements=history.placements)
    y = fn(x.to_local(grad_placements=x_grad), w.to_local(grad_placements=w_grad), recipe, sync, history, margin)
    return as_dtensor(y, mesh, tuple(out), (*x.shape[:-1], w.shape[0]))
