"""Independent reference tests: our SOAP and Shampoo against published implementations, fed the same
random gradients, compared update by update.

References (pinned in pyproject's `test` extra; the tests skip where they are not installed):
- heavyball 3.2.1, `heavyball.SOAP` (chainable.scale_by_soap): the SOAP of Vyas et al. as heavyball ships it.
- pytorch_optimizer 4.1.0, `Shampoo` (Gupta et al. 2018: AdaGrad-sum factors, inverse 2k-th roots by SVD,
  no grafting) and `ScalableShampoo` (Anil et al. 2020: EMA factors, blocks, grafting, momentum).

Each step we compare our update (what scale_by_soap / scale_by_shampoo return) with the reference's
(p_before - p_after at lr = 1, no weight decay, clipping, warmup or schedule), per parameter, as
||ours - ref|| / ||ref||. Every reference runs eagerly (heavyball.utils.compile_mode = None).

How each reference is configured, what has to be aligned and why, and each tolerance (measured maximum,
then a margin) are in the tests' docstrings. Two facts shape the SOAP tests:
- Where a Kronecker factor has a degenerate eigenvalue (rank-deficient: an m x n gradient with m < n
  gives an n x n factor of rank m at step 1), its eigenbasis inside that eigenspace is whatever rounding
  makes it, in either library, and Adam in that basis is not rotation-invariant: perturbing G_1 by 1e-12
  (relative, float64) moves our own updates of an 8 x 12 matrix with both dims preconditioned by 0.15-0.59
  (relative, steps 2-12, refresh every step; 0.10-0.44 with bases never refreshed), those of a full-rank
  one by ~1e-12. So the compared
  parameters have full-rank factors from step 1, and dims above max_precond_dim (identity) are used to
  make one-sided cases. That is also why there is no 1-D parameter with a basis here (heavyball
  preconditions none unless precondition_1d=True; ours preconditions any dim <= max_precond_dim).
- float64 is where the algorithms can be compared tightly; float32 runs are checked too, with margins.
"""
from __future__ import annotations

import pytest
import torch

from nanomega.optim.shampoo import scale_by_shampoo
from nanomega.optim.soap import scale_by_soap

try:
    import heavyball   # needs Python >= 3.11 (numpy >= 2.3.4): the test extra installs it there only
except ImportError:
    heavyball = None
pytorch_optimizer = pytest.importorskip("pytorch_optimizer")
from pytorch_optimizer import ScalableShampoo, Shampoo  # noqa: E402
from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "heavyball_eager")  # one_thread: tests/conftest.py
requires_heavyball = pytest.mark.skipif(heavyball is None, reason="heavyball is not installed (pip install -e .[test])")


@pytest.fixture(scope="module")
def heavyball_eager():
    """heavyball torch.compiles its kernels unless compile_mode is None; eager here (and restored after)."""
    if heavyball is None:
        yield
        return
    old = heavyball.utils.compile_mode
    heavyball.utils.compile_mode = None
    yield
    heavyball.utils.compile_mode = old


def random_grads(shapes: dict, steps: int, dtype, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=g, dtype=dtype) for n, s in shapes.items()} for _ in range(steps)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def max_rel(ours: list[dict], ref: list[dict], names, steps) -> float:
    return max(rel(ours[t][n], ref[t][n]) for t in steps for n in names)


def ours_updates(tx, grads: list[dict]) -> list[dict]:
    params = {n: torch.zeros_like(g) for n, g in grads[0].items()}
    state = tx.init(params)
    out = []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(u)
    return out


def torch_optimizer_updates(opt, params: dict, grads: list[dict], after_step=None) -> list[dict]:
    """Each step's update of a torch.optim-style optimizer at lr=1: p_before - p_after."""
    out = []
    for s, g in enumerate(grads, 1):
        before = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
        out.append({n: before[n] - p.detach() for n, p in params.items()})
        if after_step is not None:
            after_step(s)
    return out


# ---------------------------------------------------------------- SOAP vs heavyball.SOAP

