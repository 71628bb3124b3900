"""The forward as a wavefront over sub-batches, so that every all-to-all of every MoE layer is in flight while
another sub-batch computes, in the forward and in the backward (model.moe_sub_batches = S; "two-batch overlap").

    loss, stats = loss_and_stats(params, tokens, targets, cfg, run)    # models.transformer's, S sub-batches

Inside one layer, chunks (model.moe_overlap_chunks, experts.overlapped) leave the layer's ends exposed: nothing
of the layer is left to compute before the first dispatch or after the last combine. Here each rank's rows are
split in S sub-batches of whole sequences (attention stays within one), each a Python generator that runs the
model's units and stops (yields) where it has launched an exchange, so the driver (`interleave`) can run the others
before it waits. An MoE block runs in these steps:

    r   the last layer's combine used, the residual, attention, the MLP's norm     compute
    s   the shared expert (if any)                                                  compute
    t   routing, the rows sorted by expert, the count exchange launched            compute, then in flight
    u   the counts read (the host sync), the dispatch launched                     in flight
    v1  the rows arrived, the experts, the outputs back in their order             compute, then in flight
    v2  the combine launched                                                       in flight

The backward needs nothing more: autograd runs the nodes in the reverse of their creation, so an exchange's
gradient is launched where the forward launched it and first used where the forward made its input. Hence the
split of t | u (the rows gathered in t, so the dispatch's gradient has u's window too) and of v1 | v2 (the
combine's gradient has the window between them). An exchange is hidden in both passes when another sub-batch
computes in each window after its launch and between its input and its launch; with every sub-batch's steps in
the same order, that takes S >= 4 from the first layer to the head (`interleave`'s docstring says why; S = 2 or 3
leave some: docs/moe.md, "What falls short").

Every token meets the same weights in the same operations as in the plain forward. The loss and the router
statistics are the micro-batch's: the cross-entropy summed over the sub-batches, then divided by the micro-batch's
token count; each layer's balancing loss, z-loss and loads computed once (moe.router_stats) from the sub-batches'
routings put back in their rows' order. What differs: the matmuls run on fewer rows, and each weight's gradient is
summed over the sub-batches (rounding). A unit's parameters serve every sub-batch: under FSDP they are gathered
once, when the first sub-batch reaches the unit (the next unit's gather launched then, as the plain step does), and
kept until the backward (parallel.reshard_after_forward=false: the saved-tensor hooks that free and regather them
wrap one call of a unit, and here a block runs in steps). What this runs (Config.validate_sub_batches refuses the
rest before any work): ep > 1 with any data, tensor (with or without sequence parallel, experts split or not) and
context parallel layout, dropless or dropping routed rows; not pipelines, recomputation, compile, padded capacity
or chunks.
"""
from __future__ import annotations

import functools
import math

import torch
from torch.distributed.tensor import DTensor

from nanomega.hints import constrain, vocab_parallel
from nanomega.models import mla, moe
from nanomega.models.layers import attention, norm
from nanomega.models.loss import linear_cross_entropy
from nanomega.models.transformer import block, embed, objective, positions, units
from nanomega.parallel.experts import AllToAll, on_this_rank

# what a step did, as a sub-batch yields it: (issued compute, left an exchange in flight)
COMPUTED, IN_FLIGHT, COMPUTED_IN_FLIGHT = (True, False), (False, True), (True, True)
AT_HEAD = (False, False)     # (this object) all that is left is the head: `interleave` keeps it for last


def loss_and_stats(params: dict, tokens, targets, cfg, run):
    """models.transformer.loss_and_stats on cfg.moe_sub_batches sub-batches (module doc). run(name, fn, p, *args):
    the step's unit runner, asked for a unit's parameters as the units compute with them (param_dtype; FSDP's
    gather, launched one unit ahead) when the first sub-batch reaches it, and kept for the others."""
    S = cfg.moe_sub_batches
    held = [(name, functools.cache(functools.partial(run, name, lambda q: q, p))) for name, p in units(params, cfg)]
    parts = list(zip(sub_batches(tokens, S), sub_batches(targets, S)))
    layers = [[] for _ in parts]     # per sub-batch: (routing, keep, comm) of each MoE layer
    sums = interleave([sub_batch(held, x, y, cfg, mine) for (x, y), mine in zip(parts, layers)])
    ce = sum(sums[1:], sums[0]) / targets.numel()
    stats = []
    B, T = tokens.to_local().shape
    for per_part in zip(*layers):      # one MoE layer: the routings of its sub-batches, in their rows' order
        routing = moe.Routing(*(torch.cat(f) for f in zip(*(r for r, _, _ in per_part))))
        keep = None if per_part[0][1] is None else torch.cat([k for _, k, _ in per_part])
        stats.append(moe.router_stats(routing, keep, B, T, cfg, per_part[0][2]))
    return objective(ce, stats, tokens, targets, cfg)


