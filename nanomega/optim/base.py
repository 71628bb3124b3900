"""The optimizer protocol and the transforms every optimizer is chained from (optax-style).

An optimizer is a pair of pure functions:

    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = apply_updates(params, updates)          # params + updates

`grads`, `updates` and `params` are pytrees of the same structure; states are NamedTuples of
tensors (so they are pytrees too and go into checkpoints by name). Nothing is mutated.
Element-wise maths uses torch._foreach_* ops: one kernel launch per op for all leaves in eager
mode, and plain traceable ops for torch.compile.

`masked` and `partition` hand their inner transforms a flat {dotted name: tensor} dict, so
names survive nesting and states are keyed by parameter name.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, NamedTuple

import torch

from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_map, tree_unflatten


class GradientTransformation(NamedTuple):
    init: Callable
    update: Callable


class EmptyState(NamedTuple):
    pass


class CountState(NamedTuple):
    count: torch.Tensor  # int64 scalar: number of updates applied so far


def apply_updates(params, updates):
    """params + updates, as fresh leaf tensors that require grad (the next step differentiates them)."""
    with torch.no_grad():
        new = torch._foreach_add(tree_leaves(params), tree_leaves(updates))
    _, spec = tree_flatten(params)
    return tree_unflatten([p.requires_grad_(True) for p in new], spec)


def global_norm(tree) -> torch.Tensor:
    leaves = tree_leaves(tree)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves)))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates by min(1, max_norm / (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_."""
    def update(updates, state, params=None):
        leaves, spec = tree_flatten(updates)
        scale = (max_norm / (global_norm(leaves) + 1e-6)).clamp(max=1.0)
        return tree_unflatten(torch._foreach_mul(leaves, scale), spec), state

    return GradientTransformation(lambda params: EmptyState(), update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """updates + weight_decay * params (decoupled when chained after a preconditioner)."""
    def update(updates, state, params):
        leaves, spec = tree_flatten(updates)
        return tree_unflatten(torch._foreach_add(leaves, tree_leaves(params), alpha=weight_decay), spec), state

    return GradientTransformation(lambda params: EmptyState(), update)


def scale_by_learning_rate(schedule: Callable) -> GradientTransformation:
    """updates * -schedule(count): the step direction becomes a descent step."""
    def init(params):
        return CountState(torch.zeros((), dtype=torch.int64))

    def update(updates, state, params=None):
        leaves, spec = tree_flatten(updates)
        lr = schedule(state.count)
        return tree_unflatten(torch._foreach_mul(leaves, -lr), spec), CountState(state.count + 1)

    return GradientTransformation(init, update)


# ---------------------------------------------------------------- selecting parameters by name

def name_matcher(patterns) -> Callable[[str], bool]:
    """A predicate on dotted parameter names from fnmatch patterns such as "*norm*" or "*.bias"."""
    patterns = tuple(patterns)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def hidden_matrix(name: str, param) -> bool:
    """Matrices inside the blocks (attention and MLP projections, stacked [E, out, in] experts): the
    parameters a matrix optimizer (Muon, Shampoo, SOAP) updates. Embeddings and the LM head are
    matrices too, but they are lookup tables / classifiers and stay with AdamW, as in the Muon paper;
    so do an MoE router ([E, d]: a classifier over experts) and Qwen2-MoE's [1, d] shared-expert gate."""
    return param.ndim >= 2 and name.startswith("layers.") and ".router." not in name and "shared_gate" not in name


def per_expert(inner: GradientTransformation) -> GradientTransformation:
    """`inner` (Shampoo, SOAP) sees each expert of a stacked [E, out, in] weight as its own [out, in]
    matrix, named "<name>.<e>", so no preconditioner couples two experts; the updates are stacked back.
    Under expert parallel a rank holds whole experts, so its local experts are whole matrices too."""
    def split(tree) -> dict:
        out = {}
        for name, x in named_leaves(tree).items():
            if x.ndim == 3:
                out.update({f"{name}.{e}": m for e, m in enumerate(x.unbind(0))})
            else:
                out[name] = x
        return out

    def update(updates, state, params):
        flat = named_leaves(updates)
        out, state = inner.update(split(updates), state, split(params))
        out = named_leaves(out)
        merged = [torch.stack([out[f"{n}.{e}"] for e in range(x.shape[0])]) if x.ndim == 3 else out[n]
                  for n, x in flat.items()]
        _, spec = tree_flatten(updates)
        return tree_unflatten(merged, spec), state

    return GradientTransformation(lambda params: inner.init(split(params)), update)


def partition(transforms: dict, label_fn: Callable[[str, torch.Tensor], str]) -> GradientTransformation:
    """Route each parameter to transforms[label_fn(name, param)]; e.g. Muon for hidden matrices."""
    known: dict[str, str] = {}  # name -> label, so a compiled update traces no string matching

    def labels_of(flat_params: dict) -> dict:
        for n in flat_params.keys() - known.keys():
            known[n] = label_fn(n, flat_params[n])
        return {n: known[n] for n in flat_params}

    def split(flat: dict, labels: dict) -> dict:
        return {lab: {n: x for n, x in flat.items() if labels[n] == lab} for lab in transforms}

    def init(params):
        flat = named_leaves(params)
        labels = labels_of(flat)
        unknown = set(labels.values()) - set(transforms)
        if unknown:
            raise ValueError(f"partition labels {sorted(unknown)} have no transform; known: {sorted(transforms)}")
        groups = split(flat, labels)
        return {lab: t.init(groups[lab]) for lab, t in transforms.items()}

    def update(updates, state, params):
        flat_u, flat_p = named_leaves(updates), named_leaves(params)
        labels = labels_of(flat_p)
        u_groups, p_groups = split(flat_u, labels), split(flat_p, labels)
        merged, new_state = {}, {}
        for lab, t in transforms.items():
            if not u_groups[lab]:  # no parameter carries this label (foreach ops reject empty lists)
                new_state[lab] = state[lab]
                continue
            out, new_state[lab] = t.update(u_groups[lab], state[lab], p_groups[lab])
            merged.update(out)
        _, spec = tree_flatten(updates)
        return tree_unflatten([merged[n] for n in flat_u], spec), new_state

    return GradientTransformation(init, update)


def masked(inner: GradientTransformation, mask_fn: Callable[[str, torch.Tensor], bool]) -> GradientTransformation:
    """Apply `inner` only where mask_fn(name, param) is true; other updates pass through."""
    identity = GradientTransformation(lambda params: EmptyState(), lambda u, s, p=None: (u, s))
    return partition({"in": inner, "out": identity}, lambda n, p: "in" if mask_fn(n, p) else "out")


def tree_zeros_like(tree, dtype=None):
    return tree_map(lambda x: torch.zeros_like(x, dtype=dtype, memory_format=torch.preserve_format).detach(), tree)
