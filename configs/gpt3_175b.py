"""GPT-3 175B (Brown et al. 2020): 96 layers, d 12288, 96 heads, GELU MLP 4 x d, learned positions, LayerNorm,
biases, sequence 2,048; vocabulary 50,257 (Megatron pads it to a multiple of 128 x tp). The model of Megatron-Core's
published MFU runs (bench/published.py), as Megatron trains it: untied output layer, bf16."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, max_seq_len=2048,
                          norm="layernorm", mlp="gelu", position="learned", bias=True),
        optim=OptimConfig(lr=6e-5, warmup_steps=2000, weight_decay=0.1),
        train=TrainConfig(batch_size=1, seq_len=2048, steps=10000, dtype="bfloat16", out_dir="runs/gpt3_175b"),
    )
