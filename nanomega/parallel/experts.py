"""Expert parallel: each rank routes its own tokens, sends them to the ranks owning their experts by
all-to-all, runs its experts, and sends the outputs back.

    y, stats = expert_parallel(moe.routed_moe, {"router": ..., "experts": ...}, h, cfg)   # in the model

The model calls the hint `nanomega.hints.expert_parallel`: on plain tensors it is `routed_moe(params, h, cfg)`. On a
mesh the hint runs `experts_on_mesh`, which this module registers into it when imported: the same function on this
rank's tokens (h.to_local()) and this rank's experts (Shard(0) on the expert mesh's `ep` dim: whole experts, E / ep
of them), with a `Communication` that
- exchanges tokens with the other ep ranks (`Exchange`): the per-expert counts first, so each rank knows how many
  rows it will receive, then the rows (`AllToAll`: differentiable, traceable by torch.compile, waited where first
  used), regrouped by local expert for one grouped GEMM, and back; in model.moe_overlap_chunks chunks, each
  all-to-all in flight while another chunk computes (`overlapped`), or, with model.moe_sub_batches, in steps
  between other sub-batches' work (`on_this_rank`, parallel/wavefront.py);
- sums per-expert statistics (loads, the balancing loss's counts) over every rank that holds other tokens of the
  micro-batch, so the balancing loss, the z-loss and the loads are the serial numbers whatever the data / sequence /
  expert layout (Megatron's known aux-loss-under-SP bug is this sum done over the wrong group);
- returns losses as partial sums (DTensors), which the loss adds like any other.

Gradients leave the local region with the placements their maths implies: the router's and the experts' are partial
sums over the ranks holding other tokens (reduced once per step by the optimizer placements, as DDP's are), and
replicated where ranks computed the same thing (the router on tensor-parallel ranks without sequence parallel).
There the experts are split instead (expert tensor parallel, plan.expert_tp_dim): each tp rank holds a slice of
every expert's hidden units, so its output is a partial sum over tp, all-reduced once per layer here, and the
gradients entering the experts are all-reduced on the way in (`into_split_experts`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from nanomega.hints import register
from nanomega.models.moe import balanced_counts, host_counts
from nanomega.parallel.mesh import group_over
from nanomega.parallel.plan import as_dtensor


@register("expert_parallel")
def experts_on_mesh(fn, params: dict, x, cfg):
    """fn(params, x, cfg, comm) -> (y, MoEStats) on this rank's tokens and experts (module doc); x is a DTensor."""
    local_params, local_x, comm, finish = on_this_rank(params, x, cfg)
    return finish(*fn(local_params, local_x, cfg, comm))


def on_this_rank(params: dict, x, cfg):
    """(this rank's router and experts, its tokens, their Communication, finish(y, stats) -> the hint's result):
    experts_on_mesh in two halves, so a caller may run the layer in phases (parallel/wavefront.py)."""
    mesh, token_placements = x.device_mesh, tuple(x.placements)
    # what a sum over this rank's tokens is: partial where the tokens are split, equal where they are not
    partial = tuple(Partial() if p.is_shard() else Replicate() for p in token_placements)
    router = {k: v.to_local(grad_placements=partial) if k == "weight" else v.detach().to_local()
              for k, v in params["router"].items()}
    any_expert = next(iter(params["experts"].values()))
    expert_mesh = any_expert.device_mesh
    # a gradient is split as its weight is (ep; etp under expert tensor parallel), partial over edp's other tokens
    experts = {k: v.to_local(grad_placements=tuple(Partial() if d == "edp" else p for d, p in
                                                   zip(expert_mesh.mesh_dim_names, v.placements)))
               for k, v in params["experts"].items()}
    split = any(p.is_shard() for d, p in zip(expert_mesh.mesh_dim_names, any_expert.placements) if d == "etp")
    comm = Communication(mesh, token_placements, expert_mesh, cfg.n_experts, cfg.moe_overlap_chunks, split)

    def finish(y, stats):
        # Expert tensor parallel (module doc): y is a partial sum over tp, all-reduced here (its backward passes the
        # replicated gradient as is); not carried on as Partial, since the block adds it to the residual stream and
        # the shared expert's output, laid out like the tokens, and the hint returns its input's layout.
        partial_tp = tuple(Partial() if split and d == "tp" else p for d, p in zip(mesh.mesh_dim_names,
                                                                                  token_placements))
        y = DTensor.from_local(y, mesh, partial_tp, run_check=False, shape=x.shape, stride=x.stride())
        return (y.redistribute(mesh, token_placements) if split else y), stats
    return {"router": router, "experts": experts}, x.to_local(), comm, finish


