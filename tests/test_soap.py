"""Tests for nanomega.optim.soap (SOAP: Adam in the eigenbasis of Shampoo's factors) and the SOAP section
of nanomega.optim.linalg, against independent references: scale_by_adam / torch.optim.Adam where every
basis is the identity (or a signed permutation), a float64 dense re-implementation of the algorithm as
soap.py documents it, torch.linalg.eigh, and einsum for the mode-wise rotations.
"""
import math

import pytest
import torch

from nanomega import optim
from nanomega.config import ModelConfig, OptimConfig
from nanomega.models.transformer import init as init_model, loss_fn
from nanomega.optim.adamw import scale_by_adam
from nanomega.optim.linalg import eigenbasis, refresh_eigenbasis
from nanomega.optim.soap import _rotate, merged_shape, scale_by_soap, soap
from test_optim import assert_unchanged, snapshot
from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_unflatten


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def random_grads(params, steps, seed=0):
    return [{n: randn(*p.shape, seed=seed + 1000 * s + i, dtype=p.dtype)
             for i, (n, p) in enumerate(params.items())} for s in range(steps)]


def run(opt, params, grads):
    state = opt.init(params)
    outs, states = [], []
    for g in grads:
        u, state = opt.update(g, state, params)
        outs.append(u)
        states.append(state)
    return outs, states


# ---------------------------------------------------------------- independent references

def ref_soap_2d(grads, b1, b2, eps, beta, freq, left=True, right=True):
    """SOAP on one matrix, float64, written out with dense matrices; `left`/`right`: that side has a basis.

    Returns the updates and, per step, (Q_L, Q_R, v) after the step.
    """
    m_dim, n_dim = grads[0].shape
    m = torch.zeros(m_dim, n_dim, dtype=torch.float64)
    v = torch.zeros_like(m)
    L = torch.zeros(m_dim, m_dim, dtype=torch.float64)
    R = torch.zeros(n_dim, n_dim, dtype=torch.float64)
    QL, QR = torch.eye(m_dim, dtype=torch.float64), torch.eye(n_dim, dtype=torch.float64)

    def eig_desc(F):
        w, V = torch.linalg.eigh(F)
        return V[:, torch.argsort(w, descending=True)]

    def power_step(F, Q):
        est = [float(Q[:, j] @ F @ Q[:, j]) for j in range(Q.shape[1])]
        order = sorted(range(len(est)), key=lambda j: -est[j])   # Python's sort is stable
        Q = Q[:, order]
        return torch.linalg.qr(F @ Q).Q, order

    outs, trace = [], []
    has_basis = left or right
    for t, G in enumerate(grads, start=1):
        G = G.to(torch.float64)
        if has_basis and t == 1:       # step 1 only builds the bases
            outs.append(torch.zeros_like(G))
        else:                          # Adam on G rotated into the bases of earlier gradients; m kept unrotated
            k = t - 1 if has_basis else t
            m = b1 * m + (1 - b1) * G
            Gr = QL.T @ G @ QR
            v = b2 * v + (1 - b2) * Gr ** 2
            Mr = QL.T @ m @ QR
            D = (Mr / (1 - b1 ** k)) / ((v / (1 - b2 ** k)).sqrt() + eps)
            outs.append(QL @ D @ QR.T)
        L = beta * L + (1 - beta) * (G @ G.T)
        R = beta * R + (1 - beta) * (G.T @ G)
        if t == 1:
            QL = eig_desc(L) if left else QL
            QR = eig_desc(R) if right else QR
        elif t % freq == 0:            # the bases for step t + 1
            if left:
                QL, order = power_step(L, QL)
                v = v[order, :]
            if right:
                QR, order = power_step(R, QR)
                v = v[:, order]
        trace.append((QL, QR, v))
    return outs, trace


# ---------------------------------------------------------------- linalg

def spd(d, seed, eigenvalues=None):
    Q = torch.linalg.qr(randn(d, d, seed=seed, dtype=torch.float64)).Q
    w = eigenvalues if eigenvalues is not None else 2.0 ** -torch.arange(d, dtype=torch.float64)
    return Q @ torch.diag(w) @ Q.T, Q


def test_eigenbasis_sorted_orthonormal_and_fp64_retry(monkeypatch):
    F, _ = spd(6, seed=1)
    F = F.float()
    for factor in (F, F.double()):
        Q = eigenbasis(factor)
        assert Q.dtype == factor.dtype
        Q = Q.double()
        torch.testing.assert_close(Q.T @ Q, torch.eye(6, dtype=torch.float64), atol=1e-5, rtol=0)
        d = torch.diagonal(Q.T @ F.double() @ Q)
        assert torch.all(d[:-1] >= d[1:]), f"eigenvalues not descending: {d}"

    real_eigh = torch.linalg.eigh
    seen = []

    def failing_fp32(A):
        seen.append(A.dtype)
        if A.dtype == torch.float32:
            raise torch.linalg.LinAlgError("no convergence (simulated)")
        return real_eigh(A)

    monkeypatch.setattr(torch.linalg, "eigh", failing_fp32)
    Q = eigenbasis(F)
    assert seen == [torch.float32, torch.float64] and Q.dtype == torch.float32
    d = torch.diagonal(Q.T @ F @ Q)
    assert torch.all(d[:-1] >= d[1:])


