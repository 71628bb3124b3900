"""Memory and communication of the train step, per rank, simulated: the real step under FakeTensorMode
with torch's fake process group, in one CPU process, allocating nothing.

    python -m nanomega.sim.estimate --config=llama3_8b --parallel.dp_shard=8 --train.seq_len=8192 \\
        --train.activation_checkpointing=full --train.param_dtype=bfloat16 [--json] [--ranks=auto|all|0,7]
    python -m nanomega.sim.estimate --config=llama3_405b --parallel.pp=8 --parallel.tp=8 --parallel.dp_shard=2 ...

It builds what train.py's setup() builds (nanomega/parallel/setup.py: the mesh, each rank keeping its
shards, under pipeline parallel its stages only; the optimizer; make_step_fns) and runs one step of
train.py's loop (fns.grads, then fns.update) once per simulated rank, on fake tensors: shapes, dtypes and
storages are real, the data is not. (train.py's loop frees each step's gradients after its update, so the
next step starts from the held parameters and optimizer state alone: the first step's peak is every
step's.) Every collective and every point-to-point transfer completes at once on the fake process group
(torch.testing's FakeStore + backend "fake", whose send and recv return finished work): so pipeline
parallel runs its real runtime (parallel/pipeline.py walking its schedule's action list, each stage's
activations held from its F to its B or W, the receive buffers allocated as they are), and context
parallel's ring passes its K/V chunks as the real ring does.

What is counted is nanomega/sim/memory_tracker.py's: every storage an op creates, by category (parameters,
gradients, optimizer state, gathered parameters, activations, temporaries), and each collective's bytes
(point-to-point sends as "send").

The fake tensors are CPU tensors, but a simulated GPU run (--train.device auto or cuda) runs attention as the
GPU would: the fused SDPA kernel torch's CUDA dispatch picks, not the CPU's choice (the section "attention as the
simulated GPU runs it" below); --train.device=cpu simulates the CPU's kernels.

Limits: eager only (a compiled step saves and fuses differently); the allocator's rounding and
fragmentation, CUDA context, NCCL buffers and workspaces (but fused attention's backward's) are not counted
(the preflight leaves a margin).
Fake tensors carry no values, so where the step's shapes follow its data the simulator takes a stand-in:
- a mixture of experts routes as if balanced (every expert gets N * top_k / E tokens): expert parallel's
  all-to-all is sized so (parallel/experts.py, Exchange.balanced), and float8 experts slice their rows so;
- token dropping (model.capacity_factor > 0) keeps the capacity-bounded worst case, every expert full in
  every sequence (models/moe.py, kept_assignments): a real run keeps as many or fewer;
- context parallel's ring plans its blocks from the layout's positions, which are not data.
Simulated against measured gloo runs of the same small layouts (tests/test_estimate.py): within 10% for
DDP, FSDP, TP, EP (balanced and dropping), pp (1F1B), cp (both methods) and dense float8 (every recipe).
A pipeline's ranks are simulated one at a time, as the others: the bubble costs no memory, and a stage
waiting for its neighbour is not timed here (nanomega/sim/step_time.py's job).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from nanomega import optim
from nanomega.config import parse_args
from nanomega.models import init
from nanomega.parallel.context import kernels_of
from nanomega.parallel.mesh import MESH_DIMS, model_config, validate_layout
from nanomega.sim.fake_world import fake_world
from nanomega.sim.memory_tracker import CATEGORIES, HELD, MemoryTracker
from nanomega.train.step import make_step_fns, step_options

# ---------------------------------------------------------------- the step, as train.py runs it

def build(cfg, device: torch.device, tensors=contextlib.nullcontext):
    """train.py's setup(): (model_cfg, params, opt, par), on the process group already initialised.
    The mesh is built outside `tensors` (the fake mode): DeviceMesh reads its rank grid's values."""
    model_cfg = model_config(cfg)
    if cfg.parallel.world_size == 1:
        with tensors():
            params = init(model_cfg, cfg.train.seed, device)
        return model_cfg, params, optim.build(cfg.optim, cfg.train.steps), None
    from nanomega.parallel.setup import setup_parallel  # each shard allocated alone, as on an accelerator;
    return (model_cfg, *setup_parallel(cfg, model_cfg, device, tensors))   # under pp this rank's stages only


