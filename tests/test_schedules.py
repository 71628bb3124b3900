"""Pipeline schedules as data (parallel/schedules.py): complete, deadlock-free, and as fast as the
literature says, checked by running each rank's list in a simulation. No processes, no tensors."""
from __future__ import annotations

from fractions import Fraction

import pytest

from nanomega.parallel.schedules import (Action, Transfer, check_blocking, gpipe, interleaved_1f1b, one_f_one_b,
                                         p2p_program, peak_in_flight, render, sends, simulate, stage_ranks,
                                         theoretical_bubble, validate, zb_v)


def _layouts(pp, m):
    """(name, schedule, v, placement) of every schedule that applies to pp ranks and m micro-batches."""
    yield "gpipe", gpipe(pp, m), 1, stage_ranks(pp, 1)
    yield "1f1b", one_f_one_b(pp, m), 1, stage_ranks(pp, 1)
    for v in (1, 2):
        yield "interleaved_1f1b", interleaved_1f1b(pp, m, v), v, stage_ranks(pp, v, "loop")
    yield "zb_v", zb_v(pp, m), 2, stage_ranks(pp, 2, "v")


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_schedule_is_complete_and_runs_to_the_end_without_deadlock(pp, k):
    m = k * pp
    for name, sched, v, placement in _layouts(pp, m):
        validate(sched, m, placement)
        kinds = {a.kind for ops in sched.values() for a in ops}
        assert kinds == ({"F", "I", "W"} if name == "zb_v" else {"F", "B"}), name


def test_placements_put_stages_where_the_schedules_expect_them():
    assert stage_ranks(4, 2, "loop") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_ranks(4, 2, "v") == [0, 1, 2, 3, 3, 2, 1, 0]      # rank r: stages r and 2pp-1-r
    assert stage_ranks(3, 1) == [0, 1, 2]


def test_impossible_inputs_raise_naming_the_config_field_to_change():
    with pytest.raises(ValueError, match=r"train.grad_accum \(m=6\) divisible by parallel.pp \(4\); "
                                         r"use m in \{4, 8, 12\}"):
        interleaved_1f1b(4, 6, 2)
    assert interleaved_1f1b(4, 6, 1) == one_f_one_b(4, 6)          # v = 1 is plain 1F1B: any m
    with pytest.raises(ValueError, match=r"exactly 2 stages per rank; set parallel.pp_virtual=2 \(got 3\)"):
        stage_ranks(4, 3, "v")
    with pytest.raises(ValueError, match=r"unknown stage placement 'zigzag'; use 'loop' or 'v'"):
        stage_ranks(4, 2, "zigzag")
    with pytest.raises(ValueError, match=r"unknown schedule 'pipedream'"):
        theoretical_bubble("pipedream", 4, 8)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("t_b", [1, 2, 3])
