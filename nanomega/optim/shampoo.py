"""Shampoo (Gupta et al. 2018; blocked and grafted as in Anil et al. 2020), as a pure transform.

For a parameter block G of rank k (a matrix: k = 2), Shampoo keeps one Kronecker factor per
dimension, L_i = sum or EMA of G_(i) G_(i)^T (G_(i): the mode-i unfolding, n_i x prod(others)),
and preconditions with every factor's inverse 2k-th root applied along its own dimension:

    P = G x_1 L_1^(-1/2k) x_2 L_2^(-1/2k) ... x_k L_k^(-1/2k)      (a matrix: L^(-1/4) G R^(-1/4))

One update of scale_by_shampoo, per parameter (step = number of updates before this one):
  1. Adam direction A = m_hat / (sqrt(v_hat) + eps), exactly scale_by_adam's (state `adam`).
  2. Factors L_i <- beta L_i + (1 - beta) G_(i) G_(i)^T (beta < 1), or L_i + G_(i) G_(i)^T (beta == 1),
     per block: each dimension is cut into chunks of block_size (the last one shorter).
  3. Roots L_i^(-1/2k) are recomputed at steps start, start + f, start + 2f, ... (f =
     precondition_frequency, start = start_preconditioning_step) from the factors of step 2. A
     root that fails (non-finite in fp32 and in fp64) keeps the previous one and adds 1 to `failures`.
  4. Direction: before `start` the Adam direction A; from `start` on, per block, P rescaled to
     A's Frobenius norm on that block (grafting: Shampoo picks the direction, Adam the step size,
     so a learning rate tuned for AdamW carries over). Parameters of rank < 2 always use A.
  5. Momentum on that direction (heavy ball in Adam's first-moment form): buf <- mu buf + (1-mu) d,
     emitted as buf / (1 - mu^(step+1)). It points where classic heavy ball (buf <- mu buf + d)
     points, but the bias-corrected average keeps the grafted step size from step 0 on instead of
     growing it by up to 1/(1 - mu), so the lr still means what it means for AdamW. momentum=0
     emits d as is (and keeps no buffer). Note that Adam's b1 already smooths the graft norm.
Weight decay (decoupled) and the learning rate are applied after, by `shampoo`'s chain.

Any constant factor in L_i changes P only by a scalar, which grafting removes: this is why the
EMA needs no bias correction (it only shifts the weight of eps).

A rank-3 parameter (stacked experts [E, out, in]) gets three factors, E x E included, and
exponent -1/6. A dimension longer than block_size is cut into blocks, not left unpreconditioned.

torch.compile: the refresh of step 3 and its fp64 retry are linalg.branch calls, so the eigendecompositions,
the dominant cost, run only on refresh steps, and a compiled update neither graph-breaks nor recompiles. All
factors of one size and rank share one batched eigh. The Shampoo direction (a few small matmuls per block) is
computed on every step, also before `start`, and torch.where picks it or Adam's: cheap, and branch-free.

Against published implementations (tests/test_optim_references.py, 12 steps of random gradients):
pytorch_optimizer 4.1.0's Shampoo (AdaGrad sums, inverse 4th roots, no grafting) is beta=1, graft="none",
rel_floor=0, start 0: 4.2e-14 apart in fp64 (1.7e-5 in fp32). Its ScalableShampoo (EMA factors, no
graft, blocks, inv_root_override, momentum) is matched to <= 1e-7 in fp64. Intended differences:
- Grafting per block (ours) rather than per layer: up to 14% apart with blocks of 8 (8 x 12); identical
  with one block per layer, and our Adam graft is its RMSProp graft times sqrt(1 - b2^t) (b1 = 0).
- Momentum is emitted bias-corrected, buf / (1 - mu^t) (step 5): ours x (1 - mu^t) = the reference.
- The root: our eigh with the floor max(lambda, rel_floor x lambda_max) + eps, against its coupled
  Newton iteration with a ridge (its default): 2.7e-4 apart, within the iteration's own tolerance.
- eps is added at every root; ScalableShampoo seeds its factors with eps x I: invisible at 1e-12.
- Before the first root our direction is Adam's; pytorch_optimizer's Shampoo makes no move.
- Parameters of rank 1 get Adam's direction; the references precondition them with a full n x n root.

State (every leaf a tensor; names from the parameters' dotted names):
  count     int64 scalar: updates applied so far
  failures  int64 scalar: inverse roots that failed and kept the previous preconditioner (a
            cumulative count over all factors; report it in train metrics)
  adam      AdamState of the grafting direction (count, mu, nu: trees like the parameters)
  trace     momentum buffers, a tree like the parameters ({} when momentum == 0)
  factors   {name: [L per (block, dim)]}: blocks in row-major order, dims in order, for rank >= 2
  roots     {name: [L^(-1/2k) per (block, dim)]}, identity until the first refresh
Factors and roots are computed in fp32 (fp64 for fp64 parameters) and stored so by default;
factor_dtype / root_dtype store them lower (bf16: upcast on read, rounded on write, so a step
uses its fresh roots unrounded). state_dtype sets the dtype of the momentum buffer `trace` and of
the graft's Adam first moment (as scale_by_adam's state_dtype: the second moment keeps the
parameters' dtype).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from nanomega.optim import linalg
from nanomega.optim.adamw import AdamState, scale_by_adam
from nanomega.optim.base import (GradientTransformation, bias_correction, optimizer, per_expert, scalar_state,
                                 tree_zeros_like)
from nanomega.optim.registry import KroneckerFactors, Optimizer, register, setting, stored_dtype
from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_unflatten


class ShampooState(NamedTuple):
    count: torch.Tensor
    failures: torch.Tensor
    adam: AdamState
    trace: dict
    factors: dict
    roots: dict


def scale_by_shampoo(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, momentum: float = 0.0,
                     beta: float = 0.95, shampoo_eps: float = 1e-12, precondition_frequency: int = 10,
                     start_preconditioning_step: int = 10, block_size: int = 1024,
                     rel_floor: float = 1e-6, state_dtype=None, inv_root: int = 0,
                     precondition: str = "gradient", graft: str = "adam", factor_dtype=None,
                     root_dtype=None) -> GradientTransformation:
    """updates -> Shampoo direction grafted to Adam's per-block norm, with momentum (see module doc).

    b1, b2, eps: the Adam grafting direction. beta: EMA of the factors (1.0: AdaGrad-style sum).
    shampoo_eps, rel_floor: linalg.matrix_inverse_root's eps and relative eigenvalue floor.
    state_dtype, factor_dtype, root_dtype: the stored dtypes (None: as computed; module doc, State).
    The options of the ablation (bench/variants.py) and of the references (tests/test_optim_references.py):
    inv_root: every factor's root L^(-1/inv_root); 0 is Shampoo's 2k (-1/4 for a matrix), 2 gives
    L^(-1/2) G R^(-1/2) (Distributed Shampoo's inv_root_override).
    precondition: "gradient" preconditions this step's G (the module doc); "first_moment" the graft's
    bias-corrected first moment m_hat, as Distributed Shampoo preconditions its filtered gradient (use
    momentum=0 then).
    graft: "adam" rescales each block to the Adam direction's norm; "none" emits P as it is.
    """
    if precondition not in ("gradient", "first_moment"):
        raise ValueError(f"precondition must be 'gradient' or 'first_moment', got {precondition!r}")
    if graft not in ("adam", "none"):
        raise ValueError(f"graft must be 'adam' or 'none', got {graft!r}")
    if inv_root < 0:
        raise ValueError(f"inv_root must be >= 0 (0: twice the parameter's rank), got {inv_root}")
    adam = scale_by_adam(b1, b2, eps, state_dtype)
    start, freq = start_preconditioning_step, precondition_frequency

    def init(params):
        factors, roots = {}, {}
        for name, p in named_leaves(params).items():
            if p.ndim < 2:
                continue
            cd = linalg.compute_dtype(p.dtype)
            sizes = [d.stop - d.start for index in linalg.block_grid(p.shape, block_size) for d in index]
            factors[name] = [torch.zeros(n, n, dtype=factor_dtype or cd, device=p.device) for n in sizes]
            roots[name] = [torch.eye(n, dtype=root_dtype or cd, device=p.device) for n in sizes]
        zero = scalar_state(params, torch.int64)
        return ShampooState(zero, zero.clone(), adam.init(params),
                            tree_zeros_like(params, state_dtype) if momentum else {}, factors, roots)

    def refresh_roots(step, factors: dict, roots: dict, ranks: dict):
        """New roots on refresh steps (old ones where a root failed) and the number of failures."""
        orders = [inv_root or 2 * ranks[n] for n in factors for _ in factors[n]]  # L^(-1/2k), k the rank

        def compute(factors, roots):
            new, failed = linalg.inverse_roots(tree_leaves(factors), orders, tree_leaves(roots), shampoo_eps, rel_floor)
            return tree_unflatten(new, tree_flatten(roots)[1]), failed

        def keep(factors, roots):
            return linalg.unaliased(roots), tree_leaves(roots)[0].new_zeros((), dtype=torch.int64)

        refresh = (step >= start) & ((step - start) % freq == 0)
        return linalg.branch(refresh, compute, keep, (factors, roots))

    def update(updates, state, params=None):
        g_leaves, spec = tree_flatten(updates)
        grads = named_leaves(updates)
        step = state.count
        adam_dir, adam_state = adam.update(updates, state.adam, params)
        a_leaves = tree_leaves(adam_dir)

        if precondition == "first_moment":    # m_hat: the scalar bias correction matters without a graft
            bc1 = bias_correction(adam_state.count, b1)
            targets = {n: m / bc1 for n, m in zip(grads, tree_leaves(adam_state.mu))}
        else:
            targets = grads
        factors, blocks, old_roots = {}, {}, {}
        for name, L in state.factors.items():
            g = grads[name]
            cd = linalg.compute_dtype(g.dtype)   # stored factors and roots are upcast to it: the maths' dtype
            index = linalg.block_grid(g.shape, block_size)
            gf, tf = g.to(cd), targets[name].to(cd)
            k = g.ndim
            factors[name] = [linalg.accumulate(L[j * k + d].to(cd), linalg.gram(gf[i], d), beta)
                             for j, i in enumerate(index) for d in range(k)]
            old_roots[name] = [r.to(cd) for r in state.roots[name]]
            blocks[name] = [tf[i] for i in index]

        roots, failed = (refresh_roots(step, factors, old_roots, {n: grads[n].ndim for n in factors}) if factors
                         else ({}, torch.zeros_like(state.failures)))

        directions = []
        for (name, g), a in zip(grads.items(), a_leaves):
            if name not in factors:
                directions.append(a)
                continue
            k, shampoo_dir = g.ndim, torch.empty_like(a)
            for j, (b, i) in enumerate(zip(blocks[name], linalg.block_grid(g.shape, block_size))):
                P = linalg.along_dims(b, roots[name][j * k:(j + 1) * k])
                if graft == "adam":   # Shampoo's direction with Adam's norm; a zero block (P = 0) stays zero
                    p_norm, a_norm = torch.linalg.vector_norm(P), torch.linalg.vector_norm(a[i].to(P.dtype))
                    P = P * torch.where(p_norm > 0, a_norm / p_norm.clamp_min(torch.finfo(P.dtype).tiny), 0.0)
                shampoo_dir[i] = P    # rounded to the direction's dtype
            directions.append(torch.where(step >= start, shampoo_dir, a))

        trace = state.trace
        if momentum:
            buf, buf_spec = tree_flatten(state.trace)
            buf = torch._foreach_lerp(buf, [d.to(b.dtype) for d, b in zip(directions, buf)], 1.0 - momentum)
            bias = bias_correction(step + 1, momentum)     # 1 - mu^(step+1)
            directions = torch._foreach_div(buf, bias)
            trace = tree_unflatten(buf, buf_spec)
        out = [d.to(g.dtype) for d, g in zip(directions, g_leaves)]
        # Stored rounded (a no-op at the defaults); this step used them unrounded.
        stored_factors = {n: [L.to(factor_dtype or L.dtype) for L in Ls] for n, Ls in factors.items()}
        stored_roots = {n: [r.to(root_dtype or r.dtype) for r in rs] for n, rs in roots.items()}
        new_state = ShampooState(step + 1, state.failures + failed, adam_state, trace, stored_factors, stored_roots)
        return tree_unflatten(out, spec), new_state

    return GradientTransformation(init, update)


def shampoo(schedule, weight_decay=0.0, decay_mask=None, grad_clip=0.0, **direction) -> GradientTransformation:
    """clip -> scale_by_shampoo(**direction) -> + wd * param (decoupled, on decay_mask) -> * -lr."""
    return optimizer({"shampoo": scale_by_shampoo(**direction)}, schedule, weight_decay, decay_mask, grad_clip)


@dataclass(frozen=True)
class ShampooSettings(KroneckerFactors):
    start_preconditioning_step: int = setting(1, "[0, inf)", "Adam-grafted steps before preconditioning")
    shampoo_momentum: float = setting(0.0, "[0, 1)", "momentum on the grafted direction; 0: the graft's beta1")
    shampoo_block_size: int = setting(1024, "[1, inf)", "longer dimensions are cut into blocks of this size")


def shampoo_directions(s: ShampooSettings, state_dtype, parts) -> dict:
    """Each expert its own Shampoo (per_expert). P applies to Adam's m_hat, grafted to Adam's norm, with roots
    L^(-1/4) for a matrix: the defaults that won the ablation (docs/optimizers.md); scale_by_shampoo's
    arguments give the others."""
    direction = scale_by_shampoo(s.beta1, s.beta2, s.eps, s.shampoo_momentum, s.shampoo_beta, s.shampoo_eps,
                                 s.precondition_frequency, s.start_preconditioning_step, s.shampoo_block_size,
                                 state_dtype=state_dtype, precondition="first_moment",
                                 factor_dtype=stored_dtype(s.factor_dtype), root_dtype=stored_dtype(s.basis_dtype))
    return {"shampoo": per_expert(direction, parts.first_expert)}


register(Optimizer("shampoo", ShampooSettings, shampoo_directions, elementwise=False,
                   # per step, in blocks of b: each dim's factor and preconditioning; per refresh each block's eigh
                   matrix_cost=lambda s, mn: sum(
                       4 * mn[0] * mn[1] * min(d, b) + 4 / 3 * d * min(d, b) ** 2 * -(-o // b)
                       / s.precondition_frequency for d, o in (mn, mn[::-1]) for b in [s.shampoo_block_size]),
                   refresh_every=lambda s: s.precondition_frequency,
                   branches={"scale_by_shampoo.<locals>.refresh_roots.<locals>.compute": "refresh",
                             "scale_by_shampoo.<locals>.refresh_roots.<locals>.keep": "keep",
                             "matrix_inverse_root.<locals>.keep": "success",
                             "matrix_inverse_root.<locals>.retry": "failure"}))
