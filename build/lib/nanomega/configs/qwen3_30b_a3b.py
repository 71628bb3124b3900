"""Qwen3-30B-A3B: 48 layers, d 2048, GQA 32/4 heads of dim 128, QK-norm, 128 SwiGLU experts of 768
(top-8, weights renormalized) in every layer, vocab 151936; 30.5B parameters, 3.3B active per token."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                          n_experts=128, top_k=8, expert_ffn_dim=768, router_norm_topk=True, aux_loss_coef=1e-3),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=2, seq_len=4096, steps=10000, dtype="bfloat16", out_dir="runs/qwen3_30b_a3b"),
    )
