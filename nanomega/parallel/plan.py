"""Sharding plans as data: parameter-name patterns -> the dimension each mesh dimension splits.

    TENSOR_PARALLEL   which dim of each parameter tp splits (Megatron: column-parallel layers split the
                      output features, dim 0 of a [out, in] weight; row-parallel ones the input, dim 1)
    MLPS              where MLP matrices live; whether each is column or row parallel is its kind's
                      declaration (models/mlp.py's `column` and `row`), read by `mlp_dim`
    FSDP              dp_shard, and cp with it (`fsdp_dims`), split the first dimension tp leaves alone (so
                      tp and FSDP never split one dim); dp_replicate (and cp without FSDP) split that dim too
                      for the optimizer state under the distributed optimizer. Mesh dims that split one dim nest,
                      outer first (DTensor's rule: dp_replicate's chunk is cut again over dp_shard, that over cp)

Each parameter gets three placements, one per role:
    storage    how it lives between steps (Shard on dp_shard and cp for FSDP; tp as planned; else Replicate)
    compute    how the forward uses it: storage with the data-parallel dims gathered (Replicate)
    optimizer  where its gradient is reduced to and its optimizer state lives: storage, plus Shard on
               dp_replicate (and cp without FSDP) for the distributed optimizer (ZeRO-1)
Context parallel's ranks hold other tokens of the same sequences, so their gradients are partial sums as
dp_shard's are: under FSDP everything is sharded over dp_shard x cp together (cp 2 x FSDP 4 holds what FSDP 8
holds); without FSDP every cp rank keeps the parameters whole and ZeRO-1 shards the state over dp_replicate x
cp (`zero_dims`). Why, and what each holds: docs/parallelism.md, "FSDP over dp_shard x cp".
The forward redistributes storage -> compute, so the backward brings gradients back to storage by
itself (a reduce-scatter for FSDP). Stacked expert weights [E, ...] live on the expert mesh
(parallel/mesh.py), placed by `expert_layout`.
A router's expert bias is replicated everywhere (the balancing rule updates it from global loads on every rank).
`shard_index` says which part of a whole parameter a rank keeps; the model is never told.
"""
from __future__ import annotations

import fnmatch
import math
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
    """Shard(0) on ep (whole experts per rank); on edp replicated (the gradient all-reduced once per step)
    or, with FSDP (dp_shard > 1), Shard(1) between steps, gathered for compute (the gradient reduce-scattered
    back). On etp (tp ranks holding the same tokens) each expert's hidden dim is split (`expert_tp_dim`) in
    all three roles; with FSDP it is replicated there instead (the owners of FSDP-split experts gather edp
    only)."""
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
    roles = {"tp": (tp, tp, tp)}
    roles.update(dict.fromkeys(zero_dims(cfg), (R, R, fsdp)))       # the distributed optimizer's: state only
    over = fsdp_dims(cfg)
    if len(over) > 1 and f is not None and shape[f] % math.prod(mesh.size(dims.index(d)) for d in over):
        # two mesh dims splitting one uneven dim: DTensor's redistribute (full_tensor, the whole-matrix
        # optimizers' gathers) places the inner chunks at multiples of the inner chunk size, where nested
        # chunks (nested_bounds, the packed gathers) start at the outer chunk's start; they differ unless the
        # dim divides. Such a parameter stays sharded over dp_shard alone, whole over cp (tests/test_context.py)
        over = over[:1]
    roles.update(dict.fromkeys(over, (fsdp, R, fsdp)))              # any other dim (cp without either): whole
    return ParamLayout(*_by_role(roles, dims, (R, R, R)), torch.Size(shape), mesh)


def fsdp_dims(cfg) -> tuple[str, ...]:
    """The dense mesh dims FSDP shards parameters over (module doc): dp_shard, and cp with it; none without FSDP."""
    p = cfg.parallel
    return ("dp_shard",) + (("cp",) if p.cp > 1 else ()) if p.dp_shard > 1 else ()


def zero_dims(cfg) -> tuple[str, ...]:
    """The dense mesh dims the distributed optimizer (ZeRO-1) shards optimizer state over, parameters staying whole
    there (module doc): dp_replicate, and cp with it where FSDP does not shard over cp already."""
    p = cfg.parallel
    if not p.distributed_optimizer:
        return ()
    return ("dp_replicate",) + (("cp",) if p.cp > 1 and p.dp_shard == 1 else ())


def state_dims(cfg) -> tuple[str, ...]:
    """The dense mesh dims that shard optimizer state, outer first: the distributed optimizer's and FSDP's. A
    whole-matrix optimizer's owners are the ranks of these dims (parallel/ownership.py)."""
    return zero_dims(cfg) + fsdp_dims(cfg)


def plan(params, mesh, cfg, expert_mesh=None) -> dict:
    """{dotted name: ParamLayout} for every leaf of `params` (real or meta tensors)."""
    return {name: layout_of(name, p.shape, mesh, cfg, expert_mesh) for name, p in named_leaves(params).items()}


def chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """(start, length) of chunk i of n along a dim of `size`, as DTensor's Shard splits it."""
    full = (size + n - 1) // n
    start = min(full * i, size)
    return start, min(size, start + full) - start


def nested_bounds(size: int, sizes, coords) -> tuple[int, int]:
    """(start, length) of the part of a dim of `size` that mesh dims of `sizes` splitting it in turn (outer first,
    DTensor's nesting) leave to the rank at `coords` on them: each cuts the previous one's chunk in its chunks."""
    start, length = 0, size
    for k, coord in zip(sizes, coords):
        offset, length = chunk_bounds(length, k, coord)
        start += offset
    return start, length


def shard_index(shape, placements, sizes, coords) -> tuple:
    """The part of a whole tensor that the rank at mesh coordinate `coords` holds under `placements`:
    each Shard(d) cuts dim d in DTensor's chunks (ceil-sized, the last ones shorter or empty); mesh dims
    that split one dim nest (`nested_bounds`: FSDP's dp_shard then cp)."""
    index = [slice(None)] * len(shape)
    for d in range(len(shape)):
        over = [(size, coord) for placement, size, coord in zip(placements, sizes, coords)
                if isinstance(placement, Shard) and placement.dim == d]
        if over:
            start, length = nested_bounds(shape[d], *zip(*over))
            index[d] = slice(start, start + length)
    return tuple(index)
