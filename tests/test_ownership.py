"""The bookkeeping of the layer-wise distributed optimizer (parallel/ownership.py), without processes: owners
balanced by the update's cost, experts' owners over edp, the state a rank holds. (Moving the pieces is checked
bitwise against the serial optimizer in tests/test_parallel.py and tests/test_expert_owners.py.)"""
from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard
from torch.utils.flop_counter import FlopCounterMode

from nanomega.config import OptimConfig, parse_args
from nanomega.optim.linalg import newton_schulz
from nanomega.parallel.ownership import assign, group_ranks, matrix_cost, owner_index
from nanomega.parallel.plan import chunk_bounds
from nanomega.sim.rank_bytes import bytes_per_rank


@pytest.mark.parametrize("size", range(0, 13))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_pieces_are_dtensor_shards_and_tile_the_dimension(size, n):
    pieces = [chunk_bounds(size, n, i) for i in range(n)]
    for i, (start, length) in enumerate(pieces):
        dtensor_length, dtensor_start = Shard(0)._local_shard_size_and_offset(size, n, i)
        assert length == dtensor_length and (length == 0 or start == dtensor_start)
    covered = [j for start, length in pieces for j in range(start, start + length)]
    assert covered == list(range(size))


def owner_of(taken: dict) -> dict:
    """assign's answer for dense matrices (one each): name -> the owner that took it."""
    return {n: counts.index(1) for n, counts in taken.items()}


def test_owners_take_the_largest_matrix_first_to_the_least_loaded_rank_on_every_rank_alike():
    shapes = {"a": (64, 32), "b": (32, 32), "c": (32, 32), "d": (16, 32), "e": (16, 32), "f": (8, 8)}
    units = {n: (1, math.prod(s)) for n, s in shapes.items()}       # cost: elements, as before costs existed
    owner = owner_of(assign(units, 2))
    # loads after each: a 2048|0, b 2048|1024, c 2048|2048, d (tie: lowest) 2560|2048, e 2560|2560, f 2624|2560
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1, "f": 0}
    assert owner_of(assign(dict(reversed(units.items())), 2)) == owner     # independent of the order given
    assert sorted(owner_of(assign(units, 8)).values()) == list(range(6))   # more owners than matrices


def newton_schulz_flops(shape, steps: int) -> int:
    """FLOPs of linalg.newton_schulz on a matrix, counted by torch's FlopCounterMode (2 m n k a matmul)."""
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(shape), steps=steps)
    return counter.get_total_flops()


@pytest.mark.parametrize("shape", [(64, 16), (16, 64), (48, 48), (1024, 64)])
def test_muon_declares_the_flops_its_newton_schulz_runs(shape):
    cfg = OptimConfig(name="muon", settings=(("ns_steps", 3),))
    assert matrix_cost(cfg)(shape) == newton_schulz_flops(shape, 3)
    assert matrix_cost(cfg)((7,) + shape) == matrix_cost(cfg)(shape)    # a stacked expert: one expert's matrix


def test_owners_balance_the_update_cost_not_the_elements():
    """One square matrix and four tall ones of the same size: by elements the square one's owner also takes two
    tall ones (3.9x the other's Newton-Schulz work); by cost (max(M,N) min(M,N)^2 an iteration) the square one's
    owner takes nothing else, the least any assignment can put on it."""
    shapes = {"square": (256, 256), **{f"tall{i}": (1024, 64) for i in range(4)}}
    by_cost = matrix_cost(OptimConfig(name="muon"))
    square, tall = 5 * (4 + 2) * 256 ** 3, 5 * (4 * 1024 + 2 * 64) * 64 ** 2    # 5 iterations, by hand
    assert (by_cost(shapes["square"]), by_cost(shapes["tall0"])) == (square, tall)

    def work(taken):
        return sorted(sum(by_cost(shapes[n]) * counts[o] for n, counts in taken.items()) for o in range(2))
    assert work(assign({n: (1, math.prod(s)) for n, s in shapes.items()}, 2)) == [2 * tall, square + 2 * tall]
    assert work(assign({n: (1, by_cost(s)) for n, s in shapes.items()}, 2)) == [4 * tall, square]