class Communication:
    """What routed_moe needs from the other ranks (models/moe.py's `Serial` is the one-process version)."""

    def __init__(self, mesh, token_placements, expert_mesh, n_experts: int, chunks: int, split_experts: bool):
        self.mesh = mesh
        names = expert_mesh.mesh_dim_names
        self._etp = (expert_mesh, names.index("etp")) if split_experts else None
        token_dims = [i for i, p in enumerate(token_placements) if p.is_shard()]
        sequence_dims = [i for i, p in enumerate(token_placements) if p == Shard(1)]
        self.token_shards = math.prod([mesh.size(i) for i in token_dims])
        self.sequence_shards = math.prod([mesh.size(i) for i in sequence_dims])
        self.batch_shards = self.token_shards // self.sequence_shards
        self._tokens = group_over(mesh, token_dims) if token_dims else None
        self._sequence = group_over(mesh, sequence_dims) if sequence_dims else None
        # a scalar share per rank is a 1-element shard of a [token_shards] vector; its sum is the total
        self._share = tuple(Shard(0) if p.is_shard() else Replicate() for p in token_placements)
        self.exchange = Exchange(expert_mesh, names.index("ep"), n_experts, chunks) if "ep" in names else None

    def sum_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._tokens is None else funcol.wait_tensor(funcol.all_reduce(x, "sum", self._tokens))

    def sum_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._sequence is None else funcol.wait_tensor(funcol.all_reduce(x, "sum", self._sequence))

    def into_split_experts(self, x: torch.Tensor) -> torch.Tensor:
        """x as it enters experts split over etp: each etp rank's gradient is its slice's partial sum, so the
        backward all-reduces it (Megatron's "f"); the forward is x itself."""
        return x if self._etp is None else SumGradient.apply(x, self._etp)

    def partial(self, x: torch.Tensor) -> DTensor:
        return as_dtensor(x.reshape(1), self.mesh, self._share, (self.token_shards,)).sum()


class Exchange:
    """Rows sorted by expert <-> the ranks that own the experts (ep ranks own E/ep consecutive experts), in
    `chunks` pieces whose all-to-alls overlap the experts' compute (`overlapped`)."""

    def __init__(self, expert_mesh, ep_dim: int, n_experts: int, chunks: int = 1):
        self.group = (expert_mesh, ep_dim)
        self.ep = expert_mesh.size(ep_dim)
        self.local = n_experts // self.ep
        self.chunks = chunks

    def counts(self, counts: torch.Tensor):
        """counts [chunks, E] (or [E]) of the rows to send -> (send, received), [ep, chunks, E/ep]: to / from rank r,
        per chunk, its local experts' counts. The exchange is in flight until `received` is first used."""
        send = counts.view(self.chunks, self.ep, self.local).transpose(0, 1)
        received = funcol.all_to_all_single(send.flatten(), None, None, self.group)
        return send, received.view(self.ep, self.chunks, self.local)

    def splits(self, send: torch.Tensor, received: torch.Tensor, m: int):
        """(send, receive) split sizes [chunks][ep] of this rank's m rows. The one host sync of the layer, inherent:
        all_to_all_single takes its split sizes as host ints (NCCL and gloo size their transfers, and the received
        tensor, from them). Every chunk, both ways, one read."""
        splits = host_counts(torch.stack([send.sum(2), received.sum(2)]).transpose(1, 2))   # [2, chunks, ep]
        return splits if splits is not None else list(zip(*map(self.balanced, balanced_counts(m, self.chunks))))

    def rows(self, rows: torch.Tensor, counts: torch.Tensor, compute, beside=None):
        """rows [M, d] grouped by chunk, then by (global) expert, with counts [chunks, E] -> compute(a chunk's
        local rows grouped by local expert, their counts [E/ep]) on the owners -> the outputs back in `rows`'
        order; beside() while the first dispatch is in flight."""
        send, received = self.counts(counts)
        send_splits, recv_splits = self.splits(send, received, len(rows))
        pieces = rows.split([sum(s) for s in send_splits])

        def dispatch(k):
            return AllToAll.apply(pieces[k], recv_splits[k], send_splits[k], self.group)

        def run(k, arrived):
            return self.grouped(arrived, received[:, k], sum(recv_splits[k]), compute)

        def combine(k, back):
            return AllToAll.apply(back, send_splits[k], recv_splits[k], self.group)

        return torch.cat(overlapped(self.chunks, dispatch, run, combine, beside))

    def grouped(self, arrived: torch.Tensor, received: torch.Tensor, n: int, compute) -> torch.Tensor:
        """compute(rows, counts [E/ep]) on the n rows that arrived, ordered (source rank, local expert) with counts
        received [ep, E/ep], grouped by local expert (then source) for the grouped GEMM, by a stable sort of their
        experts (output_size: the length is known, no second sync to count the repeats); outputs in arrival order."""
        experts = torch.arange(self.local, device=received.device).repeat(self.ep)
        order = experts.repeat_interleave(received.flatten(), output_size=n).argsort(stable=True)
        out = compute(arrived[order], received.sum(0))
        return torch.empty_like(out).index_copy(0, order, out)

    def balanced(self, m: int) -> tuple[list[int], list[int]]:
        """(send, receive) splits of m rows under balanced routing, every expert getting m / E of each rank's
        rows. The memory simulator (nanomega.sim.estimate) runs the step on fake tensors, which hold no counts
        to read; every ep rank holds as many tokens as this one, so each sends this rank the same share."""
        send = balanced_counts(m, self.ep)
        mesh, dim = self.group
        return send, [send[mesh.get_local_rank(dim)]] * self.ep

    def padded(self, slots: torch.Tensor, compute, beside=None):
        """slots [E, C, d], every expert padded to C rows -> compute([E/ep, ep*c, d]) on the owners -> back, in
        `chunks` pieces of the C slots. Equal splits: no counts to exchange, static shapes."""
        E, C, d = slots.shape
        if C < self.chunks:
            raise ValueError(f"model.moe_overlap_chunks={self.chunks} splits each expert's {C} capacity slots "
                             f"on this rank; choose at most {C}")
        pieces = slots.tensor_split(self.chunks, dim=1)

        def dispatch(k):
            return AllToAll.apply(pieces[k].reshape(-1, d), None, None, self.group)

        def run(k, arrived):
            c = pieces[k].shape[1]
            local = arrived.view(self.ep, self.local, c, d).transpose(0, 1).reshape(self.local, self.ep * c, d)
            return compute(local).view(self.local, self.ep, c, -1).transpose(0, 1).reshape(E * c, -1)

        def combine(k, out):
            return AllToAll.apply(out, None, None, self.group).view(E, pieces[k].shape[1], -1)

        return torch.cat(overlapped(self.chunks, dispatch, run, combine, beside), dim=1)


