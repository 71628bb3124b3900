"""The head's matmul and the cross-entropy fused, a chunk of tokens at a time (O(chunk x vocab) memory).

    total = linear_cross_entropy(x [..., d], w [V, d], targets [...], vocab_size, chunk)   # sum over tokens, fp32

Computed whole, the loss holds the logits in the compute dtype, their fp32 copy, the log-softmax and its
gradient: four [N, V] tensors, 47 GiB of a step at 32,768 tokens and Llama 3's 128k vocabulary. Here the
logits of `chunk` tokens exist at a time (Liger's and Cut Cross-Entropy's fused linear cross-entropy,
Megatron's fused vocab-parallel cross-entropy): the forward keeps one number per token, the log of the
softmax's denominator (logsumexp), and the backward computes each chunk's logits again, their softmax
from that logsumexp, and the chunk's share of both gradients (x's rows, and w's, summed over chunks in
w's dtype, as Liger does: no fp32 copy of the head's weight). One more head matmul per chunk in the backward
buys the memory; the maths is today's,
    loss_i = logsumexp_v(logits_iv) - logits_i,target_i,   d loss_i / d logits_iv = softmax_iv - [v = target_i],
with the matmuls in the compute dtype (autocast's, as F.linear would run them) and the softmax in fp32.
Vocabulary padding columns (ids >= vocab_size) get -inf: no probability, no gradient.

Vocab-parallel: `w` may be one rank's rows of the vocabulary (ids vocab_start.. of the padded vocabulary).
Each of the three per-token numbers that need the whole vocabulary (the max, the sum of exponentials, the
target's logit) is then reduced over the ranks holding the other rows by `reduce(t, op)`, op "max" or
"sum" (Megatron's vocab-parallel cross-entropy: three all-reduces of [chunk] numbers, never the logits).
The backward needs none: the logsumexp is kept whole, and the gradient of x, a sum over the vocabulary, is
left a partial sum for the caller's layout to reduce. On plain tensors `reduce` is the identity; on a mesh
nanomega.parallel.vocab_loss supplies it (hints.vocab_parallel).
"""
from __future__ import annotations

import contextlib

import torch


def no_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    """The whole vocabulary is here: nothing to reduce."""
    return t


def autocast_dtype(device: str) -> torch.dtype | None:
    """Autocast's dtype where it is on for `device`, else None (also where the device has no autocast: meta)."""
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def autocast_off(device: str):
    """Autocast off inside; a no-op where the device has no autocast (meta: the contract checker's tensors)."""
    has_autocast = torch.amp.is_autocast_available(device)
    return torch.autocast(device, enabled=False) if has_autocast else contextlib.nullcontext()


def _logits(x: torch.Tensor, w: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """x [n, d] @ w [Vl, d].T in their dtype, then fp32 [n, Vl], padding columns (ids >= vocab_size) -inf."""
    logits = (x @ w.t()).float()
    if vocab_start + w.shape[0] > vocab_size:
        ids = torch.arange(vocab_start, vocab_start + w.shape[0], device=x.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    return logits


def _target_columns(targets: torch.Tensor, vocab_start: int, rows: int):
    """(each target's column in this rank's rows of the vocabulary, clamped; whether it is this rank's)."""
    local = targets - vocab_start
    here = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1).unsqueeze(1), here


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i loss_i over the tokens of x (module doc); x and w in the compute dtype, autocast off inside."""

    @staticmethod
    def forward(ctx, x, w, targets, vocab_start: int, vocab_size: int, chunk: int, reduce):
        lse = torch.empty(x.shape[0], device=x.device, dtype=torch.float32)
        total = torch.zeros((), device=x.device, dtype=torch.float32)
        with autocast_off(x.device.type):
            for start in range(0, x.shape[0], chunk):
                rows = slice(start, start + chunk)
                logits = _logits(x[rows], w, vocab_start, vocab_size)                   # [n, Vl] fp32
                peak = reduce(logits.amax(dim=1), "max")                                 # [n]
                sum_exp = reduce((logits - peak.unsqueeze(1)).exp_().sum(dim=1), "sum")
                column, here = _target_columns(targets[rows], vocab_start, w.shape[0])
                picked = reduce(torch.where(here, logits.gather(1, column).squeeze(1), 0.0), "sum")
                lse[rows] = peak + sum_exp.log()
                total = total + (lse[rows] - picked).sum()
                del logits
        ctx.save_for_backward(x, w, targets, lse)
        ctx.vocab_start, ctx.vocab_size, ctx.chunk = vocab_start, vocab_size, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        x, w, targets, lse = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(w)     # summed over chunks in w's dtype, like the gradient a whole matmul gives
        with autocast_off(x.device.type):
            for start in range(0, x.shape[0], ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                # softmax - one-hot of the target, times the upstream gradient: the logits' gradient
                grad = _logits(x[rows], w, ctx.vocab_start, ctx.vocab_size).sub_(lse[rows].unsqueeze(1)).exp_()
                column, here = _target_columns(targets[rows], ctx.vocab_start, w.shape[0])
                grad.scatter_add_(1, column, -here.to(grad.dtype).unsqueeze(1))
                grad = grad.mul_(grad_total).to(x.dtype)                                # [n, Vl]
                torch.mm(grad, w, out=grad_x[rows])
                grad_w.addmm_(grad.t(), x[rows])
                del grad
        return grad_x, grad_w, None, None, None, None, None


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab_size: int, chunk: int,
                         vocab_start: int = 0, reduce=no_reduce) -> torch.Tensor:
    """sum over tokens of cross-entropy(x [..., d] @ w [Vl, d].T, targets [...]) in fp32, `chunk` tokens of
    logits at a time (module doc); w holds the vocabulary's rows vocab_start.., the others reduced by `reduce`."""
    # the dtype F.linear(x, w) would compute in: autocast's where it is on, else the operands' own
    dtype = autocast_dtype(x.device.type) or torch.promote_types(x.dtype, w.dtype)
    return _ChunkedLinearCrossEntropy.apply(x.to(dtype).flatten(0, -2), w.to(dtype), targets.flatten(), vocab_start,
                                            vocab_size, chunk, reduce)
