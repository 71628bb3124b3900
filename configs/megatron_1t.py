"""Megatron's 1T-parameter GPT (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", Table 1's last row): 128 layers, d 25,600, 160 heads, GELU MLP 4 x d, learned positions,
LayerNorm, biases, sequence 2,048, vocabulary 51,200, the output layer tied to the embedding (Megatron's GPT default):
1.008T parameters. Trained on 3,072 A100 with TP 8 x PP 64 x DP 6, global batch 3,072 sequences, full recomputation
(bench/published.py)."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=51200, d_model=25600, n_layers=128, n_heads=160, max_seq_len=2048,
                          norm="layernorm", mlp="gelu", position="learned", bias=True, tie_embeddings=True),
        optim=OptimConfig(lr=6e-5, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=2048, steps=10000, dtype="bfloat16", out_dir="runs/megatron_1t",
                          activation_checkpointing="full"),
    )
