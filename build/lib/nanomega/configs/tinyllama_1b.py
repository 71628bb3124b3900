"""A ~1B LLaMA: TinyLlama-1.1B's shape (22 layers, d 2048, GQA 32/4 heads, SwiGLU 5632)."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
                          max_seq_len=2048, rope_theta=10000.0),
        optim=OptimConfig(lr=4e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=4, seq_len=2048, steps=10000, dtype="bfloat16", out_dir="runs/tinyllama_1b"),
    )
