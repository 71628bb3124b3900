"""The device mesh: `ParallelConfig` -> a named `DeviceMesh`, and the rules a layout must obey.

    dp_replicate x dp_shard x tp        (tp innermost: tensor-parallel ranks are neighbours, as in Megatron)

Only dimensions larger than 1 are built, so a collective is never issued over a group of one.
Every rule is checked by `validate_layout` (called from Config.validate) before any process group,
parameter or batch exists, and says what to change.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.distributed as dist

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_layout(cfg, world_size: int | None = None) -> None:
    """Raise ValueError naming the setting to change if cfg.parallel cannot run cfg.model / cfg.train."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    for key in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "cp"):
        if getattr(p, key) < 1:
            raise ValueError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    for key in ("ep", "pp", "cp"):
        if getattr(p, key) != 1:
            raise ValueError(f"parallel.{key}={getattr(p, key)} is reserved for a later release; set it to 1")
    if p.muon_tp not in ("duplicated", "distributed"):
        raise ValueError(f"parallel.muon_tp={p.muon_tp!r} is not one of ('duplicated', 'distributed')")
    if p.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"parallel.backend={p.backend!r} is not one of ('auto', 'gloo', 'nccl')")
    if world_size is not None and p.world_size != world_size:
        raise ValueError(f"parallel.dp_replicate * dp_shard * tp = {p.dp_replicate} * {p.dp_shard} * {p.tp} = "
                         f"{p.world_size}, but {world_size} processes were started; launch "
                         f"`torchrun --nproc-per-node {p.world_size} train.py ...` or change the sizes")
    if p.tp > 1:
        common = math.gcd(m.n_heads, m.kv_heads, m.hidden_dim)
        for key, value in (("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads), ("ffn_dim", m.hidden_dim)):
            if value % p.tp:
                raise ValueError(f"parallel.tp={p.tp} does not divide model.{key}={value} (tensor parallel splits "
                                 f"it across ranks); choose tp in {_divisors(common)}")
    if p.sequence_parallel:
        if p.tp == 1:
            raise ValueError("parallel.sequence_parallel=true shards the sequence over the tensor-parallel ranks; "
                             "it needs parallel.tp > 1")
        if t.seq_len % p.tp:
            raise ValueError(f"parallel.sequence_parallel needs train.seq_len={t.seq_len} divisible by "
                             f"parallel.tp={p.tp}")
    if t.batch_size % p.dp:
        raise ValueError(f"train.batch_size={t.batch_size} (the global micro-batch) does not split over "
                         f"dp_replicate * dp_shard = {p.dp} data-parallel ranks; use a multiple of {p.dp}")
    if p.distributed_optimizer and p.dp_replicate == 1:
        raise ValueError("parallel.distributed_optimizer=true shards optimizer state over the replicated data-"
                         "parallel ranks; it needs parallel.dp_replicate > 1 (dp_shard already shards the state)")
    if p.muon_tp == "distributed" and (p.dp_shard > 1 or p.distributed_optimizer):
        raise ValueError("parallel.muon_tp=distributed runs Newton-Schulz on tensor-parallel shards of replicated "
                         "optimizer state; with dp_shard > 1 or distributed_optimizer, use muon_tp=duplicated")


def model_config(cfg):
    """cfg.model with its vocabulary padded to a multiple of tp, so the vocab-parallel embedding divides."""
    m, tp = cfg.model, cfg.parallel.tp
    multiple = m.vocab_multiple * tp // math.gcd(m.vocab_multiple, tp)
    return m if multiple == m.vocab_multiple else dataclasses.replace(m, vocab_multiple=multiple)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg, device_type: str) -> None:
    """Join the process group torchrun set up (env:// rendezvous), once per process."""
    if dist.is_initialized():
        return
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def build_mesh(cfg, device_type: str):
    """The named DeviceMesh of the dims larger than 1, or None for a single process."""
    from torch.distributed.device_mesh import init_device_mesh
    p = cfg.parallel
    sizes = {name: getattr(p, name) for name in MESH_DIMS if getattr(p, name) > 1}
    if not sizes:
        return None
    return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))
