"""Sharding hints the model may call: identities on plain tensors, layout requests on a mesh.

The model never names a rank, a mesh dim or a mode. It calls a few hints (the idea of JAX's
`with_sharding_constraint`), and a serial run sees none of them:

    x = constrain(x, tokens)                          # the residual stream: laid out like the tokens
    h = constrain(h, tokens, whole_sequence=True)     # the input of a tensor-parallel matmul
    y, stats = expert_parallel(routed_moe, p, h, cfg) # routed experts: routed_moe(p, h, cfg) serially
    cos, sin = sequence_order(rope_tables(...), tokens)   # per-position tables, in the tokens' order
    y = causal_attention(q, k, v)                     # causal SDPA, over the whole sequence
    mask = document_mask(tokens, separator, dtype)    # packed documents kept apart (causal_attention's documents)
    total = vocab_parallel(linear_cross_entropy, x, w, targets, vocab_size, chunk)   # the head's fused loss

The batch is the one thing a parallel run places on the mesh (nanomega.parallel.parallelize):
tokens are split over the data-parallel dims on the batch, and under sequence parallel over tp on
the sequence. `constrain` asks an activation to follow that layout: after a row-parallel matmul the
activation is a partial sum on tp, and `constrain(x, tokens)` all-reduces it, or reduce-scatters it
on the sequence under sequence parallel; `whole_sequence=True` all-gathers the sequence back before
attention and the MLP. That is torch.distributed.tensor alone, so it is written here.

Under context parallel (a `cp` mesh dim) the sequence itself is split, in the load-balanced order of
nanomega.parallel.context, and `whole_sequence` gathers it over tp only (every layer but attention treats
tokens one by one). Hints that need more than a redistribution (expert_parallel's all-to-alls; on a cp mesh
sequence_order, document_mask, causal_attention and linear; fp8_linear and vocab_parallel) are implemented
under nanomega.parallel, which registers them here when imported (`register`), the way torch registers an
operator's sharding rule: once, at import, never changed after. This module imports nothing from the rest
of nanomega.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Replicate, Shard

_ON_MESH: dict = {}   # hint name -> its implementation on DTensors, filled by nanomega.parallel at import
CONTEXT = "cp"        # the mesh dim that splits the sequence for attention too (context parallel)


def register(hint: str):
    """Decorator: `fn` implements the hint `hint` ("expert_parallel") when its activation is a DTensor."""
    def add(fn):
        _ON_MESH[hint] = fn
        return fn
    return add


def constrain(x: torch.Tensor, tokens: torch.Tensor, whole_sequence: bool = False) -> torch.Tensor:
    """x [B, T, ...] redistributed to the placements of tokens [B, T] (sequence gathered if asked)."""
    if not isinstance(x, DTensor):
        return x
    # the sequence stays split over cp (context parallel): attention gathers what it needs itself
    placements = tuple(Replicate() if whole_sequence and p == Shard(1) and dim != CONTEXT else p
                       for dim, p in zip(tokens.device_mesh.mesh_dim_names, tokens.placements))
    if placements != tuple(x.placements):
        # under sequence parallel, the all-gather here has a reduce-scatter of the gradient as backward
        x = x.redistribute(x.device_mesh, placements)
    elif whole_sequence:
        # The input of a column-parallel matmul: its gradient comes back as a partial sum over tp.
        # Reduce it here, on the activation (Megatron's "f"), rather than letting DTensor carry the
        # partial sum down the residual stream (it cannot hand one to the vocab-parallel embedding).
        x = DTensor.from_local(x.to_local(), x.device_mesh, placements, shape=x.shape, stride=x.stride())
    return x


def expert_parallel(fn, params: dict, x: torch.Tensor, cfg):
    """fn(params, x, cfg) -> (y, stats): the routed experts of one MoE layer on the activation x.

    On plain tensors, that call. On a mesh, the implementation nanomega.parallel.experts registers:
    fn on this rank's tokens and experts, with the all-to-alls and the statistics' reductions."""
    if not isinstance(x, DTensor):
        return fn(params, x, cfg)
    return _runtime("expert_parallel", "nanomega.parallel.experts")(fn, params, x, cfg)


def _on_context_mesh(x: torch.Tensor) -> bool:
    return isinstance(x, DTensor) and CONTEXT in (x.device_mesh.mesh_dim_names or ())


def _runtime(hint: str, module: str):
    if hint not in _ON_MESH:
        raise RuntimeError(f"the model ran on a mesh that needs the {hint!r} runtime, but none is registered; "
                           f"import {module} (nanomega.parallel.parallelize does) before running the model on a mesh")
    return _ON_MESH[hint]


def sequence_order(table, tokens: torch.Tensor):
    """table [T, ...] (or a tuple of them) indexed by position -> its rows in the order the sequence of
    tokens [B, T] is laid out. The identity, except on a context-parallel mesh, where the batch is placed
    in the load-balanced order (nanomega.parallel.context), so the tables follow it."""
    if not _on_context_mesh(tokens):
        return table
    return _runtime("sequence_order", "nanomega.parallel.context")(table, tokens)


def document_mask(tokens: torch.Tensor, separator: int, dtype: torch.dtype):
    """What causal_attention needs to keep each document of a packed sequence to itself: a document opens at
    every `separator` token (the separator belongs to the document it opens, as data.align=bos reads the stream),
    and a token attends to the earlier tokens of its own document only. dtype: attention's (q's).

    On plain tensors, `same_document`'s mask as SDPA's additive one, [B, 1, T, T] of 0 and -inf in `dtype`, made
    once per forward and handed to every layer: each layer's SDPA saves its mask for the backward, and a boolean
    one it would first convert to a new one of q's dtype, a copy per layer (measured on the simulator: 2 layers
    held 9x the boolean mask). On a mesh without cp the same for this rank's rows, a plain tensor (attention then
    runs on the local tensors). On a context-parallel mesh, what nanomega.parallel.context registers."""
    if _on_context_mesh(tokens):
        return _runtime("document_mask", "nanomega.parallel.context")(tokens, separator, dtype)
    if isinstance(tokens, DTensor):      # the whole sequence of this rank's rows (sequence parallel splits it)
        tokens = constrain(tokens, tokens, whole_sequence=True).to_local()
    visible = same_document(tokens == separator)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def same_document(opens: torch.Tensor) -> torch.Tensor:
    """opens [B, T] bool (a document opens at the token) -> [B, 1, T, T] bool: query t sees key s when s <= t and
    no document opens in (s, t]. Row t of a sequence whose every token is its own document sees itself only."""
    document = opens.cumsum(1)
    T = document.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document.device).tril()
    return (document[:, None, :, None] == document[:, None, None, :]) & causal


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     enable_gqa: bool = False, documents=None) -> torch.Tensor:
    """Causal scaled-dot-product attention of q [B, H, T, Dqk] to k [B, Hkv, T, Dqk] and v [B, Hkv, T, Dv];
    documents: None, or document_mask's, which keeps each packed document to itself.

    F.scaled_dot_product_attention(q, k, v, is_causal=True, ...) (attn_mask=documents given a mask), on plain
    tensors and on a mesh whose sequence is whole in attention (with a mask, on the local tensors: every row and
    head is independent, and DTensor has no sharding rule for SDPA's mask). On a context-parallel mesh, the
    implementation nanomega.parallel.context registers: this rank's queries against the keys of every cp rank
    (all-gathered or passed around a ring)."""
    if _on_context_mesh(q):
        return _runtime("causal_attention", "nanomega.parallel.context")(q, k, v, scale, documents)
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    if not isinstance(q, DTensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents, scale=scale, enable_gqa=enable_gqa)
    y = F.scaled_dot_product_attention(q.to_local(), k.to_local(), v.to_local(), attn_mask=documents, scale=scale,
                                       enable_gqa=enable_gqa)
    shape = torch.Size((*q.shape[:-1], v.shape[-1]))
    return DTensor.from_local(y.contiguous(), q.device_mesh, q.placements, run_check=False, shape=shape,
                              stride=make_contiguous_strides_for(shape))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias). On a context-parallel mesh, the implementation nanomega.parallel.context registers:
    torch 2.13's DTensor flattens x [B, T, d] to [B * T, d] for the matmul and cannot view the result back when
    the batch is split over data parallel and the sequence over cp, so the rows are flattened on the local
    tensor instead."""
    if not _on_context_mesh(x):
        return F.linear(x, w, bias)
    return _runtime("linear", "nanomega.parallel.context")(x, w, bias)


def fp8_linear(fn, x: torch.Tensor, w: torch.Tensor, recipe: str, history=None, margin: int = 0,
               amax_reduction: str = "linear") -> torch.Tensor:
    """fn(x, w, recipe, history=..., margin=...): a float8 matmul (nanomega/models/fp8.py's `linear`). On a
    mesh, nanomega.parallel.fp8 runs it on this rank's pieces, every amax reduced over the ranks holding
    other pieces of the tensor (delayed scaling's, under amax_reduction="step", once at the step's end)."""
    if isinstance(x, DTensor):
        return _runtime("fp8_linear", "nanomega.parallel.fp8")(fn, x, w, recipe, history, margin, amax_reduction)
    return fn(x, w, recipe, history=history, margin=margin)


def vocab_parallel(fn, x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk: int):
    """fn(x, w, targets, vocab_size, chunk, vocab_start=, reduce=) -> the summed cross-entropy of the head's
    matmul (nanomega/models/loss.py's `linear_cross_entropy`). On a mesh, nanomega.parallel.vocab_loss runs it
    on this rank's tokens and rows of the vocabulary, the per-token numbers reduced over the vocabulary's ranks."""
    if not isinstance(x, DTensor):
        return fn(x, w, targets, vocab_size, chunk)
    return _runtime("vocab_parallel", "nanomega.parallel.vocab_loss")(fn, x, w, targets, vocab_size, chunk)
