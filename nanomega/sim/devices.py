"""Accelerators as data: datasheet peaks and bandwidths, and the few efficiency constants the step-time model
(nanomega/sim/step_time.py) applies to them, all in this one file. The one table of datasheet peaks: the
training loop's MFU denominator comes from it too (`lookup_peak`, by the name torch gives the GPU).

Every number below is the vendor's datasheet figure (dense, i.e. without 2:4 sparsity), with its source
beside it; the step-time model's GPUs are SXM parts. A card the simulator cannot model (a PCIe card: no
NVLink, no cluster network in its datasheet) leaves those fields None and serves the MFU only. Bandwidths
are per GPU and per direction (what a ring collective's send side sees): NVLink's "900 GB/s" for H100 is
both directions together, so 450 GB/s here. The network is one NIC per GPU
(a DGX-style, rail-optimised cluster): a collective whose group spans nodes is bounded by that NIC.

Efficiency constants: fixed from public measurements (cited) BEFORE the comparison with published runs in
bench/published.py, and never tuned per row; what each one stands for is in its comment.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float            # dense bf16 tensor-core peak, FLOP/s
    fp8_flops: float | None      # dense fp8 tensor-core peak, FLOP/s (None: no fp8 tensor cores)
    hbm_bytes: float             # memory per GPU, bytes
    hbm_bandwidth: float         # bytes/s
    nvlink_bandwidth: float | None    # bytes/s per GPU per direction, inside a node (None: no NVLink-class link)
    network_bandwidth: float | None   # bytes/s per GPU per direction, between nodes (None: no datasheet cluster)
    gpus_per_node: int = 8
    # fp32 FLOP/s without tensor cores: what a float32 matmul runs at under torch's default (TF32 off,
    # torch.backends.cuda.matmul.allow_tf32 = False), and where cuSOLVER's fp32 factorizations run.
    # None: not known here; fp32 matmuls are then charged at the bf16 peak (optimistic).
    fp32_flops: float | None = None
    # the word torch.cuda.get_device_name holds for it ("H100" in "NVIDIA H100 80GB HBM3"); None: no name tells
    # it apart from another entry's
    torch_name: str | None = None


DEVICES = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS bf16 dense, 80 GB HBM2e at 2,039 GB/s,
    # NVLink 3 600 GB/s (both directions); DGX A100: 8x 200 Gb/s HDR InfiniBand for 8 GPUs
    "a100": Device("A100 80GB SXM", 312e12, None, 80 * GB, 2039 * GB, 300 * GB, 200e9 / 8, fp32_flops=19.5e12,
                   torch_name="A100"),     # the PCIe A100's tensor-core peak is the same 312 TFLOPS
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16 and 1,979 TFLOPS fp8 dense (the 1,979 / 3,958
    # figures are with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s, 67 TFLOPS FP32;
    # DGX H100: 8x 400 Gb/s NDR
    "h100": Device("H100 SXM", 989e12, 1979e12, 80 * GB, 3350 * GB, 450 * GB, 400e9 / 8, fp32_flops=67e12,
                   torch_name="H100"),     # torch names it "NVIDIA H100 80GB HBM3"
    # the H100 of Meta's Grand Teton hosts, where torchtitan's published runs were made (torchtitan
    # benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, 500 W; the SXM's compute (their note:
    # its true peak is between the SXM's and the NVL's), NVLink 4, 400 Gb/s RDMA per GPU
    "h100_hbm2e": Device("H100 96GB HBM2e (Grand Teton)", 989e12, 1979e12, 96 * GB, 2400 * GB, 450 * GB, 400e9 / 8,
                          fp32_flops=67e12),
    # NVIDIA H200 datasheet (SXM): the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; 400 Gb/s NDR per GPU
    "h200": Device("H200 SXM", 989e12, 1979e12, 141 * GB, 4800 * GB, 450 * GB, 400e9 / 8, fp32_flops=67e12,
                   torch_name="H200"),
    # NVIDIA DGX B200 datasheet: 72 PFLOPS fp8 training (sparse) for 8 GPUs = 4.5 PFLOPS fp8 and 2.25 PFLOPS bf16
    # dense per GPU, 1,440 GB HBM3e in all (180 GB per GPU) at 8 TB/s each, NVLink 5 1.8 TB/s, 8x 400 Gb/s ConnectX-7
    "b200": Device("B200", 2250e12, 4500e12, 180 * GB, 8000 * GB, 900 * GB, 400e9 / 8, torch_name="B200"),
    # --- for the MFU only (no NVLink or cluster network figures: the step-time model refuses them)
    # NVIDIA H100 Tensor Core GPU datasheet (PCIe): 756 TFLOPS bf16 and 1,513 TFLOPS fp8 dense, 80 GB HBM2e at
    # 2 TB/s, 51 TFLOPS FP32
    "h100_pcie": Device("H100 PCIe", 756e12, 1513e12, 80 * GB, 2000 * GB, None, None, fp32_flops=51e12,
                        torch_name="H100 PCIe"),
    # NVIDIA L40S datasheet: 362.05 TFLOPS bf16 and 733 TFLOPS fp8 dense (rounded here to 362), 48 GB GDDR6 at
    # 864 GB/s, 91.6 TFLOPS FP32
    "l40s": Device("L40S", 362e12, 733e12, 48 * GB, 864 * GB, None, None, fp32_flops=91.6e12, torch_name="L40S"),
    # NVIDIA L4 datasheet: 242 TFLOPS bf16 and 485 TFLOPS fp8 with sparsity, half that dense; 24 GB GDDR6 at
    # 300 GB/s, 30.3 TFLOPS FP32
    "l4": Device("L4", 121e12, 242.5e12, 24 * GB, 300 * GB, None, None, fp32_flops=30.3e12, torch_name="L4"),
    # NVIDIA A10 datasheet: 125 TFLOPS bf16 dense, 24 GB GDDR6 at 600 GB/s, 31.2 TFLOPS FP32; AWS publishes no
    # datasheet for its A10G, taken here at the A10's figures (no fp8 tensor cores: Ampere)
    "a10g": Device("A10G", 125e12, None, 24 * GB, 600 * GB, None, None, fp32_flops=31.2e12, torch_name="A10G"),
    # NVIDIA Ada Lovelace architecture whitepaper, appendix (GeForce RTX 4090): 165.2 TFLOPS bf16 and 330.3 fp8
    # dense with FP32 accumulate (rounded here to 165), 24 GB GDDR6X at 1,008 GB/s, 82.6 TFLOPS FP32
    "rtx4090": Device("GeForce RTX 4090", 165e12, 330.3e12, 24 * GB, 1008 * GB, None, None, fp32_flops=82.6e12,
                      torch_name="RTX 4090"),
    # AMD Instinct MI300X data sheet: 1,307.4 TFLOPS bf16 and 2,614.9 TFLOPS fp8 dense (rounded here to 1,307),
    # 192 GB HBM3 at 5.3 TB/s, 163.4 TFLOPS FP32 (matrix)
    "mi300x": Device("Instinct MI300X", 1307e12, 2614.9e12, 192 * GB, 5300 * GB, None, None, fp32_flops=163.4e12,
                     torch_name="MI300X"),
}


@dataclass(frozen=True)
class Efficiency:
    """What a real kernel reaches of a datasheet peak. The defaults are the model's constants (module doc)."""
    # large bf16/fp8 GEMMs: cuBLAS reaches ~650-750 of H100 SXM's 989 dense TFLOP/s at sustained (power-capped)
    # clocks (NVIDIA's and others' published GEMM sweeps); 0.70 of peak
    matmul: float = 0.70
    # an MoE's grouped GEMMs (torch._grouped_mm, Transformer Engine's and DeepGEMM's grouped kernels): every expert a
    # few thousand rows of K, N = 1.5-7k (DeepSeek-V3, Qwen3-235B at their published layouts), with a ragged tail
    # tile per expert and each expert's weights read once for few rows. An ASSUMPTION fixed before the MoE rows of
    # bench/published.py were first run (2026-12-04), not measured here: 0.8 of a large GEMM's 0.70, i.e. 0.55
    grouped_matmul: float = 0.55
    # causal flash attention (torch SDPA's FlashAttention-2 / cuDNN kernels), forward and backward: FA2 runs at
    # 335-370 bf16 TFLOP/s forward on H100 at head dim 128, ~0.35 of peak (FlashAttention-3 paper, Dao et al.
    # 2024); cuDNN's kernels, torch's default on H100, are faster: 0.40
    attention: float = 0.40
    # memory-bound kernels (elementwise, norms, softmax, optimizer updates): ~80% of HBM peak (STREAM-like copy)
    hbm: float = 0.80
    # NCCL collectives' achieved bus bandwidth: ~80% of the link (nccl-tests all_gather / reduce_scatter busbw
    # on DGX H100 ~360 GB/s of NVLink's 450, ~40 of NDR's 50 GB/s)
    bus: float = 0.80
    # each kernel's launch and tail: a few microseconds that no roofline shows (eager PyTorch on H100)
    kernel_s: float = 4e-6
    # each collective's start-up latency (NCCL ring, ~tens of microseconds across nodes)
    collective_s: float = 20e-6
    # dense factorizations (eigh, QR, Cholesky, LU solve: cuSOLVER) on their standard FLOP counts
    # (step_time.linalg_flops), as a fraction of the fp32 peak (Device.fp32_flops). An ASSUMPTION, not measured
    # here: eigh is two-sided (tridiagonal reduction half in matrix-vector products, memory-bound) and its QR/
    # divide-and-conquer stage is serial, so cuSOLVER's syevd is reported at a few TFLOP/s at d ~ 4-8k and far
    # less at d ~ 1k (the matrix optimizers' default block); 0.05 of 67 TFLOP/s = 3.4 TFLOP/s. The benchmark
    # (bench/optimizer_cost.py) also shows each figure at a quarter of this, to show how much rests on it.
    linalg: float = 0.05


