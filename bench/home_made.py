"""The home-made parts against torch's own: FSDP, the pipeline runtime and checkpoints, measured side by side.

    python bench/home_made.py                                   # ~5 min on 2 busy cores
    python bench/home_made.py --steps 2 --layers 2 --out /tmp/smoke          # smoke test (~1.5 min)

nanomega writes three things that torch 2.13 also ships: FSDP per unit (parallel/fsdp.py; torch: FSDP2's
`fully_shard`), the pipeline runtime (parallel/pipeline.py + schedules.py; torch: torch.distributed.pipelining)
and checkpoints (nanomega/checkpoint/; torch: torch.distributed.checkpoint, DCP). Whether to adopt torch's or
keep ours is argued from these measurements in each module's docstring. What runs, on 2 gloo processes
(torchrun), the same model and weights on both sides (a LLaMA-style model of --layers blocks, width --d-model):

  fsdp        one forward + backward (gradient pass, no update) under FSDP over the 2 ranks: nanomega's step
              (parallel/fsdp.py: per-unit gathers, prefetch one unit ahead) against fully_shard on an nn.Module
              whose units call the very same unit functions (models/transformer.py embed, block, head), one
              fully_shard per unit and one at the root, as torchtitan applies it; FSDP2 as it comes (implicit
              prefetch) and with explicit forward prefetch of the next block (set_modules_to_forward_prefetch);
              each without and with full recomputation (torch's checkpoint_wrapper around each block, applied
              before fully_shard, as torchtitan orders them); ours also without prefetch (Parallel.prefetching off);
              and, for reference, each side with no FSDP at all (each rank alone on its rows, plain tensors: the
              compute and autograd alone). Reported: median seconds per gradient pass over
              interleaved rounds; the peak of the pass above what was live before it (torch's MemTracker,
              which follows FSDP2's storage resizes, for both sides; nanomega's own tracker beside it); the
              collectives issued per pass by kind; and how many all-gathers were issued ahead, i.e. with at least
              one matmul, attention or embedding op run between their launch and the first op that reads their
              output (a gather read at once overlaps nothing). The two sides' gradient shards are compared too.
  fsdp_profile  where the fsdp part's time goes (its main cases, AC none, and the references), on each rank:
              per interleaved round one pass timed, wall and CPU time of the process (on a loaded machine the CPU
              time is the steadier: the wall also counts the time other processes held the cores), and one pass
              under torch.profiler, each op's self time summed by kind (DTensor's Python dispatch, collectives,
              fully_shard's hooks, copies, compute, autograd); and the unit costs that explain the difference:
              one DTensor op against the same op on plain tensors, and a block's all-gather and reduce-scatter by
              functional collectives (ours) against c10d's all_gather_single / reduce_scatter_single (fully_shard's).
  pipeline    one step of --micro micro-batches over 2 stages, 1F1B: nanomega's Pipeline (pure-function
              stages, schedules.p2p_program's batched transfers) against torch.distributed.pipelining's
              Schedule1F1B over PipelineStage nn.Modules made of the same units; median seconds per step and
              the loss of each (the same micro-batches: they must agree).
  checkpoint  the FSDP-sharded parameters of 2 ranks saved and loaded back: nanomega's save/load (per-rank
              safetensors by name) against DCP's dcp.save/dcp.load with its default FileSystemWriter and with
              Hugging Face safetensors storage (HuggingFaceStorageWriter): median seconds of a save, a load
              into the same layout and a load into whole tensors (resharding), each checked bitwise; files,
              bytes, and the collectives one save and one load issue (the fsdp part's counting mode).
  lines       lines of each implementation: all, and code (no blank, comment or docstring lines).

Results: <out>/home_made.json and .md (--render JSON writes the .md again).
"""
from __future__ import annotations

import argparse
import ast
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_io  # noqa: E402

MiB = 2 ** 20


# ---------------------------------------------------------------- lines of code

def code_lines(path: Path) -> tuple[int, int]:
    """(all lines, code lines: not blank, not only a comment, not inside a docstring) of one Python file."""
    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code.update(line for line in range(tok.start[0], tok.end[0] + 1) if line not in docstrings)
    return len(text.splitlines()), len(code)


def torch_files(*parts: str) -> list[Path]:
    import torch
    base = Path(torch.__file__).parent / "distributed"
    return [p for part in parts
            for p in sorted((base / part).glob("*.py") if (base / part).is_dir() else [base / part])]


IMPLEMENTATIONS = {   # component -> (nanomega's files, torch's files): what each side needs to do the job
    # nanomega's FSDP: the per-unit gathers and reduce-scatters, and the HSDP / gradient buckets (FSDP2 has both)
    "fsdp": (["nanomega/parallel/fsdp.py", "nanomega/parallel/packing.py", "nanomega/parallel/deferred.py",
              "nanomega/parallel/regather.py", "nanomega/parallel/buckets.py"], ("fsdp/_fully_shard",)),
    "pipeline runtime": (["nanomega/parallel/pipeline.py", "nanomega/parallel/schedules.py"],
                         ("pipelining/schedules.py", "pipelining/stage.py", "pipelining/_backward.py",
                          "pipelining/microbatch.py", "pipelining/_utils.py")),
    "checkpoint": (["nanomega/checkpoint/__init__.py", "nanomega/checkpoint/files.py", "nanomega/checkpoint/saving.py",
                    "nanomega/checkpoint/loading.py"], ("checkpoint",)),
}


