"""The optimizer on a mesh: element-wise maths on local shards, matrix maths on whole matrices.

    opt = ParallelOptimizer(cfg, par, total_steps)
    state = opt.init(params)                         # params: DTensors in storage placements
    updates, state = opt.update(grads, state, params)   # grads in optimizer placements, updates in storage
    params = optim.apply_updates(params, updates)    # the serial protocol, unchanged

The serial optimizers from nanomega.optim run unchanged, on plain tensors; this file hands them
their distributed pieces (optim.build's `norm`, `whole_matrices` and `orthogonalize`):
- AdamW, SGD and the AdamW part of Muon/Shampoo/SOAP are element-wise, so they run on each rank's
  local shard of gradient, parameter and state. Under the distributed optimizer (ZeRO-1) that shard
  is a 1/dp slice of a replicated parameter; afterwards the new slices are all-gathered.
- Global-norm clipping needs one norm over all shards (`global_norm`): each rank sums the squares of
  its shards (divided by how many ranks hold a copy), one scalar all-reduce per mesh dim that shards
  a gradient adds them up (none under plain DDP).
- Muon, Shampoo and SOAP need whole matrices (Newton-Schulz of a shard is not a shard of Newton-
  Schulz). Where optimizer state is sharded over data parallel, each matrix has one owner that gathers it,
  keeps its state and computes its update (parallel/ownership.py; stacked experts split by FSDP over edp
  too, an owner taking a contiguous range of experts). Otherwise every rank gathers every matrix and
  computes it (experts: where they live, the edp ranks duplicating the work). Only gradients travel:
  the matrix directions do not read parameters (weight decay and the learning rate follow, element-wise,
  on the shards). Tensor-parallel ranks of an owner duplicate the work ("duplicated"), or, for Muon with
  parallel.muon_tp=distributed, run Newton-Schulz on their shards with one all-reduce of the Gram
  matrix per iteration (parallel/newton_schulz.py).
- Shampoo's and SOAP's state per expert ("<param>.<e>", optim.per_expert) is named by the expert's index
  in the whole model (`first_expert`), so a checkpoint reshards it by name; Muon's stacked momentum of a
  range of experts is that box of the whole (`state_box`).
"""
from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from nanomega import optim
from nanomega.parallel.newton_schulz import orthogonalize
from nanomega.parallel.ownership import Owners, matrix_cost
from nanomega.parallel.plan import as_dtensor, is_expert, state_dims
from nanomega.tree import leaf_names, map_with_name, named_leaves


