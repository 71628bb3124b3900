"""NCCL's contracts (nanomega/sim/contracts.py): every layout's real step, evaluation and end-of-run gather run per
rank on the meta device over a fake process group, and nothing NCCL refuses or hangs on happens; and the checker
itself flags each kind of breach (a CPU tensor in a collective, a group made after setup, transfers matched out
of order or to the wrong shape, a host sync in the step)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nanomega.sim import contracts
from nanomega.config import parse_args
from nanomega.sim.fake_world import fake_world
from nanomega.parallel.mesh import model_config
from tiers import slow

MODEL = ["--model.d_model=32", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
         "--model.ffn_dim=64", "--model.vocab_size=251", "--train.batch_size=4", "--train.seq_len=16",
         "--train.grad_accum=4", "--train.compile=false"]
MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32"]
# Virtual pipeline stages need MODEL's 4 blocks (2 stages x 2 virtual) and 4 micro-batches (interleaved 1F1B: a
# multiple of pp); every other layout checks the same contracts on 2 blocks (each between the embedding and the head:
# FSDP's gather ahead has a unit on either side; a pipeline stage each) and 3 micro-batches (a first, a middle, and
# the last, whose backward the reductions finish; 1F1B's steady phase): 40% of the fake ops, and of the ~25 s a
# layout took on 2 cores.
SHORT = ["--model.n_layers=2", "--train.grad_accum=3"]

LAYOUTS = {
    # the fast tier: pipeline with tensor + sequence parallel, FSDP x expert parallel
    "pp2_tp2_sp": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
    "fsdp2_ep2_moe": ["--parallel.dp_shard=2", "--parallel.ep=2", *MOE],
    # the slow tier: the rest of the matrix
    "cp2_ring_fsdp2": ["--parallel.cp=2", "--parallel.cp_method=ring", "--parallel.dp_shard=2"],
    "ddp2": ["--parallel.dp_replicate=2"],
    "fsdp2_ac_full": ["--parallel.dp_shard=2", "--train.activation_checkpointing=full"],
    "hsdp_2x2": ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"],
    "zero1": ["--parallel.dp_replicate=2", "--parallel.distributed_optimizer=true"],
    "fsdp2_tp2_ac_selective": ["--parallel.dp_shard=2", "--parallel.tp=2", "--train.activation_checkpointing=selective"],
    "cp2_all_gather_tp2": ["--parallel.cp=2", "--parallel.tp=2"],
    "pp2_1f1b_fsdp2": ["--parallel.pp=2", "--parallel.dp_shard=2"],
    "pp2_gpipe": ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"],
    "pp2_interleaved": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=interleaved_1f1b"],
    "pp2_zbv_fsdp2_ac": ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v",
                         "--parallel.dp_shard=2", "--train.activation_checkpointing=full"],
    "pp2_ep2_moe": ["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.ep=2", *MOE],
    "fsdp2_fp8_tensorwise": ["--parallel.dp_shard=2", "--model.fp8=tensorwise"],
    "tp2_fp8_rowwise": ["--parallel.tp=2", "--model.fp8=rowwise"],
    "fsdp2_fp8_delayed": ["--parallel.dp_shard=2", "--model.fp8=delayed"],
    "tp2_fp8_blockwise": ["--parallel.tp=2", "--model.fp8=blockwise", "--model.d_model=512", "--model.ffn_dim=1024",
                          "--model.n_layers=2", "--train.seq_len=128", "--model.max_seq_len=128", "--train.grad_accum=1"],
    "fsdp2_ac_every2_fp8_tensorwise": ["--parallel.dp_shard=2", "--train.activation_checkpointing=full",
                                       "--train.ac_every=2", "--model.fp8=tensorwise"],
    # MoE with fp8: its per-expert loop reads the expert counts on the host, within the layout's budget
    "fsdp2_ep2_moe_fp8_rowwise": ["--parallel.dp_shard=2", "--parallel.ep=2", "--model.fp8=rowwise", *MOE],
    "pp2_ep2_moe_fp8_tensorwise_ac": ["--parallel.pp=2", "--parallel.dp_replicate=2", "--parallel.ep=2",
                                      "--model.fp8=tensorwise", "--train.activation_checkpointing=full", *MOE],
    # Not here: token dropping (the kept assignments are a nonzero() over routing values, which fake tensors
    # lack); checkpoints issue no collective (ranks agree over the store: parallel/agreement.py).
}
FAST = {"pp2_tp2_sp", "fsdp2_ep2_moe"}


@pytest.mark.parametrize("layout", [name if name in FAST else pytest.param(name, marks=slow) for name in LAYOUTS])
def test_every_layout_keeps_ncclS_contracts(layout):
    cfg = parse_args(MODEL + ([] if "--parallel.pp_virtual=2" in LAYOUTS[layout] else SHORT) + LAYOUTS[layout])
    result = contracts.check(cfg)
    assert result["violations"] == []
    # no host read but MoE's inherent ones (one per MoE layer and forward for each reason that applies)
    moe = contracts.moe_reads_per_forward(model_config(cfg), cfg.parallel.ep)
    assert (moe > 0) == ("--model.fp8" in LAYOUTS[layout] and "--model.n_experts=4" in LAYOUTS[layout]
                         or "--parallel.ep=2" in LAYOUTS[layout])
    for r, res in result["ranks"].items():
        assert res["syncs"].get("step", 0) <= contracts.host_read_budget(cfg), r
        assert res["syncs"].get("evaluate", 0) <= 1 + moe, r    # one read of the validation loss
        assert res["syncs"].get("sample", 0) <= 2 * moe, r      # 2 tokens sampled on the mesh (parallel/sample.py)
    if moe:     # the budget is not slack: the step makes the reads it allows for, a stage only its own layers'
        assert max(res["syncs"].get("step", 0) for res in result["ranks"].values()) * cfg.parallel.pp == \
            contracts.host_read_budget(cfg)
    if "--parallel.pp=2" in LAYOUTS[layout]:    # the pipeline's transfers were seen and matched, the sample's too
        assert all({phase for *_, phase in res["transfers"]} >= {"step", "evaluate", "sample"}
                   for res in result["ranks"].values())


# ---------------------------------------------------------------- the checker flags each breach

def _records(world: int, body) -> list:
    """What Contracts records while `body(contracts)` runs as rank 0 of a fake world of `world` ranks."""
    recorder = contracts.Contracts("meta")
    with fake_world(world, 0, "cpu:fake,meta:fake"), contracts.recording_groups(recorder):
        with recorder:
            body(recorder)
    return {"off_device": recorder.off_device, "syncs": dict(recorder.syncs), "transfers": recorder.transfers,
            "groups": recorder.groups}


def test_a_cpu_tensor_in_a_collective_is_flagged():
    def body(recorder):
        with recorder.in_phase("evaluate"):
            dist.all_reduce(torch.zeros((), device="meta"))    # on the rank's device: fine
            dist.all_reduce(torch.zeros(()))                     # the pipeline evaluation's old scalar
    found = contracts.violations({0: _records(2, body)})
    assert found == ["rank 0, evaluate: c10d.allreduce_.default on cpu (NCCL takes tensors on the rank's GPU only)"]


def test_a_process_group_made_inside_the_step_is_flagged():
    from torch.distributed.device_mesh import init_device_mesh

    def body(recorder):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        with recorder.in_phase("step"):
            mesh["dp", "tp"]._flatten()        # what mesh.group_over did lazily before create_groups
    found = contracts.violations({0: _records(8, body)})
    assert found and all(f.startswith("rank 0, step: creates a process group over ranks ") for f in found), found


def test_a_host_sync_in_the_step_is_flagged():
    def body(recorder):
        with recorder.in_phase("step"):
            torch.ones(2, device="meta").sum().item()
    assert contracts.violations({0: _records(2, body)}) == [
        "rank 0: 1 host syncs in two train steps (.item(), .tolist()), over the layout's budget of 0"]


def test_transfers_are_matched_in_order_and_by_shape_across_ranks():
    def rank(transfers, setup_groups=()):
        return {"off_device": [], "syncs": {}, "transfers": transfers, "groups": [("setup", g) for g in setup_groups]}
    a, b = ((4, 8), "torch.float32", "step"), ((4, 16), "torch.float32", "step")
    fine = {0: rank([("send", 1, *a), ("send", 1, *b)]), 1: rank([("recv", 0, *a), ("recv", 0, *b)])}
    assert contracts.violations(fine) == []
    swapped = {0: rank([("send", 1, *a), ("send", 1, *b)]), 1: rank([("recv", 0, *b), ("recv", 0, *a)])}
    assert contracts.violations(swapped) == [
        "transfer #0 from rank 0 to rank 1: sent ((4, 8), 'torch.float32') in step, received into ((4, 16), "
        "'torch.float32') in step (NCCL matches in order)",
        "transfer #1 from rank 0 to rank 1: sent ((4, 16), 'torch.float32') in step, received into ((4, 8), "
        "'torch.float32') in step (NCCL matches in order)"]
    unequal = {0: rank([], [[0, 1]]), 1: rank([], [[0, 1], [0]])}
    assert contracts.violations(unequal) == ["rank 1 creates other process groups at setup than rank 0, or in another order"]


def test_a_group_over_dims_not_made_at_setup_is_refused():
    from torch.distributed.device_mesh import init_device_mesh
    from nanomega.parallel.mesh import create_groups, group_over
    with fake_world(8, 0):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        with pytest.raises(RuntimeError, match="the process group over mesh dims dp_shard_tp was not created at setup"):
            group_over(mesh, [0, 2])
        create_groups(mesh)
        assert group_over(mesh, [0, 2]).mesh_dim_names == ("dp_shard_tp",)
        assert group_over(mesh, [1]) == (mesh, 1)
