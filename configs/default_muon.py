"""The CPU default model trained with Muon on its hidden matrices and AdamW on the rest.

Muon's literature defaults (Jordan et al. 2024; torch.optim.Muon): momentum 0.95 with Nesterov, 5 quintic
Newton-Schulz steps, lr ~0.02 with the spectral shape scale; the AdamW part keeps the default's 2e-3.
"""
import dataclasses

from configs.default import config as default_config


def config():
    cfg = default_config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, name="muon", lr=0.02, momentum=0.95, adam_lr_ratio=0.1, weight_decay=0.0))
