"""One decoder-only transformer as pure functions over a nested dict of tensors.

    params = init(cfg, seed)                  # {"tok_embed": {"weight": ...}, "layers": [...], ...}
    logits = forward(params, tokens, cfg)     # [B, T, padded_vocab]
    loss   = loss_fn(params, tokens, targets, cfg)

GPT-2, LLaMA and Qwen2/Qwen3 are the same code with different `ModelConfig` fields.
Parameter names (dotted paths of the tree) follow one scheme used everywhere:

    tok_embed.weight          [V, d]      pos_embed.weight [T, d] (learned positions only)
    layers.{i}.attn_norm.weight (.bias)   layers.{i}.mlp_norm.weight (.bias)
    layers.{i}.attn.{wq,wk,wv,wo}.weight (.bias)   layers.{i}.attn.{q,k}_norm.weight (QK-norm)
    layers.{i}.mlp.{w_gate,w_up,w_down}.weight (.bias)
    final_norm.weight (.bias)  lm_head.weight [V, d] (untied only)

Init (GPT-2 / Megatron): weights ~ N(0, init_std); the two residual projections of each
block (attn.wo, mlp.w_down) use init_std / sqrt(2 * n_layers) so the residual stream's
variance does not grow with depth; biases 0, norm gains 1. Vocabulary padding rows are 0 and
stay 0 (their logits are -inf, so they get no gradient): padding the vocabulary further, as
tensor parallel does, changes no number.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanomega.config import ModelConfig
from nanomega.models.layers import attention, mlp, norm, rope_tables
from nanomega.parallel.constrain import constrain

# leaf kinds for init
NORMAL, RESIDUAL, ZEROS, ONES, VOCAB = "normal", "residual", "zeros", "ones", "vocab"


def _linear(out_dim: int, in_dim: int, bias: bool, kind: str = NORMAL) -> dict:
    p = {"weight": ((out_dim, in_dim), kind)}
    if bias:
        p["bias"] = ((out_dim,), ZEROS)
    return p


def _norm(dim: int, cfg: ModelConfig) -> dict:
    p = {"weight": ((dim,), ONES)}
    if cfg.norm == "layernorm":
        p["bias"] = ((dim,), ZEROS)
    return p


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree with (shape, init kind) leaves: the single source of the layout."""
    d, hd, f, V = cfg.d_model, cfg.dim_head, cfg.hidden_dim, cfg.padded_vocab
    qkv_bias = cfg.bias or cfg.qkv_bias
    attn = {
        "wq": _linear(cfg.n_heads * hd, d, qkv_bias),
        "wk": _linear(cfg.kv_heads * hd, d, qkv_bias),
        "wv": _linear(cfg.kv_heads * hd, d, qkv_bias),
        "wo": _linear(d, cfg.n_heads * hd, cfg.bias, RESIDUAL),
    }
    if cfg.qk_norm:
        attn["q_norm"] = {"weight": ((hd,), ONES)}
        attn["k_norm"] = {"weight": ((hd,), ONES)}
    if cfg.mlp == "swiglu":
        ffn = {"w_gate": _linear(f, d, cfg.bias), "w_up": _linear(f, d, cfg.bias),
               "w_down": _linear(d, f, cfg.bias, RESIDUAL)}
    else:
        ffn = {"w_up": _linear(f, d, cfg.bias), "w_down": _linear(d, f, cfg.bias, RESIDUAL)}
    layer = {"attn_norm": _norm(d, cfg), "attn": attn, "mlp_norm": _norm(d, cfg), "mlp": ffn}

    specs = {"tok_embed": {"weight": ((V, d), VOCAB)}}
    if cfg.position == "learned":
        specs["pos_embed"] = {"weight": ((cfg.max_seq_len, d), NORMAL)}
    specs["layers"] = [layer for _ in range(cfg.n_layers)]
    specs["final_norm"] = _norm(d, cfg)
    if not cfg.tie_embeddings:
        specs["lm_head"] = {"weight": ((V, d), VOCAB)}
    return specs


def init(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu", place=None) -> dict:
    """Fresh parameters (fp32 leaves that require grad). device="meta" allocates nothing.

    place(name, tensor) -> leaf, if given, receives each leaf as it is drawn (on the CPU, in the
    usual order, so the numbers do not depend on it) and returns what to keep: a sharded run keeps
    its shard, so no process ever holds more than one whole parameter at a time."""
    cfg.validate()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def make(spec):
        shape, kind = spec
        if torch.device(device).type == "meta":
            return torch.empty(shape, device="meta", requires_grad=True)
        if kind == ONES:
            t = torch.ones(shape)
        elif kind == ZEROS:
            t = torch.zeros(shape)
        elif kind == VOCAB:  # real rows drawn, padding rows 0: the draw does not depend on the padding
            t = F.pad(torch.randn(cfg.vocab_size, shape[1], generator=gen) * cfg.init_std,
                      (0, 0, 0, shape[0] - cfg.vocab_size))
        else:
            t = torch.randn(shape, generator=gen) * (residual_std if kind == RESIDUAL else cfg.init_std)
        return t.to(device).requires_grad_(True)

    def build(node, name=""):
        if isinstance(node, dict):
            return {k: build(v, f"{name}.{k}" if name else k) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v, f"{name}.{i}") for i, v in enumerate(node)]
        if place is None:
            return make(node)
        return place(name, make(node).detach())

    return build(param_specs(cfg))


def forward(params: dict, tokens: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """tokens [B, T] int64 -> logits [B, T, padded_vocab] (padding columns are never targets).

    `constrain` calls are sharding hints (parallel/constrain.py): identity on plain tensors; on a mesh
    they keep the residual stream laid out like the tokens and gather the sequence where a
    tensor-parallel matmul needs it."""
    T = tokens.shape[1]
    x = constrain(F.embedding(constrain(tokens, tokens, whole_sequence=True), params["tok_embed"]["weight"]), tokens)
    rope = None
    if cfg.position == "learned":
        x = x + params["pos_embed"]["weight"][:T]
    else:
        rope = rope_tables(cfg, T, tokens.device)
    for layer in params["layers"]:
        h = constrain(norm(layer["attn_norm"], x, cfg), tokens, whole_sequence=True)
        x = x + constrain(attention(layer["attn"], h, rope, cfg), tokens)
        h = constrain(norm(layer["mlp_norm"], x, cfg), tokens, whole_sequence=True)
        x = x + constrain(mlp(layer["mlp"], h, cfg), tokens)
    x = constrain(norm(params["final_norm"], x, cfg), tokens, whole_sequence=True)
    head = params["tok_embed"] if cfg.tie_embeddings else params["lm_head"]
    return F.linear(x, head["weight"])


def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Mean next-token cross-entropy in nats, computed in fp32 whatever the autocast dtype.

    Padding columns of the vocabulary get -inf (no probability mass) rather than being sliced off, so
    vocab-parallel logits are never gathered; the sum over tokens divided by their count is the mean
    that a vocab-parallel loss can compute on any mesh."""
    logits = forward(params, tokens, cfg).float()
    if cfg.padded_vocab > cfg.vocab_size:
        ids = torch.arange(cfg.padded_vocab, device=tokens.device)
        logits = logits + torch.where(ids < cfg.vocab_size, 0.0, float("-inf"))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    return loss / targets.numel()
