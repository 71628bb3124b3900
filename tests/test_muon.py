"""Tests for Muon (nanomega.optim.muon) and its Newton-Schulz iteration (nanomega.optim.linalg),
against independent references: a float64 Newton-Schulz written here, the scalar quintic map on
singular values, torch.optim.Muon, and per-matrix / per-group runs of our own transforms.

torch.optim.Muon runs Newton-Schulz in bf16 (it casts with grad.bfloat16() whatever the parameter
dtype), so the comparison with it runs ours in bf16 too; the two are bit-identical there.
"""
import math

import pytest
import torch

from nanomega import optim
from nanomega.config import ModelConfig, OptimConfig
from nanomega.models.transformer import init
from nanomega.optim import schedules
from nanomega.optim.linalg import newton_schulz
from nanomega.optim.muon import muon, scale_by_muon
from test_optim import assert_unchanged, snapshot
from nanomega.tree import named_leaves, tree_leaves, tree_map
from tiers import slow

COEFFS = (3.4445, -4.7750, 2.0315)
CFG = ModelConfig(vocab_size=64, vocab_multiple=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=64, max_seq_len=32)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def random_like(tree, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return tree_map(lambda x: torch.randn(x.shape, generator=gen, dtype=x.dtype) * scale, tree)


# ---------------------------------------------------------------- Newton-Schulz

def ref_newton_schulz(G, steps=5, coeffs=COEFFS, eps=1e-7):
    """float64, one matrix at a time, no transposition, the polynomial written out term by term."""
    a, b, c = coeffs
    out = []
    for M in G.double().reshape(-1, *G.shape[-2:]):
        X = M / (torch.sqrt((M * M).sum()) + eps)
        for _ in range(steps):
            S = X @ X.T
            X = a * X + b * (S @ X) + c * (S @ (S @ X))
        out.append(X)
    return torch.stack(out).reshape(G.shape)


def quintic_map(x, steps=5, coeffs=COEFFS):
    """What exact Newton-Schulz does to each singular value: p(p(...p(x)))."""
    a, b, c = coeffs
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return x


@pytest.mark.parametrize("shape", [(7, 5), (5, 9), (6, 6), (3, 4, 5), (3, 6, 4), (2, 3, 8, 6)],
                         ids=["tall", "wide", "square", "batch-wide", "batch-tall", "batch-2d"])
@pytest.mark.parametrize("steps", [1, 5])
def test_newton_schulz_float64_matches_reference(shape, steps):
    G = randn(*shape, seed=sum(shape), dtype=torch.float64) * 3.0
    got = newton_schulz(G, steps=steps, dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == G.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref_newton_schulz(G, steps), rtol=0, atol=1e-12)
    # other coefficients go through too (the classic cubic-free quintic 15/8, -10/8, 3/8 converges to 1)
    coeffs = (15 / 8, -10 / 8, 3 / 8)
    torch.testing.assert_close(newton_schulz(G, steps, coeffs, dtype=torch.float64),
                               ref_newton_schulz(G, steps, coeffs), rtol=0, atol=1e-12)


def test_newton_schulz_batched_equals_per_matrix():
    G = randn(5, 12, 20, seed=1)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        batched = newton_schulz(G, dtype=dtype)
        for i in range(len(G)):
            # the same maths per matrix; bf16 on CPU is even bit-identical (one rounding per fused step)
            torch.testing.assert_close(batched[i], newton_schulz(G[i], dtype=dtype), rtol=0,
                                       atol=1e-12 if dtype == torch.float64 else 1e-6)
        tall = newton_schulz(G.mT.contiguous(), dtype=dtype)          # transposing commutes with NS
        torch.testing.assert_close(tall, batched.mT, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (32, 256), (6, 48, 96)])
