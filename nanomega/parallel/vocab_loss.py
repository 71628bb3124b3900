"""The head's fused cross-entropy on a mesh: this rank's tokens against this rank's rows of the vocabulary.

Registered into the model's hint `vocab_parallel` (nanomega/hints.py) when imported. The loss
(nanomega/models/loss.py) runs on local tensors, the way parallel/fp8.py runs a float8 matmul:

    x [B, T, d]: the normed residual stream, tokens split over the data-parallel dims (Shard(0)) and over
                 cp (Shard(1)); whole on tp (the head's input is gathered over the sequence, as for any
                 column-parallel matmul)
    w [V, d]:    the head's weight as gathered for compute: rows split over tp (Shard(0)), whole elsewhere
    targets:     laid out like the tokens, gathered over tp under sequence parallel as x is

Each rank holds rows tp_rank * V/tp.. of the padded vocabulary; the per-token max, sum of exponentials and
target logit are all-reduced over tp (three all-reduces of one number per token per chunk: Megatron's
vocab-parallel cross-entropy), never the logits. Slicing a DTensor's tokens into chunks would gather them,
so the chunks are cut from each rank's own tokens. Placements of what leaves the local region:
the summed loss is a partial sum over the dims that split the tokens and the same number on tp; x's
gradient is a partial sum over tp (each rank's rows of the vocabulary contribute), which the head's
`constrain` reduces like any column-parallel input's; w's is a partial sum over the token dims (the data-
parallel reduction FSDP does anyway) and Shard(0) on tp.
"""
from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from nanomega.hints import register
from nanomega.models.loss import no_reduce
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor


@register("vocab_parallel")
def vocab_parallel_on_mesh(fn, x: DTensor, w: DTensor, targets: DTensor, vocab_size: int, chunk: int) -> DTensor:
    mesh = x.device_mesh
    if not isinstance(w, DTensor) or w.device_mesh != mesh or not isinstance(targets, DTensor):
        raise ValueError("the head's input, weight and targets must be DTensors on one mesh")
    vocab_dims, x_grad, w_grad, out = [], [], [], []
    for dim, (px, pw) in enumerate(zip(x.placements, w.placements)):
        name = mesh.mesh_dim_names[dim]
        if pw == Shard(0) and px.is_replicate():       # vocab-parallel: this rank's rows of the vocabulary
            vocab_dims.append(dim)
            x_grad.append(Partial()), w_grad.append(pw), out.append(Replicate())
        elif pw.is_replicate() and px.is_shard() and px.dim < x.ndim - 1:   # tokens split (batch or sequence)
            x_grad.append(px), w_grad.append(Partial()), out.append(Partial())
        elif pw.is_replicate() and px.is_replicate():
            x_grad.append(px), w_grad.append(pw), out.append(Replicate())
        else:
            raise ValueError(f"the head's loss with input {px} and weight {pw} on mesh dim {name} is not a "
                             "layout nanomega plans (tokens split, vocabulary rows split over tp)")
    if len(vocab_dims) > 1:
        raise ValueError("the head's vocabulary is split over one mesh dim (tp) at most")
    # the targets as the head's tokens are laid out: under sequence parallel, gathered over tp (one int per token)
    targets = targets.redistribute(mesh, x.placements)
    rows = w.to_local().shape[0]
    if vocab_dims:
        vocab_start = mesh.get_local_rank(vocab_dims[0]) * rows
        group = group_over(mesh, vocab_dims)

        def reduce(t, op):
            return funcol.wait_tensor(funcol.all_reduce(t, op, group))
    else:
        vocab_start, reduce = 0, no_reduce
    total = fn(x.to_local(grad_placements=tuple(x_grad)), w.to_local(grad_placements=tuple(w_grad)),
               targets.to_local(), vocab_size, chunk, vocab_start=vocab_start, reduce=reduce)
    return as_dtensor(total, mesh, tuple(out), ())
