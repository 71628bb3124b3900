"""Evaluation and the end-of-run sample, on one process or on a mesh: what train.py runs between steps and
after the last one, and what the contract checker (nanomega/contracts.py) runs on every rank of a layout.

On a mesh the model runs unit by unit as in training, each unit's parameters gathered only while it runs,
and the sample never gathers the whole model onto one device (parallel/sample.py). Evaluation keeps each
batch's loss on the device and reads them on the host once, at the end (a read drains the device's queue).
"""
from __future__ import annotations

import torch

from nanomega.generate import sample
from nanomega.models.transformer import call, loss_and_stats
from nanomega.step import autocast, make_runner


def cross_entropy(params, x, y, model_cfg, run=call) -> torch.Tensor:
    """The batch's mean cross-entropy: an MoE model's objective adds router losses; validation is on the CE."""
    loss, stats = loss_and_stats(params, x, y, model_cfg, run)
    return stats.get("ce", loss)


@torch.no_grad()
def validation_loss(params, batches, model_cfg, t_cfg, device, par=None) -> float:
    """The mean cross-entropy over `batches` (pairs of inputs and targets), in the training's precision."""
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    if getattr(par, "pipelined", False):
        run = make_runner(param_dtype=t_cfg.param_dtype, par=par.par)
        return par.evaluate(params, batches, model_cfg, run, lambda: autocast(t_cfg.dtype, device))
    run = make_runner(param_dtype=t_cfg.param_dtype, par=par)
    losses = []
    for x, y in batches:
        with autocast(t_cfg.dtype, device):
            if par is None:
                losses.append(cross_entropy(params, x, y, model_cfg, run).float())
                continue
            with par.context():
                x, y = par.batch(x, y)
                losses.append(par.scalar(cross_entropy(params, x, y, model_cfg, run)).float())
    return sum(torch.stack(losses).tolist()) / len(batches)      # the one host read


@torch.no_grad()
def sample_text(params, model_cfg, t_cfg, prompt, device, par=None, n_new: int | None = None) -> torch.Tensor:
    """The end-of-run sample, [1, prompt + n_new] (train.sample_tokens by default) on every rank. On a mesh every
    rank samples with the same logits and generator (a collective), the model sharded as in training."""
    gen = torch.Generator(device=device).manual_seed(t_cfg.seed) if t_cfg.temperature > 0 else None   # 0: greedy
    next_logits = None
    if par is not None:
        from nanomega.parallel.sample import next_logits as on_mesh
        run = make_runner(param_dtype=t_cfg.param_dtype, par=par.par if getattr(par, "pipelined", False) else par)
        next_logits = on_mesh(par, params, model_cfg, run, lambda: autocast(t_cfg.dtype, device))
    n_new = t_cfg.sample_tokens if n_new is None else n_new
    return sample(params, model_cfg, prompt, n_new, t_cfg.temperature, t_cfg.top_k, gen, next_logits)