def test_newton_schulz_bf16_singular_values(shape):
    """bf16 output: each matrix's singular values lie where the quintic map sends its input's.

    Exact NS maps a normalized singular value x in (0, 1] to p^5(x). For x >= 2e-3 that lands in
    [0.682, 1.202] (checked below on a fine grid), Keller Jordan's "S' ~ U(0.5, 1.5)" made precise.
    Random matrices with aspect ratio >= 2 keep x well above 2e-3 (Marchenko-Pastur); square ones
    have singular values near 0 that 5 steps cannot lift, so they are not in this test.
    bf16 rounding moves the band's ends by up to 0.015 here; we allow 0.03.
    """
    grid = torch.logspace(math.log10(2e-3), 0, 100_001, dtype=torch.float64)
    band = quintic_map(grid)
    assert 0.68 < band.min() < 0.683 and 1.20 < band.max() < 1.203
    G = randn(*shape, seed=shape[-1]) * 0.01
    out = newton_schulz(G)                       # bf16 inside, fp32 out
    assert out.dtype == torch.float32 and out.shape == G.shape
    sv_in = torch.linalg.svdvals(G.double())
    sv_in = sv_in / torch.linalg.vector_norm(G.double(), dim=(-2, -1), keepdim=True)
    assert sv_in.min() > 2e-3
    sv_out = torch.linalg.svdvals(out.double())
    for x, y in zip(sv_in.reshape(-1, sv_in.shape[-1]), sv_out.reshape(-1, sv_out.shape[-1])):
        lo_hi = quintic_map(torch.linspace(x.min(), x.max(), 100_001, dtype=torch.float64))
        assert lo_hi.min() - 0.03 <= y.min() and y.max() <= lo_hi.max() + 0.03, (y.min(), y.max(), lo_hi.aminmax())
        assert 0.65 <= y.min() and y.max() <= 1.23
    # and the float64 iteration on the same input agrees with the bf16 one to bf16 accuracy
    torch.testing.assert_close(out.double(), ref_newton_schulz(G), rtol=0, atol=0.02)  # measured 0.009


def test_newton_schulz_edge_cases():
    assert torch.equal(newton_schulz(torch.zeros(4, 6)), torch.zeros(4, 6))      # eps: no 0/0
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.ones(5))
    G = randn(9, 4, seed=3)
    snap = snapshot(G)
    newton_schulz(G, dtype=torch.float32)
    assert_unchanged(G, snap, "input")


# ---------------------------------------------------------------- against torch.optim.Muon

@pytest.mark.parametrize("scale, adjust_lr_fn, momentum, nesterov, weight_decay", [
    ("spectral", "original", 0.95, True, 0.1),           # Keller Jordan's Muon with decoupled decay
    ("match_adam", "match_rms_adamw", 0.95, True, 0.1),  # Moonshot's AdamW-matching scale
    ("spectral", None, 0.9, False, 0.0),                  # heavy-ball momentum, no decay
])
def test_muon_matches_torch(scale, adjust_lr_fn, momentum, nesterov, weight_decay):
    lr, steps = 0.02, 25
    sched = schedules.warmup_cosine(lr, 3, steps, 0.1)
    shapes = {"tall": (32, 16), "wide": (16, 32), "wide2": (16, 32), "square": (24, 24)}  # wide+wide2: one batch
    params = {n: randn(*s, seed=i) * 0.1 for i, (n, s) in enumerate(shapes.items())}
    ref = {n: p.clone() for n, p in params.items()}
    torch_opt = torch.optim.Muon(list(ref.values()), lr=lr, weight_decay=weight_decay, momentum=momentum,
                                 nesterov=nesterov, ns_coefficients=COEFFS, eps=1e-7, ns_steps=5,
                                 adjust_lr_fn=adjust_lr_fn)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: sched(s).item() / lr)
    opt = muon(sched, weight_decay, momentum=momentum, ns_steps=5, scale=scale, nesterov=nesterov,
               ns_dtype=torch.bfloat16)
    state = opt.init(params)
    gen = torch.Generator().manual_seed(123)
    for step in range(steps):
        grads = {n: torch.randn(s, generator=gen) * 10 ** (2 * torch.rand((), generator=gen).item() - 1)
                 for n, s in shapes.items()}
        for n, p in ref.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        lr_sched.step()
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        for n, p in params.items():
            torch.testing.assert_close(p.detach(), ref[n], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, n=n: f"step {step}, {n}: {m}")
    moved = max((p.detach() - randn(*shapes[n], seed=i) * 0.1).abs().max().item()
                for i, (n, p) in enumerate(params.items()))
    assert moved > 0.05, f"parameters barely moved ({moved}); the comparison would be vacuous"
    momentum_state = state["muon"].momentum
    for n, p in ref.items():
        torch.testing.assert_close(momentum_state[n], torch_opt.state[p]["momentum_buffer"], rtol=1e-6, atol=0)


# ---------------------------------------------------------------- expert tensors and grouping

