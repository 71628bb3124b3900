"""Whole matrices on their owners: the two exchanges of a layer-wise distributed optimizer.

Where optimizer state is sharded over data parallel (dp_shard, and cp with it; dp_replicate too under the
distributed optimizer: the "owner dims", plan.state_dims), Muon, Shampoo and SOAP cannot work element-wise
on shards. Each hidden matrix gets one owner among those ranks instead, which keeps its state and computes
its update whole (Megatron's LayerWiseDistributedOptimizer). Stacked experts [E/ep, out, in], sharded over
edp by FSDP, are E/ep matrices each: every expert goes whole to one owner among the edp ranks, and each
owner takes a contiguous range of a stacked weight's experts, so its state of them is one box of the whole.
Every rank holds a piece of every matrix: a slice along the dimension data parallel splits, of the
matrix gathered whole over tp first. Two all-to-alls move exactly those pieces:

    to_owners({name: local shard})    -> {name: whole matrix (or its owned experts)} of what this rank owns
    from_owners({name: whole update}) -> {name: local shard} of every matrix, from its owner(s)

so a rank receives (d-1)/d of what it owns and nothing else: no rank ever holds another owner's
matrices whole. Piece boundaries follow DTensor's Shard rule (ceil-sized chunks, nested over two
owner dims), so the pieces are exactly the local shards of the optimizer placements.

Owners are balanced by the cost of the update, which the optimizer declares (optim.Optimizer's
matrix_cost: Newton-Schulz's max(M,N)·min(M,N)² per iteration; Shampoo's and SOAP's matmuls and
eigendecompositions), not by elements: `assign` gives the costliest matrix first to the least-loaded
owner. Dense matrices are balanced over their owners and each edp group's experts over its ranks, apart:
a stacked weight's experts all cost the same, so each edp rank takes 1/edp of them and the experts' state
per rank falls by the edp factor (starting the experts from their ranks' dense loads would even the work a
little further and move expert state onto the ranks with less dense work). The memory accountant
(sim/rank_bytes.py) runs `assign` as the runtime does.
"""
from __future__ import annotations

import heapq
import itertools
import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nanomega import optim
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor, nested_bounds


def matrix_cost(optim_cfg):
    """shape -> the cost of one whole-matrix update of its last two dims, as the optimizer declares it
    (optim.Optimizer.matrix_cost); elements where it declares none."""
    spec, settings = optim.spec_of(optim_cfg.name), optim.check(optim_cfg)
    if spec.matrix_cost is None:
        return lambda shape: float(math.prod(shape[-2:]))
    return lambda shape: float(spec.matrix_cost(settings, tuple(shape[-2:])))


def assign(units: dict, owners: int) -> dict:
    """{name: (count, cost of one)} -> {name: [how many of its `count` matrices each owner takes]}: the costliest
    matrices first (then the larger count, then the name), each to the least-loaded owner (ties: the one holding
    fewer matrices, then the lowest index): longest-processing-time first, within 4/3 of the best. A dense matrix
    is (1, cost); a stacked expert weight (E/ep, the cost of one expert's matrix). The count tie-break spreads
    matrices whose update costs nothing by this measure (SOAP's with no dim within max_precond_dim: Adam alone)
    instead of piling them, and their state, on owner 0."""
    heap = [(0.0, 0, o) for o in range(owners)]
    taken = {}
    for name in sorted(units, key=lambda n: (-units[n][1], -units[n][0], n)):
        count, cost = units[name]
        taken[name] = [0] * owners
        for _ in range(count):
            x, held, o = heapq.heappop(heap)
            taken[name][o] += 1
            heapq.heappush(heap, (x + cost, held + 1, o))
    return taken


def group_ranks(grid: torch.Tensor, dims: list[int], coordinate) -> list[int]:
    """The global ranks of the group spanning mesh dims `dims` through `coordinate` of a grid of ranks, in the
    group's own order (nested, outer dim first): index i is the rank whose owner index is i."""
    index = tuple(slice(None) if i in dims else c for i, c in enumerate(coordinate))
    return grid[index].flatten().tolist()


def owner_index(grid: torch.Tensor, owner_dims: list[int]) -> dict[int, int]:
    """{global rank: its index in its owner group} over a grid of ranks (nested over owner_dims, outer first)."""
    out = {}
    for coordinate in itertools.product(*map(range, grid.shape)):
        i = 0
        for d in owner_dims:
            i = i * grid.shape[d] + coordinate[d]
        out[int(grid[coordinate])] = i
    return out


