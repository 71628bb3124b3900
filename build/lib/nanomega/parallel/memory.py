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
                    x share of its optimizer placement, except a hidden matrix under Muon, Shampoo or
                    SOAP: its state is whole, on one owner where the state is data-parallel sharded
                    (owners as ParallelOptimizer picks them: ownership.assign), on every rank otherwise
                    (split over tp for Muon with parallel.muon_tp=distributed); a rank's experts are
                    whole matrices on it (E / ep of each stacked tensor).
These are the bytes held between steps; what a step adds at its peak (gathered parameters,
activations, transient buffers) is not counted here.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from torch.distributed.tensor import Replicate, Shard

from nanomega import optim
from nanomega.models import init
from nanomega.optim.memory import state_bytes
from nanomega.parallel.mesh import mesh_shapes, model_config
from nanomega.parallel.ownership import assign
from nanomega.parallel.plan import is_expert, layout_of
from nanomega.tree import named_leaves

MATRIX_OPTIMIZERS = ("muon", "shampoo", "soap")


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
    """Bytes held between steps by the most loaded rank of the layout cfg.parallel describes (module doc)."""
    p, o = cfg.parallel, cfg.optim
    params = named_leaves(init(model_config(cfg), cfg.train.seed, "meta"))
    mesh, experts = mesh_shapes(cfg)
    opt = optim.build(o, cfg.train.steps)
    fixed = state_bytes(opt.init({}))                # counts, the clip norm: per optimizer, not per parameter
    matrix_opt = o.name in MATRIX_OPTIMIZERS
    tp_split_muon = o.name == "muon" and p.muon_tp == "distributed" and "tp" in mesh.mesh_dim_names

    held = {"params": 0.0, "grads": 0.0, "grads_backward": 0.0, "state": float(fixed)}
    whole_state = {}    # dense hidden matrices under a matrix optimizer: name -> bytes, on its owner
    for name, x in params.items():
        lay = layout_of(name, x.shape, mesh, cfg, experts)
        storage = _largest_share(x.shape, lay.storage, lay.mesh)
        optimizer = _largest_share(x.shape, lay.optimizer, lay.mesh)
        held["params"] += 4 * x.numel() * storage
        held["grads_backward"] += 4 * x.numel() * storage
        held["grads"] += 4 * x.numel() * optimizer
        state = state_bytes(opt.init({name: x})) - fixed
        if not (matrix_opt and optim.hidden_matrix(name, x)):
            held["state"] += state * optimizer
        elif is_expert(name) and lay.mesh is experts:    # whole experts, E / ep of them on each rank
            names = experts.mesh_dim_names
            held["state"] += state / (experts.size(names.index("ep")) if "ep" in names else 1)
        else:
            tp = mesh.mesh_dim_names.index("tp") if tp_split_muon else None
            over_tp = [p if i == tp else Replicate() for i, p in enumerate(lay.optimizer)]
            whole_state[name] = state * _largest_share(x.shape, over_tp, lay.mesh)

    sharded = {"dp_shard"} | ({"dp_replicate"} if p.distributed_optimizer else set())
    owners = math.prod(mesh.size(i) for i, d in enumerate(mesh.mesh_dim_names) if d in sharded)
    owner_of = assign({n: tuple(params[n].shape) for n in whole_state}, owners)
    owned = [0.0] * owners
    for name, state in whole_state.items():
        owned[owner_of[name]] += state
    held["state"] += max(owned)
    return RankBytes(**held)
