"""The step's data-parallel gradient reductions, in buckets: fewer, larger collectives.

After the last micro-batch a gradient is a partial sum over the mesh dims it must still be reduced
over: dp_replicate under DDP and HSDP (FSDP's reduce-scatter over dp_shard has already run, per
unit), tp for the norm weights under sequence parallel. `reduce_gradients` moves every gradient to
its optimizer placements as DTensor's redistribute would, but packs gradients that need the same
collective into flat buffers of at most parallel.bucket_mb (PyTorch DDP's bucket_cap_mb, 25 MB by
default; Megatron's gradient buckets), in parameter order, and issues one collective per bucket:
    Partial -> Replicate    one all-reduce over the partial dims (flattened into one group)
    Partial -> Shard(f)     ZeRO-1 (distributed optimizer): one reduce-scatter over dp_replicate of
                            the rank-ordered chunks of every gradient in the bucket (fsdp.Bucket)
in train.reduce_dtype. Anything else falls back to DTensor's redistribute, one gradient at a time (HSDP
with the distributed optimizer, whose dp_replicate shard splits a dim dp_shard splits already).

What is not done: launching a bucket while the backward still runs (DDP's overlap), since the step
takes its gradients from torch.autograd.grad at the end of each micro-batch; here the buckets are
reduced right after the last micro-batch's backward.
"""
from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

from nanomega.parallel.fsdp import Bucket, _wait
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor


def _plan(g: DTensor, target: tuple):
    """("all_reduce", dims) or ("reduce_scatter", dim) that takes g to `target`, else None."""
    moves = [(d, p, t) for d, (p, t) in enumerate(zip(g.placements, target)) if p != t]
    if moves and all(p.is_partial() and t == Replicate() for _, p, t in moves):
        return "all_reduce", tuple(d for d, _, _ in moves)
    if len(moves) == 1 and moves[0][1].is_partial() and isinstance(moves[0][2], Shard):
        d, _, t = moves[0]
        if not any(p == t for i, p in enumerate(g.placements) if i != d):   # no other mesh dim splits that dim
            return "reduce_scatter", d
    return None


def _buckets(names: list, sizes: dict, cap: float) -> list[list]:
    """Greedy, in order: a new bucket when the next gradient would take the current one past `cap`."""
    out, used = [], math.inf
    for name in names:
        if used + sizes[name] > cap:
            out.append([])
            used = 0
        out[-1].append(name)
        used += sizes[name]
    return out


def reduce_gradients(grads: dict, layouts: dict, bucket_bytes: float, reduce_dtype: torch.dtype) -> dict:
    """{name: gradient} -> {name: gradient in its optimizer placements} (module doc)."""
    out, groups = {}, {}
    for name, g in grads.items():
        target = layouts[name].optimizer
        if tuple(g.placements) == target:
            out[name] = g
            continue
        how = _plan(g, target)
        if how is None:
            out[name] = g.to(reduce_dtype).redistribute(layouts[name].mesh, target).to(g.dtype)
            continue
        groups.setdefault((g.device_mesh, how, g.dtype), []).append(name)
    for (_, (kind, dims), _), names in groups.items():
        sizes = {n: grads[n].to_local().numel() * reduce_dtype.itemsize for n in names}
        for bucket in _buckets(names, sizes, bucket_bytes):
            if kind == "all_reduce":
                out.update(_all_reduce(bucket, grads, layouts, dims, reduce_dtype))
            else:
                out.update(_reduce_scatter(bucket, grads, layouts, dims, reduce_dtype))
    return {name: out[name] for name in grads}


def _all_reduce(names, grads, layouts, dims, reduce_dtype) -> dict:
    mesh = grads[names[0]].device_mesh
    flat = torch.cat([grads[n].to_local().to(reduce_dtype).reshape(-1) for n in names])
    summed = _wait(funcol.all_reduce(flat, "sum", group_over(mesh, list(dims))))
    out, offset = {}, 0
    for n in names:
        g = grads[n]
        local = summed[offset:offset + g.to_local().numel()].view(g.to_local().shape).to(g.dtype)
        offset += local.numel()
        out[n] = as_dtensor(local, mesh, layouts[n].optimizer, layouts[n].shape)
    return out


def _reduce_scatter(names, grads, layouts, dim, reduce_dtype) -> dict:
    bucket = Bucket(names, layouts, dim, role="optimizer")
    shards = bucket.reduce_scatter([grads[n].to_local().to(reduce_dtype) for n in names])
    return {n: as_dtensor(s.to(grads[n].dtype), bucket.mesh, layouts[n].optimizer, layouts[n].shape)
            for n, s in zip(names, shards)}
