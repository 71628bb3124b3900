"""DeepSeek-V3: 61 layers, d 7168, 128 heads of multi-head latent attention (q rank 1536, kv rank 512,
per head 128 nope + 64 rope query/key dims and 128 value dims); the first 3 layers dense SwiGLU 18432,
then 256 routed experts of 2048 (top-8 from the best 4 of 8 groups, sigmoid scores, weights x 2.5)
plus 1 shared expert; aux-loss-free balancing (bias rate 1e-3) with a 1e-4 sequence-wise loss;
vocab 129280. 671B parameters, 37B active per token (without the multi-token-prediction module)."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, max_seq_len=4096, norm_eps=1e-6,
                          rope_theta=10000.0, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128,
                          qk_rope_dim=64, v_head_dim=128, ffn_dim=18432, first_dense_layers=3,
                          n_experts=256, top_k=8, expert_ffn_dim=2048, shared_ffn_dim=2048, router_score="sigmoid",
                          router_norm_topk=True, router_scale=2.5, router_groups=8, router_topk_groups=4,
                          expert_bias_rate=1e-3, aux_loss="sequence", aux_loss_coef=1e-4),
        optim=OptimConfig(lr=2.2e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=4096, steps=10000, dtype="bfloat16", out_dir="runs/deepseek_v3"),
    )
