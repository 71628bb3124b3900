"""Pure optimizers: `opt = build(cfg.optim, total_steps)`; `opt.init(params)`; `opt.update(g, s, p)`.

An optimizer is one file that registers itself (registry.py: what it declares, and who reads REGISTRY; no
second list of names exists). Importing this package registers the five below; a new one (Lion in
tests/test_extending.py, docs/extending.md) registers when its module is imported. Its own settings live in
OptimConfig.settings, typed by `check` before any work (config.OptimConfig's docstring). `build` is the one place
a config becomes an optimizer: base.optimizer's chain (clip -> directions -> masked decay -> lr), with a parallel
run's pieces handed in; nothing here knows about ranks.
"""
from __future__ import annotations

import fnmatch

import torch

from nanomega.config import OptimConfig
from nanomega.optim import schedules
from nanomega.optim.adamw import adamw, scale_by_adam
from nanomega.optim.base import (GradientTransformation, apply_updates, chain, clip_by_global_norm, global_norm,
                                 hidden_matrix, masked, optimizer, per_expert)
from nanomega.optim.linalg import newton_schulz
from nanomega.optim.muon import muon
from nanomega.optim.registry import REGISTRY, Optimizer, Parts, check, register, setting, setting_names, spec_of
from nanomega.optim.sgd import sgd
from nanomega.optim.shampoo import shampoo
from nanomega.optim.soap import soap
from nanomega.tree import named_leaves

__all__ = ["REGISTRY", "adamw", "apply_updates", "build", "build_schedule", "chain", "check", "clip_by_global_norm",
           "global_norm", "grad_norm", "GradientTransformation", "hidden_matrix", "masked", "muon", "optimizer",
           "Optimizer", "per_expert", "register", "scale_by_adam", "setting", "setting_names", "sgd", "shampoo", "soap",
           "spec_of", "state_metrics"]


def build_schedule(cfg: OptimConfig, total_steps: int):
    if cfg.schedule == "cosine":
        return schedules.warmup_cosine(cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    if cfg.schedule == "wsd":
        return schedules.warmup_stable_decay(cfg.lr, cfg.warmup_steps, total_steps, cfg.decay_fraction,
                                             cfg.min_lr_ratio)
    return schedules.constant(cfg.lr, cfg.warmup_steps)


def decay_mask(cfg: OptimConfig):
    """Weight decay on everything except the names matched by cfg.no_decay (norms, biases, embeddings),
    MoE routers' expert biases and fp8 amax histories: those get a zero gradient, so without decay no
    optimizer moves them (the balancing rule does, models/moe.expert_bias_step; step.py writes the
    histories)."""
    excluded = tuple(cfg.no_decay) + ("*.expert_bias", "*.fp8_history")    # fnmatch patterns of dotted names
    return lambda name, param: not any(fnmatch.fnmatchcase(name, p) for p in excluded)


def build(cfg: OptimConfig, total_steps: int, norm=global_norm, whole_matrices=None,
          orthogonalize=newton_schulz, first_expert=None) -> GradientTransformation:
    """The optimizer cfg.name registered. State names: "clip.grad_norm", "<direction>.<field>.<param>"
    ("adam.mu.layers.0.attn.wq.weight", "muon.momentum...", "momentum.trace..." for SGD), "lr.count".

    A whole-matrix optimizer updates the hidden matrices (hidden_matrix) and Adam, at lr * adam_lr_ratio,
    the rest, after one clip of the whole gradient. A parallel run (nanomega.parallel.optimizer) hands in
    `norm` (the global norm from this rank's shards), `whole_matrices(direction)` (the matrix direction
    run on whole matrices), `orthogonalize` (Muon's Newton-Schulz on tensor-parallel shards) and
    `first_expert` ({stacked expert weight: the model-wide index of this rank's first expert}, under
    expert parallel), so that per-expert state is named alike in every layout."""
    own, spec = check(cfg), spec_of(cfg.name)
    schedule = build_schedule(cfg, total_steps)
    state_dtype = getattr(torch, cfg.state_dtype)
    directions, lr_scale = spec.directions(own, state_dtype, Parts(orthogonalize, first_expert)), None
    if not spec.elementwise:
        whole = whole_matrices or (lambda direction: direction)
        directions = {label: masked(whole(d), hidden_matrix) for label, d in directions.items()}
        directions["adam"] = masked(scale_by_adam(own.beta1, own.beta2, own.eps, state_dtype),
                                    lambda name, p: not hidden_matrix(name, p))
        ratio = own.adam_lr_ratio
        lr_scale = None if ratio == 1.0 else (lambda name, p: 1.0 if hidden_matrix(name, p) else ratio)
    return optimizer(directions, schedule, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip, spec.coupled_decay,
                     lr_scale, norm, elementwise=spec.elementwise)


def grad_norm(opt_state) -> torch.Tensor:
    """The global norm of the last gradient the optimizer saw, before clipping (its "clip" stage keeps it)."""
    return opt_state["clip"].grad_norm


def state_metrics(opt_state) -> dict:
    """Numbers an optimizer keeps in its state for the log: Shampoo's count of failed inverse roots
    (`...failures` leaves) so far. Empty for optimizers that keep none."""
    failures = [leaf for name, leaf in named_leaves(opt_state).items() if name.endswith("failures")]
    return {"precond_failures": sum(int(f) for f in failures)} if failures else {}
