"""Tests for nanomega.optim against independent references: torch.optim.AdamW / SGD,
torch.nn.utils.clip_grad_norm_, float64 and python-math formulas.

The model comparisons train a tiny LLaMA-style transformer for 50 steps on fixed random
token batches, our pure optimizer on one copy of the parameters and torch.optim on another.
"""
import math

import pytest
import torch

from nanomega import optim
from nanomega.config import ModelConfig, OptimConfig
from nanomega.models.transformer import init, loss_fn
from nanomega.optim import schedules
from nanomega.optim.base import add_decayed_weights, scale_by_learning_rate
from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_map, tree_unflatten
from tiers import slow

CFG = ModelConfig(vocab_size=256, vocab_multiple=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                  ffn_dim=64, max_seq_len=32)
STEPS, WARMUP, LR_MIN_RATIO = 50, 5, 0.1


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------- independent references

def ref_no_decay(name: str) -> bool:
    """The default OptimConfig.no_decay written out by hand: norm gains, biases, embeddings."""
    parts = name.split(".")
    return parts[0] in ("tok_embed", "pos_embed") or parts[-1] == "bias" or parts[-2].endswith("norm")


def ref_decay_mask(name, param):
    return not ref_no_decay(name)


def ref_cosine(lr, warmup, total, min_ratio, s):
    if s < warmup:
        return lr * (s + 1) / warmup
    progress = min(max((s - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def ref_wsd(lr, warmup, total, decay_fraction, min_ratio, s):
    if s < warmup:
        return lr * (s + 1) / warmup
    n_decay = int(decay_fraction * total)
    start = total - n_decay
    if s <= start:
        return lr
    return lr * (1 - (1 - min_ratio) * min((s - start) / n_decay, 1.0))


def ref_constant(lr, warmup, s):
    return lr * min((s + 1) / warmup, 1.0) if warmup else lr


def batches(n, seed=1, batch=4, seq=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (batch, seq + 1), generator=gen) for _ in range(n)]


def random_like(tree, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return tree_map(lambda x: torch.randn(x.shape, generator=gen) * scale, tree)


def snapshot(tree):
    return [(x.detach().clone(), x._version) for x in tree_leaves(tree)]


def assert_unchanged(tree, snap, what):
    leaves = tree_leaves(tree)
    assert len(leaves) == len(snap), what
    for x, (before, version) in zip(leaves, snap):
        assert x._version == version, f"{what} was modified in place"
        assert torch.equal(x.detach(), before), f"{what} changed"


# ---------------------------------------------------------------- 50 steps against torch.optim

def train_pair(opt, make_torch_opt, lr_fn, base_lr, grad_clip=0.0):
    """Train CFG for STEPS steps with `opt`, and with a torch.optim optimizer on a copy of the params.

    Each side runs its own forward (the losses are compared every step), but the torch side steps
    on our gradients. Independent backward passes would compare chaos, not optimizers: the two
    order their float ops differently, and the resulting 1-ulp parameter differences grow through
    the model (for Adam, a gradient element of size ~eps seen for the first time turns a tiny
    gradient difference into an O(1) difference of its update): independent trajectories part at
    the 1e-5 level within a few steps, even in float64 (the loss is computed in fp32).
    """
    params = init(CFG, 0)
    names = list(named_leaves(params))
    _, spec = tree_flatten(params)
    ref = [p.detach().clone().requires_grad_(True) for p in tree_leaves(params)]
    torch_opt = make_torch_opt(dict(zip(names, ref)))
    sched = torch.optim.lr_scheduler.LambdaLR(torch_opt, lambda s: lr_fn(s) / base_lr)
    state = opt.init(params)
    losses, ref_losses, norms = [], [], []
    for tokens in batches(STEPS):
        x, y = tokens[:, :-1], tokens[:, 1:]
        loss = loss_fn(params, x, y, CFG)
        grads = torch.autograd.grad(loss, tree_leaves(params))
        with torch.no_grad():
            ref_loss = loss_fn(tree_unflatten(ref, spec), x, y, CFG)
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(ref, grad_clip)
        torch_opt.step()
        sched.step()
        updates, state = opt.update(tree_unflatten(list(grads), spec), state, params)
        params = optim.apply_updates(params, updates)
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
        norms.append(optim.global_norm(list(grads)).item())
    return params, dict(zip(names, ref)), losses, ref_losses, norms


def assert_same_training(params, ref, losses, ref_losses, atol, rtol):
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 2e-6, f"step {step}: loss {a} vs torch {b}"
    start = named_leaves(init(CFG, 0))
    moved = max((p - start[n]).abs().max().item() for n, p in named_leaves(params).items())
    assert moved > 0.05, f"parameters barely moved ({moved}); the comparison would be vacuous"
    for name, p in named_leaves(params).items():
        torch.testing.assert_close(p.detach(), ref[name].detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def param_groups(named, weight_decay, masked_decay):
    if not masked_decay:
        return [{"params": list(named.values()), "weight_decay": weight_decay}]
    decay = [p for n, p in named.items() if not ref_no_decay(n)]
    no_decay = [p for n, p in named.items() if ref_no_decay(n)]
    assert decay and no_decay
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@pytest.mark.parametrize("b1, b2, weight_decay, masked_decay, grad_clip", [
    (0.9, 0.95, 0.1, True, 1.0),      # the project's defaults: clipping, no decay on norms/embeddings
    (0.9, 0.999, 0.1, False, 0.0),    # torch's default beta2, no clipping, decay on every parameter
    (0.0, 0.95, 0.1, True, 1.0),      # no first moment (RMSProp-like), which torch accepts too
])
def test_adamw_matches_torch(b1, b2, weight_decay, masked_decay, grad_clip):
    lr, eps = 1e-2, 1e-8
    opt = optim.adamw(schedules.warmup_cosine(lr, WARMUP, STEPS, LR_MIN_RATIO), b1, b2, eps, weight_decay,
                      ref_decay_mask if masked_decay else None, grad_clip)

    def make_torch_opt(named):
        return torch.optim.AdamW(param_groups(named, weight_decay, masked_decay), lr=lr, betas=(b1, b2), eps=eps)

    lr_fn = lambda s: ref_cosine(lr, WARMUP, STEPS, LR_MIN_RATIO, s)  # noqa: E731
    params, ref, losses, ref_losses, norms = train_pair(opt, make_torch_opt, lr_fn, lr, grad_clip)
    if grad_clip:
        assert max(norms) > grad_clip, "clipping never engaged"
    assert_same_training(params, ref, losses, ref_losses, atol=5e-7, rtol=1e-6)


@pytest.mark.parametrize("lr, momentum, nesterov, weight_decay, grad_clip", [
    (0.2, 0.9, False, 0.1, 1.0),      # heavy ball, masked L2 decay, clipping
    (0.2, 0.9, True, 0.1, 0.0),       # Nesterov, masked L2 decay
    (0.5, 0.0, False, 0.0, 0.0),      # plain SGD
])
def test_sgd_matches_torch(lr, momentum, nesterov, weight_decay, grad_clip):
    masked_decay = weight_decay > 0
    opt = optim.sgd(schedules.warmup_cosine(lr, WARMUP, STEPS, LR_MIN_RATIO), momentum, nesterov, weight_decay,
                    ref_decay_mask if masked_decay else None, grad_clip)

    def make_torch_opt(named):
        return torch.optim.SGD(param_groups(named, weight_decay, masked_decay), lr=lr, momentum=momentum,
                               nesterov=nesterov)

    lr_fn = lambda s: ref_cosine(lr, WARMUP, STEPS, LR_MIN_RATIO, s)  # noqa: E731
    params, ref, losses, ref_losses, norms = train_pair(opt, make_torch_opt, lr_fn, lr, grad_clip)
    if grad_clip:
        assert max(norms) > grad_clip, "clipping never engaged"
    assert_same_training(params, ref, losses, ref_losses, atol=5e-7, rtol=1e-6)


@pytest.mark.parametrize("b2", [0.95, 0.999, 0.9999])
def test_adam_bias_correction_is_exact(b2):
    """With a constant gradient m_hat == g and v_hat == g*g exactly, so every update is g / (|g| + eps).

    float64 tensors isolate the scalar bias corrections 1 - b**t: they must not lose precision
    (1 - float32(0.999)**t is off by 1.3e-5 relative, 1 - float32(0.9999)**t by 1.7e-4).
    """
    eps = 1e-8
    g = {"w": torch.tensor([1.0, -2.0, 0.5, 3e-3], dtype=torch.float64)}
    t = optim.scale_by_adam(0.9, b2, eps)
    state = t.init(g)
    expected = g["w"] / (g["w"].abs() + eps)
    for step in range(1, 101):
        u, state = t.update(g, state, g)
        torch.testing.assert_close(u["w"], expected, rtol=1e-6, atol=0, msg=lambda m: f"step {step}: {m}")


# ---------------------------------------------------------------- build() from config

@pytest.mark.parametrize("cfg", [
    OptimConfig(lr=1e-2, warmup_steps=3),
    OptimConfig(name="sgd", lr=0.1, warmup_steps=2, schedule="wsd", nesterov=True, grad_clip=0.5),
    OptimConfig(lr=1e-3, schedule="constant", warmup_steps=4, weight_decay=0.0, grad_clip=0.0, beta2=0.99),
], ids=["adamw-cosine", "sgd-wsd", "adamw-constant"])
def test_build_equals_explicit_construction(cfg):
    total = 10
    if cfg.schedule == "cosine":
        sched = schedules.warmup_cosine(cfg.lr, cfg.warmup_steps, total, cfg.min_lr_ratio)
    elif cfg.schedule == "wsd":
        sched = schedules.warmup_stable_decay(cfg.lr, cfg.warmup_steps, total, cfg.decay_fraction, cfg.min_lr_ratio)
    else:
        sched = schedules.constant(cfg.lr, cfg.warmup_steps)
    own = optim.check(cfg)     # the optimizer's own settings, at its defaults where cfg leaves them
    if cfg.name == "adamw":
        explicit = optim.adamw(sched, own.beta1, own.beta2, own.eps, cfg.weight_decay, ref_decay_mask, cfg.grad_clip)
    else:
        explicit = optim.sgd(sched, own.momentum, own.nesterov, cfg.weight_decay, ref_decay_mask, cfg.grad_clip)
    built = optim.build(cfg, total)
    params = init(CFG, 0)
    p_a, s_a, p_b, s_b = params, built.init(params), params, explicit.init(params)
    for step in range(total):
        grads = random_like(params, step, scale=0.1)
        u, s_a = built.update(grads, s_a, p_a)
        p_a = optim.apply_updates(p_a, u)
        u, s_b = explicit.update(grads, s_b, p_b)
        p_b = optim.apply_updates(p_b, u)
    assert list(named_leaves(s_a)) == list(named_leaves(s_b))
    for a, b in zip(tree_leaves((p_a, s_a)), tree_leaves((p_b, s_b))):
        assert torch.equal(a, b)


def test_build_unknown_optimizer():
    """Refused with the known ones (tests/test_extending.py may have registered Lion in this session)."""
    with pytest.raises(ValueError, match="'lamb' is not a registered optimizer; known: adamw, (lion, )?muon, sgd, "
                                         "shampoo, soap"):
        optim.build(OptimConfig(name="lamb"), 10)


def test_decay_mask_matches_no_decay_patterns():
    """norms, biases and embeddings are excluded on every architecture variant."""
    for cfg in (CFG, ModelConfig(d_model=32, n_heads=4, norm="layernorm", bias=True, position="learned", mlp="gelu"),
                ModelConfig(d_model=32, n_heads=4, qkv_bias=True, qk_norm=True, tie_embeddings=True)):
        mask = optim.decay_mask(OptimConfig())
        names = named_leaves(init(cfg, 0, device="meta"))
        assert {n: mask(n, p) for n, p in names.items()} == {n: not ref_no_decay(n) for n in names}
    assert all(optim.decay_mask(OptimConfig(no_decay=()))(n, None) for n in names)


def test_build_with_no_parameter_decayed():
    """no_decay matching every name (an empty decay group) works and equals weight_decay=0."""
    params = init(CFG, 0)
    grads = random_like(params, 0, scale=0.1)
    for name in ("adamw", "sgd"):
        a = optim.build(OptimConfig(name=name, no_decay=("*",), weight_decay=0.1), 10)
        b = optim.build(OptimConfig(name=name, weight_decay=0.0), 10)
        ua, _ = a.update(grads, a.init(params), params)
        ub, _ = b.update(grads, b.init(params), params)
        for x, y in zip(tree_leaves(ua), tree_leaves(ub)):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- schedules

def _check_schedule(fn, ref, total, lr):
    for s in range(total + 1):
        expected = ref(s)
        for step in (s, torch.tensor(s, dtype=torch.int64)):
            got = fn(step)
            assert isinstance(got, torch.Tensor) and got.dim() == 0
            assert math.isclose(got.item(), expected, rel_tol=1e-6, abs_tol=1e-7 * lr), \
                f"step {s} ({type(step).__name__}): {got.item()} vs {expected}"


@pytest.mark.parametrize("lr, warmup, total, min_ratio", [
    (3e-3, 10, 100, 0.1), (1.0, 1, 7, 0.0), (0.5, 0, 20, 0.25), (1e-2, 50, 1000, 0.1)])
def test_warmup_cosine(lr, warmup, total, min_ratio):
    fn = schedules.warmup_cosine(lr, warmup, total, min_ratio)
    _check_schedule(fn, lambda s: ref_cosine(lr, warmup, total, min_ratio, s), total, lr)
    if warmup:
        assert math.isclose(fn(warmup - 1).item(), lr, rel_tol=1e-6)       # warmup reaches lr at warmup-1
        assert fn(0).item() < lr or warmup == 1
    assert math.isclose(fn(total).item(), lr * min_ratio, rel_tol=1e-6, abs_tol=1e-7 * lr)
    assert math.isclose(fn(10 * total).item(), lr * min_ratio, rel_tol=1e-6, abs_tol=1e-7 * lr)  # stays there
    values = [fn(s).item() for s in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))                  # monotone decay


@pytest.mark.parametrize("lr, warmup, total, fraction, min_ratio", [
    (3e-3, 10, 100, 0.2, 0.0), (1.0, 3, 50, 0.1, 0.1), (0.1, 0, 33, 0.25, 0.0)])
def test_warmup_stable_decay(lr, warmup, total, fraction, min_ratio):
    fn = schedules.warmup_stable_decay(lr, warmup, total, fraction, min_ratio)
    _check_schedule(fn, lambda s: ref_wsd(lr, warmup, total, fraction, min_ratio, s), total, lr)
    n_decay = int(fraction * total)
    start = total - n_decay
    stable = [fn(s).item() for s in range(max(warmup - 1, 0), start + 1)]
    assert all(math.isclose(v, lr, rel_tol=1e-6) for v in stable)          # constant in the middle
    decay = [fn(s).item() for s in range(start, total + 1)]
    steps = [a - b for a, b in zip(decay, decay[1:])]
    assert all(math.isclose(d, lr * (1 - min_ratio) / n_decay, rel_tol=1e-4) for d in steps)  # linear
    assert math.isclose(fn(total).item(), lr * min_ratio, abs_tol=1e-7 * lr)


@pytest.mark.parametrize("lr, warmup", [(3e-3, 0), (3e-3, 1), (0.1, 8)])
def test_constant(lr, warmup):
    fn = schedules.constant(lr, warmup)
    _check_schedule(fn, lambda s: ref_constant(lr, warmup, s), 30, lr)
    if warmup:
        assert math.isclose(fn(warmup - 1).item(), lr, rel_tol=1e-6)


# ---------------------------------------------------------------- clipping and norms

def _grad_tree(scale):
    gen = torch.Generator().manual_seed(3)
    return {"a": {"weight": torch.randn(5, 7, generator=gen) * scale, "bias": torch.randn(7, generator=gen) * scale},
            "layers": [{"w": torch.randn(3, 4, 2, generator=gen) * scale} for _ in range(2)],
            "s": torch.randn((), generator=gen) * scale}


def test_global_norm_float64_reference():
    tree = _grad_tree(1.0)
    expected = math.sqrt(sum(float((x.double() ** 2).sum()) for x in tree_leaves(tree)))
    got = optim.global_norm(tree)
    assert got.dim() == 0 and math.isclose(got.item(), expected, rel_tol=1e-6)
    assert optim.global_norm({"z": torch.zeros(3)}).item() == 0.0


@pytest.mark.parametrize("scale, max_norm", [(1.0, 1.0), (1.0, 1e3), (1e-3, 0.5)],
                         ids=["scaled", "unscaled", "tiny-unscaled"])
def test_clip_by_global_norm_matches_torch(scale, max_norm):
    tree = _grad_tree(scale)
    ref = [x.clone().requires_grad_(True) for x in tree_leaves(tree)]
    for p, g in zip(ref, tree_leaves(tree)):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    snap = snapshot(tree)
    t = optim.clip_by_global_norm(max_norm)
    out, state = t.update(tree, t.init(tree), tree)
    assert_unchanged(tree, snap, "grads")
    _, spec = tree_flatten(tree)
    assert tree_flatten(out)[1] == spec
    for got, p in zip(tree_leaves(out), ref):
        torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(optim.global_norm(tree), total, rtol=1e-6, atol=0)
    if total > max_norm:
        assert math.isclose(optim.global_norm(out).item(), max_norm, rel_tol=1e-5)
    else:
        for got, g in zip(tree_leaves(out), tree_leaves(tree)):
            assert torch.equal(got, g)


# ---------------------------------------------------------------- masked

def subset(tree, keep):
    """The nested tree restricted to leaves whose dotted name satisfies keep (list indices kept)."""
    def go(node, prefix):
        if isinstance(node, dict):
            out = {k: go(v, f"{prefix}{k}.") for k, v in node.items()}
            return {k: v for k, v in out.items() if isinstance(v, torch.Tensor) or v}
        if isinstance(node, list):
            return [go(v, f"{prefix}{i}.") or {} for i, v in enumerate(node)]
        return node if keep(prefix[:-1]) else None
    return go(tree, "")


def test_masked_leaves_excluded_untouched():
    params = init(CFG, 0)
    grads = random_like(params, 7)
    t = optim.masked(optim.scale_by_adam(0.9, 0.95), ref_decay_mask)
    state = t.init(params)
    updates, state = t.update(grads, state, params)
    inner = optim.scale_by_adam(0.9, 0.95)
    kept = subset(params, lambda n: not ref_no_decay(n))
    expected, _ = inner.update(subset(grads, lambda n: not ref_no_decay(n)), inner.init(kept), kept)
    expected = named_leaves(expected)
    g = named_leaves(grads)
    for name, u in named_leaves(updates).items():
        if ref_no_decay(name):
            assert torch.equal(u, g[name]), name             # passed through as is
        else:
            assert torch.equal(u, expected[name]), name
    state_names = list(named_leaves(state))
    for name in g:
        hits = [s for s in state_names if s.endswith("." + name)]
        assert len(hits) == (0 if ref_no_decay(name) else 2), (name, hits)  # mu and nu of kept names only

    # decay through a mask: excluded parameters get exactly -lr * g, the others -lr * (g + wd * p)
    lr, wd = 0.5, 0.25
    t = optim.chain(decay=optim.masked(add_decayed_weights(wd), ref_decay_mask),
                    lr=scale_by_learning_rate(lambda s: lr))
    updates, _ = t.update(grads, t.init(params), params)
    p = named_leaves(params)
    for name, u in named_leaves(updates).items():
        expected = -lr * (g[name] + (0.0 if ref_no_decay(name) else wd) * p[name].detach())
        torch.testing.assert_close(u, expected, rtol=1e-6, atol=1e-7)


def test_masked_with_nothing_selected_passes_everything_through():
    params = init(CFG, 0)
    grads = random_like(params, 1)
    t = optim.masked(optim.clip_by_global_norm(1e-3), lambda n, p: False)
    updates, _ = t.update(grads, t.init(params), params)
    for u, g in zip(tree_leaves(updates), tree_leaves(grads)):
        assert torch.equal(u, g)


def test_state_names_contain_parameter_names():
    """Checkpoints key optimizer state by parameter name: mu/nu (or the momentum trace) per name."""
    params = init(CFG, 0)
    names = list(named_leaves(params))
    for cfg, slots in ((OptimConfig(), ("mu", "nu")), (OptimConfig(name="sgd"), ("trace",))):
        state = optim.build(cfg, 10).init(params)
        state_names = named_leaves(state)
        assert len(set(state_names)) == len(state_names)
        for name in names:
            for slot in slots:
                hits = [s for s in state_names if s.endswith(f"{slot}.{name}")]
                assert len(hits) == 1, (name, slot, hits)
                assert state_names[hits[0]].shape == named_leaves(params)[name].shape


# ---------------------------------------------------------------- purity

@pytest.mark.parametrize("make", [
    lambda s: optim.adamw(s, 0.9, 0.95, 1e-8, 0.1, ref_decay_mask, grad_clip=0.1),
    lambda s: optim.sgd(s, 0.9, True, 0.1, ref_decay_mask, grad_clip=0.1),
    lambda s: optim.build(OptimConfig(name="muon", lr=0.02, warmup_steps=2, muon_momentum=0.95), 10),
    lambda s: optim.build(OptimConfig(name="shampoo", precondition_frequency=1, start_preconditioning_step=1), 10),
    lambda s: optim.build(OptimConfig(name="soap", precondition_frequency=1), 10),
], ids=["adamw", "sgd", "muon", "shampoo", "soap"])
def test_update_is_pure(make):
    opt = make(schedules.warmup_cosine(1e-2, 2, 10))
    params = init(CFG, 0)
    _, state = opt.update(random_like(params, 0), opt.init(params), params)   # a non-trivial state
    grads = random_like(params, 1)
    snaps = {"grads": snapshot(grads), "state": snapshot(state), "params": snapshot(params)}
    first = opt.update(grads, state, params)
    for what, tree in (("grads", grads), ("state", state), ("params", params)):
        assert_unchanged(tree, snaps[what], what)
    second = opt.update(grads, state, params)                # same inputs, same outputs
    for a, b in zip(tree_leaves(first), tree_leaves(second)):
        assert torch.equal(a, b)
    new = optim.apply_updates(params, first[0])
    assert_unchanged(params, snaps["params"], "params (apply_updates)")
    assert all(p.is_leaf and p.requires_grad for p in tree_leaves(new))


# ---------------------------------------------------------------- torch.compile

@slow     # 10 s of compiling on 2 cores; Shampoo's and SOAP's compiled updates stay in the fast tier
def test_compiled_update_matches_eager():
    gen = torch.Generator().manual_seed(0)
    params = {"tok_embed": {"weight": torch.randn(8, 4, generator=gen)},
              "layers": [{"attn_norm": {"weight": torch.randn(4, generator=gen)},
                          "attn": {"wq": {"weight": torch.randn(4, 4, generator=gen)}}}]}
    params = tree_map(lambda x: x.requires_grad_(True), params)
    opt = optim.adamw(schedules.warmup_cosine(1e-2, 2, 10), 0.9, 0.95, 1e-8, 0.1,
                      optim.decay_mask(OptimConfig()), grad_clip=1.0)
    torch._dynamo.reset()
    compiled = torch.compile(opt.update, fullgraph=True)
    p_e, s_e, p_c, s_c = params, opt.init(params), params, opt.init(params)
    for step in range(3):
        grads = random_like(params, step)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):   # the step count is traced, not baked in
            u_c, s_c = compiled(grads, s_c, p_c)
        u_e, s_e = opt.update(grads, s_e, p_e)
        p_c, p_e = optim.apply_updates(p_c, u_c), optim.apply_updates(p_e, u_e)
    assert list(named_leaves(s_c)) == list(named_leaves(s_e))
    for a, b in zip(tree_leaves((p_c, s_c)), tree_leaves((p_e, s_e))):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()


def test_state_metrics_reports_shampoo_root_failures():
    params = {"layers": [{"w": torch.randn(6, 4)}], "b": torch.randn(4)}
    assert optim.state_metrics(optim.build(OptimConfig(name="adamw"), 10).init(params)) == {}
    state = optim.build(OptimConfig(name="shampoo"), 10).init(params)
    assert optim.state_metrics(state) == {"precond_failures": 0}
    from nanomega.tree import map_with_name
    bumped = map_with_name(lambda n, x: torch.tensor(3) if n.endswith("failures") else x, state)
    assert optim.state_metrics(bumped) == {"precond_failures": 3}


# ---------------------------------------------------------------- settings that belong to one optimizer

@pytest.mark.parametrize("args, message", [
    (["--optim.name=muon", "--optim.momentum=0.95"], "optim.momentum is not read by muon; muon reads optim.beta1, "
     "optim.beta2, optim.eps, optim.adam_lr_ratio, optim.muon_momentum"),
    (["--optim.name=shampoo", "--optim.max_precond_dim=512"], "optim.max_precond_dim is not read by shampoo"),
    (["--optim.name=soap", "--optim.shampoo_block_size=512"], "optim.shampoo_block_size is not read by soap; soap "
     "reads optim.beta1, optim.beta2, optim.eps, optim.adam_lr_ratio, optim.precondition_frequency"),
    (["--optim.nesterov=true"], "optim.nesterov is not read by adamw; adamw reads optim.beta1, optim.beta2, optim.eps "
                                "(besides the common"),
    (["--optim.name=sgd", "--optim.beta2=0.9"], "optim.beta2 is not read by sgd; sgd reads optim.momentum, "
                                                "optim.nesterov (besides"),
    (["--optim.name=sgd", "--optim.shampoo.momentum=0.5"], "optim.shampoo.momentum is not read by shampoo"),
    (["--optim.lamb.b1=0.5"], "optim.lamb.b1: 'lamb' is not a registered optimizer; known: adamw, "),
    (["--optim.name=muon", "--optim.ns_steps=0"], "optim.ns_steps=0 must lie in [1, inf)"),
    (["--optim.name=muon", "--optim.ns_steps=2.5"], "optim.ns_steps=2.5 is not a int (muon's setting)"),
    (["--optim.name=muon", "--optim.muon_scale=big"],
     "optim.muon_scale='big' is not one of ('spectral', 'match_adam')"),
])
def test_a_setting_the_optimizer_does_not_read_is_refused(args, message):
    """A setting the chosen optimizer does not read would do nothing: refused, naming what it reads (and a
    value out of its range or of the wrong type, naming the range or type), by optim.check: the first check
    of train.py's preflight (parallel.mesh.validate_layout), before any work."""
    from nanomega.config import parse_args
    from nanomega.parallel.mesh import validate_layout
    with pytest.raises(ValueError) as err:
        validate_layout(parse_args(args))
    assert message in str(err.value)


def test_a_setting_scoped_to_an_optimizer_is_read_when_that_optimizer_is_chosen():
    """--optim.NAME.KEY=VALUE: one command line for several optimizers (tests/parity.py); an unscoped
    setting wins over a scoped one."""
    from nanomega.config import parse_args
    args = ["--optim.shampoo.precondition_frequency=3", "--optim.muon.ns_steps=4"]
    assert optim.check(parse_args(args + ["--optim.name=shampoo"]).optim).precondition_frequency == 3
    assert optim.check(parse_args(args + ["--optim.name=muon"]).optim).ns_steps == 4
    assert optim.check(parse_args(args).optim) == optim.check(OptimConfig())
    both = parse_args(args + ["--optim.name=muon", "--optim.ns_steps=6"]).optim
    assert optim.check(both).ns_steps == 6


def test_settings_round_trip_through_the_checkpoint_json_and_python():
    """A command line's settings, a config written in Python and the checkpoint's JSON of either are one config."""
    from nanomega.config import Config, from_dict, parse_args, to_dict
    import dataclasses
    import json
    cli = parse_args(["--optim.name=muon", "--optim.muon_momentum=0.9", "--optim.ns_coefficients=polar_express",
                      "--optim.soap.precondition_frequency=3"])
    python = OptimConfig(name="muon", muon_momentum=0.9, ns_coefficients="polar_express",
                         settings={"soap.precondition_frequency": 3})
    assert cli.optim == dataclasses.replace(python, lr=cli.optim.lr, warmup_steps=cli.optim.warmup_steps)
    back = from_dict(json.loads(json.dumps(to_dict(cli))))
    assert back == cli and hash(back.optim) == hash(cli.optim)
    assert dataclasses.replace(cli.optim, muon_momentum=0.8).settings == (
        ("muon_momentum", 0.8), ("ns_coefficients", "polar_express"), ("soap.precondition_frequency", 3))
    assert from_dict(to_dict(Config())) == Config()


def test_muon_gets_its_usual_momentum_without_flags():
    """--optim.name=muon (no clipping, to read the buffer): the momentum buffer is the EMA with 0.95 (Keller Jordan's, torch.optim.Muon's),
    not SGD's 0.9: after g1, g2 it is 0.95 * 0.05 * g1 + 0.05 * g2."""
    from nanomega.config import parse_args
    cfg = parse_args(["--optim.name=muon", "--optim.grad_clip=0"]).optim
    opt = optim.build(cfg, 10)
    params = {"layers": [{"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(0))}]}
    state = opt.init(params)
    g1, g2 = (random_like(params, seed) for seed in (1, 2))
    _, state = opt.update(g1, state, params)
    _, state = opt.update(g2, state, params)
    expected = 0.95 * 0.05 * g1["layers"][0]["w"] + 0.05 * g2["layers"][0]["w"]
    torch.testing.assert_close(state["muon"].momentum["layers.0.w"], expected, rtol=1e-6, atol=1e-7)
