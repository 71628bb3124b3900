"""Mixture of experts as pure functions over an expert-stacked parameter tree.

    layers.{i}.moe.router.weight           [E, d]     scores in fp32 whatever the autocast dtype
    layers.{i}.moe.router.expert_bias      [E]        aux-loss-free balancing only (no gradient)
    layers.{i}.moe.experts.{w_gate,w_up}   [E, f, d]  SwiGLU experts stacked on a leading expert dim
    layers.{i}.moe.experts.w_down          [E, d, f]
    layers.{i}.moe.shared.{w_gate,w_up,w_down}.weight   the shared expert(s): a dense SwiGLU MLP
    layers.{i}.moe.shared_gate.weight      [1, d]     Qwen2-MoE: sigmoid gate on the shared output

One layer, token by token: the router scores the E experts, the token goes to its top k, and the
output is the sum of those experts' outputs times the routing weights (plus the shared expert).
Executed in bulk: every (token, choice) pair is an *assignment*; assignments are sorted by expert
so each expert sees one contiguous block of rows, the blocks run as one grouped GEMM
(`torch._grouped_mm`) or a loop of matmuls, and the rows are scattered back, weighted.

Token dropping (GShard): each expert takes at most C = ceil(capacity_factor * T * k / E)
assignments per sequence; over capacity it keeps the highest-weight ones ("probs") or the earliest
("position"). The capacity group is the sequence, so the same tokens drop whatever the layout.
`pad_to_capacity` gives every expert exactly C rows per sequence: static shapes, one batched matmul.

Losses are computed on the whole micro-batch, so a parallel run computes the serial numbers: the
functions take a `comm` (on a mesh, nanomega.parallel.experts supplies it) that sums per-expert
statistics over the ranks holding other tokens of the batch and exchanges tokens with the ranks
holding other experts; `SERIAL` does nothing. Load balancing (Switch/GShard, Megatron's
normalization: 1.0 at perfect balance):
    micro_batch:  E / (k N^2) * sum_e count_e * sum_n p_ne          (N tokens in the micro-batch)
    sequence:     mean over sequences of E / (k T^2) * sum_e count_se * sum_t p_ste   (DeepSeek-V3)
with p the router probabilities (sigmoid scores normalized to sum 1) and count the assignments
before dropping; z-loss (ST-MoE): mean_n logsumexp(logits_n)^2.
"""
from __future__ import annotations

import contextlib
import functools
import math
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, is_fake

from nanomega.models import fp8
from nanomega.models.loss import autocast_dtype, autocast_off
from nanomega.models.mlp import mlp


class Routing(NamedTuple):
    experts: torch.Tensor    # [N, k] int64: the chosen experts of each token
    weights: torch.Tensor    # [N, k] fp32: their combine weights
    logits: torch.Tensor     # [N, E] fp32
    probs: torch.Tensor      # [N, E] fp32: router probabilities for the balancing loss


class MoEStats(NamedTuple):
    aux_loss: torch.Tensor   # scalar, the balancing loss of the micro-batch (differentiable)
    z_loss: torch.Tensor     # scalar (differentiable)
    load: torch.Tensor       # [E] assignments per expert in the micro-batch, before dropping (no grad)
    dropped: torch.Tensor    # scalar: assignments dropped over capacity (no grad)


class Serial:
    """The communication of a single process, where there are no other ranks: the sums of a per-expert statistic
    over the ranks holding other tokens of the batch (sum_tokens) or other positions of the same sequences
    (sum_sequence), of a scalar's per-rank shares (partial), and the input of experts whose hidden units other ranks
    share (into_split_experts) are the identity; the experts are all local (no exchange)."""
    token_shards = batch_shards = sequence_shards = 1
    sum_tokens = sum_sequence = partial = into_split_experts = staticmethod(lambda x: x)
    exchange = None


SERIAL = Serial()


# ---------------------------------------------------------------- routing

