"""FSDP over dp_shard x cp (parallel/plan.py): under context parallel with FSDP, parameters, gradients and optimizer
state are sharded over the cp ranks too, as torchtitan shards over its flattened dp_shard-cp mesh.

- The plan: every dense parameter FSDP splits is Shard on dp_shard and on cp (one dim, nested), whole for compute;
  without FSDP (dp_shard = 1) cp keeps it whole, and the distributed optimizer shards its state over dp_replicate x
  cp; experts' edp already spans the cp ranks.
- What a rank holds (sim/rank_bytes.py, train.py's memory preflight): cp 2 x FSDP 2 holds what FSDP 4 holds, a
  quarter of the model's parameters counted from its leaves (tests/test_parallel.py measures it on gloo, case
  cp2_fsdp2, and trains it against the serial run).
- On 4 gloo ranks (dp_shard 2 x cp 2), with shapes that do not divide: plan.shard_index is the part DTensor gives
  each rank, and packing.Bucket's one all-gather and one reduce-scatter over both dims give what DTensor's
  redistribute gives (the whole tensors; the sum over the four ranks, at each rank's part).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import parity
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel.mesh import mesh_shapes
from nanomega.parallel.plan import is_expert, layout_of
from nanomega.sim.rank_bytes import bytes_per_rank
from nanomega.tree import named_leaves
from tiers import slow

MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32"]


def layouts(args):
    cfg = parse_args(parity.BASE + args)
    mesh, experts = mesh_shapes(cfg)
    params = named_leaves(init(cfg.model, device="meta"))
    return mesh, experts, {n: (p, layout_of(n, p.shape, mesh, cfg, experts)) for n, p in params.items()}


@pytest.mark.parametrize("extra", [[], ["--parallel.tp=2"]])
def test_fsdp_shards_dense_parameters_over_dp_shard_and_cp(extra):
    mesh, _, plan = layouts(["--parallel.cp=2", "--parallel.dp_shard=2", *extra])
    dims = mesh.mesh_dim_names
    shard, cp = dims.index("dp_shard"), dims.index("cp")
    for name, (p, lay) in plan.items():
        split = lay.storage[shard]
        if split == Replicate():    # a 1-d tensor tensor parallel splits already (a column-parallel bias)
            assert p.dim() == 1 and "tp" in dims, name
        if split != Replicate() and p.shape[split.dim] % (mesh.size(shard) * mesh.size(cp)):
            # an uneven dim (the 251-token vocabulary over 4): sharded over dp_shard alone (plan.layout_of)
            assert lay.storage[cp] == lay.optimizer[cp] == Replicate(), name
            continue
        assert lay.storage[cp] == lay.optimizer[cp] == split, name            # the same dim, nested: plan.py
        assert lay.compute[shard] == lay.compute[cp] == Replicate(), name     # gathered over both for compute


def test_without_fsdp_every_cp_rank_keeps_the_parameters_whole():
    mesh, _, plan = layouts(["--parallel.cp=2", "--parallel.dp_replicate=2"])
    cp = mesh.mesh_dim_names.index("cp")
    assert all(lay.storage[cp] == lay.optimizer[cp] == Replicate() for _, lay in plan.values())


def test_the_distributed_optimizer_without_fsdp_shards_the_state_over_dp_replicate_and_cp():
    """ZeRO-1 with cp: parameters whole on every rank, gradients and optimizer state split over dp_replicate x cp
    (nested), so cp 2 x DDP 2 holds the gradients and AdamW state DDP 4 does."""
    args = ["--parallel.cp=2", "--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"]
    mesh, _, plan = layouts(args)
    dims = mesh.mesh_dim_names
    for name, (_, lay) in plan.items():
        assert all(x == Replicate() for x in lay.storage), name
        assert lay.optimizer[dims.index("dp_replicate")] == lay.optimizer[dims.index("cp")] == Shard(0), name
    zero1 = bytes_per_rank(parse_args(parity.BASE + args))
    assert zero1 == bytes_per_rank(parse_args(parity.BASE + ["--parallel.dp_replicate=4",
                                                             "--parallel.distributed_optimizer=true"]))
    assert zero1.grads < zero1.params / 3


def test_experts_under_fsdp_are_split_over_edp_which_spans_the_cp_ranks():
    """The expert mesh folds ep onto every rank holding other tokens, dp x cp (parallel/mesh.py): with cp 2 x FSDP
    2 and ep 2, edp is 2 (= 2 * 2 / 2), and FSDP splits each expert weight over it."""
    _, experts, plan = layouts(["--parallel.cp=2", "--parallel.dp_shard=2", "--parallel.ep=2", *MOE])
    assert dict(zip(experts.mesh_dim_names, experts.shape)) == {"edp": 2, "ep": 2}
    edp = experts.mesh_dim_names.index("edp")
    stacked = [lay for name, (_, lay) in plan.items() if is_expert(name)]
    assert stacked and all(lay.storage[edp] == Shard(1) for lay in stacked)


# a vocabulary that divides by dp_shard x cp: an uneven dim stays sharded over dp_shard alone (plan.layout_of)
EVEN = parity.BASE + ["--model.vocab_size=256"]


def test_cp2_fsdp2_holds_what_fsdp4_holds_a_quarter_of_the_model():
    """Parameters, gradients and AdamW's two moments per rank: each a quarter of the model's (counted from its
    leaves here; DTensor's first rank takes ceil-sized chunks, so a little more where a dim does not divide by
    4), the same as FSDP over 4 ranks; before the plan sharded over cp, twice that."""
    n = sum(p.numel() for p in named_leaves(init(parse_args(EVEN).model, device="meta")).values())
    cp = bytes_per_rank(parse_args(EVEN + ["--parallel.cp=2", "--parallel.dp_shard=2"]))
    assert cp == bytes_per_rank(parse_args(EVEN + ["--parallel.dp_shard=4"]))
    assert 4 * n / 4 <= cp.params <= 1.01 * 4 * n / 4
    assert 2 * cp.params <= cp.state <= 2 * cp.params + 64     # two moments; the step count and clip scalars
    whole = bytes_per_rank(parse_args(EVEN + ["--parallel.cp=2"]))     # no FSDP: every cp rank holds it all
    assert whole.params == 4 * n


def test_muon_owners_span_dp_shard_times_cp():
    """Muon's hidden matrices, each whole on one owner: four owners under cp 2 x FSDP 2 (as under FSDP 4), so the
    most loaded rank holds no more momentum than FSDP 4's; with two owners (FSDP 2 alone) it holds more."""
    muon = ["--optim.name=muon"]
    cp = bytes_per_rank(parse_args(EVEN + muon + ["--parallel.cp=2", "--parallel.dp_shard=2"]))
    assert cp == bytes_per_rank(parse_args(EVEN + muon + ["--parallel.dp_shard=4"]))
    assert cp.state < bytes_per_rank(parse_args(EVEN + muon + ["--parallel.dp_shard=2"])).state


