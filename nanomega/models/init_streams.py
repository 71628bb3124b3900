"""Random init drawn in tiles, each from its own generator, so any part of a parameter is drawn alone.

    tiles = Tiles.number(seed, {"tok_embed.weight": (V, d), ...})   # the random leaves, in parameter order
    part = tiles.draw("layers.0.mlp.w_down.weight", (d, f), (slice(0, d), slice(f0, f1)))   # N(0, 1)

A sharded run's ranks each draw only the part they keep (the shard DTensor gives them), and get the serial
numbers bitwise: a leaf's values do not depend on who draws them or in which pieces. Each random leaf,
seen as matrices over its last two dims (a vector as one row; a stacked [E, f, d] weight as E matrices),
is cut into TILE x TILE tiles (the last row and column of tiles shorter). Tile k of the model, counted over
the random leaves in parameter order, holds torch.randn's numbers from a CPU generator seeded with
(seed * tiles + k) mod 2**32: torch's CPU generator (mt19937) keeps 32 bits of a seed, so numbering the
tiles, rather than hashing names, is what keeps every tile's stream distinct (for any seed below
2**32 / tiles: 8,700 for llama3_8b, 100 for a 671B model) where 32-bit hashes would repeat a few tiles.

A part draws the whole tiles it touches and keeps its slice: a row range (Shard(0): FSDP, column-parallel,
vocab-parallel, experts over ep) or a column range (Shard(1): row-parallel, FSDP beside tp) costs at most
one tile of rows or columns more at each end (none where the bounds are multiples of TILE, as for most
layers' shards), and one generator seeding per tile (~1 us, against ~50 us for its 16K numbers): drawn
whole, a leaf costs what one randn call did (bench/init_time.py).
"""
from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

TILE = 128   # rows and columns of a tile: small enough that a shard draws little beyond itself


def _as_matrices(shape) -> tuple[tuple, int, int]:
    """(leading dims, rows, columns): the last two dims tiled, each index of the leading dims its own matrix."""
    shape = tuple(shape)
    if len(shape) == 1:
        return (), 1, shape[0]
    return shape[:-2], shape[-2], shape[-1]


class Tiles(NamedTuple):
    """Where each random leaf's tiles start in the model's numbering, and the seed's offset into it."""
    seed: int
    first: dict      # leaf name -> the number of its first tile
    total: int       # tiles in the whole model

    @staticmethod
    def number(seed: int, shapes: dict) -> "Tiles":
        """shapes: {name: the shape of its random numbers}, in parameter order (the order fixes the numbers)."""
        first, total = {}, 0
        for name, shape in shapes.items():
            lead, rows, cols = _as_matrices(shape)
            first[name], total = total, total + math.prod(lead) * math.ceil(rows / TILE) * math.ceil(cols / TILE)
        return Tiles(seed, first, total)

    def draw(self, name: str, shape, index=None) -> torch.Tensor:
        """The part `index` (a slice per dim, as plan.shard_index gives; None: the whole) of leaf `name`'s
        N(0, 1) numbers, a [*shape] tensor. Under FakeTensorMode (the memory simulator, the contract
        checker) the part is a fake tensor with nothing to draw."""
        shape = tuple(shape)
        index = tuple(slice(None) for _ in shape) if index is None else tuple(index)
        if len(shape) == 1:      # a vector is one row
            return self.draw(name, (1, *shape), (slice(None), *index))[0]
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
        out = torch.empty([max(0, stop - start) for start, stop in bounds])
        if is_fake(out) or out.numel() == 0:
            return out
        lead, rows, cols = _as_matrices(shape)
        (r0, r1), (c0, c1) = bounds[-2:]
        col_tiles = math.ceil(cols / TILE)
        per_matrix = math.ceil(rows / TILE) * col_tiles
        gen = torch.Generator(device="cpu")
        buffer = torch.empty(TILE * TILE)     # one tile's numbers at a time: contiguous, as randn fills them
        for at in itertools.product(*(range(start, stop) for start, stop in bounds[:-2])):
            matrix = sum(i * math.prod(lead[d + 1:]) for d, i in enumerate(at))   # row-major index of `at`
            dest = out[tuple(i - start for i, (start, _) in zip(at, bounds))]
            for tr in range(r0 // TILE, (r1 - 1) // TILE + 1):
                for tc in range(c0 // TILE, (c1 - 1) // TILE + 1):
                    k = self.first[name] + matrix * per_matrix + tr * col_tiles + tc
                    gen.manual_seed((self.seed * self.total + k) % 2**32)
                    height, width = min(TILE, rows - tr * TILE), min(TILE, cols - tc * TILE)
                    tile = buffer[:height * width].view(height, width).normal_(generator=gen)
                    # the tile's rows and columns inside [r0, r1) x [c0, c1), into their place in `dest`
                    ta, tb = max(r0, tr * TILE), min(r1, tr * TILE + height)
                    ua, ub = max(c0, tc * TILE), min(c1, tc * TILE + width)
                    dest[ta - r0:tb - r0, ua - c0:ub - c0] = tile[ta - tr * TILE:tb - tr * TILE,
                                                                ua - tc * TILE:ub - tc * TILE]
        return out