def modelled() -> list[str]:
    """The table's GPUs the step-time model can time: those with their interconnect's figures."""
    return sorted(k for k, d in DEVICES.items() if d.nvlink_bandwidth is not None and d.network_bandwidth is not None)


def device(name: str) -> Device:
    """The device called `name` (case-insensitive) for the step-time model, or a clear error that lists the
    ones it can model."""
    key = name.lower().replace(" ", "").replace("-", "_")
    if key not in DEVICES:
        raise ValueError(f"unknown GPU {name!r}; choose one of {modelled()} (nanomega/sim/devices.py)")
    if key not in modelled():
        raise ValueError(f"GPU {name!r} has no NVLink or cluster network figures in nanomega/sim/devices.py (its "
                         f"datasheet gives none), which the step-time model needs; choose one of {modelled()}")
    return DEVICES[key]


def lookup_peak(device_name: str) -> float:
    """The dense bf16 peak of a GPU named as torch.cuda.get_device_name names it; 0.0 if the table lacks it.
    Longest name first and whole-word matches, so "H100 PCIe" beats "H100" and "L4" misses "L40S"."""
    named = sorted((d for d in DEVICES.values() if d.torch_name), key=lambda d: len(d.torch_name), reverse=True)
    for d in named:
        if re.search(rf"(?<![a-z0-9]){re.escape(d.torch_name.lower())}(?![a-z0-9])", device_name.lower()):
            return d.bf16_flops
    return 0.0