# Shapes whose split dim does not divide by 4: nested chunks (DTensor's: ceil over dp_shard, then over cp) differ
# from a flat split over 4 there (6 rows: 2, 1, 2, 1 against 2, 2, 2, 0).
SHAPES = [(6, 5), (7, 3), (2, 9), (8, 4), (5,)]


@slow     # a 4-process launch (8 s)
def test_packing_over_dp_shard_and_cp_agrees_with_dtensor(tmp_path):
    from ranks import crash_report, torchrun
    proc = torchrun(4, __file__, tmp_path, json.dumps(SHAPES))
    assert proc.returncode == 0, crash_report(proc.stderr)
    for rank in range(4):
        assert (tmp_path / f"ok{rank}").read_text() == "ok"


def _worker(out_dir: str, shapes_json: str) -> None:
    from pathlib import Path
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from nanomega.parallel.mesh import create_groups
    from nanomega.parallel.packing import Bucket
    from nanomega.parallel.plan import ParamLayout, shard_index
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    create_groups(mesh)
    shapes = [tuple(s) for s in json.loads(shapes_json)]
    wholes = [torch.arange(math.prod(s), dtype=torch.float32).view(s) + 1 for s in shapes]
    placements = (Shard(0), Shard(0))
    lays = {f"p{i}": ParamLayout(placements, (Replicate(), Replicate()), placements, torch.Size(s), mesh)
            for i, s in enumerate(shapes)}
    shards = [distribute_tensor(w, mesh, placements).to_local() for w in wholes]
    for w, s in zip(wholes, shards):        # the part DTensor gives this rank is plan.shard_index's
        assert torch.equal(s, w[shard_index(w.shape, placements, (2, 2), mesh.get_coordinate())])
    bucket = Bucket(list(lays), lays, (0, 1))
    for w, g in zip(wholes, bucket.unpack_gather(bucket.launch_gather(shards), shards)):
        assert torch.equal(g, w), (w.shape, g)
    # each rank's gradient differs; the reduce-scatter leaves each rank the sum over the four at its part
    grads = [w * (rank + 1) for w in wholes]
    for w, g, s in zip(wholes, grads, bucket.reduce_scatter(grads)):
        assert torch.equal(s, (w * 10)[shard_index(w.shape, placements, (2, 2), mesh.get_coordinate())]), w.shape
    Path(out_dir, f"ok{rank}").write_text("ok")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys
    _worker(sys.argv[1], sys.argv[2])
