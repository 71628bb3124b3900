"""Attention in the memory simulator as a GPU runs it (nanomega/sim/estimate.py: cuda_sdpa_kernel, cuda_attention).

A simulated run on a GPU sends F.scaled_dot_product_attention to the fused kernel torch's CUDA dispatch would pick
(its rules in sdp_utils.cpp), which keeps the output and an fp32 logsumexp per query and head for the backward, and
whose backward holds an fp32 dq accumulator while it runs (memory_tracker.attention_workspace). The CPU's math path,
which the CPU takes where the value heads are narrower than the query/key heads (DeepSeek's MLA), holds the
[B, H, T, T] scores. Each is checked against a hand count; the CPU simulation (--train.device=cpu) stays the CPU's
own and equals the measured CPU step.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from nanomega.config import parse_args
from nanomega.sim import estimate
from nanomega.sim.memory_tracker import MemoryTracker

BF16, FP32 = torch.bfloat16, torch.float32


def qkv(b, hq, hkv, tq, tk, dqk, dv, dtype=BF16, device="meta", grad=True):
    return (torch.empty(b, hq, tq, dqk, dtype=dtype, device=device, requires_grad=grad),
            torch.empty(b, hkv, tk, dqk, dtype=dtype, device=device, requires_grad=grad),
            torch.empty(b, hkv, tk, dv, dtype=dtype, device=device, requires_grad=grad))


# (shapes b, hq, hkv, tq, tk, dqk, dv; dtype; options) -> the kernel, by torch's rules for sm 9.0 unless given
KERNELS = {
    "llama: equal head dims, causal": ((1, 8, 8, 64, 64, 128, 128), BF16, {"is_causal": True}, "flash"),
    "grouped-query heads": ((1, 8, 2, 64, 64, 128, 128), BF16, {"is_causal": True, "enable_gqa": True}, "flash"),
    "fewer key heads without enable_gqa": ((1, 8, 2, 64, 64, 128, 128), BF16, {"is_causal": True}, "math"),
    "MLA: qk 192, v 128": ((1, 8, 8, 64, 64, 192, 128), BF16, {"is_causal": True}, "efficient"),
    "MLA where cuDNN is preferred": ((1, 8, 8, 64, 64, 192, 128), BF16, {"is_causal": True, "cudnn_first": True},
                                     "cudnn"),
    "float32: no flash": ((1, 4, 4, 64, 64, 64, 64), FP32, {"is_causal": True}, "efficient"),
    "a mask (context parallel's all-gather)": ((1, 4, 4, 32, 64, 64, 64), BF16, {"attn_mask": True}, "efficient"),
    "causal with fewer queries than keys": ((1, 4, 4, 32, 64, 64, 64), BF16, {"is_causal": True}, "efficient"),
    "head dim 12: flash pads it to 16": ((1, 4, 4, 64, 64, 12, 12), BF16, {"is_causal": True}, "flash"),
    "head dim over flash's 256": ((1, 4, 4, 64, 64, 320, 320), BF16, {"is_causal": True}, "efficient"),
    "float32 head dim off the 4-element alignment": ((1, 4, 4, 64, 64, 6, 6), FP32, {"is_causal": True}, "math"),
    "sm 8.6, training at head dim 208": ((1, 4, 4, 64, 64, 208, 208), BF16, {"is_causal": True, "sm": (8, 6)},
                                         "efficient"),
}


@pytest.mark.parametrize("case", KERNELS)
def test_the_kernel_is_the_one_torchs_cuda_dispatch_picks(case):
    shape, dtype, options, kernel = KERNELS[case]
    q, k, v = qkv(*shape, dtype=dtype)
    options = dict(options)
    if options.pop("attn_mask", False):
        options["attn_mask"] = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device="meta")
    assert estimate.cuda_sdpa_kernel(q, k, v, **options) == kernel


def test_inference_at_head_dim_208_on_sm86_takes_flash():
    """Flash's sm 8.6 limit is its backward's: without gradients the same shapes take it."""
    q, k, v = qkv(1, 4, 4, 64, 64, 208, 208, grad=False)
    assert estimate.cuda_sdpa_kernel(q, k, v, is_causal=True, sm=(8, 6)) == "flash"


def attention_step(route, b, h, t, dqk, dv, dtype=BF16):
    """One causal SDPA forward and backward on fake CPU tensors under a MemoryTracker; q, k, v and the output's
    gradient are made before tracking, so what is counted is what attention makes. -> (bytes the forward left,
    the tracker's result, the ops run)."""
    ops = []

    class Ops(MemoryTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__.split(".")[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

    with FakeTensorMode():
        q, k, v = qkv(b, h, h, t, t, dqk, dv, dtype=dtype, device="cpu")
        g = torch.empty(b, h, t, dv, dtype=dtype)
        tracker = Ops()
        with tracker, route():
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            forward = tracker.total
            torch.autograd.grad(y, (q, k, v), g)
    return forward, tracker.result(), ops


RNG = 32    # the kernels' RNG seed and offset for dropout: two scalars (uint64 or int64), a few bytes


def test_flash_holds_its_output_and_logsumexp_and_its_backward_a_workspace():
    """Equal head dims, bf16: flash. The forward leaves the output and an fp32 logsumexp [B, H, T] (what its
    backward reads); the peak is the backward's: those, dq, dk, dv, and the fp32 dq accumulator and row sums."""
    b, h, t, d = 2, 4, 100, 32
    forward, result, ops = attention_step(estimate.cuda_sdpa, b, h, t, d, d)
    assert "_scaled_dot_product_flash_attention" in ops and "_safe_softmax" not in ops
    out, lse = b * h * t * d * 2, b * h * t * 4
    assert 0 <= forward - (out + lse) <= RNG
    grads, workspace = 3 * b * h * t * d * 2, 4 * b * h * t * (d + 1)
    assert 0 <= result["peak_bytes"] - (out + lse + grads + workspace) <= RNG


def test_flash_pads_a_head_dim_to_a_multiple_of_8_and_keeps_the_padded_copies():
    """Head dim 12: torch pads q, k and v to 16 for flash (copies, saved for the backward) and cuts the output
    back (a view of the padded one)."""
    b, h, t = 2, 4, 100
    forward, _, ops = attention_step(estimate.cuda_sdpa, b, h, t, 12, 12)
    assert "_scaled_dot_product_flash_attention" in ops
    padded = b * h * t * 16 * 2
    assert 0 <= forward - (3 * padded + padded + b * h * t * 4) <= RNG


def test_mla_takes_the_memory_efficient_kernel_whose_logsumexp_is_padded_to_32_queries():
    """qk 24 against v 16 (MLA's shape): the memory-efficient kernel, which keeps the output and an fp32 logsumexp
    over ceil(T / 32) x 32 queries, not the scores."""
    b, h, t, dqk, dv = 2, 4, 100, 24, 16
    forward, _, ops = attention_step(estimate.cuda_sdpa, b, h, t, dqk, dv)
    assert "_scaled_dot_product_efficient_attention" in ops
    out, lse = b * h * t * dv * 2, b * h * 32 * math.ceil(t / 32) * 4
    assert 0 <= forward - (out + lse) <= RNG


def test_the_gpu_kernel_saves_three_fp32_score_matrices_against_the_cpu_math_path():
    """MLA's head dims (qk 24, v 16 here): the CPU takes the math path. At its backward's peak it holds three
    fp32 [B, H, T, T] matrices, the saved probabilities P, dP = dO V^T and dS = softmax_backward(dP, P); the
    fused kernel none. The peaks differ by those three, up to the O(T) tensors each path makes (q, k, v in fp32,
    the output, gradients, workspace: fewer than 16 of B x H x T x 24 fp32 values), which this sequence length
    keeps far below one score matrix."""
    b, h, t, dqk, dv = 2, 4, 1024, 24, 16
    _, cpu, cpu_ops = attention_step(contextlib.nullcontext, b, h, t, dqk, dv)
    _, gpu, gpu_ops = attention_step(estimate.cuda_sdpa, b, h, t, dqk, dv)
    assert "_safe_softmax" in cpu_ops and "_safe_softmax" not in gpu_ops
    scores = b * h * t * t * 4
    o_t = 16 * b * h * t * dqk * 4
    assert o_t < scores / 2
    assert abs(cpu["peak_bytes"] - gpu["peak_bytes"] - 3 * scores) <= o_t


TINY_MLA = ["--config=tiny_deepseek_v3", "--model.n_layers=2", "--train.batch_size=2", "--train.seq_len=256",
            "--train.grad_accum=1", "--train.compile=false", "--train.param_dtype=bfloat16"]


def test_a_cpu_simulation_runs_the_cpus_kernels_and_matches_the_measured_cpu_step():
    """--train.device=cpu: the simulated step is the CPU's and its peak (and split) the one the tracker measures
    on real tensors for the same step. tiny_deepseek_v3's MLA (qk 48, v 32) takes the math path there, so each
    of its 2 layers keeps its fp32 probabilities [2, 6, 256, 256] for the backward, both live at the peak; the
    simulated GPU run (train.device "auto") keeps none of them, and its peak is lower by at least those."""
    cpu_cfg = parse_args(TINY_MLA + ["--train.device=cpu"])
    gpu_cfg = parse_args(TINY_MLA)
    assert (estimate.simulated_device(cpu_cfg), estimate.simulated_device(gpu_cfg)) == ("cpu", "cuda")
    measured = estimate.track_step(cpu_cfg, MemoryTracker(), torch.device("cpu"))
    cpu, gpu = estimate.simulate_rank(cpu_cfg), estimate.simulate_rank(gpu_cfg)
    assert (cpu["peak_bytes"], cpu["by_category"]) == (measured["peak_bytes"], measured["by_category"])
    scores = 2 * 6 * 256 * 256 * 4
    largest = cpu["phases"][cpu["peak_phase"]]["largest"]
    assert largest[:2] == [("activations", "_safe_softmax.default", scores)] * 2
    assert all(op != "_safe_softmax.default" for _, op, _ in gpu["phases"][gpu["peak_phase"]]["largest"])
    assert gpu["peak_bytes"] <= cpu["peak_bytes"] - 2 * scores
