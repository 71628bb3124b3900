"""Accelerator peak, MFU, throughput, bits per byte, and a JSON-lines metrics log (parameter and FLOP counts:
sim/counting.py).
All pure functions, except that `peak_flops` caches a measurement and `MetricsLog` appends."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# A known GPU's MFU denominator: its dense (no 2:4 sparsity) bf16 tensor-core peak from the one datasheet table,
# quoted even for fp32 runs, as Megatron and PaLM do.
from nanomega.sim.devices import lookup_peak


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 0,
                         seconds: float = 0.5, trials: int = 5) -> float:
    """FLOP/s of back-to-back n x n matmuls: the best of `trials` short timings after a warm-up.
    The best, not the mean, because a shared machine only ever slows a timing down; n defaults to
    1024 on CPU; a GPU needs bigger matmuls to get near its peak."""
    n = n or (1024 if device.type == "cpu" else 8192)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    (a @ b)[0, 0].item()                                    # warm-up: kernel selection, allocator
    best = 0.0
    for _ in range(trials):
        count, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / trials:
            (a @ b)[0, 0].item()                            # .item() waits for the device on any backend
            count += 1
        best = max(best, 2 * n ** 3 * count / elapsed)
    return best


def hardware_name(device: torch.device) -> str:
    if device.type != "cpu":
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    name = platform.processor()                             # often "" on Linux, so try /proc
    if not name and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"{name or platform.machine()} x{torch.get_num_threads()} threads"


def peak_flops(device: torch.device | str, dtype: torch.dtype, override: float = 0.0,
               cache_dir: str = "") -> float:
    """Peak FLOP/s used as the MFU denominator.

    override > 0 wins. A known GPU gets its bf16 dense table entry whatever `dtype` is.
    Anything else (CPU, unknown GPU) gets a measured matmul rate in `dtype` (achieved, so
    below a datasheet peak), cached in `cache_dir or ~/.cache/nanomega`/peak_flops.json so
    only the first run pays ~0.5 s, keyed by hardware, thread count, dtype, torch version. A rate
    measured while more processes want the cores than there are (load average above the core count)
    is this moment's, not the machine's: it is used for this run but not cached, or one busy minute
    would divide every later run's MFU denominator (a cached 11 GFLOP/s showed MFU 1,945%).
    """
    if override > 0:
        return float(override)
    device = torch.device(device)
    if device.type == "cuda" and (known := lookup_peak(torch.cuda.get_device_name(device))):
        return known
    path = Path(cache_dir or Path.home() / ".cache" / "nanomega") / "peak_flops.json"
    key = f"{hardware_name(device)} | {dtype} | torch {torch.__version__}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):                           # missing or corrupt: measure again
        cache = {}
    if key in cache:
        return float(cache[key])
    cache[key] = measure_matmul_flops(device, dtype)
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        return cache[key]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")           # write, then rename: no reader sees half a file
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return cache[key]


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak (a fraction, not %)."""
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak}")
    return tokens_per_s * flops_per_token / peak


@dataclass(frozen=True)
class Throughput:
    """Fixes the per-token cost and the peak once; `rates` turns a timed interval into numbers."""
    flops_per_token: float
    peak: float

    def rates(self, tokens: int, seconds: float) -> dict[str, float]:
        tps = tokens / seconds if seconds > 0 else 0.0
        return {"tokens_per_s": tps, "mfu": mfu(tps, self.flops_per_token, self.peak)}


def bytes_per_token(tokenizer, batches) -> float:
    """Mean bytes of text per target token of `batches` (pairs of inputs and targets): what turns a loss per
    token into one per byte. The tokenizer says how many bytes each id stands for (`token_bytes()`, one
    count per id): 1 for every id of the byte tokenizer; a BPE tokenizer's merged tokens stand for more."""
    lengths = torch.tensor(tokenizer.token_bytes(), dtype=torch.float64)
    targets = torch.cat([y.reshape(-1).cpu() for _, y in batches])
    return float(lengths[targets].mean())


def bits_per_byte(nats_per_token: float, bytes_per_token: float) -> float:
    """A loss in nats per token as bits per byte of text, comparable across tokenizers:
    nats/token x tokens / (ln 2 x bytes) = nats/token / (ln 2 x bytes/token)."""
    return nats_per_token / (math.log(2) * bytes_per_token)


def peak_memory_gib(device: torch.device) -> float:
    """The run's peak memory so far, in GiB: the device's peak of allocated tensor bytes on CUDA (what
    torchtitan logs as max active), the process's peak resident memory elsewhere (tensors, Python, data)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource  # POSIX; ru_maxrss is in KiB on Linux, in bytes on macOS
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if platform.system() == "Darwin" else 2**20)


def moe_metrics(stats: dict) -> dict:
    """The router's health for the log, from one step's MoE stats (step.grads_fn): balancing and z
    losses, and per MoE layer the assignments (token, choice) each expert got in the step — min,
    max and coefficient of variation (std / mean; 0 = perfect balance) — and the fraction dropped
    over capacity."""
    if "expert_load" not in stats:
        return {}
    load = stats["expert_load"].float()
    mean = load.mean(1)
    return {"aux_loss": float(stats["aux_loss"]), "z_loss": float(stats["z_loss"]),
            "expert_load_min": load.min(1).values.tolist(), "expert_load_max": load.max(1).values.tolist(),
            "expert_load_cv": (load.std(1, correction=0) / mean).tolist(),
            "dropped_fraction": (stats["dropped"].float() / load.sum(1)).tolist()}


def _jsonable(x):
    # json.dumps calls this only for types it cannot write itself.
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if hasattr(x, "tolist"):                                # numpy scalars and arrays
        return x.tolist()
    raise TypeError(f"cannot log {type(x).__name__} as JSON")


class MetricsLog:
    """Appends one JSON object per line to `path` (conventionally <out_dir>/metrics.jsonl).
    Opened, written and closed on every call, so each line reaches the OS as soon as `log`
    returns: a crash or kill of the trainer loses nothing already logged. NaN/inf are written
    as NaN/Infinity (Python's json reads them back): a diverging loss must show in the log."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict) -> None:
        line = json.dumps(record, default=_jsonable) + "\n"
        with open(self.path, "a") as f:
            f.write(line)                                   # one write: a kill can only cut the last line


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """All records in order. A truncated last line (killed mid-write) is dropped, not an error."""
    lines = Path(path).read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return records
