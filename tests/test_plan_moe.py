"""The layout search's pruning rules (nanomega/sim/plan.py) and its refusal of an MoE plan no layout divides.

- Refusal: a GPU count that no layout of a mixture of experts divides is refused before any memory count or
  simulation, naming the nearest counts that work (found by the same structural check, independently re-checked).
- Context parallel is searched only from long sequences (cut 1).
- The analytic bound that skips layouts (cut 3) never exceeds the simulated step of the same layout.
- The first recomputation simulated (cut 5) is ordered as recomputation orders memory: none > selective > full.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                # noqa: E402
from nanomega.parallel import schedules               # noqa: E402
from nanomega.parallel.mesh import model_config       # noqa: E402
from nanomega.sim import plan                         # noqa: E402
from nanomega.sim.counting import count_params, flops_per_token   # noqa: E402
from nanomega.sim.devices import Efficiency, device   # noqa: E402
from nanomega.sim.step_time import predict            # noqa: E402

MOE = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=2",
       "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
       "--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_dim=96", "--train.compile=false",
       "--train.seq_len=64"]


def _no_work(*args, **kwargs):
    raise AssertionError("a bad request must be refused before any memory count or simulation")


def test_an_moe_plan_for_a_gpu_count_no_layout_divides_is_refused_with_the_counts_that_work(monkeypatch):
    """2 sequences on 3 GPUs: 4 heads and 2 blocks allow no tp or pp of 3, and 3 data-parallel ranks cannot share
    2 sequences; 2 and 4 GPUs can hold the same batch."""
    monkeypatch.setattr("nanomega.sim.step_time.predict", _no_work)
    monkeypatch.setattr("nanomega.sim.rank_bytes.bytes_per_rank", _no_work)
    with pytest.raises(ValueError, match=r"no layout divides 3 GPUs for this model and batch: .*ep must divide the 4 "
                                         r"experts.* \(the nearest: 2 or 4\)"):
        plan.plan(MOE, gpus=3, seq_len=64, global_batch_tokens=128)
    m = parse_args(MOE).model
    for n, works in ((2, True), (3, False), (4, True)):
        assert bool(plan.structural_layouts(MOE, m, n, 2, 64)) is works


def test_context_parallel_is_searched_only_from_long_sequences():
    m = parse_args(MOE).model
    short = plan.structural_layouts(MOE, m, 2, 4, 64)
    assert short and all(c.cp == 1 for c, _, _ in short)
    assert any(c.cp == 2 for c, _, _ in plan.structural_layouts(MOE, m, 2, 4, 64, cp_from=64))


@pytest.mark.parametrize("layout", ["--parallel.dp_shard=2", "--parallel.ep=2 --parallel.dp_shard=2"])
def test_the_analytic_bound_never_exceeds_the_simulated_step(layout):
    """Cut 3 skips a layout whose bound exceeds the top-th simulated step: sound only if the bound is a lower
    bound of what the simulation would predict."""
    flags = MOE + layout.split() + ["--train.batch_size=4", "--train.seq_len=64", "--train.grad_accum=1",
                                    "--train.activation_checkpointing=none"]
    cfg = parse_args(flags)
    c = plan.Candidate(tp=1, pp=1, schedule="", virtual=1, dp_replicate=1, dp_shard=2, micro=2, recompute="none",
                       ep=cfg.parallel.ep)
    dev, eff = device("h100"), Efficiency()
    mc = model_config(cfg)
    est = plan.analytic(c, cfg.model, 64, 4, 2, flops_per_token(mc, 64), dev, eff, False, count_params(mc), 0.0)
    simulated = predict(cfg, "h100")
    assert est["bound"] <= simulated["step_s"]
    assert est["bound"] <= est["step_s"]


def test_the_first_recomputation_tried_follows_memory():
    m = parse_args(["--config=mixtral_8x7b"]).model
    c = plan.Candidate(tp=2, pp=1, schedule="", virtual=1, dp_replicate=1, dp_shard=8, micro=1, recompute="none")
    guess = {r: plan.activation_guess(c, m, 4096, r) for r in plan.RECOMPUTE}
    assert guess["none"] > guess["selective"] > guess["full"] > 0
    # a pipeline's first stage keeps pp micro-batches in flight: pp 2 holds half the blocks twice
    staged = plan.activation_guess(plan.Candidate(2, 2, "1f1b", 1, 1, 4, 1, "none"), m, 4096, "none")
    assert staged == pytest.approx(guess["none"])
    assert schedules.theoretical_bubble("1f1b", 2, 8) > 0


def test_the_same_failure_on_three_layouts_stops_the_search_and_names_it(monkeypatch):
    """A failure that is the code's (here injected: every simulation raises as a broken import would) stops the
    search after three simulations, not after --max_simulations, and the error names it."""
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("simulating rank 0: AttributeError: 'ModelConfig' object has no attribute 'x'")
    monkeypatch.setattr("nanomega.sim.step_time.predict", broken)
    with pytest.raises(ValueError, match=r"failed on every layout tried \(3\).*no attribute 'x'"):
        plan.plan(MOE, gpus=2, seq_len=64, global_batch_tokens=256, max_simulations=16)
    assert len(calls) == 3
