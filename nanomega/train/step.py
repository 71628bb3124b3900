"""The train step: gradients of the loss over micro-batches, then one optimizer update.

It is two functions, each compiled on its own when asked:
  grads_fn(params, micro_batches) -> loss, grads, stats  (forward + backward; torch.compile on the loss)
  update_fn(grads, s, params)     -> params, s           (opt.update + apply_updates)
The update is the optimizer's pure update, written into the old tensors as torch.optim's in-place step
(make_update): eager, for an element-wise optimizer (AdamW, SGD), one parameter at a time (update_in_place:
its peak is the held state plus one parameter's temporaries); compiled, as one graph whose results are
copied into the old buffers (update_written_back: inductor stores into them directly). Eager for a matrix
optimizer it runs over the whole tree, new tensors beside the old.
`stats` are the MoE router statistics of the step (models.transformer.loss_and_stats; {} for a dense
model): mean losses over the micro-batches, expert loads summed. `update` also moves the routers'
expert biases (aux-loss-free balancing) from those loads, outside the gradient.
The split lets the loop look at the loss (finite or not) before anything is changed, so a
non-finite step can be skipped or stopped without touching the parameters or the checkpoint.

The loss runs the model unit by unit (embedding, blocks, head) through `make_runner`, which applies
train.param_dtype and activation recomputation (nanomega/models/recompute.py) to each unit.
On a mesh (`par`, parallel/parallelize.py) the same two functions run over DTensors: the batch is
placed, each unit's parameters are gathered just before it runs (parallel/fsdp.py), and gradients stay partial sums over data parallel
until the last micro-batch, so gradient accumulation communicates once per step (FSDP's gradients
are reduce-scattered by its backward, once per micro-batch, as FSDP2's by default: reducing once per
step would hold the whole gradient unsharded across micro-batches; the last micro-batch's stay in
flight until the reducer adds them to the running sum, parallel/buckets.py). `opt` is then a
ParallelOptimizer, with the same protocol: updates in the parameters' placements. The gradient's global
norm is measured once, by the optimizer's clip stage, and read from the state (optim.grad_norm).

Delayed fp8 scaling's amax histories leave grads_fn in `stats["fp8_history"]`, combined over the micro-batches
by max and, on a mesh, over the ranks by one all-reduce at the end of the step (parallel/fp8.py); `update`
writes them back. The two functions share one fact the host knows: whether their update has written histories
yet. Until it has, a history may be empty (a fresh model), the step scales by its own amaxes, and each is
reduced as it is taken; after, each rank keeps its own amaxes within the step and the one reduction at its end
gives the same numbers (parallel/fp8.py, "first step"). Only the collectives differ, never the results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from nanomega.config import ModelConfig
from nanomega.models import recompute
from nanomega.models.fp8 import is_amax_history
from nanomega.models.moe import expert_bias_step
from nanomega.models.transformer import loss_and_stats, units
from nanomega.optim import GradientTransformation, apply_updates, grad_norm
from nanomega.optim.base import write_back
from nanomega.parallel import fp8 as fp8_on_mesh
from nanomega.parallel.fsdp import accumulate
from nanomega.tree import leaf_names, map_with_name, tree_flatten, tree_leaves, tree_map, tree_unflatten


def move_expert_biases(params, load: torch.Tensor, rate: float, cfg: ModelConfig | None = None):
    """Each MoE layer's router.expert_bias after one balancing step from its loads [moe layers, E]
    (the same numbers on every rank, so a replicated bias stays replicated). A pipeline stage's tree
    holds its blocks as {"<index>": block}: its rows of `load` are found from cfg (row j: the j-th MoE
    layer of the whole model)."""
    blocks = params["layers"]
    if isinstance(blocks, dict):
        rows = [sum(map(cfg.is_moe_layer, range(int(i)))) for i in blocks]
        items = list(blocks.items())
    else:
        rows = list(itertools.accumulate(["moe" in layer for layer in blocks], initial=0))
        items = list(enumerate(blocks))
    layers = {}
    for (key, layer), j in zip(items, rows):
        if "moe" in layer and "expert_bias" in layer["moe"]["router"]:
            router = layer["moe"]["router"]
            bias = router["expert_bias"].detach()
            if isinstance(bias, DTensor):   # replicated on every mesh dim: step the local copy
                new = DTensor.from_local(expert_bias_step(bias.to_local(), load[j], rate), bias.device_mesh,
                                         bias.placements, run_check=False)
            else:
                new = expert_bias_step(bias, load[j], rate)
            layer = {**layer, "moe": {**layer["moe"], "router": {**router, "expert_bias": new}}}
        layers[key] = layer
    return {**params, "layers": layers if isinstance(blocks, dict) else list(layers.values())}


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
    Prefetch: the forward's before the unit before it runs, the backward's from a hook on the unit's
    output); the recomputed function only unpacks. compile_units compiles each block's maths on its
    own (torchtitan's per-block compile): the hooks cannot be traced, so on a mesh the step compiles
    blocks rather than the whole loss. The embedding and the head run eagerly: compiled on their own,
    their backward can fail to partition (AOTAutograd: "Node tangents_2 was invalid, but is output") in
    a process that ran the step before."""
    dtype = getattr(torch, param_dtype)
    compiled = {}

    def run(name, fn, p, *args):
        if compile_units and name.startswith("layers."):   # blocks only, as torchtitan compiles them
            if fn not in compiled:
                compiled[fn] = torch.compile(fn)
            fn = compiled[fn]
        recompute_it = recompute.recomputes(name, activation_checkpointing, ac_every)
        if par is None:
            def unit(p, *args):
                return fn(tree_map(lambda x: x.to(dtype), p), *args)
            return recompute.recomputed(unit, activation_checkpointing)(p, *args) if recompute_it else unit(p, *args)
        par.before(name, p)     # FSDP's prefetch: this unit's gather and the next one's launched
        # how the backward gathers the unit again: by its recomputation (launched ahead of it, outside it),
        # or, freed after the forward, by saved-tensor hooks; else it keeps its gathers
        again = (par.recomputed_gather() if recompute_it else par.regather() if par.reshard_after_forward
                 else None)

        def unit(p, *args):
            return fn(par.gather(name, p, again), *args)
        if recompute_it:
            out = recompute.recomputed(unit, activation_checkpointing)(p, *args)
        else:
            with again if again is not None else contextlib.nullcontext():
                out = unit(p, *args)
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
    mesh, each block (make_runner)."""
    written = HistoriesWritten()
    # the model as run once the histories hold a step: delayed amaxes kept local until the step's one reduction
    per_step_cfg = dataclasses.replace(model_cfg, fp8_amax_reduction="step") if model_cfg.fp8 == "delayed" \
        else model_cfg

    def cfg_now() -> ModelConfig:
        return per_step_cfg if written.yet else model_cfg

    if getattr(par, "pipelined", False):   # pipeline parallel: the schedule runs the stages (parallel/pipeline.py)
        pipe = par
        run = make_runner(activation_checkpointing, ac_every, param_dtype, pipe.par, compile_units=compile)

        def pipelined_grads(params, micro_batches):
            cfg = cfg_now()
            loss, grads, stats = pipe.grads(params, micro_batches, run,
                                            lambda: autocast(dtype, micro_batches[0][0].device), cfg)
            return loss, grads, reduced_histories(stats, cfg)
        return StepFns(pipelined_grads, make_update(model_cfg, opt, compile, written))
    run = make_runner(activation_checkpointing, ac_every, param_dtype, par, compile_units=compile and par is not None)

    def loss(params, x, y, cfg):
        return loss_and_stats(params, x, y, cfg, run)

    loss = torch.compile(loss) if compile and par is None else loss

    def grads_fn(params, micro_batches):
        """Mean loss over micro-batches, its gradient (summed per micro-batch, then averaged), stats."""
        leaves, spec = tree_flatten(params)
        names = leaf_names(params)
        n = len(micro_batches)
        total_loss, total_grads, total_stats = None, None, {}
        histories = {j for j, name in enumerate(names) if is_amax_history(name)}
        newest = {}      # fp8 delayed scaling: each history one step on, max over the micro-batches
        cfg = cfg_now()    # once the histories hold a step, their amaxes are reduced once, at the end (module doc)
        with contextlib.nullcontext() if par is None else par.context():
            for i, (x, y) in enumerate(micro_batches):
                ahead = contextlib.nullcontext()
                if par is not None:
                    x, y = par.batch(x, y)
                    ahead = par.prefetching(units(params, model_cfg))   # FSDP gathers ahead
                with ahead, autocast(dtype, x.device):
                    value, stats = loss(params, x, y, cfg)
                hooks, arrived = [], set()
                if par is not None and i == n - 1:
                    # the step's data-parallel reductions start while this last backward runs: each
                    # gradient, once autograd has it, enters a bucket (parallel/buckets.py) with the sum of
                    # the earlier micro-batches'; the reducer adds and divides where it first needs the
                    # values, so an FSDP gradient, a pending reduce-scatter's result, is not waited for here
                    reducer = par.reducer()

                    def ready(j, g):
                        if j in histories:    # not a gradient: kept below, the optimizer gets zeros
                            return
                        arrived.add(j)
                        reducer.add(names[j], g, None if total_grads is None else total_grads[j], n)
                    hooks = [p.register_hook(functools.partial(ready, j)) for j, p in enumerate(leaves)]
                grads = torch.autograd.grad(value, leaves, allow_unused=True)
                for hook in hooks:
                    hook.remove()
                # an expert bias only moves the router's choice: no gradient reaches it (zero, so every
                # optimizer leaves it unchanged; it is never decayed)
                grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, leaves)]
                for j in histories:
                    newest[j] = grads[j] if j not in newest else torch.maximum(newest[j], grads[j])
                    grads[j] = torch.zeros_like(grads[j])
                if hooks:
                    for j in sorted(set(range(len(leaves))) - arrived):   # no gradient reached it: zeros
                        reducer.add(names[j], grads[j], None if total_grads is None else total_grads[j], n)
                else:
                    # (an FSDP gradient still in flight is added where the sum is first read: parallel/fsdp.py)
                    total_grads = grads if total_grads is None else [accumulate(a, b)
                                                                     for a, b in zip(total_grads, grads)]
                # starting from the first value, not 0.0: adding a float to a DTensor partial sum reduces it
                total_loss = value.detach() if total_loss is None else total_loss + value.detach()
                total_stats = {k: v + total_stats[k] if k in total_stats else v for k, v in stats.items()}
        means = ("ce", "aux_loss", "z_loss")    # the rest (expert loads, drops) are counts: summed
        stats = {k: v / n if k in means else v for k, v in total_stats.items()}
        if newest:
            stats["fp8_history"] = {names[j]: h.detach() for j, h in newest.items()}
            stats = reduced_histories(stats, cfg)
        if par is not None:   # one all-reduce for the loss and the router losses
            reduced = reducer.finish()
            scalars = par.scalars({"loss": total_loss / n, **{k: v for k, v in stats.items() if k in means}})
            return scalars.pop("loss"), tree_unflatten([reduced[name] for name in names], spec), {**stats, **scalars}
        if n > 1:
            total_grads = [g / n for g in total_grads]
        return total_loss / n, tree_unflatten(total_grads, spec), stats

    return StepFns(grads_fn, make_update(model_cfg, opt, compile, written))


class HistoriesWritten:
    """Whether the step functions' update has written delayed fp8 scaling's histories back: from then on each
    holds at least one step's amaxes, and a step may keep its amaxes local until its end (module doc)."""

    def __init__(self):
        self.yet = False


