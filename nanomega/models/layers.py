"""Transformer building blocks as pure functions: each takes its slice of the parameter tree.

Linear weights are stored [out_features, in_features], as torch and Hugging Face store them,
so `F.linear(x, w)` computes x @ w.T and checkpoints convert by renaming only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanomega.models import fp8
from nanomega.config import ModelConfig
from nanomega.hints import causal_attention, fp8_linear


def linear(p: dict, x: torch.Tensor, cfg: ModelConfig | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); in float8 as cfg.fp8 says (nanomega/models/fp8.py; through the hint `fp8_linear`,
    which on a mesh scales every tensor as a whole across the ranks holding its pieces)."""
    if cfg is None or cfg.fp8 == "none":
        return F.linear(x, p["weight"], p.get("bias"))
    y = fp8_linear(fp8.linear, x, p["weight"], cfg.fp8, p.get("fp8_history"), cfg.fp8_margin, cfg.fp8_amax_reduction)
    return y if p.get("bias") is None else y + p["bias"].to(y.dtype)


def norm(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """LayerNorm or RMSNorm, computed in fp32 and returned in x's dtype (a bf16 residual stream is
    normalised in fp32, as Megatron and HF do; for fp32 the casts are no-ops)."""
    weight, bias = p["weight"].float(), p.get("bias")
    if cfg.norm == "layernorm":
        y = F.layer_norm(x.float(), x.shape[-1:], weight, None if bias is None else bias.float(), cfg.norm_eps)
    else:
        y = F.rms_norm(x.float(), x.shape[-1:], weight, cfg.norm_eps)
    return y.to(x.dtype)


def rope_tables(cfg: ModelConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim/2] for rotary embeddings, always computed in fp32. The rotary dim is
    the head dim, or for multi-head latent attention the rope part of each head (qk_rope_dim)."""
    half = (cfg.qk_rope_dim if cfg.attention == "mla" else cfg.dim_head) // 2
    inv_freq = cfg.rope_theta ** (-torch.arange(0, half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head ("rotate_half", the LLaMA/HF layout). x: [B, H, T, D]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


def split_heads(x: torch.Tensor, dim_head: int) -> torch.Tensor:
    """[B, T, H * D] -> [B, H, T, D]. Plain view ops rather than einops: under torch.compile einops's lookup
    of a backend per tensor type is traced and guarded, and a mesh run that meets a second tensor type
    (DTensor and plain) recompiled every block twice."""
    return x.unflatten(-1, (-1, dim_head)).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H * D]."""
    return y.transpose(1, 2).flatten(-2)


def attention(p: dict, x: torch.Tensor, rope, cfg: ModelConfig, cache: dict | None = None,
              position: int = 0) -> torch.Tensor:
    """Causal (grouped-query) self-attention. x: [B, T, d_model]. With a cache (generation: this layer's
    {"k", "v"} of models/transformer.py's init_cache), x holds positions position.. and attends to the
    cached keys and values before them too."""
    q = split_heads(linear(p["wq"], x, cfg), cfg.dim_head)
    k = split_heads(linear(p["wk"], x, cfg), cfg.dim_head)
    v = split_heads(linear(p["wv"], x, cfg), cfg.dim_head)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
        q = F.rms_norm(q, q.shape[-1:], p["q_norm"]["weight"], cfg.norm_eps)
        k = F.rms_norm(k, k.shape[-1:], p["k_norm"]["weight"], cfg.norm_eps)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if cache is None:
        y = causal_attention(q, k, v, enable_gqa=cfg.kv_heads != cfg.n_heads)   # SDPA (a hint: nanomega/hints.py)
    else:
        k, v = cached(cache, "k", k, position), cached(cache, "v", v, position)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q.shape[2], position, q.device),
                                           enable_gqa=cfg.kv_heads != cfg.n_heads)
    return linear(p["wo"], merge_heads(y), cfg)


def cached(cache: dict, key: str, new: torch.Tensor, position: int) -> torch.Tensor:
    """Writes new [B, H, T, D] into the buffer cache[key] [B, H, max_len, D] at positions position..
    position+T-1 and returns the buffer's positions 0..position+T-1. In place: a fresh tensor per token
    (torch.cat) would copy the whole cache every step; nothing before `position` is ever changed."""
    end = position + new.shape[2]
    cache[key][:, :, position:end] = new
    return cache[key][:, :, :end]


def causal_mask(queries: int, position: int, device) -> torch.Tensor | None:
    """Which of the keys 0..position+queries-1 each query (at positions position..) may see: [queries, keys]
    bool; None for one query, which sees them all. SDPA's is_causal aligns the square's top-left corner,
    wrong once queries < keys, so the diagonal is shifted by hand."""
    if queries == 1:
        return None
    return torch.ones(queries, position + queries, dtype=torch.bool, device=device).tril(position)


def mlp(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    if cfg.mlp == "swiglu":
        return linear(p["w_down"], F.silu(linear(p["w_gate"], x, cfg)) * linear(p["w_up"], x, cfg), cfg)
    return linear(p["w_down"], F.gelu(linear(p["w_up"], x, cfg), approximate="tanh"), cfg)
