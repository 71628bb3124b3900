"""AdamW: Adam's moment estimates with decoupled weight decay (Loshchilov & Hutter)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from nanomega.optim.base import GradientTransformation, bias_correction, optimizer, scalar_state, tree_zeros_like
from nanomega.optim.registry import Adam, Optimizer, register
from nanomega.tree import tree_flatten, tree_leaves, tree_unflatten


class AdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, state_dtype=None):
    """updates -> m_hat / (sqrt(v_hat) + eps), with bias-corrected first and second moments.
    state_dtype (e.g. torch.bfloat16) stores the first moment only; the maths runs in the gradient's
    dtype, and the second moment keeps full precision (its square root amplifies rounding)."""
    def init(params):
        return AdamState(scalar_state(params, torch.int64),
                         tree_zeros_like(params, state_dtype), tree_zeros_like(params))

    def update(updates, state, params=None):
        g, spec = tree_flatten(updates)
        count = state.count + 1
        stored_mu, mu_spec = tree_flatten(state.mu)
        # Out-of-place where an input is read, in place only on buffers this function just made:
        # pure to the caller, and three fewer full-size allocations per step in eager mode.
        mu = torch._foreach_lerp([m.to(x.dtype) for m, x in zip(stored_mu, g)], g, 1 - b1)
        nu = torch._foreach_mul(tree_leaves(state.nu), b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)
        bc1, bc2 = bias_correction(count, b1), bias_correction(count, b2)
        denom = torch._foreach_sqrt(nu)
        torch._foreach_div_(denom, torch.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(mu, denom)
        torch._foreach_div_(out, bc1)
        mu = [m.to(s.dtype) for m, s in zip(mu, stored_mu)]
        return tree_unflatten(out, spec), AdamState(count, tree_unflatten(mu, mu_spec), tree_unflatten(nu, mu_spec))

    return GradientTransformation(init, update)


def adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0, decay_mask=None, grad_clip=0.0, state_dtype=None):
    """clip -> Adam -> + wd * param (on decay_mask) -> * -lr.  Matches torch.optim.AdamW."""
    return optimizer({"adam": scale_by_adam(b1, b2, eps, state_dtype)}, schedule, weight_decay, decay_mask, grad_clip,
                     elementwise=True)


register(Optimizer("adamw", Adam, lambda s, state_dtype, parts: {"adam": scale_by_adam(s.beta1, s.beta2, s.eps,
                                                                                       state_dtype)}))
