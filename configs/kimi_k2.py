"""Kimi K2 (Moonshot AI, 2025): DeepSeek-V3's architecture made sparser and given fewer heads. 61 layers,
d 7168, 64 heads of multi-head latent attention (q rank 1536, kv rank 512, per head 128 nope + 64 rope
query/key dims and 128 value dims); the first layer dense SwiGLU 18432, then 384 routed experts of 2048
(top-8, no expert groups, sigmoid scores, weights renormalized x 2.827) plus 1 shared expert; vocab 163840,
untied; RoPE theta 50000 read through YaRN (x32 over the 4096-token pretraining context, 128K).
1,026,408,209,408 parameters, 32,861,477,888 active per token (both embedding tables counted, no
multi-token-prediction module: the checkpoint has none); the report's rounded 1.04T / 32.6B are not
reproduced by its own config.json (tests/test_trillion_configs.py).

Sources. The shapes are moonshotai/Kimi-K2-Base's and Kimi-K2-Instruct's config.json (the two are the same
architecture; huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json): num_hidden_layers 61,
hidden_size 7168, intermediate_size 18432, num_attention_heads 64, q_lora_rank 1536, kv_lora_rank 512,
qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, first_k_dense_replace 1, moe_layer_freq 1,
n_routed_experts 384, moe_intermediate_size 2048, num_experts_per_tok 8, n_shared_experts 1, n_group 1,
topk_group 1, scoring_func "sigmoid", topk_method "noaux_tc", norm_topk_prob true, routed_scaling_factor
2.827, vocab_size 163840, tie_word_embeddings false, rms_norm_eps 1e-6, rope_theta 50000,
max_position_embeddings 131072, rope_scaling {type yarn, factor 32, original_max_position_embeddings 4096,
beta_fast 1, beta_slow 1, mscale 1, mscale_all_dim 1}, num_nextn_predict_layers 0; read from public copies
of that file (e.g. hyper-accel/tiny-random-kimi-k2's config.json keeps its rope block and context) and checked
against Megatron-Bridge's KimiK2Provider (bridge.models.kimi.kimi_provider: 61, 7168, 18432, 384 x 2048, shared 2048,
64 heads, rotary_base 50000, top-8 in 1 group of 1, scaling 2.827, untied). Kimi K2 report (arXiv
2507.20534, Table 2 and section 2.5): 1.04T total, 32.6B activated, 1 dense layer, no expert grouping; a
4096-token context, MuonClip with the WSD schedule over 15.5T tokens: 500 warmup steps, lr 2e-4 constant
for 10T tokens, then a cosine decay to 2e-5 over 5.5T; weight decay 0.1; batch 67M tokens (16384 x 4096).

Assumed here: Muon with Moonshot's update-RMS matching (muon_scale="match_adam": "Muon is Scalable for LLM
Training", which MuonClip builds on), AdamW at the same lr for the rest; the decay is nanomega's linear WSD
tail over the same share of the run (5.5 / 15.5), not a cosine; the balancing is DeepSeek-V3's (bias rate
1e-3, sequence-wise loss 1e-4), which the report does not restate. Not here: QK-Clip (MuonClip's per-head
rescaling of W_q and W_k when a head's max logit passes tau=100), which nanomega's Muon lacks; batch_size
and steps are placeholders, as in deepseek_v3.py."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=163840, d_model=7168, n_layers=61, n_heads=64, max_seq_len=131072, norm_eps=1e-6,
                          rope_theta=50000.0, rope_scaling="yarn", rope_factor=32.0, rope_original_max_len=4096,
                          rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                          attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64,
                          v_head_dim=128, ffn_dim=18432, first_dense_layers=1,
                          n_experts=384, top_k=8, expert_ffn_dim=2048, shared_ffn_dim=2048, router_score="sigmoid",
                          router_norm_topk=True, router_scale=2.827, expert_bias_rate=1e-3, aux_loss="sequence",
                          aux_loss_coef=1e-4),
        optim=OptimConfig(name="muon", lr=2e-4, schedule="wsd", warmup_steps=500, decay_fraction=5.5 / 15.5,
                          min_lr_ratio=0.1, weight_decay=0.1, muon_scale="match_adam"),
        train=TrainConfig(batch_size=1, seq_len=4096, steps=10000, dtype="bfloat16", out_dir="runs/kimi_k2"),
    )
