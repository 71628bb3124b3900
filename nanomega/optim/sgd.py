"""SGD with heavy-ball or Nesterov momentum and L2 weight decay, as torch.optim.SGD defines them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanomega.optim.base import GradientTransformation, optimizer, tree_zeros_like
from nanomega.optim.registry import Optimizer, register, setting
from nanomega.tree import tree_flatten, tree_unflatten


class TraceState(NamedTuple):
    trace: dict


def trace(momentum: float, nesterov: bool = False, state_dtype=None):
    """buf = momentum * buf + g; emit buf (heavy ball) or g + momentum * buf (Nesterov)."""
    def init(params):
        return TraceState(tree_zeros_like(params, state_dtype))

    def update(updates, state, params=None):
        g, spec = tree_flatten(updates)
        stored, buf_spec = tree_flatten(state.trace)
        buf = torch._foreach_mul([b.to(x.dtype) for b, x in zip(stored, g)], momentum)  # maths in g's dtype
        torch._foreach_add_(buf, g)
        out = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
        return tree_unflatten(out, spec), TraceState(tree_unflatten([b.to(s.dtype) for b, s in zip(buf, stored)],
                                                                    buf_spec))

    return GradientTransformation(init, update)


def sgd(schedule, momentum=0.0, nesterov=False, weight_decay=0.0, decay_mask=None, grad_clip=0.0,
        state_dtype=None):
    """clip -> + wd * param (coupled L2, before momentum, as torch.optim.SGD) -> momentum -> * -lr."""
    directions = {"momentum": trace(momentum, nesterov, state_dtype)} if momentum else {}
    return optimizer(directions, schedule, weight_decay, decay_mask, grad_clip, coupled_decay=True, elementwise=True)


@dataclass(frozen=True)
class SGDSettings:
    momentum: float = setting(0.9, "[0, 1)", "0 turns momentum off (and its state)")
    nesterov: bool = setting(False)


register(Optimizer("sgd", SGDSettings, coupled_decay=True,
                   directions=lambda s, state_dtype, parts: ({"momentum": trace(s.momentum, s.nesterov, state_dtype)}
                                                             if s.momentum else {})))
