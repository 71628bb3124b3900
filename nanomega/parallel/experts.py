"""Expert parallel: each rank routes its own tokens, sends them to the ranks owning their experts by
all-to-all, runs its experts, and sends the outputs back.

    y, stats = expert_parallel(moe.routed_moe, {"router": ..., "experts": ...}, h, cfg)   # in the model

The model calls the hint `nanomega.hints.expert_parallel`: on plain tensors it is `routed_moe(params,
h, cfg)`. On a mesh the hint runs `experts_on_mesh`, which this module registers into it when
imported: the same function on this rank's tokens (h.to_local()) and this rank's experts (Shard(0)
on the expert mesh's `ep` dim: whole experts, E / ep of them), with a `Communication` that
- exchanges tokens with the other ep ranks (`Exchange`): the per-expert counts first (all_to_all_single,
  so each rank knows how many rows it will receive), then the rows with
  `all_to_all_single_autograd` (functional collectives: differentiable, and traceable by torch.compile),
  regrouped by local expert for one grouped GEMM, and back the same way;
- sums per-expert statistics (loads, the balancing loss's counts) over every rank that holds other
  tokens of the micro-batch, so the balancing loss, the z-loss and the loads are the serial numbers
  whatever the data / sequence / expert layout (Megatron's known aux-loss-under-SP bug is this sum
  done over the wrong group);
- returns losses as partial sums (DTensors), which the loss adds like any other.

Gradients leave the local region with the placements their maths implies: the router's and the
experts' are partial sums over the ranks holding other tokens (reduced once per step by the optimizer
placements, as DDP's are), and replicated where ranks computed the same thing (tensor-parallel ranks
without sequence parallel).
"""
from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from nanomega.hints import register
from nanomega.models.moe import host_counts
from nanomega.parallel.mesh import group_over


@register("expert_parallel")
def experts_on_mesh(fn, params: dict, x, cfg):
    """fn(params, x, cfg, comm) -> (y, MoEStats) on this rank's tokens and experts (module doc); x is a DTensor."""
    mesh, token_placements = x.device_mesh, tuple(x.placements)
    # what a sum over this rank's tokens is: partial where the tokens are split, equal where they are not
    partial = tuple(Partial() if p.is_shard() else Replicate() for p in token_placements)
    router = {k: v.to_local(grad_placements=partial) if k == "weight" else v.detach().to_local()
              for k, v in params["router"].items()}
    any_expert = next(iter(params["experts"].values()))
    expert_mesh = any_expert.device_mesh
    expert_grads = tuple(Shard(0) if d == "ep" else Partial() if d == "edp" else Replicate()
                         for d in expert_mesh.mesh_dim_names)
    experts = {k: v.to_local(grad_placements=expert_grads) for k, v in params["experts"].items()}
    comm = Communication(mesh, token_placements, expert_mesh, cfg.n_experts)
    y, stats = fn({"router": router, "experts": experts}, x.to_local(), cfg, comm)
    y = DTensor.from_local(y, mesh, token_placements, run_check=False, shape=x.shape, stride=x.stride())
    return y, stats


