"""Pure optimizers: `opt = build(cfg.optim, total_steps)`; `opt.init(params)`; `opt.update(g, s, p)`."""
from __future__ import annotations

import torch

from nanomega.config import OptimConfig
from nanomega.optim import schedules
from nanomega.optim.adamw import adamw, scale_by_adam
from nanomega.optim.base import (GradientTransformation, apply_updates, chain, clip_by_global_norm,
                                 global_norm, hidden_matrix, masked, name_matcher, partition)
from nanomega.optim.sgd import sgd
from nanomega.tree import named_leaves

__all__ = ["GradientTransformation", "adamw", "apply_updates", "build", "build_schedule", "chain",
           "clip_by_global_norm", "global_norm", "hidden_matrix", "masked", "name_matcher", "partition",
           "scale_by_adam", "sgd", "state_metrics"]


def build_schedule(cfg: OptimConfig, total_steps: int):
    if cfg.schedule == "cosine":
        return schedules.warmup_cosine(cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        return schedules.warmup_stable_decay(cfg.lr, cfg.warmup_steps, total_steps, cfg.decay_fraction,
                                             cfg.min_lr_ratio)
    return schedules.constant(cfg.lr, cfg.warmup_steps)


def decay_mask(cfg: OptimConfig):
    """Weight decay on everything except the names matched by cfg.no_decay (norms, biases, embeddings)
    and MoE routers' expert biases: those get a zero gradient, so without decay no optimizer moves them
    (the balancing rule does, models/moe.expert_bias_step)."""
    excluded = name_matcher(tuple(cfg.no_decay) + ("*.expert_bias",))
    return lambda name, param: not excluded(name)


def build(cfg: OptimConfig, total_steps: int, wrap_matrices=None) -> GradientTransformation:
    """The optimizer cfg.name describes. `wrap_matrices` wraps the matrix optimizer of Muon, Shampoo
    and SOAP (a parallel run uses it to give them whole matrices); element-wise ones ignore it."""
    schedule = build_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        return adamw(schedule, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip,
                     getattr(torch, cfg.state_dtype))
    if cfg.name == "sgd":
        return sgd(schedule, cfg.momentum, cfg.nesterov, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip,
                   getattr(torch, cfg.state_dtype))
    if cfg.name in ("muon", "shampoo", "soap"):
        import importlib
        module = importlib.import_module(f"nanomega.optim.{cfg.name}")
        return module.from_config(cfg, schedule, decay_mask(cfg), wrap_matrices)
    raise ValueError(f"unknown optimizer {cfg.name!r}; choose one of: adamw, sgd, muon, shampoo, soap")


def state_metrics(opt_state) -> dict:
    """Numbers an optimizer keeps in its state for the log: Shampoo's count of failed inverse roots
    (`...failures` leaves) so far. Empty for optimizers that keep none."""
    failures = [leaf for name, leaf in named_leaves(opt_state).items() if name.endswith("failures")]
    return {"precond_failures": int(sum(int(f) for f in failures))} if failures else {}
