"""What a model costs, counted from its parameter tree without allocating it: parameters (published, padded,
active) and training FLOPs per token, the figures MFU, the planner and the simulator all divide by."""
from __future__ import annotations

import math

from nanomega.config import ModelConfig
from nanomega.models.transformer import VOCAB, param_specs


def count_params(cfg: ModelConfig, padded: bool = False, active: bool = False) -> int:
    """Number of parameters, counted from the model's parameter tree (nothing is allocated).
    padded=False gives the published count (true vocab_size rows in the embedding and head);
    padded=True counts the rows the model actually allocates. active=True counts what one token
    uses: of each stacked expert weight only top_k of the n_experts experts (MoE's "active
    parameters"); the router and the shared experts are used by every token."""
    total = 0
    for name, (shape, kind) in _spec_leaves(param_specs(cfg)):
        n = math.prod(shape)
        if kind == VOCAB and not padded:
            n = cfg.vocab_size * shape[1]
        if active and ".experts." in name:
            n = n * cfg.top_k // cfg.n_experts
        if name.endswith("expert_bias"):   # a buffer moved by the balancing rule, not trained
            n = 0
        total += n
    return total


def _spec_leaves(specs, prefix: str = ""):
    """(dotted name, (shape, init kind)) for every leaf of a param_specs tree."""
    if isinstance(specs, dict):
        for k, v in specs.items():
            yield from _spec_leaves(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(specs, list):
        for i, v in enumerate(specs):
            yield from _spec_leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, specs


def _embedding_params(cfg: ModelConfig, vocab: int) -> int:
    pos = cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0
    return vocab * cfg.d_model + pos


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, PaLM appendix B convention:
        6 * N_matmul + 6 * n_layers * n_heads * (qk_dim + v_dim) * seq_len
    6*N: each weight does one multiply-add (2 FLOPs) per token forward and two backward
    (input grad and weight grad). N_matmul is every *active* parameter (for MoE: top_k of the
    n_experts experts, plus router and shared experts) except the embedding lookup tables (a
    gather costs no FLOPs); norms and biases stay in because they are a rounding error and leaving
    them keeps N_matmul = count_params - embeddings. The LM head is a real [d, vocab] matmul,
    counted once even when tied to tok_embed, at the padded vocab because that is the matmul that
    runs. The second term is QK^T and attention@V (2*T*qk_dim + 2*T*v_dim per head, times 3 for
    backward; 12*T*head_dim for ordinary attention, MLA's qk_dim is nope + rope), using query heads
    (GQA does not shrink it) and without halving for the causal mask, as PaLM and Megatron report MFU.
    """
    vocab = cfg.padded_vocab
    n_matmul = count_params(cfg, padded=True, active=True) - _embedding_params(cfg, vocab)
    n_matmul += vocab * cfg.d_model * cfg.tie_embeddings    # tied: the head reuses tok_embed in a matmul
    if cfg.attention == "mla":
        qk, v = cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.v_head_dim
    else:
        qk = v = cfg.dim_head
    attention = 6 * cfg.n_layers * cfg.n_heads * (qk + v) * seq_len
    return float(6 * n_matmul + attention)
