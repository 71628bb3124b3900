"""Turn the serial model and batch into their parallel form on a mesh, for the train step.

    par = Parallel(cfg, mesh, init(..., device="meta"))     # the sharding plan of every parameter
    params = init(..., place=lambda name, part: par.shard(name, part, device))   # DTensors, storage placements
    x, y = par.batch(x, y)                        # the global batch, split as the layout says
    with par.context(), par.prefetching(units(params, model_cfg)):  # gathers one unit ahead
        loss = loss_fn(params, x, y, model_cfg, run)   # run: each unit's parameters par.gather-ed (step.py)
    reducer = par.reducer()                       # DDP all-reduce / ZeRO reduce-scatter, once per step,
    ... gradient hooks: reducer.add(name, grad)   # in buckets launched during the last backward
    grads = reducer.finish()

The order is torchtitan's: the model is pure, the plan is data, and this file applies it. Everything
is DTensor: the collectives are the ones its placements imply (docs/parallelism.md lists them).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication, register_sharding

from nanomega.parallel import context   # registers context-parallel attention and sequence order (model hints)
from nanomega.parallel import experts  # noqa: F401  (registers the expert-parallel runtime into the model's hint)
from nanomega.parallel import fp8  # noqa: F401  (registers float8 matmuls on a mesh into the model's hint)
from nanomega.parallel import vocab_loss  # noqa: F401  (registers the vocab-parallel fused loss into the model's hint)
from nanomega.models.transformer import forward, loss_and_stats
from nanomega.parallel import plan as planning
from nanomega.parallel.buckets import GradientReducer
from nanomega.parallel.fsdp import UnitGather
from nanomega.parallel.mesh import DP_DIMS, build_expert_mesh, create_groups, group_over
from nanomega.tree import map_with_name, named_leaves, tree_flatten, tree_unflatten

aten = torch.ops.aten


# DTensor has no sharding rule for CPU's fused attention kernel (CUDA's have one): attention is
# independent per sequence and per head, so it may run sharded on the batch or on the heads.
@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _cpu_attention_sharding(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
    return [([Shard(d), Shard(d)], [Shard(d), Shard(d), Shard(d), None, None, None, None]) for d in (0, 1)] + \
           [([Replicate(), Replicate()], [Replicate(), Replicate(), Replicate(), None, None, None, None])]


@register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _cpu_attention_backward_sharding(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                                     attn_mask=None, scale=None):
    return [([Shard(d)] * 3, [Shard(d)] * 6 + [None] * 4) for d in (0, 1)] + \
           [([Replicate()] * 3, [Replicate()] * 6 + [None] * 4)]


class Parallel(UnitGather):
    """The mesh and the placements of every parameter and batch for one run; as a UnitGather, it gathers each
    unit's parameters (`gather`, `prefetching`, `before`, `after`: parallel/fsdp.py)."""

    def __init__(self, cfg, mesh, params):
        self.mesh = mesh
        self.expert_mesh = build_expert_mesh(cfg, mesh.device_type)   # None for a dense model
        create_groups(mesh)                # every group a step may use, now, on every rank in one order
        create_groups(self.expert_mesh)
        super().__init__(cfg, planning.plan(params, mesh, cfg, self.expert_mesh))
        dims = mesh.mesh_dim_names
        # tokens [B, T]: batch split over the data-parallel dims, sequence over cp (context parallel, in
        # the load-balanced order: `batch`) and over tp under sequence parallel (nested inside cp's chunk)
        sp = cfg.parallel.sequence_parallel
        self.token_placements = tuple(Shard(0) if d in DP_DIMS else Shard(1) if d == "cp" or sp else Replicate()
                                      for d in dims)
        self.target_placements = tuple(Shard(0) if d in DP_DIMS else Shard(1) if d == "cp" else Replicate()
                                       for d in dims)

    @property
    def layout_key(self) -> dict:
        """What fixes where each shard and each optimizer state lives: a checkpoint resumes only under the same."""
        p = self.cfg.parallel
        key = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp,
               "distributed_optimizer": p.distributed_optimizer}
        key |= {d: getattr(p, d) for d in ("ep", "cp") if getattr(p, d) > 1}   # named only when used
        # the state sharded over cp too (plan.py; a checkpoint written before, whose key lacks this, is resharded)
        return key | ({"state_over_cp": True} if "cp" in planning.state_dims(self.cfg) else {})

    def shard(self, name: str, part, device) -> DTensor:
        """This rank's shard of parameter `name` on `device`, as a DTensor leaf. part(index) gives the slices
        `index` of the whole parameter (models.transformer.init's place hook draws only those), so neither
        the CPU nor the device ever holds the whole parameter."""
        layout = self.layouts[name]
        index = planning.shard_index(layout.shape, layout.storage, layout.mesh.shape, layout.mesh.get_coordinate())
        local = part(index).to(device).contiguous()
        return planning.as_dtensor(local, layout.mesh, layout.storage, layout.shape).requires_grad_(True)

    def batch(self, x: torch.Tensor, y: torch.Tensor):
        """The global batch (the same on every rank) -> this rank's slice, as DTensors. Under context
        parallel the sequence is first permuted to the load-balanced order (parallel/context.py), so the
        contiguous chunks DTensor gives the cp ranks are their load-balanced shards."""
        if "cp" in self.mesh.mesh_dim_names:
            order = context.load_balanced_order(x.shape[1], self.cfg.parallel.cp).to(x.device)
            x, y = x.index_select(1, order), y.index_select(1, order)
        x = distribute_tensor(x, self.mesh, self.token_placements, src_data_rank=None)
        y = distribute_tensor(y, self.mesh, self.target_placements, src_data_rank=None)
        return x, y

    def context(self):
        stack = contextlib.ExitStack()
        if "tp" in self.mesh.mesh_dim_names:   # cross-entropy on vocab-sharded logits (torch's loss_parallel)
            stack.enter_context(context.loss_parallel())
        stack.enter_context(implicit_replication())   # RoPE tables, masks: plain tensors, same on every rank
        if "cp" in self.mesh.mesh_dim_names:
            stack.enter_context(context.method(self.cfg.parallel.cp_method))   # attention over the cp ranks
        return stack

    def reducer(self) -> GradientReducer:
        """The step's data-parallel reductions (gradients Partial over data parallel, or already
        reduce-scattered, -> optimizer placements), in reduce_dtype, bucketed and launched as the last
        micro-batch's backward hands over each gradient (parallel/buckets.py)."""
        return GradientReducer(self.layouts, self.cfg.parallel.bucket_mb * 2**20, self.reduce_dtype)

    def scalar(self, value: DTensor) -> torch.Tensor:
        """A DTensor scalar (the loss: a partial sum over data parallel) as a plain tensor, with one
        all-reduce over the flattened partial dims (full_tensor() would issue one per mesh dim)."""
        partial = [i for i, p in enumerate(value.placements) if p.is_partial()]
        if len(partial) < 2:
            return value.full_tensor()
        return funcol.all_reduce(value.to_local(), "sum", group_over(self.mesh, partial))

    def scalars(self, values: dict) -> dict:
        """Several scalar DTensors (the loss and the router losses) as plain tensors: one all-reduce per
        distinct placement, of the stacked local values."""
        groups: dict[tuple, list[str]] = {}
        for name, v in values.items():
            groups.setdefault(tuple(v.placements), []).append(name)
        out = {}
        for placements, names in groups.items():
            stacked = torch.stack([values[n].to_local() for n in names])
            stacked = DTensor.from_local(stacked, self.mesh, placements, run_check=False)
            out.update(zip(names, self.scalar(stacked).unbind(0)))
        return out

    def full(self, tree):
        """Every DTensor leaf gathered whole (a collective: every rank must call it)."""
        return map_with_name(lambda n, x: x.full_tensor() if isinstance(x, DTensor) else x, tree)

    def full_on_main(self, tree):
        """Every leaf whole on rank 0, None on the others (a collective: every rank must call it): gathered_on_main
        with every leaf held by every rank."""
        return gathered_on_main(tree, named_leaves(tree), lambda name: 0)

    # ------------------------------------------------------------ the Layout protocol (below)

    @property
    def unit_par(self) -> Parallel:
        return self

    def grads(self, params, micro_batches, parts):
        return parts.loop(params, micro_batches)

    def cross_entropy(self, params, x, y, model_cfg, run, autocast) -> torch.Tensor:
        with autocast(), self.context():
            x, y = self.batch(x, y)
            loss, stats = loss_and_stats(params, x, y, model_cfg, run)
            return self.scalar(stats.get("ce", loss)).float()

    def logits_at(self, params, tokens, row: torch.Tensor, model_cfg, run, autocast) -> torch.Tensor:
        with autocast():
            logits = forward(params, tokens, model_cfg, run)
        return (logits.full_tensor() if isinstance(logits, DTensor) else logits).index_select(1, row)[:, 0]


