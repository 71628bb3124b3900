"""Optimizer-state memory: bytes held by `opt.init(params)`, in total and per parameter element.

    state_bytes(opt.init(params))                       # bytes of every tensor leaf of a state
    state_bytes_per_param(opt, params)                  # e.g. 8.0 for AdamW's fp32 moments (+ a few counts)
    state_bytes_per_param(opt, init(cfg, device="meta"))   # any model size: shapes only, nothing allocated

A "meta" tensor has shape and dtype but no storage, and `nbytes` still counts what it would hold, so the
state of an 8B-parameter model is measured without allocating it. This is why an optimizer's `init` builds
its state from shapes alone (zeros, identities: docs/extending.md), as every registered one does.
"""
from __future__ import annotations

import torch

from nanomega.tree import tree_leaves


def state_bytes(opt_state) -> int:
    """Sum of nbytes over the tensor leaves of an optimizer state (meta tensors count as if allocated)."""
    return sum(x.nbytes for x in tree_leaves(opt_state) if isinstance(x, torch.Tensor))


def param_count(params) -> int:
    return sum(x.numel() for x in tree_leaves(params) if isinstance(x, torch.Tensor))


def state_bytes_per_param(opt, params) -> float:
    """state_bytes(opt.init(params)) / number of parameter elements. `params` may live on the meta device."""
    return state_bytes(opt.init(params)) / param_count(params)
