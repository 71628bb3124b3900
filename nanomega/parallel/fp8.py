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
    delayed      as tensorwise, for the amaxes it records (x, w, dy of each linear); in the step, once
                 per step instead (below)

Each sync is a blocking all-reduce of a scalar (a vector for rowwise). Delayed scaling's amaxes, though, only
enter the history, which scales later steps, so one reduction per step suffices (docs/fp8.md, "Delayed scaling
reduces once per step": 84 amax all-reduces per step before, 1 after; tests/test_fp8_amax_reduction.py). Under
the model config's `fp8_amax_reduction == "step"` (AmaxesAtStepEnd, the train step's) each rank records its own
pieces' amaxes, no collective in the forward or the backward; once the step has combined the histories over
micro-batches by max, `reduce_histories` all-reduces (max) every history's newest column, stacked into one
tensor, over the stage's whole mesh (histories are plan.REPLICATED; the group is made at setup,
mesh.create_groups; on the dims outside an operand's own group the ranks hold copies, whose max is that value).
Every rank then holds the serial run's history: the same numbers. The first step is the exception: an empty
history scales by this step's amax, which must be whole before the cast, so under "linear" (the default) delayed
amaxes are synced per linear as tensorwise's are, and step.py runs the model with "step" only once the host knows
the histories hold a step (TransformerEngine's scale 1 for an empty history would change the first step's
numbers; deciding on the device would take a host sync). The mode is the frozen model config's class: no global
state, and torch.compile guards on it. A first step skipped as non-finite leaves the next step scaling by each
rank's own amaxes, once.

The placements of the result follow the matmul's algebra as DTensor's rules for F.linear would: tokens
split -> output split alike; a column-parallel weight (Shard(0) on tp) -> output Shard on its last dim;
a row-parallel pair (x and w both split on K) -> a partial sum on tp. The gradients leave the local
region the same way (x.to_local / w.to_local with the placements their maths implies), so tensor
parallel's reductions and FSDP's reduce-scatter run as for any linear layer.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from nanomega.hints import register
from nanomega.models.fp8 import no_sync
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor


def reduce_histories(histories: dict) -> dict:
    """{name: history [3, H]} one step on, as the step combined them, with each newest column the max over
    the ranks (module doc): one all-reduce per mesh, of every newest column stacked. Plain tensors (a pipeline
    stage of one process) are whole already."""
    out, by_mesh = dict(histories), {}
    for name, h in histories.items():
        if isinstance(h, DTensor):
            by_mesh.setdefault(h.device_mesh, []).append(name)
    for mesh, names in by_mesh.items():
        local = [histories[n].to_local() for n in names]
        newest = torch.stack([h[:, 0] for h in local])                                  # [histories, 3]
        newest = funcol.wait_tensor(funcol.all_reduce(newest, "max", group_over(mesh, list(range(mesh.ndim)))))
        for name, h, column in zip(names, local, newest.unbind(0)):
            whole = torch.cat([column.reshape(3, 1), h[:, 1:]], dim=1)
            out[name] = DTensor.from_local(whole, mesh, histories[name].placements, run_check=False)
    return out


@register("fp8_linear")
def fp8_linear_on_mesh(fn, x: DTensor, w: DTensor, recipe: str, history=None, margin: int = 0,
                       amax_reduction: str = "linear") -> DTensor:
    mesh, last = x.device_mesh, x.ndim - 1
    if w.device_mesh != mesh:
        raise ValueError("an fp8 linear's input and weight must be on one mesh")
    out, x_grad, w_grad = [], [], []
    split = {operand: {None: [], 0: [], 1: []} for operand in ("x", "w", "g")}   # the mesh dims that split each amax
    for dim, (px, pw) in enumerate(zip(x.placements, w.placements)):
        tokens = px.is_shard() and px.dim < last            # x split on its batch or sequence dims
        if tokens and pw.is_replicate():
            out.append(px), x_grad.append(px), w_grad.append(Partial())
            for operand, axis in (("x", None), ("x", 0), ("g", None), ("g", 0)):
                split[operand][axis].append(dim)
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
        # its "gradient" (the history one step on) is declared replicated too; under amax_reduction="step" its newest
        # column is this rank's until the step reduces it (reduce_histories)
        history = history.to_local(grad_placements=history.placements)
    if recipe == "delayed" and amax_reduction == "step":
        sync = no_sync
    y = fn(x.to_local(grad_placements=x_grad), w.to_local(grad_placements=w_grad), recipe, sync, history, margin)
    return as_dtensor(y, mesh, tuple(out), (*x.shape[:-1], w.shape[0]))