def track_step(cfg, tracker: MemoryTracker, device: torch.device, tensors=contextlib.nullcontext) -> dict:
    """Build the run and take one step of train.py's loop under `tracker`; `tensors` is the context the
    tensors are made in (FakeTensorMode to simulate, nothing to measure a real run). Simulated, attention
    runs as the simulated device's kernels run it (simulated_kernels)."""
    built = list(build(cfg, device, tensors))
    with tensors():
        with simulated_kernels(cfg):
            return _track_steps(cfg, tracker, device, built)


def _track_steps(cfg, tracker, device, built: list) -> dict:
    t = cfg.train
    (model_cfg, params, opt, par), built[:] = built, []    # the loop's references only: the update frees them
    state = opt.init(params)
    tracker.label(params, "parameters")
    tracker.label(state, "optimizer_state")
    fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(t), "compile": False})   # eager: see the module doc
    gen = torch.Generator().manual_seed(t.seed)
    with tracker:
        micro = []
        for _ in range(t.grad_accum):
            tokens = torch.randint(0, cfg.model.vocab_size, (t.batch_size, t.seq_len + 1), generator=gen)
            micro.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))
        with tracker.in_phase("forward_backward"):
            loss, grads, stats = fns.grads(params, micro)
        tracker.label(grads, "gradients")
        with tracker.in_phase("update"):
            params, state = fns.update(grads, state, params, stats)
        tracker.label(params, "parameters")
        tracker.label(state, "optimizer_state")
        held = {k: tracker.current[k] for k in HELD}   # what the optimizer received and keeps
        del loss, micro, tokens, grads     # as train.py's loop does after the update
    return {**tracker.result(), "held_after": held}


# ---------------------------------------------------------------- attention as the simulated GPU runs it
# The simulation's fake tensors live on the CPU (a fake "cuda" tensor aborts autograd in a CPU-only build), so
# F.scaled_dot_product_attention would take the CPU's kernel choice: its flash kernel where q, k and v have one
# head dim, else the math path, which holds the [B, H, Tq, Tk] scores, their softmax and its gradient in fp32
# (MLA: qk 192 against v 128). A run on a GPU takes a fused kernel that keeps the output and an fp32 logsumexp
# per query and head for the backward instead. Where the simulated run is a GPU's, SDPA is routed to the kernel
# torch's CUDA dispatch would pick (cuda_sdpa_kernel) and that kernel's own op is called: its fake kernel makes
# what the real one returns and autograd saves, and its backward's workspace is memory_tracker's
# attention_workspace.

SIMULATED_SM = (9, 0)     # H100 and H200, the GPUs this repository's plans and tables are for


def simulated_device(cfg) -> str:
    """The device whose kernels a simulation charges: "cpu" for --train.device=cpu, "cuda" otherwise ("auto"
    stands for the accelerator a simulated plan is for)."""
    return "cpu" if cfg.train.device.split(":")[0] == "cpu" else "cuda"


