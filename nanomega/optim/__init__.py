"""Pure optimizers: `opt = build(cfg.optim, total_steps)`; `opt.init(params)`; `opt.update(g, s, p)`.

`build` is the one place a config becomes an optimizer: every optimizer is base.optimizer's chain
(clip -> directions -> masked decay -> lr), and the matrix optimizers (Muon, Shampoo, SOAP) take the
hidden matrices while Adam takes the rest. A parallel run hands in its distributed pieces (the norm
of a sharded gradient, whole matrices for the matrix optimizers, Newton-Schulz on tensor-parallel
shards, the index of a rank's first expert); nothing here knows about ranks.
"""
from __future__ import annotations

import torch

from nanomega.config import OptimConfig, from_dict
from nanomega.optim import schedules
from nanomega.optim.adamw import adamw, scale_by_adam
from nanomega.optim.base import (GradientTransformation, apply_updates, chain, clip_by_global_norm, global_norm,
                                 hidden_matrix, masked, name_matcher, optimizer, partition, per_expert)
from nanomega.optim.linalg import newton_schulz
from nanomega.optim.muon import NS_SCHEDULES, scale_by_muon, scale_by_neuron_norm
from nanomega.optim.sgd import sgd, trace
from nanomega.optim.shampoo import scale_by_shampoo
from nanomega.optim.soap import scale_by_soap
from nanomega.tree import named_leaves

__all__ = ["GradientTransformation", "adamw", "apply_updates", "build", "build_schedule", "chain",
           "clip_by_global_norm", "format1_state_names", "global_norm", "grad_norm", "hidden_matrix", "masked", "name_matcher",
           "optimizer", "partition", "scale_by_adam", "sgd", "state_metrics"]


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
    excluded = name_matcher(tuple(cfg.no_decay) + ("*.expert_bias", "*.fp8_history"))
    return lambda name, param: not excluded(name)


def matrix_direction(cfg: OptimConfig, orthogonalize=newton_schulz, first_expert=None) -> GradientTransformation:
    """Muon's, Shampoo's or SOAP's direction for the hidden matrices (Shampoo and SOAP: each expert its own,
    its state named by its index in the whole model: base.per_expert's `first_expert`)."""
    state_dtype = getattr(torch, cfg.state_dtype)
    # Shampoo's and SOAP's matrices: "float32" stores them as computed (fp64 for fp64 parameters): None.
    factor_dtype, basis_dtype = (None if d == "float32" else getattr(torch, d) for d in (cfg.factor_dtype,
                                                                                       cfg.basis_dtype))
    if cfg.name == "muon":
        direction = scale_by_muon(cfg.muon_momentum, cfg.ns_steps, cfg.muon_scale, state_dtype,
                                  ns_coefficients=NS_SCHEDULES[cfg.ns_coefficients], ns_dtype=cfg.ns_dtype,
                                  orthogonalize=orthogonalize)
        if cfg.normuon_beta2:     # NorMuon: Muon's direction, then each output neuron's second moment
            return chain(muon=direction, normuon=scale_by_neuron_norm(cfg.normuon_beta2))
        return direction
    if cfg.name == "shampoo":
        return per_expert(scale_by_shampoo(cfg.beta1, cfg.beta2, cfg.eps, cfg.shampoo_momentum, cfg.shampoo_beta,
                                           cfg.shampoo_eps, cfg.precondition_frequency,
                                           cfg.start_preconditioning_step, cfg.shampoo_block_size,
                                           state_dtype=state_dtype, inv_root=cfg.shampoo_inv_root,
                                           precondition=cfg.shampoo_precondition, graft=cfg.shampoo_graft,
                                           factor_dtype=factor_dtype, root_dtype=basis_dtype),
                          first_expert)
    return per_expert(scale_by_soap(cfg.beta1, cfg.beta2, cfg.eps, cfg.shampoo_beta, cfg.precondition_frequency,
                                    cfg.max_precond_dim, True, cfg.shampoo_eps, state_dtype, factor_dtype, basis_dtype),
                      first_expert)


