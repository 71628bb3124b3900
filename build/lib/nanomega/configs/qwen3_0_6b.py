"""Qwen3-0.6B: 28 layers, d 1024, GQA 16/8 heads of dim 128, QK-norm, SwiGLU 3072, tied embeddings."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
                          ffn_dim=3072, max_seq_len=4096, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                          tie_embeddings=True),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=4, seq_len=4096, steps=10000, dtype="bfloat16", out_dir="runs/qwen3_0_6b"),
    )
