"""FP8 matmuls as pure functions: y = x @ w.T with both operands in float8, forward and backward.

    y = fp8.linear(x, w, "rowwise")       # x [..., K], w [N, K] -> y [..., N] in the compute dtype

Every matmul of a linear layer takes two float8 operands and one float32 scale per group of their
elements, and accumulates in float32 (torch._scaled_mm):

    forward    y  = x  @ w.T     contracts K    x: e4m3, w: e4m3
    backward   dx = dy @ w       contracts N    dy: e5m2 (a gradient's range is wider), w: e4m3
               dw = dy.T @ x     contracts M    dy: e5m2, x: e4m3

Each operand is scaled along the dimension its matmul contracts, as the recipe says:
    tensorwise   one scale per tensor, from its amax this step (current scaling)
    rowwise      one scale per row of the left operand and per column of the right one: per token and
                 per output feature in the forward, re-scaled along N and M for the backward (torchao's
                 rowwise recipe)
    blockwise    DeepSeek-V3's: 1 x 128 tiles along the contraction for activations and gradients,
                 128 x 128 blocks for weights (one block scale serves both of a weight's matmuls);
                 every operand in e4m3, since tiles this small leave e5m2's range unneeded (DeepSeek
                 keeps e4m3 for gradients too, for its precision). _scaled_mm has no block scaling on
                 the CPU: each 128-long slice of the contraction is one row-scaled product, summed in
                 float32, which is DeepSeek's own promotion to float32 every 128 products (on the CPU one
                 batched float32 matmul of the float8 values, elsewhere a _scaled_mm per slice).
    delayed      tensorwise, but each scale from the largest amax of the last H steps (x 2^margin) instead
                 of this step's (TransformerEngine's delayed scaling): the amax is no longer on the critical
                 path of the cast. The history [3, H] (x, w, dy) is a parameter leaf next to the weight
                 (models/transformer.py), so checkpoints carry it; its "gradient" is the history one step
                 on, which the train step writes back (step.py). An empty history (the first step) scales
                 by this step's amax.

An operand is multiplied by fp8_max / amax (e4m3: 448, e5m2: 57344), so its largest element maps to the
largest float8 number, clamped, and rounded to nearest by the cast; the matmul gets the reciprocal as
the operand's scale. Scales are constants to autograd, as in every fp8 recipe.

How the matmuls run is the device's, decided in one place (`matmul_kernel`):
    CUDA         torch._scaled_mm, every dim zero-padded to a multiple of 16, as it requires (an expert's
                 token count is arbitrary, and the weight gradient contracts over it; the zeros add exact
                 zeros to the sums). Row-wise scales give a float32 result only through cuBLAS on sm90 with
                 CUDA >= 12.9; elsewhere (sm89, sm100: CUTLASS, bf16 only) a float32 product runs with unit
                 scales and the scales are applied after it in float32, as those kernels' epilogue does.
    CPU          emulated, always: the float8 operands dequantized to float32 (exact) times their scales, one
                 float32 matmul, the same sums as _scaled_mm up to accumulation order (its row-wise product
                 bit for bit). The CPU's tensorwise _scaled_mm is a reference kernel, 70-350 times slower than
                 the emulation at n = 256-1024 (docs/fp8.md's rates, `python tests/test_fp8_devices.py`). The
                 CPU has no bf16 matmul into float32 (aten mm.dtype), which would give the same exact products
                 at AMX speed; a CPU with native float8 matmuls would change this choice.
An operand with no rows (an expert without tokens) has amax 0 and an empty product: zeros, a zero weight
gradient.

`sync(amax, operand, axis)` lets a caller reduce an amax (max) over the ranks that hold other pieces of
the same tensor, so every rank uses one scale per logical tensor (parallel/fp8.py, which also says when delayed
scaling's amaxes are reduced once per step instead): operand is "x", "w" or "g", axis the dimension the amax was
taken along (0 or 1 of the 2-D operand), or None for a whole tensor. Serially it is the identity. Blockwise never
syncs: its tiles never straddle ranks (the layout is refused otherwise).
"""
from __future__ import annotations