def limit_groups(choice: torch.Tensor, cfg) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3; Megatron's group_limited_topk): experts are split in
    router_groups groups, a group scores the sum of its best top_k / router_topk_groups experts,
    and a token chooses only among the experts of its router_topk_groups best groups."""
    N, E = choice.shape
    groups = choice.view(N, cfg.router_groups, E // cfg.router_groups)
    group_scores = groups.topk(cfg.top_k // cfg.router_topk_groups, dim=-1).values.sum(-1)
    best = group_scores.topk(cfg.router_topk_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    return groups.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(N, E)


def route(p: dict, x: torch.Tensor, cfg) -> Routing:
    """x [N, d] -> the top-k experts of each token and their weights, in fp32 (autocast off: a bf16
    router flips near-tied choices and rounds the balancing statistics)."""
    with autocast_off(x.device.type):
        logits = F.linear(x.float(), p["weight"].float())
    if cfg.router_score == "softmax":
        scores = probs = logits.softmax(-1)
    else:  # sigmoid (DeepSeek-V3): independent scores; normalized to a distribution for the balancing loss
        scores = logits.sigmoid()
        probs = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    softmax_after = cfg.router_score == "softmax" and not cfg.router_softmax_first
    choice = logits if softmax_after else scores
    if "expert_bias" in p:  # aux-loss-free balancing: the bias moves the choice, never the weights
        choice = choice + p["expert_bias"].detach().float()
    if cfg.router_groups > 1:
        choice = limit_groups(choice, cfg)
    experts = choice.topk(cfg.top_k, dim=-1).indices
    if softmax_after:
        weights = logits.gather(-1, experts).softmax(-1)
    else:
        weights = scores.gather(-1, experts)
        if cfg.router_norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Routing(experts, weights * cfg.router_scale, logits, probs)


def capacity(cfg, seq_len: int) -> int:
    """Assignments one expert takes per sequence under token dropping."""
    return capacity_of(cfg.capacity_factor, seq_len, cfg.top_k, cfg.n_experts)


@torch.compiler.assume_constant_result     # Python numbers in, one out: torch.compile takes the value, not Fraction
def capacity_of(factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    # exact arithmetic: in floats 1.1 * 100 is 110.00000000000001, whose ceiling would admit one more
    return min(seq_len, math.ceil(Fraction(repr(factor)) * seq_len * top_k / n_experts))


def kept(routing: Routing, batch: int, seq_len: int, cfg) -> torch.Tensor:
    """[N, k] bool: which assignments fit their expert's capacity in their sequence."""
    N, k = routing.experts.shape
    E, C = cfg.n_experts, capacity(cfg, seq_len)
    chosen = torch.zeros(N, E, dtype=torch.bool, device=routing.experts.device).scatter(1, routing.experts, True)
    chosen = chosen.view(batch, seq_len, E)
    if cfg.drop_policy == "position":   # the first C tokens of the sequence that chose e
        keep = chosen & (chosen.cumsum(1) <= C)
    else:                               # the C tokens with the largest weights for e
        weight = torch.full((N, E), float("-inf"), device=routing.weights.device)
        weight = weight.scatter(1, routing.experts, routing.weights.detach()).view(batch, seq_len, E)
        # a stable sort: among equal weights the earlier token wins, as in the reference loop
        best = weight.sort(dim=1, descending=True, stable=True).indices[:, :C]
        keep = chosen & torch.zeros_like(chosen).scatter(1, best, True)
    return keep.view(N, E).gather(1, routing.experts)


def kept_assignments(keep: torch.Tensor, batch: int, seq_len: int, cfg) -> torch.Tensor:
    """The kept assignments (a = n * k + j) in order, [M]: nonzero reads M on the host (one sync per layer).
    A fake tensor (the memory simulator) holds no routing; its stand-in is the capacity-bounded worst case, every
    expert full in every sequence: M = batch * min(seq_len * k, E * C) rows (their shapes, not which rows)."""
    if torch.compiler.is_compiling() or not is_fake(keep):    # (compiling: fake, standing for real)
        return keep.flatten().nonzero().squeeze(1)
    return torch.arange(batch * min(seq_len * cfg.top_k, cfg.n_experts * capacity(cfg, seq_len)), device=keep.device)


# ---------------------------------------------------------------- the experts