SOAP_HP = dict(b1=0.95, b2=0.95, shampoo_beta=0.95, eps=1e-8)   # the paper's (and both libraries') defaults
MAX_DIM = 10      # max_precond_dim: 12 and 16 keep the identity, so one-sided cases exist
NEVER = 10**6     # a precondition_frequency that never refreshes within the test: the step-1 eigh bases stay
STEPS = 12
SOAP_SHAPES = {
    "left": (8, 12),      # basis on dim 0 only (12 > MAX_DIM)
    "right": (12, 8),     # basis on dim 1 only
    "both": (10, 10),     # both sides; full-rank factors from step 1
    "merged": (6, 3, 2),  # merge_dims: [6, 6] in both libraries (ours merges left to right, heavyball keeps
                          # dim 0 and merges the rest from the right; they agree on this shape)
    "plain": (16, 16),    # no dim <= MAX_DIM: Adam
    "vector": (11,),      # Adam
}
WITH_BASIS = ["left", "right", "both", "merged"]
WITHOUT_BASIS = ["plain", "vector"]


def ours_soap(grads, precondition_frequency):
    """Our scale_by_soap's updates, configured as SOAP_HP, MAX_DIM and merged dims."""
    return ours_updates(scale_by_soap(**SOAP_HP, precondition_frequency=precondition_frequency,
                                      max_precond_dim=MAX_DIM, merge_dims=True), grads)


def heavyball_soap(grads, precondition_frequency, repeat_first=False):
    """heavyball.SOAP's updates, configured as SOAP_HP: lr 1, no weight decay, warmup, PaLM beta2 schedule,
    clipping, MARS or caution; fp32 (fp64) state; fixed refresh frequency (use_precond_schedule=False).

    Its refresh schedule starts at 0.5/f: heavyball refreshes after step s when a running sum of 1/f crosses
    an integer, and from 0 the float sum of three 1/3s falls short of 1.0, which moves every later refresh
    by a step; from 0.5/f the crossings are at s = f, 2f, ... as the frequency says (and as ours refreshes).

    repeat_first: fed G_1, G_1, G_2, ..., G_T and its first step dropped. heavyball's step 1 only sets up,
    for every parameter; ours only for parameters with a basis (the others are Adam from step 1), so the
    parameters without a basis are compared this way."""
    dtype = grads[0]["left"].dtype
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads[0].items()}
    opt = heavyball.SOAP(list(params.values()), lr=1.0, betas=(SOAP_HP["b1"], SOAP_HP["b2"]),
                         shampoo_beta=SOAP_HP["shampoo_beta"], eps=SOAP_HP["eps"], weight_decay=0.0,
                         precondition_frequency=precondition_frequency, max_precond_dim=MAX_DIM, merge_dims=True,
                         precondition_1d=False, warmup_steps=0, use_precond_schedule=False, palm=False,
                         gradient_clipping=None, update_clipping=None, mars=False, caution=False,
                         storage_dtype="float64" if dtype == torch.float64 else "float32")
    opt.inner_group["cumulative_prob"] = 0.5 / precondition_frequency
    if repeat_first:
        return torch_optimizer_updates(opt, params, [grads[0]] + grads)[1:]
    return torch_optimizer_updates(opt, params, grads)


@requires_heavyball
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 3e-6), (torch.float32, 2e-5)])
def test_soap_matches_heavyball_with_the_first_bases(dtype, tol):
    """Bases from eigh after step 1, never refreshed (precondition_frequency huge on both sides): Adam in the
    eigenbasis of G_1's factors, with one- and two-sided bases, merged dims, and no basis (Adam) — our whole
    update path but the refresh. heavyball as users run it; its parameters without a basis fed G_1 twice.

    Both libraries' step 1 only builds the factors and bases of a parameter with a basis: no move, nothing in
    the moments. Measured max relative difference over 12 steps: float64 9.9e-7 (all of it is how eps
    enters: ours sqrt(v_hat) + eps, heavyball max(sqrt(v_hat), eps)), float32 2.8e-6. Tolerance: 3e-6
    (float64), 2e-5 (float32).
    """
    grads = random_grads(SOAP_SHAPES, STEPS, dtype)
    ours = ours_soap(grads, NEVER)
    ref = heavyball_soap(grads, NEVER)
    for n in WITH_BASIS:
        assert torch.count_nonzero(ours[0][n]) == 0 and torch.count_nonzero(ref[0][n]) == 0, n
    assert max_rel(ours, ref, WITH_BASIS, range(1, STEPS)) < tol
    assert max_rel(ours, heavyball_soap(grads, NEVER, repeat_first=True), WITHOUT_BASIS, range(STEPS)) < tol


