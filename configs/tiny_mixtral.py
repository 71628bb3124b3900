"""A tiny Mixtral-shaped byte model for the CPU: 4 layers, d 192, GQA 6/2 heads, 8 SwiGLU experts of 608
(top-2) in every layer; 11.7M parameters, 3.30M active per token (the dense default's 3.3M).

300 steps of 16 x 256 tokens, as configs/default.py; Switch-style balancing loss at 1e-2."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, max_seq_len=256, rope_theta=1000000.0,
                          n_experts=8, top_k=2, expert_ffn_dim=608, aux_loss_coef=1e-2),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=300, batch_size=16, seq_len=256, eval_every=75, ckpt_every=150,
                          out_dir="runs/tiny_mixtral"),
    )
