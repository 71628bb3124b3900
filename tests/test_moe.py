"""The mixture-of-experts layer (nanomega.models.moe) against references written here, token by token
in plain Python: dispatch (dropless and token dropping, every kernel) and its gradients, the capacity
rule on a hand-built routing, the routers (Mixtral, Qwen2-MoE, DeepSeek-V3 sigmoid and group-limited,
expert bias), the balancing and z losses and how the model adds them. The rest of MoE (balancing by
the expert bias, the model's layout, the optimizers, config validation): tests/test_moe_model.py."""
import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from nanomega.config import ModelConfig
from nanomega.models import moe
from nanomega.models.mlp import expert_dim
from nanomega.models.transformer import forward, init, loss_and_stats

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

D, F_DIM = 16, 8


def layer_cfg(**kw) -> ModelConfig:
    """One MoE layer's settings (the attention fields only have to validate)."""
    base = dict(d_model=D, n_heads=2, n_layers=1, n_experts=4, top_k=2, expert_ffn_dim=F_DIM)
    cfg = ModelConfig(**{**base, **kw})
    cfg.validate()
    return cfg


def moe_params(cfg, seed=0, scale=0.5) -> dict:
    gen = torch.Generator().manual_seed(seed)
    E, d, f = cfg.n_experts, cfg.d_model, expert_dim(cfg)
    r = lambda *shape: (torch.randn(*shape, generator=gen) * scale).requires_grad_(True)
    return {"router": {"weight": r(E, d)}, "experts": {"w_gate": r(E, f, d), "w_up": r(E, f, d), "w_down": r(E, d, f)}}


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def assert_close(actual, expected, rel=2e-6, what=""):
    """max |actual - expected| <= rel * max |expected| (fp32 sums in another order)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1e-30)
    assert err <= rel * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g}"


# ---------------------------------------------------------------- the references

def ref_route_token(logits, cfg, bias=None):
    """One token's routing by the definitions: (chosen experts, highest choice first; their weights).
    logits [E] (differentiable); the choice is made on Python floats."""
    E, k = cfg.n_experts, cfg.top_k
    scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
    softmax_after = cfg.router_score == "softmax" and not cfg.router_softmax_first
    choice = (logits if softmax_after else scores).tolist()
    if bias is not None:
        choice = [c + b for c, b in zip(choice, bias.tolist())]
    allowed = list(range(E))
    if cfg.router_groups > 1:
        size = E // cfg.router_groups
        group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:k // cfg.router_topk_groups])
                       for g in range(cfg.router_groups)]
        best = sorted(range(cfg.router_groups), key=lambda g: -group_score[g])[:cfg.router_topk_groups]
        allowed = [e for e in range(E) if e // size in best]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
    if softmax_after:
        w = logits[chosen].softmax(-1)
    else:
        w = scores[chosen]
        if cfg.router_norm_topk:
            w = w / w.sum()
    return chosen, w * cfg.router_scale


def ref_capacity(cfg, T):
    """C = ceil(cf * T * k / E), capped at T, in exact arithmetic (cf as the decimal it is written as)."""
    return min(T, math.ceil(Fraction(str(cfg.capacity_factor)) * T * cfg.top_k / cfg.n_experts))


def ref_keep(routes, B, T, cfg):
    """{(b, t, e): kept} by the capacity rule, per sequence and expert."""
    keep = {(b, t, e): True for b in range(B) for t in range(T) for e in routes[b][t][0]}
    if not cfg.capacity_factor:
        return keep
    C = ref_capacity(cfg, T)
    for b in range(B):
        for e in range(cfg.n_experts):
            mine = [t for t in range(T) if e in routes[b][t][0]]        # sequence order
            if cfg.drop_policy == "probs":   # largest weight first; sorted() is stable: ties keep the earlier token
                weight = lambda t: float(routes[b][t][1][routes[b][t][0].index(e)].detach())
                mine = sorted(mine, key=lambda t: -weight(t))
            for t in mine[C:]:
                keep[b, t, e] = False
    return keep


def ref_moe(p, x, cfg):
    """The layer token by token: (output [B, T, d], keep dict, routes)."""
    B, T, d = x.shape
    W = p["router"]["weight"]
    bias = p["router"].get("expert_bias")
    w = p["experts"]
    routes = [[ref_route_token(W @ x[b, t], cfg, bias) for t in range(T)] for b in range(B)]
    keep = ref_keep(routes, B, T, cfg)
    out = []
    for b in range(B):
        for t in range(T):
            y = torch.zeros(d)
            for e, weight in zip(*routes[b][t]):
                if keep[b, t, e]:
                    h = F.silu(w["w_gate"][e] @ x[b, t]) * (w["w_up"][e] @ x[b, t])
                    y = y + weight * (w["w_down"][e] @ h)
            out.append(y)
    return torch.stack(out).view(B, T, d), keep, routes


def ref_losses(W, x, cfg, bias=None):
    """(balancing loss, z-loss, counts [E]) of x [B, T, d] by the module doc's formulas."""
    B, T, d = x.shape
    E, k = cfg.n_experts, cfg.top_k
    logits = x.reshape(B * T, d) @ W.t()
    probs = logits.softmax(-1) if cfg.router_score == "softmax" else \
        logits.sigmoid() / logits.sigmoid().sum(-1, keepdim=True)
    count = torch.zeros(B, T, E)
    for n in range(B * T):
        for e in ref_route_token(logits[n].detach(), cfg, bias)[0]:
            count[n // T, n % T, e] = 1.0
    probs = probs.view(B, T, E)
    if cfg.aux_loss == "micro_batch":
        N = B * T
        aux = E / (k * N * N) * (count.sum((0, 1)) * probs.sum((0, 1))).sum()
    else:
        aux = sum(E / (k * T * T) * (count[b].sum(0) * probs[b].sum(0)).sum() for b in range(B)) / B
    z = torch.logsumexp(logits, -1).square().mean()
    return aux, z, count.sum((0, 1))


# ---------------------------------------------------------------- 1. dispatch == the per-token loop

DISPATCH = {
    "dropless_grouped_mm": dict(expert_kernel="grouped_mm"),
    "dropless_loop": dict(no_grouped_mm=True),      # the per-expert matmuls of a GPU without the grouped GEMM
    "dropless_top1_switch": dict(top_k=1, router_norm_topk=False, expert_kernel="grouped_mm"),  # w = p, not 1
    "dropless_unused_expert_grouped_mm": dict(expert_kernel="grouped_mm", starve=True),
    "dropless_unused_expert_loop": dict(no_grouped_mm=True, starve=True),
    "probs_0.5": dict(capacity_factor=0.5),
    "probs_1.0_loop": dict(capacity_factor=1.0, no_grouped_mm=True),
    "probs_1.25": dict(capacity_factor=1.25),
    "position_0.5": dict(capacity_factor=0.5, drop_policy="position"),
    "position_1.0": dict(capacity_factor=1.0, drop_policy="position", no_grouped_mm=True),
    "position_1.25": dict(capacity_factor=1.25, drop_policy="position"),
    "probs_0.5_padded": dict(capacity_factor=0.5, pad_to_capacity=True),
    "probs_1.25_padded": dict(capacity_factor=1.25, pad_to_capacity=True),
    "position_1.0_padded": dict(capacity_factor=1.0, drop_policy="position", pad_to_capacity=True),
    "position_0.5_padded_unused_expert": dict(capacity_factor=0.5, drop_policy="position", pad_to_capacity=True,
                                              starve=True),
}


@pytest.mark.parametrize("case", DISPATCH)
def test_dispatch_and_gradients_equal_the_per_token_loop(case, monkeypatch):
    kw = dict(DISPATCH[case])
    starve = kw.pop("starve", False)
    if kw.pop("no_grouped_mm", False):     # "auto" then runs a matmul per expert
        monkeypatch.setattr(moe, "grouped_mm_available", lambda x: False)
    cfg = layer_cfg(**kw)
    B, T = 3, 8
    p = moe_params(cfg, seed=1)
    x = randn(B, T, D, seed=2)
    if starve:  # a feature every token has, and the last expert hates it: that expert gets no row at all
        x[..., 0] = 3.0
        with torch.no_grad():
            p["router"]["weight"][-1, 0] = -20.0
    x.requires_grad_(True)
    y, stats = moe.routed_moe(p, x, cfg)
    ref, keep, _ = ref_moe(p, x, cfg)
    assert_close(y, ref, what="output")

    # the loads (before dropping) and the drops are the reference's
    load = torch.zeros(cfg.n_experts)
    for (b, t, e) in keep:
        load[e] += 1
    assert torch.equal(stats.load, load)
    assert stats.dropped.item() == sum(not v for v in keep.values())
    if starve:
        assert load[-1] == 0
    assert (stats.dropped.item() > 0) == bool(cfg.capacity_factor)   # every token-dropping case really drops

    # gradients w.r.t. the input, the router and every expert weight
    g = randn(B, T, D, seed=3)
    leaves = [x, p["router"]["weight"], *p["experts"].values()]
    ours = torch.autograd.grad((y * g).sum(), leaves)
    theirs = torch.autograd.grad((ref * g).sum(), leaves)
    for name, a, b in zip(["x", "router", "w_gate", "w_up", "w_down"], ours, theirs):
        assert b.abs().max() > 0, name
        assert_close(a, b, what=f"grad {name}")


# ---------------------------------------------------------------- 2. the capacity rule, by hand

# router weight = identity (d = E = 4): the logits are the inputs. k = 2, T = 6, cf = 0.5 -> C = ceil(1.5) = 2.
# Renormalized top-2 weights: w(a) = sigmoid(l_a - l_b). Sequence 0 ("L" = -10, never chosen):
#   t0: e0=2, e1=1      -> e0 .731, e1 .269        t3: e0=2.5, e1=2 -> e0 .622, e1 .378
#   t1: e0=1, e2=3      -> e2 .881, e0 .119        t4: e2=1, e3=0   -> e2 .731, e3 .269
#   t2: e0=4, e3=1      -> e0 .953, e3 .047        t5: e1=0, e3=3   -> e3 .953, e1 .047
# e0 is chosen by t0..t3: "position" keeps t0, t1; "probs" keeps t2 (.953), t0 (.731).
# e1 by t0, t3, t5: both keep t0, t3. e2 by t1, t4: both kept. e3 by t2, t4, t5: "position" keeps
# t2, t4; "probs" t5 (.953), t4 (.269).
# Sequence 1: six identical tokens choosing e0 (.731) and e1 (.269): equal weights, so both policies
# keep the two earliest tokens for each expert -- and nothing of sequence 0 counts against them.
L = -10.0
SEQ0 = [[2, 1, L, L], [1, L, 3, L], [4, L, L, 1], [2.5, 2, L, L], [L, L, 1, 0], [L, 0, L, 3]]
SEQ1 = [[1, 0, L, L]] * 6
CHOICES = [[{0, 1}, {0, 2}, {0, 3}, {0, 1}, {2, 3}, {1, 3}], [{0, 1}] * 6]
DROPPED = {"position": {(0, 2, 0), (0, 3, 0), (0, 5, 1), (0, 5, 3)},
           "probs": {(0, 1, 0), (0, 3, 0), (0, 5, 1), (0, 2, 3)}}
DROPPED_SEQ1 = {(1, t, e) for t in range(2, 6) for e in (0, 1)}


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_drops_exactly_the_defined_tokens(policy, pad):
    cfg = layer_cfg(d_model=4, capacity_factor=0.5, drop_policy=policy, pad_to_capacity=pad)
    B, T = 2, 6
    assert moe.capacity(cfg, T) == 2 == ref_capacity(cfg, T)
    x = torch.tensor([SEQ0, SEQ1], dtype=torch.float32)
    router = {"weight": torch.eye(4)}
    routing = moe.route(router, x.view(B * T, 4), cfg)
    assert [[set(r) for r in routing.experts.view(B, T, 2).tolist()[b]] for b in range(B)] == CHOICES
    kept = moe.kept(routing, B, T, cfg)
    assert kept.shape == (B * T, 2) and kept.dtype == torch.bool
    dropped = {(n // T, n % T, e) for n in range(B * T) for j, e in enumerate(routing.experts[n].tolist())
               if not kept[n, j]}
    assert dropped == DROPPED[policy] | DROPPED_SEQ1

    p = {"router": router, "experts": moe_params(cfg, seed=4)["experts"]}
    y, stats = moe.routed_moe(p, x, cfg)
    assert stats.dropped.item() == len(DROPPED[policy]) + len(DROPPED_SEQ1) == 12
    assert stats.load.tolist() == [10, 9, 2, 3]       # counted before dropping
    # a token whose both choices were dropped gets exactly zero from the routed experts
    assert torch.equal(y[1, 2:], torch.zeros(4, 4))
    assert_close(y, ref_moe(p, x, cfg)[0], what="output")

    # the capacity group is the sequence: sequence 0 alone drops the same tokens
    alone = moe.kept(moe.route(router, x[0], cfg), 1, T, cfg)
    assert torch.equal(alone, kept[:T])


def test_capacity_formula_and_cap():
    for E, k, T, cf in [(4, 2, 6, 0.5), (8, 2, 10, 1.0), (8, 1, 7, 1.25), (16, 4, 9, 1.5), (4, 2, 6, 10.0),
                        (64, 6, 32, 0.3)]:
        cfg = layer_cfg(n_experts=E, top_k=k, capacity_factor=cf)
        assert moe.capacity(cfg, T) == ref_capacity(cfg, T)
    assert moe.capacity(layer_cfg(capacity_factor=10.0), 6) == 6   # never more than the sequence
    # nothing dropped when the capacity is the whole sequence
    cfg = layer_cfg(capacity_factor=10.0)
    routing = moe.route({"weight": randn(4, D, seed=5)}, randn(12, D, seed=6), cfg)
    assert moe.kept(routing, 2, 6, cfg).all()


def test_capacity_is_the_exact_ceiling_for_decimal_capacity_factors():
    """cf = 1.1, T = 100, E = 10, k = 1: C = ceil(11) = 11. In floats 1.1 * 100 is 110.00000000000001, so a
    float ceil gives 12 -- one more assignment per expert and sequence than the rule, and those tokens are
    not dropped. (Found by this test: models/moe.py `capacity`.)"""
    for E, k, T in [(10, 1, 100), (10, 2, 100), (4, 2, 100), (16, 8, 100)]:
        cfg = layer_cfg(n_experts=E, top_k=k, capacity_factor=1.1)
        assert moe.capacity(cfg, T) == ref_capacity(cfg, T) == math.ceil(Fraction(11, 10) * T * k / E), (E, k, T)


# ---------------------------------------------------------------- 3. routers

ROUTERS = {
    "mixtral": dict(),
    "qwen2_moe_unnormalized": dict(router_norm_topk=False),
    "topk_then_softmax": dict(router_softmax_first=False),
    "deepseek_v3_sigmoid": dict(router_score="sigmoid", router_scale=2.5),
    "sigmoid_unnormalized": dict(router_score="sigmoid", router_norm_topk=False),
    # k / topk_groups = 1: a group scores its best expert (then the groups change no choice: checked below)
    "groups_top1_per_group": dict(n_experts=8, top_k=2, router_groups=4, router_topk_groups=2),
    # k / topk_groups = 2: a group of two scores the sum of both, and the token takes the best pair
    "groups_one_group": dict(n_experts=8, top_k=2, router_groups=4, router_topk_groups=1),
    "groups_top2_per_group_sigmoid": dict(n_experts=16, top_k=4, router_groups=4, router_topk_groups=2,
                                          router_score="sigmoid", router_scale=2.5),
    "groups_sigmoid_bias": dict(n_experts=16, top_k=4, router_groups=4, router_topk_groups=2,
                                router_score="sigmoid", router_scale=2.5, expert_bias_rate=1e-3),
    "softmax_bias": dict(expert_bias_rate=1e-3, n_experts=8),
}


@pytest.mark.parametrize("name", ROUTERS)
def test_router_matches_its_formula(name):
    cfg = layer_cfg(**ROUTERS[name])
    E, N = cfg.n_experts, 64
    W, x = randn(E, D, seed=7, scale=0.5), randn(N, D, seed=8)
    router = {"weight": W}
    bias = None
    if cfg.expert_bias_rate:
        bias = randn(E, seed=9, scale=0.3 if cfg.router_score == "sigmoid" else 1.0)
        router["expert_bias"] = bias
    r = moe.route(router, x, cfg)
    logits = x @ W.t()
    assert_close(r.logits, logits, what="logits")
    probs = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid() / logits.sigmoid().sum(-1, True)
    assert_close(r.probs, probs, what="probs")
    for n in range(N):
        chosen, w = ref_route_token(logits[n], cfg, bias)
        assert r.experts[n].tolist() == chosen, n
        assert_close(r.weights[n], w, what=f"weights of token {n}")
    if cfg.router_norm_topk:
        assert_close(r.weights.sum(-1), torch.full((N,), cfg.router_scale), what="normalized")
    if cfg.router_groups > 1:   # only experts of the best groups ...
        size = E // cfg.router_groups
        groups = r.experts // size
        assert all(len(set(g)) <= cfg.router_topk_groups for g in groups.tolist())
        plain = moe.route(router, x, layer_cfg(**{**ROUTERS[name], "router_groups": 1, "router_topk_groups": 1}))
        # ... which changes some token's choice, unless a group scores its best expert only: then the
        # groups of the k best experts are always among the k best groups
        assert torch.equal(plain.experts, r.experts) == (cfg.top_k // cfg.router_topk_groups == 1)
    if bias is not None:        # the bias moves the choice, not the weights (those are the unbiased scores)
        unbiased = moe.route({"weight": W}, x, cfg)
        assert not torch.equal(unbiased.experts, r.experts)
        scores = logits.softmax(-1) if cfg.router_score == "softmax" else logits.sigmoid()
        w = scores.gather(1, r.experts)
        assert_close(r.weights, w / w.sum(-1, True) * cfg.router_scale, what="unbiased weights")


def test_topk_then_softmax_equals_softmax_then_topk_renormalized():
    x, W = randn(128, D, seed=10), randn(8, D, seed=11, scale=0.7)
    a = moe.route({"weight": W}, x, layer_cfg(n_experts=8, router_softmax_first=False))
    b = moe.route({"weight": W}, x, layer_cfg(n_experts=8))
    assert torch.equal(a.experts, b.experts)
    assert_close(a.weights, b.weights, what="weights")


def test_router_runs_in_fp32_and_bias_gets_no_gradient():
    cfg = layer_cfg(router_score="sigmoid", expert_bias_rate=1e-3, n_experts=8)
    W = randn(8, D, seed=12).requires_grad_(True)
    bias = randn(8, seed=13, scale=0.5).requires_grad_(True)
    x = randn(10, D, seed=14).bfloat16()
    r = moe.route({"weight": W, "expert_bias": bias}, x, cfg)
    assert r.weights.dtype == r.logits.dtype == r.probs.dtype == torch.float32
    grads = torch.autograd.grad(r.weights.sum() + r.logits.square().sum(), [W, bias], allow_unused=True)
    assert grads[0] is not None and grads[1] is None


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_router_stays_fp32_under_bf16_autocast(policy):
    """Under autocast the router's matmul would run in bf16 (near-tied choices flip, the balancing
    statistics round); it runs in fp32, equal to the fp32 router, and token dropping by weight works."""
    cfg = layer_cfg(capacity_factor=1.0, drop_policy=policy)
    W = randn(cfg.n_experts, D, seed=21)
    x = randn(2 * 16, D, seed=22)
    want = moe.route({"weight": W}, x, cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = moe.route({"weight": W}, x, cfg)
        keep = moe.kept(got, 2, 16, cfg)
    assert got.logits.dtype == got.weights.dtype == torch.float32
    assert torch.equal(got.logits, want.logits) and torch.equal(got.experts, want.experts)
    assert torch.equal(keep, moe.kept(want, 2, 16, cfg))


# ---------------------------------------------------------------- 4. losses

LOSSES = {
    "micro_batch_softmax": dict(),
    "sequence_softmax": dict(aux_loss="sequence"),
    "micro_batch_sigmoid": dict(router_score="sigmoid", n_experts=8, top_k=3),
    "sequence_sigmoid_groups": dict(aux_loss="sequence", router_score="sigmoid", n_experts=8, top_k=2,
                                    router_groups=4, router_topk_groups=2),
    "micro_batch_dropping": dict(capacity_factor=0.5),
}


@pytest.mark.parametrize("name", LOSSES)
def test_losses_match_their_formulas_with_gradients(name):
    cfg = layer_cfg(aux_loss_coef=0.01, z_loss_coef=0.001, **LOSSES[name])
    B, T = 3, 7
    p = moe_params(cfg, seed=15)
    x = randn(B, T, D, seed=16)
    _, stats = moe.routed_moe(p, x, cfg)
    W = p["router"]["weight"]
    aux, z, count = ref_losses(W, x, cfg)
    assert_close(stats.aux_loss, aux, what="aux")
    assert_close(stats.z_loss, z, what="z")
    assert torch.equal(stats.load, count)          # before dropping
    ours = torch.autograd.grad(stats.aux_loss, W, retain_graph=True)[0]
    theirs = torch.autograd.grad(aux, W, retain_graph=True)[0]
    assert theirs.abs().max() > 0
    assert_close(ours, theirs, what="d aux / d router")
    assert_close(torch.autograd.grad(stats.z_loss, W)[0], torch.autograd.grad(z, W)[0], what="d z / d router")


def test_losses_are_off_when_their_coefficients_are_zero():
    cfg = layer_cfg()
    _, stats = moe.routed_moe(moe_params(cfg), randn(2, 5, D, seed=17), cfg)
    assert stats.aux_loss.item() == 0.0 and stats.z_loss.item() == 0.0


@pytest.mark.parametrize("aux_loss", ["micro_batch", "sequence"])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_balancing_loss_is_one_at_balance(aux_loss, score):
    cfg = layer_cfg(aux_loss_coef=1.0, aux_loss=aux_loss, router_score=score)
    B, T = 2, 8
    # a zero router: uniform probabilities. Every token then ties on all experts and they all pick the same
    # k, a maximally unbalanced load -- yet the loss is exactly 1, because sum_e count_e = kN whatever the counts.
    p = moe_params(cfg)
    with torch.no_grad():
        p["router"]["weight"].zero_()
    _, stats = moe.routed_moe(p, randn(B, T, D, seed=18), cfg)
    assert stats.load.sum().item() == B * T * cfg.top_k
    assert sorted(stats.load.tolist()) == [0, 0, B * T, B * T]
    assert abs(stats.aux_loss.item() - 1.0) < 1e-6
    # a truly balanced router: half the tokens prefer experts (0, 1), half (2, 3), with mirrored logits,
    # in every sequence: equal counts and equal mean probabilities
    a, b = 1.5, -0.5
    rows = [[a, a + 0.1, b, b + 0.1], [b, b + 0.1, a, a + 0.1]] * (T // 2)
    x = torch.tensor([rows] * B, dtype=torch.float32)
    p4 = {"router": {"weight": torch.eye(4)}, "experts": moe_params(layer_cfg(d_model=4), seed=19)["experts"]}
    cfg4 = layer_cfg(d_model=4, aux_loss_coef=1.0, aux_loss=aux_loss, router_score=score)
    _, stats = moe.routed_moe(p4, x, cfg4)
    assert stats.load.tolist() == [B * T / 2] * 4
    assert abs(stats.aux_loss.item() - 1.0) < 1e-6
    # and a skewed one is above 1
    _, stats = moe.routed_moe(p4, torch.tensor([[[2.0, 1.0, 0.0, -1.0]] * T] * B), cfg4)
    assert stats.aux_loss.item() > 1.2


def test_loss_and_stats_adds_every_layers_router_losses(monkeypatch):
    cfg = ModelConfig(vocab_size=50, vocab_multiple=64, d_model=D, n_layers=4, n_heads=2, max_seq_len=16, ffn_dim=24,
                      n_experts=4, top_k=2, expert_ffn_dim=F_DIM, shared_ffn_dim=12, first_dense_layers=1,
                      aux_loss_coef=0.03, z_loss_coef=0.002, capacity_factor=1.0, init_std=0.3)
    params = init(cfg, seed=20)
    gen = torch.Generator().manual_seed(21)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 12), generator=gen) for _ in range(2))
    seen = []
    original = moe.routed_moe

    def spy(p, x, c, *args, **kwargs):
        seen.append((p["router"]["weight"], x.detach()))
        return original(p, x, c, *args, **kwargs)

    monkeypatch.setattr(moe, "routed_moe", spy)
    loss, stats = loss_and_stats(params, tokens, targets, cfg)
    assert len(seen) == cfg.n_moe_layers == 3
    refs = [ref_losses(W, x, cfg) for W, x in seen]
    logits = forward(params, tokens, cfg)[..., :cfg.vocab_size]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    aux = sum(r[0] for r in refs)
    z = sum(r[1] for r in refs)
    assert_close(stats["ce"], ce.detach(), what="ce")
    assert_close(loss.detach(), (ce + 0.03 * aux + 0.002 * z).detach(), what="objective")
    assert_close(stats["aux_loss"], aux.detach() / 3, what="mean aux")
    assert_close(stats["z_loss"], z.detach() / 3, what="mean z")
    assert torch.equal(stats["expert_load"], torch.stack([r[2] for r in refs]))
    assert stats["dropped"].shape == (3,) and (stats["dropped"] >= 0).all()
    # the objective's gradient reaches each router through both losses
    W = params["layers"][1]["moe"]["router"]["weight"]
    ours = torch.autograd.grad(loss, W, retain_graph=True)[0]
    assert ours.abs().max() > 0
    # a dense model reports no stats
    dense = ModelConfig(vocab_size=50, d_model=D, n_layers=1, n_heads=2, max_seq_len=16)
    assert loss_and_stats(init(dense), tokens, targets, dense)[1] == {}
