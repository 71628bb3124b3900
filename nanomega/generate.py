"""Autoregressive sampling as a pure function of the parameters (no KV cache: the default model
is small and the context short, so recomputing the prefix keeps this readable)."""
from __future__ import annotations

import torch

from nanomega.config import ModelConfig
from nanomega.models import forward


@torch.no_grad()
def sample(params: dict, cfg: ModelConfig, prompt: torch.Tensor, n_new: int, temperature: float = 1.0,
           top_k: int = 0, generator: torch.Generator | None = None, next_logits=None) -> torch.Tensor:
    """prompt [B, T0] int64 -> [B, T0 + n_new]. temperature 0 means greedy; top_k 0 means no cut.
    Padding columns of the vocabulary are never sampled. next_logits(context [B, T]) -> [B, vocab] gives
    the logits of the token after each row; by default the model's forward on `params`, on a mesh the
    sharded model's (parallel/sample.py), which hands every rank the same logits, so every rank draws the
    same tokens from the same generator."""
    if next_logits is None:
        def next_logits(context):
            return forward(params, context, cfg)[:, -1]
    tokens = prompt
    for _ in range(n_new):
        context = tokens[:, -cfg.max_seq_len:]
        logits = next_logits(context)[:, :cfg.vocab_size].float()
        if temperature == 0:
            next_token = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens
