"""Pipeline parallel: the model cut into stages over parallel.pp ranks, run by a schedule of actions.

    pipe = Pipeline(cfg, mesh, model_cfg) # this rank's stages; pipe.par: the stage's Parallel (or None)
    params = pipe.keep(tree)              # the parts of a parameter tree this rank holds
    loss, grads, stats = pipe.grads(params, micro_batches, parts)   # one step (parts: step.StepParts)

A stage is a contiguous slice of the model's units (models/transformer.py `run_units`): the first
holds the embedding, the last the final norm, the head and the loss; the blocks are split as
parallel.pp_layers says, or evenly (mesh.stages_layers). A rank holds pp_virtual stages
(schedules.stage_ranks: interleaved 1F1B loops over the ranks, ZB-V folds them into a V). Its
parameter tree keeps only its own parts, every leaf under its usual name (blocks as {"<index>": block}),
so sharding plans, optimizers and checkpoints work on it unchanged; the other dims of the mesh
(data, tensor, context parallel) apply within each stage (mesh.stage_mesh).

The schedule is data (parallel/schedules.py: GPipe, 1F1B, interleaved 1F1B, ZB-V; its doc says what F, B, I and W
do), and `grads` is one loop over this rank's actions; I and W are torch.distributed.pipelining's
stage_backward_input / stage_backward_weight, which keep the intermediate gradients between the two. Activations
and gradients move between ranks in the batches of schedules.p2p_program (dist.batch_isend_irecv, in lockstep with
the neighbours, so no send can wait forever for its receive, as one may on NCCL), or by hand between two stages of
one rank.

Ours, not torch.distributed.pipelining's schedules (re-decided 2026-12-03 with torch 2.13; bench/home_made.py,
bench/results/home_made.md): one 1F1B step of 4 micro-batches on 2 gloo ranks took 1,851 ms here and 1,880 ms in
Schedule1F1B over PipelineStage modules of the same units, with the same loss: no speed to gain. torch's stage is
an nn.Module whose shapes it infers at the first step, and its loss_fn sees only the last stage's output; a stage
here also differentiates its own MoE layers' router losses, combines float8 amax histories by max, runs its own
sub-mesh (FSDP, TP, CP, EP) and sums statistics and the clip norm over the stages. Ours also proves that each
rank's transfers complete when a send blocks until its receive is posted (schedules.check_blocking), and
nanomega/sim/contracts.py matches every transfer's shape. Size: 746 (444) lines (code), against 8,261 (5,477)
for torch's schedules, stage, _backward, microbatch and _utils.

A micro-batch's loss is its mean cross-entropy; each stage's gradients are summed over the
micro-batches in order and divided by their number, as the serial step does, then reduced over the
stage's data-parallel ranks (parallel/buckets.py). A stage with MoE layers also differentiates its
layers' router losses (the objective's terms: they need no other stage), and its experts are folded
onto the stage's own ranks (mesh.expert_grid). The loss and the router statistics are summed over the
stages (parallel/stage_stats.py), the clip norm too (`norm_over_stages`).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor import DTensor

from nanomega.models import init
from nanomega.models.loss import autocast_dtype
from nanomega.models.transformer import add_router_losses, objective, run_units, units
from nanomega.parallel import schedules
from nanomega.parallel.deferred import local_of
from nanomega.parallel.mesh import stage_of, stages_layers
from nanomega.parallel.parallelize import gathered_on_main
from nanomega.parallel.plan import as_dtensor
from nanomega.parallel.stage_stats import RouterStats
from nanomega.tree import named_leaves, tree_flatten


class Pipeline:
    """This rank's stages and their schedule: a parallelize.Layout, as a Parallel is (module doc)."""

    def __init__(self, cfg, mesh, model_cfg):
        p = cfg.parallel
        self.cfg, self.mesh = cfg, mesh
        self.whole = init(model_cfg, device="meta")      # names and shapes of the whole model
        self.pp, self.m = p.pp, cfg.train.grad_accum
        self.rank = mesh.get_local_rank("pp")
        self.placement = schedules.stage_ranks(p.pp, p.pp_virtual, "v" if p.pp_schedule == "zb_v" else "loop")
        self.n_stages = len(self.placement)
        self.sizes = sizes = stages_layers(cfg)
        self.blocks = [range(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(self.n_stages)]   # each stage's blocks
        self.stages = [s for s, r in enumerate(self.placement) if r == self.rank]
        args = (p.pp, self.m) + ((p.pp_virtual,) if p.pp_schedule == "interleaved_1f1b" else ())
        schedule = schedules.SCHEDULES[p.pp_schedule](*args)
        self.program = schedules.p2p_program(schedule, self.placement)[self.rank]   # actions and transfer batches
        axis = mesh.mesh_dim_names.index("pp")
        row = list(mesh.get_coordinate())
        row[axis] = slice(None)     # peers[r]: the global rank holding pipeline rank r at this rank's other coordinates
        self.peers = mesh.mesh[tuple(row)].tolist()
        self.pp_dim = (mesh, axis)     # the pp process group, as functional collectives take it
        self.par = None
        self.timeline = []   # (action, start, end) of the last step's computations (time.perf_counter)
        self.transfers = []  # the last step's batches of transfers, as posted (tests match them to the program)

    # ------------------------------------------------------------ which parameters live here

    @property
    def unit_par(self):
        """The stage's Parallel, where each unit's parameters are gathered; None on one process per stage."""
        return self.par

    def keep(self, tree: dict, stages=None) -> dict:
        """The parts of a parameter tree (the whole model's, or this rank's) that `stages` hold (this rank's)."""
        stages = self.stages if stages is None else stages
        blocks = tree["layers"].items() if isinstance(tree["layers"], dict) else enumerate(tree["layers"])
        out = {k: v for k, v in tree.items() if k != "layers" and stage_of(k, self.sizes) in stages}
        out["layers"] = {str(i): layer for i, layer in blocks if stage_of(f"layers.{i}", self.sizes) in stages}
        return out

    @property
    def layout_key(self) -> dict:
        p = self.cfg.parallel
        key = {"pp": p.pp, "pp_virtual": p.pp_virtual, "pp_placement": self.placement,
               "pp_blocks": [len(b) for b in self.blocks]}
        return {**key, **(self.par.layout_key if self.par is not None else {})}

    # ------------------------------------------------------------ point-to-point

    def _exchange(self, batch: list, outbox: dict, inbox: dict, like) -> None:
        """Post one batch of transfers (schedules.p2p_program) at once and wait for it: the sends take their
        tensors out of `outbox`, the receives land in `inbox`, both keyed (what, stage, micro); like(t) gives
        a receive's empty tensor, laid out as the stage computes with it (its local part receives). NCCL matches
        transfers between two ranks in order, not by tag; the program lists them in one order on both sides (the
        tag only helps gloo pair them the same way)."""
        ops = []
        for t in batch:
            key, peer = (t.what, t.stage, t.micro), self.peers[t.peer]
            if t.op == "send":
                tensor = local_of(outbox.pop(key)).detach().contiguous()
            else:
                inbox[key] = like(t)
                tensor = local_of(inbox[key])
            tag = (t.what == "grad") * self.n_stages * self.m + t.stage * self.m + t.micro
            ops.append(dist.P2POp(dist.isend if t.op == "send" else dist.irecv, tensor, peer, tag=tag))
        self.transfers.append(list(batch))
        for work in dist.batch_isend_irecv(ops):
            work.wait()     # sent buffers are released here, not held until the step ends

    @staticmethod
    def _like(tokens: torch.Tensor, d: int, autocast) -> torch.Tensor:
        """An empty residual stream [B, T, d] laid out like tokens [B, T], in the step's compute dtype."""
        local = local_of(tokens)
        with autocast():     # (a meta tensor, nanomega/sim/contracts.py, has no autocast: float32)
            dtype = autocast_dtype(local.device.type) or torch.float32
        x = torch.empty(*local.shape, d, dtype=dtype, device=local.device)
        if isinstance(tokens, DTensor):
            x = as_dtensor(x, tokens.device_mesh, tokens.placements, (*tokens.shape, d))
        return x

    def _hand(self, key: tuple, value, outbox: dict, inbox: dict) -> None:
        """`value` for the stage that key (what, stage, micro) names: into `inbox` if this rank holds that stage
        (its stages consume from `inbox` alone, what was received and what another of them made), else `outbox`."""
        (inbox if self.placement[key[1]] == self.rank else outbox)[key] = value

    # ------------------------------------------------------------ one step

    def context(self):
        """The stage's context (vocab-parallel loss, implicit replication: Parallel.context), if it has a mesh."""
        return self.par.context() if self.par is not None else contextlib.nullcontext()

    def grads(self, params, micro_batches, parts):
        """(mean loss, gradients in the optimizer placements, stats) of one step, as the plain step's loop
        (step.make_step_fns): `parts` (step.StepParts) hands the unit runner, the step's autocast and model
        config, and the sums of the gradients over the micro-batches (step.GradientSums) the loop uses too.
        Each stage runs every micro-batch: its FSDP may gather once per step (parallel/fsdp.py OncePerStep)."""
        step = contextlib.nullcontext() if self.par is None else self.par.step(len(micro_batches))
        with self.context(), step:
            return self._grads(params, micro_batches, parts.run, parts.autocast, parts.cfg, parts.sums)

    def _grads(self, params, micro_batches, run, autocast, model_cfg, gradient_sums):
        self.timeline, self.transfers = [], []
        trees = {s: self.keep(params, [s]) for s in self.stages}   # once per step, not per action
        last = self.n_stages - 1
        placed = [self.par.batch(x, y) if self.par is not None else (x, y) for x, y in micro_batches]
        inputs, outputs, weight_groups, router, losses, ce = {}, {}, {}, {}, {}, {}
        outbox, inbox = {}, {}           # (what, stage, micro) -> a tensor to send / one for a stage of this rank
        router_stats = RouterStats(self, model_cfg, local_of(placed[0][0]).device)
        n = len(micro_batches)
        reducer = self.par.reducer() if self.par is not None else None
        sums = gradient_sums(params, n, reducer)
        passes = dict.fromkeys(self.stages, 0)    # the weight-gradient passes (B, or W) each stage has run

        def weight_pass(s, stage_leaves, backward):
            """backward() -> (..., then the stage's weight gradients, None where unused), added to the sums.
            In the stage's last pass its data-parallel reduction starts (step.GradientSums), and the stage's
            buckets are launched as the pass ends, so they run while the rest of the schedule does (Megatron
            overlaps them with the pipeline's cool-down), not after it."""
            final = passes[s] == n - 1
            passes[s] += 1
            got = sums.backward(stage_leaves, backward, final)
            if final and reducer is not None:
                reducer.flush()
            return got

        def like(t):     # a receive's tensor: a residual stream, or the gradient of this rank's stage output
            if t.what == "act":
                return self._like(placed[t.micro][0], model_cfg.d_model, autocast)
            return torch.empty_like(outputs[t.stage, t.micro])     # a DTensor's: its local tensor's, placed alike

        for action in self.program:
            if isinstance(action, list):
                self._exchange(action, outbox, inbox, like)
                continue
            s, mb = action.stage, action.micro
            tokens, targets = placed[mb]
            stage_leaves = tree_flatten(trees[s])[0]
            t0 = time.perf_counter()
            if action.kind == "F":
                x = None if s == 0 else inbox.pop(("act", s, mb)).detach().requires_grad_(True)
                # FSDP's gathers one unit ahead inside the stage, in its forward and its backward (fsdp.Prefetch)
                stage_units = units(trees[s], model_cfg)
                ahead = contextlib.nullcontext() if self.par is None else self.par.prefetching(stage_units)
                with autocast():
                    with ahead:
                        # the last stage's head runs with the loss: its logits a chunk at a time (models/loss.py)
                        out, moe = run_units(trees[s], x, tokens, model_cfg, run, targets if s == last else None)
                    if s == last:
                        out, stats = objective(out, moe, tokens, targets, model_cfg)
                        losses[mb], ce[mb] = out.detach(), stats.get("ce", out).detach()
                    elif moe:     # the stage's router losses: part of the objective, differentiated here
                        router[s, mb] = add_router_losses(None, moe, model_cfg)[2]
                        router_stats.terms += [] if router[s, mb] is None else [router[s, mb].detach()]
                router_stats.add(s, moe)
                if s != last:
                    self._hand(("act", s + 1, mb), out, outbox, inbox)
                inputs[s, mb], outputs[s, mb] = x, out
            elif action.kind in ("B", "I"):
                out, x = outputs.pop((s, mb)), inputs.pop((s, mb))
                g = None if s == last else inbox.pop(("grad", s, mb))
                ins = [] if x is None else [x]
                extra = router.pop((s, mb), None)
                outs, grad_outs = ([out], None if g is None else [g]) if extra is None else ([out, extra], [g, None])
                if action.kind == "B" or x is None:    # the first stage has no input to hand back first
                    dx = weight_pass(s, stage_leaves, lambda: torch.autograd.grad(
                        outs, ins + stage_leaves, grad_outs, allow_unused=True))[:len(ins)]
                else:
                    dx, weight_groups[s, mb] = stage_backward_input(outs, grad_outs, ins, iter(stage_leaves))
                if x is not None:
                    dx = dx[0].redistribute(x.device_mesh, x.placements) if isinstance(x, DTensor) else dx[0]
                    self._hand(("grad", s - 1, mb), dx, outbox, inbox)
            elif (s, mb) in weight_groups:   # W: the weights' gradients, from what I kept
                weight_pass(s, stage_leaves, lambda: self._weights(stage_leaves, weight_groups.pop((s, mb))))
            self.timeline.append((action, t0, time.perf_counter()))
        grads, histories = sums.finish()
        loss = sum(losses[mb] for mb in sorted(losses)) / n if losses else None
        ce = sum(ce[mb] for mb in sorted(ce)) / n if ce else None
        loss, stats = router_stats.finish(loss, ce, n)
        return loss, grads, {**stats, **histories}

    def _weights(self, stage_leaves: list, groups) -> list:
        """W: the weights' gradients from what I kept (stage_backward_weight leaves them in .grad, taken out). It
        wants a gradient for every weight: FSDP gathering once per step hands zeros before a unit's last backward
        (parallel/fsdp.py OncePerStep), where a whole backward hands nothing."""
        with contextlib.nullcontext() if self.par is None else self.par.every_gradient():
            stage_backward_weight(iter(stage_leaves), groups)
        grads = [p.grad for p in stage_leaves]
        for p in stage_leaves:
            p.grad = None
        return grads

    # ------------------------------------------------------------ what every rank needs to see

    def sum_over_stages(self, values: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_reduce(values.detach().float(), "sum", self.pp_dim))

    def norm_over_stages(self, squares: torch.Tensor) -> torch.Tensor:
        """The global gradient norm from the sum of squares of this rank's stages' gradients."""
        return funcol.all_reduce(squares, "sum", self.pp_dim).sqrt()

    def global_norm(self, grads) -> torch.Tensor:
        """optim's `norm` for a stage on one process per pp rank: its squares summed over the stages."""
        return self.norm_over_stages(sum(g.float().square().sum() for g in tree_flatten(grads)[0]))

    def cross_entropy(self, params, x, y, model_cfg, run, autocast) -> torch.Tensor:
        """The batch's mean cross-entropy through the stages in order (forward only), on every rank (Layout)."""
        with self.context():
            tokens, targets = self.par.batch(x, y) if self.par is not None else (x, y)
            value = torch.zeros((), device=local_of(tokens).device)
            out = self.forward(params, tokens, model_cfg, run, autocast)
            if out is not None:
                ce, _ = objective(out, [], tokens, targets, model_cfg)
                value = self.par.scalar(ce) if self.par is not None else ce
            return self.sum_over_stages(value)     # the last stage's, on every rank (the others add zeros)

    def logits_at(self, params, tokens, row: torch.Tensor, model_cfg, run, autocast) -> torch.Tensor:
        """The logits at the sequence's row `row` ([1]) through the stages (Layout), on every rank: the last stage's,
        summed over pp with zeros from the others (exact: x + 0 = x)."""
        local = local_of(tokens)
        logits = torch.zeros(local.shape[0], model_cfg.padded_vocab, device=local.device)
        out = self.forward(params, tokens, model_cfg, run, autocast)
        if out is not None:
            out = out.full_tensor() if isinstance(out, DTensor) else out
            logits = out.index_select(1, row)[:, 0]
        return self.sum_over_stages(logits)

    def forward(self, params, tokens, model_cfg, run, autocast):
        """tokens (placed as the stage's mesh lays them out) through this rank's stages in order, forward only
        (evaluation, the sample on the mesh): the last stage's output on the rank that holds it, None elsewhere.
        Transfers go in the batches of schedules.p2p_program, as a step's: nothing can block forever."""
        d, out = model_cfg.d_model, None
        forwards = {r: [schedules.Action("F", s, 0) for s in range(self.n_stages) if self.placement[s] == r]
                    for r in range(self.pp)}
        outbox, inbox = {}, {}
        for action in schedules.p2p_program(forwards, self.placement)[self.rank]:
            if isinstance(action, list):
                self._exchange(action, outbox, inbox, lambda t: self._like(tokens, d, autocast))
                continue
            s = action.stage
            x = None if s == 0 else inbox.pop(("act", s, 0)).detach().requires_grad_(True)
            with autocast():
                out, _ = run_units(self.keep(params, [s]), x, tokens, model_cfg, run)
            if s < self.n_stages - 1:
                self._hand(("act", s + 1, 0), out, outbox, inbox)
        return out if self.placement[-1] == self.rank else None

    def full_on_main(self, params):
        """Every parameter whole on global rank 0 (None elsewhere), one at a time (parallelize.gathered_on_main):
        a stage's rank at rank 0's other coordinates sends the parameters rank 0 does not hold."""
        def sender(name: str) -> int:
            owner = self.placement[stage_of(name, self.sizes)]
            return 0 if owner == 0 else self.peers[owner] if self.peers[0] == 0 else -1   # -1: not in rank 0's row
        return gathered_on_main(self.whole, named_leaves(params), sender)