import fnmatch
from typing import NamedTuple

import torch
import torch.nn.functional as F

from nanomega.config import FP8_RECIPES as RECIPES
from nanomega.models.loss import autocast_dtype, autocast_off

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 128
TINY = 1e-12     # an all-zero tensor gets scale TINY / fp8_max, not 0 (no division by zero)


def no_sync(amax, operand, axis):
    return amax


def amax_of(a: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The max of `a` (a tensor's |t| in float32) along `dim`, kept, or over all of it; 0 where there is nothing
    to take it over (an expert that received no tokens): the empty operand then scales as an all-zero one
    does, and every rank still joins the amax sync."""
    if a.numel() == 0:
        return a.new_zeros(() if dim is None else a.shape[:dim] + (1,) + a.shape[dim + 1:])
    return a.amax() if dim is None else a.amax(dim=dim, keepdim=True)


def quantize(t: torch.Tensor, dtype: torch.dtype, recipe: str, axis: int, weight: bool = False,
             sync=no_sync, operand: str = "x", amax: torch.Tensor | None = None):
    """A 2-D tensor scaled for a matmul contracting its `axis` -> (float8 tensor, float32 scale) with
    t ≈ q * scale; scale [1, 1] (tensorwise, delayed), keepdim along `axis` (rowwise), or one per
    BLOCK-long tile along `axis` ([M, K/128] for axis 1; a weight's 128 x 128 blocks expanded to that
    shape). `amax`: delayed scaling's, from the history (elements above it saturate)."""
    fmax = torch.finfo(dtype).max
    a = None if amax is not None else t.detach().float().abs()    # delayed scaling brings its amax
    if amax is not None:
        amax = amax.reshape(1, 1)
    elif recipe == "tensorwise":
        amax = sync(amax_of(a), operand, None).reshape(1, 1)
    elif recipe == "rowwise":
        amax = sync(amax_of(a, axis), operand, axis)
    elif recipe == "blockwise":
        amax = tile_amax(a, axis, weight)
    else:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {RECIPES[1:]}")
    # in float64, rounded once to float32: torchao's convention (and one answer compiled or eager)
    to_fp8 = (fmax / amax.double().clamp(min=TINY)).float()
    expanded = to_fp8.repeat_interleave(BLOCK, dim=axis) if recipe == "blockwise" else to_fp8
    q = t.detach().float() * expanded
    return q.clamp(-fmax, fmax).to(dtype), to_fp8.reciprocal()


def tile_amax(a: torch.Tensor, axis: int, weight: bool) -> torch.Tensor:
    """amax of each BLOCK-long tile of |t| along `axis` (of each BLOCK x BLOCK block for a weight), shaped
    like t with `axis` shrunk by BLOCK."""
    m, n = a.shape
    if axis == 1:
        tiles = a.view(m, n // BLOCK, BLOCK).amax(-1)                                   # [m, n/128]
        if weight:
            tiles = tiles.view(m // BLOCK, BLOCK, n // BLOCK).amax(1).repeat_interleave(BLOCK, 0)
        return tiles
    return tile_amax(a.t(), 1, weight).t()


class Kernel(NamedTuple):
    """How a device runs the float8 matmuls: `matmul_kernel` decides, the one place that knows devices (tests
    pass a Kernel to run another device's contract on the CPU)."""
    emulate: bool        # float8 operands dequantized to float32 (exact) times their scales, one float32 matmul
    multiple: int        # torch._scaled_mm's dims zero-padded to a multiple of this (CUDA wants 16)
    fp32_rowwise: bool   # whether _scaled_mm gives row-wise scaled products in float32 (cuBLAS on sm90 only)


EMULATED = Kernel(emulate=True, multiple=1, fp32_rowwise=True)      # the CPU's (module doc: its rates)
SCALED_MM = Kernel(emulate=False, multiple=1, fp32_rowwise=True)    # torch._scaled_mm as the CPU runs it


def matmul_kernel(device: torch.device) -> Kernel:
    """The Kernel for `device` (module doc); device_refusal turns away what neither CUDA nor the CPU is."""
    if device.type != "cuda":
        return EMULATED
    major, _ = torch.cuda.get_device_capability(device)
    toolkit = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return Kernel(emulate=False, multiple=16, fp32_rowwise=major == 9 and toolkit >= (12, 9))


def dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides, size-1 dims included (_scaled_mm checks a [N, 1] scale's stride(1) == 1)."""
    return t.reshape(-1).clone().view(t.shape)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t [R, C] extended with `value` to [rows, cols]. Float8 is padded with zeros through its bytes (the zero
    byte is +0 in both formats, and pad kernels for float8 are not everywhere)."""
    extra = (0, cols - t.shape[1], 0, rows - t.shape[0])
    if not any(extra):
        return t
    if t.dtype in (E4M3, E5M2):
        return F.pad(t.view(torch.uint8), extra).view(t.dtype)
    return F.pad(t, extra, value=value)


def scaled_mm(a, sa, b, sb, out_dtype, kernel: Kernel) -> torch.Tensor:
    """torch._scaled_mm of a [M, C] and b [C, N] under `kernel`'s contract (module doc): padded rows and
    columns are cut off again (row-wise scales are padded with ones)."""
    m, c, n = a.shape[0], a.shape[1], b.shape[1]
    rows, inner, cols = (round_up(size, kernel.multiple) for size in (m, c, n))
    rowwise = sa.numel() > 1 or sb.numel() > 1
    if rowwise:   # one scale per row of a and per column of b, padded alike
        sa, sb = padded(sa.expand(m, 1), rows, 1, 1.0), padded(sb.expand(1, n), 1, cols, 1.0)
    a = padded(a, rows, inner).contiguous()                    # _scaled_mm: row-major left,
    b = padded(b, inner, cols).t().contiguous().t()            # column-major right
    if rowwise and out_dtype != torch.bfloat16 and not kernel.fp32_rowwise:
        one = sa.new_ones(1, 1)
        out = (torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32) * sa * sb).to(out_dtype)
    else:
        out = torch._scaled_mm(a, b, scale_a=dense(sa), scale_b=dense(sb), out_dtype=out_dtype)
    return out if (rows, cols) == (m, n) else out[:m, :n].contiguous()


def emulated_matmul(a, sa, b, sb, recipe: str) -> torch.Tensor:
    """The float32 product of float8 operands dequantized to float32 (exact) and scaled (module doc: the CPU's)."""
    if recipe != "blockwise":
        return (a.float() * sa) @ (b.float() * sb)
    # each tile's float32 partial sums, then scaled and summed: one batched matmul instead of C/128
    m, n, tiles = a.shape[0], b.shape[1], a.shape[1] // BLOCK
    parts = torch.bmm(a.float().view(m, tiles, BLOCK).transpose(0, 1), b.float().view(tiles, BLOCK, n))
    return (parts * (sa.t().unsqueeze(2) * sb.unsqueeze(1))).sum(0)


def scaled_matmul(a, sa, b, sb, out_dtype, recipe: str, kernel: Kernel = EMULATED) -> torch.Tensor:
    """a [M, C] @ b [C, N] of float8 operands, each quantized along C: sa [M, 1] / sb [1, N] (rowwise),
    [1, 1] (tensorwise), or one per tile, [M, C/128] / [C/128, N] (blockwise)."""
    m, n = a.shape[0], b.shape[1]
    if 0 in (m, a.shape[1], n):
        # an expert without tokens: empty sums, 0 (the CPU's _scaled_mm leaves a C = 0 result uninitialised)
        return a.new_zeros(m, n, dtype=out_dtype)
    if kernel.emulate:
        return emulated_matmul(a, sa, b, sb, recipe).to(out_dtype)
    if recipe != "blockwise":
        return scaled_mm(a, sa, b, sb, out_dtype, kernel)
    out = None
    for j in range(a.shape[1] // BLOCK):   # one row-scaled product per tile of the contraction, summed in fp32
        tile = slice(j * BLOCK, (j + 1) * BLOCK)
        part = scaled_mm(a[:, tile], sa[:, j:j + 1], b[tile], sb[j:j + 1], torch.float32, kernel)
        out = part if out is None else out + part
    return out.to(out_dtype)


def observe(t: torch.Tensor, sync, operand: str) -> torch.Tensor:
    """A tensor's amax now, over every rank holding a piece of it (delayed scaling's history entry)."""
    return sync(amax_of(t.detach().float().abs()), operand, None)


def delayed_amax(history: torch.Tensor, now: torch.Tensor, margin: int) -> torch.Tensor:
    """The amax delayed scaling scales by: the history's largest (times 2^margin), or the amax now while the
    history is empty (the first step, then, scales as tensorwise does)."""
    past = history.amax()
    return torch.where(past > 0, past * 2.0 ** margin, now)


class _Linear(torch.autograd.Function):
    """history [3, H] (delayed scaling only): amaxes of x, w and the output's gradient over the last H steps,
    newest first. Its "gradient" is the history one step on: rolled, this step's amaxes in front (the pure
    way out for an amax the backward sees: step.py combines it over micro-batches by max, on a mesh over the
    ranks too, and writes it back after the optimizer, which never sees it)."""

    @staticmethod
    def forward(ctx, x, w, history, recipe, sync, out_dtype, margin, kernel):
        ctx.recipe, ctx.sync, ctx.dtypes, ctx.margin, ctx.kernel = recipe, sync, (x.dtype, w.dtype), margin, kernel
        ax = aw = None
        if recipe == "delayed":
            now = torch.stack([observe(x, sync, "x"), observe(w, sync, "w")])
            ax, aw = (delayed_amax(history[i], now[i], margin) for i in range(2))
        qx, sx = quantize(x, E4M3, recipe, 1, sync=sync, operand="x", amax=ax)
        qw, sw = quantize(w, E4M3, recipe, 1, weight=True, sync=sync, operand="w", amax=aw)
        # tensorwise, delayed: one scale serves every matmul, keep the float8 copies; else re-scaled in the backward
        kept = (qx, sx, qw, sw) if recipe in ("tensorwise", "delayed") else (x, w)
        ctx.save_for_backward(*kept, *((history, now) if recipe == "delayed" else ()))
        return scaled_matmul(qx, sx, qw.t(), sw.t(), out_dtype, recipe, kernel)

    @staticmethod
    def backward(ctx, g):
        recipe, sync, kernel = ctx.recipe, ctx.sync, ctx.kernel
        (x_dtype, w_dtype), gd = ctx.dtypes, E4M3 if recipe == "blockwise" else E5M2   # module doc
        if recipe in ("tensorwise", "delayed"):
            qx, sx, qw, sw, *delayed = ctx.saved_tensors
            amax = rolled = None
            if delayed:
                history, now = delayed
                g_now = observe(g, sync, "g")
                amax = delayed_amax(history[2], g_now, ctx.margin)
                rolled = torch.cat([torch.cat([now, g_now.reshape(1)]).reshape(3, 1), history[:, :-1]], dim=1)
            qg, sg = quantize(g, gd, recipe, 1, sync=sync, operand="g", amax=amax)
            return (scaled_matmul(qg, sg, qw, sw, x_dtype, recipe, kernel),
                    scaled_matmul(qg.t(), sg, qx, sx, w_dtype, recipe, kernel), rolled, None, None, None, None, None)
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:   # contracts N: g along its rows' length, w along its columns
            qg, sg = quantize(g, gd, recipe, 1, sync=sync, operand="g")
            qw, sw = quantize(w, E4M3, recipe, 0, weight=True, sync=sync, operand="w")
            dx = scaled_matmul(qg, sg, qw, sw, x_dtype, recipe, kernel)
        if ctx.needs_input_grad[1]:   # contracts M: g and x along their columns
            qg, sg = quantize(g, gd, recipe, 0, sync=sync, operand="g")
            qx, sx = quantize(x, E4M3, recipe, 0, sync=sync, operand="x")
            dw = scaled_matmul(qg.t(), sg.t(), qx, sx, w_dtype, recipe, kernel)
        return dx, dw, None, None, None, None, None, None


def linear(x: torch.Tensor, w: torch.Tensor, recipe: str, sync=no_sync, history: torch.Tensor | None = None,
           margin: int = 0, kernel: Kernel | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K].T in float8 (module doc) -> [..., N] in the compute dtype (autocast's if
    enabled, else x's). history: delayed scaling's amax history [3, H] (_Linear), margin its 2^margin;
    kernel: how the matmuls run, x's device's (matmul_kernel) unless given."""
    if (recipe == "delayed") != (history is not None):
        raise ValueError("fp8 delayed scaling takes the layer's amax history, and only it does")
    device = x.device.type
    out_dtype = autocast_dtype(device) or x.dtype
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if recipe == "blockwise":   # zero rows complete the last tile of the weight gradient's contraction
        rows = padded(rows, round_up(m, BLOCK), rows.shape[1])
    with autocast_off(device):
        y = _Linear.apply(rows, w, history, recipe, sync, out_dtype, margin, kernel or matmul_kernel(x.device))
    return y[:m].view(*x.shape[:-1], w.shape[0])


FP8_LINEARS = ("*.attn.w*.weight", "*.mlp.w_*.weight", "*.moe.shared.w_*.weight", "*.moe.experts.w_*")


def is_amax_history(name: str) -> bool:
    """Whether `name` is delayed scaling's amax history, a parameter leaf whose "gradient" step.py writes back."""
    return name.endswith(".fp8_history")


def is_fp8_linear(name: str) -> bool:
    """Whether the parameter `name` is the weight of a matmul that an fp8 recipe runs in float8."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in FP8_LINEARS)


def refusal(recipe: str, name: str, shape) -> str | None:
    """Why `recipe` cannot run the linear `name` (its weight's local shape [N, K] on a rank), or None."""
    bad = [f"{what} {size}" for what, size in zip(("out_features", "in_features"), shape)
           if recipe == "blockwise" and size % BLOCK]
    if bad:
        return (f"model.fp8=blockwise scales {BLOCK} x {BLOCK} blocks of every weight, but {name} has "
                f"{' and '.join(bad)} (on each rank) not divisible by {BLOCK}; use model.fp8=rowwise or "
                f"tensorwise, or layer widths that are multiples of {BLOCK}")
    return None


def device_refusal(device: torch.device) -> str | None:
    """Why `device` cannot run float8 matmuls, or None: the CPU emulates them (matmul_kernel); CUDA needs compute
    capability 8.9 (Ada) or later for float8 tensor cores, and every GPU admitted here gets a Kernel whose
    _scaled_mm calls it accepts (matmul_kernel)."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (8, 9):
            return None
        return (f"model.fp8 needs float8 matmuls: a CUDA GPU of compute capability 8.9 (Ada, Hopper) or later, "
                f"but {torch.cuda.get_device_name(device)} is {major}.{minor}; use model.fp8=none (bf16: "
                f"--train.dtype=bfloat16)")
    return f"model.fp8 runs on the CPU or on CUDA GPUs, not on {device.type}; use model.fp8=none"
