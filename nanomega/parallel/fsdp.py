"""FSDP per unit: a unit's parameters gathered just before it runs, its gradients reduce-scattered as soon as
its backward is done, and every collective launched one unit ahead of its use.

The model runs as a sequence of units (models/transformer.py `units`: the embedding, each block, the head),
each called through the train step's runner (nanomega/train/step.py), which hands each unit its parameters in
their compute placements (`UnitGather`). Those sharded over a data-parallel mesh dim (dp_shard x cp; edp for
FSDP-sharded experts) are cast from the fp32 shards to train.param_dtype and gathered by `_GatherUnit`, an
autograd function whose forward all-gathers a unit's bucket in one collective and whose backward
reduce-scatters all its gradients in one collective, in train.reduce_dtype. Each gradient comes back a partial
sum over dp_replicate, which HSDP reduces once per step, on the shard (parallel/buckets.py); DTensor's own
redistribute would all-reduce the whole gradient over dp_replicate first, per micro-batch. This file composes
three ideas, each in its own file:

    packing.py    one flat buffer and one collective per unit and mesh dim (and float8 gathers);
    deferred.py   gradients handed back without waiting for their reduce-scatter;
    regather.py   the unit gathered again for its backward: after the forward freed it
                  (parallel.reshard_after_forward, FSDP2's default), or inside its recomputation.

What overlaps (a functional collective starts when it is called and is waited for at the first use of its
result, as FSDP2 runs them on a side stream):
  forward    the step hands the forward's unit list to `UnitGather.prefetching` (Prefetch): as unit k is
             reached, unit k + 1's all-gather is launched too, so it is in flight while unit k computes (at
             most two units gathered at once);
  backward   a hook on each unit's output fires when the backward reaches the unit and launches the gather
             again of the unit before it (a Regather's or a RecomputedGather's), one unit ahead; each unit's
             reduce-scatter is left in flight until the next unit's backward is done and packs its gradients
             (deferred.InFlight);
  micro-batches and pipeline stages  the same, per micro-batch (each reduced shard added into the running
             sum where it is waited: deferred.add_into) and per stage (parallel/pipeline.py runs each stage's
             forward inside `prefetching`); or, with parallel.fsdp_gather="per_step", one all-gather and one
             reduce-scatter per unit and step, for more memory held all step (OncePerStep).
Every gather is launched outside any recomputed region, in the forward and in the backward alike.
memory_tracker's schedule records where each collective is launched and waited (tests/test_overlap.py).

Ours, not torch's fully_shard (re-decided 2026-12-03 with torch 2.13; measured in docs/parallelism.md,
"Against torch's fully_shard"). fully_shard hooks nn.Modules, and the model is functions: adopting it means a
module around every unit and FSDP's state in modules, not in the plan that also places TP, EP and the
optimizer's shards; the float8 gather per unit with one amax all-reduce has no fully_shard equivalent without
torchao's Float8Linear (a module swap and a dependency); the same Bucket packs ZeRO-1's reduce-scatter, and
Regather serves the zero-bubble pipeline's two-pass backward. On 2 gloo ranks the gradient shards agree within
1.5e-8 and the collectives are the same (more of them launched ahead); a pass is 28% slower, from DTensor's
host CPU (every op of a unit runs on DTensors, where fully_shard computes on plain tensors), not from this
file: FSDP's own share is the same on both sides. What fully_shard has that this lacks: CPU offload,
resharding to a smaller mesh after the forward, and a compiled path (SimpleFSDP plus inductor's bucketing, in
torchtitan; ours compiles per block, the hooks cannot be traced).
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from nanomega.models import init
from nanomega.models.fp8 import is_fp8_linear
from nanomega.parallel.deferred import Deferred, InFlight, cast_back
from nanomega.parallel.mesh import model_config, stage_of, stages_layers
from nanomega.parallel.packing import Bucket
from nanomega.parallel.plan import is_expert
from nanomega.parallel.regather import RecomputedGather, Regather
from nanomega.parallel.schedules import stage_ranks
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


class _GatherUnit(torch.autograd.Function):
    """A bucket's shards (fp32 DTensors, storage placements) -> the parameters in their compute
    placements in the UnitGather's param_dtype, with one all-gather; the backward reduce-scatters all the
    gradients in its reduce_dtype with one collective and hands each back in the shard's dtype and its gradient
    placements (storage, but a partial sum over dp_replicate). `pending`: the gather, already launched
    by the prefetch (else launched here); the UnitGather's InFlight holds the step's reduce-scatter in flight."""

    @staticmethod
    def forward(ctx, unit, bucket, pending, *shards):
        ctx.unit, ctx.bucket, ctx.once = unit, bucket, unit.once
        ctx.shard_dtypes = [s.dtype for s in shards]
        local = [s.to_local() for s in shards]
        ctx.shard_shapes = [x.shape for x in local]
        gathered = None if ctx.once is None else ctx.once.gathered.get(bucket)
        if gathered is None:
            if pending is None:
                pending = bucket.launch_gather([x.to(unit.param_dtype) for x in local])
            gathered = bucket.unpack_gather(pending, local)
            if ctx.once is not None:     # kept for the step's other micro-batches (OncePerStep)
                ctx.once.gathered[bucket] = gathered
        ctx.local_shapes = [x.shape for x in gathered]
        return tuple(_dtensor(x, bucket.mesh, lay.compute, lay.shape) for x, lay in zip(gathered, bucket.layouts))

    @staticmethod
    def backward(ctx, *grads):
        bucket, unit, once = ctx.bucket, ctx.unit, ctx.once
        grad_placements = [unit.grad_placements[n] for n in bucket.names]
        unit.in_flight.settle()   # the previous unit's shards computed (and summed) before this unit's buffers exist
        local = []
        for i, g in enumerate(grads):
            if g is None:    # a parameter the unit did not use
                local.append(torch.zeros(ctx.local_shapes[i], dtype=unit.reduce_dtype, device=bucket.mesh.device_type))
                continue
            # a partial sum over the gathered dim (reduced here), the gradient placements elsewhere
            want = tuple(Partial() if d in bucket.mesh_dims else p for d, p in enumerate(grad_placements[i]))
            if tuple(g.placements) != want:
                g = g.redistribute(bucket.mesh, want)
            local.append(g.to_local())     # converted to reduce_dtype by its copy into the packed buffer
        if once is not None:
            local = once.summed(bucket, local, unit.reduce_dtype)
        if local is None and not unit.zeros:  # not the unit's last backward: no gradient yet (OncePerStep)
            return (None,) * (3 + len(grads))
        if local is None:     # the same, where every weight must get a gradient (every_gradient): zeros
            shards = [torch.zeros(shape, dtype=dtype, device=bucket.mesh.device_type)
                      for shape, dtype in zip(ctx.shard_shapes, ctx.shard_dtypes)]
        else:
            # each shard's gradient, computed at its first use: the pending result cast to the shard's dtype
            # (a view of it where the dtypes agree), so nothing here waits for the reduce-scatter
            shards = [Deferred(functools.partial(cast_back, dtype=dtype), s, dtype)
                      for s, dtype in zip(bucket.reduce_scatter(local, unit.reduce_dtype), ctx.shard_dtypes)]
            unit.in_flight.replace(shards)
        return (None, None, None, *(_dtensor(s, bucket.mesh, placements, lay.shape)
                                    for s, placements, lay in zip(shards, grad_placements, bucket.layouts)))


def _dtensor(local: torch.Tensor, mesh, placements, shape) -> DTensor:
    """plan.as_dtensor without an op on `local` (DTensor.from_local takes a view of it, which would compute
    a Deferred) and without from_local's Python (an autograd function, a spec built and checked): a unit's
    every gathered parameter and gradient goes through here."""
    meta = TensorMeta(torch.Size(shape), make_contiguous_strides_for(shape), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


class Prefetch:
    """The units of one forward, in order (models/transformer.py `units`), and the gathers launched one unit
    ahead of them, in the forward and (from a hook on each unit's output: `UnitGather.after`) in the backward:
    FSDP2's forward and backward prefetch (module doc, "What overlaps")."""

    def __init__(self, units: list):
        self.units = units
        self.current = -1          # the unit the forward runs now
        self.launched = {}         # unit index -> {bucket key: pending gather}
        self.again = {}            # unit index -> its Regather or RecomputedGather

    def enter(self, prefix: str, leaves: list) -> int:
        k = self.current = self.current + 1
        name, params = self.units[k]
        if name != prefix or any(a is not b for a, b in zip(tree_flatten(params)[0], leaves)):
            raise RuntimeError(f"unit {k} of the forward is {name!r}, but {prefix!r} ran: the forward must "
                               "run its units in the order models.transformer.units lists them")
        return k

    def backward_reaches(self, k: int, grad=None) -> None:
        """Unit k's backward is about to run: its gather again (launched already, but for the backward's
        first unit) and unit k - 1's, one unit ahead."""
        for again in (self.again.pop(k, None), self.again.get(k - 1)):
            if again is not None:
                again.prefetch()


class OncePerStep:
    """parallel.fsdp_gather="per_step": each unit gathered once per step, before the step's (the stage's) first
    micro-batch runs it, and kept until its last backward; its gradients summed unsharded over the micro-batches
    in train.reduce_dtype and reduce-scattered once, by that last backward. torchtitan's FSDP2 under a pipeline
    (reshard_after_forward=False; no reduce-scatter nor reshard after a backward but the last: torch's
    PipelineStage disables gradient sync until then). It trades memory for collectives: a rank holds its
    stage's gathered parameters and their unsharded gradients for the whole step (gather_once_default weighs
    them), where per micro-batch it gathers and reduce-scatters every unit again for every micro-batch
    (1 + reshard_after_forward all-gathers and one reduce-scatter per unit and micro-batch, against one each
    per step). The buckets are the step's, not the micro-batch's: `gathered` and `sums` are keyed by them."""

    def __init__(self, n: int):
        self.n = n                # the micro-batches of the step: each unit's backwards before it reduce-scatters
        self.gathered = {}        # bucket -> its gathered local tensors, from its first gather to its last backward
        self.sums = {}            # bucket -> [its unsharded gradients summed so far, in reduce_dtype]
        self.backwards = {}       # bucket -> the backwards it has run this step

    def summed(self, bucket, local: list, dtype: torch.dtype) -> list | None:
        """A unit's backward hands over its local gradients: None until the step's last backward of the unit,
        which gets the sum over the step's micro-batches (in order: the first's, then each added), to reduce-scatter.
        The unit's gathered parameters are dropped then (the graphs that saved them are done with them)."""
        done = self.backwards[bucket] = self.backwards.get(bucket, 0) + 1
        total = self.sums.pop(bucket, None)
        if total is None and done < self.n:    # owned copies (an autograd gradient may be a view shared with another)
            total = [torch.empty(g.shape, dtype=dtype, device=g.device).copy_(g) for g in local]
        elif total is not None:
            for t, g in zip(total, local):
                t.add_(g)
        if done < self.n:
            self.sums[bucket] = total
            return None
        self.gathered.pop(bucket, None)
        return local if total is None else total


def gather_once_default(cfg, gpu_bytes: float, peak_bytes: float) -> bool:
    """The planner's rule for parallel.fsdp_gather (nanomega/sim/plan.py): True ("per_step") where it pays and
    fits. It pays only with FSDP (dp_shard > 1) and several micro-batches per step (train.grad_accum > 1, the
    micro-batches a pipeline stage runs too): with one there is nothing to gather again. It fits when the rank's
    simulated per-micro-batch peak (peak_bytes) plus what per_step holds for the whole step (`per_step_bytes`)
    stays within the GPU's memory (gpu_bytes). Pure: the planner calls it for each candidate layout."""
    if cfg.parallel.dp_shard <= 1 or cfg.train.grad_accum <= 1:
        return False
    return peak_bytes + per_step_bytes(cfg) <= gpu_bytes


def per_step_bytes(cfg) -> float:
    """What parallel.fsdp_gather="per_step" holds on one rank for the whole step (OncePerStep), at most: the
    parameters of the pipeline rank's stages (the largest rank's: the embedding's or the head's stage) gathered in
    train.param_dtype, and their unsharded gradients in train.reduce_dtype; each at tensor parallel's split (all
    but the 1-d norms and biases) and, for experts, expert parallel's. An upper bound on what it adds to the peak:
    per micro-batch already holds a unit or two gathered and one unit's gradients at a time."""
    p, t = cfg.parallel, cfg.train
    sizes = stages_layers(cfg) if p.pp > 1 else [cfg.model.n_layers]
    placement = stage_ranks(p.pp, p.pp_virtual, "v" if p.pp_schedule == "zb_v" else "loop") if p.pp > 1 else [0]
    per_rank = [0.0] * p.pp
    for name, x in named_leaves(init(model_config(cfg), device="meta")).items():
        split = (p.tp if x.dim() > 1 else 1) * (p.ep if is_expert(name) else 1)
        per_rank[placement[stage_of(name, sizes)]] += x.numel() / split
    width = getattr(torch, t.param_dtype).itemsize + getattr(torch, t.reduce_dtype).itemsize
    return max(per_rank) * width


class UnitGather:
    """Gathers a unit's parameters to their compute placements (module doc): FSDP's part of
    parallelize.Parallel, which is one. Inside `prefetching(units)` the gathers run one unit ahead of the
    forward (Prefetch)."""

    def __init__(self, cfg, layouts: dict):
        self.cfg, self.layouts = cfg, layouts
        # where the gather's backward leaves each gradient: storage, but a partial sum over dp_replicate and
        # over cp where cp keeps the parameter whole (ranks holding other tokens, reduced once per step; under
        # FSDP the gather's reduce-scatter spans cp too: plan.py)
        self.grad_placements = {name: tuple(Partial() if d in ("dp_replicate", "cp") and not p.is_shard() else p
                                            for d, p in zip(layout.mesh.mesh_dim_names, layout.storage))
                                for name, layout in layouts.items()}
        self.param_dtype, self.reduce_dtype = (getattr(torch, cfg.train.param_dtype),
                                               getattr(torch, cfg.train.reduce_dtype))
        self.reshard_after_forward = cfg.parallel.reshard_after_forward
        self.gather_per_step = cfg.parallel.fsdp_gather == "per_step"
        self.ahead = None     # the Prefetch of the forward running now, if any
        self.in_flight = InFlight()
        self.once = None      # the step's OncePerStep, inside `step` where gather_per_step
        self.zeros = False    # inside `every_gradient`
        self.unit_buckets = {}    # (prefix, tree structure) -> the unit's buckets, built at its first gather

    def gathers_in_fp8(self, name: str) -> bool:
        """Whether the parameter `name` is gathered in float8 (packing.py): a dense block weight that a
        tensorwise fp8 recipe runs in float8."""
        return (is_fp8_linear(name) and not is_expert(name)       # a block's: layers.<i>.*
                and self.cfg.model.block_config(int(name.split(".")[1])).fp8 == "tensorwise")

    @contextlib.contextmanager
    def _within(self, name: str, value):
        """The attribute `name` set to `value` within it, back to what it was after."""
        before = getattr(self, name)
        setattr(self, name, value)
        try:
            yield
        finally:
            setattr(self, name, before)

    def prefetching(self, units: list):
        """Within it, the gathers run one unit ahead, the forward's and the backward's: `units` as
        models.transformer.units lists them."""
        return self._within("ahead", Prefetch(units))

    def step(self, n: int):
        """One step of n micro-batches (a pipeline stage's n): within it, under parallel.fsdp_gather="per_step",
        each unit is gathered once and its gradients reduce-scattered once (OncePerStep); else nothing changes."""
        return self._within("once", OncePerStep(n) if self.gather_per_step else None)

    def every_gradient(self):
        """Within it, gathering once per step, a unit's backward hands its shards zeros until its last, not
        nothing: torch's weight pass of a split backward (pipeline.py's W, stage_backward_weight) refuses a weight
        without a gradient."""
        return self._within("zeros", True)

    def before(self, prefix: str, params: dict) -> None:
        """Called as the forward reaches a unit, outside any recomputation: launch its gather and the
        next unit's, where not launched already (Prefetch) nor kept from an earlier micro-batch
        (OncePerStep). A no-op outside `prefetching`."""
        if self.ahead is None:
            return
        k = self.ahead.enter(prefix, tree_flatten(params)[0])
        for j in (k, k + 1):
            if j < len(self.ahead.units) and j not in self.ahead.launched:
                leaves, _, buckets = self.buckets(*self.ahead.units[j])
                self.ahead.launched[j] = {key: self.launch(b, [leaves[i] for i in js]) for key, b, js in buckets
                                          if self.once is None or b not in self.once.gathered}

    def after(self, output) -> None:
        """Called with the output of the unit the forward has just run: when its gradient is complete, the
        backward's gathers are launched one unit ahead (Prefetch.backward_reaches). A no-op outside
        `prefetching`."""
        first = output[0] if isinstance(output, (tuple, list)) else output   # a block's: (x, router stats)
        if self.ahead is not None and isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(functools.partial(self.ahead.backward_reaches, self.ahead.current))

    def buckets(self, prefix: str, params: dict) -> tuple[list, object, list]:
        """The unit's leaves, its tree structure and [(key, Bucket, leaf indices)]: one bucket per mesh and
        mesh dims that FSDP gathers over (the dense mesh's dp_shard, with cp; the expert mesh's edp). A unit's buckets
        depend on its names alone, and are built once (each pass asks twice a unit: a host cost)."""
        leaves, spec = tree_flatten(params)
        if (prefix, spec) not in self.unit_buckets:
            names = [f"{prefix}.{n}" if prefix else n for n in named_leaves(params)]
            members: dict = {}
            for j, name in enumerate(names):
                lay = self.layouts[name]
                # the mesh dims whose Shard storage the compute placements gather (dp_shard and cp, splitting one
                # dim in turn, gathered in one collective over both: plan.py); () where nothing is gathered
                dims = tuple(d for d, (s, c) in enumerate(zip(lay.storage, lay.compute)) if s != c)
                if dims:
                    members.setdefault((id(lay.mesh), dims, self.gathers_in_fp8(name)), []).append(j)
            self.unit_buckets[prefix, spec] = [(key, Bucket([names[j] for j in js], self.layouts, key[1], fp8=key[2]),
                                                js) for key, js in members.items()]
        return leaves, spec, self.unit_buckets[prefix, spec]

    def launch(self, bucket: Bucket, shards: list):
        """Start the gather of a bucket's shards (DTensors) in param_dtype, outside autograd."""
        with torch.no_grad():
            return bucket.launch_gather([s.detach().to_local().to(self.param_dtype) for s in shards])

    def regather(self) -> Regather:
        return Regather(self.launch)

    def recomputed_gather(self) -> RecomputedGather:
        return RecomputedGather(self.launch)

    def gather(self, prefix: str, params: dict, again: Regather | RecomputedGather | None = None) -> dict:
        """One unit's parameters (the subtree named `prefix`), storage -> compute placements in param_dtype,
        by _GatherUnit (module doc). `again`: how the backward gathers them again, a Regather (freed after the
        forward) or a RecomputedGather (the unit is recomputed, and this is called again by its recomputation)."""
        leaves, spec, buckets = self.buckets(prefix, params)
        out = [x.to(self.param_dtype) for x in leaves]   # what needs no gather (DDP, TP): the cast only
        recomputing = torch._C._current_graph_task_id() != -1
        launched = {}
        if recomputing:
            launched = again.take() if isinstance(again, RecomputedGather) else {}
        elif self.ahead is not None:     # the forward, prefetching
            k = self.ahead.current
            launched = self.ahead.launched.pop(k, {})
            if again is not None:
                self.ahead.again[k] = again
        for key, bucket, js in buckets:
            shards = [leaves[j] for j in js]
            gathered = _GatherUnit.apply(self, bucket, launched.get(key), *shards)
            if again is not None and not recomputing:
                again.track(key, bucket, shards, gathered)
            for j, g in zip(js, gathered):
                out[j] = g
        return tree_unflatten(out, spec)