@requires_heavyball
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 3e-6), (torch.float32, 2e-3)])
@pytest.mark.parametrize("precondition_frequency", [1, 2, 3])
def test_soap_matches_heavyball_with_refreshes(dtype, precondition_frequency, tol):
    """QR power-iteration refreshes after every 1, 2, 3 steps on both sides, which exercises the refresh
    itself, the re-sorting of the basis by estimated eigenvalue and the re-indexing of v that follows it
    (heavyball instead leaves columns in place), QR's sign flips (heavyball fixes them) and the first
    moment's re-rotation at each refresh (both keep it in the rotated space). All of these are equivalent in
    exact arithmetic; this shows it. Both refresh after their update, from factors that include G_t, for
    use from step t + 1.

    Measured max relative difference (steps 2..12, and every step of the parameters without a basis;
    frequencies 1-3): float64 9.9e-7 (eps handling, as in the fixed-basis test), tolerance 3e-6. float32
    7.5e-4 (frequency 1), 4.1e-4 (2), 8.3e-5 (3); tolerance 2e-3: heavyball's QR step runs on F + c I,
    c = 64 n * 1.2e-7 * lambda_max ~ 1e-4 of lambda_max in float32, and a power-iteration step on F + c I
    is not one on F (heavyball's float32 updates are up to 4.7e-4 from its own float64 ones).
    """
    grads = random_grads(SOAP_SHAPES, STEPS, dtype)
    ours = ours_soap(grads, precondition_frequency)
    ref = heavyball_soap(grads, precondition_frequency)
    for n in WITH_BASIS:
        assert torch.count_nonzero(ours[0][n]) == 0 and torch.count_nonzero(ref[0][n]) == 0, n
    assert max_rel(ours, ref, WITH_BASIS, range(1, STEPS)) < tol
    repeated = heavyball_soap(grads, precondition_frequency, repeat_first=True)
    assert max_rel(ours, repeated, WITHOUT_BASIS, range(STEPS)) < tol


@requires_heavyball
def test_soap_intended_difference_from_heavyball_is_adam_from_step_one_without_a_basis():
    """The one intended difference, and that the comparison above needs its alignment: a parameter with no
    basis (every dim above max_precond_dim, or a vector) is plain Adam in ours from step 1, while heavyball
    skips step 1 for every parameter (float64: its step 1 moves nothing; from step 2 on its Adam is one
    gradient behind ours, measured 0.25-0.9 relative apart)."""
    grads = random_grads(SOAP_SHAPES, STEPS, torch.float64)
    ours, ref = ours_soap(grads, 3), heavyball_soap(grads, 3)
    for n in WITHOUT_BASIS:
        assert torch.count_nonzero(ref[0][n]) == 0 and ours[0][n].norm() > 1.0, n
    assert min(max_rel(ours, ref, WITHOUT_BASIS, [t]) for t in range(1, STEPS)) > 0.1


