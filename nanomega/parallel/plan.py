"""Sharding plans as data: parameter-name patterns -> the dimension each mesh dimension splits.

    TENSOR_PARALLEL   which dim of each parameter tp splits (Megatron: column-parallel layers split the
                      output features, dim 0 of a [out, in] weight; row-parallel ones the input, dim 1)
    MLPS              where MLP matrices live; whether each is column or row parallel is its kind's
                      declaration (models/mlp.py's `column` and `row`), read by `mlp_dim`
    FSDP              dp_shard (and dp_replicate's optimizer state under the distributed optimizer)
                      splits the first dimension tp leaves alone, so two mesh dims never split one dim

Each parameter gets three placements, one per role:
    storage    how it lives between steps (Shard on dp_shard for FSDP; tp as planned; else Replicate)
    compute    how the forward uses it: storage with the data-parallel dims gathered (Replicate)
    optimizer  where its gradient is reduced to and its optimizer state lives: storage, plus Shard on
               dp_replicate for the distributed optimizer (ZeRO-1)
Context parallel (cp) replicates every parameter in all three roles: its ranks hold other tokens of
the same sequences, so a gradient is a partial sum over cp, all-reduced once per step with data
parallel's. Megatron also shards parameters and optimizer state over cp (its data-parallel group for
the distributed optimizer is dp x cp); nanomega doesn't yet: FSDP and ZeRO-1 split over dp only.
The forward redistributes storage -> compute, so the backward brings gradients back to storage by
itself (a reduce-scatter for FSDP). Stacked expert weights [E, ...] live on the expert mesh
(parallel/mesh.py): Shard(0) on ep (each rank holds whole experts), on etp split on their hidden dim
(expert tensor parallel; replicated under FSDP), and on edp replicated (gradients all-reduced once per step)
or, with FSDP (dp_shard > 1), Shard(1) between steps and gathered for compute (gradients reduce-scattered).
A router's expert bias is replicated everywhere (the balancing rule updates it from global loads on every rank).
`shard_index` says which part of a whole parameter a rank keeps; the model is never told.
"""
from __future__ import annotations

import fnmatch
from typing import NamedTuple

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Replicate, Shard

from nanomega.models.mlp import matrix_roles
from nanomega.parallel.mesh import expert_tensor_parallel
from nanomega.tree import named_leaves

# name pattern -> the dim tensor parallel splits; parameters matching none are replicated over tp
TENSOR_PARALLEL = {
    "tok_embed.weight": 0,              # vocab-parallel embedding: each rank holds a range of token rows
    "lm_head.weight": 0,                # vocab-parallel head: each rank computes its range of logits
    "layers.*.attn.wq.*": 0,            # column parallel, by heads (weights and biases)
    "layers.*.attn.wk.*": 0,
    "layers.*.attn.wv.*": 0,
    "layers.*.attn.wo.weight": 1,       # row parallel: its output is a partial sum over heads
    "layers.*.attn.wq_b.*": 0,          # multi-head latent attention: heads split, the latents replicated
    "layers.*.attn.wkv_b.*": 0,
}
MLPS = ("layers.*.mlp.*", "layers.*.moe.shared.*")    # a block's MLP; the shared expert is a dense MLP too
EXPERTS = "layers.*.moe.experts.*"     # stacked [E, ...] expert weights: on the expert mesh
REPLICATED = ("layers.*.moe.router.expert_bias", "layers.*.fp8_history")   # state every rank keeps whole


class ParamLayout(NamedTuple):
    storage: tuple
    compute: tuple
    optimizer: tuple
    shape: torch.Size      # the global (unsharded) shape
    mesh: object = None    # the mesh the placements refer to (the main mesh, or the expert mesh)


def as_dtensor(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    """This rank's part of a tensor of global `shape` under `placements`, as a DTensor (no collective)."""
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=make_contiguous_strides_for(shape))


def tp_dim(name: str) -> int | None:
    for pattern, dim in TENSOR_PARALLEL.items():
        if fnmatch.fnmatchcase(name, pattern):
            return dim
    return mlp_dim(name) if any(fnmatch.fnmatchcase(name, pattern) for pattern in MLPS) else None


