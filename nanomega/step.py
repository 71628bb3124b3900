"""The train step: gradients of the loss over micro-batches, then one optimizer update.

It is two pure functions, each compiled on its own when asked:
  grads_fn(params, x, y)      -> loss, grads     (forward + backward; torch.compile on the loss)
  update_fn(grads, s, params) -> params, s       (the whole optimizer as one fused graph)
The split lets the loop look at the loss (finite or not) before anything is changed, so a
non-finite step can be skipped or stopped without touching the parameters or the checkpoint.

On a mesh (`par`, parallel/parallelize.py) the same two functions run over DTensors: the batch is
placed, parameters are gathered for compute, and gradients stay partial sums over data parallel
until the last micro-batch, so gradient accumulation communicates once per step (FSDP's gradients
are reduce-scattered by its backward, once per micro-batch). `opt` is then a ParallelOptimizer.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from nanomega.config import ModelConfig
from nanomega.models import loss_fn
from nanomega.optim import GradientTransformation, global_norm
from nanomega.tree import tree_flatten, tree_leaves, tree_unflatten


class StepFns(NamedTuple):
    grads: callable
    update: callable


def autocast(dtype: str, device: torch.device):
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def make_step_fns(model_cfg: ModelConfig, opt: GradientTransformation, compile: bool = False,
                  dtype: str = "float32", par=None) -> StepFns:
    def parallel_loss(params, x, y, cfg):
        return loss_fn(par.compute(params), x, y, cfg)

    loss = loss_fn if par is None else parallel_loss
    loss = torch.compile(loss) if compile else loss

    def grads_fn(params, micro_batches):
        """Mean loss over micro-batches and its gradient (summed per micro-batch, then averaged)."""
        leaves, spec = tree_flatten(params)
        total_loss, total_grads = None, None
        with contextlib.nullcontext() if par is None else par.context():
            for x, y in micro_batches:
                if par is not None:
                    x, y = par.batch(x, y)
                with autocast(dtype, x.device):
                    value = loss(params, x, y, model_cfg)
                grads = torch.autograd.grad(value, leaves)
                total_grads = grads if total_grads is None else [a + b for a, b in zip(total_grads, grads)]
                # starting from the first value, not 0.0: adding a float to a DTensor partial sum reduces it
                total_loss = value.detach() if total_loss is None else total_loss + value.detach()
        n = len(micro_batches)
        if n > 1:
            total_grads = [g / n for g in total_grads]
        grads = tree_unflatten(list(total_grads), spec)
        if par is not None:
            return par.scalar(total_loss / n), par.reduce(grads)
        return total_loss / n, grads

    def update_fn(grads, opt_state, params):
        if par is not None:
            return opt.update(grads, opt_state, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        new = torch._foreach_add([p.detach() for p in tree_leaves(params)], tree_leaves(updates))
        _, spec = tree_flatten(params)
        return tree_unflatten(new, spec), opt_state, global_norm(grads)

    if compile:
        update_fn = torch.compile(update_fn)

    def update(grads, opt_state, params):
        new_params, opt_state, grad_norm = update_fn(grads, opt_state, params)
        for p in tree_leaves(new_params):
            p.requires_grad_(True)
        return new_params, opt_state, grad_norm

    return StepFns(grads_fn, update)