class ParallelOptimizer:
    def __init__(self, cfg, par, total_steps: int, over_stages=None):
        self.mesh, self.layouts = par.mesh, par.layouts
        self.over_stages = over_stages   # pipeline parallel: squares -> the norm over every stage
        # names, not patterns, at step time: a compiled update traces no string matching
        self.experts = frozenset(n for n in self.layouts if is_expert(n))
        names = self.mesh.mesh_dim_names
        sharded_state = state_dims(cfg)     # dp_shard and cp under FSDP, dp_replicate under ZeRO-1 (plan.py)
        self.owner_dims = [i for i, d in enumerate(names) if d in sharded_state]
        # muon_tp=distributed: an optimizer registered with tp_shards (Muon) gets its matrices as tp shards
        # (DTensors on the tp mesh) and runs the sharded Newton-Schulz (parallel/newton_schulz.py);
        # validate_layout allows it only where the data-parallel dims hold whole copies (no ownership).
        self.tp_shards = (optim.spec_of(cfg.optim.name).tp_shards and cfg.parallel.muon_tp == "distributed"
                          and "tp" in names)
        self.tp_index = names.index("tp") if "tp" in names else None
        self._plan_norm()
        self.owners = [] if optim.spec_of(cfg.optim.name).elementwise else self._plan_owners(cfg)
        self.owned = frozenset(n for own in self.owners for n in own.names)
        # {stacked expert weight: the model-wide index of this rank's first expert}: its offset on dim 0 in compute
        # placements (Shard(0) on ep), or of its owned range's first, so that per-expert state (optim.per_expert) is
        # named by global expert and one expert's state has one name in every layout
        self.first_expert = {n: compute_local_shape_and_global_offset(lay.shape, lay.mesh, lay.compute)[1][0]
                             for n, lay in self.layouts.items() if n in self.experts}
        for own in self.owners:
            self.first_expert.update(own.first_expert)
        self.inner = optim.build(cfg.optim, total_steps, norm=self.global_norm, whole_matrices=self._whole_matrices,
                                 orthogonalize=orthogonalize, first_expert=self.first_expert)
        # the step's in-place update, one parameter at a time (optim.optimizer's leaf_by_leaf): element-wise
        # optimizers only; a matrix optimizer's owners move all matrices at once, so it runs `update` whole
        self.leaf_by_leaf = self._leaf_by_leaf if self.inner.leaf_by_leaf is not None else None

    # ------------------------------------------------------------ placements <-> local tensors

    def _wrap(self, name: str, local: torch.Tensor) -> DTensor:
        layout = self.layouts[name]
        return as_dtensor(local, layout.mesh, layout.optimizer, layout.shape)

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A collective: every rank must ask for the same names in the same order."""
        layout = self.layouts[name]
        if self.tp_shards and name not in self.experts:   # whole over data parallel already; stays split over tp
            return as_dtensor(local, self.mesh["tp"], [layout.optimizer[self.tp_index]], layout.shape)
        return self._wrap(name, local).redistribute(layout.mesh, self._held_whole(name)).to_local()

    def _held_whole(self, name: str) -> tuple:
        """The placements in which a rank holds `name` whole: replicated; a stacked expert weight, this rank's
        experts whole (compute's placements, with expert tensor parallel's split of the hidden dim (etp) gathered,
        as a dense tp-split matrix is for Muon, Shampoo and SOAP, and over edp where FSDP splits them)."""
        layout = self.layouts[name]
        if name not in self.experts:
            return (Replicate(),) * layout.mesh.ndim
        return tuple(Replicate() if d == "etp" else p for d, p in zip(layout.mesh.mesh_dim_names, layout.compute))

    def _local_slice(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a whole tensor (slicing only: Replicate -> Shard moves no data)."""
        if isinstance(whole, DTensor):
            return whole.to_local()
        layout = self.layouts[name]
        whole = as_dtensor(whole, layout.mesh, self._held_whole(name), layout.shape)
        return whole.redistribute(layout.mesh, layout.optimizer).to_local()

    # ------------------------------------------------------------ whole matrices

    def _plan_owners(self, cfg) -> list[Owners]:
        """The owners of the hidden matrices (module doc): dense ones over the owner dims, experts over the edp
        ranks where FSDP splits them, each balanced by matrix_cost (ownership.py says why apart). Known from
        names and shapes alone, at construction."""
        hidden = [n for n, lay in self.layouts.items() if optim.hidden_matrix(n, torch.empty(lay.shape, device="meta"))]
        cost, owners = matrix_cost(cfg.optim), []
        dense = [n for n in hidden if n not in self.experts]
        if self.owner_dims and dense:
            owners.append(Owners(self.mesh, self.owner_dims, self.layouts, dense, cost))
        experts = [n for n in hidden if n in self.experts]
        if not experts:
            return owners
        expert_mesh, optimizer = self.layouts[experts[0]].mesh, self.layouts[experts[0]].optimizer
        edp = [i for i, d in enumerate(expert_mesh.mesh_dim_names) if d == "edp" and optimizer[i].is_shard()]
        if edp:
            owners.append(Owners(expert_mesh, edp, self.layouts, experts, cost, stacked=experts))
        return owners

    def _whole_matrices(self, inner: optim.GradientTransformation) -> optim.GradientTransformation:
        """`inner` (Muon's, Shampoo's or SOAP's direction, on the hidden matrices) fed whole matrices; see
        the module doc. It reads gradients only, so parameters stay where they are (`params` is None)."""
        def to_whole(flat: dict) -> dict:   # owners' all-to-alls first, then the rest, every rank in one order
            whole = {}
            for own in self.owners:
                whole.update(own.to_owners({n: flat[n] for n in own.names}))
            return {**whole, **{n: self._whole(n, x) for n, x in flat.items() if n not in self.owned}}

        def init(params):
            return inner.init(to_whole(named_leaves(params)))

        def update(updates, state, params=None):
            flat_u = named_leaves(updates)
            whole_u, out = to_whole(flat_u), {}
            if whole_u:          # an owner may own nothing
                out, state = inner.update(whole_u, state, None)
                out = named_leaves(out)
            local = {}
            for own in self.owners:
                local.update(own.from_owners({n: out[n] for n in own.mine}, like=next(iter(flat_u.values()))))
            local.update({n: self._local_slice(n, u) for n, u in out.items() if n not in self.owned})
            return map_with_name(lambda n, _: local[n], updates), state

        return optim.GradientTransformation(init, update)

    # ------------------------------------------------------------ the protocol

    def init(self, params):
        return self.inner.init(self._local_optimizer_params(params))

    def state_box(self, name: str, local: torch.Tensor) -> tuple[list[int], list[int]]:
        """(global shape, offset of this rank's part) of an optimizer-state leaf, for checkpoints that reshard
        (checkpoint.py): a leaf named after a parameter ("adam.mu.<param>") and shaped like that parameter's
        shard in its optimizer placements is that shard of a whole tensor; one named after a stacked expert
        weight and holding whole experts (Muon's momentum of an owner's range) is those experts' box, from
        first_expert; any other leaf (a matrix owner's whole-matrix state, Kronecker factors, step counts,
        one expert's state "<param>.<e>" named by its global index e) is whole on the rank that holds it."""
        parts = name.split(".")
        param = next((p for p in (".".join(parts[i:]) for i in range(1, len(parts))) if p in self.layouts), None)
        if param is not None:
            layout = self.layouts[param]
            shape, offset = compute_local_shape_and_global_offset(layout.shape, layout.mesh, layout.optimizer)
            if tuple(local.shape) == tuple(shape):
                return list(layout.shape), list(offset)
            if param in self.experts and local.ndim == len(layout.shape) and local.shape[1:] == layout.shape[1:]:
                return list(layout.shape), [self.first_expert[param]] + [0] * (local.ndim - 1)
        return list(local.shape), [0] * local.ndim

    def _local_optimizer_params(self, params):
        return map_with_name(
            lambda n, p: p.detach().redistribute(self.layouts[n].mesh, self.layouts[n].optimizer).to_local(), params)

    def _plan_norm(self) -> None:
        """Which mesh dims the global norm reduces over and by how much each shard's sum of squares is
        divided, fixed at construction (a compiled update then reads no mesh and no placement): the dense
        parameters over the mesh, stacked experts over the expert mesh (split over ep, and edp under FSDP)."""
        self.norm_groups, self.norm_copies = [], {}    # (experts or not, mesh, the dims that shard any of them)
        for experts in (False, True):
            names = [n for n in self.layouts if (n in self.experts) == experts]
            if not names:
                continue
            mesh = self.layouts[names[0]].mesh
            replicated = {n: [isinstance(p, Replicate) for p in self.layouts[n].optimizer] for n in names}
            dims = [i for i in range(mesh.ndim) if not all(r[i] for r in replicated.values())]
            self.norm_groups.append((experts, mesh, dims))
            self.norm_copies.update({n: math.prod(mesh.size(i) for i in dims if r[i]) for n, r in replicated.items()})

    def global_norm(self, local_grads) -> torch.Tensor:
        """The norm of the whole gradient from this rank's shards (a tree of local tensors): each shard's
        sum of squares divided by the number of ranks holding a copy of it, then summed over the mesh
        dims that shard anything (none under plain DDP: there every rank already holds the whole
        gradient). Experts add their sum of squares over the dims that split them (ep, and edp under FSDP)."""
        local_grads = named_leaves(local_grads)
        total = None
        for experts, mesh, dims in self.norm_groups:
            part = torch.zeros((), dtype=torch.float32, device=next(iter(local_grads.values())).device)
            for n, g in local_grads.items():
                if (n in self.experts) == experts:
                    part = part + g.float().square().sum() / self.norm_copies[n]
            for dim in dims:
                part = funcol.all_reduce(part, "sum", (mesh, dim))
            total = part if total is None else total + part
        return total.sqrt() if self.over_stages is None else self.over_stages(total)

    def update(self, grads, state, params):
        """grads in optimizer placements, params in storage -> (updates in storage placements, state).

        The serial optimizer runs on this rank's shards; its updates go from optimizer to storage
        placements (ZeRO-1: the all-gather of the updated slices; FSDP, TP: nothing to move)."""
        local_g, local_p = self._on_shards(grads, params)
        updates, state = self.inner.update(local_g, state, local_p)
        return map_with_name(self._stored, updates), state

    def _leaf_by_leaf(self, grads, state, params, apply, keep=None):
        """`update` one parameter at a time (optim.optimizer's leaf_by_leaf on this rank's shards): apply(i,
        update, finite) receives parameter i's update in storage placements (ZeRO-1: its slices all-gathered,
        one parameter at a time)."""
        names = leaf_names(params)
        local_g, local_p = self._on_shards(grads, params)
        return self.inner.leaf_by_leaf(local_g, state, local_p,
                                       lambda i, u, finite: apply(i, self._stored(names[i], u), finite), keep)

    def _on_shards(self, grads, params) -> tuple:
        """(gradients, parameters): this rank's local tensors in the optimizer placements, in the tree of params."""
        local_g = named_leaves(grads)
        return map_with_name(lambda n, _: local_g[n].to_local(), params), self._local_optimizer_params(params)

    def _stored(self, name: str, update: torch.Tensor) -> DTensor:
        """This rank's update of `name` in the optimizer placements -> in storage placements (ZeRO-1: all-gathered)."""
        return self._wrap(name, update).redistribute(self.layouts[name].mesh, self.layouts[name].storage)
