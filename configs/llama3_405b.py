"""LLaMA-3.1 405B: 126 layers, d 16384, GQA 128/8 heads, SwiGLU 53248, vocab 128256; RoPE theta 500k with
Llama 3.1's scaling (factor 8 over an 8192-token pretraining context, low/high frequency factors 1 and 4: the
128k context), as its Hugging Face config.json has them. Trained here at sequence 8192."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                          max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0,
                          rope_original_max_len=8192, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0),
        optim=OptimConfig(lr=8e-5, warmup_steps=8000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=8192, steps=10000, dtype="bfloat16", out_dir="runs/llama3_405b"),
    )