def cuda_sdpa_kernel(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                     enable_gqa: bool = False, sm: tuple[int, int] = SIMULATED_SM, cudnn_first: bool = False) -> str:
    """"flash", "efficient", "cudnn" or "math": what torch's SDPA picks on a GPU of compute capability `sm` for
    these dense inputs (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, select_sdp_backend; its rules for
    sm >= 8.0, where every kernel's hardware range holds). Order:
    FlashAttention-2, then the memory-efficient kernel, then math; cuDNN's kernel first where torch prefers it
    (sm 9.0/10.x with a cuDNN newer than 9.15, which the simulator cannot know: cudnn_first). cuDNN and flash
    hold the same bytes (the output and an fp32 logsumexp [B, H, Tq]); the memory-efficient kernel pads its
    logsumexp to 32 queries."""
    if not (q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == k.shape[0] == v.shape[0]
            and min(q.shape[2], k.shape[2]) > 0 and all(_local(t).stride(-1) == 1 for t in (q, k, v))):
        return "math"
    if not (q.shape[1] == k.shape[1] == v.shape[1]
            or (enable_gqa and q.shape[1] % k.shape[1] == 0 and q.shape[1] % v.shape[1] == 0)):
        return "math"
    dq, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    flash = (half and attn_mask is None and sm >= (8, 0) and dq == dk == dv <= 256
             and not (is_causal and q.shape[2] != k.shape[2])
             # its backward fails for head dims in (192, 224] on sm 8.6-8.9 and 12.x
             and not (grad and ((8, 6) <= sm <= (8, 9) or sm >= (12, 0))
                      and 192 < dq <= (256 if dropout_p else 224)))
    align = 8 if half else 4     # the CUTLASS kernel's GEMM alignment, in elements (sm >= 8.0)
    efficient = (q.dtype in (torch.float16, torch.bfloat16, torch.float32) and dq == dk and dq % align == 0
                 and dv % align == 0 and all(_local(t).storage_offset() % align == 0 for t in (q, k, v)))
    # cuDNN on sm 9.0: head dims up to 128, or qk 192 with v 128 (DeepSeek's MLA), multiples of 8; not deterministic
    cudnn = (half and sm >= (8, 0) and (max(dq, dv) <= 128 or (sm[0] in (9, 10) and (dq, dv) == (192, 128)))
             and dq % 8 == 0 and dv % 8 == 0 and k.shape[2] != 1 and not torch.are_deterministic_algorithms_enabled())
    usable = {"cudnn": cudnn, "flash": flash, "efficient": efficient}
    order = ["cudnn", "flash", "efficient"] if cudnn_first and sm[0] in (9, 10) else ["flash", "efficient"]
    return next((name for name in order if usable[name]), "math")


def cuda_attention(q, k, v, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention as torch's CUDA dispatch runs it (aten/src/ATen/native/transformers/
    attention.cpp): under CUDA's autocast in its low precision, a boolean mask made additive, then the kernel
    cuda_sdpa_kernel picks, through its own op."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        q, k, v = (t.to(low) if t.is_floating_point() else t for t in (q, k, v))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    kernel = cuda_sdpa_kernel(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool and kernel != "math":
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, -torch.inf)
    aten = torch.ops.aten
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))    # kept for a backward only
    with torch.autocast(device, enabled=False):
        if kernel == "flash":
            d = q.shape[-1]     # head dims padded to a multiple of 8 (copies), the output cut back
            if d % 8:
                scale = d ** -0.5 if scale is None else scale
                q, k, v = (torch.nn.functional.pad(t, (0, -d % 8)) for t in (q, k, v))
            y = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            return y[..., :d] if d % 8 else y
        if kernel == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(q, k, v, attn_mask, lse, dropout_p, is_causal, False,
                                                            scale=scale)[0]
        if kernel == "efficient":
            if q.shape[1] != k.shape[1]:    # key heads repeated for the query heads they serve (a stand-in: the
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))   # fake backward has no GQA)
            if attn_mask is not None:
                attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, lse, dropout_p, is_causal,
                                                                scale=scale)[0]
        return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale,
                                                       enable_gqa=enable_gqa)[0]


@contextlib.contextmanager
def cuda_sdpa():
    """Within it, F.scaled_dot_product_attention is cuda_attention, and context parallel's attention blocks run
    CUDA's fused kernels (parallel/context.py, kernels_of). The function itself is replaced, for this
    context only: a TorchFunctionMode would be the tidier hook, but autograd does not carry function modes into
    the backward, where activation recomputation runs attention again (the CPU's kernel would be recomputed
    then: another op, and checkpoint refuses the mismatch)."""
    functional = torch.nn.functional
    original, functional.scaled_dot_product_attention = functional.scaled_dot_product_attention, cuda_attention
    try:
        with kernels_of("cuda"):
            yield
    finally:
        functional.scaled_dot_product_attention = original


def simulated_kernels(cfg):
    """cuda_sdpa where fake tensors stand for a GPU run (simulated_device); nothing on real tensors or for a
    CPU run, whose SDPA is the CPU's own."""
    from torch._guards import active_fake_mode
    if active_fake_mode() is None or simulated_device(cfg) != "cuda":
        return contextlib.nullcontext()
    return cuda_sdpa()


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t._local_tensor if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- simulation

