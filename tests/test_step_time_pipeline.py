"""The step-time model's pipelines (nanomega/sim/step_time.py: replay_pipeline, predict under parallel.pp) against
hand-computed timelines and references that do not use the replay.

- 1F1B with equal stages: the makespan (m + pp - 1)(F + B) and each rank idle (pp - 1) / (m + pp - 1) of it.
- An uneven stage dominates: its work back to back, plus the ramps in and out, worked out by hand below.
- Transfers: with equal stages and one transfer time, the replay's makespans are those of
  parallel/schedules.simulate (its own timeline code, with its t_comm), for 1F1B and interleaved 1F1B.
- The data-parallel reduction is launched as a stage's last backward ends and hidden by the cool-down up to the
  time the other ranks still work: a hand-computed pp = 2 timeline.
- predict: uneven stages (pp_layers, or n_layers that pp does not divide) are timed, each stage from its own
  blocks; the stages' work sums to the one-stage step's forward and backward.
"""
from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega.config import parse_args                           # noqa: E402
from nanomega.parallel import schedules                          # noqa: E402
from nanomega.sim.step_time import predict, replay_pipeline, time_step, trace  # noqa: E402
from nanomega.sim.devices import device                          # noqa: E402

TINY = ["--model.vocab_size=256", "--model.vocab_multiple=1", "--model.d_model=64", "--model.n_layers=4",
        "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=160", "--model.max_seq_len=64",
        "--train.batch_size=2", "--train.seq_len=64", "--train.compile=false"]


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 4), (3, 7)])
def test_1f1b_with_equal_stages_idles_the_textbook_bubble(pp, m):
    r = replay_pipeline(schedules.one_f_one_b(pp, m), schedules.stage_ranks(pp, 1), [1] * pp, [2] * pp)
    assert r.makespan == (m + pp - 1) * 3
    for rank in range(pp):
        assert (r.makespan - r.busy[rank]) / r.makespan == pytest.approx(float(Fraction(pp - 1, m + pp - 1)))


def test_an_uneven_stage_dominates_the_step():
    """1F1B, 4 stages, 8 micro-batches; stage 2 takes F 2, B 4, the others F 1, B 2. By hand: stage 2 starts when
    stages 0 and 1 have run F0 (t = 2); it runs F0, F1 (to 6), then waits for B0 of stage 3 (F0 there at 4-5, B0
    5-7): idle 1; from 7 it never waits again (each later input is ready before it is free), so it ends at
    2 + 8 x (2 + 4) + 1 = 51; stages 1 and 0 then run their last backward, 2 each: 55."""
    r = replay_pipeline(schedules.one_f_one_b(4, 8), schedules.stage_ranks(4, 1), [1, 1, 2, 1], [2, 2, 4, 2])
    assert r.spans[2][-1][1] == 51
    assert r.makespan == 55
    assert r.busy[2] == 48 and r.makespan - r.busy[2] == 7      # the slow rank idles only the ramps and one wait


@pytest.mark.parametrize("comm", [0.25, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)])
def test_transfers_delay_the_step_as_schedules_simulate_does(kind, v, comm):
    pp, m = 4, 8
    sched = schedules.SCHEDULES[kind](*((pp, m) + ((v,) if kind == "interleaved_1f1b" else ())))
    f, b = 1.0 / v, 2.0 / v
    r = replay_pipeline(sched, schedules.stage_ranks(pp, v), [f] * pp * v, [b] * pp * v, lambda src, dst: comm)
    reference = schedules.simulate(sched, t_f=f, t_b=b, t_comm=comm)
    assert r.makespan == pytest.approx(reference.makespan)
    free = replay_pipeline(sched, schedules.stage_ranks(pp, v), [f] * pp * v, [b] * pp * v)
    assert r.makespan > free.makespan                           # each transfer on the critical path costs


@pytest.mark.parametrize("reduce,ready", [([2.0, 2.0], {0: 11.0, 1: 9.0}), ([2.0, 3.0], {0: 11.0, 1: 10.0})])
def test_the_reduction_hides_in_the_cool_down(reduce, ready):
    """1F1B, pp 2, 2 micro-batches, F 1, B 2. Rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7; rank 0: F0 0-1, F1 1-2,
    B0 4-6 (after rank 1's B0), B1 7-9. Rank 1's reduction starts at 7: 2 s end at 9, hidden by rank 0's last
    backward; 3 s end at 10, one exposed. Rank 0's starts at 9."""
    r = replay_pipeline(schedules.one_f_one_b(2, 2), schedules.stage_ranks(2, 1), [1.0, 1.0], [2.0, 2.0],
                        None, reduce)
    assert r.makespan == 9.0
    assert r.ready == ready


