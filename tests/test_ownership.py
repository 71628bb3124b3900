"""The bookkeeping of the layer-wise distributed optimizer (parallel/ownership.py), without processes.
(Moving the pieces is checked bitwise against the serial optimizer in tests/test_parallel.py.)"""
from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard

from nanomega.parallel.ownership import assign
from nanomega.parallel.plan import chunk_bounds


@pytest.mark.parametrize("size", range(0, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_pieces_are_dtensor_shards_and_tile_the_dimension(size, n):
    pieces = [chunk_bounds(size, n, i) for i in range(n)]
    for i, (start, length) in enumerate(pieces):
        dtensor_length, dtensor_start = Shard(0)._local_shard_size_and_offset(size, n, i)
        assert length == dtensor_length and (length == 0 or start == dtensor_start)
    covered = [j for start, length in pieces for j in range(start, start + length)]
    assert covered == list(range(size))


def test_owners_take_the_largest_matrix_first_to_the_least_loaded_rank_on_every_rank_alike():
    shapes = {"a": (64, 32), "b": (32, 32), "c": (32, 32), "d": (16, 32), "e": (16, 32), "f": (8, 8)}
    owner = assign(shapes, 2)
    # loads after each: a 2048|0, b 2048|1024, c 2048|2048, d (tie: lowest) 2560|2048, e 2560|2560, f 2624|2560
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1, "f": 0}
    assert assign(dict(reversed(shapes.items())), 2) == owner       # independent of the order given
    assert sorted(assign(shapes, 8).values()) == list(range(6))     # more owners than matrices: some own none
