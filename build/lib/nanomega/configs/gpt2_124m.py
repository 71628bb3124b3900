"""GPT-2 small (124M): learned positions, LayerNorm, GELU, biases, tied embeddings."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
                          norm="layernorm", mlp="gelu", position="learned", tie_embeddings=True, bias=True),
        optim=OptimConfig(lr=6e-4, warmup_steps=700, weight_decay=0.1),
        train=TrainConfig(batch_size=8, seq_len=1024, grad_accum=8, steps=5000, out_dir="runs/gpt2_124m"),
    )