# How torch.compile traces a block holding an expert-parallel layer (compile_block): the split sizes' host read
# (host_counts) becomes unbacked ints in the graph, sizing the all-to-alls, the splits and the grouped GEMM's rows,
# and token dropping's kept assignments (nonzero) a tensor of unbacked length, rather than dynamo's graph break,
# which splits every frame from the block down to the read (11 graphs a block; tests/test_compiled_ep.py).
TRACED_COUNTS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}


def compile_block(fn, **options):
    """torch.compile(fn, **options), traced with TRACED_COUNTS: an MoE block, all-to-alls and counts included,
    is one graph (the read still syncs, inside it). The settings apply at each call, where dynamo traces, and to
    this function alone: the rest of the step compiles under dynamo's defaults."""
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch._dynamo.config.patch(TRACED_COUNTS):
            return compiled(*args, **kwargs)
    return run


def overlapped(n: int, dispatch, compute, combine, beside=None) -> list:
    """combine(k, compute(k, dispatch(k))) for chunks k < n, issued so each all-to-all has compute to hide
    behind, in the forward and in the backward (which runs the nodes in the reverse of their creation):

        D0 D1 E0 D2 E1 C0 D3 E2 C1 ... E(n-1) C(n-2) C(n-1)

    Chunk k + 1's dispatch is in flight while chunk k computes (D(k+1) before E(k)), and chunk k's combine is
    launched after chunk k + 1 computes (C(k) after E(k+1)), so in the backward C(k)'s gradient exchange runs
    while chunk k + 1's experts run their backward; its result is first used by the caller, after the last.
    What no chunk can hide: D0 in both passes (no compute before the first chunk), D1 in the backward (between
    the rows' gather and it only D0), C(n-1) in both and C(n-2) in the forward (no compute after the last).
    beside() (the shared expert: compute that needs no chunk) runs after D0 and before D1 is launched, so it
    hides D0 in the forward and D1 in the backward."""
    arrived, done, computed = {0: dispatch(0)}, [], None
    if beside is not None:
        beside()
    for k in range(n):
        if k + 1 < n:
            arrived[k + 1] = dispatch(k + 1)
        out = compute(k, arrived.pop(k))
        if computed is not None:
            done.append(combine(k - 1, computed))
        computed = out
    done.append(combine(n - 1, computed))
    return done


class AllToAll(torch.autograd.Function):
    """all_to_all_single whose result is waited for where first used, in the forward and in the backward
    (all_to_all_single_autograd's backward waits for its gradient exchange at once: nothing could hide it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        return funcol.all_to_all_single(x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_to_all_single(grad.contiguous(), *ctx.splits, ctx.group), None, None, None


class SumGradient(torch.autograd.Function):
    """The identity whose backward all-reduces the gradient over `group` (ranks holding partial sums of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None