def test_experts_go_to_owners_in_contiguous_counts_from_their_ranks_loads():
    """A stacked weight's experts, one at a time to the least loaded owner: 4 experts over 2 owners are 2 and 2,
    3 over 2 are 2 and 1 and the next weight's odd one goes to the other owner; the costliest matrix goes
    first, so a matrix costlier than an expert does not land last on a loaded owner (ordered by a name's
    total cost, 5 x 3 before 7, the loads were 15 | 8 | 9 here)."""
    assert assign({"w": (4, 10.0)}, 2) == {"w": [2, 2]}
    assert assign({"a": (3, 10.0), "b": (3, 10.0)}, 2) == {"a": [2, 1], "b": [1, 2]}
    units = {"w1": (5, 3.0), "w2": (5, 2.0), "other": (1, 7.0)}
    taken = assign(units, 3)
    assert {n: sum(c) for n, c in taken.items()} == {"w1": 5, "w2": 5, "other": 1}
    load = [sum(c[o] * units[n][1] for n, c in taken.items()) for o in range(3)]
    assert load == [11.0, 11.0, 10.0]          # 32 in all: the best there is


def test_matrices_whose_update_costs_nothing_are_spread_not_piled_on_one_owner():
    """SOAP declares no cost for a matrix with no dim within max_precond_dim (Adam alone runs on it): by load alone
    every such matrix would go to owner 0 with its state. Five weights of three experts over four owners: each
    owner holds 3 or 4 of the 15; the cost still decides first (the free ones go to the owner without the costly one)."""
    taken = assign({f"w{i}": (3, 0.0) for i in range(5)}, 4)
    held = [sum(t[o] for t in taken.values()) for o in range(4)]
    assert sorted(held) == [3, 4, 4, 4]
    mixed = assign({"big": (1, 10.0), **{f"z{i}": (1, 0.0) for i in range(3)}}, 2)
    assert mixed["big"] == [1, 0] and all(mixed[f"z{i}"] == [0, 1] for i in range(3))


def test_the_accountant_finds_edp_groups_and_owner_indices_on_the_rank_grids():
    """FSDP 4 x ep 2: expert grid [edp 2, ep 2] over ranks 0-3 (rank = 2 edp + ep); dense owners are dp_shard 0-3."""
    expert = torch.arange(4).view(2, 2)
    assert group_ranks(expert, [0], (0, 1)) == [1, 3] and group_ranks(expert, [0], (1, 0)) == [0, 2]
    dense = owner_index(torch.arange(4).view(4), [0])
    assert dense == {0: 0, 1: 1, 2: 2, 3: 3}
    # two owner dims, nested (outer first), as DTensor nests Shard over them; tp (last) is not an owner dim
    assert owner_index(torch.arange(8).view(2, 2, 2), [0, 1]) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}


@pytest.mark.parametrize("opt", ["muon", "soap"])
def test_expert_owners_over_edp_hold_what_a_whole_expert_rank_holds(opt):
    """FSDP 4 x ep 2 gives each expert one owner among 2 edp ranks: a rank holds the state of E/4 experts, as
    under FSDP 4 x ep 4 (edp 1: each rank whole E/4 experts), and half of what the same layout held before the
    owners (every edp rank the state of its E/2 experts); the dense owners are those of FSDP 4 in both."""
    common = ["--config=tiny_mixtral", "--parallel.dp_shard=4", f"--optim.name={opt}"]
    owners = bytes_per_rank(parse_args(common + ["--parallel.ep=2"])).state
    whole = bytes_per_rank(parse_args(common + ["--parallel.ep=4"])).state
    assert owners == whole