def test_a_split_backward_is_refused_not_guessed():
    with pytest.raises(ValueError, match="split backward"):
        replay_pipeline(schedules.zb_v(2, 4), schedules.stage_ranks(2, 2, "v"), [1.0] * 4, [2.0] * 4)
    with pytest.raises(ValueError, match="zb_v is not timed yet"):
        predict(parse_args(TINY + ["--parallel.pp=2", "--parallel.pp_virtual=2", "--parallel.pp_schedule=zb_v",
                                   "--train.grad_accum=4"]))


def test_a_reduction_waited_by_the_update_is_the_pipelines_not_an_actions():
    """time_step's split for the replay: a collective launched in the backward and first waited by the update
    is the step-end reduction (its seconds apart, not in the actions); one waited by a backward op is inside it."""
    h100 = device("h100")
    op = ("matmul", 1e12, 0, True, frozenset(), False, "forward_backward", (), False)
    upd = ("pointwise", 0.0, 1e9, False, frozenset(), False, "update", (), False)
    sched = [{"kind": "all_reduce", "launched": 1, "waited": 3, "bytes_sent": 4e9, "ranks": [0, 8],
              "phase": "forward_backward"},
             {"kind": "all_gather", "launched": 0, "waited": 1, "bytes_sent": 1e9, "ranks": [0, 1],
              "phase": "forward_backward"}]
    r = time_step({"ops": [op, op, op, upd], "schedule": sched}, h100)
    pipe = r["pipe"]
    reduction = 4e9 / (50e9 * 0.80) + 20e-6
    assert pipe["reduce"] == {"all_reduce": pytest.approx(reduction)}
    gather_stall = r["exposed_s"]["all_gather"]
    assert gather_stall > 0 and pipe["exposed_in"] == {"all_gather": pytest.approx(gather_stall)}
    assert pipe["backward"] == pytest.approx(r["backward_s"] + gather_stall)
    assert pipe["update"] == pytest.approx(r["forward_s"])          # the update's one op (not in a backward)


def _stages(r):
    return r["pipeline"]["forward_s"], r["pipeline"]["backward_s"]


def test_uneven_stages_are_timed_each_from_its_own_blocks():
    """pp 2 over 5 blocks (the runtime's even split: 3 and 2), and pp_layers 1,4: each stage's forward and
    backward; the two stages' backwards, times the micro-batches, are the one-stage step's (the same ops)."""
    m = 4
    whole = time_step(trace(parse_args(TINY + ["--model.n_layers=5", f"--train.grad_accum={m}"])), device("h100"))
    even = predict(parse_args(TINY + ["--model.n_layers=5", "--parallel.pp=2", f"--train.grad_accum={m}"]))
    skewed = predict(parse_args(TINY + ["--model.n_layers=5", "--parallel.pp=2", "--parallel.pp_layers=1,4",
                                        f"--train.grad_accum={m}"]))
    for r in (even, skewed):
        assert m * sum(_stages(r)[1]) == pytest.approx(whole["backward_s"], rel=1e-6)
    # moving two blocks from stage 0 to stage 1 moves their time: a block's forward is (even - skewed) / 2
    block_f = (_stages(even)[0][0] - _stages(skewed)[0][0]) / 2
    assert block_f > 0
    assert _stages(skewed)[0][1] - _stages(even)[0][1] == pytest.approx(2 * block_f, rel=1e-6)
    assert skewed["step_s"] > even["step_s"]                    # the busier last stage sets the pace


def test_bad_pp_layers_are_refused_before_any_trace():
    with pytest.raises(ValueError, match="must give 2 stages"):
        predict(parse_args(TINY + ["--parallel.pp=2", "--parallel.pp_layers=4,1", "--train.grad_accum=2"]))


@pytest.mark.parametrize("ranks,reduction", [([0, 8, 16, 24], True), ([0, 1], False)])
def test_a_data_parallel_reduction_waited_in_the_last_backward_is_the_step_end_reduction(ranks, reduction):
    """The code may wait for a reduction's last bucket inside the last backward (the embedding's, launched as its
    gradient is made): over the data-parallel ranks it is the step-end reduction all the same (a pipeline stage
    waits for it as its last backward ends); a tensor-parallel one there stays inside the action."""
    h100 = device("h100")
    fwd = ("matmul", 1e12, 0, False, frozenset(), False, "forward_backward", (), False)
    bwd = fwd[:3] + (True,) + fwd[4:]
    sched = [{"kind": "reduce_scatter", "launched": 2, "waited": 3, "bytes_sent": 4e9, "ranks": ranks,
              "phase": "forward_backward"}]
    r = time_step({"ops": [fwd, bwd, bwd, bwd], "schedule": sched}, h100, data_parallel=frozenset([0, 8, 16, 24]))
    assert bool(r["pipe"]["reduce"]) is reduction
    assert bool(r["pipe"]["exposed_in"]) is not reduction
