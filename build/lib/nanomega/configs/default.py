"""The CPU default: a 3.3M-parameter LLaMA-style byte model that trains in about 4 minutes on 2 cores.

280 steps of 16 x 256 tokens (1.15M tokens, about a third of an epoch of the built-in corpus).
lr 2e-3 was the best of {2e-3, 3e-3, 6e-3} at this budget (validation 1.53, 1.55, 1.77 nats/byte).
"""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=280, batch_size=16, seq_len=256, eval_every=70, ckpt_every=140),
    )
