"""Multi-head latent attention (MLA, DeepSeek-V2/V3) as a pure function over its parameter subtree.

MLA shrinks what a KV cache must hold. Each token's keys and values are not projected per head
but from one small latent c = RMSNorm(x @ W_kv_a) of kv_lora_rank dims (512 in DeepSeek-V3
against 128 heads x 256 dims of K and V): W_kv_b expands c into every head's k_nope and v, so a
cache needs only c. The query can be low-rank too (q_lora_rank > 0: x -> wq_a -> RMSNorm -> wq_b).

RoPE cannot be applied to keys made from c: a position-dependent rotation between W_kv_b and the
query would stop W_kv_b from being folded into the query at inference. So RoPE gets its own
dims: each head's query has nope dims (no position) and rope dims (rotated), and the key's rope
dims come straight from x as ONE rope key of qk_rope_dim, shared by all heads (like MQA):

    q      = x @ wq.T  (or wq_b(RMSNorm(wq_a(x))))    [B, T, H, nope + rope]  -> q_nope | RoPE(q_rope)
    c | kr = x @ wkv_a.T                              [B, T, kv_lora_rank + rope]
    k_nope | v = RMSNorm(c) @ wkv_b.T                 [B, T, H, nope + v_head_dim]
    k      = k_nope | RoPE(kr) (the same for every head);  softmax scale 1/sqrt(nope + rope) (YaRN: softmax_scale)
    y      = causal softmax(q k^T) v @ wo.T           [B, T, d]

Parameters (weights [out, in], no biases; H = n_heads):
    wq    [H*(nope+rope), d]                  when q_lora_rank == 0, otherwise
    wq_a  [q_lora_rank, d],  q_a_norm [q_lora_rank],  wq_b [H*(nope+rope), q_lora_rank]
    wkv_a [kv_lora_rank + rope, d],  kv_a_norm [kv_lora_rank],  wkv_b [H*(nope+v_head_dim), kv_lora_rank]
    wo    [d, H*v_head_dim]  (residual-scaled init)
Each head's rows are [nope rows, rope rows] in wq/wq_b and [k_nope rows, v rows] in wkv_b, the
order Hugging Face's DeepseekV3Attention uses, so its q_proj / q_a_proj / q_a_layernorm / q_b_proj /
kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj / o_proj convert by renaming, except the rope rows:
HF rotates interleaved pairs by default (rope_interleave=True), we rotate halves; see
rope_rows_from_interleaved. HF's two latent norms use eps 1e-6 whatever rms_norm_eps says; ours use
cfg.norm_eps (DeepSeek's is 1e-6 too).

Generation (a cache given: `latent_attention`) keeps per token and layer only the normalized latent
c and the rotated rope key kr, kv_lora_rank + qk_rope_dim numbers, as DeepSeek's inference code does,
instead of the expanded keys and values' H * (nope + rope + v_head_dim): 576 against 40,960 for
DeepSeek-V3 (71x less), 80 against 480 for configs/tiny_deepseek_v3.py. wkv_b is never applied to the
cache: its key rows are folded into the query (q_nope W_k . c = (q_nope W_k) . c) and its value rows
into the output (softmax . (c W_v^T) = (softmax . c) W_v^T), so attention runs on the latent, as one
multi-query SDPA over [c | kr] with c as the values; equal to the training form up to fp32 rounding.

Training runs the form above: keys and values are expanded to all heads and fed to SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanomega.hints import causal_attention
from nanomega.models.layers import apply_rope, cached, causal_mask, linear, merge_heads, split_heads, yarn_mscale


def param_specs(cfg, make_linear, residual) -> dict:
    """The attention subtree with (shape, init kind) leaves; make_linear(out, in, bias, kind) is a weight's spec."""
    d, H, r = cfg.d_model, cfg.n_heads, cfg.kv_lora_rank
    qk, v = cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.v_head_dim
    if cfg.q_lora_rank:
        q = {"wq_a": make_linear(cfg.q_lora_rank, d, False), "q_a_norm": {"weight": ((cfg.q_lora_rank,), "ones")},
             "wq_b": make_linear(H * qk, cfg.q_lora_rank, False)}
    else:
        q = {"wq": make_linear(H * qk, d, False)}
    return {**q, "wkv_a": make_linear(r + cfg.qk_rope_dim, d, False), "kv_a_norm": {"weight": ((r,), "ones")},
            "wkv_b": make_linear(H * (cfg.qk_nope_dim + v), r, False),
            "wo": make_linear(d, H * v, False, kind=residual)}


