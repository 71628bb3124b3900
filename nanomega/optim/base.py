"""The optimizer protocol and the transforms every optimizer is chained from (optax-style).

An optimizer is a pair of pure functions, on one process and on a mesh alike:

    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = apply_updates(params, updates)          # params + updates

`grads`, `updates` and `params` are pytrees of the same structure; states are dicts and NamedTuples
of tensors (so they are pytrees too and go into checkpoints by name). Nothing is mutated, except by the
train step (step.optimizer_step): it writes the new state into the old tensors where `step_kept` holds
(`write_back`; an element-wise optimizer's `leaf_by_leaf`, one parameter at a time: docs/memory.md), with
`update`'s numbers, bit for bit.
Element-wise maths uses torch._foreach_* ops: one kernel launch per op for all leaves in eager
mode, and plain traceable ops for torch.compile.

Every optimizer is the same chain (`optimizer`): clip -> its directions -> masked weight decay ->
learning rate. A chain's state is keyed by stage name, so a state leaf is named by what it is
("adam.mu.<param>", "lr.count"), never by the position of its stage. `masked` hands
its inner transform a flat {dotted name: tensor} dict, so names survive nesting.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from nanomega.tree import map_with_name, named_leaves, tree_flatten, tree_leaves, tree_map, tree_unflatten


class GradientTransformation(NamedTuple):
    init: Callable
    update: Callable
    # update applied one parameter at a time, writing into the old buffers (`optimizer`'s leaf_by_leaf);
    # None where a direction couples parameters (Muon, Shampoo, SOAP): the step then runs `update` whole
    leaf_by_leaf: Callable | None = None


class CountState(NamedTuple):
    count: torch.Tensor  # int64 scalar: number of updates applied so far


class ClipState(NamedTuple):
    grad_norm: torch.Tensor  # fp32 scalar: the global norm of the last gradient, before clipping (for the log)


def apply_updates(params, updates):
    """params + updates, as fresh leaf tensors that require grad (the next step differentiates them).
    Under torch.compile the caller sets requires_grad after the graph (step.py does): a tensor marked
    inside a graph cannot leave it without a graph break."""
    with torch.no_grad():
        new = torch._foreach_add([p.detach() for p in tree_leaves(params)], tree_leaves(updates))
    if not torch.compiler.is_compiling():
        new = [p.requires_grad_(True) for p in new]
    _, spec = tree_flatten(params)
    return tree_unflatten(new, spec)


def scalar_state(params, dtype: torch.dtype) -> torch.Tensor:
    """A zero scalar of optimizer state (a step count, a norm) on the parameters' device.

    Not on the CPU: a count there makes the learning rate and the bias corrections CPU tensors too.
    CUDA's foreach ops read a CPU scalar tensor by .item() for mul and div but refuse it for add's tensor
    overload, torch.where and the like rely on CPU-scalar promotion op by op, and a compiled update would
    mix CPU kernels into a GPU graph. On the parameters' device it is one device throughout; what a branch on
    it costs (torch.cond reads its predicate on the host) is said where a branch is taken (linalg.branch).
    With no parameters (a rank that owns no matrix) it stays on the CPU: that state is never updated."""
    device = next((x.device for x in tree_leaves(params) if isinstance(x, torch.Tensor)), torch.device("cpu"))
    return torch.zeros((), dtype=dtype, device=device)


def bias_correction(count: torch.Tensor, beta: float, dtype=torch.float32) -> torch.Tensor:
    """1 - beta**count as -expm1(count * log beta), in `dtype`: in fp32, beta**t then 1 - x loses ~1e-5 of
    1 - 0.999**t to cancellation. beta = 0 (no averaging) corrects nothing: 1."""
    t = count.to(dtype)
    return torch.ones_like(t) if beta == 0 else -torch.expm1(t * math.log(beta))


def global_norm(tree) -> torch.Tensor:
    leaves = tree_leaves(tree)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves)))


def _by_name(fn: Callable[[str, torch.Tensor], object]) -> Callable[[dict], dict]:
    """fn(name, param) over a flat {name: tensor}, memoized by name: filled at init, so that a compiled update
    traces no string matching (masked's selection, the learning rate's per-parameter scale)."""
    known: dict = {}

    def of(flat: dict) -> dict:
        for n in flat.keys() - known.keys():
            known[n] = fn(n, flat[n])
        return {n: known[n] for n in flat}
    return of


def chain(**stages: GradientTransformation) -> GradientTransformation:
    """The stages applied in order; the state is {stage name: its state}."""
    def init(params):
        return {name: t.init(params) for name, t in stages.items()}

    def update(updates, state, params=None):
        new_state = {}
        for name, t in stages.items():
            updates, new_state[name] = t.update(updates, state[name], params)
        return updates, new_state

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float, norm: Callable = global_norm) -> GradientTransformation:
    """Scale all updates by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; max_norm 0:
    no clipping. Either way the norm is kept in the state: the one place a step computes it, for the log.
    `norm` is handed in by a parallel run: the norm of the whole gradient from this rank's shards."""
    def update(updates, state, params=None):
        leaves, spec = tree_flatten(updates)
        total = norm(updates)
        if max_norm:
            scale = max_norm_scale(max_norm, total)
            leaves = torch._foreach_mul(leaves, scale)
        return tree_unflatten(leaves, spec), ClipState(total.detach().float())

    return GradientTransformation(lambda params: ClipState(scalar_state(params, torch.float32)), update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """updates + weight_decay * params (decoupled when chained after a preconditioner)."""
    def update(updates, state, params):
        leaves, spec = tree_flatten(updates)
        return tree_unflatten(torch._foreach_add(leaves, tree_leaves(params), alpha=weight_decay), spec), state

    return GradientTransformation(lambda params: (), update)     # no state


def scale_by_learning_rate(schedule: Callable, lr_scale: Callable | None = None) -> GradientTransformation:
    """updates * -schedule(count) (* lr_scale(name, update) where given): the direction becomes a descent step.
    lr_scale multiplies the learning rate per parameter (the AdamW part of a matrix optimizer: adam_lr_ratio)."""
    scales_of = _by_name(lambda name, x: 1.0 if lr_scale is None else float(lr_scale(name, x)))

    def init(params):
        scales_of(named_leaves(params))
        return CountState(scalar_state(params, torch.int64))

    def update(updates, state, params=None):
        leaves, spec = tree_flatten(updates)
        lr = schedule(state.count)
        groups: dict[float, list[int]] = {}   # one multiply per scale: all leaves at once without lr_scale
        for i, scale in enumerate(scales_of(named_leaves(updates)).values()):
            groups.setdefault(scale, []).append(i)
        out = [None] * len(leaves)
        for s, idx in groups.items():
            for i, u in zip(idx, torch._foreach_mul([leaves[i] for i in idx], -lr if s == 1.0 else -(lr * s))):
                out[i] = u
        return tree_unflatten(out, spec), CountState(state.count + 1)

    return GradientTransformation(init, update)


def optimizer(directions: dict, schedule: Callable, weight_decay: float = 0.0, decay_mask: Callable | None = None,
              grad_clip: float = 0.0, coupled_decay: bool = False, lr_scale: Callable | None = None,
              norm: Callable = global_norm, elementwise: bool = False) -> GradientTransformation:
    """clip -> directions -> + weight_decay * param (where decay_mask) -> * -lr: the chain every optimizer is.

    directions: {stage name: transform}, applied in order (AdamW: {"adam": scale_by_adam(...)}; a matrix
    optimizer: its own on the hidden matrices, then Adam on the rest). coupled_decay puts the decay before
    them instead (SGD's L2, as torch.optim.SGD). The state: {"clip", *directions, "decay", "lr"}.
    elementwise: every direction updates each parameter from its own gradient and state alone (Adam, SGD's
    momentum): the result then also has `leaf_by_leaf`, the same update one parameter at a time."""
    decay = add_decayed_weights(weight_decay)
    decay = masked(decay, decay_mask) if decay_mask else decay
    stages = {"clip": clip_by_global_norm(grad_clip, norm)}
    stages.update({"decay": decay, **directions} if coupled_decay else {**directions, "decay": decay})
    stages["lr"] = scale_by_learning_rate(schedule, lr_scale)
    whole = chain(**stages)
    if not elementwise:
        return whole
    after_clip = {name: t for name, t in stages.items() if name != "clip"}

    def leaf_by_leaf(grads, state, params, apply, keep=None):
        """`update`'s numbers, bit for bit, with one parameter's temporaries alive at a time (the step's
        in-place update, docs/memory.md). The clip's global norm is measured first over the whole gradient
        (a scalar), and with it whether the step is kept (`step_kept`: no host sync). Then each parameter's
        clipped gradient goes through the other stages alone, as a one-leaf {name: tensor} tree with its
        column of the state; apply(i, update, kept) receives its update (the caller writes it into parameter
        i, write_where, and drops it) and its new state leaves are written into `state`'s own tensors. The
        state's other leaves (counts), read by every parameter's update, come last. Returns (the new state:
        `state`'s tensors, written where kept, its counts new scalars, the measured norm; kept)."""
        g_leaves, spec = tree_flatten(grads)
        names, p_leaves = list(named_leaves(grads)), tree_leaves(params)
        total = norm(grads)
        kept = step_kept(total, keep)
        scale = max_norm_scale(grad_clip, total) if grad_clip else None
        columns = {stage: per_parameter(state[stage], spec) for stage in after_clip}
        written: dict = {}    # id(a leaf of `state`) -> what write_back made of it
        for i, (name, g, p) in enumerate(zip(names, g_leaves, p_leaves)):
            u = {name: g if scale is None else torch._foreach_mul([g], scale)[0]}
            for stage, t in after_clip.items():
                cut = tree_map(lambda x: {name: x.leaves[i]} if isinstance(x, _Column) else x, columns[stage])
                u, s = t.update(u, cut, {name: p})
                # this parameter's state written into its own tensors now; a count comes back a new scalar, and every
                # parameter reads the old one (the last parameter's new one is kept)
                written.update(zip(map(id, tree_leaves(cut)), tree_leaves(write_back(cut, s, kept))))
            apply(i, u[name], kept)
            del u
        return {stage: ClipState(total.detach().float()) if stage == "clip"
                else tree_map(lambda x: written.get(id(x), x), state[stage]) for stage in state}, kept

    return GradientTransformation(whole.init, whole.update, leaf_by_leaf)


def step_kept(norm: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Whether a step changes anything, as a device flag: its gradient's global norm is finite and the caller's
    own flag `keep` (train.py: the loss is finite), if given, holds. The one place the skip of a non-finite step
    is decided: read on the device, never by the host (no sync), and every write of the step selects by it
    (write_where), so a skipped step leaves parameters, moments, factors, counts and histories as they were."""
    finite = torch.isfinite(norm)
    return finite if keep is None else finite & keep


def write_where(kept: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> None:
    """`new` written into `old`'s own tensor where the device flag `kept` holds; else `old` stays (a DTensor:
    its local shard, placed alike)."""
    if hasattr(old, "to_local"):
        old, new = old.to_local(), new.to_local()
    torch.where(kept, new, old, out=old)


def write_back(state, new_state, kept: torch.Tensor):
    """`new_state` where `kept` holds, else `state`, laid out as they are (an optimizer's update returns its
    state's structure, each leaf its old shape): each tensor written into `state`'s own (write_where), so no
    second copy of the parameters' moments is kept; a scalar (a count) comes back a fresh one, which costs
    nothing; a leaf the update passed through (`new is old`: Shampoo's roots between recomputations) as it is.
    A compiled update (step.py) writes this way too: inside one graph the copies become the kernels' own stores
    into the old buffers."""
    old_leaves, spec = tree_flatten(state)
    new_leaves, new_spec = tree_flatten(new_state)
    if spec != new_spec:
        raise ValueError("an optimizer's update returned state laid out unlike its input; the step writes the new "
                         "state into the old leaf by leaf and needs the same structure")
    out = []
    for old, new in zip(old_leaves, new_leaves):
        if new is not old and old.ndim == 0:
            new = torch.where(kept, new, old)
        elif new is not old:
            write_where(kept, old, new)
            new = old
        out.append(new)
    return tree_unflatten(out, spec)


class _Column:
    """The leaves of a state subtree laid out like the parameters (Adam's mu), one per parameter: a pytree leaf."""
    __slots__ = ("leaves",)

    def __init__(self, leaves: list):
        self.leaves = leaves


def per_parameter(state, spec):
    """`state` with each subtree laid out like the parameters (its tree spec is `spec`: Adam's moments, SGD's
    trace) replaced by a _Column of its leaves, other nodes and leaves (counts) kept: the one walk over an optimizer
    state by parameter (leaf_by_leaf cuts each parameter's column from it and writes its new state back)."""
    def column(x) -> bool:
        return isinstance(x, (dict, list)) and tree_flatten(x)[1] == spec
    return tree_map(lambda x: _Column(tree_leaves(x)) if column(x) else x, state, is_leaf=column)


def max_norm_scale(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """clip_by_global_norm's factor: min(1, max_norm / (norm + 1e-6))."""
    return (max_norm / (total + 1e-6)).clamp(max=1.0)


# ---------------------------------------------------------------- selecting parameters by name

def hidden_matrix(name: str, param) -> bool:
    """Matrices inside the blocks (attention and MLP projections, stacked [E, out, in] experts): the
    parameters a matrix optimizer (Muon, Shampoo, SOAP) updates. Embeddings and the LM head are
    matrices too, but they are lookup tables / classifiers and stay with AdamW, as in the Muon paper;
    so do an MoE router ([E, d]: a classifier over experts) and Qwen2-MoE's [1, d] shared-expert gate."""
    return (param.ndim >= 2 and name.startswith("layers.") and ".router." not in name and "shared_gate" not in name
            and not name.endswith(".fp8_history"))


def per_expert(inner: GradientTransformation, first_expert: dict | None = None) -> GradientTransformation:
    """`inner` (Shampoo, SOAP) sees each expert of a stacked [E, out, in] weight as its own [out, in]
    matrix, named "<name>.<e>", so no preconditioner couples two experts; the updates are stacked back.
    e is the expert's index in the whole model: a tree holding experts from k on (expert parallel, where a
    rank holds whole experts) names them k, k+1, ... with first_expert={name: k}, so each expert's state
    has one name in every layout and a checkpoint reshards by name."""
    first_expert = first_expert or {}

    def expert_names(name: str, x) -> list[str]:
        return [f"{name}.{first_expert.get(name, 0) + e}" for e in range(x.shape[0])]

    def split(tree) -> dict | None:
        if tree is None:
            return None
        out = {}
        for name, x in named_leaves(tree).items():
            out.update(zip(expert_names(name, x), x.unbind(0)) if x.ndim == 3 else {name: x})
        return out

    def update(updates, state, params):
        out, state = inner.update(split(updates), state, split(params))
        out = named_leaves(out)

        def stacked(n, x):
            return torch.stack([out[k] for k in expert_names(n, x)]) if x.ndim == 3 else out[n]
        return map_with_name(stacked, updates), state

    return GradientTransformation(lambda params: inner.init(split(params)), update)


def masked(inner: GradientTransformation, mask_fn: Callable[[str, torch.Tensor], bool]) -> GradientTransformation:
    """Apply `inner` only where mask_fn(name, param) is true; other updates pass through. The state is
    inner's own, over the selected parameters (so a chain stage "adam" of masked Adam saves "adam.mu.<p>")."""
    selects = _by_name(mask_fn)

    def init(params):
        flat = named_leaves(params)
        chosen = selects(flat)
        return inner.init({n: p for n, p in flat.items() if chosen[n]})

    def update(updates, state, params=None):
        flat_u = named_leaves(updates)
        chosen = selects(flat_u)    # an update has its parameter's name and shape
        names = [n for n in flat_u if chosen[n]]
        if not names:   # nothing selected (foreach ops reject empty lists)
            return updates, state
        flat_p = None if params is None else named_leaves(params)
        out, state = inner.update({n: flat_u[n] for n in names}, state,
                                  None if flat_p is None else {n: flat_p[n] for n in names})
        out = named_leaves(out)
        return map_with_name(lambda n, u: out.get(n, u), updates), state

    return GradientTransformation(init, update)


def tree_zeros_like(tree, dtype=None):
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype, memory_format=torch.preserve_format).detach(), tree)
