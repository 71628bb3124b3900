"""The CPU default: a ~3.5M-parameter LLaMA-style byte model that trains in under 5 minutes on 2 cores."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768, max_seq_len=256),
        optim=OptimConfig(lr=3e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=600, batch_size=16, seq_len=256, eval_every=200, ckpt_every=300),
    )