def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs on the CPU (any float dtype) and on CUDA in bf16 from sm90 (Hopper) on. On
    "meta" (shapes only) the grouped path is the one that can run: the loop needs the counts' values."""
    if x.device.type in ("cpu", "meta"):
        return True
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


@torch.library.custom_op("nanomega::grouped_mm", mutates_args=())
def _grouped_mm_any_dtype(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm_any_dtype.register_fake
def _(a, b, offs):
    if b.ndim == 2:   # [k, M] x [M, n] in groups of M -> [G, k, n] (the weight gradient)
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    return (_grouped_mm_any_dtype(grad, b.transpose(-2, -1), offs),
            _grouped_mm_any_dtype(a.transpose(0, 1), grad, offs), None)


_grouped_mm_any_dtype.register_autograd(
    _grouped_mm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, k] in groups ending at offs, times b [G, k, n] -> [M, n]. torch.compile traces
    torch._grouped_mm in bf16 only (its meta kernel refuses fp32, which the CPU kernel runs): other
    dtypes go through a custom op with its own shape function and backward, so no graph breaks."""
    if a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    return _grouped_mm_any_dtype(a, b, offs)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[n_experts] int64: how many entries of `experts` name each expert (bincount with a static shape)."""
    flat = experts.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def _in_compute_dtype(x: torch.Tensor, w: dict) -> tuple[torch.Tensor, dict]:
    """x and the expert weights in the dtype F.linear would use (torch._grouped_mm is not on autocast's list)."""
    dtype = autocast_dtype(x.device.type) or x.dtype
    return x.to(dtype), {k: v.to(dtype) for k, v in w.items()}


def host_counts(counts: torch.Tensor) -> list[int] | None:
    """counts [E] read on the host: a sync (the device's queue of work drains first). A fake tensor (the memory
    simulator, the contract checker) holds no values: None, for the caller's balanced stand-in, after a read
    that the contract checker counts (its dispatch mode answers it; a bare FakeTensorMode refuses it). Under
    torch.compile the counts are traced, fake, but stand for real ones: the read is traced (unbacked ints under
    capture_scalar_outputs, parallel/experts.py's compile_block; else dynamo's one graph break)."""
    if torch.compiler.is_compiling() or not is_fake(counts):
        return counts.cpu().tolist()      # one copy to the host, one wait
    with contextlib.suppress(DataDependentOutputException):
        counts.cpu().tolist()
    return None


def balanced_counts(rows: int, n: int) -> list[int]:
    """`rows` rows over n experts as balanced routing gives them (the simulators' stand-in for real counts)."""
    return [rows // n + (e < rows % n) for e in range(n)]


def swiglu(matmul, x: torch.Tensor) -> torch.Tensor:
    """(silu(x W_gate) * x W_up) W_down, where matmul(rows, name) is the rows times the expert weight `name`."""
    return matmul(F.silu(matmul(x, "w_gate")) * matmul(x, "w_up"), "w_down")


def expert_swiglu(w: dict, e: int, x: torch.Tensor, recipe: str) -> torch.Tensor:
    """Expert e's SwiGLU on its rows x (maybe none: an empty output, a zero weight gradient), a matmul per
    projection, in float8 as `recipe` says (models/fp8.py). Delayed scaling's histories sit beside 2-D weights
    only (models/transformer.py), so the stacked experts scale by this step's amaxes, as tensorwise does."""
    recipe = "tensorwise" if recipe == "delayed" else recipe
    linear = F.linear if recipe == "none" else functools.partial(fp8.linear, recipe=recipe)
    return swiglu(lambda rows, name: linear(rows, w[name][e]), x)


def expert_mlp(w: dict, rows: torch.Tensor, counts: torch.Tensor, kernel: str = "auto",
               fp8: str = "none") -> torch.Tensor:
    """SwiGLU of each expert on its block of rows. rows [M, d] sorted by expert, counts [E] rows per
    expert (summing to M). "grouped_mm": one grouped GEMM per projection; "auto": that where it runs
    (grouped_mm_available), else a matmul per expert, as an fp8 recipe always runs (expert_swiglu;
    torch._scaled_grouped_mm has no CPU kernel)."""
    if fp8 == "none":
        rows, w = _in_compute_dtype(rows, w)
        if kernel == "grouped_mm" or grouped_mm_available(rows):
            offsets = counts.cumsum(0).to(torch.int32)
            return swiglu(lambda x, name: grouped_mm(x, w[name].transpose(-2, -1), offsets), rows)
    # a matmul per expert slices by the row counts on the host: one sync per call, inherent to looping (the
    # grouped GEMM, and torch._scaled_grouped_mm, CUDA only, take the offsets on the device)
    sizes = host_counts(counts) or balanced_counts(len(rows), len(counts))
    return torch.cat([expert_swiglu(w, e, block, fp8) for e, block in enumerate(rows.split(sizes))])


def expert_bmm(w: dict, slots: torch.Tensor, fp8: str = "none") -> torch.Tensor:
    """SwiGLU of each expert on a padded [E, C, d] buffer: three batched matmuls, static shapes (with an
    fp8 recipe, float8 matmuls expert by expert)."""
    if fp8 != "none":
        return torch.stack([expert_swiglu(w, e, slots[e], fp8) for e in range(slots.shape[0])])
    slots, w = _in_compute_dtype(slots, w)
    return swiglu(lambda x, name: torch.bmm(x, w[name].transpose(1, 2)), slots)


def routed(w: dict, x: torch.Tensor, routing: Routing, kept_rows, cfg, exchange=None,
           capacity_rows: int = 0, beside=None) -> torch.Tensor:
    """x [N, d] -> sum over each token's kept choices (kept_rows: kept_assignments, None: all) of
    weight * expert(x), [N, d].

    `exchange` (expert parallel) carries the sorted rows to the ranks that own their experts and
    back, in exchange.chunks pieces (contiguous runs of tokens) so the pieces' all-to-alls overlap the
    experts' compute; without it every expert is local. capacity_rows > 0 pads every expert to that
    many rows (the exchange then splits the slots). beside(): work that needs none of this (the shared
    expert), run while the first all-to-all is in flight, or first without an exchange. (parallel/wavefront.py
    takes the same steps for one chunk, in phases between other sub-batches' work.)"""
    N, k = routing.experts.shape
    E = cfg.n_experts
    if exchange is None and beside is not None:
        beside()
    chunks = 1 if exchange is None or capacity_rows else exchange.chunks
    if N < chunks:
        raise ValueError(f"model.moe_overlap_chunks={chunks} splits this rank's {N} tokens; choose at most {N}")
    flat = routing.experts.flatten()
    # assignment a = n * k + j; those that survive dropping, sorted by (chunk of the token, expert): stable, so by
    # token within one
    assignments = torch.arange(N * k, device=x.device) if kept_rows is None else kept_rows
    key = flat[assignments] if chunks == 1 else (assignments // k) * chunks // N * E + flat[assignments]
    by_key = key.argsort(stable=True)
    assignments = assignments[by_key]
    expert_of = flat[assignments]
    counts = expert_counts(key[by_key], chunks * E).view(chunks, E)
    rows = x[assignments // k]
    if capacity_rows:
        # row i of expert e's block goes to slot i of e's padded buffer
        start = counts[0].cumsum(0) - counts[0]
        slot = torch.arange(len(assignments), device=x.device) - start[expert_of]
        padded = x.new_zeros(E, capacity_rows, x.shape[-1]).index_put((expert_of, slot), rows)
        compute = functools.partial(expert_bmm, w, fp8=cfg.fp8)
        out = (compute(padded) if exchange is None else exchange.padded(padded, compute, beside))[expert_of, slot]
    else:
        compute = functools.partial(expert_mlp, w, kernel=cfg.expert_kernel, fp8=cfg.fp8)
        out = compute(rows, counts[0]) if exchange is None else exchange.rows(rows, counts, compute, beside)
    return combine(out, routing.weights, assignments, N)


def combine(out: torch.Tensor, weights: torch.Tensor, assignments: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Each token's output [n_tokens, d]: the sum of its kept choices' expert outputs (out, one row per assignment
    a = token * k + choice, in `assignments`' order), weighted by the router (weights [n_tokens, k])."""
    weighted = out * weights.flatten()[assignments].unsqueeze(1).to(out.dtype)
    return out.new_zeros(n_tokens, out.shape[-1]).index_add(0, assignments // weights.shape[1], weighted)


# ---------------------------------------------------------------- the layer

def balancing_loss(routing: Routing, batch: int, seq_len: int, cfg, comm=SERIAL) -> torch.Tensor:
    """The load-balancing loss of the micro-batch (module doc); `comm` makes it global under parallel."""
    E, k = cfg.n_experts, cfg.top_k
    chosen = torch.zeros_like(routing.probs).scatter(1, routing.experts, 1.0)   # [N, E], no gradient
    if cfg.aux_loss == "micro_batch":
        n = batch * seq_len * comm.token_shards
        count = comm.sum_tokens(chosen.sum(0))
        return comm.partial((count * routing.probs.sum(0)).sum() * (E / (k * n * n)))
    count = comm.sum_sequence(chosen.view(batch, seq_len, E).sum(1))           # [B, E] per sequence
    t = seq_len * comm.sequence_shards
    per_seq = (count * routing.probs.view(batch, seq_len, E).sum(1)).sum(1) * (E / (k * t * t))
    return comm.partial(per_seq.sum() / (batch * comm.batch_shards))


def routed_moe(p: dict, x: torch.Tensor, cfg, comm=SERIAL, beside=None) -> tuple[torch.Tensor, MoEStats]:
    """The routed experts of one layer on x [B, T, d] (this rank's tokens): (output [B, T, d], stats).
    p holds "router" and "experts"; the shared expert is added by the caller, which may hand it in as
    beside() to run while the first all-to-all is in flight (`routed`)."""
    B, T, d = x.shape
    flat = x.reshape(B * T, d)
    routing = route(p["router"], flat, cfg)
    keep = kept(routing, B, T, cfg) if cfg.capacity_factor else None
    rows = capacity(cfg, T) * B if cfg.pad_to_capacity else 0
    # experts split over tensor-parallel ranks (expert tensor parallel) compute partial sums of each output, so
    # the gradients of their input rows and of the combine weights are partial sums too, reduced on the way in
    split = routing._replace(weights=comm.into_split_experts(routing.weights))
    y = routed(p["experts"], comm.into_split_experts(flat), split,
               None if keep is None else kept_assignments(keep, B, T, cfg), cfg, comm.exchange, rows, beside)
    return y.view(B, T, d).to(x.dtype), router_stats(routing, keep, B, T, cfg, comm)


def router_stats(routing: Routing, keep, batch: int, seq_len: int, cfg, comm=SERIAL) -> MoEStats:
    """The layer's MoEStats from the routing of its batch x seq_len tokens (keep: kept's, None when dropless)."""
    device = routing.logits.device
    zero = comm.partial(torch.zeros((), device=device))
    aux = balancing_loss(routing, batch, seq_len, cfg, comm) if cfg.aux_loss_coef else zero
    z = comm.partial(torch.logsumexp(routing.logits, -1).square().sum() / (batch * seq_len * comm.token_shards)) \
        if cfg.z_loss_coef else zero
    with torch.no_grad():
        load = comm.sum_tokens(expert_counts(routing.experts, cfg.n_experts).float())
        dropped = torch.zeros((), device=device) if keep is None else comm.sum_tokens((~keep).sum().float())
    return MoEStats(aux, z, load, dropped)


def shared_expert(p: dict, x: torch.Tensor, cfg) -> torch.Tensor:
    """The dense SwiGLU every token passes (layers.mlp), gated by sigmoid(x . w) in Qwen2-MoE."""
    y = mlp(p["shared"], x, cfg)
    if "shared_gate" in p:
        y = torch.sigmoid(F.linear(x, p["shared_gate"]["weight"])) * y
    return y


def expert_bias_step(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): raise the bias of underloaded experts and lower the
    bias of overloaded ones by `rate`, from the loads of the last step (outside the gradient)."""
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)

