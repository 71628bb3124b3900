"""A tiny Mixtral-style byte model for the CPU: the default's attention (d 256, 4 layers, GQA 8/4 heads)
with every MLP replaced by 8 SwiGLU experts of 384, top-2 (renormalized): 10.4M parameters, 3.29M active
per token, the dense default's 3.28M. Switch-style balancing loss 1e-2, z-loss 1e-3.

The default's budget (280 steps of 16 x 256 tokens, AdamW 2e-3): validation 1.487 nats/byte against the
dense default's 1.528 at equal tokens (`python bench/moe.py --part quality`), in about 5 minutes."""
from nanomega.config import Config, ModelConfig, OptimConfig, TrainConfig


def config() -> Config:
    return Config(
        model=ModelConfig(d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=256,
                          n_experts=8, top_k=2, expert_ffn_dim=384, aux_loss_coef=1e-2, z_loss_coef=1e-3),
        optim=OptimConfig(lr=2e-3, warmup_steps=50, weight_decay=0.1),
        train=TrainConfig(steps=280, batch_size=16, seq_len=256, eval_every=70, ckpt_every=140,
                          out_dir="runs/tiny_mixtral"),
    )
