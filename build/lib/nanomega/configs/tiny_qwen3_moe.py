"""A tiny Qwen3-MoE-style byte model for the CPU: d 256, 4 layers, GQA 8/4 heads of dim 32 with QK-norm,
8 SwiGLU experts of 384 (top-2, weights renormalized) in every layer: 10.4M parameters, 3.29M active.

The default's budget: 280 steps of 16 x 256 tokens; Switch-style balancing loss 1e-2, z-loss 1e-3."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, max_seq_len=256,
                          norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, n_experts=8, top_k=2,
                          expert_ffn_dim=384, router_norm_topk=True, aux_loss_coef=1e-2, z_loss_coef=1e-3),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=280, batch_size=16, seq_len=256, eval_every=70, ckpt_every=140,
                          out_dir="runs/tiny_qwen3_moe"),
    )
