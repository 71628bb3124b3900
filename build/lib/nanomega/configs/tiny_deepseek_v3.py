"""A tiny DeepSeek-V3-shaped byte model for the CPU: 4 layers, d 192, 6 heads of multi-head latent
attention (q rank 96, kv rank 64, 32 nope + 16 rope query/key dims, 32 value dims); the first layer
dense SwiGLU 1200, then 8 routed experts of 240 in 4 groups (top-4 from the best 2 groups: two per
group, as DeepSeek-V3's 8 from 4 of 8 groups, which is also what Hugging Face's router assumes) plus
1 shared expert, sigmoid scores x 2.5; aux-loss-free balancing (bias rate 1e-3) with a 1e-4
sequence-wise loss. 5.0M parameters, 3.36M active per token (the dense default's 3.3M).

300 steps of 16 x 256 tokens, as configs/default.py."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=192, n_layers=4, n_heads=6, max_seq_len=256, norm_eps=1e-6, attention="mla",
                          q_lora_rank=96, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32,
                          ffn_dim=1200, first_dense_layers=1, n_experts=8, top_k=4, expert_ffn_dim=240,
                          shared_ffn_dim=240, router_score="sigmoid", router_norm_topk=True, router_scale=2.5,
                          router_groups=4, router_topk_groups=2, expert_bias_rate=1e-3, aux_loss="sequence",
                          aux_loss_coef=1e-4),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=300, batch_size=16, seq_len=256, eval_every=75, ckpt_every=150,
                          out_dir="runs/tiny_deepseek_v3"),
    )
