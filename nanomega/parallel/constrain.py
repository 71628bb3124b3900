"""Sharding hints the model may call: no-ops on plain tensors, layout requests on DTensors.

The batch is the one thing the parallel step places on the mesh (parallel/step.py): tokens are split
over the data-parallel dims on the batch, and under sequence parallel over tp on the sequence. The
model asks for its activations to follow that layout, so it never names a rank, a mesh dim or a mode:

    x = constrain(x, tokens)                          # the residual stream: laid out like the tokens
    h = constrain(h, tokens, whole_sequence=True)     # the input of a tensor-parallel matmul

(the idea of JAX's `with_sharding_constraint`). After a row-parallel matmul the activation is a
partial sum on tp: `constrain(x, tokens)` all-reduces it, or reduce-scatters it on the sequence under
sequence parallel; `whole_sequence=True` all-gathers the sequence back before attention and the MLP.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard


def constrain(x: torch.Tensor, tokens: torch.Tensor, whole_sequence: bool = False) -> torch.Tensor:
    """x [B, T, ...] redistributed to the placements of tokens [B, T] (sequence gathered if asked)."""
    if not isinstance(x, DTensor):
        return x
    placements = tuple(Replicate() if whole_sequence and p == Shard(1) else p for p in tokens.placements)
    if placements != tuple(x.placements):
        # under sequence parallel, the all-gather here has a reduce-scatter of the gradient as backward
        x = x.redistribute(x.device_mesh, placements)
    elif whole_sequence:
        # The input of a column-parallel matmul: its gradient comes back as a partial sum over tp.
        # Reduce it here, on the activation (Megatron's "f"), rather than letting DTensor carry the
        # partial sum down the residual stream (it cannot hand one to the vocab-parallel embedding).
        x = DTensor.from_local(x.to_local(), x.device_mesh, placements, shape=x.shape, stride=x.stride())
    return x
