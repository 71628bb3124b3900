"""Newton-Schulz on tensor-parallel shards: Muon's parallel.muon_tp=distributed.

A matrix X [m, n] split over tp by rows (column-parallel weights, Shard on dim -2) has
X^T X = sum over ranks of X_r^T X_r, so each rank can run the quintic iteration on its own rows,

    A = all_reduce(X_r^T X_r)           (n x n, the same on every rank)
    X_r <- a X_r + X_r (b A + c A^2)

and split by columns (row-parallel weights, Shard on dim -1) the mirror image with A = X X^T.
One all-reduce of an n x n (or m x m) Gram matrix per iteration, plus one scalar for the norm,
instead of gathering the m x n matrix. The result equals the whole-matrix iteration in exact
arithmetic; the serial iteration picks the smaller Gram matrix, this one the Gram matrix the
shard allows, so in floating point they agree to rounding (~1e-6 in fp32), not bitwise.

`orthogonalize` is what ParallelOptimizer hands Muon (optim.build's `orthogonalize`): this iteration for
a matrix that arrives as tensor-parallel shards (a DTensor), the serial one for a whole matrix.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Shard

from nanomega.optim.linalg import newton_schulz, ns_schedule


def orthogonalize(G: torch.Tensor, steps: int, coefficients, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Muon's Newton-Schulz on a mesh: for G a DTensor [..., m, n] split over a 1-D (tp) mesh, the sharded
    iteration (module doc), with G's placement; for a whole matrix (plain, or replicated over tp), the serial one."""
    if not isinstance(G, DTensor):
        return newton_schulz(G, steps, coefficients, eps, dtype)
    mesh, (placement,) = G.device_mesh, G.placements
    local = G.to_local()
    if not isinstance(placement, Shard):   # replicated over tp: every rank has the whole matrix
        return DTensor.from_local(newton_schulz(local, steps, coefficients, eps, dtype), mesh, G.placements,
                                  run_check=False)
    rows_split = placement.dim % G.ndim == G.ndim - 2
    X = local.to(dtype)
    sq = funcol.all_reduce(X.float().square().sum(dim=(-2, -1), keepdim=True), "sum", mesh)
    X = X / (sq.sqrt().to(dtype) + eps)
    for a, b, c in ns_schedule(coefficients, steps):
        if rows_split:
            A = funcol.all_reduce(X.mT @ X, "sum", mesh)
            X = a * X + X @ (b * A + c * (A @ A))
        else:
            A = funcol.all_reduce(X @ X.mT, "sum", mesh)
            X = a * X + (b * A + c * (A @ A)) @ X
    return DTensor.from_local(X.to(G.dtype).contiguous(), mesh, G.placements, run_check=False,
                              shape=G.shape, stride=G.stride())

