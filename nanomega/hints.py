"""Sharding hints the model may call: identities on plain tensors, layout requests on a mesh.

The model never names a rank, a mesh dim or a mode. It calls two hints (the idea of JAX's
`with_sharding_constraint`), and a serial run sees neither:

    x = constrain(x, tokens)                          # the residual stream: laid out like the tokens
    h = constrain(h, tokens, whole_sequence=True)     # the input of a tensor-parallel matmul
    y, stats = expert_parallel(routed_moe, p, h, cfg) # routed experts: routed_moe(p, h, cfg) serially

The batch is the one thing a parallel run places on the mesh (nanomega.parallel.parallelize):
tokens are split over the data-parallel dims on the batch, and under sequence parallel over tp on
the sequence. `constrain` asks an activation to follow that layout: after a row-parallel matmul the
activation is a partial sum on tp, and `constrain(x, tokens)` all-reduces it, or reduce-scatters it
on the sequence under sequence parallel; `whole_sequence=True` all-gathers the sequence back before
attention and the MLP. That is torch.distributed.tensor alone, so it is written here.

`expert_parallel` needs more than a redistribution: token all-to-alls and statistics summed over
other ranks. That runtime lives in nanomega.parallel.experts, which registers it here when imported
(`register`), the way torch registers an operator's sharding rule: once, at import, never changed
after. This module imports nothing from the rest of nanomega.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

_ON_MESH: dict = {}   # hint name -> its implementation on DTensors, filled by nanomega.parallel at import


def register(hint: str):
    """Decorator: `fn` implements the hint `hint` ("expert_parallel") when its activation is a DTensor."""
    def add(fn):
        _ON_MESH[hint] = fn
        return fn
    return add


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


def expert_parallel(fn, params: dict, x: torch.Tensor, cfg):
    """fn(params, x, cfg) -> (y, stats): the routed experts of one MoE layer on the activation x.

    On plain tensors, that call. On a mesh, the implementation nanomega.parallel.experts registers:
    fn on this rank's tokens and experts, with the all-to-alls and the statistics' reductions."""
    if not isinstance(x, DTensor):
        return fn(params, x, cfg)
    if "expert_parallel" not in _ON_MESH:
        raise RuntimeError("the MoE layer got a DTensor, but no expert-parallel runtime is registered; "
                           "import nanomega.parallel.experts (nanomega.parallel.parallelize does) before "
                           "running the model on a mesh")
    return _ON_MESH["expert_parallel"](fn, params, x, cfg)
