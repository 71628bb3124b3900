"""Whole matrices on their owners: the two exchanges of a layer-wise distributed optimizer.

Where optimizer state is sharded over data parallel (dp_shard; dp_replicate too under the distributed
optimizer: the "owner dims"), Muon, Shampoo and SOAP cannot work element-wise on shards. Each hidden
matrix gets one owner among those ranks instead (largest first, to the least-loaded owner), which
keeps its state and computes its update whole (Megatron's LayerWiseDistributedOptimizer). Every rank
holds a piece of every matrix: a slice along the dimension data parallel splits, of the matrix
gathered whole over tp first. Two all-to-alls move exactly those pieces:

    to_owners({name: local shard})    -> {name: whole matrix} of the matrices this rank owns
    from_owners({name: whole update}) -> {name: local shard} of every matrix, from its owner

so a rank receives (d-1)/d of what it owns and nothing else: no rank ever holds another owner's
matrices whole. Piece boundaries follow DTensor's Shard rule (ceil-sized chunks, nested over two
owner dims), so the pieces are exactly the local shards of the optimizer placements.
"""
from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Replicate, Shard

from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor, chunk_bounds


def assign(shapes: dict, owners: int) -> dict:
    """name -> owner index: largest matrices first, each to the least-loaded owner (ties: lowest index)."""
    load, owner = [0] * owners, {}
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        o = min(range(owners), key=lambda i: (load[i], i))
        owner[name], load[o] = o, load[o] + math.prod(shapes[name])
    return owner


class Owners:
    """The owner of each matrix and the piece each owner-group rank holds of it."""

    def __init__(self, mesh, owner_dims: list[int], layouts: dict, names: list[str]):
        self.mesh, self.layouts, self.names = mesh, layouts, list(names)
        sizes = [mesh.size(i) for i in owner_dims]
        self.count = math.prod(sizes)
        coords = mesh.get_coordinate()
        self.me = 0
        for i in owner_dims:
            self.me = self.me * mesh.size(i) + coords[i]
        self.group = group_over(mesh, owner_dims)
        self.owner = assign({n: tuple(layouts[n].shape) for n in self.names}, self.count)
        self.mine = [n for n in self.names if self.owner[n] == self.me]
        # The dim data parallel splits, and each owner-group rank's (start, length) along it.
        self.split_dim, self.bounds = {}, {}
        for n in self.names:
            placements = [layouts[n].optimizer[i] for i in owner_dims]
            dims = {p.dim for p in placements if isinstance(p, Shard)}
            if len(dims) != 1 or not all(isinstance(p, Shard) for p in placements):
                raise ValueError(f"{n}: optimizer placements {placements} on the owner dims must all split one "
                                 "dimension (the plan's data-parallel dim)")
            f = self.split_dim[n] = dims.pop()
            bounds = []
            for rank in range(self.count):
                start, length, rest = 0, layouts[n].shape[f], rank
                for k, size in enumerate(sizes):   # nested, outer mesh dim first
                    index = rest // math.prod(sizes[k + 1:])
                    rest %= math.prod(sizes[k + 1:])
                    offset, length = chunk_bounds(length, size, index)
                    start += offset
                bounds.append((start, length))
            self.bounds[n] = bounds

    def _piece_shape(self, name: str, rank: int) -> list[int]:
        shape = list(self.layouts[name].shape)
        shape[self.split_dim[name]] = self.bounds[name][rank][1]
        return shape

    def _tp_whole(self, name: str):
        """The optimizer placements with tensor parallel gathered: the piece each owner-group rank holds."""
        names = self.mesh.mesh_dim_names
        return [Replicate() if d == "tp" else p for d, p in zip(names, self.layouts[name].optimizer)]

    def _move(self, name: str, local: torch.Tensor, source, target) -> torch.Tensor:
        """This rank's part of `name` under placements `source` -> under `target` (DTensor's collectives)."""
        return as_dtensor(local, self.mesh, source, self.layouts[name].shape).redistribute(self.mesh, target).to_local()

    def to_owners(self, local: dict) -> dict:
        """{name: this rank's optimizer shard} of every matrix -> {name: whole} of the matrices it owns."""
        # First gather over tp (a no-op where tp does not split the matrix), every rank in the same order.
        pieces = {n: self._move(n, local[n], self.layouts[n].optimizer, self._tp_whole(n)) for n in self.names}
        send_parts, in_splits = [], []
        for o in range(self.count):
            part = [pieces[n].reshape(-1) for n in self.names if self.owner[n] == o]
            send_parts += part
            in_splits.append(sum(p.numel() for p in part))
        out_splits = [sum(math.prod(self._piece_shape(n, r)) for n in self.mine) for r in range(self.count)]
        ref = local[self.names[0]]
        send = torch.cat(send_parts) if send_parts else ref.new_zeros(0)
        recv = funcol.all_to_all_single(send, out_splits, in_splits, self.group)
        received, offset = {n: [] for n in self.mine}, 0
        for r in range(self.count):
            for n in self.mine:
                shape = self._piece_shape(n, r)
                k = math.prod(shape)
                received[n].append(recv[offset:offset + k].view(shape))
                offset += k
        return {n: torch.cat(received[n], dim=self.split_dim[n]) for n in self.mine}

    def from_owners(self, whole: dict, like: torch.Tensor) -> dict:
        """{name: whole} of the matrices this rank owns -> {name: this rank's optimizer shard} of every matrix.
        `like` gives the dtype and device of an empty send (a rank may own nothing)."""
        send_parts, in_splits = [], []
        for r in range(self.count):
            part = [whole[n].narrow(self.split_dim[n], *self.bounds[n][r]).reshape(-1) for n in self.mine]
            send_parts += part
            in_splits.append(sum(p.numel() for p in part))
        out_splits = [sum(math.prod(self._piece_shape(n, self.me)) for n in self.names if self.owner[n] == o)
                      for o in range(self.count)]
        send = torch.cat(send_parts) if send_parts else like.new_zeros(0)
        recv = funcol.all_to_all_single(send, out_splits, in_splits, self.group)
        out, offset = {}, 0
        for o in range(self.count):
            for n in self.names:
                if self.owner[n] != o:
                    continue
                shape = self._piece_shape(n, self.me)
                k = math.prod(shape)
                piece = recv[offset:offset + k].view(shape)
                offset += k
                # the tp shard of the piece: slicing only (Replicate -> Shard moves no data)
                out[n] = self._move(n, piece, self._tp_whole(n), self.layouts[n].optimizer)
        return out