@requires_heavyball
@pytest.mark.parametrize("shape", [(64, 32), (128, 32), (8, 12)])
def test_soap_every_step_refresh_keeps_update_size_like_heavyball(shape):
    """Refresh after every step, float32, default max_precond_dim, 3 seeds x 22 steps: our update's norm stays
    within 2x heavyball's at every step (measured at most 1.22x, 1.22x and 1.16x for these shapes, over 6
    seeds: rounding in the rank-deficient factors' bases). Until 2026-12-03 ours refreshed BEFORE its update,
    from factors that included G_t, and kept G_1 in the moments: its step-2 update was 8-690x an Adam-sized
    step (64 x 32: 358x on seed 0), because m's content landed on rotated entries whose v was near zero."""
    for seed in range(3):
        grads = random_grads({"w": shape}, 22, torch.float32, seed)
        ours = ours_updates(scale_by_soap(**SOAP_HP, precondition_frequency=1), grads)
        params = {"w": torch.nn.Parameter(torch.zeros(shape))}
        opt = heavyball.SOAP(list(params.values()), lr=1.0, betas=(SOAP_HP["b1"], SOAP_HP["b2"]),
                             shampoo_beta=SOAP_HP["shampoo_beta"], eps=SOAP_HP["eps"], weight_decay=0.0,
                             precondition_frequency=1, max_precond_dim=1024, warmup_steps=0,
                             use_precond_schedule=False, palm=False, gradient_clipping=None, update_clipping=None)
        ref = torch_optimizer_updates(opt, params, grads)
        for t in range(1, len(grads)):
            assert ours[t]["w"].norm() < 2 * ref[t]["w"].norm(), (seed, t)


# ---------------------------------------------------------------- Shampoo vs pytorch_optimizer

SHAMPOO_SHAPES = {"wide": (8, 12), "square": (16, 16), "tall": (12, 8), "cube": (3, 4, 5)}


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 5e-5)])
@pytest.mark.parametrize("frequency", [1, 3])
def test_shampoo_matches_pytorch_optimizer_shampoo(dtype, tol, frequency):
    """pytorch_optimizer.Shampoo (Gupta et al.: factors eps I + sum G G^T, each applied as its inverse 2k-th
    root from an SVD, no grafting, here without momentum) vs ours with beta=1.0 (AdaGrad sums),
    graft="none", momentum=0, inv_root=0 (-1/(2k)), shampoo_eps=matrix_eps=1e-6 (ours adds it to the
    eigenvalues, the reference to the matrix: the same root), rel_floor=0 (our eigenvalue floor off),
    one block per dim. Matrices 8x12, 16x16, 12x8 and a rank-3 tensor (exponent -1/6).

    Refresh every `frequency` steps: the reference recomputes roots at its steps f, 2f, ... (1-based) and its
    roots are zero matrices before the first (zero updates); ours at start + k f (0-based), so start =
    f - 1, and before it ours emits the Adam direction: compared from step f on.

    Measured max relative difference over 12 steps: float64 4.2e-14 (tolerance 1e-12); float32 1.7e-5, at
    step 1 of the wide and tall matrices, whose larger factor has rank 8 of 12 then (the rounding noise in
    its null space is raised to the -1/4 power differently: SVD takes |lambda|, ours clamps at 0); 1.4e-6
    from step 2 on. Tolerance 5e-5. Our default rel_floor=1e-6 gives the same numbers here.
    """
    grads = random_grads(SHAMPOO_SHAPES, STEPS, dtype)
    tx = scale_by_shampoo(beta=1.0, graft="none", momentum=0.0, inv_root=0, shampoo_eps=1e-6, rel_floor=0.0,
                          precondition_frequency=frequency, start_preconditioning_step=frequency - 1,
                          block_size=1024)
    ours = ours_updates(tx, grads)
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads[0].items()}
    opt = Shampoo(list(params.values()), lr=1.0, momentum=0.0, weight_decay=0.0, matrix_eps=1e-6,
                  preconditioning_compute_steps=frequency)
    ref = torch_optimizer_updates(opt, params, grads)
    assert all(ref[t][n].abs().max() == 0 for t in range(frequency - 1) for n in SHAMPOO_SHAPES)
    assert max_rel(ours, ref, SHAMPOO_SHAPES, range(frequency - 1, STEPS)) < tol


B2 = 0.9   # ScalableShampoo's beta2: its factor EMA and its RMSProp graft's second moment


