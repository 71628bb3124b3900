"""Qwen3-235B-A22B: 94 layers, d 4096, GQA 64/4 heads of dim 128, QK-norm, 128 SwiGLU experts of 1536
(top-8, weights renormalized, no shared expert) in every layer, vocab 151936, untied; 235,093,634,560
parameters, 22,190,763,520 active per token (both embedding tables counted; there is no MTP module).

Sources: Qwen/Qwen3-235B-A22B's config.json (huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json):
num_hidden_layers 94, hidden_size 4096, num_attention_heads 64, num_key_value_heads 4, head_dim 128,
num_experts 128, moe_intermediate_size 1536, num_experts_per_tok 8, norm_topk_prob true, decoder_sparse_step
1, mlp_only_layers [], vocab_size 151936, tie_word_embeddings false, rms_norm_eps 1e-6, rope_theta 1e6,
max_position_embeddings 40960, router_aux_loss_coef 1e-3 (and intermediate_size 12288, which no layer
uses: every layer is MoE; kept so the config reads as the file does); checked against Ascend MindSpeed-RL's
configs/model/qwen3_235b_a22b.yaml (the same values in Megatron's names, qk_layernorm true). The Qwen3
report (arXiv 2505.09388) gives 235B total, 22B activated and 4096-token pretraining sequences, but no
learning rate, warmup or batch: those are assumed as in qwen3_30b_a3b.py; batch_size and steps are
placeholders."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=151936, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128,
                          max_seq_len=40960, norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
                          ffn_dim=12288, n_experts=128, top_k=8, expert_ffn_dim=1536, router_norm_topk=True,
                          aux_loss_coef=1e-3),
        optim=OptimConfig(lr=3e-4, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=4096, steps=10000, dtype="bfloat16",
                          out_dir="runs/qwen3_235b_a22b"),
    )