def simulate_rank(cfg, rank: int = 0) -> dict:
    """The tracker's result for `rank` of the layout, on fake tensors (nothing is allocated)."""
    if dist.is_initialized():
        raise RuntimeError("nanomega.sim.estimate simulates in a process without a process group; run it with python, "
                           "not torchrun")
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_world(cfg.parallel.world_size, rank):
        try:
            return track_step(cfg, MemoryTracker(), torch.device("cpu"), lambda: fake)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            # fake tensors hold no values: a step whose shapes follow its data cannot be simulated
            raise ValueError(f"this step reads tensor values to choose shapes ({err.func}), which fake tensors "
                             "do not have, so it cannot be simulated; the plan's per-rank parameter, gradient "
                             "and state bytes (parallel/memory.py) do not need them") from None


def _in_child(fn, *args):
    """fn(*args) in a forked process: torch keeps process-wide state per process group (device meshes,
    flattened sub-meshes by name) that a second process group in the same process would find stale."""
    return _start_child(fn, *args)()


def _start_child(fn, *args):
    """Start fn(*args) in a forked process (see _in_child); returns the function that waits for its result,
    so several ranks can be simulated at once (nanomega/sim/contracts.py)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", fn(*args)))
        except ValueError as err:
            send.send(("value", str(err)))
        except BaseException as err:   # noqa: BLE001  (reported by the parent)
            import traceback
            send.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        finally:
            send.close()

    proc = ctx.Process(target=child)
    proc.start()
    send.close()

    def result():
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = "error", f"the simulation process died (exit code {proc.join() or proc.exitcode})"
        proc.join()
        if status == "value":
            raise ValueError(value)
        if status == "error":
            raise RuntimeError(f"simulating rank {args[1]}: {value}")
        return value
    return result


def role_ranks(cfg, which: str = "auto") -> list[int]:
    """The ranks to simulate: "all", a comma-separated list, or "auto": the first and the last index on every
    mesh dim (DTensor gives the first ranks of an uneven split the larger chunks, the last the smaller; tp ranks
    hold different vocabulary rows), and under pipeline parallel the first rank of every stage (each holds other
    layers, and the schedule keeps a different number of micro-batches in flight on each)."""
    p = cfg.parallel
    sizes = [getattr(p, d) for d in MESH_DIMS]
    if which == "all":
        return list(range(p.world_size))
    if which != "auto":
        ranks = sorted({int(r) for r in which.split(",")})
        if any(not 0 <= r < p.world_size for r in ranks):
            raise ValueError(f"--ranks={which}: every rank must be in [0, {p.world_size - 1}]")
        return ranks

    def rank_at(coords):    # the mesh is row-major over MESH_DIMS
        r = 0
        for c, size in zip(coords, sizes):
            r = r * size + c
        return r
    ranks = {rank_at([stage] + [0] * (len(sizes) - 1)) for stage in range(p.pp)}
    for corner in range(2 ** len(sizes)):
        ranks.add(rank_at([(size - 1) * ((corner >> i) & 1) for i, size in enumerate(sizes)]))
    return sorted(ranks)


def estimate(cfg, ranks: str = "auto") -> dict:
    """Simulate every rank of role_ranks(cfg, ranks); the largest peak and its split on top."""
    validate_layout(cfg, cfg.parallel.world_size)
    chosen = role_ranks(cfg, ranks)
    if cfg.parallel.world_size == 1:    # no process group: nothing stays behind in this process
        per_rank = {chosen[0]: simulate_rank(cfg, chosen[0])}
    else:
        per_rank = {r: _in_child(simulate_rank, cfg, r) for r in chosen}
    top = max(per_rank, key=lambda r: per_rank[r]["peak_bytes"])
    from nanomega.sim.counting import count_params
    return {"world_size": cfg.parallel.world_size, "n_params": count_params(model_config(cfg)),
            "peak_rank": top, "peak_bytes": per_rank[top]["peak_bytes"], "by_category": per_rank[top]["by_category"],
            "collectives": per_rank[top]["collectives"],
            "collectives_by_phase": per_rank[top].get("collectives_by_phase", {}), "ranks": per_rank}


GiB = 2 ** 30


def what_to_change(cfg, result: dict) -> str:
    """The settings that shrink the largest parts of the simulated peak, largest first."""
    split, p, t = result["by_category"], cfg.parallel, cfg.train
    held = split["parameters"] + split["gradients"] + split["optimizer_state"]
    advice = {
        "held": (held, f"shard parameters, gradients and optimizer state over more ranks "
                       f"(--parallel.dp_shard={p.dp_shard * 2}: {held / GiB:,.1f} GiB of the peak)"),
        "activations": (split["activations"] + split["temporary"],
                        ("recompute activations (--train.activation_checkpointing=full: "
                         if t.activation_checkpointing == "none" else "a smaller micro-batch (")
                        + f"activations and temporaries are {(split['activations'] + split['temporary']) / GiB:,.1f} "
                        f"GiB of the peak)"),
        "batch": (split["activations"],
                  f"a smaller micro-batch (--train.batch_size={t.batch_size // 2} with --train.grad_accum="
                  f"{t.grad_accum * 2} keeps the tokens per step)" if t.batch_size // 2 % p.dp == 0 and t.batch_size > p.dp
                  else f"shorter sequences (--train.seq_len={t.seq_len // 2}; the micro-batch is already one "
                       f"sequence per data-parallel rank)"),
        "gathered": (split["gathered_parameters"], f"bf16 gathers (--train.param_dtype=bfloat16: gathered parameters "
                                                   f"are {split['gathered_parameters'] / GiB:,.1f} GiB)"),
    }
    if t.param_dtype != "float32" or p.dp_shard == 1:   # only FSDP's gathers follow param_dtype
        advice.pop("gathered")
    order = sorted(advice.values(), key=lambda a: -a[0])
    return "try " + "; or ".join(text for size, text in order if size > 0) + "; or pick a smaller --config"




def describe(result: dict) -> str:
    lines = [f"{result['n_params'] / 1e9:.3f}B parameters, {result['world_size']} rank(s); peak "
             f"{result['peak_bytes'] / GiB:.2f} GiB on rank {result['peak_rank']}"]
    head = "rank | peak GiB (phase) | " + " | ".join(CATEGORIES)
    lines += [head, "-" * len(head)]
    for r, res in result["ranks"].items():
        lines.append(f"{r} | {res['peak_bytes'] / GiB:.2f} ({res['peak_phase']}) | "
                     + " | ".join(f"{res['by_category'][c] / GiB:.2f}" for c in CATEGORIES))
    comm = result["collectives"]
    if comm:
        lines.append(f"collectives per step on rank {result['peak_rank']} (bytes sent, ring algorithms): "
                     + ", ".join(f"{k} {v['count']}x {v['bytes_sent'] / GiB:.3f} GiB" for k, v in sorted(comm.items())))
    schedule = [e for e in result["ranks"][result["peak_rank"]].get("schedule", []) if e["phase"] != "update"]
    if schedule:   # memory_tracker's schedule: what each collective of forward and backward can overlap
        kinds = sorted({e["kind"] for e in schedule})
        lines.append("forward + backward, launched ahead of their first use (>= 1 matmul, attention or embedding "
                     "between launch and wait) / all: " + ", ".join(
                         f"{k} {sum(bool(e['compute']) for e in schedule if e['kind'] == k)}/"
                         f"{sum(e['kind'] == k for e in schedule)}" for k in kinds))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    want_json, ranks, rest = False, "auto", []
    for a in argv:
        if a == "--json":
            want_json = True
        elif a.startswith("--ranks="):
            ranks = a.split("=", 1)[1]
        else:
            rest.append(a)
    try:
        cfg = parse_args(rest)
        start = time.perf_counter()
        result = estimate(cfg, ranks)
    except ValueError as err:
        sys.exit(f"error: {err}")
    result["seconds"] = round(time.perf_counter() - start, 2)
    if want_json:
        print(json.dumps({**result, "ranks": {str(k): v for k, v in result["ranks"].items()}}))
    else:
        print(describe(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
