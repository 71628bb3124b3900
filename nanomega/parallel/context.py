"""Context parallel: the sequence split over `cp` ranks, attention computed across the split.
The layout of the shards, the two methods' shared block loop and its hand-written backward, packed documents'
masks and the model's hints all turn on the same positions and the same blocks, so they live in one file; the
design's chapter, with its measurements, is docs/pipeline-context.md ("Context parallel").

Every layer but attention treats tokens independently, so a rank can hold T / cp of each sequence
and run the model on them unchanged, given which positions it holds (`shard_indices`: its RoPE angles
and causal mask use them) and `attention`, causal over the whole sequence:

    idx = shard_indices(T, cp, rank)                            # this rank's positions
    every = load_balanced_order(T, cp).view(cp, -1)             # every rank's, in rank order
    y = attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], every, group, method="all_gather" | "ring")

Load balance. A causal token at position p attends to p + 1 keys, so contiguous slices would give
the last rank 2*cp - 1 times the work of the first. The sequence is cut into 2 * cp chunks and rank r
holds chunks r and 2*cp - 1 - r (Megatron's and TransformerEngine's layout): an early chunk and its
mirror image, the same causal work on every rank.

Two attention methods, as Megatron's `cp_comm_type`:
- "all_gather": every rank's K and V gathered in one collective (`all_gather_single_autograd`, whose backward
  reduce-scatters dK and dV back to their owners), the whole K/V resident for the layer: simple, and cheap when
  K/V are small (GQA).
- "ring": K/V chunks travel around the ring by point-to-point, the next chunk's transfer overlapping the compute
  of the one in hand: a rank holds K/V for three chunks at most.
Both attend block by block (`_blocks`: blocks the causal mask hides entirely are skipped, so no rank computes more
than its causal share), merging the partial results by the online-softmax (log-sum-exp) rule, each block on a
fused kernel that returns its log-sum-exp and never holds the block's scores (`block_kernel`). One
torch.autograd.Function (`_ChunkedAttention`) with the standard ring-attention backward serves both: only q, k, v,
the output and the log-sum-exp are saved; the backward recomputes each block's probabilities from the saved
log-sum-exp, and the ring sends each chunk's dK/dV along with it, so it ends on the chunk's owner. Autograd
through the forward loop (the other choice) would have saved every block's probabilities and every received
chunk: the all-gather's memory, without its simplicity.

Packed documents (model.document_separator; `documents=documents_of(opens)`): a query attends to the earlier keys
of its own document only. The blocks are still planned on the host, from each position's least and greatest
document start over the rows (`Documents.bounds`, the forward's one host read, counted by
nanomega/sim/contracts.py): a block in which no row's query meets a key of its own document is skipped, one that
documents do not cut runs as without them, the rest with the documents' mask.

On a mesh (parallel.cp > 1) the model calls none of this by name: nanomega.parallel.parallelize places
the batch permuted by `load_balanced_order`, so that DTensor's contiguous Shard(1) chunks over the cp
dim are exactly the load-balanced shards (under sequence parallel tp splits each rank's shard again,
nested inside it), and this module registers four of the model's hints (nanomega/hints.py):
`sequence_order` (RoPE's tables and a learned position embedding in that order), `document_mask` (`Documents`
from the tokens), `causal_attention` (`attention` on the local q, k, v over the cp group, with the method
`method(...)` sets: Parallel.context enters it from parallel.cp_method), and `linear` (`linear_on_mesh`: DTensor's
own flatten of [B, T, d] cannot be viewed back when the batch does not divide by cp).
The loss (summed over the tokens, divided by the global token count) and every gradient are then partial
sums over cp, reduced with data parallel's (parallel/plan.py).

Why not torch's own `context_parallel`: it fails on CPU in torch 2.13 and patches SDPA globally, a fit for
module-based models (docs/pipeline-context.md). Under torch.compile (on a mesh each block is compiled) the
attention hint runs eagerly (torch.compiler.disable, a graph break per layer): the ring plans its blocks on
the host and talks point to point, and the method is read from a context variable.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from einops import rearrange
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.parallel import loss as tp_loss
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import _disable_current_modes

from nanomega.hints import CONTEXT, register
from nanomega.parallel.plan import as_dtensor

# --- the load-balanced layout ---------------------------------------------------------------------

def shard_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds, int64 [seq_len / cp]: chunks rank and 2*cp-1-rank of
    2*cp equal chunks (module doc). They are also the positions its RoPE angles and causal mask use."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is not a rank of parallel.cp={cp}; need cp >= 1 and 0 <= rank < cp")
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len={seq_len} is not divisible by 2 * parallel.cp = {2 * cp}; "
                         f"use a multiple of {2 * cp}")
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """Every rank's shard_indices, in rank order [seq_len]: a sequence permuted by it and cut into cp
    contiguous chunks (DTensor's Shard) gives rank r exactly its load-balanced shard."""
    return torch.cat([shard_indices(seq_len, cp, r) for r in range(cp)])


# --- attention over the sharded sequence ----------------------------------------------------------

METHODS = ("all_gather", "ring")


def attention(q, k, v, positions, group=None, method: str = "all_gather", scale: float | None = None,
              documents: Documents | None = None):
    """Causal attention of this rank's queries to the keys of the whole sequence (module doc).

    q [B, H, Tl, Dqk], k [B, Hkv, Tl, Dqk], v [B, Hkv, Tl, Dv]: this rank's tokens; positions [cp, Tl]:
    every rank's (global, int64: shard_indices), in rank order; group: the cp process group (None: the
    world); scale: the softmax scale, Dqk ** -0.5 by default; documents: None, or `documents_of` the B rows'
    packed documents, each query then attending to the earlier keys of its own document only. Returns
    [B, H, Tl, Dv] for this rank's queries, in q's dtype. Query head h uses kv head h // (H / Hkv), as SDPA's
    enable_gqa."""
    if method not in METHODS:
        raise ValueError(f"parallel.cp method {method!r} is not one of {list(METHODS)}")
    H, Hkv = q.shape[1], k.shape[1]
    if H % Hkv or k.shape[:-1] != v.shape[:-1] or k.shape[-1] != q.shape[-1] or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention needs q [B, H, T, D], k [B, Hkv, T, D], v [B, Hkv, T, Dv] with Hkv "
                         f"dividing H; got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if positions.ndim != 2 or positions.shape[1] != q.shape[2]:
        raise ValueError(f"positions must be [cp, {q.shape[2]}] (every rank's, one per local token), "
                         f"got {list(positions.shape)}")
    if documents is not None and tuple(documents.start.shape) != (q.shape[0], positions.numel()):
        raise ValueError(f"documents.start must be [B, T] = [{q.shape[0]}, {positions.numel()}] (each row's every "
                         f"position), got {list(documents.start.shape)}")
    group = dist.group.WORLD if group is None else group
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if method == "all_gather":   # the whole K and V on every rank, one message for both
        kv = funcol.all_gather_single_autograd(torch.cat([k, v], -1).contiguous(), 0, group)
        kv = rearrange(kv, "(r b) h t d -> b h (r t) d", r=dist.get_world_size(group))   # keys in rank order
        k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return _ChunkedAttention.apply(q, k, v, positions, group, scale, method == "ring", documents)


# --- packed documents: where each token's document opens ---------------------------------------------

class Documents(NamedTuple):
    """The packed documents of a batch's rows as the blocks read them (`documents_of`; on a mesh the hint
    document_mask's, made once per forward). start [B, T] int, on the rows' device, in position order: where
    each token's document opens (a query at t sees the keys in [start[t], t]). bounds [2, T] int64, on the host:
    the least and the greatest start of each position over the rows, from which every layer plans its blocks
    with no read of the device (`_documents_meet`); under a fake mode a fake tensor, read as the worst case."""
    start: torch.Tensor
    bounds: torch.Tensor


def documents_of(opens: torch.Tensor) -> Documents:
    """opens [B, T] bool (a document opens at the token; the first token opens one in any case) -> Documents.
    The one host read of a forward: bounds' copy to the host (counted by nanomega/sim/contracts.py)."""
    T = opens.shape[1]
    start = torch.where(opens, torch.arange(T, device=opens.device), 0).cummax(1).values   # [B, T]
    return Documents(start, torch.stack([start.amin(0), start.amax(0)]).cpu())


def _host_bounds(documents: Documents | None, T: int):
    """documents' bounds to plan with (None without documents): under a fake mode (the simulator, the contract
    checker) they hold no values, so every start is 0 for `meets` and the query itself for `whole`: every
    causally visible block meets its documents, and each is masked."""
    if documents is None:
        return None
    bounds = documents.bounds
    if is_fake(bounds) or bounds.device.type == "meta":
        return torch.stack([torch.zeros(T, dtype=torch.int64), torch.arange(T)])
    return bounds


# --- one block of (queries, keys): a fused kernel that returns its log-sum-exp --------------------

aten = torch.ops.aten
_KERNEL_DEVICE = contextvars.ContextVar("cp_kernel_device", default=None)


@contextlib.contextmanager
def _setting(variable: contextvars.ContextVar, value):
    """Within it, `variable` holds `value`."""
    token = variable.set(value)
    try:
        yield
    finally:
        variable.reset(token)


def kernels_of(device: str):
    """Within it, attention blocks run the kernels `device` would run, whatever the tensors' device: the
    simulator (nanomega.sim.estimate) charges a GPU run's kernels on fake CPU tensors."""
    return _setting(_KERNEL_DEVICE, device)


def block_kernel(q: torch.Tensor, v: torch.Tensor) -> str:
    """The kernel every block of these inputs runs on (module doc): "cpu_flash" (torch's CPU flash attention,
    every float dtype, float64 included), "flash" (FlashAttention-2: CUDA in half precision, head dims up to
    256), "efficient" (CUDA's memory-efficient kernel: float32, or wider heads), else "plain" (matmul and exp:
    float64 on a GPU, other devices)."""
    device = _KERNEL_DEVICE.get() or q.device.type
    if device == "cpu":
        return "cpu_flash"
    if device == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and _width("flash", q, v) <= 256:
        return "flash"
    if device == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "plain"


def _width(kernel: str, q, v) -> int:
    """The one head dim the fused kernels take for q, k and v alike: the wider of Dqk and Dv (MLA's differ),
    on CUDA rounded up to 8 (the kernels' alignment)."""
    d = max(q.shape[-1], v.shape[-1])
    return d if kernel == "cpu_flash" else -(-d // 8) * 8


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """x's last dim padded with zeros to `width`: zero query/key columns leave the scores as they are, zero value
    columns give zero output columns, which are cut off."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v [B, Hkv, t, D] with each kv head repeated for the query heads it serves (the efficient kernel and the
    plain one have no GQA)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], 1)


def _sum_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """dK or dV [B, H, t, D] of repeated kv heads summed back to [B, Hkv, t, D]."""
    return rearrange(x, "b (h g) t d -> b h g t d", h=kv_heads).sum(2)


def _block_forward(kernel, q, k, v, causal: bool, visible, scale, mask=None):
    """(out [B, H, tq, Dv] in q's dtype or wider, lse [B, H, tq], the kernel run, its rng state for the backward
    or None) of queries q [B, H, tq, Dqk] against k [B, Hkv, tk, Dqk], v [B, Hkv, tk, Dv]: every key visible, the
    causal square (causal: the kernels' is_causal), by the plain kernel the mask `visible` (_blocks), or the
    documents' `mask` [B, 1, tq, tk] (_document_mask) on a kernel that takes one (`_route`); a row that sees no
    key gets out 0 and lse -inf (the CPU kernel gives it lse 0)."""
    kernel, seen = _route(kernel, q, k, causal, visible, mask)
    if kernel == "plain":
        return (*_plain_forward(q, k, v, seen, scale), "plain", None)
    dv, width = v.shape[-1], _width(kernel, q, v)
    q, k, v = (_pad(t, width) for t in (q, k, v))
    bias, rng = _bias(kernel, mask, q), None
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    elif kernel == "flash":
        out, lse, _, _, _, _, *rng, _ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                                scale=scale)
    else:
        k, v = (_repeat_heads(t, q.shape[1]) for t in (k, v))
        out, lse, *rng = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
        lse = lse[..., :q.shape[2]]    # the kernel pads its rows to 32
    out = out[..., :dv]
    if mask is not None:
        seen = mask.any(-1)                                                    # [B, 1, tq]: rows that see a key
        out, lse = out.masked_fill(~seen[..., None], 0.0), lse.masked_fill(~seen, float("-inf"))
    return out, lse, kernel, rng


def _block_backward(kernel, do, q, k, v, out, lse, causal: bool, visible, scale, rngs: dict, mask=None):
    """(dq, dk, dv) of one block, from the whole output and log-sum-exp of q's rows (after every block's merge):
    the block's probabilities are then exp(scores - lse), its part of the whole softmax, as the ring needs (every
    row's whole lse is finite: a token sees itself). rngs: the forward's rng state of each kernel it ran."""
    kernel, seen = _route(kernel, q, k, causal, visible, mask)
    if kernel == "plain":
        return _plain_backward(do, q, k, v, out, lse, seen, scale)
    dqk, dv, width = q.shape[-1], v.shape[-1], _width(kernel, q, v)
    q, k, v, do, out = (_pad(t, width) for t in (q, k, v, do, out))
    lse, bias, rng = lse.contiguous(), _bias(kernel, mask, q), rngs.get(kernel)
    if kernel == "cpu_flash":
        dq, dk, dv_ = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                                attn_mask=bias, scale=scale)
    elif kernel == "flash":
        dq, dk, dv_ = aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, *rng, scale=scale)
    else:
        kv_heads = k.shape[1]
        k, v = (_repeat_heads(t, q.shape[1]) for t in (k, v))
        lse = F.pad(lse, (0, -q.shape[2] % 32))
        dq, dk, dv_, _ = aten._scaled_dot_product_efficient_attention_backward(
            do, q, k, v, bias, out, lse, *rng, 0.0, [True, True, True, False], causal, scale=scale)
        dk, dv_ = _sum_heads(dk, kv_heads), _sum_heads(dv_, kv_heads)
    return dq[..., :dqk], dk[..., :dqk], dv_[..., :dv]


def _route(kernel: str, q, k, causal: bool, visible, mask):
    """(the kernel a block runs on, the plain kernel's visibility mask or None). A document-masked block leaves
    FlashAttention-2 (no mask) for the memory-efficient kernel (an additive bias); the CPU flash kernel and the
    plain one take theirs. A block masked by position (`visible`) runs on the plain kernel; there the is_causal
    square's mask is made when used."""
    if mask is not None and kernel == "flash":
        kernel = "efficient"
    if kernel != "plain" and visible is None:
        return kernel, None
    if mask is None and causal:
        return "plain", torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return "plain", visible if mask is None else mask


def _bias(kernel: str, mask, q):
    """mask [B, 1, tq, tk] bool as the additive bias `kernel` takes, in q's dtype (None without a mask): the CPU
    flash kernel's broadcast over heads; the memory-efficient kernel's expanded to q's heads, its rows padded to
    16 keys and cut back (the alignment SDPA's own call gives it)."""
    if mask is None:
        return None
    tk = mask.shape[-1]
    pad = 0 if kernel == "cpu_flash" else -tk % 16
    bias = torch.zeros(*mask.shape[:-1], tk + pad, dtype=q.dtype, device=q.device)
    bias[..., :tk].masked_fill_(~mask, float("-inf"))
    bias = bias[..., :tk]
    return bias if kernel == "cpu_flash" else bias.expand(-1, q.shape[1], -1, -1)


def _plain_forward(q, k, v, visible, scale):
    """The block by matmul and exp, in fp32 at least (fp64 stays fp64): every score held, [B, H, tq, tk]."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (_repeat_heads(t, q.shape[1]).to(dtype) for t in (q, k, v))
    s = _scores(q, k, scale, visible)
    lse = s.logsumexp(-1)
    return torch.exp(s - _finite(lse)[..., None]) @ v, lse


def _plain_backward(do, q, k, v, out, lse, visible, scale):
    kv_heads = k.shape[1]
    q, k, v, do, out = (_repeat_heads(t, q.shape[1]).to(lse.dtype) for t in (q, k, v, do, out))
    p = torch.exp(_scores(q, k, scale, visible) - lse[..., None])
    ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True)) * scale   # softmax backward, scale folded
    return ds @ k, _sum_heads(ds.transpose(-1, -2) @ q, kv_heads), _sum_heads(p.transpose(-1, -2) @ do, kv_heads)


def _scores(q, k, scale, visible):
    """q [B, H, tq, D] against k [B, H, tk, D] -> [B, H, tq, tk], hidden keys at -inf."""
    s = (q @ k.transpose(-1, -2)) * scale
    return s if visible is None else s.masked_fill(~visible.to(s.device), float("-inf"))


def _finite(lse):
    """-inf (a row that sees no key yet) as 0, so exp(x - lse) gives 0 there instead of nan."""
    return lse.masked_fill(lse.isinf(), 0.0)


# --- the blocks of a chunk of keys, forward and backward ----------------------------------------------------

def _blocks(q_positions: torch.Tensor, k_positions: torch.Tensor, bounds: torch.Tensor | None = None):
    """(query slice, key slice, causal, mask or None, documents) of the blocks the causal mask does not hide
    entirely, planned on the host. The queries and the keys are cut in halves (a rank's two chunks under
    shard_indices); a block whose every key comes after every query is skipped, one whose every key comes at or
    before every query runs unmasked, one whose queries and keys are the same increasing positions runs as the
    kernels' is_causal square (causal True: a rank's own chunk against itself, the only masked block under
    shard_indices), any other with its mask by position (for the plain kernel; the only [tq, tk] tensor made: the
    plan lives through the backward). Under shard_indices every rank computes 2*cp + 1 blocks of (T / 2cp)^2
    pairs, its exact causal share; other positions still give the right result, only maybe more work. With
    documents' bounds (Documents, _host_bounds) a block in which no row's query meets a key of its own document
    is skipped too, and one in which documents hide some causal pair runs with their mask instead (documents:
    the block's (query positions, key positions) to build it from, `_document_mask`; else None)."""
    def halves(n):
        return [s for s in (slice(0, n // 2), slice(n // 2, n)) if s.stop > s.start]
    out = []
    for qs in halves(len(q_positions)):
        for ks in halves(len(k_positions)):
            q, k = q_positions[qs], k_positions[ks]
            if q.max() < k.min():
                continue
            if bounds is not None:
                meets, whole = _documents_meet(q, k, bounds)
                if not meets:
                    continue
                if not whole:
                    out.append((qs, ks, False, None, (q, k)))
                    continue
            if q.min() >= k.max():
                out.append((qs, ks, False, None, None))
            elif torch.equal(q, k) and bool((q[1:] > q[:-1]).all()):
                out.append((qs, ks, True, None, None))
            else:
                out.append((qs, ks, False, q[:, None] >= k[None, :], None))
    return out


def _documents_meet(q: torch.Tensor, k: torch.Tensor, bounds: torch.Tensor) -> tuple[bool, bool]:
    """(meets, whole) of a block of query positions q and key positions k (host int64), bounds [2, T] the least
    and greatest document start of each position over the rows: a query at t sees the keys in [start, t], so some
    row's query sees a key of the block iff some t has a key in [least start, t] (meets), and no causally visible
    pair is hidden by documents in any row iff every key comes at or after the greatest start of every query
    (whole: the block runs as without documents)."""
    keys = k.sort().values
    seen = torch.searchsorted(keys, q, right=True) - torch.searchsorted(keys, bounds[0, q])
    return bool((seen > 0).any()), bool(keys[0] >= bounds[1, q].max())


def _document_mask(start: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, 1, tq, tk] bool on start's device: query position q[i] of row b sees key position k[j] when
    start[b, q[i]] <= k[j] <= q[i] (causal, and no document opens between them). Made when a block runs, forward
    and backward: the plan keeps positions only."""
    q, k = q.to(start.device), k.to(start.device)
    return ((k <= q[:, None]) & (k >= start.index_select(1, q)[..., None]))[:, None]


def _attend_chunk(kernel, q, k_c, v_c, blocks, scale, out, lse, start, rngs: dict):
    """Merges q's attention to one chunk of keys into out [B, H, Tl, Dv] and lse [B, H, Tl] (in place, the
    online-softmax rule: both parts rescaled to the new log-sum-exp); start: Documents.start or None; rngs gets
    the rng state of each kernel run."""
    for qs, ks, causal, visible, documents in blocks:
        mask = None if documents is None else _document_mask(start, *documents)
        block_out, block_lse, ran, rng = _block_forward(kernel, q[..., qs, :], k_c[:, :, ks], v_c[:, :, ks], causal,
                                                        visible, scale, mask)
        if rng:
            rngs.setdefault(ran, rng)
        block_lse = block_lse.to(lse.dtype)
        new = torch.logaddexp(lse[..., qs], block_lse)
        out[..., qs, :] = (out[..., qs, :] * torch.exp(lse[..., qs] - _finite(new))[..., None]
                           + block_out * torch.exp(block_lse - _finite(new))[..., None])
        lse[..., qs] = new


def _grad_chunk(kernel, do, q, k_c, v_c, out, lse, blocks, scale, start, rngs, dq, dk_c, dv_c):
    """Adds the gradients of one chunk's blocks into dq (q's rows) and dk_c, dv_c (the chunk's), in place."""
    for qs, ks, causal, visible, documents in blocks:
        mask = None if documents is None else _document_mask(start, *documents)
        gq, gk, gv = _block_backward(kernel, do[..., qs, :], q[..., qs, :], k_c[:, :, ks], v_c[:, :, ks],
                                     out[..., qs, :], lse[..., qs], causal, visible, scale, rngs, mask)
        dq[..., qs, :] += gq
        dk_c[:, :, ks] += gk
        dv_c[:, :, ks] += gv


# --- the two methods: K/V chunks in hand, block by block, with a hand-written backward -----------------

def _shift(x: torch.Tensor, group, tag: int = 0):
    """Start sending x to the next rank of the ring and receiving the same from the previous one;
    returns wait() -> the received tensor. The caller computes before waiting: the transfer overlaps
    it. Messages of different kinds in flight at once (K/V and dK/dV) carry different tags."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return lambda: x
    x, received = x.contiguous(), torch.empty_like(x)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (me + 1) % n), group, tag),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (me - 1) % n), group, tag)])

    def wait(sent=x):   # holds the sent tensor until the transfer is done
        for w in works:
            w.wait()
        return received
    return wait


def _chunks(k, v, group, ring: bool):
    """Yields the K/V chunks the queries attend to, (k_j, v_j) in the plan's order. The ring's: at step s the chunk
    of rank (r - s) mod cp, the first this rank's own, K and V travelling as one message, the next chunk's transfer
    under way while the caller computes. The all-gather's: rank j's slice of the gathered k, v."""
    cp = dist.get_world_size(group)
    if not ring:
        yield from zip(k.tensor_split(cp, dim=2), v.tensor_split(cp, dim=2))
        return
    kv = torch.cat([k, v.to(k.dtype)], -1)
    for step in range(cp):
        arriving = _shift(kv, group) if step < cp - 1 else None
        yield kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        if arriving is not None:
            kv = arriving()


class _ChunkedAttention(torch.autograd.Function):
    """q [B, H, Tl, D] against every rank's chunk of K/V (`_chunks`), block by block, with its own backward (module
    doc). The ring's k, v are this rank's chunk, the first it attends to, whose diagonal gives every query a finite
    log-sum-exp; the all-gather's are the gathered [B, Hkv, cp * Tl, D], their gradients left to the gather."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, scale, ring: bool, documents=None):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        sources = [(rank - step) % cp for step in range(cp)] if ring else range(cp)
        with _disable_current_modes():   # planned on the host from the layout's positions (even under a fake mode)
            bounds = _host_bounds(documents, positions.numel())          # and the documents' bounds (host already)
            plan = [_blocks(positions[rank].cpu(), positions[s].cpu(), bounds) for s in sources]
        kernel = block_kernel(q, v)
        dtype = torch.promote_types(q.dtype, torch.float32)            # accumulated in fp32 at least
        out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=dtype)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)
        start, rngs = None if documents is None else documents.start, {}
        for (k_j, v_j), blocks in zip(_chunks(k, v, group, ring), plan):
            _attend_chunk(kernel, q, k_j, v_j, blocks, scale, out, lse, start, rngs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, start)
        ctx.group, ctx.scale, ctx.plan, ctx.kernel, ctx.ring, ctx.rngs = group, scale, plan, kernel, ring, rngs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, start = ctx.saved_tensors
        do, widths = grad_out.to(q.dtype).contiguous(), [k.shape[-1], v.shape[-1]]
        dq, incoming = torch.zeros_like(q, dtype=lse.dtype), None
        # dK|dV: the all-gather's of every chunk, in one buffer; the ring's of the chunk in hand, sent on with it
        whole = None if ctx.ring else k.new_zeros(*k.shape[:-1], sum(widths), dtype=lse.dtype)
        for j, (k_j, v_j) in enumerate(_chunks(k, v, ctx.group, ctx.ring)):
            dkv = k_j.new_zeros(*k_j.shape[:-1], sum(widths), dtype=lse.dtype) if ctx.ring else \
                whole.tensor_split(len(ctx.plan), dim=2)[j]
            _grad_chunk(ctx.kernel, do, q, k_j, v_j, out, lse, ctx.plan[j], ctx.scale, start, ctx.rngs, dq,
                        *dkv.split(widths, dim=-1))
            if ctx.ring:
                if incoming is not None:
                    dkv += incoming()                                          # what the ranks before added
                incoming = _shift(dkv, ctx.group, tag=1)                       # follows its chunk round the ring
        dk, dv = (incoming() if ctx.ring else whole).split(widths, dim=-1)    # the ring's after cp shifts: our own
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


# --- on a mesh: the model's hints (nanomega/hints.py) -----------------------------------------------

_METHOD = contextvars.ContextVar("cp_method", default="all_gather")


def method(name: str):
    """Within it, attention on a context-parallel mesh uses `name` (parallel.cp_method, checked by
    mesh.validate_context; module doc)."""
    return _setting(_METHOD, name)


@register("sequence_order")
def sequence_order_on_mesh(table, tokens: DTensor):
    """Rows [T, ...] of a per-position table (or a tuple of tables) in the load-balanced order the batch
    was placed in. A plain table (RoPE's) comes back as this rank's rows, placed Shard(0) on cp: it meets
    q and k, split on the sequence over cp, without a redistribution (inside a compiled block, torch 2.13
    takes the wrong rows when it slices a replicated table to meet them: measured, rank 1 of 2). A
    parameter (a learned position embedding) stays replicated: DTensor hands each rank its rows in the
    (eager) embedding."""
    mesh = tokens.device_mesh
    i = mesh.mesh_dim_names.index(CONTEXT)
    cp = mesh.size(i)
    order = load_balanced_order(tokens.shape[1], cp)
    mine = shard_indices(tokens.shape[1], cp, mesh.get_local_rank(i))
    placements = [Shard(0) if d == i else Replicate() for d in range(mesh.ndim)]

    def permute(t):
        if t.shape[0] != tokens.shape[1]:
            raise ValueError(f"a per-position table needs one row per position ({tokens.shape[1]}), "
                             f"got {list(t.shape)}")
        if isinstance(t, DTensor):
            index = DTensor.from_local(order.to(t.device), t.device_mesh, [Replicate()] * t.device_mesh.ndim,
                                       run_check=False)
            return t.index_select(0, index)
        local = t.index_select(0, mine.to(t.device)).contiguous()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    return tuple(permute(t) for t in table) if isinstance(table, tuple) else permute(table)


@register("causal_attention")
@torch.compiler.disable   # eager inside a compiled block: the graph breaks around it (module doc)
def attention_on_mesh(q: DTensor, k: DTensor, v: DTensor, scale: float | None = None,
                      documents: Documents | None = None) -> DTensor:
    """Causal attention of q, k, v [B, H, T, D] whose sequence is split over cp (in the load-balanced
    order) and whole on every other mesh dim: `attention` on the local tensors over the cp group, with
    the method `method` set; the result laid out as q. The batch and the heads may be split (data and
    tensor parallel): attention is independent per sequence and per head. documents: document_mask_on_mesh's
    (this rank's rows), or None."""
    mesh = q.device_mesh
    i = mesh.mesh_dim_names.index(CONTEXT)
    cp = mesh.size(i)
    for name, x in (("q", q), ("k", k), ("v", v)):
        splits = [d for d, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == 2]
        if splits != [i] or type(x.placements[i]) is not Shard or any(p.is_partial() for p in x.placements):
            raise ValueError(f"context-parallel attention needs {name} [B, H, T, D] split on the sequence over "
                             f"{CONTEXT!r} only (mesh dims {mesh.mesh_dim_names}), got {x.placements}")
    with _disable_current_modes():   # the layout's positions, not data: host integers even under a fake mode
        positions = load_balanced_order(q.shape[2], cp).view(cp, -1)   # (the simulator, nanomega.sim.estimate)
    y = attention(q.to_local(), k.to_local(), v.to_local(), positions, mesh.get_group(i), _METHOD.get(), scale,
                  documents)
    # contiguous, as the global stride says (torch.compile traces the layout a DTensor declares)
    return as_dtensor(y.contiguous(), mesh, q.placements, (*q.shape[:-1], v.shape[-1]))


@register("document_mask")
@torch.compiler.disable   # eager: one host read, and a Python tuple handed to the compiled blocks
def document_mask_on_mesh(tokens: DTensor, separator: int, dtype: torch.dtype | None = None) -> Documents:
    """The packed documents of this rank's rows (Documents, for attention_on_mesh), from tokens [B, T] placed
    in the load-balanced order, the sequence split over cp (and over tp under sequence parallel): whether each
    token opens a document, gathered over the sequence's splits (one byte a token), put back in position
    order, and `documents_of` them: the forward's one host read. dtype (attention's) is not needed: a masked
    block makes its own bias in its kernel's dtype, for as long as the kernel runs."""
    mesh = tokens.device_mesh
    cp = mesh.size(mesh.mesh_dim_names.index(CONTEXT))
    whole = [Replicate() if isinstance(p, Shard) and p.dim == 1 else p for p in tokens.placements]
    opens = (tokens == separator).to(torch.uint8).redistribute(mesh, whole).to_local()   # load-balanced order
    order = load_balanced_order(tokens.shape[1], cp).to(opens.device)
    return documents_of(torch.empty_like(opens).index_copy_(1, order, opens).bool())


@register("linear")
def linear_on_mesh(x: DTensor, w: DTensor, bias: DTensor | None = None) -> DTensor:
    """F.linear on x [B, T, d] whose batch and sequence are both split (data parallel and cp).

    DTensor (torch 2.13) runs it as a view to rows [B * T, d] (placed Shard(0) on the data-parallel dims, a
    _StridedShard on cp), a matmul, and a view back to [B, T, n], which it refuses unless B divides by cp
    ("Sharding propagation failed for aten._unsafe_view"). Here the rows are flattened on the local tensor and seen
    as contiguous shards of [B * T, d] (the global rows permuted, which a row-wise map does not see), multiplied by
    DTensor (tensor parallel's weight placements and partial sums as usual), and the local result viewed back to
    [b, t, n] under x's batch and sequence placements. No data moves."""
    splits = {p.dim for p in x.placements if isinstance(p, Shard)}
    if (x.ndim != 3 or not {0, 1} <= splits or any(p.is_partial() or isinstance(p, _StridedShard)
                                                   for p in x.placements)):
        return F.linear(x, w, bias)
    B, T, d = x.shape
    as_rows = [Shard(0) if isinstance(p, Shard) and p.dim < 2 else Shard(1) if isinstance(p, Shard) else p
               for p in x.placements]
    local = x.to_local()
    rows = as_dtensor(local.reshape(-1, local.shape[-1]), x.device_mesh, as_rows, (B * T, d))
    y = F.linear(rows, w, bias)
    back = [x.placements[i] if isinstance(p, Shard) and p.dim == 0 else Shard(2) if isinstance(p, Shard) else p
            for i, p in enumerate(y.placements)]
    out = y.to_local()
    return as_dtensor(out.view(*local.shape[:2], out.shape[-1]), x.device_mesh, back, (B, T, y.shape[-1]))


# --- two torch 2.13 gaps that a split sequence meets -------------------------------------------------

_strided_size_and_offset = _StridedShard.local_shard_size_and_offset


def _traceable_strided_shard_size(self, curr_local_size, *args, **kwargs):
    """_StridedShard.local_shard_size_and_offset, also under torch.compile and FakeTensorMode.

    Under cp a matmul's rows [B * T] are split over the data-parallel dims (on B) and cp (on T, a
    _StridedShard). DTensor's sharding propagation then asks that placement for its local size and
    offsets, which torch computes with torch.arange(...).tolist(): under a fake or tracing mode (a
    compiled block, nanomega.sim.estimate) the tensor is fake and .tolist() fails ("aten._local_scalar_dense
    ... Sharding propagation failed for aten.mm.default"). The sizes are plain integers, so the same
    computation runs outside those modes; symbolic sizes are left to torch."""
    with _disable_current_modes() if isinstance(curr_local_size, int) else contextlib.nullcontext():
        return _strided_size_and_offset(self, curr_local_size, *args, **kwargs)


_StridedShard.local_shard_size_and_offset = _traceable_strided_shard_size   # on import: once per process


def _as_row_shards(x):
    """x with its strided splits of a dim (_StridedShard: what flattening logits [B, T, V] split on T
    gives) seen as contiguous ones, and x's own spec (None if it had none): the same local rows, their
    global order permuted, which a row-wise loss does not see. No data moves."""
    if not isinstance(x, DTensor) or not any(isinstance(p, _StridedShard) for p in x.placements):
        return x, None
    placements = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in x.placements)
    spec = DTensorSpec(x.device_mesh, placements, tensor_meta=x._spec.tensor_meta)
    return DTensor(x._local_tensor, spec, requires_grad=x.requires_grad), x._spec


def _on_row_shards(handler):
    """torch's loss_parallel handler for one op, run on row shards (_as_row_shards); a result laid out
    like the first strided input (log-softmax, the logits' gradient) gets that input's placements back."""
    def run(op, args, kwargs):
        converted = [_as_row_shards(a) for a in args]
        out = handler(op, tuple(a for a, _ in converted), kwargs)
        spec = next((s for _, s in converted if s is not None), None)
        if spec is not None and isinstance(out, DTensor) and out.shape == spec.shape:
            restored = DTensorSpec(spec.mesh, spec.placements, tensor_meta=out._spec.tensor_meta)
            out = DTensor(out._local_tensor, restored, requires_grad=out.requires_grad)
        return out
    return run


@contextlib.contextmanager
def loss_parallel():
    """torch.distributed.tensor.parallel.loss_parallel (cross-entropy on vocab-sharded logits, the vocab
    all-reduced rather than gathered), also for logits whose sequence is split over cp: their flattened
    rows are strided shards, which torch's handlers refuse ("expects non-TP mesh dims to be Shard or
    Replicate"); each row's loss needs its own row only, so they run on the rows seen as contiguous
    shards (other logits as they are). Restores the handlers on exit, exceptions included (torch's
    context manager does not)."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    handlers.update({op: _on_row_shards(h) for op, h in tp_loss.customized_loss_ops.items()})
    try:
        yield
    finally:
        handlers.clear()
        handlers.update(before)