def count_lines() -> dict:
    out = {}
    for name, (ours, theirs) in IMPLEMENTATIONS.items():
        mine = [code_lines(ROOT / f) for f in ours]
        torch_side = [code_lines(f) for f in torch_files(*theirs)]
        out[name] = {"nanomega_files": ours, "torch_paths": list(theirs),
                     "nanomega": [sum(a for a, _ in mine), sum(c for _, c in mine)],
                     "torch": [sum(a for a, _ in torch_side), sum(c for _, c in torch_side)],
                     "torch_files": len(torch_side)}
    return out


# ---------------------------------------------------------------- the workers (under torchrun)

def model_args(a, extra=()) -> list[str]:
    return [f"--model.d_model={a.d_model}", f"--model.n_layers={a.layers}", "--model.n_heads=8", "--model.n_kv_heads=4",
            f"--model.ffn_dim={4 * a.d_model}", f"--model.max_seq_len={a.seq}", f"--train.seq_len={a.seq}",
            f"--train.batch_size={a.batch}", "--train.device=cpu", "--train.compile=false", "--optim.name=sgd",
            "--optim.momentum=0", *extra]


def unit_modules(params: dict, model_cfg):
    """An nn.Module per unit of models/transformer.py `units` (embedding, each block, head), holding the unit's
    parameters as nn.Parameters and calling the unit's own function: the same maths and sizes as the functional
    model, so what differs between the two sides is only how FSDP or the pipeline is implemented."""
    import torch
    from torch import nn
    from nanomega.models import transformer
    from nanomega.tree import named_leaves, tree_flatten, tree_unflatten

    class Unit(nn.Module):
        def __init__(self, name: str, fn, p: dict):
            super().__init__()
            self.unit_name, self.fn, self.spec = name, fn, tree_flatten(p)[1]
            self.names = list(named_leaves(p))
            for n, leaf in zip(self.names, tree_flatten(p)[0]):
                self.register_parameter(n.replace(".", "__"), nn.Parameter(leaf.detach().clone()))

        def tree(self) -> dict:
            return tree_unflatten([getattr(self, n.replace(".", "__")) for n in self.names], self.spec)

        def forward(self, *args):
            return self.fn(self.tree(), *args)

    out = []
    for name, p in transformer.units(params, model_cfg):
        fn = transformer.embed if "tok_embed" in p and name == "" and "final_norm" not in p else \
            transformer.head if "final_norm" in p else transformer.block
        out.append(Unit(name, fn, p))
    return out


def positions_for(model_cfg, tokens, dtype=None):
    """What the blocks' attention reads (models.transformer.positions: RoPE's tables; a document mask in dtype)."""
    import torch
    from nanomega.models import transformer
    return transformer.positions(tokens, model_cfg, dtype or torch.float32)


class FSDPModel:
    """fully_shard over the unit modules (built by `build`), and the loss as models.transformer computes it."""

    @staticmethod
    def build(params, model_cfg, mesh, recompute: bool, explicit_prefetch: bool, shard: bool = True):
        import torch
        from torch import nn
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        from torch.distributed.fsdp import fully_shard
        from nanomega.models import transformer

        units = unit_modules(params, model_cfg)

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = units[0]
                self.blocks = nn.ModuleList(checkpoint_wrapper(u) if recompute else u for u in units[1:-1])
                self.head = units[-1]

            def forward(self, tokens, targets):
                x = self.embed(tokens, model_cfg)
                at = positions_for(model_cfg, tokens, x.dtype)
                for i, b in enumerate(self.blocks):
                    x, _ = b(x, tokens, at, model_cfg.block_config(i))
                logits = self.head(x, tokens, model_cfg)
                return transformer.objective(logits, [], tokens, targets, model_cfg)[0]

        model = Model()
        if not shard:     # the compute alone, for reference
            return model
        for m in [model.embed, *model.blocks, model.head]:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if explicit_prefetch:    # torchtitan's option: each unit's forward prefetches the next one's gather
            order = [model.embed, *model.blocks, model.head]
            for this, following in zip(order, order[1:]):
                this.set_modules_to_forward_prefetch([following])
        return model


WRAPS = ("_wrap_tensor_autograd.default",)