def mlp_dim(name: str) -> int | None:
    """An MLP leaf's tp dim (layers.0.mlp.w_up.weight): a column-parallel matrix splits its weight's and its
    bias's output features (dim 0), a row-parallel one its weight's inputs (dim 1; its bias is added once, after
    the partial sums are reduced, so it stays whole)."""
    *_, matrix, leaf = name.split(".")
    role = matrix_roles().get(matrix)
    return 0 if role == "column" else 1 if role == "row" and leaf == "weight" else None


def is_expert(name: str) -> bool:
    return fnmatch.fnmatchcase(name, EXPERTS)


def _by_role(roles: dict, dims, default) -> tuple:
    """(storage, compute[, optimizer]) placements over the mesh dims `dims`, from each dim's roles."""
    return tuple(tuple(roles.get(d, default)[i] for d in dims) for i in range(len(default)))


def expert_layout(name: str, shape, expert_mesh, cfg) -> ParamLayout:
    """Shard(0) on ep (whole experts per rank); with FSDP (dp_shard > 1) also Shard(1) on edp between
    steps, gathered for compute (the gradient reduce-scattered back). On etp (tp ranks holding the same
    tokens) each expert's hidden dim is split (`expert_tp_dim`) in all three roles; with FSDP it is
    replicated there instead (the owners of FSDP-split experts gather edp only)."""
    R = Replicate()
    t = expert_tp_dim(name) if expert_tensor_parallel(cfg) else None
    etp = Shard(t) if t is not None else R
    roles = {"ep": (Shard(0), Shard(0)), "edp": (Shard(1), R) if cfg.parallel.dp_shard > 1 else (R, R),
             "etp": (etp, etp)}
    storage, compute = _by_role(roles, expert_mesh.mesh_dim_names, (R, R))
    return ParamLayout(storage, compute, storage, torch.Size(shape), expert_mesh)


def expert_tp_dim(name: str) -> int | None:
    """The dim expert tensor parallel splits: each expert's hidden units f, column-parallel in w_gate and
    w_up [E, f, d] (dim 1), row-parallel in w_down [E, d, f] (dim 2), so a rank's experts output a
    partial sum over etp."""
    return {"w_gate": 1, "w_up": 1, "w_down": 2}.get(name.rsplit(".", 1)[-1])


def layout_of(name: str, shape, mesh, cfg, expert_mesh=None) -> ParamLayout:
    if expert_mesh is not None and is_expert(name):
        return expert_layout(name, shape, expert_mesh, cfg)
    R, dims = Replicate(), mesh.mesh_dim_names
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in REPLICATED):
        return ParamLayout(*_by_role({}, dims, (R, R, R)), torch.Size(shape), mesh)
    t = tp_dim(name) if "tp" in dims else None
    f = next((d for d in range(len(shape)) if d != t), None)   # FSDP's: 0, or 1 where tp splits 0 (module doc)
    tp, fsdp = Shard(t) if t is not None else R, Shard(f) if f is not None else R
    roles = {"tp": (tp, tp, tp), "dp_shard": (fsdp, R, fsdp),   # cp (the default): every cp rank holds it all
             "dp_replicate": (R, R, fsdp if cfg.parallel.distributed_optimizer else R)}
    return ParamLayout(*_by_role(roles, dims, (R, R, R)), torch.Size(shape), mesh)


def plan(params, mesh, cfg, expert_mesh=None) -> dict:
    """{dotted name: ParamLayout} for every leaf of `params` (real or meta tensors)."""
    return {name: layout_of(name, p.shape, mesh, cfg, expert_mesh) for name, p in named_leaves(params).items()}


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of chunk i of n along a dim of `size`, as DTensor's Shard splits it."""
    full = (size + n - 1) // n
    start = min(full * i, size)
    return start, min(size, start + full) - start


def shard_index(shape, placements, sizes, coords) -> tuple:
    """The part of a whole tensor that the rank at mesh coordinate `coords` holds under `placements`:
    each Shard(d) cuts dim d in DTensor's chunks (ceil-sized, the last ones shorter or empty)."""
    index = [slice(None)] * len(shape)
    for placement, size, coord in zip(placements, sizes, coords):
        if isinstance(placement, Shard):
            if index[placement.dim] != slice(None):
                raise ValueError(f"two mesh dims split dim {placement.dim}; the plan never does that")
            start, length = chunk_bounds(shape[placement.dim], size, coord)
            index[placement.dim] = slice(start, start + length)
    return tuple(index)