def test_1f1b_bubble_is_pp_minus_1_over_m_plus_pp_minus_1_exactly(pp, t_b):
    """By hand (t_comm = 0): the last rank gets its first input after pp-1 forwards, (pp-1) t_f. From
    then on it never waits: its next forward was sent by rank pp-2 before that rank's backward (which
    waits on the last rank) in rank pp-2's list. It so finishes at (pp-1) t_f + m (t_f + t_b), and the
    last backward walks back over pp-1 ranks: makespan (m+pp-1)(t_f+t_b). Every rank computes
    m (t_f + t_b), so each idles (pp-1)(t_f+t_b): bubble (pp-1)/(m+pp-1), whatever t_b (the brief's
    t_b = 2 t_f included). m < pp works too: the warm-up is cut and it is GPipe."""
    for m in range(1, 3 * pp + 1):
        t = simulate(one_f_one_b(pp, m), t_f=1, t_b=t_b)
        assert t.makespan == (m + pp - 1) * (1 + t_b)
        assert set(t.busy.values()) == {m * (1 + t_b)}
        assert t.bubble == Fraction(pp - 1, m + pp - 1) == theoretical_bubble("1f1b", pp, m)


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_gpipe_bubble_equals_1f1bs_and_communication_only_lengthens_its_two_ramps(pp):
    """By hand: the forwards are a pipeline of m items over pp ranks, (m+pp-1) t_f; the backwards
    start on the last rank right after its last forward and are the same pipeline mirrored,
    (m+pp-1) t_b. With a transfer time, only the first forward and the last backward wait for one
    crossing per rank boundary, 2 (pp-1) t_comm: every other transfer happens during computation."""
    for m in range(1, 3 * pp + 1):
        assert simulate(gpipe(pp, m)).bubble == Fraction(pp - 1, m + pp - 1) == theoretical_bubble("gpipe", pp, m)
        assert simulate(gpipe(pp, m), t_comm=2).makespan == (m + pp - 1) * 3 + 2 * (pp - 1) * 2
    # 1F1B's steady state cannot hide it: the last rank waits for its next forward, which rank pp-2
    # runs only after that rank's backward, itself waiting for the last rank's (a round trip)
    if pp > 1:
        assert simulate(one_f_one_b(pp, 2 * pp), t_comm=2).makespan > (3 * pp - 1) * 3 + 2 * (pp - 1) * 2


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_warm_up_hides_transfers_up_to_a_forward_long(pp, v):
    """Megatron's extra pp-r-1 warm-up forwards mean each steady forward's input was sent a step
    before it is needed: with t_comm <= t_f only the first forward and the last backward wait, one
    crossing per stage boundary each, 2 (v pp - 1) t_comm. (1F1B pays every step: test above.)"""
    for m in (pp, 2 * pp, 4 * pp):
        sched = interleaved_1f1b(pp, m, v)
        base = simulate(sched).makespan
        for t_comm in (Fraction(1, 4), Fraction(1, 2), 1):
            assert simulate(sched, t_comm=t_comm).makespan == base + 2 * (v * pp - 1) * t_comm
        if m > pp:       # longer transfers show in the steady state (with m = pp there is none)
            assert simulate(sched, t_comm=3).makespan > base + 2 * (v * pp - 1) * 3


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaving_divides_the_idle_time_by_v(pp, v):
    """Megatron (Narayanan et al. 2021) gives the bubble as idle over busy time: (1/v)(pp-1)/m for
    interleaved, (pp-1)/m for 1F1B. Measured here exactly so, hence as the idle share of the step
    (pp-1)/(v m + pp-1): each ramp crosses pp stages of 1/v of a rank's work, not pp ranks' worth."""
    for m in (pp, 2 * pp, 3 * pp):
        t = simulate(interleaved_1f1b(pp, m, v))                 # stages of t_f = 1, t_b = 2
        idle_over_busy = t.bubble / (1 - t.bubble)
        plain = simulate(one_f_one_b(pp, m)).bubble
        assert idle_over_busy == Fraction(pp - 1, m) / v == plain / (1 - plain) / v
        assert t.bubble == Fraction(pp - 1, v * m + pp - 1) == theoretical_bubble("interleaved_1f1b", pp, m, v)


def test_zb_v_leaves_only_the_unavoidable_ramp_pp4_m8_bubble_1_over_17():
    """ZB-V, pp=4, m=8, t_f = t_i = t_w = 1 (per stage; a rank holds 2 stages): each rank computes
    2 stages x 8 micro-batches x (F + I + W) = 48. The last rank's first input crosses 3 ranks, so it
    starts at 3 and cannot finish before 51; rank 0 runs the first action (F0 of stage 0) and the
    last (W of stage 0). ZB-V reaches that bound: makespan 51, every rank idle 3 (rank r: r at the
    start, 3-r at the end), bubble 12 / (4 x 51) = 1/17 ~ 0.059, against 1F1B's 3/11 ~ 0.27. The
    paper's "zero" lets the next step fill those ramps (no optimizer barrier: post-validation)."""
    t = simulate(zb_v(4, 8), t_f=1, t_i=1, t_w=1)
    assert t.makespan == 51 and set(t.busy.values()) == {48}
    assert [spans[0][0] for spans in t.spans.values()] == [0, 1, 2, 3]
    assert [t.makespan - spans[-1][1] for spans in t.spans.values()] == [3, 2, 1, 0]
    assert t.bubble == Fraction(1, 17) == theoretical_bubble("zb_v", 4, 8)
    assert simulate(one_f_one_b(4, 8)).bubble == Fraction(3, 11)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6, 8])
