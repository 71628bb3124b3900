"""The train step: gradients of the loss over micro-batches, then one optimizer update.

It is two functions, each compiled on its own when asked:
  grads_fn(params, micro_batches) -> loss, grads, stats  (forward + backward; torch.compile on the loss)
  update(grads, s, params)        -> params, s           (opt.update, written into params and s)
The split lets the loop look at the loss before anything is changed. The update is the optimizer's pure update,
written into the old tensors as torch.optim's in-place step (make_update), where the step is kept
(optim.base.step_kept, decided once on the device): a non-finite step changes no parameter, moment, factor,
count or fp8 history, and the loop has nothing to restore. `stats` are the MoE router statistics of the step
(models.transformer.loss_and_stats; {} for a dense model): mean losses over the micro-batches, expert loads
summed; `update` also moves the routers' expert biases (aux-loss-free balancing) from those loads.

The loss runs the model unit by unit through `make_runner` (param_dtype, activation recomputation, FSDP's
gathers). On a mesh (`par`, parallel/parallelize.py's Layout) the same two functions run over DTensors, and
gradients stay partial sums over data parallel until the last micro-batch, so gradient accumulation
communicates once per step (FSDP's reduce-scatters: parallel/fsdp.py; one buffer per gradient: GradientSums).
`opt` is then a ParallelOptimizer, with the same protocol. The gradient's global norm is measured once, by the
optimizer's clip stage (optim.grad_norm). A Pipeline's schedule runs the stages in place of the micro-batch loop,
with the same runner and GradientSums (StepParts).

Delayed fp8 scaling's amax histories leave grads_fn in `stats["fp8_history"]` (the max over the micro-batches)
and `update` writes them back. The two functions share one fact the host knows: whether `update` has written
histories yet. Until it has, a history may be empty and each amax is reduced as it is taken; after, each rank
keeps its own amaxes within the step and one all-reduce at its end gives the same numbers (parallel/fp8.py,
"first step"). Only the collectives differ, never the results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from nanomega.config import AmaxesAtStepEnd, ModelConfig
from nanomega.models import recompute
from nanomega.models.fp8 import is_amax_history
from nanomega.models.moe import expert_bias_step
from nanomega.models.transformer import loss_and_stats, units
from nanomega.optim import GradientTransformation, grad_norm
from nanomega.optim.base import step_kept, write_back, write_where
from nanomega.parallel import fp8 as fp8_on_mesh
from nanomega.parallel import wavefront
from nanomega.parallel.experts import compile_block
from nanomega.parallel.deferred import accumulate, add_in_place, add_into, divide_in_place, storage_of
from nanomega.tree import (leaf_names, map_with_name, named_leaves, tree_flatten, tree_leaves, tree_map,
                           tree_unflatten)


def move_expert_biases(params, load: torch.Tensor, rate: float, cfg: ModelConfig):
    """Each MoE layer's router.expert_bias after one balancing step from its loads [moe layers, E]
    (the same numbers on every rank, so a replicated bias stays replicated); every other leaf as it is. Block i's
    row of `load` is the number of MoE layers before it in the whole model (cfg): a pipeline stage's tree holds
    only its own blocks, as {"<index>": block}."""
    def moved(name: str, x):
        if not name.endswith(".moe.router.expert_bias"):
            return x
        j = sum(map(cfg.is_moe_layer, range(int(name.split(".")[1]))))     # "layers.<i>.moe...": block i's row
        bias = x.detach()
        if isinstance(bias, DTensor):   # replicated on every mesh dim: step the local copy
            return DTensor.from_local(expert_bias_step(bias.to_local(), load[j], rate), bias.device_mesh,
                                      bias.placements, run_check=False)
        return expert_bias_step(bias, load[j], rate)
    return map_with_name(moved, params)


class StepFns(NamedTuple):
    grads: callable
    update: callable


def autocast(dtype: str, device: torch.device):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def make_runner(activation_checkpointing: str = "none", ac_every: int = 1, param_dtype: str = "float32",
                par=None, compile_units: bool = False):
    """run(name, fn, params, *args) for the model's units (models/transformer.py `units`), composed in a
    fixed order, innermost first: the unit's parameters cast to param_dtype, or on a mesh gathered
    to their compute placements in param_dtype (FSDP per unit: parallel/fsdp.py); then activation
    recomputation around that, so a recomputed unit gathers again in its backward; else, with
    parallel.reshard_after_forward, the gathered parameters freed after the forward by saved-tensor
    hooks. Every gather is launched outside the recomputed region, one unit ahead (parallel/fsdp.py's
    Prefetch); the recomputed function only unpacks. compile_units compiles each block's maths on its
    own (torchtitan's per-block compile): the hooks cannot be traced, so on a mesh the step compiles
    blocks rather than the whole loss. The embedding and the head run eagerly: compiled on their own,
    their backward can fail to partition (AOTAutograd: "Node tangents_2 was invalid, but is output") in
    a process that ran the step before."""
    dtype = getattr(torch, param_dtype)
    compiled = functools.cache(compile_block)     # each block function compiled once, counts traced (experts.py)

    def run(name, fn, p, *args):
        if compile_units and name.startswith("layers."):   # blocks only, as torchtitan compiles them
            fn = compiled(fn)
        recompute_it = recompute.recomputes(name, activation_checkpointing, ac_every)
        again = None
        if par is not None:
            par.before(name, p)     # FSDP's prefetch: this unit's gather and the next one's launched
            # how the backward gathers the unit again: by its recomputation (launched ahead of it, outside it),
            # or, freed after the forward, by saved-tensor hooks; else (and gathered once per step) it keeps them
            again = (None if par.gather_per_step else par.recomputed_gather() if recompute_it
                     else par.regather() if par.reshard_after_forward else None)

        def unit(p, *args):
            return fn(tree_map(lambda x: x.to(dtype), p) if par is None else par.gather(name, p, again), *args)
        if recompute_it:
            out = recompute.recomputed(unit, activation_checkpointing)(p, *args)
        else:
            with again if again is not None else contextlib.nullcontext():
                out = unit(p, *args)
        if par is not None:
            par.after(out)          # the backward's prefetch: launched from a hook on the unit's output
        return out
    return run


def step_options(t_cfg) -> dict:
    """The train section's settings that make_step_fns takes: make_step_fns(..., **step_options(cfg.train))."""
    keys = ("compile", "dtype", "activation_checkpointing", "ac_every", "param_dtype")
    return {k: getattr(t_cfg, k) for k in keys}


def make_step_fns(model_cfg: ModelConfig, opt: GradientTransformation, compile: bool = False,
                  dtype: str = "float32", par=None, activation_checkpointing: str = "none", ac_every: int = 1,
                  param_dtype: str = "float32") -> StepFns:
    """The step's two functions (module doc). On one process `compile` compiles the whole loss; on a
    mesh, each block (make_runner). `par` (parallel/parallelize.py's Layout): a Parallel runs the micro-batch
    loop below on its mesh, a Pipeline its schedule over the stages; either is handed the same StepParts."""
    written = SimpleNamespace(yet=False)    # whether update has written fp8 histories back yet (module doc)
    # the model as run once the histories hold a step: delayed amaxes kept local until the step's one reduction
    fields = {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}
    per_step_cfg = AmaxesAtStepEnd(**fields) if model_cfg.fp8 == "delayed" else model_cfg

    mesh = None if par is None else par.unit_par     # where each unit's parameters are gathered
    run = make_runner(activation_checkpointing, ac_every, param_dtype, mesh, compile_units=compile and par is not None)

    def loss(params, x, y, cfg):
        if cfg.moe_sub_batches > 1:     # every all-to-all behind another sub-batch's compute (parallel/wavefront.py)
            return wavefront.loss_and_stats(params, x, y, cfg, run)
        return loss_and_stats(params, x, y, cfg, run)

    loss = torch.compile(loss) if compile and par is None else loss

    def loop(params, micro_batches, cfg):
        """Mean loss over micro-batches, its gradient (summed per micro-batch, then averaged), stats."""
        leaves = tree_leaves(params)
        n = len(micro_batches)
        # on a mesh the step's data-parallel reductions start while the last backward runs (GradientSums)
        sums = GradientSums(params, n, None if par is None else par.reducer(), cfg=cfg)
        total_loss, total_stats = None, {}
        # on a mesh, the step's n micro-batches (FSDP may gather once per step: parallel/fsdp.py OncePerStep)
        with contextlib.nullcontext() if par is None else par.context(), \
                contextlib.nullcontext() if par is None else par.step(n):
            for i, (x, y) in enumerate(micro_batches):
                ahead = contextlib.nullcontext()
                if par is not None:
                    x, y = par.batch(x, y)
                    ahead = par.prefetching(units(params, model_cfg))   # FSDP gathers ahead
                with ahead, autocast(dtype, x.device):
                    value, stats = loss(params, x, y, cfg)
                # (the gradients are not held here: the last pass's are the reducer's now, not kept through its finish)
                sums.backward(leaves, lambda: torch.autograd.grad(value, leaves, allow_unused=True), final=i == n - 1)
                # starting from the first value, not 0.0: adding a float to a DTensor partial sum reduces it
                total_loss = value.detach() if total_loss is None else total_loss + value.detach()
                total_stats = {k: v + total_stats[k] if k in total_stats else v for k, v in stats.items()}
        means = ("ce", "aux_loss", "z_loss")    # the rest (expert loads, drops) are counts: summed
        stats = {k: v / n if k in means else v for k, v in total_stats.items()}
        grads, histories = sums.finish()
        if par is not None:   # one all-reduce for the loss and the router losses
            scalars = par.scalars({"loss": total_loss / n, **{k: v for k, v in stats.items() if k in means}})
            return scalars.pop("loss"), grads, {**stats, **histories, **scalars}
        return total_loss / n, grads, {**stats, **histories}

    def grads_fn(params, micro_batches):
        # once the histories hold a step, their amaxes are reduced once, at the end (module doc)
        cfg = per_step_cfg if written.yet else model_cfg
        if par is None:
            return loop(params, micro_batches, cfg)
        parts = StepParts(run, lambda: autocast(dtype, micro_batches[0][0].device), cfg,
                          functools.partial(loop, cfg=cfg), functools.partial(GradientSums, cfg=cfg))
        return par.grads(params, micro_batches, parts)

    return StepFns(grads_fn, make_update(model_cfg, opt, compile, written))


class StepParts(NamedTuple):
    """What the step hands its layout's `grads` (parallel/parallelize.py Layout): a Parallel runs `loop`, the
    micro-batch loop, on its mesh; a Pipeline runs its schedule with the rest."""
    run: callable          # the unit runner (make_runner), on the stage's mesh
    autocast: callable     # autocast(): a fresh autocast context of the step
    cfg: ModelConfig       # the model as this step runs it (fp8 histories: module doc)
    loop: callable         # loop(params, micro_batches) -> (loss, grads, stats)
    sums: callable         # sums(params, n, reducer) -> GradientSums


class GradientSums:
    """A step's gradients summed over its micro-batches: the one logic of the plain step and of each pipeline
    stage's passes (parallel/pipeline.py is handed it). A parameter autograd did not reach gets zeros (an
    expert bias only moves the router's choice: every optimizer leaves it unchanged; it is never decayed). A
    delayed fp8 amax history is not a gradient: its newest amaxes are combined by max over the micro-batches
    and the optimizer gets zeros. On a mesh the final pass over a parameter (the last micro-batch's backward)
    hands each gradient to the data-parallel reducer as soon as autograd has it (parallel/buckets.py), with
    the sum of the earlier passes; the reducer adds and divides where it first needs the values, so an FSDP
    gradient, a pending reduce-scatter's result, is not waited for here.

    One buffer per gradient (Megatron's accumulation, docs/memory.md): each pass's gradient is added into the
    earlier passes' sum as autograd hands it over, in that sum's buffer, and the final pass's divided there too,
    so a backward never holds a micro-batch's whole gradients beside the sum. An FSDP gradient still in flight
    is added where its reduce-scatter is waited (deferred.add_into); any other (DDP's and ZeRO-1's partial sums,
    TP's, one process's) at once (deferred.add_in_place), and the hook hands autograd the sum in its place, so
    the micro-batch's own gradient is dropped there. The first pass's gradients become the sum's buffers (no
    copy); a buffer is only written in place where no other sum holds it (a gradient autograd hands two leaves,
    `owners`) and it is dense (not a broadcast's stride-0 view). The numbers are (((g1 + g2) + ...) + gn) / n,
    the same operations as a sum made after each backward, so the same bits."""

    def __init__(self, params, n: int, reducer=None, *, cfg: ModelConfig):
        leaves, self.spec = tree_flatten(params)
        self.names = leaf_names(params)
        self.index = {id(x): j for j, x in enumerate(leaves)}
        self.histories = {j for j, name in enumerate(self.names) if is_amax_history(name)}
        self.totals: list = [None] * len(leaves)
        self.n, self.cfg, self.reducer = n, cfg, reducer
        self.handed: set = set()
        self.summed: set = set()     # the pass's gradients already added into totals, by leaf index
        self.divided: set = set()    # one process: the totals already divided by n (the final pass's, in place)
        self.owners: dict = {}       # a sum's storage -> how many totals hold it (in place only into a sole one)

    def backward(self, leaves: list, backward, final: bool) -> tuple:
        """backward() -> (..., then the gradients of `leaves`, None where autograd reached none), returned as it is,
        run while `leaves`' gradients are summed in place as autograd produces them (class doc) and a final pass's go
        to the reducer; what is left of them is then added to the sums (`add`)."""
        self.summed = set()
        hooked = self.reducer is not None or self.n > 1      # one process, one micro-batch: nothing to sum
        hooks = ([p.register_hook(functools.partial(self._arrived, self.index[id(p)], final=final)) for p in leaves]
                 if hooked else [])
        try:
            got = backward()
        finally:
            for h in hooks:
                h.remove()
        self.add(leaves, got[len(got) - len(leaves):], final)
        return got

    def _arrived(self, j: int, g, final: bool):
        """Leaf j's gradient of this pass, as autograd hands it over: added into the sum (the final pass's divided
        by n: the step's gradient), and the final pass's then the reducer's; what the hook returns (the sum, or
        None: g itself) is what autograd hands on."""
        if j in self.histories:
            return None
        total, n, out = self.totals[j], self.n if final else 1, None
        # (the final pass of a gradient earlier passes did not reach: divided in place)
        if (n > 1 and divide_in_place(g, n)) if total is None else add_into(total, g, n):
            self.totals[j] = g
            self.summed.add(j)
        elif total is not None and self.owners.get(storage_of(total)) == 1 and add_in_place(total, g, n):
            self.summed.add(j)
            out = total
        if not final:
            return out
        self.handed.add(j)
        if self.reducer is None and j in self.summed:
            self.divided.add(j)
        elif self.reducer is not None:     # the reducer's from now on: dropped here once packed into its bucket
            # (buckets.py): the sum, or this pass's gradient with the earlier passes' sum
            self.reducer.add(self.names[j], *((self.totals[j],) if j in self.summed else (g, self.totals[j], self.n)))
            self.totals[j] = None
        return out

    def add(self, leaves: list, grads, final: bool) -> None:
        """One pass's gradients of `leaves` (None where autograd reached none) added to the sums."""
        to_reducer = final and self.reducer is not None
        for p, g in zip(leaves, grads):
            j = self.index[id(p)]
            if g is None and not final and self.totals[j] is None and j not in self.histories:
                continue    # nothing yet (FSDP gathering once per step: the unit's sum comes in its last pass)
            g = torch.zeros_like(p) if g is None else g
            if j in self.histories:
                self.totals[j] = g if self.totals[j] is None else torch.maximum(self.totals[j], g)
                if to_reducer:
                    self.reducer.add(self.names[j], torch.zeros_like(g))
            elif to_reducer:
                if j not in self.handed:    # no gradient reached it during the backward: zeros
                    self.reducer.add(self.names[j], g, self.totals[j], self.n)
            elif j not in self.summed:     # (an FSDP gradient still in flight: added where the sum is first read)
                total = self.totals[j] = g if self.totals[j] is None else accumulate(self.totals[j], g)
                if (address := storage_of(total)) != 0:
                    self.owners[address] = self.owners.get(address, 0) + 1

    def finish(self) -> tuple:
        """(the step's gradients as a tree, on a mesh the reducer's in the optimizer's placements; the stats' entry
        {"fp8_history": {name: the history one step on}}, {} without delayed fp8 scaling). The newest amaxes are
        reduced over the ranks (parallel/fp8.py) where the step kept them local (cfg.fp8_amax_reduction == "step")."""
        newest = {self.names[j]: self.totals[j].detach() for j in sorted(self.histories)}
        if newest and self.cfg.fp8_amax_reduction == "step":
            newest = fp8_on_mesh.reduce_histories(newest)
        histories = {"fp8_history": newest} if newest else {}
        if self.reducer is not None:
            reduced = self.reducer.finish()
            return tree_unflatten([reduced[name] for name in self.names], self.spec), histories
        n = self.n
        return tree_unflatten([torch.zeros_like(g) if j in self.histories else g if j in self.divided or n == 1
                               else g / n for j, g in enumerate(self.totals)], self.spec), histories


def make_update(model_cfg: ModelConfig, opt: GradientTransformation, compile: bool = False,
                written: SimpleNamespace | None = None):
    """update(grads, opt_state, params, stats=None, keep=None) -> (params, opt_state): the optimizer's update
    written into `params` and `opt_state`'s own tensors (they are consumed), then the routers' expert biases moved
    and delayed fp8 histories written back (`written` records that). Nothing changes where optim.base.step_kept
    says no (a non-finite gradient norm, or `keep` false: train.py's finite loss) but the clip stage's norm, so
    the loop can see why (optim.grad_norm)."""
    by_leaf = not compile and getattr(opt, "leaf_by_leaf", None) is not None
    step = functools.partial(optimizer_step, opt, by_leaf)
    step = torch.compile(step) if compile else step

    def update(grads, opt_state, params, stats=None, keep=None):
        # No autograd here: weight decay reads the parameters (which require grad), and a recorded
        # update would chain every step's parameters to the last one's graph (memory growing per step).
        with torch.no_grad():
            opt_state, kept = step(grads, opt_state, params, keep)
            if model_cfg.expert_bias_rate and stats:
                moved = move_expert_biases(params, stats["expert_load"], model_cfg.expert_bias_rate, model_cfg)
                for old, new in zip(tree_leaves(params), tree_leaves(moved)):
                    if new is not old:
                        write_where(kept, old.detach(), new)
            if stats and "fp8_history" in stats:   # delayed fp8 scaling's amax histories, one step on
                held = named_leaves(params)
                for name, history in stats["fp8_history"].items():
                    write_where(kept, held[name].detach(), history)
                if written is not None:
                    written.yet = True
        for p in tree_leaves(params):
            p.requires_grad_(True)    # leaves for the next step's gradient
        return params, opt_state

    return update


def optimizer_step(opt, by_leaf: bool, grads, opt_state, params, keep=None):
    """(opt_state, kept): `params` and `opt_state` one step on, written into their own tensors where the step is
    kept (optim.base.step_kept), with apply_updates(params, opt.update(...))'s numbers, bit for bit. by_leaf (an
    element-wise optimizer, eager): optim.optimizer's leaf_by_leaf, one parameter at a time. Else opt.update over
    the whole tree, written back (optim.write_back): compiled, inductor fuses each element-wise chain into a kernel
    that stores into the old buffer (docs/memory.md)."""
    leaves = [p.detach() for p in tree_leaves(params)]

    def apply(i, update, kept):
        write_where(kept, leaves[i], torch._foreach_add([leaves[i]], [update])[0])   # apply_updates' own op

    if by_leaf:
        return opt.leaf_by_leaf(grads, opt_state, params, apply, keep)
    updates, new_state = opt.update(grads, opt_state, params)
    kept = step_kept(grad_norm(new_state), keep)
    for i, update in enumerate(tree_leaves(updates)):
        apply(i, update, kept)
    # the clip stage's norm is the step's measurement, kept either way (make_update)
    return {k: new_state[k] if k == "clip" else write_back(opt_state[k], new_state[k], kept) for k in opt_state}, kept