@pytest.mark.parametrize("scale", ["spectral", "match_adam"])
def test_expert_tensor_equals_separate_matrices(scale):
    """[E, out, in] is E independent matrices, each scaled by its own (out, in), each with its own
    momentum; a 2-D parameter of the same [out, in] shape sharing the tree does not change that."""
    E, out_dim, in_dim = 3, 12, 6
    params = {"experts": randn(E, out_dim, in_dim, seed=0, dtype=torch.float64),
              "dense": randn(out_dim, in_dim, seed=1, dtype=torch.float64)}
    make = lambda: muon(lambda s: torch.tensor(0.05, dtype=torch.float64), 0.1, momentum=0.95,  # noqa: E731
                        ns_steps=5, scale=scale, ns_dtype=torch.float64)
    opt = make()
    state = opt.init(params)
    alone = [make() for _ in range(E + 1)]
    singles = [{"w": params["experts"][e]} for e in range(E)] + [{"w": params["dense"]}]
    states = [t.init(p) for t, p in zip(alone, singles)]
    for step in range(4):
        grads = random_like(params, step)
        updates, state = opt.update(grads, state, params)
        g_singles = [{"w": grads["experts"][e]} for e in range(E)] + [{"w": grads["dense"]}]
        expected = []
        for i, (t, p, g) in enumerate(zip(alone, singles, g_singles)):
            u, states[i] = t.update(g, states[i], p)
            expected.append(u["w"])
        torch.testing.assert_close(updates["experts"], torch.stack(expected[:E]), rtol=0, atol=1e-12)
        torch.testing.assert_close(updates["dense"], expected[E], rtol=0, atol=1e-12)
    # the update is scale * (orthogonal-ish matrix): its size is set by (out, in), not by E
    spectral = torch.linalg.matrix_norm(-updates["experts"] / 0.05 - 0.1 * params["experts"], ord=2)
    factor = math.sqrt(out_dim / in_dim) if scale == "spectral" else 0.2 * math.sqrt(out_dim)
    assert ((spectral / factor > 0.65) & (spectral / factor < 1.25)).all()


