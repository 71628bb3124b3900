"""Activation recomputation (activation checkpointing): trade a block's saved activations for a
second forward of that block in its backward.

    train.activation_checkpointing = "none" | "full" | "selective",  train.ac_every = k

"full" keeps only a block's inputs and recomputes all of its forward in the backward (Megatron's
`--recompute-granularity full --recompute-method uniform`): the activations held between forward and
backward fall from every block's intermediates to one residual stream per block, for about one more
forward pass of compute. "selective" is torchtitan's op-level policy: the outputs of the ops in SAVE
(the matmuls and attention, whose recomputation is the costly part) are kept, and every other op
(norms, activations, RoPE, casts, residual adds, the gathers of sequence parallel and FSDP) is
recomputed. Megatron's "selective" recomputes the attention core (softmax and its dropout) instead;
with fused attention kernels (SDPA flash / memory-efficient) that core is never materialised, so it
would save nothing here. ac_every = k recomputes blocks 0, k, 2k, ... (torchtitan's ac_freq).

Only blocks are recomputed: the embedding's output is the first block's input (held anyway) and the
head's logits feed the loss directly. Both policies are torch.utils.checkpoint (non-reentrant), so they
compose with torch.compile (traced as a higher-order op) and with DTensor. A unit that gathers its
parameters (FSDP) gathers them inside the recomputed function, so the backward gathers them again and
nothing gathered is kept between forward and backward (nanomega/train/step.py composes the two).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

aten, c10d = torch.ops.aten, torch.ops._c10d_functional

# "selective": the ops whose outputs are saved; everything else is recomputed. The matmuls (linear
# layers lower to mm / addmm; bmm and grouped mm for experts; float8 linears to _scaled_mm on GPUs, to mm
# or bmm where emulated, models/fp8.py), attention, and the collectives that a
# recomputation would otherwise repeat on the tensor-parallel activation (all-gathers are recomputed:
# their inputs are kept, and FSDP must gather again anyway).
SAVE = frozenset([
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten._grouped_mm.default,
    aten._scaled_mm.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    c10d.reduce_scatter_tensor.default,
    c10d.all_reduce.default,
    c10d.all_to_all_single.default,
])


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def recomputes(name: str, mode: str, every: int) -> bool:
    """Whether the unit `name` ("layers.{i}" for block i; "" for the embedding and the head) is recomputed."""
    return mode != "none" and name.startswith("layers.") and int(name.split(".")[1]) % every == 0


def recomputed(fn, mode: str):
    """fn, with its activations recomputed in the backward under `mode` ("full" or "selective")."""
    context = (functools.partial(create_selective_checkpoint_contexts, _policy) if mode == "selective"
               else noop_context_fn)
    return functools.partial(checkpoint, fn, use_reentrant=False, context_fn=context)
