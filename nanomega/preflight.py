"""Before any work: the device, the data, and every refusal a run can be given cheaply.

    device = pick_device(cfg.train.device)
    preflight(cfg, device)       # layout rules, fp8 support, out_dir, init_from's headers, memory
    splits = load_data(cfg)      # the corpus read, checked against the vocabulary and the sequence length

A refusal says what to change and happens before data, process groups or parameters exist, so nothing
saved is touched. The memory check counts what the most loaded rank holds between steps from the plan
(instant), and simulates the step on fake tensors only when that comes close to the free memory.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nanomega import checkpoint, hf
from nanomega.config import Config
from nanomega.data import check_vocab, declared_vocab_size, load_splits, require_length
from nanomega.evaluate import read_task, task_name
from nanomega.metrics import count_params, flops_per_token
from nanomega.models import fp8
from nanomega.parallel.memory import bytes_per_rank
from nanomega.parallel.mesh import launched_world_size, model_config, validate_layout
from nanomega.tracking import require_tracker


# Simulate the step when the held bytes exceed 1/SIMULATE_ABOVE of the free memory (the default run on a
# CPU: 50 MB of 24 GB, no simulation); PEAK_MARGIN covers the allocator's rounding, fragmentation and the
# workspaces no tensor shows (the tracked peak is 5% above the resident-set growth on a CPU).
SIMULATE_ABOVE = 16
PEAK_MARGIN = 0.10


def pick_device(name: str) -> torch.device:
    """The device this process trains on. A GPU without an index is GPU LOCAL_RANK (torchrun's; 0 alone),
    so each rank's first CUDA call (the preflight's memory query) opens a context on its own GPU only,
    never on GPU 0, long before init_distributed makes it the current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"   # no CUDA context: the driver's device count only
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def load_data(cfg: Config):
    """Everything that can fail on bad data fails here, before any expensive work."""
    splits = load_splits(cfg.data, cfg.train.seq_len)
    check_vocab(splits, cfg.model.vocab_size, declared_vocab_size(cfg.data))
    require_length(splits, cfg.train.seq_len)
    return splits


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":   # pick_device's indexed GPU: a bare "cuda" would query (and open) the current one
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_tasks(paths, world_size: int) -> None:
    """--eval.tasks: each file read and checked (evaluate.read_task), names distinct, one process. On a mesh
    the scorer would need every position's logits of the sharded model (the sample's path reads one row), which
    it does not have yet; a run's checkpoint is scored after training with python -m nanomega.evaluate."""
    if world_size > 1:
        raise ValueError(f"eval.tasks runs on one process, and this job has {world_size}: leave --eval.tasks out "
                         "and score the checkpoint after the run with python -m nanomega.evaluate --run "
                         "<out_dir> --tasks <files> (it reads a checkpoint of any layout)")
    names = [task_name(p) for p in paths]
    if len(set(names)) < len(names):
        raise ValueError(f"eval.tasks={','.join(paths)}: two files share a name ({names}); tasks are logged by "
                         "file name, so rename one")
    for path in paths:
        read_task(path)


def preflight(cfg: Config, device: torch.device) -> None:
    """Describe the model and refuse what cannot work, before data or parameters are touched."""
    t_cfg = cfg.train
    require_tracker(t_cfg.tracker)       # a missing tensorboard or wandb, before anything else
    validate_layout(cfg, launched_world_size())
    if t_cfg.fp8 != "none" and (refused := fp8.device_refusal(device)):
        raise ValueError(refused)
    n_params, fpt = count_params(cfg.model), flops_per_token(cfg.model, t_cfg.seq_len)
    if is_main_process():
        active = count_params(cfg.model, active=True)
        moe = f" ({active / 1e6:,.2f}M active per token)" if active != n_params else ""
        print(f"model: {n_params / 1e6:,.2f}M parameters ({n_params:,}){moe}, {fpt / 1e9:.4g} GFLOP/token (train, "
              f"seq {t_cfg.seq_len}), device {device}")
    if Path(t_cfg.out_dir).exists() and not Path(t_cfg.out_dir).is_dir():
        raise ValueError(f"train.out_dir={t_cfg.out_dir} is a file, not a directory; choose another --train.out_dir")
    if t_cfg.init_from:      # names and shapes against the model, from the files' headers
        hf.check_folder(t_cfg.init_from, model_config(cfg))
    latest = checkpoint.latest(t_cfg.out_dir)
    if latest is not None and not t_cfg.resume:
        raise ValueError(f"{t_cfg.out_dir} already holds checkpoints (latest {latest.name}); pass --train.resume=true "
                         "to continue that run, or choose a new --train.out_dir (nothing was overwritten)")
    if latest is not None:    # a truncated or corrupted file, from lengths and headers; the checksums when loading
        checkpoint.check_intact(latest, checksummed=lambda meta: ())
    if cfg.eval.tasks:
        check_tasks(cfg.eval.tasks, launched_world_size())
    # What the most loaded rank holds between steps (the plan's count, instant) bounds its step's peak from
    # below. Well under the free memory it is enough; otherwise the step is simulated (nanomega.estimate:
    # the real step on fake tensors, ~20 s for llama3_8b), since activations, gathered parameters and the
    # update's transients come on top: 2.5-5x the held bytes for llama3_8b at sequence 8192. CPU ranks share one host.
    ranks = cfg.parallel.world_size if device.type == "cpu" else 1
    held = bytes_per_rank(cfg).total
    have = available_memory(device)
    if held * ranks > have:
        raise ValueError(f"training this model needs at least {held * ranks / 2**30:,.0f} GiB for parameters, "
                         f"gradients and optimizer state ({held / 2**30:,.1f} GiB per rank in this layout), but "
                         f"{device} has {have / 2**30:,.0f} GiB free; pick a smaller --config or shard it over more "
                         "devices (--parallel.dp_shard, --parallel.tp, --parallel.ep)")
    if held * ranks * SIMULATE_ABOVE < have:
        return
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:   # not simulated yet (nanomega.estimate says so)
        print(f"preflight: the plan holds {held / 2**30:,.1f} GiB per rank of {have / 2**30:,.1f} GiB; the step's "
              "peak is not simulated under parallel.pp or parallel.cp")
        return
    from nanomega.estimate import estimate, what_to_change
    result = estimate(cfg, ranks="0")
    need = result["peak_bytes"] * ranks * (1 + PEAK_MARGIN)
    if need > have:
        raise ValueError(f"a train step peaks at {result['peak_bytes'] / 2**30:,.1f} GiB per rank (simulated: "
                         f"python -m nanomega.estimate with these flags), {need / 2**30:,.1f} GiB with a "
                         f"{PEAK_MARGIN:.0%} margin, but {device} has {have / 2**30:,.1f} GiB free; "
                         + what_to_change(cfg, result))