def test_refresh_converges_to_eigenvectors():
    F, U = spd(8, seed=2)   # eigenvalues 1, 1/2, 1/4, ...: each refresh halves the error
    Q = torch.linalg.qr(randn(8, 8, seed=3, dtype=torch.float64)).Q
    for _ in range(80):
        Q, perm = refresh_eigenbasis(F, Q)
    assert torch.equal(perm, torch.arange(8)), "a converged basis is already sorted"
    torch.testing.assert_close((Q.T @ U).abs(), torch.eye(8, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(Q.T @ Q, torch.eye(8, dtype=torch.float64), atol=1e-12, rtol=0)


def test_refresh_permutation_follows_eigenvalue_order():
    F = torch.diag(torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64))
    Q, perm = refresh_eigenbasis(F, torch.eye(3, dtype=torch.float64))
    assert perm.tolist() == [1, 2, 0]
    torch.testing.assert_close(Q.abs(), torch.eye(3, dtype=torch.float64)[:, [1, 2, 0]], atol=1e-12, rtol=0)


def test_rotate_is_modewise_matrix_product():
    x = randn(3, 4, 5, seed=4, dtype=torch.float64)
    Q0 = torch.linalg.qr(randn(3, 3, seed=5, dtype=torch.float64)).Q
    Q2 = torch.linalg.qr(randn(5, 5, seed=6, dtype=torch.float64)).Q
    bases = {"0": Q0, "2": Q2}
    rotated = _rotate(x, bases)
    torch.testing.assert_close(rotated, torch.einsum("abc,ai,ck->ibk", x, Q0, Q2))
    torch.testing.assert_close(_rotate(rotated, bases, back=True), x)


# ---------------------------------------------------------------- SOAP against Adam

SHAPES = {"w": (6, 5), "experts": (2, 3, 4), "bias": (7,)}


def test_identity_bases_equal_adam():
    params = {n: randn(*s, seed=i) for i, (n, s) in enumerate(SHAPES.items())}
    grads = random_grads(params, 6)
    ours, states = run(scale_by_soap(b1=0.9, b2=0.99, eps=1e-8, max_precond_dim=1), params, grads)
    ref, _ = run(scale_by_adam(b1=0.9, b2=0.99, eps=1e-8), params, grads)
    assert all(f == {} for f in states[-1].factors.values()) and all(b == {} for b in states[-1].bases.values())
    for step, (u, r) in enumerate(zip(ours, ref)):
        for n in params:
            torch.testing.assert_close(u[n], r[n], atol=1e-6, rtol=1e-6, msg=lambda m: f"step {step} {n}: {m}")


def test_identity_bases_equal_torch_adam():
    w = randn(6, 5, seed=0)
    grads = [g["w"] for g in random_grads({"w": w}, 6)]
    opt = soap(lambda c: 0.01, b1=0.9, b2=0.99, max_precond_dim=1)
    params = {"w": w.clone()}
    state = opt.init(params)
    ref = w.clone().requires_grad_(True)
    torch_opt = torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    for g in grads:
        u, state = opt.update({"w": g}, state, params)
        params = {"w": params["w"] + u["w"]}
        ref.grad = g.clone()
        torch_opt.step()
    torch.testing.assert_close(params["w"], ref.detach(), atol=1e-6, rtol=1e-6)


def test_second_moment_follows_a_flipped_eigenvalue_order():
    """Diagonal gradients: every basis is a signed permutation, so SOAP is Adam in permuted coordinates
    from step 2 on (step 1 only builds the bases: Adam is compared from G_2). The gradients' large entry
    moves from the first to the last coordinate, so the refresh after step 2 reverses the eigenvalue order:
    v must be re-indexed with it."""
    grads = [{"w": torch.diag(torch.tensor([3.0, 2.0, 1.0]))}] + \
            [{"w": 5 * torch.diag(torch.tensor([1.0, 2.0, 3.0]))} for _ in range(4)]
    params = {"w": torch.zeros(3, 3)}
    ours, states = run(scale_by_soap(b1=0.9, b2=0.99, precondition_frequency=2), params, grads)
    adam, adam_states = run(scale_by_adam(b1=0.9, b2=0.99), params, grads[1:])
    reversed_ = torch.eye(3).flip(0)
    assert torch.equal(states[0].bases["w"]["0"].abs(), torch.eye(3))
    assert torch.equal(states[1].bases["w"]["0"].abs(), reversed_), "the refresh did not reorder the basis"
    assert torch.equal(states[1].bases["w"]["1"].abs(), reversed_)
    assert torch.equal(ours[0]["w"], torch.zeros(3, 3))
    for step in range(1, len(grads)):
        torch.testing.assert_close(ours[step]["w"], adam[step - 1]["w"], atol=1e-6, rtol=1e-6)
    # v in the rotated space is Adam's v with both axes reversed
    torch.testing.assert_close(states[-1].nu["w"], adam_states[-1].nu["w"].flip(0, 1), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------- SOAP against a dense float64 reference

@pytest.mark.parametrize("shape, max_precond_dim, left, right", [
    ((5, 4), 16, True, True),     # both sides preconditioned
    ((12, 4), 8, False, True),    # 12 > max_precond_dim: the left side keeps the identity
])
def test_matches_dense_float64_reference(shape, max_precond_dim, left, right):
    b1, b2, eps, beta, freq, steps = 0.9, 0.95, 1e-8, 0.9, 2, 7   # refreshes after steps 2, 4, 6
    params = {"w": randn(*shape, seed=0, dtype=torch.float64)}
    grads = random_grads(params, steps, seed=10)
    opt = scale_by_soap(b1, b2, eps, shampoo_beta=beta, precondition_frequency=freq, max_precond_dim=max_precond_dim)
    ours, states = run(opt, params, grads)
    ref, trace = ref_soap_2d([g["w"] for g in grads], b1, b2, eps, beta, freq, left, right)
    assert set(states[-1].factors["w"]) == ({"0"} if left else set()) | {"1"}
    for step, (u, r, (QL, QR, v), s) in enumerate(zip(ours, ref, trace, states)):
        torch.testing.assert_close(u["w"], r, atol=1e-9, rtol=1e-9, msg=lambda m: f"step {step + 1}: {m}")
        torch.testing.assert_close(s.nu["w"], v, atol=1e-12, rtol=1e-9, msg=lambda m: f"v, step {step + 1}: {m}")
        torch.testing.assert_close(s.bases["w"]["1"].abs(), QR.abs(), atol=1e-9, rtol=0)
    assert ours[-1]["w"].abs().max() > 0.1
    # the refreshes changed the basis (the comparison covers them)
    assert not torch.allclose(states[0].bases["w"]["1"].abs(), states[1].bases["w"]["1"].abs(), atol=1e-3)


# ---------------------------------------------------------------- structure

def test_merged_shape_rule():
    assert merged_shape((8, 64, 32), 1024) == (512, 32)
    assert merged_shape((50000, 8, 8), 64) == (50000, 64)
    assert merged_shape((2, 3, 4), 6) == (6, 4)
    assert merged_shape((16, 32), 1024) == (16, 32), "matrices are never flattened"
    assert merged_shape((8, 64, 32), 1024, merge_dims=False) == (8, 64, 32)


def test_merge_dims_on_a_3d_tensor():
    params = {"experts": randn(2, 3, 4, seed=0, dtype=torch.float64)}
    grads = random_grads(params, 5)
    ours, states = run(scale_by_soap(precondition_frequency=2, max_precond_dim=6), params, grads)
    s = states[-1]
    assert {k: tuple(f.shape) for k, f in s.factors["experts"].items()} == {"0": (6, 6), "1": (4, 4)}
    assert s.nu["experts"].shape == (6, 4) and s.mu_rotated["experts"].shape == (6, 4)
    # the same as SOAP on the [6, 4] matrix it is merged into
    flat = {"experts": params["experts"].reshape(6, 4)}
    ref, _ = run(scale_by_soap(precondition_frequency=2, max_precond_dim=6), flat,
                 [{"experts": g["experts"].reshape(6, 4)} for g in grads])
    for u, r in zip(ours, ref):
        assert u["experts"].shape == (2, 3, 4)
        torch.testing.assert_close(u["experts"].reshape(6, 4), r["experts"], atol=1e-12, rtol=1e-12)
    # unmerged: one factor per dim
    _, states = run(scale_by_soap(max_precond_dim=6, merge_dims=False), params, grads[:2])
    assert {k: tuple(f.shape) for k, f in states[-1].factors["experts"].items()} == \
        {"0": (2, 2), "1": (3, 3), "2": (4, 4)}


def test_state_leaves_are_tensors_and_inputs_unchanged():
    params = {n: randn(*s, seed=i) for i, (n, s) in enumerate(SHAPES.items())} | {"vocab": randn(40, 3, seed=9)}
    opt = soap(lambda c: 0.01, precondition_frequency=1, max_precond_dim=20, weight_decay=0.1)
    state = opt.init(params)
    for g in random_grads(params, 3):
        snaps = [snapshot(params), snapshot(g), snapshot(state)]
        u, new_state = opt.update(g, state, params)
        for tree, snap, what in zip((params, g, state), snaps, ("params", "grads", "state")):
            assert_unchanged(tree, snap, what)
        state = new_state
    named = named_leaves(state)
    assert len(named) == len(tree_leaves(state))
    assert all(isinstance(x, torch.Tensor) for x in named.values()), named
    assert "soap.factors.vocab.1" in named and "soap.factors.vocab.0" not in named   # 40 > max_precond_dim


def test_compiled_update_matches_eager():
    """torch.compile traces the whole update (fullgraph: the eigh/refresh/keep choice is a torch.cond)."""
    params = {"w": randn(6, 5, seed=0, dtype=torch.float64), "e": randn(2, 3, 4, seed=1, dtype=torch.float64)}
    grads = random_grads(params, 5)
    opt = scale_by_soap(precondition_frequency=2, max_precond_dim=6)
    eager, _ = run(opt, params, grads)
    update = torch.compile(opt.update, backend="aot_eager", fullgraph=True)
    state = opt.init(params)
    for g, e in zip(grads, eager):
        u, state = update(g, state, params)
        for n in params:
            torch.testing.assert_close(u[n], e[n], atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------- optimization

def test_lowers_an_ill_conditioned_least_squares_loss():
    gen = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(32, 16, generator=gen)).Q
    V = torch.linalg.qr(torch.randn(16, 16, generator=gen)).Q
    A = U @ torch.diag(torch.logspace(0, -2, 16)) @ V.T        # condition number 100
    B = A @ torch.randn(16, 8, generator=gen)

    def loss(X):
        return 0.5 * ((A @ X - B) ** 2).sum()

    opt = soap(lambda c: 0.1, max_precond_dim=64)
    params = {"w": torch.zeros(16, 8, requires_grad=True)}
    state = opt.init(params)
    start = loss(params["w"]).item()
    for _ in range(50):
        g = torch.autograd.grad(loss(params["w"]), [params["w"]])[0]
        u, state = opt.update({"w": g}, state, params)
        params = optim.apply_updates(params, u)
    assert loss(params["w"]).item() < 0.1 * start


def test_build_from_config_trains_the_model():
    cfg = ModelConfig(vocab_size=256, vocab_multiple=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_dim=64, max_seq_len=32)
    opt = optim.build(OptimConfig(name="soap", lr=3e-3, warmup_steps=0, schedule="constant",
                                  precondition_frequency=2, max_precond_dim=48), total_steps=8)
    params = init_model(cfg, 0)
    state = opt.init(params)
    named = named_leaves(state)
    assert all(isinstance(x, torch.Tensor) for x in named.values())
    hidden = [n for n, p in named_leaves(params).items() if optim.hidden_matrix(n, p)]
    assert hidden and all(f"soap.mu_rotated.{n}" in named for n in hidden)
    assert "soap.factors.layers.0.mlp.w_up.weight.1" in named           # [64, 32]: 32 <= 48 has a factor,
    assert "soap.factors.layers.0.mlp.w_up.weight.0" not in named       # 64 > 48 keeps the identity
    assert not any("tok_embed" in k for k in named if k.startswith("soap.")), "embeddings go to AdamW"
    assert any("tok_embed" in k for k in named if k.startswith("adam."))
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses = []
    for _ in range(8):
        value = loss_fn(params, x, y, cfg)
        grads = torch.autograd.grad(value, tree_leaves(params))
        u, state = opt.update(tree_unflatten(list(grads), tree_flatten(params)[1]), state, params)
        params = optim.apply_updates(params, u)
        losses.append(value.item())
    assert math.isfinite(losses[-1]) and losses[-1] < losses[0]


def test_shampoo_beta_one_sums_the_factors_as_adagrad():
    """shampoo_beta = 1 (the settings allow it: "1 sums them") makes each factor the sum of the grams, as Shampoo's;
    an EMA written as lerp(L, G G^T, 1 - beta) kept them at zero."""
    params = {"w": randn(5, 4, seed=0, dtype=torch.float64)}
    grads = random_grads(params, 3)
    _, states = run(scale_by_soap(shampoo_beta=1.0, precondition_frequency=1, max_precond_dim=6), params, grads)
    g = [x["w"] for x in grads]
    torch.testing.assert_close(states[-1].factors["w"]["0"], sum(x @ x.T for x in g), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(states[-1].factors["w"]["1"], sum(x.T @ x for x in g), atol=1e-12, rtol=1e-12)
