"""A compiled expert-parallel block: how many graphs torch.compile makes of it, and that they compute the eager block.

The train step compiles each block on its own on a mesh (train/step.py make_runner) with parallel/experts.py's
`compile_block`. In a dropless expert-parallel MoE block one thing is not static: how many rows each rank sends each
other rank (the all-to-all's split sizes), read on the host from the exchanged counts (models/moe.py host_counts);
under token dropping also how many assignments are kept. compile_block traces both (TRACED_COUNTS: unbacked ints, a
tensor of unbacked length), so the block is one graph with no break; under dynamo's defaults they are the breaks
left, each split by dynamo into a break in every frame from the block down to it. Both are counted here on 2 gloo
ranks (this file's __main__), the block's forward and backward compiled with the "aot_eager" backend (dynamo and
AOTAutograd's joint graph and partitioner, without inductor's minutes of C++ compile), against the eager block bit
for bit. Inductor's numbers: the compiled parity case in tests/test_parallel.py (slow tier).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import parity                                                    # noqa: E402
from tiers import selected, tiered                               # noqa: E402
from nanomega.config import parse_args                         # noqa: E402

MOE = ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=32", "--model.shared_ffn_dim=32",
       "--model.aux_loss_coef=0.01", "--model.z_loss_coef=0.001", "--optim.name=adamw"]
CASES = {
    "ep2": ["--parallel.dp_replicate=2", "--parallel.ep=2"],
    # two chunks: their all-to-alls overlapped with the experts (parallel/experts.py `overlapped`), FSDP gathering
    "fsdp2_ep2_chunks2": ["--parallel.dp_shard=2", "--parallel.ep=2", "--model.moe_overlap_chunks=2"],
    # token dropping: the kept assignments' count is data-dependent too (their nonzero: under dynamo's defaults a
    # second break); padded to capacity: equal splits, no counts to read (the kept assignments' break alone)
    "ep2_drop": ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.capacity_factor=1.0"],
    "ep2_pad": ["--parallel.dp_replicate=2", "--parallel.ep=2", "--model.capacity_factor=1.25",
                "--model.pad_to_capacity=true", "--model.drop_policy=position"],
    # expert tensor parallel (tp > 1 without sequence parallel): each tp rank holds half of every expert's hidden
    # units, its output all-reduced over tp and the gradients entering the experts all-reduced: traced in the graph
    "tp2_etp": ["--parallel.tp=2"],
}


FAST = {("ep2",)}     # the fast tier's case (one launch: 14 s on 2 cores at load 2.5); the others are slow


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """One torchrun launch of this file over the selected tests' cases: {case: rank 0's counts and comparisons}."""
    from ranks import crash_report, torchrun
    out = tmp_path_factory.mktemp("compiled_ep")
    cases = selected(request, "compiled", lambda item: item.callspec.params["case"])
    proc = torchrun(2, Path(__file__), out, json.dumps(cases), timeout=600,
                    env={"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")})   # private: no other run's entries
    assert proc.returncode == 0, crash_report(proc.stderr)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in cases}


@pytest.mark.parametrize("case", tiered([(c,) for c in CASES], FAST))
def test_an_expert_parallel_block_compiles_to_one_graph_equal_to_eager(compiled, case):
    """compile_block: no graph break, one graph (all-to-alls, the counts' read and the grouped GEMM inside), and its
    output and every gradient (the input's, the router's, the experts', the shared expert's) bitwise eager's."""
    got = compiled[case]
    assert got["traced"]["breaks"] == [], got["traced"]["breaks"]
    assert got["traced"]["graphs"] == 1
    assert got["equal"], got["differ"]


# The data-dependent values of an MoE layer, where dynamo's defaults break the graph: the split sizes' host read,
# and under token dropping the number of kept assignments (their nonzero; padded dispatch has no split sizes to read).
COUNT_READ = ("Data dependent operator", "moe.py", "host_counts")
KEPT = ("Dynamic shape operator", "moe.py", "kept_assignments")
INHERENT = {"ep2": {COUNT_READ}, "fsdp2_ep2_chunks2": {COUNT_READ}, "ep2_drop": {COUNT_READ, KEPT}, "ep2_pad": {KEPT},
            "tp2_etp": set()}     # no exchange under expert tensor parallel alone: no split sizes to read


@pytest.mark.parametrize("case", tiered([(c,) for c in CASES], FAST))
def test_under_dynamo_defaults_only_the_data_dependent_values_break(compiled, case):
    """Without TRACED_COUNTS every break is at a data-dependent value (INHERENT): the split sizes' host read
    (host_counts' .tolist()), the kept assignments' nonzero; no mesh size query, no DTensor.from_local, no
    repeat_interleave, no fake-tensor check, no Fraction breaks the block. Dynamo splits every frame on the stack at
    such a value, and their resumptions (torch 2.13, dropless: 10 breaks, 11 graphs)."""
    got = compiled[case]["default"]
    sites = {(b["reason"], b["file"], b["function"]) for b in got["breaks"]}
    assert sites == INHERENT[case], got["breaks"]
    assert got["break_count"] == got["graph_count"] - 1 >= len(INHERENT[case])


# ---------------------------------------------------------------- the ranks' side

def layer_inputs(cfg, params, par, model_cfg):
    """The first block's gathered parameters and inputs as the step hands them (a random residual stream)."""
    from torch.distributed.tensor import DTensor
    from nanomega.models.transformer import positions, units
    tokens, _ = par.batch(*parity.batches(cfg, 0)[0])
    name, p = next((n, p) for n, p in units(params, model_cfg) if n.startswith("layers."))
    B, T = tokens.to_local().shape
    x = torch.randn(B, T, model_cfg.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    gathered = par.unit_par.gather(name, p)
    return gathered, x, (DTensor.from_local(x, tokens.device_mesh, tokens.placements), tokens,
                         positions(tokens, model_cfg, x.dtype),
                         model_cfg.block_config(int(name.split(".")[1])))


def forward_backward(fn, p, x, args) -> list[torch.Tensor]:
    """The block's output and the gradients of a loss on it (output, router losses) to x and every parameter."""
    from torch.distributed.tensor import DTensor
    from nanomega.tree import tree_leaves
    y, stats = fn(p, *args)
    loss = y.to_local().square().sum() + stats.aux_loss.to_local() + stats.z_loss.to_local()
    leaves = [x] + [leaf for leaf in tree_leaves(p) if leaf.requires_grad]
    grads = torch.autograd.grad(loss, leaves)
    return [t.to_local() if isinstance(t, DTensor) else t for t in (y.detach(), *grads)]


def break_sites(explained) -> list[dict]:
    """Each graph break explain found: its reason's first line and the innermost frame it happened in."""
    return [{"reason": b.reason.splitlines()[0], "file": Path(b.user_stack[-1].filename).name,
             "function": b.user_stack[-1].name, "line": b.user_stack[-1].line} for b in explained.break_reasons]


def run_case(args: list[str]) -> dict:
    import train
    from torch._dynamo.utils import counters
    from nanomega.models.transformer import block
    from nanomega.parallel.experts import compile_block
    cfg = parse_args(parity.BASE + MOE + args)
    torch.manual_seed(cfg.train.seed)
    model_cfg, params, _, par = train.setup(cfg, torch.device("cpu"))
    with par.context():
        p, x, block_args = layer_inputs(cfg, params, par, model_cfg)
        eager = forward_backward(block, p, x, block_args)
        torch._dynamo.reset()
        counters.clear()
        got = forward_backward(compile_block(block, backend="aot_eager"), p, x, block_args)
        traced = {"breaks": [str(k).splitlines()[0] for k in counters["graph_break"]],
                  "graphs": counters["stats"]["unique_graphs"]}
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(p, *block_args)
    return {"traced": traced, "equal": all(torch.equal(a, b) for a, b in zip(got, eager)),
            "differ": [i for i, (a, b) in enumerate(zip(got, eager)) if not torch.equal(a, b)],
            "default": {"breaks": break_sites(explained), "break_count": explained.graph_break_count,
                        "graph_count": explained.graph_count}}


def main(out_dir: str, cases_json: str) -> None:
    torch.set_num_threads(1)
    for name in json.loads(cases_json):
        result = run_case(CASES[name])
        if torch.distributed.get_rank() == 0:
            (Path(out_dir) / f"{name}.json").write_text(json.dumps(result, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
