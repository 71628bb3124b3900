"""The CPU default model trained with Shampoo (Adam-grafted) on its hidden matrices and AdamW on the rest.

The optim defaults since the ablation (README, `bench/variants.py`): Adam's first moment preconditioned, as
Distributed Shampoo (Shi et al. 2023) does, EMA factors (beta 0.95), inverse roots every 10 steps from
step 1, per-block Adam grafting (so Adam's learning rate carries over), no momentum after the graft.
lr 1.5e-3 at the default budget: validation 1.4036 against AdamW's best 1.6262 (bench/variants.py's eval,
5 batches), AdamW's final loss reached at step 166 of 280.
"""
import dataclasses

from .default import config as default_config


def config():
    cfg = default_config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, name="shampoo", lr=1.5e-3, adam_lr_ratio=2e-3 / 1.5e-3))