def test_zb_v_reaches_its_lower_bound_once_the_v_is_full(pp):
    """(pp-1)/(6m+pp-1) bounds the bubble of any schedule on the V placement with a step barrier
    (previous test); ZB-V meets it from 2m >= 3pp-1 micro-batches on, and stays above it for fewer,
    where its pattern, built for 2pp-1 micro-batches, has holes."""
    for m in range(1, 3 * pp + 1):
        bubble, bound = simulate(zb_v(pp, m)).bubble, theoretical_bubble("zb_v", pp, m)
        assert bubble == bound if 2 * m >= 3 * pp - 1 else bubble > bound
        assert bubble < simulate(one_f_one_b(pp, m)).bubble or pp == 1


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
def test_in_flight_forwards_1f1b_min_pp_minus_rank_and_m_gpipe_m_zb_v_2pp_half_stages(pp):
    for m in range(1, 3 * pp + 1):
        assert peak_in_flight(one_f_one_b(pp, m)) == {r: min(pp - r, m) for r in range(pp)}
        assert peak_in_flight(gpipe(pp, m)) == {r: m for r in range(pp)}
    # ZB-V: 2pp stages of half a rank's layers on every rank: 1F1B's rank-0 memory, on all ranks
    assert peak_in_flight(zb_v(pp, 2 * pp)) == {r: 2 * pp for r in range(pp)}


def _edited(sched, rank, fn):
    out = {r: list(ops) for r, ops in sched.items()}
    out[rank] = fn(out[rank])
    return out


def _swap(i, j):
    def fn(ops):
        ops[i], ops[j] = ops[j], ops[i]
        return ops
    return fn


def test_validate_names_an_action_run_before_its_own_input():
    sched = _edited(one_f_one_b(4, 8), 3, _swap(0, 1))     # last rank: B0 before F0
    with pytest.raises(ValueError, match=r"deadlocks.*rank 3 at #0 B0@s3 waits for F0@s3"):
        validate(sched, 8, stage_ranks(4, 1))
    sched = _edited(zb_v(2, 4), 1, lambda ops: [a for a in ops if a != Action("W", 2, 3)] + [Action("W", 2, 3)])
    validate(sched, 4, stage_ranks(2, 2, "v"))            # a W moved later is still fine
    i = sched[1].index(Action("I", 2, 3))
    sched[1].insert(i, sched[1].pop())                          # ... but not before its I
    with pytest.raises(ValueError, match=r"rank 1 at #\d+ W3@s2 waits for I3@s2"):
        validate(sched, 4, stage_ranks(2, 2, "v"))


def test_validate_names_both_sides_of_a_deadlock_across_ranks():
    """Rank 0 waits for backward 0 before sending forward 1; rank 1 wants forward 1 before it runs
    backward 0: each waits for the other."""
    sched = one_f_one_b(2, 4)                # rank 0: F0 F1 B0 ..., rank 1: F0 B0 F1 ...
    sched = _edited(_edited(sched, 0, _swap(1, 2)), 1, _swap(1, 2))
    with pytest.raises(ValueError, match=r"rank 0 at #1 B0@s0 waits for B0/I0@s1; "
                                         r"rank 1 at #1 F1@s1 waits for F1@s0"):
        validate(sched, 4, stage_ranks(2, 1))


def test_validate_names_a_missing_a_doubled_and_a_misplaced_action():
    placement = stage_ranks(2, 2, "v")
    missing = _edited(zb_v(2, 4), 0, lambda ops: [a for a in ops if a != Action("W", 3, 1)])
    with pytest.raises(ValueError, match=r"stage 3, micro-batch 1 has \['F', 'I'\]; it needs F and B, or F, I and W"):
        validate(missing, 4, placement)
    doubled = _edited(gpipe(2, 4), 1, lambda ops: ops + [Action("B", 1, 2)])
    with pytest.raises(ValueError, match=r"rank 1 #8 B2@s1: a second B of stage 1, micro-batch 2 "
                                         r"\(the first is rank 1 #6 B2@s1\)"):
        validate(doubled, 4, stage_ranks(2, 1))
    moved = _edited(zb_v(2, 4), 0, lambda ops: ops + [Action("F", 1, 0)])
    with pytest.raises(ValueError, match=r"rank 0 #\d+ F0@s1: stage 1 is placed on rank 1, not rank 0"):
        validate(moved, 4, placement)
    with pytest.raises(ValueError, match=r"schedule has ranks \[0, 1\], expected 0..3 \(parallel.pp=4\)"):
        validate(gpipe(2, 4), 4, stage_ranks(4, 1))


