"""Muon variants from the public optimization records, each against its paper's formula:
Polar Express's per-step Newton-Schulz coefficients, and NorMuon's per-neuron second moment."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanomega import optim
from nanomega.config import Config, OptimConfig, parse_args
from nanomega.optim.linalg import newton_schulz, ns_schedule
from nanomega.optim.muon import NS_COEFFICIENTS, POLAR_EXPRESS, scale_by_muon, scale_by_neuron_norm
from nanomega.parallel.mesh import validate_layout
from nanomega.tree import named_leaves


def composed(sigma: torch.Tensor, schedule) -> torch.Tensor:
    """The Newton-Schulz iteration on one singular value: p_T(...p_1(sigma)), p_t(x) = a x + b x^3 + c x^5."""
    for a, b, c in schedule:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def test_polar_express_iterates_the_papers_polynomials_on_each_singular_value():
    """In float64 the matrix iteration is U p(S / ||G||_F) V^T with p the composition of the five
    quintics (the first with the 1.02 safety division folded in): one matmul chain per singular value."""
    gen = torch.Generator().manual_seed(0)
    for shape in ((24, 40), (40, 24), (3, 16, 16)):
        G = torch.randn(*shape, generator=gen, dtype=torch.float64)
        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
        sigma = S / torch.linalg.vector_norm(G, dim=(-2, -1)).unsqueeze(-1)
        want = U @ torch.diag_embed(composed(sigma, ns_schedule(POLAR_EXPRESS, 5))) @ Vh
        got = newton_schulz(G, 5, POLAR_EXPRESS, eps=0.0, dtype=torch.float64)
        assert torch.allclose(got, want, rtol=0, atol=1e-10), shape
    # The folded first step is the record's: x / 1.02 through its first quintic.
    x = torch.linspace(0, 1, 101, dtype=torch.float64)
    a, b, c = 8.156554524902461, -22.48329292557795, 15.878769915207462
    assert torch.allclose(composed(x, POLAR_EXPRESS[:1]), composed(x / 1.02, [(a, b, c)]), rtol=1e-12, atol=1e-15)


def test_polar_express_ends_closer_to_orthogonal_than_jordans_coefficients():
    """On singular values in [1e-3, 1] (the paper's design interval), five Polar Express steps end in
    [0.846, 1.142] (its cushioned design keeps a band rather than converging), where Keller Jordan's fixed
    quintic ends in [0.470, 1.203]: the largest distance from 1 is under a third."""
    sigma = torch.logspace(-3, 0, 2001, dtype=torch.float64)
    pe = composed(sigma, ns_schedule(POLAR_EXPRESS, 5))
    kj = composed(sigma, ns_schedule(NS_COEFFICIENTS, 5))
    assert 0.84 < pe.min() and pe.max() < 1.15 and kj.min() < 0.5 and kj.max() > 1.2
    assert (pe - 1).abs().max() < (kj - 1).abs().max() / 3


def normuon_reference(grads, momentum=0.95, beta2=0.95, steps=5):
    """NorMuon as its paper's algorithm 1 / official normuon_update states it, in float64: EMA momentum with
    Nesterov, Newton-Schulz (Keller Jordan's quintic), per-row second moment of the orthogonalised update,
    normalise, restore the pre-normalisation Frobenius norm, then Muon's sqrt(max(1, rows/cols))."""
    buf = {n: torch.zeros_like(g, dtype=torch.float64) for n, g in grads[0].items()}
    v = {n: torch.zeros(*g.shape[:-1], 1, dtype=torch.float64) for n, g in grads[0].items()}
    out = []
    for step in grads:
        upd = {}
        for n, g in step.items():
            g = g.double()
            buf[n] = torch.lerp(buf[n], g, 1 - momentum)
            u = torch.lerp(g, buf[n], momentum)
            o = newton_schulz(u, steps, NS_COEFFICIENTS, dtype=torch.float64)
            v[n] = torch.lerp(v[n], (o * o).mean(dim=-1, keepdim=True), 1 - beta2)
            y = o / (v[n].sqrt() + 1e-10)
            y = y * (torch.linalg.vector_norm(o) / (torch.linalg.vector_norm(y) + 1e-10))
            upd[n] = y * max(1.0, g.shape[-2] / g.shape[-1]) ** 0.5
        out.append(upd)
    return out


def test_normuon_equals_its_papers_update_over_ten_steps():
    """Muon (float32 Newton-Schulz) chained with scale_by_neuron_norm, against the float64 formula: the
    updates agree to 1e-5 relative (float32 against float64 Newton-Schulz), step by step, for wide, tall
    and square matrices."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"wide": (16, 32), "tall": (48, 16), "square": (24, 24)}
    grads = [{n: torch.randn(*s, generator=gen) for n, s in shapes.items()} for _ in range(10)]
    tx = optim.chain(muon=scale_by_muon(0.95, 5, ns_dtype=torch.float32), normuon=scale_by_neuron_norm(0.95))
    params = {n: torch.zeros(s) for n, s in shapes.items()}
    state = tx.init(params)
    ref = normuon_reference(grads)
    for t, g in enumerate(grads):
        upd, state = tx.update(g, state, params)
        for n in shapes:
            err = (upd[n].double() - ref[t][n]).norm() / ref[t][n].norm()
            assert err < 1e-5, (t, n, err.item())
    # it changed something: the per-row scales differ from plain Muon's by far more than that
    plain = scale_by_muon(0.95, 5, ns_dtype=torch.float32)
    p_state = plain.init(params)
    for g in grads:
        plain_upd, p_state = plain.update(g, p_state, params)
    assert (plain_upd["tall"] - upd["tall"]).norm() > 0.05 * upd["tall"].norm()


def test_the_variants_are_chosen_by_config_and_refused_where_rows_are_split():
    cfg = OptimConfig(name="muon", ns_coefficients="polar_express", normuon_beta2=0.95)
    params = {"layers": [{"w": torch.randn(8, 4)}], "tok_embed": {"weight": torch.randn(10, 4)}}
    opt = optim.build(cfg, 10)
    state = opt.init(params)
    assert "muon.normuon.second_moment.layers.0.w" in named_leaves(state)
    with pytest.raises(ValueError, match="optim.normuon_beta2 is not read by adamw"):
        optim.check(OptimConfig(name="adamw", normuon_beta2=0.95))
    with pytest.raises(ValueError, match=r"optim.normuon_beta2=1.0 must lie in \[0, 1\)"):
        optim.check(parse_args(["--optim.name=muon", "--optim.normuon_beta2=1"]).optim)
    par = dataclasses.replace(Config().parallel, tp=2, muon_tp="distributed")
    with pytest.raises(ValueError, match="muon_tp=duplicated"):
        validate_layout(dataclasses.replace(Config(), optim=cfg, parallel=par))
