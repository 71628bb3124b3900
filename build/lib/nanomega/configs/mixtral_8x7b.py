"""Mixtral 8x7B: 32 layers, d 4096, GQA 32/8 heads, 8 SwiGLU experts of 14336 (top-2) in every layer,
RoPE theta 1e6, vocab 32000; 46.7B parameters, 12.9B active per token."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=32768,
                          rope_theta=1000000.0, n_experts=8, top_k=2, expert_ffn_dim=14336, aux_loss_coef=0.02),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=4096, steps=10000, dtype="bfloat16", out_dir="runs/mixtral_8x7b"),
    )
