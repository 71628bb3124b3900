"""Learning-rate schedules: functions of the update count (an int or an int64 tensor) -> lr.

They are written with torch ops on a tensor count so a compiled optimizer step traces them once
instead of recompiling for every step value.
"""
from __future__ import annotations

import math

import torch


def _as_float(step) -> torch.Tensor:
    return torch.as_tensor(step).to(torch.float32)


def constant(lr: float, warmup_steps: int = 0):
    def schedule(step):
        s = _as_float(step)
        return lr * torch.clamp((s + 1) / max(warmup_steps, 1), max=1.0)
    return schedule


def warmup_cosine(lr: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to lr over warmup_steps, then cosine decay to lr * min_ratio at total_steps."""
    def schedule(step):
        s = _as_float(step)
        warm = lr * (s + 1) / max(warmup_steps, 1)
        progress = torch.clamp((s - warmup_steps) / max(total_steps - warmup_steps, 1), 0.0, 1.0)
        cos = lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + torch.cos(math.pi * progress)))
        return torch.where(s < warmup_steps, warm, cos)
    return schedule


def warmup_stable_decay(lr: float, warmup_steps: int, total_steps: int, decay_fraction: float = 0.2,
                        min_ratio: float = 0.0):
    """WSD (MiniCPM): warmup, a long constant phase, then linear decay over the last decay_fraction."""
    decay_start = total_steps - int(decay_fraction * total_steps)

    def schedule(step):
        s = _as_float(step)
        warm = lr * (s + 1) / max(warmup_steps, 1)
        progress = torch.clamp((s - decay_start) / max(total_steps - decay_start, 1), 0.0, 1.0)
        decay = lr * (1 - (1 - min_ratio) * progress)
        return torch.where(s < warmup_steps, warm, decay)
    return schedule
