"""Muon (Keller Jordan, 2024): momentum, then each hidden matrix's update replaced by its nearest
semi-orthogonal matrix (Newton-Schulz), so every direction of the matrix moves at the same rate.

    opt = muon(schedule, momentum=0.95)                   # hidden matrices only
    opt = optim.build(OptimConfig(name="muon"), steps)    # Muon on optim.hidden_matrix, AdamW on the rest

Fused Q/K/V: our wq, wk and wv are separate parameters, so each is orthogonalized on its own by
construction. A Megatron-style fused [3*d, d] QKV weight would need an option to split it into its
three blocks (and a fused gate/up MLP into two) before Newton-Schulz: orthogonalizing the
concatenation couples the blocks' singular values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanomega.optim.base import GradientTransformation, chain, optimizer, tree_zeros_like
from nanomega.optim.linalg import NS_COEFFICIENTS, newton_schulz
from nanomega.optim.registry import MatrixAdam, Optimizer, register, setting
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten

# Polar Express (Amsel, Persson, Musco & Gower 2025), 5 steps for singular values in [1e-3, 1], as the
# modded-nanogpt record uses them: the paper's per-step optimal quintics (with its safety factor and
# cushion), for X normalised by 1.02 x its Frobenius norm. That division is folded into the first
# triple here (p(x / s) = a/s x + b/s^3 x^3 + c/s^5 x^5), so newton_schulz's own normalisation serves.
_PE, _S = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
           (4.042929935166739, -2.808917465908714, 0.5000178451051316),
           (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
           (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
           (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)), 1.02
POLAR_EXPRESS = ((_PE[0][0] / _S, _PE[0][1] / _S**3, _PE[0][2] / _S**5),) + _PE[1:]
NS_SCHEDULES = {"jordan": NS_COEFFICIENTS, "polar_express": POLAR_EXPRESS}


class MuonState(NamedTuple):
    momentum: dict  # the EMA of gradients, per parameter name, in state_dtype


def shape_scale(shape, scale: str) -> float:
    """The factor on the orthogonalized update of a [..., rows, cols] parameter.

    "spectral":   sqrt(max(1, rows/cols)) (Keller Jordan; torch.optim.Muon's adjust_lr_fn="original").
    "match_adam": 0.2 * sqrt(max(rows, cols)) (Moonshot, "Muon is Scalable for LLM Training"): an
                  orthogonal update has RMS ~ 1/sqrt(max(rows, cols)), so this gives it AdamW's typical
                  update RMS of ~0.2 and lets AdamW's lr and weight decay carry over unchanged
                  (torch's adjust_lr_fn="match_rms_adamw").
    """
    rows, cols = shape[-2], shape[-1]
    if scale == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    if scale == "match_adam":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"muon scale {scale!r} is not one of ('spectral', 'match_adam')")


def scale_by_muon(momentum: float = 0.95, ns_steps: int = 5, scale: str = "spectral", state_dtype=None,
                  nesterov: bool = True, ns_coefficients=NS_COEFFICIENTS, eps: float = 1e-7,
                  ns_dtype=torch.bfloat16, orthogonalize=newton_schulz) -> GradientTransformation:
    """updates -> shape_scale * NS((1 - momentum) g + momentum buf) (Nesterov) or NS(buf), buf = EMA of g.

    The momentum buffer is the EMA buf <- momentum * buf + (1 - momentum) * g, as torch.optim.Muon
    and Keller Jordan's current Muon keep it. The textbook buf <- momentum * buf + g is this buffer
    times 1 / (1 - momentum), and Newton-Schulz starts by normalizing, so both give the same update;
    the EMA form makes our bf16 Newton-Schulz input, hence its output, bit-identical to torch's.
    Every leaf is [..., rows, cols]; 3 or more dims (stacked experts [E, out, in]) are E independent matrices.
    state_dtype stores the buffer (None: the parameter's dtype); the maths runs in the gradient's dtype.
    orthogonalize(x, steps, coefficients, eps, dtype) is linalg.newton_schulz; a parallel run hands in one
    that runs on tensor-parallel shards (parallel.muon_tp=distributed), never on a shard alone.
    """
    shape_scale((1, 1), scale)  # an unknown `scale` fails here, not at the first step

    def init(params):
        flat = named_leaves(params)
        bad = [f"{n} {tuple(p.shape)}" for n, p in flat.items() if p.ndim < 2]
        if bad:
            raise ValueError(f"Muon updates matrices only; route these to AdamW: {', '.join(bad)}")
        return MuonState(tree_zeros_like(params, state_dtype))

    def update(updates, state, params=None):
        g, spec = tree_flatten(updates)
        old, buf_spec = tree_flatten(state.momentum)
        buf = torch._foreach_lerp([b.to(x.dtype) for b, x in zip(old, g)], g, 1 - momentum)
        u = torch._foreach_lerp(g, buf, momentum) if nesterov else buf   # (1-m) g + m buf

        # One batched Newton-Schulz per (shape, dtype): a model's layers repeat a handful of shapes,
        # so this is a few large matmul chains instead of one small chain per parameter.
        groups: dict[tuple, list[int]] = {}
        for i, x in enumerate(u):
            groups.setdefault((tuple(x.shape), x.dtype, getattr(x, "placements", None)), []).append(i)
        out = [None] * len(u)
        for (shape, _, _), idx in groups.items():
            x = u[idx[0]] if len(idx) == 1 else torch.stack([u[i] for i in idx])
            o = orthogonalize(x, ns_steps, ns_coefficients, eps, ns_dtype) * shape_scale(shape, scale)
            for i, oi in zip(idx, [o] if len(idx) == 1 else o.unbind(0)):
                out[i] = oi
        new = [b.to(prev.dtype) for b, prev in zip(buf, old)]
        return tree_unflatten(out, spec), MuonState(tree_unflatten(new, buf_spec))

    return GradientTransformation(init, update)


class NeuronNormState(NamedTuple):
    second_moment: dict   # per parameter, [..., rows, 1]: the EMA of each output row's mean square


def scale_by_neuron_norm(beta2: float = 0.95, eps: float = 1e-10) -> GradientTransformation:
    """NorMuon's normalisation (Li et al. 2025), chained after Muon's direction O [..., rows, cols]:
    v <- beta2 v + (1 - beta2) mean_j O_ij^2 (one number per output neuron i, no bias correction),
    O' = O / (sqrt(v) + eps) row by row, then O' rescaled to O's Frobenius norm: Muon's update size,
    with rows that keep moving a lot slowed relative to the others. Scale-invariant in O, so Muon's
    shape scale (applied before) passes through. Needs whole rows: under parallel.muon_tp=distributed
    (shards) it is refused by the layout rules."""
    def init(params):
        return NeuronNormState({n: torch.zeros(*p.shape[:-1], 1, dtype=torch.float32, device=p.device)
                                for n, p in named_leaves(params).items()})

    def update(updates, state, params=None):
        _, spec = tree_flatten(updates)
        moments, result = {}, []
        for name, o in named_leaves(updates).items():
            x = o.float()
            v = torch.lerp(state.second_moment[name], x.square().mean(dim=-1, keepdim=True), 1 - beta2)
            y = x / (v.sqrt() + eps)
            norm, new_norm = (torch.linalg.vector_norm(t, dim=(-2, -1), keepdim=True) for t in (x, y))
            result.append((y * (norm / (new_norm + eps))).to(o.dtype))
            moments[name] = v
        return tree_unflatten(result, spec), NeuronNormState(moments)

    return GradientTransformation(init, update)


def muon(schedule, weight_decay=0.0, decay_mask=None, grad_clip=0.0, **direction) -> GradientTransformation:
    """clip -> scale_by_muon(**direction) -> + wd * param (on decay_mask) -> * -lr, for hidden matrices only.

    Equals torch.optim.Muon(lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
    adjust_lr_fn="original" for scale="spectral", "match_rms_adamw" for "match_adam"): its decay
    p *= 1 - lr * wd is ours, decoupled and not shape-scaled.
    """
    return optimizer({"muon": scale_by_muon(**direction)}, schedule, weight_decay, decay_mask, grad_clip)


@dataclass(frozen=True)
class MuonSettings(MatrixAdam):
    muon_momentum: float = setting(0.95, "[0, 1)", "Keller Jordan's and torch.optim.Muon's EMA, with Nesterov")
    ns_steps: int = setting(5, "[1, inf)", "Newton-Schulz iterations")
    # "spectral" sqrt(max(1, rows/cols)) | "match_adam" 0.2*sqrt(max(rows, cols))
    muon_scale: str = setting("spectral", choices=("spectral", "match_adam"))
    ns_dtype: str = setting("bfloat16", choices=("float32", "bfloat16"))   # "float32" for exact parity tests
    # "jordan" (3.4445, -4.7750, 2.0315) every step | "polar_express" (per step)
    ns_coefficients: str = setting("jordan", choices=tuple(NS_SCHEDULES))
    normuon_beta2: float = setting(0.0, "[0, 1)", "NorMuon's per-neuron second moment; 0 turns it off")


def muon_directions(s: MuonSettings, state_dtype, parts) -> dict:
    direction = scale_by_muon(s.muon_momentum, s.ns_steps, s.muon_scale, state_dtype,
                              ns_coefficients=NS_SCHEDULES[s.ns_coefficients], ns_dtype=getattr(torch, s.ns_dtype),
                              orthogonalize=parts.orthogonalize)
    if s.normuon_beta2:     # NorMuon: Muon's direction, then each output neuron's second moment
        direction = chain(muon=direction, normuon=scale_by_neuron_norm(s.normuon_beta2))
    return {"muon": direction}


register(Optimizer("muon", MuonSettings, muon_directions, elementwise=False, tp_shards=True,
                   matrix_cost=lambda s, mn: s.ns_steps * (4 * max(mn) + 2 * min(mn)) * min(mn) ** 2))