class Layout(Protocol):
    """What the train step, evaluation and the sample ask of a run on a mesh (`par`): a Parallel, every rank
    running the whole model, or a Pipeline (parallel/pipeline.py), a rank running its stages, each on the
    Parallel of the stage's own sub-mesh or, alone on its process, on none. Every method is a collective."""

    @property
    def unit_par(self) -> Parallel | None:
        """Where each unit's parameters are gathered (step.make_runner): a Parallel, or a stage's (None)."""

    @property
    def layout_key(self) -> dict:
        """What fixes where each shard and each optimizer state lives (checkpoints)."""

    def grads(self, params, micro_batches, parts) -> tuple:
        """(mean loss, gradients in the optimizer placements, stats) of one step; parts: step.StepParts."""

    def cross_entropy(self, params, x, y, model_cfg, run, autocast) -> torch.Tensor:
        """The batch's mean cross-entropy, a float32 scalar on every rank's device (evaluate.validation_loss)."""

    def logits_at(self, params, tokens, row: torch.Tensor, model_cfg, run, autocast) -> torch.Tensor:
        """[B, padded vocab]: the logits at the sequence's row `row` ([1]) of tokens placed as unit_par places a
        context (parallel/sample.py), on every rank."""

    def full_on_main(self, tree):
        """Every parameter whole on global rank 0 (None elsewhere), one at a time."""