def test_render_lists_each_ranks_order_and_draws_the_simulated_time_grid():
    """1F1B, pp=2, m=2, t_f=1, t_b=2, by hand: rank 0 runs F0 [0,1], F1 [1,2]; rank 1 F0 [1,2],
    B0 [2,4], F1 [4,5], B1 [5,7]; rank 0's B0 waits for rank 1's: [4,6], B1 [7,9]. Each rank computes
    6 of 9: bubble 1/3 = (pp-1)/(m+pp-1)."""
    sched = one_f_one_b(2, 2)
    assert render(sched) == "rank 0: F0 F1 B0 B1\nrank 1: F0 B0 F1 B1"
    t = simulate(sched)
    assert render(sched, t) == ("rank 0: F0 F1 .. .. B0 -- .. B1 --\n"
                                "rank 1: .. F0 B0 -- F1 B1 -- .. ..")
    assert t.bubble == Fraction(1, 3)
    assert render(zb_v(2, 2)).splitlines()[1].startswith("rank 1: F0@s1 F0@s2 F1@s1")   # several stages: @s
    assert isinstance(simulate(sched, t_f=0.5, t_b=1.0).bubble, float)


# ---------------------------------------------------------------- point-to-point under NCCL's contract

@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_schedules_transfers_complete_when_a_send_blocks_until_its_receive_is_posted(pp, k):
    m = k * pp
    for name, sched, v, placement in _layouts(pp, m):
        program = p2p_program(sched, placement)
        check_blocking(program)
        # every transfer the placement implies is posted once by each side, and before its consumer runs
        for r, items in program.items():
            seen = set()
            for item in items:
                if isinstance(item, list):
                    seen |= {(t.op, t.what, t.stage, t.micro) for t in item}
                    continue
                assert all((t.op, t.what, t.stage, t.micro) in seen for t in _receives(item, r, placement)), \
                    (name, r, item)
            expected = {(t.op, t.what, t.stage, t.micro) for a in sched[r]
                        for t in sends(a, r, placement) + _receives(a, r, placement)}
            assert seen == expected, (name, r)


def _receives(a, rank, placement):
    """What `a` receives before it runs on `rank`: the input of F from stage - 1, the output's gradient of
    B or I from stage + 1, where that stage sits on another rank (the mirror of schedules.sends)."""
    s, last = a.stage, len(placement) - 1
    if a.kind == "F" and s > 0 and placement[s - 1] != rank:
        return [Transfer("recv", placement[s - 1], "act", s, a.micro)]
    if a.kind in ("B", "I") and s < last and placement[s + 1] != rank:
        return [Transfer("recv", placement[s + 1], "grad", s, a.micro)]
    return []


def _each_alone(schedule, placement):
    """The executor before batching: each receive posted alone just before its action, each send just after."""
    programs = {}
    for r, ops in schedule.items():
        programs[r] = []
        for a in ops:
            programs[r] += [[t] for t in _receives(a, r, placement)] + [a] + [[t] for t in sends(a, r, placement)]
    return programs


def test_posting_each_send_alone_deadlocks_1f1b_as_nccl_would():
    """Rank 0 blocks sending F1's output while rank 1 blocks sending B0's gradient."""
    program = _each_alone(one_f_one_b(2, 2), stage_ranks(2, 1))
    with pytest.raises(ValueError, match=r"deadlock .*rank 0 at batch #1 \[send act1@s1 to rank 1\]; "
                                         r"rank 1 at batch #1 \[send grad0@s0 to rank 0\]"):
        check_blocking(program)
    check_blocking(_each_alone(gpipe(2, 2), stage_ranks(2, 1)))   # GPipe's order happens to be safe


def test_transfers_between_two_ranks_must_be_received_in_the_order_they_are_sent():
    """NCCL has no tags: the k-th send from a to b fills the k-th receive of b from a."""
    send = [Transfer("send", 1, "act", 1, 0), Transfer("send", 1, "act", 1, 1)]
    recv = [Transfer("recv", 0, "act", 1, 1), Transfer("recv", 0, "act", 1, 0)]
    with pytest.raises(ValueError, match=r"transfer #0 from rank 0 to rank 1: rank 0 sends send act0@s1 to rank 1 "
                                         r"but rank 1 receives recv act1@s1 from rank 0"):
        check_blocking({0: [send], 1: [recv]})
    check_blocking({0: [send], 1: [recv[::-1]]})
