"""Float8 matmuls under each device's contract (nanomega/models/fp8.py, `matmul_kernel`), checked on the CPU.

CUDA's torch._scaled_mm wants every dim a multiple of 16 and, on sm89 and sm100, gives row-wise scaled products
in bf16 only; the CPU's tensorwise _scaled_mm is a reference kernel thousands of times slower than a float32
matmul, so the CPU emulates. Here the CUDA contract runs on the CPU's _scaled_mm under a dispatch mode that
refuses what CUDA refuses, against the unpadded product and the emulation; the device decision is checked
with the GPU's compute capability mocked; the emulation against torch._scaled_mm for every recipe; and
selective recomputation against re-running the float8 matmuls.

    python tests/test_fp8_devices.py      # the CPU's _scaled_mm against the emulation, GFLOP/s (docs/fp8.md)
"""
from __future__ import annotations

import collections
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanomega.models import recompute
from nanomega.models import fp8
from test_fp8 import E4M3, E5M2, RECIPES, emulate_matmul, emulate_quantize, operands

aten = torch.ops.aten
CUDA = torch.device("cuda")


def sm(capability, toolkit, monkeypatch) -> fp8.Kernel:
    """matmul_kernel's choice for a CUDA GPU of `capability` with torch built for CUDA `toolkit`."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"sm{capability[0]}{capability[1]}")
    monkeypatch.setattr(torch.version, "cuda", toolkit)
    return fp8.matmul_kernel(CUDA)


class CudaContract(TorchDispatchMode):
    """Refuses the _scaled_mm calls CUDA refuses (torch 2.13, aten/src/ATen/native/cuda/Blas.cpp and the
    CUTLASS row-wise kernels): a dim not a multiple of 16, a left operand not row-major or a right one not
    column-major, and, where the kernel has no float32 row-wise epilogue, row-wise scales with an output
    other than bf16 or a right operand other than e4m3."""

    def __init__(self, kernel: fp8.Kernel):
        super().__init__()
        self.kernel, self.calls = kernel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._scaled_mm.default:
            a, b, sa, sb = args[:4]
            out_dtype = kwargs.get("out_dtype", args[6] if len(args) > 6 else None)
            assert all(size % 16 == 0 for size in (*a.shape, *b.shape)), (a.shape, b.shape)
            assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
            if sa.numel() > 1 or sb.numel() > 1:
                assert sa.shape == (a.shape[0], 1) and sb.shape == (1, b.shape[1]), (sa.shape, sb.shape)
                assert b.dtype == E4M3
                assert self.kernel.fp32_rowwise or out_dtype == torch.bfloat16, out_dtype
            self.calls += 1
        return func(*args, **kwargs)


def run_linear(x, w, dy, recipe, kernel, autocast=False):
    """(y, dx, dw) of fp8.linear under `kernel`; delayed scaling with an empty history (its first step)."""
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    history = torch.zeros(3, 2) if recipe == "delayed" else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fp8.linear(xr, wr, recipe, history=history, kernel=kernel)
    return (y, *torch.autograd.grad(y, (xr, wr), dy.to(y.dtype)))


def close(got, want, tol):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm()) <= tol * float(want.norm())


# ------------------------------------------------------------------ which kernel a device gets

@pytest.mark.parametrize("capability,toolkit,fp32_rowwise", [
    ((8, 9), "12.9", False),     # Ada: CUTLASS row-wise kernel, bf16 out
    ((9, 0), "12.9", True),      # Hopper with cuBLAS >= 12.9: row-wise scales into float32
    ((9, 0), "12.8", False),     # Hopper, older cuBLAS: CUTLASS
    ((10, 0), "12.9", False),    # Blackwell: CUTLASS for row-wise scales
])
def test_each_gpu_gets_a_kernel_it_can_run_and_is_admitted(monkeypatch, capability, toolkit, fp32_rowwise):
    """Every admitted GPU runs _scaled_mm with dims padded to 16; float32 from row-wise scales only where cuBLAS
    gives it. device_refusal and matmul_kernel agree: nothing admitted is handed a call it rejects (checked
    for every recipe by test_the_cuda_contract_holds_for_every_recipe)."""
    kernel = sm(capability, toolkit, monkeypatch)
    assert kernel == fp8.Kernel(emulate=False, multiple=16, fp32_rowwise=fp32_rowwise)
    assert fp8.device_refusal(CUDA) is None


def test_gpus_without_float8_are_refused_and_the_cpu_emulates(monkeypatch):
    sm((8, 6), "12.9", monkeypatch)
    assert "compute capability 8.9" in fp8.device_refusal(CUDA) and "is 8.6" in fp8.device_refusal(CUDA)
    assert fp8.matmul_kernel(torch.device("cpu")) == fp8.EMULATED


# ------------------------------------------------------------------ CUDA's contract, run on the CPU

def test_padding_is_zeros_in_float8_and_ones_in_scales():
    q = (torch.randn(5, 40) * 10).to(E5M2)
    p = fp8.padded(q, 16, 48)
    assert p.dtype == E5M2 and p.shape == (16, 48)
    assert torch.equal(p[:5, :40].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(p.float()[5:], torch.zeros(11, 48)) and torch.equal(p.float()[:, 40:], torch.zeros(16, 8))
    assert torch.equal(fp8.padded(torch.full((5, 1), 0.5), 16, 1, 1.0)[5:], torch.ones(11, 1))


@pytest.mark.parametrize("scales", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_padding_to_multiples_of_16_leaves_the_product_unchanged(scales, out_dtype):
    """A [37, 200] @ [200, 136] float8 product (no dim a multiple of 16) under CUDA's contract equals the
    unpadded torch._scaled_mm: the padding adds exact zeros to each sum."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(37, 200, generator=g) * 20).to(E4M3), (torch.randn(200, 136, generator=g) * 20).to(E4M3)
    if scales == "tensorwise":
        sa, sb = torch.tensor([[0.013]]), torch.tensor([[0.007]])
    else:
        sa, sb = torch.rand(37, 1, generator=g) / 50, torch.rand(1, 136, generator=g) / 50
    want = torch._scaled_mm(a, b.t().contiguous().t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    contract = CudaContract(fp8.Kernel(emulate=False, multiple=16, fp32_rowwise=True))
    with contract:
        got = fp8.scaled_mm(a, sa, b, sb, out_dtype, contract.kernel)
    assert contract.calls == 1 and got.shape == (37, 136) and got.dtype == out_dtype
    tol = 2e-6 if out_dtype == torch.float32 else 2 ** -8
    assert close(got, want, tol)
    assert close(got, (a.double() * sa.double()) @ (b.double() * sb.double()), tol)


CONTRACT_SHAPES = {"tensorwise": (37, 200, 136), "rowwise": (37, 200, 136), "delayed": (37, 200, 136),
                   "blockwise": (37, 256, 384)}     # blockwise: K and N whole 128-tiles (fp8.refusal)


@pytest.mark.parametrize("capability,toolkit", [((8, 9), "12.9"), ((9, 0), "12.9")], ids=["sm89", "sm90"])
@pytest.mark.parametrize("recipe", RECIPES + ("delayed",))
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_cuda_contract_holds_for_every_recipe(monkeypatch, capability, toolkit, recipe, autocast):
    """With the kernel matmul_kernel picks for the GPU, every _scaled_mm of the forward and both gradients is
    one CUDA accepts (CudaContract), and the results equal the CPU's emulation within float32 accumulation
    (the outputs within bf16 rounding under bf16 autocast)."""
    kernel = sm(capability, toolkit, monkeypatch)
    m, k, n = CONTRACT_SHAPES[recipe]
    x, w, dy = operands(10, m=m, k=k, n=n)
    want = run_linear(x, w, dy, recipe, fp8.EMULATED, autocast)
    contract = CudaContract(kernel)
    with contract:
        got = run_linear(x, w, dy, recipe, kernel, autocast)
    assert contract.calls >= 3
    for g, wt in zip(got, want):
        assert g.shape == wt.shape and g.dtype == wt.dtype
        assert close(g, wt, 2 ** -7 if g.dtype == torch.bfloat16 else 2e-6)


# ------------------------------------------------------------------ the CPU's emulation

@pytest.mark.parametrize("recipe", RECIPES + ("delayed",))
def test_the_emulation_equals_scaled_mm(recipe):
    """Float8 operands dequantized to float32 (exact) and scaled, one float32 matmul: torch._scaled_mm's
    numbers within float32 accumulation, forward and both gradients, and the float64 sums of the emulated
    float8 products (tests/test_fp8.py) for the forward."""
    x, w, dy = operands(11, m=64, k=256, n=256)
    got, want = run_linear(x, w, dy, recipe, fp8.EMULATED), run_linear(x, w, dy, recipe, fp8.SCALED_MM)
    for g, wt in zip(got, want):
        assert close(g, wt, 2e-6)
    quantized = "tensorwise" if recipe == "delayed" else recipe
    qx, sx = emulate_quantize(x, E4M3, quantized, 1)
    qw, sw = emulate_quantize(w, E4M3, quantized, 1, weight=True)
    assert close(got[0], emulate_matmul(qx, sx, qw.t(), sw.t(), quantized), 2e-6)


def gflops(fn, n: int, repeats: int) -> float:
    fn()
    best = min(timed(fn) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_rates(n: int, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of an n x n x n float8 product on this CPU: torch._scaled_mm with tensorwise and row-wise
    scales, the emulation (fp8.emulated_matmul), and a bf16 matmul for scale."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(E4M3)
    b = torch.randn(n, n, generator=g).to(E4M3).t().contiguous().t()      # column-major, as _scaled_mm wants
    one, rows, cols = torch.ones(1, 1), torch.rand(n, 1, generator=g), torch.rand(1, n, generator=g)
    x, y = torch.randn(n, n, generator=g).bfloat16(), torch.randn(n, n, generator=g).bfloat16()

    def scaled_mm(sa, sb):
        return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    return {
        "_scaled_mm tensorwise": gflops(scaled_mm(one, one), n, 1 if n > 256 else repeats),   # ~1 min at 1024
        "_scaled_mm rowwise": gflops(scaled_mm(rows, cols), n, repeats),
        "emulated": gflops(lambda: fp8.emulated_matmul(a, rows, b, cols, "rowwise"), n, repeats),
        "bf16 matmul": gflops(lambda: x @ y, n, repeats),
    }


def test_the_emulation_outruns_the_cpus_tensorwise_scaled_mm():
    """The reason the CPU emulates: its tensorwise _scaled_mm is a reference kernel (0.04-0.07 GFLOP/s here,
    0.08 on an AMX Xeon) where the emulation runs at float32 matmul speed. Row-wise _scaled_mm on the CPU is
    the emulation's own computation (bit for bit, tests above)."""
    rates = cpu_rates(128)
    print({k: round(v, 3) for k, v in rates.items()})
    assert rates["emulated"] >= 5 * rates["_scaled_mm tensorwise"]


# ------------------------------------------------------------------ selective recomputation

class OpCounts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", RECIPES)
def test_selective_recomputation_keeps_the_float8_matmuls(recipe):
    """Under "selective" the backward re-runs no _scaled_mm (recompute.SAVE keeps their outputs): as many
    calls as without recomputation, where "full" re-runs the forward's."""
    x, w, dy = operands(12, m=32, k=256, n=128)
    w2 = torch.randn(128, 128, generator=torch.Generator().manual_seed(1)) * 0.05

    def block(x, w, w2):
        return fp8.linear(torch.relu(fp8.linear(x, w, recipe, kernel=fp8.SCALED_MM)), w2, recipe,
                          kernel=fp8.SCALED_MM)

    def scaled_mm_calls(mode):
        fn = block if mode == "none" else recompute.recomputed(block, mode)
        inputs = [t.clone().requires_grad_() for t in (x, w, w2)]
        with OpCounts() as ops:
            out = fn(*inputs)
            forward = ops.counts[aten._scaled_mm.default]
            grads = torch.autograd.grad(out, inputs, dy)
        return forward, ops.counts[aten._scaled_mm.default], grads

    forward, plain, want = scaled_mm_calls("none")
    _, selective, got = scaled_mm_calls("selective")
    _, full, _ = scaled_mm_calls("full")
    assert selective == plain and full == plain + forward
    assert all(torch.equal(g, wt) for g, wt in zip(got, want))


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; GFLOP/s, best of 3 (1 for the slowest)")
    for size in (256, 1024):
        print(size, {k: round(v, 3) for k, v in cpu_rates(size).items()})
