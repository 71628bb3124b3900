"""SOAP (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in the
eigenbasis of Shampoo's preconditioner.

    opt = soap(schedule)                                  # every parameter it is given
    opt = optim.build(OptimConfig(name="soap"), steps)    # SOAP on the hidden matrices, AdamW on the rest

For a matrix gradient G (m x n), Shampoo keeps the Kronecker factors L = EMA(G G^T) and R = EMA(G^T G).
SOAP takes their eigenvectors Q_L, Q_R, rotates the gradient into that basis, G' = Q_L^T G Q_R, runs
Adam there (one second-moment entry per entry of G'), and rotates Adam's direction back: Q_L D' Q_R^T.
With Q = I it is exactly Adam. A k-dim tensor gets one factor per dimension i, from its mode-i
unfolding G_(i) (dim i as rows, all the others flattened as columns): L_i = EMA(G_(i) G_(i)^T).

Per parameter, with t = the step number (1, 2, ...), in heavyball's order (the reference):
    t = 1:  L_i <- (1 - shampoo_beta) G_(i) G_(i)^T and Q_i <- eigh(L_i), every preconditioned dim i;
            no move, and m, v stay zero
    t >= 2: G'    =  G x_i Q_i^T                (x_i: multiply along dim i; bases from G_1 .. G_{t-1})
            m     <- b1 m + (1 - b1) G'         in the ROTATED space
            v     <- b2 v + (1 - b2) G'^2       in the ROTATED space
            out   =  (m / (sqrt(v / bc2) + eps) / bc1) x_i Q_i     bc = 1 - b^(t-1): Adam's bias correction,
                                                                   counted from the moments' first step
            L_i   <- shampoo_beta * L_i + (1 - shampoo_beta) * G_(i) G_(i)^T
            when t is a multiple of precondition_frequency, for step t + 1: Q_i <- one QR power-iteration
            step on L_i, v re-indexed along dim i to follow the columns, m <- m x_i (Q_i,old^T Q_i)
A gradient is projected only onto bases built from earlier gradients, and the moments hold only what was
projected onto them (the next section: why that order matters).

Design choices:
- The first moment lives in the rotated space, as the paper's and heavyball's: a step projects G
  alone into the basis (one matmul per preconditioned dim) and the direction back (one more). A
  refresh carries m out of the old basis and into the new one (two per dim, once every
  precondition_frequency steps); v is only re-indexed, being per-entry statistics of the basis.
  Kept in the original space (until 2026-12), m cost one more projection per step for the same update
  up to rounding: the default model's compiled update took 233 ms against 203 ms, 11% slower than
  heavyball's compiled SOAP instead of 5% faster (bench/optimizer_step.py). That state was "soap.mu";
  this one is "soap.mu_rotated", so an older SOAP checkpoint is refused by name, not misread.
- Step 1 builds the factors and bases of a parameter with at least one basis and nothing else (no move,
  zero moments), and the basis a step projects onto was built before it saw that step's gradient
  (heavyball's order). The other order (ours until 2026-12-03: a basis refreshed from factors that held
  G_t, and G_1 kept in the moments) left v's mass where past gradients had projected and m's elsewhere: at
  a refresh every step the step-2 update was 8-690x an Adam-sized step (64 x 32 fp32; 50x at step 3 for
  128 x 32); now the updates stay within 1.4x heavyball's (tests/test_optim_references.py). Parameters
  without any eigenbasis are plain Adam from step 1 (heavyball skips step 1 for every parameter: the one
  intended difference). Weight decay, chained after, still applies at step 1.
- Dimensions of size 1 or larger than max_precond_dim (the vocabulary) keep the identity: no
  factor or basis is stored for them.
- merge_dims (3+ dims only: merged_shape) gives a conv or stacked-expert weight fewer, larger factors.
  Matrices are never flattened: one factor of vec(G) would be full-matrix Adagrad, a different algorithm.
  Both moments are stored in the merged shape.
- torch.compile: "eigh now? refresh now?" depends on the count, a tensor: a nested linalg.branch over all
  parameters' bases, so compiled, the QR runs on 1 / precondition_frequency of the steps (a torch.where would
  run it every step: 10x the matrix work at the default frequency), and the keep branch copies the bases
  (d^2 each) and v, small next to the projections' matmuls. eigh (step 1 only) runs in fp64 when compiled:
  a failed fp32 eigh cannot be caught in a graph.
- Precision: factors, bases and all the maths run in fp32 (fp64 for fp64 parameters); state_dtype
  stores m and v (default: that compute dtype); the update comes back in the gradient's dtype.
  factor_dtype and basis_dtype store the factors and the bases (default: the compute dtype; bf16 is
  upcast on read and rounded on write, so a refresh computes from the rounded old basis).

Against the reference (heavyball 3.2.1's SOAP, tests/test_optim_references.py: 12 steps of random
gradients, updates compared one by one, heavyball as users run it): 9.9e-7 apart in fp64 (how eps
enters: ours adds it to sqrt(v_hat), heavyball clamps sqrt(v_hat) at eps) and 7.5e-4 in fp32 with a
refresh every step (heavyball shifts each factor by ~1e-4 x its largest eigenvalue before its fp32 QR
step; that alone moves its own fp32 updates 4.7e-4 from its fp64 ones). Differences left:
- A parameter without a basis is Adam from step 1 (above).
- soap() on a vector (<= max_precond_dim) preconditions it; heavyball by default does not (8-86%
  apart). optim.build sends vectors to AdamW, so only a direct soap() call sees it.
- The v re-indexing on a refresh and QR's sign flips: no effect beyond rounding.

Defaults are the paper's: b1 = 0.95, b2 = 0.95, shampoo_beta = 0.95, precondition_frequency = 10,
eps = 1e-8. The reference implementation allows dims up to 10000 and does not merge; the default here
is max_precond_dim = 1024 (OptimConfig's: a factor costs d^2 memory, its eigh/QR d^3 time).
optim.build takes b1/b2 from optim.beta1/beta2 (0.9/0.95 by default, as for AdamW).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanomega.optim.base import GradientTransformation, bias_correction, optimizer, per_expert, scalar_state
from nanomega.optim.linalg import (accumulate, along_dims, branch, compute_dtype, eigenbasis, gram, refresh_eigenbasis,
                                   unaliased)
from nanomega.optim.registry import KroneckerFactors, Optimizer, register, setting, stored_dtype
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten


class SoapState(NamedTuple):
    count: torch.Tensor  # int64 scalar: updates applied so far
    mu_rotated: dict     # {param name: first moment}, merged shape, rotated space (like nu)
    nu: dict             # {param name: second moment}, merged shape, rotated space
    factors: dict        # {param name: {str(merged dim): L_i}}, preconditioned dims only
    bases: dict          # {param name: {str(merged dim): Q_i}}, columns by descending eigenvalue


def merged_shape(shape, max_precond_dim: int, merge_dims: bool = True) -> tuple[int, ...]:
    """The shape SOAP preconditions: for 3+ dims and merge_dims, consecutive dims merged left to right
    while their product stays <= max_precond_dim ([8, 64, 32] -> [512, 32] at 1024); else unchanged."""
    shape = tuple(shape)
    if not merge_dims or len(shape) <= 2:
        return shape
    groups: list[int] = []
    for d in shape:
        if groups and groups[-1] * d <= max_precond_dim:
            groups[-1] *= d
        else:
            groups.append(d)
    return tuple(groups)


def _rotate(x: torch.Tensor, bases: dict, back: bool = False) -> torch.Tensor:
    """x x_i Q_i^T over every dim i with a basis (into the eigenbasis), or x x_i Q_i (back, `back`)."""
    return along_dims(x, [bases.get(str(i)) for i in range(x.ndim)], back)


def scale_by_soap(b1: float = 0.95, b2: float = 0.95, eps: float = 1e-8, shampoo_beta: float = 0.95,
                  precondition_frequency: int = 10, max_precond_dim: int = 1024, merge_dims: bool = True,
                  shampoo_eps: float = 1e-12, state_dtype=None, factor_dtype=None,
                  basis_dtype=None) -> GradientTransformation:
    """updates -> Adam's direction computed in the eigenbasis of Shampoo's factors (module docstring).
    factor_dtype, basis_dtype: the stored dtype of the factors and of the bases (None: the maths' own)."""
    def plan(shape):
        """The merged shape, and its dims that get a factor and a basis (the others keep the identity)."""
        merged = merged_shape(shape, max_precond_dim, merge_dims)
        return merged, tuple(i for i, d in enumerate(merged) if 1 < d <= max_precond_dim)

    def init(params):
        mu, nu, factors, bases = {}, {}, {}, {}
        for name, p in named_leaves(params).items():
            merged, dims = plan(p.shape)
            cd = compute_dtype(p.dtype)
            sd = state_dtype or cd
            mu[name] = torch.zeros(merged, dtype=sd, device=p.device)
            nu[name] = torch.zeros(merged, dtype=sd, device=p.device)
            factors[name] = {str(i): torch.zeros(merged[i], merged[i], dtype=factor_dtype or cd, device=p.device)
                             for i in dims}
            # Identity until step 1 replaces it with eigh's basis.
            bases[name] = {str(i): torch.eye(merged[i], dtype=basis_dtype or cd, device=p.device) for i in dims}
        return SoapState(scalar_state(params, torch.int64), mu, nu, factors, bases)

    def stored(bases):   # rounded to basis_dtype: every branch returns the bases as they are stored
        return {n: {k: Q.to(basis_dtype or Q.dtype) for k, Q in qs.items()} for n, qs in bases.items()}

    # The branches of "which bases this step": same signature (count, factors, bases, nu, mu) -> (bases, nu, mu),
    # factors and bases in the compute dtype.
    def first_bases(count, factors, bases, nu, mu):
        return (stored({n: {k: eigenbasis(L, shampoo_eps) for k, L in fs.items()} for n, fs in factors.items()}),
                unaliased(nu), unaliased(mu))      # step 1: the moments are still zero in any basis

    def refreshed_bases(count, factors, bases, nu, mu):
        new_bases, new_nu, new_mu = {}, {}, {}
        for n, fs in factors.items():
            v, new_bases[n], cd = nu[n], {}, next(iter(fs.values())).dtype   # the factors' dtype: the maths'
            for k, L in fs.items():
                new_bases[n][k], perm = refresh_eigenbasis(L, bases[n][k])
                v = v.index_select(int(k), perm)  # v's entries follow their basis vectors
            new_nu[n] = v
            # m is a vector of the space, not per-entry statistics: out of the old basis, into the new one
            new_mu[n] = _rotate(_rotate(mu[n].to(cd), bases[n], back=True), new_bases[n]).to(mu[n].dtype)
        return stored(new_bases), new_nu, new_mu

    def kept_bases(count, factors, bases, nu, mu):
        return unaliased(stored(bases)), unaliased(nu), unaliased(mu)

    def later_bases(count, factors, bases, nu, mu):
        due = count % precondition_frequency == 0
        return branch(due, refreshed_bases, kept_bases, (count, factors, bases, nu, mu))

    def update(updates, state, params=None):
        _, spec = tree_flatten(updates)
        grads = named_leaves(updates)
        names = list(grads)
        count = state.count + 1
        cds = {n: compute_dtype(g.dtype) for n, g in grads.items()}
        G = {n: g.to(cds[n]).reshape(plan(g.shape)[0]) for n, g in grads.items()}
        old_bases = {n: {k: Q.to(cds[n]) for k, Q in qs.items()} for n, qs in state.bases.items()}   # upcast

        # 1. Adam in the rotated space, on the gradient projected onto the bases of past gradients. A parameter
        # with a basis starts its moments at step 2: at step 1 it has no basis yet, so its G_1 is multiplied by
        # zero (m, v and the direction stay zero) and its bias corrections count from step 2.
        out, mu, nu = {}, {}, {}
        adam_count = (count - 1).clamp(min=1)
        for n in names:
            cd, has_basis = cds[n], bool(state.factors[n])
            t = adam_count if has_basis else count
            bc1, bc2 = bias_correction(t, b1, cd), bias_correction(t, b2, cd)
            g_rot = _rotate(G[n], old_bases[n])
            if has_basis:
                g_rot = g_rot * (count > 1).to(cd)
            m = torch.lerp(state.mu_rotated[n].to(cd), g_rot, 1 - b1)
            v = torch.addcmul(state.nu[n].to(cd) * b2, g_rot, g_rot, value=1 - b2)
            direction = m / (torch.sqrt(v) / torch.sqrt(bc2) + eps) / bc1
            out[n] = _rotate(direction, old_bases[n], back=True).reshape(grads[n].shape).to(grads[n].dtype)
            mu[n], nu[n] = m.to(state.mu_rotated[n].dtype), v.to(state.nu[n].dtype)

        # 2. Shampoo's factors take G_t, then the bases for step t + 1: eigh after step 1, a QR refresh after
        # every precondition_frequency-th step, with v re-indexed and m rotated to follow them.
        factors = {n: {k: accumulate(L.to(cds[n]), gram(G[n], int(k)), shampoo_beta)
                       for k, L in state.factors[n].items()} for n in names}
        bases = {n: state.bases[n] for n in names}
        with_basis = [n for n in names if factors[n]]
        if with_basis:
            ops = (count, *({n: tree[n] for n in with_basis} for tree in (factors, old_bases, nu, mu)))
            new_bases, new_nu, new_mu = branch(count == 1, first_bases, later_bases, ops)
            bases.update(new_bases)
            nu.update(new_nu)
            mu.update(new_mu)

        factors = {n: {k: L.to(factor_dtype or L.dtype) for k, L in fs.items()} for n, fs in factors.items()}
        state = SoapState(count, mu, nu, factors, bases)
        return tree_unflatten([out[n] for n in names], spec), state

    return GradientTransformation(init, update)


def soap(schedule, weight_decay=0.0, decay_mask=None, grad_clip=0.0, **direction) -> GradientTransformation:
    """clip -> scale_by_soap(**direction) -> + wd * param (decoupled, on decay_mask) -> * -lr, for every parameter
    it is given."""
    return optimizer({"soap": scale_by_soap(**direction)}, schedule, weight_decay, decay_mask, grad_clip)


@dataclass(frozen=True)
class SoapSettings(KroneckerFactors):
    max_precond_dim: int = setting(1024, "[1, inf)", "a longer dimension keeps the identity (no factor, no basis)")


def soap_directions(s: SoapSettings, state_dtype, parts) -> dict:
    direction = scale_by_soap(s.beta1, s.beta2, s.eps, s.shampoo_beta, s.precondition_frequency, s.max_precond_dim,
                              True, s.shampoo_eps, state_dtype, stored_dtype(s.factor_dtype),
                              stored_dtype(s.basis_dtype))
    return {"soap": per_expert(direction, parts.first_expert)}   # each expert its own, named by global index


register(Optimizer("soap", SoapSettings, soap_directions, elementwise=False,
                   # per step, each dim with a basis: its factor, the rotation in and out; per refresh its eigh/QR
                   matrix_cost=lambda s, mn: sum(6 * mn[0] * mn[1] * d + 4 / 3 * d ** 3 / s.precondition_frequency
                                                 for d in mn if d <= s.max_precond_dim),
                   refresh_every=lambda s: s.precondition_frequency,
                   branches={"scale_by_soap.<locals>.refreshed_bases": "refresh",
                             "scale_by_soap.<locals>.kept_bases": "keep",
                             "scale_by_soap.<locals>.first_bases": "first",
                             "scale_by_soap.<locals>.later_bases": "later"}))
