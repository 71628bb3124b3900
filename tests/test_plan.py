"""The layout search (nanomega/sim/plan.py): its top choice fits and is faster than layouts known to be worse; bad
requests get an error that says what to change, before any simulation."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.sim import plan                     # noqa: E402
from nanomega.config import parse_args        # noqa: E402
from nanomega.sim.step_time import predict        # noqa: E402
from tiers import slow                        # noqa: E402

TINY = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
        "--train.compile=false"]


def _no_simulation(*args, **kwargs):
    raise AssertionError("a bad request must be refused before any simulation")


def test_an_unknown_gpu_is_refused(monkeypatch):
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_simulation)
    with pytest.raises(ValueError, match=r"unknown GPU 'v100'; choose one of \['a100', 'b200', 'h100'"):
        plan.plan(TINY, gpus=2, gpu="v100")


def test_a_gpu_count_no_layout_divides_is_refused(monkeypatch):
    """3 GPUs, 2 sequences a step, 4 heads and 2 blocks: no data, tensor or pipeline split of 3 exists."""
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_simulation)
    with pytest.raises(ValueError, match="no layout divides 3 GPUs for this model and batch"):
        plan.plan(TINY, gpus=3, seq_len=64, global_batch_tokens=128)


def test_a_model_that_fits_no_layout_is_refused(monkeypatch):
    """70B parameters with fp32 master weights, gradients and AdamW moments (16 B each) on one 80 GB GPU."""
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_simulation)
    with pytest.raises(ValueError, match="with their gradients and optimizer state, hold 1,051 GiB: more than 1 "
                                         "H100 SXM GPUs of 67 GiB hold even fully sharded; .* plan for at least 16"):
        plan.plan(["--config=llama3_70b"], gpus=1, gpu="h100", seq_len=8192)


def test_too_few_gpus_for_the_held_bytes_are_refused_with_the_count_that_holds_them(monkeypatch):
    """megatron_1t's 1.008T parameters hold 15,021 GiB with fp32 gradients and AdamW state: 64 H100 cannot hold
    them under any sharding; the refusal names the least count that can (held bytes over the budget), before any
    layout's bytes are counted."""
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_simulation)
    from nanomega.sim.rank_bytes import bytes_per_rank
    held = bytes_per_rank(parse_args(["--config=megatron_1t"])).total
    least = int(-(-held // (80e9 * (1 - plan.MARGIN))))
    with pytest.raises(ValueError, match=f"plan for at least {least} GPUs"):
        plan.plan(["--config=megatron_1t"], gpus=64, gpu="h100")


def test_a_model_no_gpu_count_holds_is_refused(monkeypatch):
    """A block of d_model 196,608 is 12 d^2 = 464B parameters: 108 GiB in bf16 per GPU even over tensor parallel 8,
    beyond an A100's 67 GiB budget, and no GPU count helps (FSDP gathers a whole block for compute)."""
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_simulation)
    monkeypatch.setattr(plan, "structural_layouts", _no_simulation)
    wide = ["--config=megatron_1t", "--model.d_model=196608", "--model.n_heads=768"]
    with pytest.raises(ValueError, match="no GPU count holds this model on A100 80GB SXM: one block has 464B "
                                         "parameters.*use a smaller model.d_model or a GPU with more memory"):
        plan.plan(wide, gpus=4096, gpu="a100")


def test_context_parallel_is_searched_where_the_sequence_splits_in_balanced_chunks():
    """context.py's load balancing cuts the sequence in 2 x cp chunks: 24 tokens allow cp 1, 2 and 4 of 8 GPUs (48 /
    2 / 4 chunks of 12 / 6 / 3 tokens), not 8 (16 chunks); both methods are searched, and no sequence, no cp."""
    found = plan.layouts(8, 4, 8, seq_len=24)
    assert {c.cp for c in found} == {1, 2, 4}
    assert {c.cp_method for c in found if c.cp > 1} == {"all_gather", "ring"}
    assert all(c.tp * c.pp * c.cp * c.dp_replicate * c.dp_shard == 8 for c in found)
    assert {c.cp for c in plan.layouts(8, 4, 8)} == {1}
    assert {c.cp_method for c in plan.layouts(8, 4, 8, seq_len=24, cp_methods=("ring",)) if c.cp > 1} == {"ring"}


def test_expert_parallel_is_searched_over_the_divisors_of_the_experts():
    """6 experts on 8 GPUs: ep 1, 2, 3 and 6 are candidates (validate_layout later keeps those dividing the ranks
    that hold different tokens); a dense model keeps ep 1."""
    assert {c.ep for c in plan.layouts(8, 4, 8, n_experts=6)} == {1, 2, 3, 6}
    assert {c.ep for c in plan.layouts(8, 4, 8, n_experts=0)} == {1}


@slow   # ~20 s: every layout of 2 GPUs simulated
def test_the_top_choice_fits_and_beats_worse_layouts():
    result = plan.plan(TINY, gpus=2, gpu="h100", seq_len=64, global_batch_tokens=256, top=3)
    best = result["best"][0]
    assert best["peak_bytes"] <= 80e9 * (1 - plan.MARGIN)
    assert [r["step_s"] for r in result["best"]] == sorted(r["step_s"] for r in result["best"])
    # the same layout recomputing every block does strictly more work: the search must not prefer it
    worse = parse_args(TINY + [f for f in best["flags"] if "activation_checkpointing" not in f]
                       + ["--train.activation_checkpointing=full"])
    assert predict(worse, "h100")["step_s"] > best["step_s"]


@slow   # 3 and 5.5 min on a loaded 2-core machine: every layout of 2 GPUs with cp and ep simulated (~40 each)
@pytest.mark.parametrize("extra, key, value", [
    ([], "cp", 2),                                                     # a dense model: context parallel searched
    (["--model.n_experts=4", "--model.top_k=2"], "ep", 2),             # a mixture of experts: expert parallel too
])
def test_context_and_expert_parallel_layouts_are_simulated_and_ranked_by_the_model(extra, key, value):
    """Every layout simulated is ranked by its own prediction: the top choice is no slower than the cp 2 (or ep 2)
    layout and the plain FSDP 2 layout, each predicted directly with the flags the planner reports."""
    result = plan.plan(TINY + extra, gpus=2, gpu="h100", seq_len=64, global_batch_tokens=128, top=40,
                       max_simulations=60, cp_methods=("all_gather",), cp_from=0)
    best = result["best"][0]
    assert best["peak_bytes"] <= 80e9 * (1 - plan.MARGIN)
    searched = [r for r in result["best"] if getattr(r["layout"], key) == value]
    assert searched, f"no {key}={value} layout was ranked"
    for r in (searched[0], next(r for r in result["best"] if r["layout"].dp_shard == 2 and r["layout"].cp == 1
                                and r["layout"].ep == 1)):
        again = predict(parse_args(TINY + extra + r["flags"]), "h100")
        assert again["step_s"] == pytest.approx(r["step_s"], rel=1e-9)
        assert best["step_s"] <= again["step_s"]


def test_pipelines_the_code_refuses_for_a_model_are_named_not_silently_dropped():
    """megatron_1t ties its output layer to the embedding, which the pipeline refuses (parallel/mesh.py): the search
    keeps only unpipelined layouts and records why, once per reason, for the plan's notes; untied, pipelines
    (stages as even as possible where pp does not divide the 128 blocks) are searched."""
    base = ["--config=megatron_1t", "--train.seq_len=2048"]
    refused: dict = {}
    found = plan.structural_layouts(base, parse_args(base).model, 64, 128, 2048, refused=refused)
    assert found and all(c.pp == 1 for c, _, _ in found)
    assert any("model.tie_embeddings=true" in reason for reason in refused)
    untied = base + ["--model.tie_embeddings=false"]
    pipelined = {c.pp for c, _, _ in plan.structural_layouts(untied, parse_args(untied).model, 64, 128, 2048)}
    assert {2, 4, 8, 16, 32, 64} <= pipelined
    assert plan.layouts(48, 126, 8) and {c.pp for c in plan.layouts(48, 126, 8)} >= {16, 48}   # 126 blocks: uneven
