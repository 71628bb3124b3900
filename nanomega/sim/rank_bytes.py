"""What one rank holds between steps, from the sharding plan alone: parameters, gradients, optimizer state.

    bytes_per_rank(cfg) -> RankBytes(params, grads, grads_backward, state)   # the most loaded rank

No process group and no allocation: the model is initialized on the meta device and the plan
(plan.layout_of) is read over meshes described by their dim names and sizes (mesh.mesh_shapes), so
an 8B or 671B layout is counted on a laptop. train.py's memory preflight and bench/memory.py both
use it. For each parameter of N elements, "share" is the part of it the most loaded rank holds under a
placement: 1 / (the sharded mesh dims' sizes), a little more where a dim does not divide evenly
(DTensor gives the first ranks chunks of ceil(n / k)):
    params          4N x share of its storage placement                        fp32
    grads           4N x share of its optimizer placement: as the optimizer receives them
    grads_backward  4N x share of its storage placement: as the backward leaves them, before the
                    data-parallel reduce (a transient; not in `total`)
    state           the optimizer's state for that parameter (optim.build's, measured on meta tensors)
                    x share of its optimizer placement, except a hidden matrix under a whole-matrix
                    optimizer (optim.REGISTRY's elementwise=False: Muon, Shampoo, SOAP): its state is whole,
                    on one owner where the state is data-parallel sharded, on every rank otherwise
                    (split over tp for Muon with parallel.muon_tp=distributed); each expert's whole on one
                    edp owner where FSDP splits experts over edp, else a rank's E / ep experts on it.
                    Owners as ParallelOptimizer picks them (ownership.assign by matrix_cost), the most
                    loaded rank found over the layout's rank grids (its dense and its expert share).
Under pipeline parallel each pipeline rank holds its stages' parameters (mesh.stage_of), counted apart.
These are the bytes held between steps; what a step adds at its peak (gathered parameters,
activations, transient buffers) is not counted here.
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
from torch.distributed.tensor import Replicate, Shard

from nanomega import optim
from nanomega.models import init
from nanomega.optim.memory import state_bytes
from nanomega.parallel.mesh import expert_grid, mesh_shapes, model_config, stage_of, stages_layers
from nanomega.parallel.ownership import assign, group_ranks, matrix_cost, owner_index
from nanomega.parallel.plan import is_expert, layout_of, state_dims
from nanomega.parallel.schedules import stage_ranks
from nanomega.tree import named_leaves


class RankBytes(NamedTuple):
    params: float
    grads: float
    grads_backward: float
    state: float

    @property
    def total(self) -> float:
        """Parameters, gradients (as the optimizer receives them) and optimizer state."""
        return self.params + self.grads + self.state


def _largest_share(shape, placements, mesh) -> float:
    """The fraction of a tensor the most loaded rank holds: DTensor splits a dim of n over k ranks
    into chunks of ceil(n / k), so the first rank holds the most and uneven shapes hold more than 1/k."""
    local = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            local[p.dim] = -(-local[p.dim] // mesh.size(i))
    return math.prod(local) / max(math.prod(shape), 1)


def bytes_per_rank(cfg) -> RankBytes:
    """Bytes held between steps by the most loaded rank of the layout cfg.parallel describes (module doc).
    Under pipeline parallel a rank holds its stages' parameters only: each pipeline rank is counted apart
    and the most loaded one is returned."""
    p, o = cfg.parallel, cfg.optim
    params = named_leaves(init(model_config(cfg), cfg.train.seed, "meta"))
    mesh, experts = mesh_shapes(cfg)
    opt = optim.build(o, cfg.train.steps)
    fixed = state_bytes(opt.init({}))                # counts, the clip norm: per optimizer, not per parameter
    spec = optim.spec_of(o.name)           # the registry says what the optimizer needs (optim/registry.py)
    matrix_opt = not spec.elementwise
    tp_split_muon = spec.tp_shards and p.muon_tp == "distributed" and "tp" in mesh.mesh_dim_names
    if p.pp > 1:
        sizes = stages_layers(cfg)
        placement = stage_ranks(p.pp, p.pp_virtual, "v" if p.pp_schedule == "zb_v" else "loop")
        pp_rank = {name: placement[stage_of(name, sizes)] for name in params}
    else:
        pp_rank = dict.fromkeys(params, 0)

    held = [{"params": 0.0, "grads": 0.0, "grads_backward": 0.0, "state": float(fixed)} for _ in range(p.pp)]
    whole_state = [{} for _ in range(p.pp)]    # dense hidden matrices under a matrix optimizer: name -> bytes
    expert_state = [{} for _ in range(p.pp)]   # experts with edp owners: name -> (E / ep, bytes of one expert)
    cost = matrix_cost(o) if matrix_opt else None
    for name, x in params.items():
        lay = layout_of(name, x.shape, mesh, cfg, experts)
        storage = _largest_share(x.shape, lay.storage, lay.mesh)
        optimizer = _largest_share(x.shape, lay.optimizer, lay.mesh)
        h = held[pp_rank[name]]
        h["params"] += 4 * x.numel() * storage
        h["grads_backward"] += 4 * x.numel() * storage
        h["grads"] += 4 * x.numel() * optimizer
        state = state_bytes(opt.init({name: x})) - fixed
        if not (matrix_opt and optim.hidden_matrix(name, x)):
            h["state"] += state * optimizer
        elif is_expert(name) and lay.mesh is experts:    # whole experts, E / ep of them on each rank (or its owner)
            names = experts.mesh_dim_names
            ep = experts.size(names.index("ep")) if "ep" in names else 1
            if any(d == "edp" and lay.optimizer[i].is_shard() for i, d in enumerate(names)):
                expert_state[pp_rank[name]][name] = (x.shape[0] // ep, state / x.shape[0])
            else:
                h["state"] += state / ep
        else:
            tp = mesh.mesh_dim_names.index("tp") if tp_split_muon else None
            over_tp = [p if i == tp else Replicate() for i, p in enumerate(lay.optimizer)]
            whole_state[pp_rank[name]][name] = state * _largest_share(x.shape, over_tp, lay.mesh)

    sharded = state_dims(cfg)      # the optimizer's owner dims (parallel/optimizer.py): dp_shard x cp under FSDP
    owner_dims = [i for i, d in enumerate(mesh.mesh_dim_names) if d in sharded]
    owners = math.prod(mesh.size(i) for i in owner_dims)
    for stage, (h, matrices) in enumerate(zip(held, whole_state)):   # owners among each stage's dp ranks
        units = {n: (1, cost(params[n].shape)) for n in matrices}
        taken = assign(units, owners)
        owned = [sum(taken[n][o] * state for n, state in matrices.items()) for o in range(owners)]
        if not expert_state[stage]:
            h["state"] += max(owned)
            continue
        # experts: owners along each edp line of the expert grid; a rank's dense share by its dense owner index
        dense_index = owner_index(torch.arange(p.world_size).view(mesh.shape), owner_dims)
        names, grid = expert_grid(cfg)
        edp = [names.index("edp")]
        lines = {tuple(group_ranks(grid, edp, c)) for c in itertools.product(*map(range, grid.shape))
                 if "pp" not in names or c[names.index("pp")] == stage}
        units_e = {n: (count, cost(params[n].shape[1:])) for n, (count, _) in expert_state[stage].items()}
        taken_e, most = assign(units_e, grid.shape[edp[0]]), 0.0
        for members in lines:
            for i, r in enumerate(members):
                mine = sum(taken_e[n][i] * one for n, (_, one) in expert_state[stage].items())
                most = max(most, owned[dense_index[r]] + mine)
        h["state"] += most
    return max((RankBytes(**h) for h in held), key=lambda b: b.total)