def counting_mode():
    """A dispatch mode that counts the collectives issued (functional and c10d alike), by kind, and for each
    all-gather whether compute ran between its launch and the first op reading its output (module doc)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    import torch.distributed._functional_collectives as funcol
    from nanomega.sim.memory_tracker import COMPUTE, _storages

    def kind_of(func) -> str | None:
        name = func.__name__
        if func.namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            return None
        for key, kind in (("allgather", "all_gather"), ("all_gather", "all_gather"),
                          ("reduce_scatter", "reduce_scatter"),
                          ("allreduce", "all_reduce"), ("all_reduce", "all_reduce"), ("alltoall", "all_to_all"),
                          ("all_to_all", "all_to_all"), ("broadcast", "broadcast"), ("send", "send"), ("recv", "recv")):
            if key in name:
                return kind
        return None

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.launched = []       # per collective: [kind, compute ops before its first read, in the backward]
            self.pending = {}                      # an output storage's address -> (its index, compute count then)
            self.compute = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor or t is funcol.AsyncCollectiveTensor or getattr(t, "unwraps_itself", False)
                   for t in types):     # (parallel/deferred.py's Deferred: computes itself, waiting where it does)
                return NotImplemented
            kwargs = kwargs or {}
            kind = kind_of(func)
            if (kind is None or "wait" in func.__name__) and not func.is_view and func.__name__ not in WRAPS:
                # the first op reading a pending collective's output (funcol's wait_tensor, FSDP2's copy-out); a
                # view reads nothing, nor funcol's wrapping of its result (still pending)
                for a in tree_flatten((args, kwargs))[0]:
                    if isinstance(a, torch.Tensor):
                        for st in _storages(a):
                            found = self.pending.pop(st._cdata, None)
                            if found is not None and self.launched[found[0]][1] is None:
                                self.launched[found[0]][1] = self.compute - found[1]
            out = func(*args, **kwargs)
            if kind is not None and "wait" not in func.__name__:
                self.launched.append([kind, None, torch._C._current_graph_task_id() != -1])
                # c10d's in-place ops write into their first argument; functional ones return the output
                written = args[0] if func.namespace == "c10d" else out
                for t in tree_flatten(written)[0]:
                    if isinstance(t, torch.Tensor):
                        for st in _storages(t):
                            self.pending[st._cdata] = (len(self.launched) - 1, self.compute)
            elif kind is None:
                self.compute += func in COMPUTE
            return out

        def result(self) -> dict:
            """Per kind: how many were issued, and how many overlapped compute (were issued ahead)."""
            out = {}
            for kind, compute, backward in self.launched:
                entry = out.setdefault(kind, {"count": 0, "ahead": 0, "backward": 0, "backward_ahead": 0})
                entry["count"] += 1
                entry["ahead"] += bool(compute)
                entry["backward"] += backward
                entry["backward_ahead"] += backward and bool(compute)
            return dict(sorted(out.items()))
    return Count()


def measure_peak(fn, tensors) -> dict:
    """fn() under torch's MemTracker: the peak above what was live when it started, in bytes."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker:
        before = sum(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
        out = fn()
        peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
        del out
    return {"before": before, "peak_above": peak - before}


def fsdp_cases(a, rank: int, modes=(("none", True), ("none", False), ("full", True))) -> dict:
    """{case name: (one gradient pass, the tensors live before it, its parameters, "nanomega" or "torch")} for
    each (activation checkpointing, nanomega's prefetch) in `modes`; the references with ("none", True)."""
    import contextlib
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from nanomega.sim import estimate
    from nanomega.config import parse_args
    from nanomega.models import init
    from nanomega.train.step import make_step_fns, step_options
    from nanomega.parallel.deferred import resolved
    from nanomega.tree import tree_flatten, tree_unflatten

    torch.manual_seed(0)
    cases, reference = {}, {}
    for ac, prefetch in modes:
        cfg = parse_args(model_args(a, ["--parallel.dp_shard=2", f"--train.activation_checkpointing={ac}"]))
        model_cfg, params, opt, par = estimate.build(cfg, torch.device("cpu"))
        if not prefetch:    # every gather launched where it is needed, and waited for at once
            par.prefetching = lambda units: contextlib.nullcontext()
        fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(cfg.train), "compile": False})
        tokens = torch.randint(0, model_cfg.vocab_size, (a.batch, a.seq + 1),
                               generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        leaves = tree_flatten(params)[0]

        def ours(fns=fns, params=params, x=x, y=y):
            grads = fns.grads(params, [(x, y)])[1]
            # the reduce-scatters left in flight, as the optimizer's read waits
            return tree_unflatten([resolved(g) for g in tree_flatten(grads)[0]], tree_flatten(grads)[1])
        cases[f"nanomega, AC {ac}" + ("" if prefetch else ", no prefetch")] = (ours, leaves, params, "nanomega")
        if not prefetch:    # (as FSDP2's forward on a CPU: each gather waited for at once)
            continue
        whole = init(model_cfg, cfg.train.seed, "cpu")
        mesh = init_device_mesh("cpu", (2,))
        local = slice(rank * a.batch // 2, (rank + 1) * a.batch // 2)   # this rank's rows, as par.batch shards them
        for label, explicit in (("fully_shard", False), ("fully_shard + forward prefetch", True)):
            model = FSDPModel.build(whole, model_cfg, mesh, ac == "full", explicit)

            def theirs(model=model):
                model.zero_grad(set_to_none=True)
                loss = model(x[local], y[local])
                loss.backward()
                return {n: p.grad for n, p in model.named_parameters()}
            cases[f"{label}, AC {ac}"] = (theirs, list(model.parameters()), model, "torch")
        if ac == "none" and prefetch:   # each rank alone on its rows, no FSDP: what the compute costs on either side
            from nanomega import optim
            serial_fns = make_step_fns(model_cfg, optim.build(cfg.optim, 1), compile=False)

            def serial_ours(fns=serial_fns, params=whole):
                return fns.grads(params, [(x[local], y[local])])[1]
            plain = FSDPModel.build(whole, model_cfg, mesh, False, False, shard=False)

            def serial_theirs(model=plain):
                model.zero_grad(set_to_none=True)
                model(x[local], y[local]).backward()
            reference = {
                "reference: nanomega's step, no FSDP": (serial_ours, tree_flatten(whole)[0], whole, "nanomega"),
                "reference: the nn.Modules, no FSDP": (serial_theirs, list(plain.parameters()), plain, "torch")}
    return {**cases, **reference}


def fsdp_worker(a, out: str) -> None:
    import torch.distributed as dist
    from nanomega.sim.memory_tracker import MemoryTracker
    from nanomega.tree import named_leaves

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases, results = fsdp_cases(a, rank), {}
    # the gradients of the two sides: the same shards of the same maths
    grads_ours = {n: g.to_local() for n, g in named_leaves(cases["nanomega, AC none"][0]()).items()}
    grads_theirs = cases["fully_shard, AC none"][0]()
    diff = 0.0
    for n, g in grads_theirs.items():
        name = n.replace("_checkpoint_wrapped_module.", "").split(".", 1)
        unit = name[0] if name[0] in ("embed", "head") else None
        key = name[1].replace("__", ".") if unit else ".".join(["layers"] + name[1].split(".", 1)[:1]) + "." + \
            name[1].split(".", 1)[1].replace("__", ".")
        diff = max(diff, (g.to_local() - grads_ours[key]).abs().max().item())
    for name, (fn, tensors, _, _) in cases.items():
        counter = counting_mode()
        with counter:
            fn()
        mine = {}
        if name.startswith("nanomega") or name.startswith("reference: nanomega"):
            tracker = MemoryTracker()
            tracker.label(cases[name][2], "parameters")
            with tracker:
                fn()
            mine = {"nanomega_tracker_peak_above": tracker.result()["peak_bytes"] -
                    tracker.result()["held_after"]["parameters"]}
        results[name] = {"collectives": counter.result(), **measure_peak(fn, tensors), **mine, "times": []}
    for _ in range(a.steps):     # interleaved rounds: a busy machine slows every case alike
        for name, (fn, *_rest) in cases.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            results[name]["times"].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps({"cases": results, "grad_max_abs_diff": diff}))
    dist.barrier()
    dist.destroy_process_group()


PROFILED = ("nanomega, AC none", "fully_shard, AC none", "reference: nanomega's step, no FSDP",
            "reference: the nn.Modules, no FSDP", "nanomega, DDP")
COPIES = {"aten::copy_", "aten::cat", "aten::_chunk_cat", "aten::split_with_sizes_copy", "aten::_foreach_copy_",
          "aten::zero_", "aten::fill_", "aten::empty", "aten::empty_strided", "aten::new_empty",
          "aten::new_empty_strided", "aten::new_zeros", "aten::zeros", "aten::clone", "aten::_to_copy"}
CATEGORIES = (   # (row of the profile table, which profiler keys it sums), first match wins
    ("tensor subclasses' Python dispatch (DTensor's, funcol's, Deferred's)", lambda k: k == "PythonSubclass"),
    ("collectives: launch and wait (c10d, funcol)",
     lambda k: k.startswith(("c10d::", "_c10d_functional", "record_param_comms", "gloo"))),
    ("fully_shard's hooks (FSDP:: ranges: its Python, its waits on gloo)", lambda k: k.startswith("FSDP::")),
    ("copies, packing, allocation", lambda k: k in COPIES),
    ("compute: every other aten op", lambda k: k.startswith("aten::")),
    ("autograd nodes and functions", lambda k: True))


def ddp_pass(a):
    """nanomega's gradient pass under DDP over the 2 ranks: every op of every unit on DTensors (parameters
    Replicate, the batch Shard(0)) as under FSDP, but nothing gathered: one bucketed all-reduce at the end."""
    import torch
    from nanomega.config import parse_args
    from nanomega.parallel.deferred import resolved
    from nanomega.sim import estimate
    from nanomega.train.step import make_step_fns, step_options
    from nanomega.tree import tree_flatten

    cfg = parse_args(model_args(a, ["--parallel.dp_replicate=2"]))
    model_cfg, params, opt, par = estimate.build(cfg, torch.device("cpu"))
    fns = make_step_fns(model_cfg, opt, par=par, **{**step_options(cfg.train), "compile": False})
    tokens = torch.randint(0, model_cfg.vocab_size, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(1))

    def ddp():
        return [resolved(g) for g in tree_flatten(fns.grads(params, [(tokens[:, :-1], tokens[:, 1:])])[1])[0]]
    return ddp


def fsdp_profile_worker(a, out: str) -> None:
    """Where a pass's time goes (the fsdp part's main cases and references, each rank): per interleaved round,
    one pass timed (wall and this process's CPU time) and one under torch.profiler (each op's self CPU time)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from nanomega.tree import named_leaves

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    everything = fsdp_cases(a, rank, modes=(("none", True),))
    everything["nanomega, DDP"] = (ddp_pass(a), None, None, "nanomega")
    cases = {name: everything[name][0] for name in PROFILED}
    for fn in cases.values():    # warm-up
        fn()
    results = {name: {"wall": [], "cpu": [], "wall_profiled": [], "ops": {}} for name in cases}
    for _ in range(a.steps):
        for name, fn in cases.items():
            r = results[name]
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            r["wall"].append(time.perf_counter() - wall)
            r["cpu"].append(time.process_time() - cpu)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                wall = time.perf_counter()
                fn()
                r["wall_profiled"].append(time.perf_counter() - wall)
            for e in prof.key_averages():
                seconds, count = r["ops"].get(e.key, (0.0, 0))
                r["ops"][e.key] = (seconds + e.self_cpu_time_total / 1e6, count + e.count)
    block = sum(t.to_local().numel() for n, t in named_leaves(everything["nanomega, AC none"][2]).items()
                if n.startswith("layers.0."))
    total = sum(t.numel() for t in named_leaves(everything["reference: nanomega's step, no FSDP"][2]).values())
    costs = {"dispatch": dispatch_cost(), "collectives": collective_cost(block, total, 3 * a.steps),
             "block_shard": block, "parameters": total}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"cases": results, **costs})
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": ranks, "rounds": a.steps}))
    dist.barrier()
    dist.destroy_process_group()


def timed(fn, rounds: int, inner: int = 1) -> dict:
    """Median wall and CPU time (this process's) of `inner` calls of fn, in ms per call, over `rounds`."""
    import torch.distributed as dist
    walls, cpus = [], []
    for _ in range(rounds):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(inner):
            fn()
        walls.append((time.perf_counter() - wall) / inner)
        cpus.append((time.process_time() - cpu) / inner)
    return {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus)}


def dispatch_cost(rounds: int = 7, inner: int = 300) -> dict:
    """One op on DTensors against the same op on their local tensors (a [64, 64] matmul, the batch Shard(0)
    and the weight Replicate over both ranks, as a unit's ops run under FSDP): what DTensor adds per op."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    mesh = init_device_mesh("cpu", (2,))
    x, w = torch.randn(64, 64), torch.randn(64, 64)
    dx, dw = DTensor.from_local(x, mesh, [Shard(0)]), DTensor.from_local(w, mesh, [Replicate()])
    out = {}
    for _ in range(2):    # interleaved, the first round a warm-up
        out["dtensor"] = timed(lambda: dx @ dw, rounds, inner)
        out["plain"] = timed(lambda: x @ w, rounds, inner)
    return out


def collective_cost(numel: int, total: int, rounds: int) -> dict:
    """One block's packed all-gather and reduce-scatter (fp32, `numel` per rank) over both ranks, launched and
    waited: by functional collectives (nanomega's) and by c10d's all_gather_single / reduce_scatter_single
    (fully_shard's), interleaved; and DDP's all-reduce of every gradient (`total` elements, funcol's)."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    group = dist.group.WORLD
    shard, whole = torch.randn(numel), torch.randn(2 * numel)
    gathered, scattered, every = torch.empty(2 * numel), torch.empty(numel), torch.randn(total)
    cases = {"all-gather, funcol": lambda: funcol.all_gather_single(shard, 0, group).wait(),
             "all-gather, c10d": lambda: dist.all_gather_single(gathered, shard, group),
             "reduce-scatter, funcol": lambda: funcol.reduce_scatter_single(whole, "sum", 0, group).wait(),
             "reduce-scatter, c10d": lambda: dist.reduce_scatter_single(scattered, whole, group=group),
             "all-reduce of every gradient, funcol": lambda: funcol.all_reduce(every, "sum", group).wait()}
    times = {name: {"wall_ms": [], "cpu_ms": []} for name in cases}
    for _ in range(rounds + 1):    # the first a warm-up
        for name, fn in cases.items():
            for key, value in timed(fn, 1).items():
                times[name][key].append(value)
    return {name: {key: statistics.median(v[1:]) for key, v in t.items()} for name, t in times.items()}


def profile_rows(case: dict, rounds: int) -> dict:
    """{row: ms per pass} of one rank's case: each category's self CPU time (mean over the profiled passes),
    the time outside any op (the profiled wall less every op's self time), the wall and the CPU time of the
    passes timed without the profiler (medians)."""
    rows = {name: 0.0 for name, _ in CATEGORIES}
    for key, (seconds, _) in case["ops"].items():
        rows[next(name for name, test in CATEGORIES if test(key))] += 1e3 * seconds / rounds
    rows["outside any op: the Python of the step, model and hooks"] = \
        1e3 * statistics.mean(case["wall_profiled"]) - sum(rows.values())
    rows["wall, without the profiler (median)"] = 1e3 * statistics.median(case["wall"])
    rows["CPU time of the process, without the profiler (median)"] = 1e3 * statistics.median(case["cpu"])
    return rows


def pipeline_worker(a, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from nanomega.config import parse_args
    from nanomega.models import init, transformer
    from nanomega.parallel.mesh import model_config
    from nanomega.parallel.setup import setup_parallel
    from nanomega.train.step import make_step_fns, step_options

    cfg = parse_args(model_args(a, ["--parallel.pp=2", "--parallel.pp_schedule=1f1b", f"--train.grad_accum={a.micro}"]))
    model_cfg = model_config(cfg)
    params, opt, pipe = setup_parallel(cfg, model_cfg, torch.device("cpu"))
    rank = dist.get_rank()
    fns = make_step_fns(model_cfg, opt, par=pipe, **{**step_options(cfg.train), "compile": False})
    tokens = torch.randint(0, model_cfg.vocab_size, (a.micro * a.batch, a.seq + 1),
                           generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    micro = [(x[i * a.batch:(i + 1) * a.batch], y[i * a.batch:(i + 1) * a.batch]) for i in range(a.micro)]

    def ours():
        return float(fns.grads(params, micro)[0])

    # torch's: the same units as two nn.Module stages (the blocks split as nanomega's stages split them)
    units = unit_modules(init(model_cfg, cfg.train.seed, "cpu"), model_cfg)
    first_blocks = len(pipe.blocks[0])

    class Stage(nn.Module):
        def __init__(self, parts, first: bool, last: bool):
            super().__init__()
            self.parts, self.first, self.last = nn.ModuleList(parts), first, last

        def forward(self, x):
            # the blocks read only the tokens' shape (plain tensors: the sharding hints are identities)
            tokens = x if self.first else torch.empty(x.shape[:2], dtype=torch.long)
            at = positions_for(model_cfg, tokens)
            for part in self.parts:
                if part.fn is transformer.embed:
                    x = part(tokens, model_cfg)
                elif part.fn is transformer.head:
                    x = part(x, tokens, model_cfg)
                else:
                    i = int(part.unit_name.split(".")[1])
                    x = part(x, tokens, at, model_cfg.block_config(i))[0]
            return x

    parts = units[:1 + first_blocks] if rank == 0 else units[1 + first_blocks:]
    stage = PipelineStage(Stage(parts, rank == 0, rank == 1), rank, 2, torch.device("cpu"))

    def loss_fn(logits, targets):
        return transformer.objective(logits, [], targets, targets, model_cfg)[0]
    schedule = Schedule1F1B(stage, n_microbatches=a.micro, loss_fn=loss_fn)

    def theirs():
        stage.submod.zero_grad(set_to_none=True)
        losses = []
        schedule.step(*([x] if rank == 0 else []), **({"target": y, "losses": losses} if rank == 1 else {}))
        return float(torch.stack(losses).detach().mean()) if losses else None

    cases = {"nanomega Pipeline, 1F1B": ours, "torch Schedule1F1B + PipelineStage": theirs}
    results = {name: {"times": [], "loss": fn()} for name, fn in cases.items()}    # (the first: warm-up)
    for _ in range(a.steps):
        for name, fn in cases.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            results[name]["times"].append(time.perf_counter() - start)
    losses = [None, None]
    dist.all_gather_object(losses, {n: r["loss"] for n, r in results.items()})
    if rank == 0:
        for name in cases:   # the last stage computes the loss
            results[name]["loss"] = losses[1][name]
        Path(out).write_text(json.dumps({"cases": results, "micro_batches": a.micro}))
    dist.barrier()
    dist.destroy_process_group()


def checkpoint_worker(a, out: str) -> None:
    import shutil
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
    from nanomega import checkpoint
    from nanomega.sim import estimate
    from nanomega.config import parse_args
    from nanomega.models import init
    from nanomega.parallel.agreement import agreement
    from nanomega.tree import named_leaves

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = parse_args(model_args(a, ["--parallel.dp_shard=2"]))
    model_cfg, params, opt, par = estimate.build(cfg, torch.device("cpu"))
    named = named_leaves(params)     # {dotted name: DTensor shard}: what both sides save
    agree = agreement(60)
    base = Path(out).parent / "ckpt"
    directories = {"nanomega": base / "nanomega", "DCP": base / "dcp", "DCP + HF safetensors": base / "hf"}

    def save(kind):
        d = directories[kind]
        if rank == 0:
            shutil.rmtree(d, ignore_errors=True)
        dist.barrier()
        if kind == "nanomega":
            checkpoint.save(d, 1, params, {}, {"layout": par.layout_key}, keep=1, rank=rank, world_size=2, agree=agree)
        elif kind == "DCP":
            dcp.save(dict(named), checkpoint_id=str(d))
        else:
            dcp.save(dict(named), storage_writer=HuggingFaceStorageWriter(str(d), save_distributed=True))
        dist.barrier()

    whole = {n: torch.zeros(t.shape, dtype=t.dtype) for n, t in named.items()}   # the serial layout's tensors

    def load(kind, into_whole=False):
        """Into this layout's shards, or (into_whole) into whole tensors, as a serial run reads it: resharding."""
        d = directories[kind]
        if kind == "nanomega":
            like = init(model_cfg, device="cpu") if into_whole else params
            shards = {} if into_whole else {"rank": rank, "world_size": 2, "layout": par.layout_key}
            return named_leaves(checkpoint.load(checkpoint.latest(d), like, None, **shards)[0])
        like = {n: torch.zeros_like(t) for n, t in (whole if into_whole else named).items()}
        dcp.load(like, checkpoint_id=str(d),
                 **({"storage_reader": HuggingFaceStorageReader(str(d))} if kind != "DCP" else {}))
        return like

    def load_whole(kind):
        return load(kind, into_whole=True)

    results = {}
    for kind in directories:
        results[kind] = {"save": [], "load": [], "load_whole": [], "error": None}
    for _ in range(a.steps):
        for kind in directories:
            if results[kind]["error"]:
                continue
            try:
                loaded = {}
                for what, fn in (("save", save), ("load", load), ("load_whole", load_whole)):
                    dist.barrier()
                    start = time.perf_counter()
                    loaded[what] = fn(kind)
                    results[kind][what].append(time.perf_counter() - start)
                results[kind]["exact"] = all(torch.equal(loaded["load"][n].to_local(), t.to_local())
                                             for n, t in named.items())
                results[kind]["exact_whole"] = all(torch.equal(loaded["load_whole"][n], t.full_tensor())
                                                   for n, t in named.items())
            except Exception as err:     # a side that cannot do it is a finding, not a crash
                results[kind]["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    for kind in directories:     # what each side asks of the process group (the counting mode of the fsdp part)
        if results[kind]["error"] is None:
            for what, fn in (("save", save), ("load", load)):
                counter = counting_mode()
                with counter:
                    fn(kind)
                results[kind][f"{what}_collectives"] = counter.result()
    if rank == 0:
        for kind, d in directories.items():
            files = [f for f in d.rglob("*") if f.is_file()] if d.exists() else []
            results[kind].update(files=len(files), bytes=sum(f.stat().st_size for f in files))
        Path(out).write_text(json.dumps({"cases": results}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences), split over the 2 ranks")
    parser.add_argument("--steps", type=int, default=6, help="timed rounds of each case")
    parser.add_argument("--micro", type=int, default=4, help="micro-batches of the pipeline step (each --batch)")
    parser.add_argument("--parts", default="fsdp,fsdp_profile,pipeline,checkpoint")
    results_io.add_arguments(parser)
    a = parser.parse_args()
    if a.render:
        return results_io.render(a.render, tables)
    doc = results_io.start("home_made")
    doc["settings"] = {k: getattr(a, k) for k in ("layers", "d_model", "seq", "batch", "steps", "micro")}
    doc["lines"] = count_lines()
    for part in a.parts.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "out.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
                   "--worker", part, str(out), json.dumps(vars(a))]
            start = time.perf_counter()
            run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if run.returncode:   # the other parts' results are still written; this one's table says it failed
                doc.setdefault("failed", []).append(part)
                print(f"{part}: FAILED (exit {run.returncode}; its output is above)", flush=True)
                continue
            doc[part] = {**json.loads(out.read_text()), "seconds": round(time.perf_counter() - start, 1)}
            print(f"{part}: {doc[part]['seconds']} s", flush=True)
    results_io.write(doc, tables(doc), a.out)
    return 1 if doc.get("failed") else 0


def median_ms(times: list) -> str:
    return f"{1e3 * statistics.median(times):,.0f}" if times else "-"


def collectives(c: dict, ahead: bool = True) -> str:
    """'7 all-gather (2/4 fwd, 3/3 bwd ahead), 4 reduce-scatter' from a counter's result."""
    parts = []
    for kind, e in c.items():
        text = f"{e['count']} {kind.replace('_', '-')}"
        if kind == "all_gather" and ahead:
            fwd, fwd_ahead = e["count"] - e["backward"], e["ahead"] - e["backward_ahead"]
            text += f" ({fwd_ahead}/{fwd} fwd, {e['backward_ahead']}/{e['backward']} bwd ahead)"
        parts.append(text)
    return ", ".join(parts)


def profile_tables(f: dict, model: str, layers: int) -> list:
    """The fsdp_profile part's tables: per rank, where a pass's time goes; the unit costs; the gap they explain."""
    parts, names = [], ("nanomega", "fully_shard", "nanomega, no FSDP", "nn.Modules, no FSDP", "nanomega, DDP")
    for rank, r in enumerate(f["ranks"]):
        per_case = [profile_rows(r["cases"][name], f["rounds"]) for name in PROFILED]
        rows = [[row, *(f"{c[row]:,.0f}" for c in per_case), f"{per_case[0][row] - per_case[1][row]:+,.0f}"]
                for row in per_case[0]]
        parts += [f"Where a forward + backward's time goes, rank {rank} ({model}, AC none): ms per pass, each op's "
                  f"self CPU time by torch.profiler (mean of {f['rounds']} profiled passes; the profiler's times are "
                  "wall-clock, so a loaded machine inflates them), the profiled pass's wall less all of it (outside "
                  "any op), and, of as many passes interleaved with them without the profiler, the median wall and "
                  "CPU time (this process's, gloo's threads included):",
                  results_io.table(["", *names, "nanomega - fully_shard"], "lrrrrrr", rows)]
    rows, explained = [], []
    for rank, r in enumerate(f["ranks"]):
        d, c = r["dispatch"], r["collectives"]
        calls = r["cases"][PROFILED[0]]["ops"].get("PythonSubclass", (0, 0))[1] / f["rounds"]
        per_op = {k: d["dtensor"][k] - d["plain"][k] for k in ("wall_ms", "cpu_ms")}
        gather = {k: c["all-gather, funcol"][k] - c["all-gather, c10d"][k] for k in per_op}
        scatter = {k: c["reduce-scatter, funcol"][k] - c["reduce-scatter, c10d"][k] for k in per_op}
        rows += [[f"rank {rank}: a DTensor matmul [64, 64], above the plain one (per op)",
                  f"{1e3 * per_op['wall_ms']:,.0f} us", f"{1e3 * per_op['cpu_ms']:,.0f} us"]]
        rows += [[f"rank {rank}: {name} " + (f"({4 * r['parameters'] / MiB:.1f} MiB)" if "every" in name else
                                             f"of a block ({4 * r['block_shard'] / MiB:.1f} MiB a rank)"),
                  f"{v['wall_ms']:,.1f} ms", f"{v['cpu_ms']:,.1f} ms"] for name, v in c.items()]
        explained.append((rank, calls, per_op, gather, scatter))
    parts += ["Unit costs, measured in the same run (medians of interleaved rounds; DTensor's per op over 300 calls, "
              "each collective launched and waited alone):",
              results_io.table(["", "wall", "CPU"], "lrr", rows)]
    gathers, scatters = 2 * (layers + 2) - 1, layers + 2    # per pass: the head is not gathered again
    for rank, calls, per_op, gather, scatter in explained:
        parts.append(f"Rank {rank}: {calls:,.0f} tensor-subclass dispatches per pass x {1e3 * per_op['cpu_ms']:,.0f} "
                     f"us of CPU = {calls * per_op['cpu_ms']:,.0f} ms; gloo's path behind funcol against c10d's, "
                     f"{gathers} all-gathers x {gather['wall_ms']:+,.1f} ms and {scatters} reduce-scatters x "
                     f"{scatter['wall_ms']:+,.1f} ms of wall = "
                     f"{gathers * gather['wall_ms'] + scatters * scatter['wall_ms']:+,.0f} ms (block-sized, an upper "
                     "bound: the embedding's and head's are smaller).")
    return parts


def tables(doc: dict) -> str:
    s, parts = doc["settings"], []
    rows = [[name, f"{v['nanomega'][0]:,} ({v['nanomega'][1]:,})", f"{v['torch'][0]:,} ({v['torch'][1]:,})",
             ", ".join(v["nanomega_files"]),
             f"torch/distributed/{{{', '.join(v['torch_paths'])}}} ({v['torch_files']} files)"]
            for name, v in doc["lines"].items()]
    parts += ["Lines of each implementation, all (code: no blank, comment or docstring line):",
              results_io.table(["component", "nanomega", "torch", "nanomega's files", "torch's files"], "lrrll", rows)]
    model = (f"{s['layers']} layers, d {s['d_model']}, sequence {s['seq']}, fp32, eager, 2 gloo processes on the "
             f"machine's cores")
    if "fsdp" in doc:
        f = doc["fsdp"]
        rows = [[name, median_ms(r["times"]), f"{r['peak_above'] / MiB:,.1f}"
                 + (f" ({r['nanomega_tracker_peak_above'] / MiB:,.1f})" if "nanomega_tracker_peak_above" in r else ""),
                 collectives(r["collectives"])] for name, r in f["cases"].items()]
        parts += [f"FSDP over 2 ranks, one forward + backward (no update) of batch {s['batch']} ({model}); median of "
                  f"{s['steps']} interleaved rounds; peak: above what was live before the pass, rank 0, torch's "
                  "MemTracker (nanomega's tracker in brackets); collectives issued per pass, and all-gathers issued "
                  "ahead (compute ran between launch and first read) in the forward and in the backward (the "
                  f"backward's include the recomputation's). Gradient shards, nanomega against fully_shard: max "
                  f"|difference| {f['grad_max_abs_diff']:.1e}.",
                  results_io.table(["case", "ms / pass", "peak MiB", "collectives per pass"], "lrrl", rows)]
    if "fsdp_profile" in doc:
        parts += profile_tables(doc["fsdp_profile"], model, s["layers"])
    if "pipeline" in doc:
        p = doc["pipeline"]
        rows = [[name, median_ms(r["times"]), f"{r['loss']:.6f}"] for name, r in p["cases"].items()]
        parts += [f"Pipeline, 2 stages on 2 ranks, 1F1B, {p['micro_batches']} micro-batches of {s['batch']} ({model}); "
                  f"forward + backward of the step, median of {s['steps']} interleaved rounds; the loss of the same "
                  "micro-batches:", results_io.table(["runtime", "ms / step", "loss"], "lrr", rows)]
    if "checkpoint" in doc:
        c = doc["checkpoint"]
        bitwise = {True: "yes", False: "NO", None: "-"}
        rows = [[name, median_ms(r["save"]), median_ms(r["load"]), median_ms(r["load_whole"]), r.get("files", "-"),
                 f"{r.get('bytes', 0) / MiB:,.1f}", bitwise[r.get("exact")] + " / " + bitwise[r.get("exact_whole")]
                 + (f" ({r['error']})" if r["error"] else ""),
                 "; ".join(f"{what}: " + (collectives(r[f"{what}_collectives"], ahead=False) or "none")
                           for what in ("save", "load")
                           if f"{what}_collectives" in r)] for name, r in c["cases"].items()]
        parts += [f"Checkpoint of the FSDP-sharded parameters of 2 ranks ({model}; no optimizer state): median "
                  f"of {s['steps']} rounds of a save, a load into the same layout, and a load of whole tensors on "
                  "each rank (the serial layout: resharding); bitwise: the same layout / the whole tensors:",
                  results_io.table(["writer", "save ms", "load ms", "load whole ms", "files", "MiB", "bitwise",
                                    "collectives (barriers in the timing loop apart)"], "lrrrrrll", rows)]
    if doc.get("failed"):
        parts.append(f"Failed, no results: {', '.join(doc['failed'])} (the run's output has the error).")
    return "\n\n".join(parts)

WORKERS = {"fsdp": fsdp_worker, "fsdp_profile": fsdp_profile_worker, "pipeline": pipeline_worker,
           "checkpoint": checkpoint_worker}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        WORKERS[sys.argv[2]](argparse.Namespace(**json.loads(sys.argv[4])), sys.argv[3])
    else:
        sys.exit(main())
