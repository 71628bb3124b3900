"""Transformer building blocks as pure functions: each takes its slice of the parameter tree.
(The MLP kinds are models/mlp.py's registry.)

Linear weights are stored [out_features, in_features], as torch and Hugging Face store them,
so `F.linear(x, w)` computes x @ w.T and checkpoints convert by renaming only.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanomega.models import fp8
from nanomega.config import ModelConfig
from nanomega.hints import causal_attention, fp8_linear, linear as hint_linear


def linear(p: dict, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x @ weight.T (+ bias); in float8 as cfg.fp8 says (nanomega/models/fp8.py; through the hint `fp8_linear`,
    which on a mesh scales every tensor as a whole across the ranks holding its pieces)."""
    if cfg.fp8 == "none":
        return hint_linear(x, p["weight"], p.get("bias"))     # F.linear (on a cp mesh, rows flattened locally)
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


def rope_frequencies(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim/2] in float64, the factor cos and sin are multiplied by), with the
    model's rope scaling: how a model pretrained on rope_original_max_len positions reads longer contexts.

    "llama3" (Llama 3.1/3.2): a dim whose wavelength is longer than original/low_freq_factor is slowed by
    `factor` (interpolated), one shorter than original/high_freq_factor is kept, and the ones between blend
    the two linearly in original/wavelength. "yarn" (YaRN, Peng et al. 2023; Qwen2/3, DeepSeek-V3): the same
    idea by rotations: a dim that turns more than beta_fast times within the original context is kept, one
    that turns fewer than beta_slow times is slowed by `factor`, with a linear ramp over the dims between
    (their bounds floored and ceiled); cos and sin are scaled by HF's attention_factor (0.1 ln factor + 1, or
    the ratio of the mscale and mscale_all_dim versions, or one given outright), which sharpens the softmax
    that longer contexts flatten. Computed in float64 so the rounding is fp32's once, at the cast."""
    half = (cfg.qk_rope_dim if cfg.attention == "mla" else cfg.dim_head) // 2
    dim = 2 * half
    inv_freq = cfg.rope_theta ** (-torch.arange(0, half, device=device, dtype=torch.float64) / half)
    factor, original = cfg.rope_factor, cfg.rope_original_max_len
    if cfg.rope_scaling == "llama3":
        wavelength = 2 * math.pi / inv_freq
        low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        smooth = ((original / wavelength - low) / (high - low)).clamp(0, 1)   # 0: slow it down, 1: keep it
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0
    if cfg.rope_scaling == "yarn":
        def dim_of(rotations):      # the dim that turns `rotations` times within the original context
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        first = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
        last = min(math.ceil(dim_of(cfg.rope_beta_slow)), dim - 1)
        span = last - first if last != first else 1e-3             # as Hugging Face: no division by zero
        ramp = ((torch.arange(half, device=device, dtype=torch.float64) - first) / span).clamp(0, 1)
        if cfg.rope_attention_factor:
            scale = cfg.rope_attention_factor
        elif cfg.rope_mscale and cfg.rope_mscale_all_dim:
            scale = yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
        else:
            scale = yarn_mscale(factor)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp), scale
    return inv_freq, 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_tables(cfg: ModelConfig, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim/2] for rotary embeddings, always computed in fp32 (the frequencies in
    float64 first: rope_frequencies, with the model's rope scaling). The rotary dim is the head dim, or for
    multi-head latent attention the rope part of each head (qk_rope_dim)."""
    inv_freq, scale = rope_frequencies(cfg, device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq.float())
    return angles.cos() * scale, angles.sin() * scale


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


class Positions(NamedTuple):
    """Where a batch's tokens sit, as attention reads it (models/transformer.py `positions`, made once per forward):
    RoPE's (cos, sin) [T, rotary/2] in the tokens' order (None: learned positions, added by the embedding), and
    the packed documents' mask (hints.document_mask; None: every token attends to the whole causal prefix)."""
    rope: tuple | None = None
    documents: object = None


def attention(p: dict, x: torch.Tensor, at: Positions, cfg: ModelConfig, cache: dict | None = None,
              position: int = 0) -> torch.Tensor:
    """Causal (grouped-query) self-attention. x: [B, T, d_model]. With a cache (generation: this layer's
    {"k", "v"} of models/transformer.py's init_cache), x holds positions position.. and attends to the
    cached keys and values before them too."""
    q, k, v = (split_heads(linear(p[w], x, cfg), cfg.dim_head) for w in ("wq", "wk", "wv"))
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
        q = F.rms_norm(q, q.shape[-1:], p["q_norm"]["weight"], cfg.norm_eps)
        k = F.rms_norm(k, k.shape[-1:], p["k_norm"]["weight"], cfg.norm_eps)
    if at.rope is not None:
        q, k = apply_rope(q, *at.rope), apply_rope(k, *at.rope)
    if cache is None:   # SDPA (a hint: nanomega/hints.py)
        y = causal_attention(q, k, v, enable_gqa=cfg.kv_heads != cfg.n_heads, documents=at.documents)
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