def scalable_shampoo(grads, graft, block_size=1024, inv_root=0, beta1=0.0, frequency=1, use_svd=True,
                     matrix_eps=1e-12):
    """pytorch_optimizer.ScalableShampoo's updates: no weight decay, preconditioned from step 1, statistics
    every step, no shape merging (shape_interpretation=False), every dim preconditioned, no Nesterov,
    momentum an EMA (moving_average_for_momentum), diagonal_eps 1e-30 (the graft's eps)."""
    params = {n: torch.nn.Parameter(torch.zeros_like(g)) for n, g in grads[0].items()}
    opt = ScalableShampoo(list(params.values()), lr=1.0, betas=(beta1, B2), moving_average_for_momentum=True,
                          weight_decay=0.0, decoupled_learning_rate=True, inverse_exponent_override=inv_root,
                          start_preconditioning_step=1, preconditioning_compute_steps=frequency,
                          statistics_compute_steps=1, block_size=block_size, shape_interpretation=False,
                          graft_type=graft, nesterov=False, diagonal_eps=1e-30, matrix_eps=matrix_eps,
                          use_svd=use_svd)
    return torch_optimizer_updates(opt, params, grads)


@pytest.mark.parametrize("block_size, inv_root, frequency", [
    (1024, 0, 1), (1024, 2, 1), (8, 0, 1), (8, 2, 1), (5, 0, 1), (5, 2, 1), (1024, 0, 3)])
def test_shampoo_matches_scalable_shampoo_without_grafting(block_size, inv_root, frequency):
    """ScalableShampoo (SVD roots, graft NONE, beta1 = 0: no momentum) vs ours with beta = B2 (EMA factors),
    graft="none", momentum=0, rel_floor=0, shampoo_eps=matrix_eps=1e-12: EMA factors, blocking (16 in
    blocks of 8, and 5+5+5+1; both libraries cut row-major, last block shorter), the rank-3 tensor,
    inv_root / inverse_exponent_override 0 (-1/(2k)) and 2 (-1/2), and the refresh frequency (reference: its
    steps f, 2f, ..., identity roots before: compared from step f, ours with start = f - 1).

    The reference seeds its factors with matrix_eps * I and decays that with the EMA; ours adds
    shampoo_eps to the eigenvalues at every root: 1e-12 against eigenvalues ~1, invisible.
    Measured max relative difference (float64, 12 steps): 1.0e-7 (blocks of 5, inv_root 2: a 5 x 1 block's
    5 x 5 factor is rank 1 at step 1, and its near-null eigenvalues get the -1/2 power), otherwise <= 4.1e-9.
    Tolerance 3e-7.
    """
    grads = random_grads(SHAMPOO_SHAPES, STEPS, torch.float64)
    tx = scale_by_shampoo(b2=B2, beta=B2, graft="none", momentum=0.0, inv_root=inv_root, shampoo_eps=1e-12,
                          rel_floor=0.0, precondition_frequency=frequency, start_preconditioning_step=frequency - 1,
                          block_size=block_size)
    ours = ours_updates(tx, grads)
    ref = scalable_shampoo(grads, LayerWiseGrafting.NONE, block_size, inv_root, frequency=frequency)
    assert max_rel(ours, ref, SHAMPOO_SHAPES, range(frequency - 1, STEPS)) < 3e-7


