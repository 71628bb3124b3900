"""Accelerators as data: datasheet peaks and bandwidths, and the few efficiency constants the step-time model
(nanomega/sim/step_time.py) applies to them, all in this one file.

Every number below is the vendor's datasheet figure for the SXM part (dense, i.e. without 2:4 sparsity), with
its source beside it. Bandwidths are per GPU and per direction (what a ring collective's send side sees):
NVLink's "900 GB/s" for H100 is both directions together, so 450 GB/s here. The network is one NIC per GPU
(a DGX-style, rail-optimised cluster): a collective whose group spans nodes is bounded by that NIC.

Efficiency constants: fixed from public measurements (cited) BEFORE the comparison with published runs in
bench/published.py, and never tuned per row; what each one stands for is in its comment.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float            # dense bf16 tensor-core peak, FLOP/s
    fp8_flops: float | None      # dense fp8 tensor-core peak, FLOP/s (None: no fp8 tensor cores)
    hbm_bytes: float             # memory per GPU, bytes
    hbm_bandwidth: float         # bytes/s
    nvlink_bandwidth: float      # bytes/s per GPU per direction, inside a node
    network_bandwidth: float     # bytes/s per GPU per direction, between nodes
    gpus_per_node: int = 8
    # fp32 FLOP/s without tensor cores: what a float32 matmul runs at under torch's default (TF32 off,
    # torch.backends.cuda.matmul.allow_tf32 = False), and where cuSOLVER's fp32 factorizations run.
    # None: not known here; fp32 matmuls are then charged at the bf16 peak (optimistic).
    fp32_flops: float | None = None


DEVICES = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): 312 TFLOPS bf16 dense, 80 GB HBM2e at 2,039 GB/s,
    # NVLink 3 600 GB/s (both directions); DGX A100: 8x 200 Gb/s HDR InfiniBand for 8 GPUs
    "a100": Device("A100 80GB SXM", 312e12, None, 80 * GB, 2039 * GB, 300 * GB, 200e9 / 8, fp32_flops=19.5e12),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS bf16 and 1,979 TFLOPS fp8 dense (the 1,979 / 3,958
    # figures are with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s, 67 TFLOPS FP32;
    # DGX H100: 8x 400 Gb/s NDR
    "h100": Device("H100 SXM", 989e12, 1979e12, 80 * GB, 3350 * GB, 450 * GB, 400e9 / 8, fp32_flops=67e12),
    # the H100 of Meta's Grand Teton hosts, where torchtitan's published runs were made (torchtitan
    # benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, 500 W; the SXM's compute (their note:
    # its true peak is between the SXM's and the NVL's), NVLink 4, 400 Gb/s RDMA per GPU
    "h100_hbm2e": Device("H100 96GB HBM2e (Grand Teton)", 989e12, 1979e12, 96 * GB, 2400 * GB, 450 * GB, 400e9 / 8,
                          fp32_flops=67e12),
    # NVIDIA H200 datasheet (SXM): the H100's compute, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; 400 Gb/s NDR per GPU
    "h200": Device("H200 SXM", 989e12, 1979e12, 141 * GB, 4800 * GB, 450 * GB, 400e9 / 8, fp32_flops=67e12),
    # NVIDIA DGX B200 datasheet: 72 PFLOPS fp8 training (sparse) for 8 GPUs = 4.5 PFLOPS fp8 and 2.25 PFLOPS bf16
    # dense per GPU, 1,440 GB HBM3e in all (180 GB per GPU) at 8 TB/s each, NVLink 5 1.8 TB/s, 8x 400 Gb/s ConnectX-7
    "b200": Device("B200", 2250e12, 4500e12, 180 * GB, 8000 * GB, 900 * GB, 400e9 / 8),
}


@dataclass(frozen=True)
class Efficiency:
    """What a real kernel reaches of a datasheet peak. The defaults are the model's constants (module doc)."""
    # large bf16/fp8 GEMMs: cuBLAS reaches ~650-750 of H100 SXM's 989 dense TFLOP/s at sustained (power-capped)
    # clocks (NVIDIA's and others' published GEMM sweeps); 0.70 of peak
    matmul: float = 0.70
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


def device(name: str) -> Device:
    """The device called `name` (case-insensitive), or a clear error that lists the known ones."""
    key = name.lower().replace(" ", "").replace("-", "_")
    if key not in DEVICES:
        raise ValueError(f"unknown GPU {name!r}; choose one of {sorted(DEVICES)} (nanomega/sim/devices.py)")
    return DEVICES[key]