def gathered_on_main(whole, mine: dict, sender: Callable[[str], int]):
    """Every leaf of `whole` (the whole model's tree: its names, shapes and dtypes) whole on global rank 0, None
    on the others: a collective, one leaf at a time, so no rank holds more than one whole parameter it does not
    keep. The ranks that hold a leaf (mine: {name: this rank's leaf}) gather it over their mesh (full_tensor);
    where rank 0 is not among them, sender(name), the global rank that holds it at rank 0's other coordinates,
    sends it to rank 0 (a pipeline stage's: Pipeline.full_on_main). sender(name) is 0 where rank 0 holds it."""
    rank = torch.distributed.get_rank()
    device = next(iter(mine.values())).device      # a received tensor lands on this rank's device (NCCL)
    out = []
    for name, like in named_leaves(whole).items():
        x = mine.get(name)
        full = None if x is None else x.full_tensor() if isinstance(x, DTensor) else x.detach()
        source = sender(name)
        if source != 0:
            if rank == source:
                torch.distributed.send(full.contiguous(), 0)
            elif rank == 0:
                full = torch.empty(like.shape, dtype=like.dtype, device=device)
                torch.distributed.recv(full, source)
        out.append(full if rank == 0 else None)
    return tree_unflatten(out, tree_flatten(whole)[1]) if rank == 0 else None
