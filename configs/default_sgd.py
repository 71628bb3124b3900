"""The CPU default model trained with SGD + momentum (a baseline for the optimizer study)."""
import dataclasses

from .default import config as default_config


def config():
    cfg = default_config()
    return dataclasses.replace(cfg, optim=dataclasses.replace(
        cfg.optim, name="sgd", lr=0.3, momentum=0.9, nesterov=True, weight_decay=0.0))
