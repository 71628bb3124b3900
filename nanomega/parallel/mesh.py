"""The device mesh: `ParallelConfig` -> a named `DeviceMesh`, and the rules a layout must obey.

    pp x dp_replicate x dp_shard x cp x tp   (tp innermost: tensor-parallel ranks are neighbours, as in
                                             Megatron and torchtitan; pp outermost: a stage's ranks are
                                             a contiguous block)

A pipeline stage runs on the sub-mesh of the other dims at its pp coordinate (`stage_mesh`): DTensor
placements never mention pp, since a stage's parameters exist on its own ranks only.

Experts live on a second mesh over the same ranks (Megatron's "parallel folding"): expert parallel
takes ep of the ranks that hold *different tokens* — the data-parallel ranks, and the tensor-parallel
ones too under sequence parallel — and the rest replicate the experts:

    edp x ep            (sequence parallel, or tp = 1: every rank routes its own tokens)
    edp x ep x etp      (tp > 1 without sequence parallel: tp ranks hold the same tokens and split
                         each expert's hidden units: expert tensor parallel, etp = tp; under FSDP they
                         duplicate the expert work instead)

Only dimensions larger than 1 are built, so a collective is never issued over a group of one.
Every rule is checked by `validate_layout`, and says what to change: by nanomega/run/preflight.py before
any data, process group, parameter or batch exists, and again by `build_mesh` for callers that build
a mesh without it.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from nanomega import optim
from nanomega.models.mlp import expert_dim, hidden_dim

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DP_DIMS = ("dp_replicate", "dp_shard")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_layout(cfg, world_size: int | None = None) -> None:
    """Raise ValueError naming the setting to change if cfg.parallel cannot run cfg.model / cfg.train."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    own = optim.check(cfg.optim)     # the optimizer's name and own settings (optim/registry.py)
    for key in ("dp_replicate", "dp_shard", "tp", "ep", "pp", "pp_virtual", "cp"):
        if getattr(p, key) < 1:
            raise ValueError(f"parallel.{key} must be >= 1, got {getattr(p, key)}")
    validate_pipeline(cfg)
    validate_context(cfg)
    validate_fp8(cfg)
    if p.muon_tp not in ("duplicated", "distributed"):
        raise ValueError(f"parallel.muon_tp={p.muon_tp!r} is not one of ('duplicated', 'distributed')")
    if world_size is not None and p.world_size != world_size:
        raise ValueError(f"parallel.pp * dp_replicate * dp_shard * cp * tp = {p.pp} * {p.dp_replicate} * "
                         f"{p.dp_shard} * {p.cp} * {p.tp} = {p.world_size}, but {world_size} processes were started; "
                         f"launch `torchrun --nproc-per-node {p.world_size} train.py ...` or change the sizes")
    common = math.gcd(m.n_heads, m.kv_heads, hidden_dim(m))
    if p.tp > 1:
        for key, value in (("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads), ("ffn_dim", hidden_dim(m))):
            if value % p.tp:
                raise ValueError(f"parallel.tp={p.tp} does not divide model.{key}={value} (tensor parallel splits "
                                 f"it across ranks); choose tp in {divisors(common)}")
    if expert_tensor_parallel(cfg):
        f = expert_dim(m)
        if f % p.tp:
            raise ValueError(f"parallel.tp={p.tp} splits each expert's hidden units (expert tensor parallel: tp > 1 "
                             f"without sequence parallel) and does not divide model.expert_ffn_dim={f}; choose tp "
                             f"in {divisors(math.gcd(common, f))} or set parallel.sequence_parallel=true")
        if (f // p.tp) % 8 and t.device != "cpu":
            raise ValueError(f"model.expert_ffn_dim={f} / parallel.tp={p.tp} = {f // p.tp} hidden units per rank: the "
                             "grouped GEMM needs rows of 16 bytes (a multiple of 8 in bf16); choose an "
                             "expert_ffn_dim that is a multiple of 8 * tp, or set parallel.sequence_parallel=true")
    if p.sequence_parallel and p.tp == 1:
        raise ValueError("parallel.sequence_parallel=true shards the sequence over the tensor-parallel ranks; "
                         "it needs parallel.tp > 1")
    if p.ep > 1:
        token_ranks = p.dp * p.cp * (p.tp if p.sequence_parallel else 1)
        if not m.n_experts:
            raise ValueError(f"parallel.ep={p.ep} splits experts, but the model has none (model.n_experts=0)")
        if m.n_experts % p.ep:
            raise ValueError(f"parallel.ep={p.ep} does not divide model.n_experts={m.n_experts}; choose ep in "
                             f"{[d for d in divisors(m.n_experts) if token_ranks % d == 0]}")
        if token_ranks % p.ep:
            where = "dp_replicate * dp_shard" + (" * cp" if p.cp > 1 else "") + (" * tp" if p.sequence_parallel else "")
            raise ValueError(f"parallel.ep={p.ep} must divide the {token_ranks} ranks that hold different tokens "
                             f"({where}; experts are folded onto them); choose ep in {divisors(token_ranks)}"
                             + ("" if p.sequence_parallel or p.tp == 1 else
                                ", or set parallel.sequence_parallel=true to fold ep onto tp too"))
    for splits, what, off in ((p.cp > 1, "context parallel", "parallel.cp=1"),
                              (p.sequence_parallel, "sequence parallel", "parallel.sequence_parallel=false")):
        if m.n_experts and m.capacity_factor and splits:
            raise ValueError(f"token dropping decides per sequence (model.capacity_factor > 0), and {what} splits "
                             f"sequences over ranks; use dropless routing (model.capacity_factor=0) or {off}")
    if t.batch_size % p.dp:
        raise ValueError(f"train.batch_size={t.batch_size} (the global micro-batch) does not split over "
                         f"dp_replicate * dp_shard = {p.dp} data-parallel ranks; use a multiple of {p.dp}")
    if p.distributed_optimizer and p.dp_replicate == 1:
        raise ValueError("parallel.distributed_optimizer=true shards optimizer state over the replicated data-"
                         "parallel ranks; it needs parallel.dp_replicate > 1 (dp_shard already shards the state)")
    if p.muon_tp == "distributed" and getattr(own, "normuon_beta2", 0.0) and p.tp > 1:
        raise ValueError("optim.normuon_beta2 > 0 normalises whole rows of Muon's update, and parallel.muon_tp="
                         "distributed keeps them split over tp; use parallel.muon_tp=duplicated")
    if p.muon_tp == "distributed" and (p.dp_shard > 1 or p.distributed_optimizer):
        raise ValueError("parallel.muon_tp=distributed runs Newton-Schulz on tensor-parallel shards of replicated "
                         "optimizer state; with dp_shard > 1 or distributed_optimizer, use muon_tp=duplicated")


def expert_tensor_parallel(cfg) -> bool:
    """Whether tp splits each expert's hidden units (plan.expert_layout): tp > 1 without sequence parallel (the tp
    ranks hold the same tokens), on an MoE model whose experts FSDP does not split (dp_shard = 1)."""
    p = cfg.parallel
    return bool(cfg.model.n_experts) and p.tp > 1 and not p.sequence_parallel and p.dp_shard == 1


def validate_pipeline(cfg) -> None:
    """parallel.pp and its settings against the model and the micro-batches (train.grad_accum)."""
    from nanomega.parallel import schedules
    p, m = cfg.parallel, cfg.model
    if p.pp == 1:
        if p.pp_virtual != 1 or p.pp_layers:
            raise ValueError("parallel.pp_virtual and parallel.pp_layers split pipeline stages; they need "
                             "parallel.pp > 1")
        return
    if p.pp_schedule not in schedules.SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={p.pp_schedule!r} is not one of {tuple(schedules.SCHEDULES)}")
    if p.pp_schedule == "zb_v" and p.pp_virtual != 2:
        raise ValueError(f"parallel.pp_schedule=zb_v holds two stages per rank (a V); set parallel.pp_virtual=2 "
                         f"(got {p.pp_virtual})")
    if p.pp_schedule in ("gpipe", "1f1b") and p.pp_virtual != 1:
        raise ValueError(f"parallel.pp_schedule={p.pp_schedule} runs one stage per rank; set parallel.pp_virtual=1 "
                         "or use pp_schedule=interleaved_1f1b")
    stages_layers(cfg)     # raises if the layers do not split
    schedules.SCHEDULES[p.pp_schedule](p.pp, cfg.train.grad_accum, *([p.pp_virtual] if p.pp_schedule ==
                                                                    "interleaved_1f1b" else []))
    if m.tie_embeddings:
        raise ValueError("parallel.pp > 1 puts the embedding on the first stage and the head on the last; "
                         "model.tie_embeddings=true would share one matrix between them: set it to false")


def validate_fp8(cfg) -> None:
    """model.fp8 against the model's layer widths as each rank holds them (blockwise tiles are 128 wide and
    must not straddle tensor-parallel shards)."""
    if cfg.model.fp8 == "none":
        return
    from nanomega.models import init
    from nanomega.models.fp8 import is_fp8_linear, refusal
    from nanomega.parallel.plan import expert_tp_dim, is_expert, tp_dim
    from nanomega.tree import named_leaves
    m, tp = model_config(cfg), cfg.parallel.tp
    for name, p in named_leaves(init(m, device="meta")).items():
        block = int(name.split(".")[1]) if name.startswith("layers.") else -1
        if not is_fp8_linear(name) or m.block_config(block).fp8 == "none":
            continue
        shape = list(p.shape[-2:])                  # an expert's [E, N, K]: each expert's matrix
        if is_expert(name):   # split on the hidden dim under expert tensor parallel (each expert's [N, K]: dim - 1)
            split = expert_tp_dim(name) - 1 if expert_tensor_parallel(cfg) else None
        else:
            split = tp_dim(name) if tp > 1 else None
        if split is not None:
            shape[split] //= tp
        if message := refusal(m.fp8, name, shape):
            raise ValueError(message)


def stages_layers(cfg) -> list[int]:
    """Blocks per virtual stage (pp * pp_virtual of them): parallel.pp_layers, or as even as possible with
    the first stages taking one more (the last stage also carries the head)."""
    p, n = cfg.parallel, cfg.model.n_layers
    stages = p.pp * p.pp_virtual
    if p.pp_layers:
        if len(p.pp_layers) != stages or sum(p.pp_layers) != n or min(p.pp_layers) < 1:
            raise ValueError(f"parallel.pp_layers={','.join(map(str, p.pp_layers))} must give {stages} stages "
                             f"(pp * pp_virtual = {p.pp} * {p.pp_virtual}) at least one block each, summing to "
                             f"model.n_layers={n}")
        return list(p.pp_layers)
    if n < stages:
        raise ValueError(f"model.n_layers={n} cannot split into pp * pp_virtual = {p.pp} * {p.pp_virtual} = {stages} "
                         f"stages of at least one block; lower parallel.pp or parallel.pp_virtual")
    return [n // stages + (s < n % stages) for s in range(stages)]


PP_HEAD = ("final_norm", "lm_head")           # parameters on the last pipeline stage
PP_EMBEDDING = ("tok_embed", "pos_embed")     # parameters on the first


def stage_of(name: str, sizes: list[int]) -> int:
    """The pipeline stage (of len(sizes), sizes = stages_layers(cfg)) that holds parameter `name`: the embedding
    on the first, the final norm and head on the last, block i on the stage whose blocks include it."""
    top = name.split(".")[0]
    if top in PP_EMBEDDING:
        return 0
    if top in PP_HEAD:
        return len(sizes) - 1
    block, start = int(name.split(".")[1]), 0
    for s, n in enumerate(sizes):
        if start <= block < start + n:
            return s
        start += n
    raise ValueError(f"{name}: block {block} is beyond the {sum(sizes)} blocks of the stages")


def validate_context(cfg) -> None:
    """parallel.cp, and the sequence split over cp and over tp under sequence parallel (sequence_multiple)."""
    from nanomega.parallel.context import METHODS
    p, t = cfg.parallel, cfg.train
    if p.cp_method not in METHODS:
        raise ValueError(f"parallel.cp_method={p.cp_method!r} is not one of {METHODS}")
    split = sequence_multiple(cfg)
    if t.seq_len % split:
        factors = ["2", "parallel.cp"] * (p.cp > 1) + ["parallel.tp"] * p.sequence_parallel
        why = " (load-balanced causal sharding gives each cp rank two chunks)" if p.cp > 1 else ""
        raise ValueError(f"train.seq_len={t.seq_len} is not divisible by {' * '.join(factors)} = {split}{why}; "
                         f"use a multiple of {split}")


def sequence_multiple(cfg) -> int:
    """What the layout needs the sequence length to be a multiple of: 2 * cp chunks (context parallel's
    load balance), each split again over tp under sequence parallel."""
    p = cfg.parallel
    sp = p.tp if p.sequence_parallel else 1
    return 2 * p.cp * sp if p.cp > 1 else sp


def model_config(cfg):
    """cfg.model as the run builds it: its vocabulary padded to a multiple of tp, so the vocab-parallel
    embedding divides."""
    m, tp = cfg.model, cfg.parallel.tp
    multiple = math.lcm(m.vocab_multiple, tp)
    return dataclasses.replace(m, vocab_multiple=multiple) if multiple != m.vocab_multiple else m


def pick_device(name: str | torch.device) -> torch.device:
    """The device this process trains on. A GPU without an index is GPU LOCAL_RANK (torchrun's; 0 alone),
    so each rank's first CUDA call (the preflight's memory query) opens a context on its own GPU only,
    never on GPU 0, long before init_distributed makes it the current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"   # no CUDA context: the driver's device count only
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device) -> None:
    """Join the process group torchrun set up (env:// rendezvous), once per process, on `device` (this
    rank's torch.device, or a device type: pick_device's). On a GPU it becomes the current device first,
    and NCCL is bound to it (device_id): every later bare "cuda" (the device mesh, barriers) means this
    rank's GPU, and no rank opens a context or a communicator on another's."""
    if dist.is_initialized():
        return
    device = pick_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # inductor's on-disk graph caches are keyed without the rank: on one machine a rank would load a graph
    # another rank compiled, with that rank's process-group names and slices baked in (docs/parallelism.md,
    # "Context parallel"). One cache directory per rank, under the one set (importing dynamo sets it).
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{os.environ.get('RANK', '0')}")
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)


def create_groups(mesh) -> None:
    """Every process group `group_over` can hand out on `mesh`: one flattened mesh per set of two or more of
    its dims, in one fixed order. Creating a group is a collective over every rank of the job (on NCCL a
    rank that creates one alone, or later than the others, hangs them all), so every rank calls this at
    setup, in the same order, before any step: a pipeline stage that alone reaches a collective mid-step
    (the loss on the last stage, an fp8 amax) then finds its group made."""
    if mesh is None:
        return
    names = mesh.mesh_dim_names
    for size in range(2, len(names) + 1):
        for dims in itertools.combinations(names, size):
            mesh[dims]._flatten()


def group_over(mesh, dims: list[int]):
    """The process group of `mesh` spanning the mesh dims `dims` (indices), as functional collectives take
    it; made at setup by `create_groups` (never here: see there)."""
    if len(dims) == 1:
        return (mesh, dims[0])
    name = "_".join(mesh.mesh_dim_names[i] for i in dims)
    made = mesh._get_root_mesh()._flatten_mapping.get(name)
    if made is None:
        raise RuntimeError(f"the process group over mesh dims {name} was not created at setup; creating it "
                           "inside the step would hang NCCL (parallel/mesh.py create_groups)")
    return made


def expert_grid(cfg) -> tuple[tuple[str, ...], torch.Tensor]:
    """The expert mesh as data (module doc): its dim names and the grid of global ranks, dims of size 1
    left out (but at least one dim). Rank r of a stage's mesh holds token slice r // tp (data parallel,
    then context parallel: both hold other tokens) and tp rank r % tp. Under pipeline parallel the grid
    leads with pp: each stage folds its experts onto its own ranks (build_expert_mesh keeps this rank's)."""
    p = cfg.parallel
    stage = p.world_size // p.pp
    ranks = torch.arange(p.world_size)
    if p.sequence_parallel or p.tp == 1:
        grid, names = ranks.view(p.pp, stage // p.ep, p.ep), ("pp", "edp", "ep")
    else:
        grid, names = ranks.view(p.pp, p.dp * p.cp // p.ep, p.ep, p.tp), ("pp", "edp", "ep", "etp")
    keep = [i for i, size in enumerate(grid.shape) if size > 1] or [len(names) - 1]
    return tuple(names[i] for i in keep), grid.reshape([grid.shape[i] for i in keep])


class MeshShape(NamedTuple):
    """A mesh as the sharding plan reads it, without any process: its dim names and sizes (for reading
    per-rank checkpoints and counting per-rank memory in one process)."""
    mesh_dim_names: tuple
    shape: tuple

    def size(self, dim: int) -> int:
        return self.shape[dim]


def mesh_shapes(cfg) -> tuple[MeshShape, MeshShape | None]:
    """The shapes of the meshes build_mesh and build_expert_mesh would build (experts: None without one)."""
    p = cfg.parallel
    dims = tuple(d for d in MESH_DIMS if getattr(p, d) > 1)
    main = MeshShape(dims, tuple(getattr(p, d) for d in dims))
    if not cfg.model.n_experts or p.world_size == 1:
        return main, None
    names, grid = expert_grid(cfg)
    return main, MeshShape(names, tuple(grid.shape))


def build_expert_mesh(cfg, device_type: str):
    """The DeviceMesh the stacked expert weights live on, or None for a dense model or one process.
    Under pipeline parallel every rank builds the whole grid (creating process groups is collective) and
    keeps its stage's part."""
    from torch.distributed.device_mesh import DeviceMesh
    if not cfg.model.n_experts or cfg.parallel.world_size // cfg.parallel.pp == 1:
        return None
    names, grid = expert_grid(cfg)
    return stage_mesh(DeviceMesh(device_type, grid, mesh_dim_names=names))


def stage_mesh(mesh):
    """The sub-mesh of a pipeline stage: every dim but pp, at this rank's pp coordinate (None where pp
    is the only dim larger than 1: the stage is one process)."""
    if mesh is None or "pp" not in mesh.mesh_dim_names:
        return mesh
    rest = tuple(d for d in mesh.mesh_dim_names if d != "pp")
    return mesh[rest] if rest else None


def build_mesh(cfg, device_type: str):
    """The named DeviceMesh of the dims larger than 1, or None for a single process."""
    from torch.distributed.device_mesh import init_device_mesh
    validate_layout(cfg, launched_world_size())
    shape = mesh_shapes(cfg)[0]
    return init_device_mesh(device_type, shape.shape, mesh_dim_names=shape.mesh_dim_names) if shape.shape else None
