"""The CPU default model trained with SOAP on its hidden matrices and AdamW on the rest.

SOAP's literature defaults (Vyas et al. 2024): betas (0.95, 0.95), shampoo_beta 0.95, precondition every 10
steps; the AdamW part keeps the default's 2e-3.
"""
import dataclasses

from .default import config as default_config


def config():
    cfg = default_config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, name="soap", lr=3e-3, beta1=0.95, beta2=0.95, shampoo_beta=0.95, precondition_frequency=10,
        adam_lr_ratio=2e-3 / 3e-3))
