"""Pipeline schedules as data: for each pipeline rank, the list of actions it runs, in order.

One idea: the schedules, and the checks and timings that read the same lists (completeness,
deadlock freedom with and without blocking sends, the bubble), so that what is checked is what runs.

    sched = one_f_one_b(pp=4, m=8)         # {rank: [Action("F", 0, 0), Action("F", 0, 1), ...]}
    validate(sched, 8, stage_ranks(4, 1, "loop"))
    simulate(sched).bubble                 # Fraction(3, 11): the idle share of the step
    print(render(sched))                   # rank 0: F0 F1 F2 F3 B0 F4 B1 ...

The model is cut into pp * v contiguous slices of its units, the *virtual stages* 0 .. pp*v-1 (stage
s feeds stage s+1); `stage_ranks` says which pipeline rank holds each. A schedule says, per rank,
in which order that rank runs the forward and backward of its stages on each of the m micro-batches
(train.grad_accum; pp, v and m are checked with the config: parallel/mesh.validate_layout). Nothing
here touches a process group or a tensor: the executor (parallel/pipeline.py) walks its rank's list.
This is torch.distributed.pipelining's schedule IR, kept compute-only.

Action kinds:
    F   forward of `stage` on micro-batch `micro` (the last stage also computes the loss)
    B   its whole backward: the input's gradient (for stage - 1) and the weights' gradients
    I   the input's gradient only: all the previous stage waits for
    W   the weights' gradients only: needed by nobody until the optimizer step, so it can fill a bubble
A (stage, micro) is either B, or I then W (Zero Bubble, Qi et al. 2024, splits B to move W around).

Communication is not written as actions. Who sends what to whom follows from the placement: F of
stage s produces the input of F of s+1; B or I of s+1 produces the output gradient of B or I of s;
when the two stages sit on different ranks the producer sends and the consumer receives before it
runs (`sends`; torch's pipelining adds the same SEND/RECV actions mechanically, in a lowering
pass). One dependency rule serves validation, the deadlock check and the timing.

How the executor posts them matters on NCCL, where a send may block until its receive is posted and transfers
between two ranks are matched in order (NCCL has no tags). Posting each send on its own deadlocks 1F1B with pp = 2
and two micro-batches once messages are large (tests/test_schedules.py): rank 0 blocks sending F1's output while
rank 1 blocks sending B0's gradient, each waiting for the other to receive. So transfers go out in batches
(dist.batch_isend_irecv, NCCL's group call) posted in lockstep with the peers' (`p2p_program`): Megatron's
send_forward_recv_backward, derived instead of hand-written. `check_blocking` proves a program completes under
blocking sends and in-order matching, or names the ranks that wait on each other.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from fractions import Fraction
from itertools import accumulate
from typing import NamedTuple


class Action(NamedTuple):
    kind: str      # "F", "B", "I" or "W" (module doc)
    stage: int     # virtual stage, 0 .. pp*v - 1
    micro: int     # micro-batch, 0 .. m - 1

    def __str__(self):
        return f"{self.kind}{self.micro}@s{self.stage}"


KINDS = ("F", "B", "I", "W")


def stage_ranks(pp: int, v: int, style: str = "loop") -> list[int]:
    """The rank holding each virtual stage: [rank of stage 0, rank of stage 1, ...].

    "loop": stage s on rank s % pp, so the model wraps around the ranks v times (Megatron's
    interleaved schedule). "v": two stages per rank, rank r holding r and 2*pp-1-r, so the forward
    runs down the ranks and back up (ZB-V, DualPipeV): the first and the last stage (embedding and
    loss) share rank 0, and each rank's two stages hand each other their activations without a send.
    """
    if style == "loop":
        return [s % pp for s in range(pp * v)]
    if style == "v":
        if v != 2:
            raise ValueError(f"the V placement holds exactly 2 stages per rank; set parallel.pp_virtual=2 (got {v})")
        return [s if s < pp else 2 * pp - 1 - s for s in range(2 * pp)]
    raise ValueError(f"unknown stage placement {style!r}; use 'loop' or 'v'")


def gpipe(pp: int, m: int) -> dict[int, list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward. Holds all m micro-batches'
    activations at once; its bubble is 1F1B's."""
    return _warm_up_then_alternate(pp, m, 1, lambda r: m)