def sub_batches(t, S: int) -> list:
    """t [B, ...], a DTensor, as S DTensors laid out as t, each holding B / S of this rank's rows (whole sequences)."""
    shape = torch.Size([t.shape[0] // S, *t.shape[1:]])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return [DTensor.from_local(part, t.device_mesh, t.placements, run_check=False, shape=shape, stride=stride)
            for part in t.to_local().tensor_split(S)]


def interleave(programs: list) -> list:
    """Run the generators to their ends, interleaved; their return values in order. A generator yields (computed,
    in_flight) after each step; one left in flight is resumed only once another has computed since (when one can).

    Sub-batch s starts after the first has taken s steps, then the turn goes round: the next in turn whose
    exchange has been covered, else one at its last step (the head, computed: kept for last, it covers the others'
    last combines), else the next in turn. Every sub-batch has the same steps, so the stagger holds through the
    model: in a round, sub-batch s's window after step i holds sub-batch s + 1's step i - 1 and s + 2's step
    i - 2, and of two consecutive steps of a block one computes; near the ends the stagger runs short, which S >= 4
    covers (tests/test_overlap.py)."""
    S = len(programs)
    taken, covered, at_head, done, turn = [0] * S, [True] * S, set(), {}, 0
    while len(done) < S:
        order = [(turn + i) % S for i in range(S)]
        live = [s for s in order if s not in done and (s == 0 or taken[s] or taken[0] > s)]
        heads = [s for s in live if s in at_head]
        s = ([s for s in live if covered[s] and s not in at_head] or heads or live)[0]
        try:
            step = next(programs[s])
        except StopIteration as end:
            done[s], step = end.value, COMPUTED
        taken[s] += 1
        if step is AT_HEAD:
            at_head.add(s)
        computed, in_flight = step
        if computed:
            covered = [True] * S
        covered[s] = not in_flight
        turn = (s + 1) % S
    return [done[s] for s in range(S)]


def sub_batch(held: list, tokens, targets, cfg, layers: list):
    """One sub-batch's forward, a generator of steps (module doc); returns its summed cross-entropy. held: (name,
    its parameters()) of each unit; layers: gets (routing, keep, comm) of each MoE layer, for the micro-batch's
    statistics."""
    x, pending, at = None, None, None
    for name, unit in held:
        p = unit()
        if "tok_embed" in p and x is None:
            x = embed(p, tokens, cfg)
            yield COMPUTED
        elif "final_norm" in p:
            yield AT_HEAD
            x = pending() if pending else x
            h = constrain(norm(p["final_norm"], x, cfg), tokens, whole_sequence=True)
            w = p["tok_embed" if cfg.tie_embeddings else "lm_head"]["weight"]
            return vocab_parallel(linear_cross_entropy, h, w, targets, cfg.vocab_size,
                                  cfg.loss_chunk or targets.numel())
        else:
            block_cfg = cfg.block_config(int(name.split(".")[1]))
            x = pending() if pending else x
            at = positions(tokens, cfg, x.dtype) if at is None else at    # this sub-batch's rows' own masks
            if "moe" not in p:
                x, pending = block(p, x, tokens, at, block_cfg)[0], None
                yield COMPUTED
            else:
                pending = yield from moe_block(p, x, tokens, at, block_cfg, layers)


def moe_block(layer: dict, x, tokens, at, cfg, layers: list):
    """models.transformer.block for an MoE block, in steps r s t u v1 v2 (module doc); returns the step r of the
    next unit begins with: the combine used and the residual added."""
    attend = mla.attention if cfg.attention == "mla" else attention
    h = constrain(norm(layer["attn_norm"], x, cfg), tokens, whole_sequence=True)
    x = x + constrain(attend(layer["attn"], h, at, cfg), tokens)
    h = constrain(norm(layer["mlp_norm"], x, cfg), tokens)
    p = layer["moe"]
    yield COMPUTED                                                                           # r
    shared = None
    if "shared" in p:
        shared = constrain(moe.shared_expert(p, constrain(h, tokens, whole_sequence=True), cfg), tokens)
        yield COMPUTED                                                                       # s
    local, rows_of, comm, finish = on_this_rank({"router": p["router"], "experts": p["experts"]}, h, cfg)
    B, T, d = rows_of.shape
    flat = rows_of.reshape(B * T, d)
    routing = moe.route(local["router"], flat, cfg)
    keep = moe.kept(routing, B, T, cfg) if cfg.capacity_factor else None
    layers.append((routing, keep, comm))
    N, k = routing.experts.shape
    experts = routing.experts.flatten()
    assignments = torch.arange(N * k, device=flat.device) if keep is None else moe.kept_assignments(keep, B, T, cfg)
    assignments = assignments[experts[assignments].argsort(stable=True)]      # by expert, then token
    counts = moe.expert_counts(experts[assignments], cfg.n_experts)
    rows = comm.into_split_experts(flat)[assignments // k]
    ex = comm.exchange
    send, received = ex.counts(counts)
    yield COMPUTED_IN_FLIGHT                                                                 # t
    (send_splits,), (recv_splits,) = ex.splits(send, received, len(rows))    # the layer's one host read
    arrived = AllToAll.apply(rows, recv_splits, send_splits, ex.group)
    yield IN_FLIGHT                                                                          # u
    mlp = functools.partial(moe.expert_mlp, local["experts"], kernel=cfg.expert_kernel, fp8=cfg.fp8)
    out = ex.grouped(arrived, received[:, 0], sum(recv_splits), mlp)
    yield COMPUTED_IN_FLIGHT                                                                 # v1
    back = AllToAll.apply(out, send_splits, recv_splits, ex.group)
    yield IN_FLIGHT                                                                          # v2

    def combined():
        y = moe.combine(back, comm.into_split_experts(routing.weights), assignments, N)
        y = finish(y.view(B, T, -1).to(rows_of.dtype), None)[0]
        return x + (y + shared if shared is not None else y)
    return combined