def softmax_scale(cfg) -> float:
    """1/sqrt(nope + rope), times YaRN's mscale(factor, mscale_all_dim)^2 under YaRN rope scaling: DeepSeek-V3
    sharpens its softmax for the stretched context here (with mscale == mscale_all_dim, as it ships, the
    cos/sin factor is 1 and this is the whole of YaRN's attention scaling)."""
    scale = (cfg.qk_nope_dim + cfg.qk_rope_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.rope_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


def attention(p: dict, x: torch.Tensor, at, cfg, cache: dict | None = None, position: int = 0) -> torch.Tensor:
    """Causal multi-head latent attention. x: [B, T, d_model]; at: layers.Positions (RoPE's (cos, sin)
    [T, qk_rope_dim/2] or None, the documents' mask or None).
    With a cache (generation), x holds positions position.. and attends on the latent (latent_attention)."""
    nope, rot, H = cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.n_heads
    if "wq" in p:
        q = linear(p["wq"], x, cfg)
    else:
        q_latent = linear(p["wq_a"], x, cfg)
        q = linear(p["wq_b"], F.rms_norm(q_latent, q_latent.shape[-1:], p["q_a_norm"]["weight"], cfg.norm_eps), cfg)
    q_nope, q_rope = split_heads(q, nope + rot).split([nope, rot], dim=-1)
    latent, k_rope = linear(p["wkv_a"], x, cfg).split([cfg.kv_lora_rank, rot], dim=-1)
    latent = F.rms_norm(latent, latent.shape[-1:], p["kv_a_norm"]["weight"], cfg.norm_eps)
    k_rope = k_rope[:, None]                                             # [B, 1, T, rope]: one key for all heads
    if at.rope is not None:
        q_rope, k_rope = apply_rope(q_rope, *at.rope), apply_rope(k_rope, *at.rope)
    if cache is not None:
        return latent_attention(p, q_nope, q_rope, latent, k_rope, cfg, cache, position)
    kv = split_heads(linear(p["wkv_b"], latent, cfg), nope + cfg.v_head_dim)
    k_nope, v = kv.split([nope, cfg.v_head_dim], dim=-1)                 # [B, H, T, nope], [B, H, T, v]
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope.expand(-1, H, -1, -1)], dim=-1)
    y = causal_attention(q, k, v, scale=softmax_scale(cfg), documents=at.documents)   # SDPA; v may be narrower
    return linear(p["wo"], merge_heads(y), cfg)


def latent_attention(p: dict, q_nope, q_rope, latent, k_rope, cfg, cache: dict, position: int) -> torch.Tensor:
    """Attention on the cached latent (module doc): q_nope [B, H, T, nope], q_rope [B, H, T, rope], latent
    [B, T, kv_lora_rank], k_rope [B, 1, T, rope] (the ropes rotated); cache {"kv": [B, 1, max_len, r + rope]}."""
    nope, r = cfg.qk_nope_dim, cfg.kv_lora_rank
    w_kv = p["wkv_b"]["weight"].unflatten(0, (cfg.n_heads, -1))           # [H, nope + v, r]
    w_k, w_v = w_kv.split([nope, cfg.v_head_dim], dim=1)
    keys = cached(cache, "kv", torch.cat([latent[:, None], k_rope], dim=-1), position)   # [B, 1, P + T, r + rope]
    q = torch.cat([q_nope @ w_k, q_rope], dim=-1)                         # [B, H, T, r + rope]
    y = F.scaled_dot_product_attention(q, keys, keys[..., :r], attn_mask=causal_mask(q.shape[2], position, q.device),
                                       scale=softmax_scale(cfg), enable_gqa=True)
    return linear(p["wo"], merge_heads(y @ w_v.transpose(1, 2)), cfg)    # [B, H, T, r] -> [B, H, T, v]


# --- Hugging Face's interleaved rope layout -------------------------------------------------------
# HF's apply_rotary_pos_emb_interleave rotates pairs (x0, x1), (x2, x3), ... and writes the result
# as [rotated evens | rotated odds]: exactly our rotate-half RoPE applied to x[[0, 2, 4, ..., 1, 3, 5, ...]].
# So moving those rope rows of the weights that produce x into that order makes our q and k equal
# HF's element for element (not only their dot products).

def _permute_rope_rows(weight: torch.Tensor, n_heads: int, nope: int, rope: int, to_hf: bool) -> torch.Tensor:
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])    # HF's rows, evens first
    order = torch.argsort(order) if to_hf else order
    w = weight.reshape(n_heads, nope + rope, *weight.shape[1:])
    return torch.cat([w[:, :nope], w[:, nope:][:, order]], dim=1).reshape(weight.shape)


def rope_rows_from_interleaved(weight: torch.Tensor, n_heads: int, nope: int, rope: int) -> torch.Tensor:
    """HF (rope_interleave=True) weight -> ours: in each of n_heads blocks of [nope rows, rope rows],
    the rope rows reordered evens first, then odds. A new tensor; other rows and dims untouched.

    wq / wq_b (HF q_proj / q_b_proj): n_heads=H, nope=qk_nope_dim.  wkv_a (HF kv_a_proj_with_mqa) is
    one block [kv_lora_rank latent rows, rope rows]: n_heads=1, nope=kv_lora_rank. Nothing else."""
    return _permute_rope_rows(weight, n_heads, nope, rope, to_hf=False)


def rope_rows_to_interleaved(weight: torch.Tensor, n_heads: int, nope: int, rope: int) -> torch.Tensor:
    """Ours -> HF (rope_interleave=True): the inverse of rope_rows_from_interleaved, same arguments."""
    return _permute_rope_rows(weight, n_heads, nope, rope, to_hf=True)