def one_f_one_b(pp: int, m: int) -> dict[int, list[Action]]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron's default without interleaving).

    Rank r runs pp-r-1 forwards ahead (the warm-up: what reaches the last stage while its first
    backward comes back), then alternates one forward and one backward, then drains the backwards
    (the cool-down). Same bubble as GPipe, but a rank holds at most pp - r micro-batches' activations
    instead of m. Any m works (torch's Schedule1F1B asks m >= pp, Megatron does not).
    """
    return _warm_up_then_alternate(pp, m, 1, lambda r: pp - r - 1)


def interleaved_1f1b(pp: int, m: int, v: int) -> dict[int, list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, §2.2): v stages per rank, placed "loop".

    Micro-batches go through in groups of pp: a rank runs the forward of its first stage on
    micro-batches 0..pp-1, then of its second stage on the same ones, ..., then the next group; the
    backwards in the same order, with the stages reversed. Warm-up on rank r: (v-1)pp + 2(pp-r-1)
    forwards (Megatron-Core's count), then one forward and one backward alternate. With (v-1)pp +
    (pp-r-1) the bubble would be the same at t_comm = 0; the second pp-r-1 costs that many more
    stage-activations and hides transfers: each steady forward's input was sent a step earlier, so a
    transfer of up to t_f costs only the two ramps (tests/test_schedules.py), where 1F1B pays a round
    trip on every micro-batch. The groups of pp need m divisible by pp (Megatron's rule; torch's
    ScheduleInterleaved1F1B relaxes it to m a multiple of m // pp). The idle time shrinks v times,
    for v times as many point-to-point transfers. v = 1 is plain 1F1B.
    """
    if v == 1:
        return one_f_one_b(pp, m)
    if m % pp:
        options = ", ".join(str(pp * k) for k in range(1, 4))
        raise ValueError(f"interleaved 1F1B needs train.grad_accum (m={m}) divisible by parallel.pp ({pp}); "
                         f"use m in {{{options}}}, or parallel.pp_virtual=1")
    return _warm_up_then_alternate(pp, m, v, lambda r: 2 * (pp - r - 1) + (v - 1) * pp)


def _warm_up_then_alternate(pp: int, m: int, v: int, warm) -> dict[int, list[Action]]:
    """The three schedules above, which differ only in the warm-up: rank r runs warm(r) forwards (all of
    them at most), then alternates one forward and one backward, then drains the backwards. Its k-th
    forward runs chunk (k mod pp*v) // pp of its stages on micro-batch k mod pp of group k // (pp*v);
    its k-th backward the same, the chunks reversed (interleaved_1f1b; with v = 1, micro-batch k)."""
    total, group = m * v, pp * v

    def at(k: int, forward: bool, r: int) -> Action:
        chunk = (k % group) // pp
        stage = (chunk if forward else v - 1 - chunk) * pp + r
        return Action("F" if forward else "B", stage, (k // group) * pp + k % pp)

    out = {}
    for r in range(pp):
        ahead = min(warm(r), total)
        ops = [at(k, True, r) for k in range(ahead)]
        for k in range(total - ahead):
            ops += [at(k + ahead, True, r), at(k, False, r)]
        out[r] = ops + [at(k, False, r) for k in range(total - ahead, total)]
    return out


def zb_v(pp: int, m: int) -> dict[int, list[Action]]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §6; torch's ScheduleZBVZeroBubble).

    Two stages per rank placed "v" (rank r: chunk 0 = stage r, chunk 1 = stage 2pp-1-r), backward
    split into I and W. Rank r: 2(pp-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); pp-r
    triples (F, I, W of chunk 1); then the steady F I W of chunk 0, F I W of chunk 1; the cool-down
    runs I's first, both chunks, and leaves W's last, where they fill what would be idle. At most 2pp
    stage-activations on a rank, each half of a rank's layers: 1F1B's peak memory.

    The pattern needs 2pp-1 micro-batches to fill the V; for fewer it is built for 2pp-1 and the
    extra micro-batches' actions dropped (as torch does): every dependency stays within one
    micro-batch, so the rest keeps its order and stays deadlock-free. We chose ZB-V over DualPipeV
    because its actions are single computations; DualPipeV overlaps a forward and a backward of two
    micro-batches in one action, which only pays with communication to hide.
    """
    n = max(m, 2 * pp - 1)
    out = {}
    for r in range(pp):
        chunk = (r, 2 * pp - 1 - r)
        done, ops = Counter(), []            # done["F", 0]: the forwards of chunk 0 so far

        def run(*steps, times=1):            # ("F", 0): the next micro-batch of that kind on chunk 0
            for _ in range(times):
                for kind, c in steps:
                    ops.append(Action(kind, chunk[c], done[kind, c]))
                    done[kind, c] += 1

        run(("F", 0), times=2 * (pp - r) - 1)
        run(("F", 1), ("F", 0), times=r)
        run(("F", 1), ("I", 1), ("W", 1), times=pp - r)
        while done["F", 1] < n:
            if done["F", 0] < n:
                run(("F", 0))
            run(("I", 0), ("W", 0), ("F", 1), ("I", 1), ("W", 1))
        run(("I", 0), ("I", 1), times=r)
        while done["I", 0] < n:
            run(("I", 0), ("W", 0))
        while done["W", 1] < n:
            run(("W", 1))
        while done["W", 0] < n:
            run(("W", 0))
        out[r] = [a for a in ops if a.micro < m]
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb_v": zb_v}


def _needs(a: Action, n_stages: int) -> list[tuple]:
    """What an action waits for, as keys of the results other actions produce (see timeline)."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.stage, a.micro)]
    grad = [("dx", a.stage + 1, a.micro)] if a.stage < n_stages - 1 else []   # the loss starts the last
    return [("F", a.stage, a.micro)] + grad


MADE = {"F": ("F",), "B": ("dx",), "I": ("dx", "I"), "W": ()}   # results: "dx" = the input's gradient


def _label(key: tuple) -> str:
    what, stage, micro = key
    return {"F": f"F{micro}", "dx": f"B{micro}/I{micro}", "I": f"I{micro}"}[what] + f"@s{stage}"


def timeline(schedule: dict, duration, t_comm) -> dict[int, list[tuple]]:
    """{rank: [(start, end, action), ...]}: each rank runs its list in order, each action as soon as
    its rank is free and its inputs exist (plus t_comm when they come from another rank). Start
    times depend only on those two, so the order in which ranks are visited here does not matter.
    duration: an action's time by its kind ({"F": ..., "B": ...}), or a function of the action (a stage's own
    times: nanomega/sim/step_time.py's replay); t_comm: a transfer's time, or a function of the source and
    destination stages. Raises when no rank can go on before every list is done: the schedule deadlocks."""
    cost = duration if callable(duration) else (lambda a: duration[a.kind])
    comm = t_comm if callable(t_comm) else (lambda src, dst: t_comm)
    n_stages = 1 + max((a.stage for ops in schedule.values() for a in ops), default=0)
    ready, spans = {}, {r: [] for r in schedule}      # result key -> (time, rank)
    moved = True
    while moved:
        moved = False
        for r, ops in schedule.items():
            while len(spans[r]) < len(ops):
                a = ops[len(spans[r])]
                needs = _needs(a, n_stages)
                if any(k not in ready for k in needs):
                    break
                start = max([spans[r][-1][1] if spans[r] else 0] +
                            [ready[k][0] + (comm(k[1], a.stage) if ready[k][1] != r else 0) for k in needs])
                spans[r].append((start, start + cost(a), a))
                ready.update({(what, a.stage, a.micro): (start + cost(a), r) for what in MADE[a.kind]})
                moved = True
    stuck = [(r, len(spans[r]), ops[len(spans[r])]) for r, ops in schedule.items() if len(spans[r]) < len(ops)]
    if stuck:
        waits = "; ".join(f"rank {r} at #{i} {a} waits for "
                          + ", ".join(_label(k) for k in _needs(a, n_stages) if k not in ready)
                          for r, i, a in stuck)
        raise ValueError(f"schedule deadlocks (an action waits for one that comes after it): {waits}")
    return spans


def validate(schedule: dict, m: int, placement: list[int]) -> None:
    """Raise ValueError naming the first offending action unless the schedule is complete and runs.

    Complete: the ranks 0..pp-1 of the placement; every (stage, micro) has exactly one F and either one
    B or one I and one W, each on the rank `placement` gives its stage. Runs: executing each list in order, an
    action waiting until its inputs exist (F of s-1 for F of s; its own F and the B or I of s+1 for
    B or I of s; its I for W), every rank reaches its end. Running it also orders dependencies: one
    scheduled before its input on the same rank, or in a cycle across ranks, is a deadlock.
    """
    pp, n_stages = max(placement) + 1, len(placement)
    if sorted(schedule) != list(range(pp)):
        raise ValueError(f"schedule has ranks {sorted(schedule)}, expected 0..{pp - 1} (parallel.pp={pp})")
    seen = {}
    for r in range(pp):
        for i, a in enumerate(schedule[r]):
            where = f"rank {r} #{i} {a}"
            if a.kind not in KINDS or not 0 <= a.stage < n_stages or not 0 <= a.micro < m:
                raise ValueError(f"{where}: expected kind in {KINDS}, stage in 0..{n_stages - 1}, "
                                 f"micro in 0..{m - 1} (train.grad_accum={m})")
            if placement[a.stage] != r:
                raise ValueError(f"{where}: stage {a.stage} is placed on rank {placement[a.stage]}, not rank {r}")
            if a in seen:
                raise ValueError(f"{where}: a second {a.kind} of stage {a.stage}, micro-batch {a.micro} "
                                 f"(the first is {seen[a]})")
            seen[a] = where
    for s in range(n_stages):
        for j in range(m):
            has = {k for k in KINDS if Action(k, s, j) in seen}
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                raise ValueError(f"stage {s}, micro-batch {j} has {sorted(has) or 'nothing'}; "
                                 "it needs F and B, or F, I and W")
    check_blocking(p2p_program(schedule, placement))      # p2p_program's timeline raises on a deadlock


class Transfer(NamedTuple):
    op: str        # "send" or "recv"
    peer: int      # the pipeline rank at the other end
    what: str      # "act": a forward's output; "grad": the gradient of a stage's output
    stage: int     # the stage that consumes it
    micro: int

    def __str__(self):
        direction = "to" if self.op == "send" else "from"
        return f"{self.op} {self.what}{self.micro}@s{self.stage} {direction} rank {self.peer}"


def sends(a: Action, rank: int, placement: list[int]) -> list[Transfer]:
    """What `a` sends when it has run on `rank`: F its output to stage + 1, B or I its input's gradient to
    stage - 1, where that stage sits on another rank. Each send's receive is the peer's (p2p_program)."""
    s = a.stage
    if a.kind == "F" and s < len(placement) - 1 and placement[s + 1] != rank:
        return [Transfer("send", placement[s + 1], "act", s + 1, a.micro)]
    if a.kind in ("B", "I") and s > 0 and placement[s - 1] != rank:
        return [Transfer("send", placement[s - 1], "grad", s - 1, a.micro)]
    return []


def p2p_program(schedule: dict, placement: list[int]) -> dict[int, list]:
    """{rank: [Action, or a batch [Transfer, ...], ...]}: each rank's actions with the transfers it posts
    between them, one batch at a time (module doc).

    Lockstep, as torch's pipelining runs its schedules: the actions are timed (`timeline`, t_b = 2 t_f),
    and each transfer is posted, on both sides, in the batch of the moment its producer finishes: the
    sender right after producing it, the receiver as soon as it is free at or after that moment (before
    any action that could need it). Every rank posts its batches in the order of those moments and each
    batch pairs only with the peers' batches of the same moment, so every batch finds its matches posted:
    no schedule can deadlock, whatever blocks."""
    spans = timeline(schedule, {"F": 1, "B": 2, "I": 1, "W": 1}, 0)
    moments = defaultdict(lambda: defaultdict(list))      # rank -> moment -> transfers
    for r, ops in spans.items():
        for _, end, a in ops:
            for t in sends(a, r, placement):
                moments[r][end].append(t)
                moments[t.peer][end].append(Transfer("recv", r, t.what, t.stage, t.micro))
    programs = {}
    for r, ops in spans.items():
        batches = [(moment, sorted(batch, key=lambda t: (t.peer, t.op, t.what, t.stage, t.micro)))
                   for moment, batch in sorted(moments[r].items())]
        program, k = [], 0
        for start, _, a in ops:
            while k < len(batches) and batches[k][0] <= start:   # everything made by the time `a` starts
                program.append(batches[k][1])
                k += 1
            program.append(a)
        programs[r] = program + [batch for _, batch in batches[k:]]
    return programs


def check_blocking(programs: dict[int, list]) -> None:
    """Raise ValueError unless every rank completes its batches (the lists in p2p_program's programs) under
    NCCL's contract: a batch is posted when the rank's previous one completes, and completes when each of
    its transfers is matched by a posted one of the peer; the k-th send from a to b is matched with the
    k-th receive of b from a (NCCL matches in order), which must carry the same thing."""
    programs = {r: [item for item in program if isinstance(item, list)] for r, program in programs.items()}
    channel = defaultdict(lambda: ([], []))       # (src, dst) -> (sends, receives), each [(batch index, t)]
    for r, batches in programs.items():
        for i, batch in enumerate(batches):
            for t in batch:
                channel[(r, t.peer) if t.op == "send" else (t.peer, r)][t.op != "send"].append((i, t))
    partners = defaultdict(list)                  # (rank, batch index) -> the (rank, batch index) of its matches
    for (src, dst), (sends, recvs) in channel.items():
        for k in range(max(len(sends), len(recvs))):
            if k >= len(sends) or k >= len(recvs) or sends[k][1][2:] != recvs[k][1][2:]:
                got = [str(x[k][1]) if k < len(x) else "nothing" for x in (sends, recvs)]
                raise ValueError(f"transfer #{k} from rank {src} to rank {dst}: rank {src} sends {got[0]} but rank "
                                 f"{dst} receives {got[1]} (NCCL matches them in order)")
            partners[src, sends[k][0]].append((dst, recvs[k][0]))
            partners[dst, recvs[k][0]].append((src, sends[k][0]))
    done = dict.fromkeys(programs, 0)             # rank -> batches complete; batch done[r] is posted
    moved = True
    while moved:
        moved = False
        for r, batches in programs.items():
            if done[r] < len(batches) and all(i <= done[peer] for peer, i in partners[r, done[r]]):
                done[r], moved = done[r] + 1, True
    stuck = [r for r in programs if done[r] < len(programs[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at batch #{done[r]} [" + ", ".join(map(str, programs[r][done[r]])) + "]"
                          for r in stuck)
        raise ValueError(f"point-to-point deadlock when a send blocks until its receive is posted: {waits}")


class Timeline(NamedTuple):
    spans: dict        # rank -> [(start, end, action), ...]
    busy: dict         # rank -> time spent computing
    makespan: object   # when the last rank finishes
    bubble: object     # idle / (pp x makespan): Fraction when the times are integers


def simulate(schedule: dict, t_f=1, t_b=2, t_i=1, t_w=1, t_comm=0) -> Timeline:
    """Time a schedule: each action takes its kind's time and starts as soon as its rank has run the
    actions before it and its inputs exist (t_comm after they are made on another rank).

    The bubble is the idle share of every rank's time until the last one finishes (the step ends
    for all of them together at the optimizer step): 1 - sum(busy) / (pp x makespan). Times are per
    stage; a stage of a "loop" or "v" placement is 1/v of a rank's layers, so scale them by 1/v to
    compare makespans with a one-stage-per-rank schedule (bubble fractions do not depend on it).
    """
    spans = timeline(schedule, {"F": t_f, "B": t_b, "I": t_i, "W": t_w}, t_comm)
    busy = {r: sum(end - start for start, end, _ in s) for r, s in spans.items()}
    makespan = max((s[-1][1] for s in spans.values() if s), default=0)
    total = len(spans) * makespan
    idle = total - sum(busy.values())
    exact = all(isinstance(t, int) for t in (idle, total))
    return Timeline(spans, busy, makespan, Fraction(idle, total) if exact else idle / total)


def theoretical_bubble(kind: str, pp: int, m: int, v: int = 1) -> Fraction:
    """The idle share of the step (simulate's definition) the literature predicts, with t_b = 2 t_f
    (t_i = t_w = t_f for ZB-V).

    gpipe, 1f1b: each rank idles (pp-1)(t_f+t_b) of a makespan (m+pp-1)(t_f+t_b), any t_f, t_b:
        (pp-1) / (m+pp-1).  (GPipe's and Megatron's papers quote (pp-1)/m: idle over busy time.)
    interleaved_1f1b: the ramps shrink v times, each rank idles (pp-1)(t_f+t_b)/v of its
        m(t_f+t_b) of work: (pp-1) / (v*m + pp-1)  (Megatron's "(1/v)(pp-1)/m", idle over busy).
    zb_v: the paper's "zero" counts the ramps as filled by the next step (its optimizer step is not
        a barrier: "post-validation"). With the step as a barrier the last rank still waits pp-1
        forwards for its first input, while each rank has 2m(t_f+t_i+t_w) = 6m t_f of work and rank 0
        the first and the last action: (pp-1) / (6m + pp-1), a lower bound, close to 0 for m >> pp,
        that zb_v reaches once 2m >= 3pp-1 (tests/test_schedules.py).
    """
    work = {"gpipe": m, "1f1b": m, "interleaved_1f1b": v * m, "zb_v": 6 * m}   # a rank's, in units it idles pp-1 of
    if kind not in work:
        raise ValueError(f"unknown schedule {kind!r}; use one of {sorted(SCHEDULES)}")
    return Fraction(pp - 1, work[kind] + pp - 1)


def peak_in_flight(schedule: dict) -> dict[int, int]:
    """rank -> the most (stage, micro) forwards it holds at once: from an F until its backward is done
    (its B, or its W, which still needs the stage's inputs). A stage is 1/v of a rank's layers, so
    interleaved and V placements hold 1/v of a micro-batch's activations per count."""
    held = {"F": 1, "B": -1, "I": 0, "W": -1}     # the change each kind makes to what the rank holds
    return {r: max(accumulate((held[a.kind] for a in ops), initial=0)) for r, ops in schedule.items()}


def render(schedule: dict, timeline: Timeline | None = None) -> str:
    """One line per rank: the actions in order (F3 = forward of micro-batch 3; @s5 = on stage 5, shown
    where a rank holds several stages); given simulate's timeline with integer times, a time grid
    instead, one column per time unit, an action spread over its duration and "." for idle."""
    several = any(len({a.stage for a in ops}) > 1 for ops in schedule.values())
    name = (lambda a: str(a)) if several else (lambda a: f"{a.kind}{a.micro}")
    if timeline is None:
        return "\n".join(f"rank {r}: " + " ".join(name(a) for a in ops) for r, ops in schedule.items())
    if not all(isinstance(t, int) for spans in timeline.spans.values() for span in spans for t in span[:2]):
        raise ValueError("render's time grid needs integer action times (simulate with integer t_f, t_b, ...)")
    width = max(len(name(a)) for ops in schedule.values() for a in ops)
    lines = []
    for r, spans in timeline.spans.items():
        cells, t = [], 0
        for start, end, a in spans:
            cells += ["." * width] * (start - t) + [name(a).ljust(width)] + ["-" * width] * (end - start - 1)
            t = end
        lines.append(f"rank {r}: " + " ".join(cells + ["." * width] * (timeline.makespan - t)))
    return "\n".join(lines)