def reduced_histories(stats: dict, cfg: ModelConfig) -> dict:
    """stats with its fp8 histories' newest amaxes reduced over the ranks (parallel/fp8.py reduce_histories), where
    the step kept them local (cfg.fp8_amax_reduction == "step")."""
    if cfg.fp8_amax_reduction != "step" or "fp8_history" not in stats:
        return stats
    return {**stats, "fp8_history": fp8_on_mesh.reduce_histories(stats["fp8_history"])}


def make_update(model_cfg: ModelConfig, opt: GradientTransformation, compile: bool = False,
                written: HistoriesWritten | None = None):
    """update(grads, opt_state, params, stats) -> (params, opt_state): the optimizer's updates applied, then
    the routers' expert biases moved and delayed fp8 scaling's histories written back (module doc; `written`
    records that they were). In place (module doc: eager with AdamW or SGD, and compiled) `params`
    and `opt_state` are consumed, their tensors written, as torch.optim does; else opt.update and apply_updates
    run over the whole tree and return new tensors beside the old."""
    if compile:
        update_fn = torch.compile(functools.partial(update_written_back, opt))
    elif getattr(opt, "leaf_by_leaf", None) is not None:
        update_fn = functools.partial(update_in_place, opt)
    else:
        update_fn = functools.partial(update_whole_tree, opt)

    def update(grads, opt_state, params, stats=None, keep=None):
        # keep: a device flag (train.py: the loss is finite); where it is false an in-place update writes nothing
        # No autograd here: weight decay reads the parameters (which require grad), and a recorded
        # update would chain every step's parameters to the last one's graph (memory growing per step).
        with torch.no_grad():
            new_params, opt_state = update_fn(grads, opt_state, params, keep)
            if model_cfg.expert_bias_rate and stats:
                new_params = move_expert_biases(new_params, stats["expert_load"], model_cfg.expert_bias_rate,
                                                model_cfg)
            if stats and "fp8_history" in stats:   # delayed fp8 scaling's amax histories, one step on
                histories = stats["fp8_history"]
                new_params = map_with_name(lambda name, p: histories.get(name, p), new_params)
                if written is not None:
                    written.yet = True
        for p in tree_leaves(new_params):
            p.requires_grad_(True)    # fresh leaves for the next step's gradient
        return new_params, opt_state

    return update