class Communication:
    """What routed_moe needs from the other ranks (models/moe.py's `Serial` is the one-process version)."""

    def __init__(self, mesh, token_placements, expert_mesh, n_experts: int):
        self.mesh = mesh
        token_dims = [i for i, p in enumerate(token_placements) if p.is_shard()]
        sequence_dims = [i for i, p in enumerate(token_placements) if p == Shard(1)]
        self.token_shards = math.prod(mesh.size(i) for i in token_dims)
        self.sequence_shards = math.prod(mesh.size(i) for i in sequence_dims)
        self.batch_shards = self.token_shards // self.sequence_shards
        self._tokens = group_over(mesh, token_dims) if token_dims else None
        self._sequence = group_over(mesh, sequence_dims) if sequence_dims else None
        # a scalar share per rank is a 1-element shard of a [token_shards] vector; its sum is the total
        self._share = tuple(Shard(0) if p.is_shard() else Replicate() for p in token_placements)
        names = expert_mesh.mesh_dim_names
        self.exchange = Exchange(expert_mesh, names.index("ep"), n_experts) if "ep" in names else None

    def sum_tokens(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._tokens is None else funcol.wait_tensor(funcol.all_reduce(x, "sum", self._tokens))

    def sum_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._sequence is None else funcol.wait_tensor(funcol.all_reduce(x, "sum", self._sequence))

    def partial(self, x: torch.Tensor) -> DTensor:
        shares = DTensor.from_local(x.reshape(1), self.mesh, self._share, run_check=False,
                                    shape=torch.Size([self.token_shards]), stride=(1,))
        return shares.sum()


class Exchange:
    """Rows sorted by expert <-> the ranks that own the experts (ep ranks own E/ep consecutive experts)."""

    def __init__(self, expert_mesh, ep_dim: int, n_experts: int):
        self.group = (expert_mesh, ep_dim)
        self.ep = expert_mesh.size(ep_dim)
        self.local = n_experts // self.ep

    def rows(self, rows: torch.Tensor, counts: torch.Tensor, compute):
        """rows [M, d] grouped by (global) expert with counts [E] -> compute(local rows grouped by local
        expert, their counts [E/ep]) on the owners -> the outputs back in `rows`' order."""
        send = counts.view(self.ep, self.local)                     # to rank r: its experts' counts
        received = funcol.all_to_all_single(send.flatten(), None, None, self.group)
        received = received.view(self.ep, self.local)               # from rank s: per local expert
        # The one host sync of the layer, inherent: all_to_all_single takes its split sizes as host ints (NCCL
        # and gloo size their transfers, and the received tensor, from them). Both directions in one read.
        splits = host_counts(torch.stack([send.sum(1), received.sum(1)]))
        send_splits, recv_splits = splits if splits is not None else self.balanced(len(rows))
        arrived = funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        # arrived is ordered (source rank, local expert); the grouped GEMM wants (local expert, source)
        sizes = received.flatten()
        starts = sizes.cumsum(0) - sizes                            # of each (source, expert) block
        by_expert = received.t().flatten()
        starts_by_expert = starts.view(self.ep, self.local).t().flatten()
        offset = starts_by_expert - (by_expert.cumsum(0) - by_expert)
        # output_size: the length is known (no second sync to count the repeats)
        order = (torch.arange(len(arrived), device=rows.device)
                 + offset.repeat_interleave(by_expert, output_size=len(arrived)))
        out = compute(arrived[order], received.sum(0))
        back = torch.empty_like(out).index_copy(0, order, out)      # (source, expert) order again
        return funcol.all_to_all_single_autograd(back, send_splits, recv_splits, self.group)

    def balanced(self, m: int) -> tuple[list[int], list[int]]:
        """(send, receive) splits of m rows under balanced routing, every expert getting m / E of each rank's
        rows. The memory simulator (nanomega.sim.estimate) runs the step on fake tensors, which hold no counts
        to read; every ep rank holds as many tokens as this one, so each sends this rank the same share."""
        send = [m // self.ep + (r < m % self.ep) for r in range(self.ep)]
        mesh, dim = self.group
        return send, [send[mesh.get_local_rank(dim)]] * self.ep

    def padded(self, slots: torch.Tensor, compute):
        """slots [E, C, d], every expert padded to C rows -> compute([E/ep, ep*C, d]) on the owners -> back.
        Equal splits: no counts to exchange, static shapes."""
        E, C, d = slots.shape
        arrived = funcol.all_to_all_single_autograd(slots.reshape(E * C, d), None, None, self.group)
        local = arrived.view(self.ep, self.local, C, d).transpose(0, 1).reshape(self.local, self.ep * C, d)
        out = compute(local).view(self.local, self.ep, C, -1).transpose(0, 1).reshape(E * C, -1)
        return funcol.all_to_all_single_autograd(out, None, None, self.group).view(E, C, -1)