def test_shampoo_momentum_and_grafting_match_scalable_shampoo_up_to_bias_corrections():
    """Momentum and grafting, each on its own, against ScalableShampoo (float64, one block per dim):

    - momentum mu = 0.9: the reference keeps m <- mu m + (1 - mu) P (moving_average_for_momentum, no Nesterov)
      and steps by m; ours keeps the same EMA and emits it bias-corrected, m / (1 - mu^t). So
      ours * (1 - mu^t) = reference. Measured 4.6e-8, tolerance 1e-7: our bias correction is a float32
      scalar (shampoo.py: (step + 1).to(torch.float32)), so it carries float32 rounding into float64.
    - grafting: the reference's RMSProp graft (per layer) takes its norm from g / (sqrt(v) + eps),
      v <- B2 v + (1 - B2) g^2; ours (graft="adam", per block, b1 = 0 so Adam's m_hat = g, b2 = B2) from
      g / (sqrt(v / (1 - B2^t)) + eps): with eps -> 0, ours = reference * sqrt(1 - B2^t) while one block
      covers the layer (b1 = 0: Adam's m_hat is g). Measured 7.2e-8 (again Adam's float32 bias
      corrections), tolerance 2e-7.
    """
    grads = random_grads(SHAMPOO_SHAPES, STEPS, torch.float64)
    mu = 0.9
    tx = scale_by_shampoo(b2=B2, beta=B2, graft="none", momentum=mu, shampoo_eps=1e-12, rel_floor=0.0,
                          precondition_frequency=1, start_preconditioning_step=0, block_size=1024)
    ours = [{n: u * (1 - mu ** t) for n, u in d.items()} for t, d in enumerate(ours_updates(tx, grads), 1)]
    ref = scalable_shampoo(grads, LayerWiseGrafting.NONE, beta1=mu)
    assert max_rel(ours, ref, SHAMPOO_SHAPES, range(STEPS)) < 1e-7

    tx = scale_by_shampoo(b1=0.0, b2=B2, eps=1e-30, beta=B2, graft="adam", momentum=0.0, shampoo_eps=1e-12,
                          rel_floor=0.0, precondition_frequency=1, start_preconditioning_step=0, block_size=1024)
    ours = [{n: u / (1 - B2 ** t) ** 0.5 for n, u in d.items()} for t, d in enumerate(ours_updates(tx, grads), 1)]
    ref = scalable_shampoo(grads, LayerWiseGrafting.RMSPROP)
    assert max_rel(ours, ref, SHAMPOO_SHAPES, range(STEPS)) < 2e-7


def test_shampoo_documented_differences_from_scalable_shampoo():
    """What remains when ours cannot be configured to the reference (float64, 12 steps):
    - the reference's default root, a coupled Schur-Newton iteration (stopping at residual 1e-3) with a
      ridge matrix_eps * lambda_max added, vs our eigh with the floor max(lambda, rel_floor * lambda_max)
      + shampoo_eps (rel_floor = matrix_eps = 1e-6): measured <= 2.7e-4; bound 1e-3, the iteration's own
      tolerance.
    - per-block grafting (ours) vs per-layer (the reference), blocks of 8 (otherwise as the graft check of
      the previous test): up to 14% (8 x 12), 12% (12 x 8), 5% (16 x 16); the rank-3 tensor, one block,
      still agrees to 7.2e-8. Step 1 agrees for all (6.7e-9): each block's P is then its own polar factor
      U V^T, of norm sqrt(rank), the Adam direction is sign(g), of norm sqrt(size), and rank / size is the
      same for every block of these shapes, so per-block and per-layer scales coincide.
    """
    grads = random_grads(SHAMPOO_SHAPES, STEPS, torch.float64)
    tx = scale_by_shampoo(b2=B2, beta=B2, graft="none", momentum=0.0, shampoo_eps=1e-12, rel_floor=1e-6,
                          precondition_frequency=1, start_preconditioning_step=0)
    ref = scalable_shampoo(grads, LayerWiseGrafting.NONE, use_svd=False, matrix_eps=1e-6)
    assert max_rel(ours_updates(tx, grads), ref, SHAMPOO_SHAPES, range(STEPS)) < 1e-3

    tx = scale_by_shampoo(b1=0.0, b2=B2, eps=1e-30, beta=B2, graft="adam", momentum=0.0, shampoo_eps=1e-12,
                          rel_floor=0.0, precondition_frequency=1, start_preconditioning_step=0, block_size=8)
    ours = [{n: u / (1 - B2 ** t) ** 0.5 for n, u in d.items()} for t, d in enumerate(ours_updates(tx, grads), 1)]
    ref = scalable_shampoo(grads, LayerWiseGrafting.RMSPROP, block_size=8)
    assert max_rel(ours, ref, ["wide", "square", "tall"], range(STEPS)) > 3e-2
    assert max_rel(ours, ref, ["cube"], range(STEPS)) < 2e-7