def update_whole_tree(opt, grads, opt_state, params, keep=None):
    """opt.update and apply_updates over the whole tree: new parameters and state beside the old, which the caller
    chooses between by its flag (train.py's keep_where; `keep` is not read here)."""
    updates, opt_state = opt.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def update_in_place(opt, grads, opt_state, params, keep=None):
    """(params, opt_state) one step on, written into their own tensors: the optimizer's pure update computed one
    parameter at a time (optim.optimizer's leaf_by_leaf), each parameter's update added to it in place as soon
    as it exists, so the update's peak is the held state plus one parameter's temporaries, not a second copy
    of the parameters and moments. The numbers are apply_updates(params, opt.update(...))'s, bit for bit. Where
    the gradient's norm is not finite, or the device flag `keep` is false, nothing is written (the loop's skip of
    a non-finite step, train.py)."""
    leaves = tree_leaves(params)

    def apply(i, update, finite):
        p = leaves[i].detach()
        new = torch._foreach_add([p], [update])[0]       # apply_updates' own op, for the same bits
        if isinstance(p, DTensor):
            p, new = p.to_local(), new.to_local()
        torch.where(finite, new, p, out=p)

    return params, opt.leaf_by_leaf(grads, opt_state, params, apply, keep)


def update_written_back(opt, grads, opt_state, params, keep=None):
    """The compiled update: opt.update and apply_updates over the whole tree, their results copied
    into the old parameters and per-parameter state (optim.write_back) where the gradient's norm is finite (and `keep`,
if given, holds). In one
    graph, inductor fuses each element-wise chain into a kernel that stores into the old buffer, so no second
    copy of the parameters and moments is made (docs/memory.md)."""
    updates, new_state = opt.update(grads, opt_state, params)
    finite = torch.isfinite(grad_norm(new_state)) if isinstance(new_state, dict) and "clip" in new_state \
        else torch.ones((), dtype=torch.bool)
    if keep is not None:
        finite = finite & keep
    for p, u in zip(tree_leaves(params), tree_leaves(updates)):
        p = p.detach()
        if isinstance(p, DTensor):    # the same placements: the local shards
            p, u = p.to_local(), u.to_local()
        p.copy_(torch.where(finite, p + u, p))
    return params, write_back(opt_state, new_state, tree_flatten(params)[1], set(leaf_names(params)), finite)
