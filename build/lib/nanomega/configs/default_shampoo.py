"""The CPU default model trained with Shampoo (Adam-grafted) on its hidden matrices and AdamW on the rest.

Defaults in the spirit of distributed Shampoo (Shi et al. 2023): EMA factors (beta 0.95), inverse roots every
10 steps after 10 Adam-grafted steps, per-block Adam grafting (so Adam's learning rate carries over), no extra
momentum on top of the graft's first moment.
"""
import dataclasses

from .default import config as default_config


def config():
    cfg = default_config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, name="shampoo", lr=3e-3, shampoo_momentum=0.0, shampoo_beta=0.95, precondition_frequency=10,
        start_preconditioning_step=10, adam_lr_ratio=2e-3 / 3e-3))