class Owners:
    """The owner of each matrix and the piece each owner-group rank holds of it. `stacked`: names whose dim 0
    lists matrices (experts) that owners take in contiguous ranges."""

    def __init__(self, mesh, owner_dims: list[int], layouts: dict, names: list[str], cost, stacked=frozenset()):
        self.mesh, self.layouts, self.names, self.stacked = mesh, layouts, list(names), frozenset(stacked)
        sizes = [mesh.size(i) for i in owner_dims]
        ranks = list(itertools.product(*map(range, sizes)))   # owner-group rank r: coordinates, row-major
        self.count, self.me = len(ranks), ranks.index(tuple(mesh.get_local_rank(i) for i in owner_dims))
        self.group = group_over(mesh, owner_dims)
        # what the owner group holds together: each tensor gathered over the owner dims and tp (experts stay
        # split over ep: E/ep of them), and where it starts in the whole (an expert's global index); the dim data
        # parallel splits, and each owner-group rank's (start, length) along it
        self.base, first, self.split_dim, self.bounds = {}, {}, {}, {}
        for n in self.names:
            gathered = [Replicate() if i in owner_dims else p for i, p in enumerate(self._tp_whole(n))]
            shape, offset = compute_local_shape_and_global_offset(layouts[n].shape, mesh, gathered)
            self.base[n], first[n] = list(shape), offset[0]
            placements = [layouts[n].optimizer[i] for i in owner_dims]
            dims = {p.dim for p in placements if isinstance(p, Shard)}
            if len(dims) != 1 or not all(isinstance(p, Shard) for p in placements):
                raise ValueError(f"{n}: optimizer placements {placements} on the owner dims must all split one "
                                 "dimension (the plan's data-parallel dim)")
            f = self.split_dim[n] = dims.pop()
            self.bounds[n] = [nested_bounds(shape[f], sizes, c) for c in ranks]   # nested, outer dim first
        units = {n: (self.base[n][0], cost(self.base[n][1:])) if n in self.stacked else (1, cost(self.base[n]))
                 for n in self.names}
        taken = assign(units, self.count)
        # owner o's (start, length) along dim 0 of a stacked tensor: contiguous, in owner order
        self.ranges = {n: [(sum(taken[n][:o]), taken[n][o]) for o in range(self.count)] for n in self.names}
        self.owns = {n: [o for o in range(self.count) if taken[n][o]] for n in self.names}
        self.mine = [n for n in self.names if taken[n][self.me]]
        self.first_expert = {n: first[n] + self.ranges[n][self.me][0] for n in self.mine if n in self.stacked}

    def _piece_shape(self, name: str, rank: int, owner: int) -> list[int]:
        """The shape of the piece `rank` holds of what `owner` owns of `name`."""
        shape = list(self.base[name])
        if name in self.stacked:
            shape[0] = self.ranges[name][owner][1]
        shape[self.split_dim[name]] = self.bounds[name][rank][1]
        return shape

    def _part(self, name: str, x: torch.Tensor, owner: int) -> torch.Tensor:
        """What `owner` owns of this rank's piece x of `name`: all of it, or its range of the stacked experts."""
        return x.narrow(0, *self.ranges[name][owner]) if name in self.stacked else x

    def _tp_whole(self, name: str):
        """The optimizer placements with tensor parallel gathered: the piece each owner-group rank holds."""
        names = self.mesh.mesh_dim_names
        return [Replicate() if d == "tp" else p for d, p in zip(names, self.layouts[name].optimizer)]

    def _move(self, name: str, local: torch.Tensor, source, target) -> torch.Tensor:
        """This rank's part of `name` under placements `source` -> under `target` (DTensor's collectives)."""
        if list(source) == list(target):
            return local
        return as_dtensor(local, self.mesh, source, self.layouts[name].shape).redistribute(self.mesh, target).to_local()

    def _all_to_all(self, send: list, receive: list, like: torch.Tensor) -> list:
        """One all-to-all over the owner group: send[r], {name: tensor} for owner-group rank r -> from each rank r,
        {name: tensor} of the shapes receive[r] gives, in its order; `like`: from_owners'."""
        parts = [x.reshape(-1) for to_rank in send for x in to_rank.values()]
        sizes = [[math.prod(shape) for shape in shapes.values()] for shapes in receive]
        recv = funcol.all_to_all_single(torch.cat(parts) if parts else like.new_zeros(0), [sum(k) for k in sizes],
                                        [sum(x.numel() for x in to_rank.values()) for to_rank in send], self.group)
        pieces = iter(recv.split([k for each in sizes for k in each]))
        return [{n: next(pieces).view(shape) for n, shape in shapes.items()} for shapes in receive]

    def to_owners(self, local: dict) -> dict:
        """{name: this rank's optimizer shard} of every matrix -> {name: whole} of the matrices it owns (of a
        stacked weight: its range of experts, whole)."""
        # First gather over tp (a no-op where tp does not split the matrix), every rank in the same order.
        pieces = {n: self._move(n, local[n], self.layouts[n].optimizer, self._tp_whole(n)) for n in self.names}
        received = self._all_to_all(
            [{n: self._part(n, pieces[n], o) for n in self.names if o in self.owns[n]} for o in range(self.count)],
            [{n: self._piece_shape(n, r, self.me) for n in self.mine} for r in range(self.count)],
            local[self.names[0]])
        return {n: torch.cat([r[n] for r in received], dim=self.split_dim[n]) for n in self.mine}

    def from_owners(self, whole: dict, like: torch.Tensor) -> dict:
        """{name: whole} of what this rank owns -> {name: this rank's optimizer shard} of every matrix.
        `like` gives the dtype and device of an empty send (a rank may own nothing)."""
        received = self._all_to_all(
            [{n: whole[n].narrow(self.split_dim[n], *self.bounds[n][r]) for n in self.mine} for r in range(self.count)],
            [{n: self._piece_shape(n, self.me, o) for n in self.names if o in self.owns[n]} for o in range(self.count)],
            like)
        # a stacked weight's ranges come in owner order: concatenated they are this rank's piece of every expert;
        # then the tp shard of the piece: slicing only (Replicate -> Shard moves no data)
        parts = {n: [o[n] for o in received if n in o] for n in self.names}
        return {n: self._move(n, torch.cat(parts[n]) if n in self.stacked else parts[n][0], self._tp_whole(n),
                              self.layouts[n].optimizer) for n in self.names}
