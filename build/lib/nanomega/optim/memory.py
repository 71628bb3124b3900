"""Optimizer-state memory: bytes held by `opt.init(params)`, in total and per parameter element.

    state_bytes(opt.init(params))                       # bytes of every tensor leaf of a state
    state_bytes_per_param(opt, params)                  # e.g. 8.0 for AdamW's fp32 moments (+ a few counts)
    state_bytes_per_param(opt, init(cfg, device="meta"))   # any model size: shapes only, nothing allocated

A "meta" tensor has shape and dtype but no storage, and `nbytes` still counts what it would hold, so the
state of an 8B-parameter model is measured without allocating it. An optimizer whose init does real maths
(an eigendecomposition, say) may not run on meta tensors; then the state is built on CPU zeros instead,
with a warning saying so, up to `fallback_limit` bytes of parameters (beyond that, an error names the cause).
"""
from __future__ import annotations

import warnings

import torch

from nanomega.tree import tree_leaves, tree_map


def state_bytes(opt_state) -> int:
    """Sum of nbytes over the tensor leaves of an optimizer state (meta tensors count as if allocated)."""
    return sum(x.nbytes for x in tree_leaves(opt_state) if isinstance(x, torch.Tensor))


def param_count(params) -> int:
    return sum(x.numel() for x in tree_leaves(params) if isinstance(x, torch.Tensor))


def state_bytes_per_param(opt, params, fallback_limit: int = 2 * 2**30) -> float:
    """state_bytes(opt.init(params)) / number of parameter elements. `params` may live on the meta device."""
    leaves = [x for x in tree_leaves(params) if isinstance(x, torch.Tensor)]
    try:
        state = opt.init(params)
    except (NotImplementedError, RuntimeError) as err:
        if not any(x.device.type == "meta" for x in leaves):
            raise
        need = sum(x.nbytes for x in leaves)
        if need > fallback_limit:
            raise RuntimeError(f"this optimizer's init does not run on meta tensors ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:160]}), and materializing the {need / 2**30:.1f} GiB "
                               f"of parameters exceeds fallback_limit={fallback_limit / 2**30:.1f} GiB") from err
        warnings.warn(f"optimizer init failed on meta tensors ({type(err).__name__}: "
                      f"{str(err).splitlines()[0][:160]}); measured its state on CPU zeros instead", stacklevel=2)
        real = tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype, device="cpu", requires_grad=x.requires_grad)
                        if isinstance(x, torch.Tensor) and x.device.type == "meta" else x, params)
        state = opt.init(real)
    return state_bytes(state) / param_count(params)