def test_muon_rejects_vectors_and_unknown_scale():
    with pytest.raises(ValueError, match="bias"):
        scale_by_muon().init({"w": torch.zeros(3, 3), "bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="spectrl"):
        scale_by_muon(scale="spectrl")


# ---------------------------------------------------------------- from_config: partition and clipping

def subset(flat, keep):
    return {n: x for n, x in flat.items() if keep(n)}


def is_hidden(name):
    """Independent of optim.hidden_matrix: the block projections of this model, written out."""
    return name.startswith("layers.") and name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def test_from_config_partition_and_joint_clipping():
    cfg = OptimConfig(name="muon", lr=0.02, warmup_steps=2, weight_decay=0.1, muon_momentum=0.95, grad_clip=1.0,
                      adam_lr_ratio=0.25, muon_scale="match_adam", beta2=0.99)
    total = 10
    sched = schedules.warmup_cosine(cfg.lr, cfg.warmup_steps, total, cfg.min_lr_ratio)
    built = optim.build(cfg, total)
    params = named_leaves(init(CFG, 0))
    mask = optim.decay_mask(cfg)
    names = list(params)

    # state: momentum for the block matrices, AdamW moments for embeddings, norms and the LM head
    state_names = list(named_leaves(built.init(params)))
    for name in names:
        muon_hits = [s for s in state_names if s.endswith("momentum." + name)]
        adam_hits = [s for s in state_names if s.endswith("mu." + name) or s.endswith("nu." + name)]
        if is_hidden(name):
            assert len(muon_hits) == 1 and muon_hits[0].startswith("muon.") and not adam_hits, name
        else:
            assert not muon_hits and len(adam_hits) == 2 and all(s.startswith("adam.") for s in adam_hits), name
    assert {n for n in names if is_hidden(n)} and {n for n in names if not is_hidden(n)}

    # updates: clip ALL gradients by their joint norm, then Muon (lr) and AdamW (lr * ratio) on their parts
    own = optim.check(cfg)     # Muon's own settings, its defaults where cfg leaves them
    ref_muon = muon(sched, cfg.weight_decay, mask, momentum=own.muon_momentum, ns_steps=own.ns_steps,
                    scale=own.muon_scale)
    ref_adam = optim.adamw(lambda s: sched(s) * own.adam_lr_ratio, own.beta1, own.beta2, own.eps,
                           cfg.weight_decay, mask)
    clip = optim.clip_by_global_norm(cfg.grad_clip)
    parts = {"muon": (ref_muon, is_hidden), "adam": (ref_adam, lambda n: not is_hidden(n))}
    ref_states = {k: t.init(subset(params, keep)) for k, (t, keep) in parts.items()}
    state, p_built, p_ref = built.init(params), params, params
    for step in range(3):
        grads = random_like(params, step)
        norm = optim.global_norm(grads).item()
        assert norm > 10 * cfg.grad_clip and optim.global_norm(subset(grads, is_hidden)).item() < norm
        clipped, _ = clip.update(grads, (), None)
        updates, state = built.update(grads, state, p_built)
        for k, (t, keep) in parts.items():
            u, ref_states[k] = t.update(subset(clipped, keep), ref_states[k], subset(p_ref, keep))
            for n, x in u.items():
                assert torch.equal(updates[n], x), f"step {step}: {n}"
        p_built, p_ref = optim.apply_updates(p_built, updates), optim.apply_updates(p_ref, updates)


def test_bf16_momentum_state():
    """state_dtype="bfloat16" stores the momentum in bf16; the maths (and the update) stays fp32."""
    params = named_leaves(init(CFG, 0))
    hidden = subset(params, is_hidden)
    t16 = optim.build(OptimConfig(name="muon", muon_momentum=0.95, state_dtype="bfloat16"), 10)
    t32 = optim.build(OptimConfig(name="muon", muon_momentum=0.95, state_dtype="float32"), 10)
    s16, s32 = t16.init(params), t32.init(params)
    for step in range(5):
        grads = random_like(params, step)
        u16, s16 = t16.update(grads, s16, params)
        u32, s32 = t32.update(grads, s32, params)
        buf16, buf32 = s16["muon"].momentum, s32["muon"].momentum
        assert set(buf16) == set(hidden)
        for n in hidden:
            assert buf16[n].dtype == torch.bfloat16 and buf32[n].dtype == torch.float32
            assert u16[n].dtype == torch.float32
            if step == 0:   # one EMA step from zero: the bf16 buffer is the fp32 one rounded
                assert torch.equal(buf16[n], buf32[n].bfloat16())
                assert torch.equal(u16[n], u32[n])
            torch.testing.assert_close(buf16[n].float(), buf32[n], rtol=2e-2,
                                       atol=1e-2 * buf32[n].abs().max().item())
        adam16, adam32 = s16["adam"].mu, s32["adam"].mu  # the AdamW group's first moment too
        for n in params:
            if not is_hidden(n):
                assert adam16[n].dtype == torch.bfloat16 and adam32[n].dtype == torch.float32
                torch.testing.assert_close(u16[n], u32[n], rtol=5e-2, atol=5e-2)


# ---------------------------------------------------------------- torch.compile

@slow
def test_compiled_update_matches_eager():
    """The whole from_config update compiles to one graph that re-runs without recompiling. bf16
    Newton-Schulz rounds differently once inductor fuses it, so parameters agree to bf16 accuracy
    (measured 5e-4 after 3 steps of lr 1e-2); everything outside Newton-Schulz agrees to 1e-6."""
    params = {"tok_embed": {"weight": randn(8, 4, seed=0)},
              "layers": [{"attn_norm": {"weight": randn(4, seed=1)},
                          "attn": {"wq": {"weight": randn(4, 4, seed=2)}, "wk": {"weight": randn(8, 4, seed=3)}},
                          "mlp": {"experts": randn(2, 4, 8, seed=4)}},
                         {"attn": {"wq": {"weight": randn(4, 4, seed=5)}}}]}
    params = tree_map(lambda x: x.requires_grad_(True), params)
    opt = optim.build(OptimConfig(name="muon", lr=1e-2, warmup_steps=2, muon_momentum=0.95, adam_lr_ratio=0.3), 10)
    torch._dynamo.reset()
    compiled = torch.compile(opt.update, fullgraph=True)
    p_e, s_e, p_c, s_c = params, opt.init(params), params, opt.init(params)
    for step in range(3):
        grads = random_like(params, step)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            u_c, s_c = compiled(grads, s_c, p_c)
        u_e, s_e = opt.update(grads, s_e, p_e)
        p_c, p_e = optim.apply_updates(p_c, u_c), optim.apply_updates(p_e, u_e)
    assert list(named_leaves(s_c)) == list(named_leaves(s_e))
    for (name, a), b in zip(named_leaves((p_c, s_c)).items(), tree_leaves((p_e, s_e))):
        bf16_ns = name.startswith("0.layers") and not name.endswith("norm.weight")
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-3 if bf16_ns else 1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    torch._dynamo.reset()
