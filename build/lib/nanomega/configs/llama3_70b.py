"""LLaMA-3 70B: 80 layers, d 8192, GQA 64/8 heads, SwiGLU 28672, RoPE theta 500k, vocab 128256."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                          max_seq_len=8192, rope_theta=500000.0),
        optim=OptimConfig(lr=1.5e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=8192, steps=10000, dtype="bfloat16", out_dir="runs/llama3_70b"),
    )