def build(cfg: OptimConfig, total_steps: int, norm=global_norm, whole_matrices=None,
          orthogonalize=newton_schulz, first_expert=None) -> GradientTransformation:
    """The optimizer cfg.name describes. State names: "clip.grad_norm", "<direction>.<field>.<param>"
    ("adam.mu.layers.0.attn.wq.weight", "muon.momentum...", "momentum.trace..." for SGD), "lr.count".

    Muon, Shampoo and SOAP update the hidden matrices (hidden_matrix) and Adam, at lr * adam_lr_ratio,
    the rest, after one clip of the whole gradient. A parallel run (nanomega.parallel.optimizer) hands in
    `norm` (the global norm from this rank's shards), `whole_matrices(direction)` (the matrix direction
    run on whole matrices), `orthogonalize` (Muon's Newton-Schulz on tensor-parallel shards) and
    `first_expert` ({stacked expert weight: the model-wide index of this rank's first expert}, under
    expert parallel), so that per-expert state is named alike in every layout."""
    cfg.validate()
    schedule = build_schedule(cfg, total_steps)
    state_dtype = getattr(torch, cfg.state_dtype)
    adam = scale_by_adam(cfg.beta1, cfg.beta2, cfg.eps, state_dtype)
    if cfg.name == "adamw":
        return optimizer({"adam": adam}, schedule, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip, norm=norm,
                         elementwise=True)
    if cfg.name == "sgd":
        directions = {"momentum": trace(cfg.momentum, cfg.nesterov, state_dtype)} if cfg.momentum else {}
        return optimizer(directions, schedule, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip, coupled_decay=True,
                         norm=norm, elementwise=True)
    matrices = matrix_direction(cfg, orthogonalize, first_expert)
    if whole_matrices is not None:
        matrices = whole_matrices(matrices)
    directions = {cfg.name: masked(matrices, hidden_matrix),
                  "adam": masked(adam, lambda name, p: not hidden_matrix(name, p))}
    ratio = cfg.adam_lr_ratio
    lr_scale = None if ratio == 1.0 else (lambda name, p: 1.0 if hidden_matrix(name, p) else ratio)
    return optimizer(directions, schedule, cfg.weight_decay, decay_mask(cfg), cfg.grad_clip, lr_scale=lr_scale,
                     norm=norm)


def format1_state_names(cfg: OptimConfig, stored: list[str]) -> dict:
    """{state name in this version: its name in a format-1 checkpoint written with `cfg`} (checkpoint.py).

    Format 1 named state by the position of its transform in the chain, after an optional clip stage:
    AdamW (adam, decay, lr); SGD (decay, [momentum], lr); Muon / Shampoo / SOAP one partition
    {cfg.name: (direction, decay, lr), "adamw": (adam, decay, lr)}, whose two learning-rate counts become
    the one "lr.count" (a tuple: the checkpoint loader checks they are equal). "clip.grad_norm" is new
    (None: it keeps its initial value until the next step measures it)."""
    stages = {"adamw": ["adam", "decay", "lr"], "sgd": ["decay"] + (["momentum"] if cfg.momentum else []) + ["lr"]}
    names: dict = {"clip.grad_norm": None}
    for old in stored:
        position, _, rest = old.partition(".")
        position = int(position) - (1 if cfg.grad_clip else 0)
        if cfg.name in stages:
            names[f"{stages[cfg.name][position]}.{rest}"] = old
            continue
        label, inner, rest = rest.split(".", 2)     # the partition's group, its chain position, the rest
        if inner == "2":
            names[f"lr.{rest}"] = names.get(f"lr.{rest}", ()) + (old,)
        else:
            names[f"{cfg.name if label == cfg.name else 'adam'}.{rest}"] = old
    return names


def format1_renaming(stored: list[str], meta: dict) -> dict:
    """checkpoint.load's `rename_format1_state`: format1_state_names under the optimizer config the
    checkpoint was written with (its meta.json)."""
    return format1_state_names(from_dict(meta["config"]).optim, stored)


def grad_norm(opt_state) -> torch.Tensor:
    """The global norm of the last gradient the optimizer saw, before clipping (its "clip" stage keeps it)."""
    return opt_state["clip"].grad_norm


def state_metrics(opt_state) -> dict:
    """Numbers an optimizer keeps in its state for the log: Shampoo's count of failed inverse roots
    (`...failures` leaves) so far. Empty for optimizers that keep none."""
    failures = [leaf for name, leaf in named_leaves(opt_state).items() if name.endswith("failures")]
    return {"precond_failures": int(sum(int(f) for f in failures))} if failures else {}
