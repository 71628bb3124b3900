"""The step's in-place update (step.optimizer_step; optim.optimizer's leaf_by_leaf): the numbers of the pure
update bit for bit, a peak of the held state plus one parameter's temporaries, nothing written on a non-finite
step (optim.base.step_kept) by any optimizer; compiled, the whole-tree update's numbers written into the old
tensors."""
import pytest
import torch

from nanomega import optim
from nanomega.config import ModelConfig, OptimConfig
from nanomega.sim.memory_tracker import MemoryTracker
from nanomega.train.step import make_update
from nanomega.tree import named_leaves, tree_leaves, tree_map
from tiers import slow

CFG = ModelConfig()   # make_update reads only the MoE and fp8 fields: a dense model, no histories

OPTIMIZERS = {
    "adamw": dict(name="adamw", grad_clip=1.0, weight_decay=0.1),
    "adamw_bf16_state": dict(name="adamw", grad_clip=0.0, weight_decay=0.1, state_dtype="bfloat16"),
    "sgd": dict(name="sgd", momentum=0.0, weight_decay=0.01, grad_clip=0.5),
    "sgd_nesterov": dict(name="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
    "muon": dict(name="muon", grad_clip=1.0, weight_decay=0.1),
    "shampoo": dict(name="shampoo", precondition_frequency=2, start_preconditioning_step=2),
    "soap": dict(name="soap", precondition_frequency=2),
}


def params_like_a_model(seed: int = 0, width: int = 16, n_layers: int = 2):
    g = torch.Generator().manual_seed(seed)
    block = lambda: {"attn": {"wq": torch.randn(width, width, generator=g)},
                     "ln1": {"weight": torch.ones(width)}, "mlp": {"w1": torch.randn(2 * width, width, generator=g)}}
    return {"embed": torch.randn(32, width, generator=g), "layers": [block() for _ in range(n_layers)],
            "norm": {"weight": torch.ones(width)}}


def gradients(params, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return tree_map(lambda p: torch.randn(p.shape, generator=g), params)


def fresh(tree):
    return tree_map(lambda x: x.clone().requires_grad_(x.requires_grad), tree)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_update_matches_the_pure_update_bit_for_bit(name):
    """Five steps of the step's update against opt.update + apply_updates over the whole tree (the pure API):
    equal parameters and equal state, to the bit (the in-place path for AdamW and SGD, the whole one else)."""
    opt = optim.build(OptimConfig(lr=3e-2, warmup_steps=0, **OPTIMIZERS[name]), total_steps=10)
    assert (opt.leaf_by_leaf is not None) == (OPTIMIZERS[name]["name"] in ("adamw", "sgd"))
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model())
    ref_params, ref_state = fresh(params), opt.init(params)
    state = tree_map(torch.clone, ref_state)
    update = make_update(CFG, opt)
    for step in range(5):
        grads = gradients(params, step)
        updates, ref_state = opt.update(grads, ref_state, ref_params)
        ref_params = optim.apply_updates(ref_params, updates)
        params, state = update(tree_map(torch.clone, grads), state, params)
    for got, want in ((params, ref_params), (state, ref_state)):
        got, want = named_leaves(got), named_leaves(want)
        assert got.keys() == want.keys()
        for n in want:
            assert torch.equal(got[n], want[n]), n


def peak_above_held(update, params, state, grads) -> int:
    tracker = MemoryTracker()
    tracker.label(params, "parameters")
    tracker.label(grads, "gradients")
    tracker.label(state, "optimizer_state")
    held = tracker.total
    with tracker:
        out = update(grads, state, params)
    del out
    return tracker.result()["peak_bytes"] - held


def test_adamw_update_peaks_at_one_parameters_temporaries():
    """AdamW's update above the held parameters, gradients and moments: at most a few copies of the largest
    parameter in place (its update's temporaries), where the whole-tree update holds new parameters and
    moments for every parameter at once (more than three times the parameters' bytes)."""
    opt = optim.build(OptimConfig(name="adamw", grad_clip=1.0, weight_decay=0.1), total_steps=10)
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model(width=64, n_layers=8))
    state, grads = opt.init(params), gradients(params, 0)
    total = sum(p.nbytes for p in tree_leaves(params))
    largest = max(p.nbytes for p in tree_leaves(params))
    assert total > 8 * largest      # the model is many parameters, so the two bounds below are apart
    whole = peak_above_held(make_update(CFG, opt._replace(leaf_by_leaf=None)), fresh(params),
                            tree_map(torch.clone, state), grads)
    in_place = peak_above_held(make_update(CFG, opt), params, state, grads)
    assert whole > 3 * total
    assert in_place <= 6 * largest, (in_place, largest)


def test_non_finite_gradient_writes_nothing():
    """A NaN in one gradient makes the global norm NaN: no parameter, moment or count is written; the state
    holds the measured norm, so the loop can count the skipped step."""
    opt = optim.build(OptimConfig(name="adamw", grad_clip=1.0), total_steps=10)
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model())
    update = make_update(CFG, opt)
    params, state = update(gradients(params, 0), opt.init(params), params)
    before_p, before_s = fresh(params), tree_map(torch.clone, state)
    grads = gradients(params, 1)
    grads["layers"][1]["mlp"]["w1"][0, 0] = float("nan")
    params, new_state = update(grads, state, params)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(before_p)))
    assert torch.isnan(optim.grad_norm(new_state))
    assert torch.equal(new_state["adam"].mu["embed"], before_s["adam"].mu["embed"])
    assert torch.equal(new_state["adam"].nu["layers"][1]["mlp"]["w1"], before_s["adam"].nu["layers"][1]["mlp"]["w1"])



@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_non_finite_loss_writes_nothing_though_the_gradient_is_finite(name):
    """train.py hands the update its loss's finiteness (keep): a step whose loss is not finite changes no
    parameter and no moment, as the loop's skip did before the update wrote in place, even where every
    gradient is finite."""
    opt = optim.build(OptimConfig(name=name, grad_clip=1.0), total_steps=10)
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model())
    update = make_update(CFG, opt)
    params, state = update(gradients(params, 0), opt.init(params), params)
    before_p, before_s = fresh(params), tree_map(torch.clone, state)
    params, new_state = update(gradients(params, 1), state, params, keep=torch.tensor(False))
    assert torch.isfinite(optim.grad_norm(new_state))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(before_p)))
    # the per-parameter state (moments, traces) and the counts stay; only the measured norm is new
    got, want = named_leaves(new_state), named_leaves(before_s)
    assert all(torch.equal(got[n], want[n]) for n in want if n != "clip.grad_norm")
    params, _ = update(gradients(params, 1), new_state, params, keep=torch.tensor(True))
    assert not all(torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(before_p)))


@slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_compiled_update_writes_the_whole_updates_numbers_into_the_old_tensors(name):
    """Compiled, the step's update (step.optimizer_step, whole tree) copies opt.update's results into the old parameters
    and state inside the graph: three steps give the compiled whole-tree update's numbers bit for bit, in the
    tensors the step was handed (Adam's moments, Muon's momentum by name)."""
    opt = optim.build(OptimConfig(lr=3e-2, warmup_steps=0, **OPTIMIZERS[name]), total_steps=10)

    def whole(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state
    whole = torch.compile(whole)
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model())
    ref_params, ref_state = fresh(params), opt.init(params)
    state = tree_map(torch.clone, ref_state)
    handed = [id(t) for t in tree_leaves(params)]
    moments = state["adam"].mu if name == "adamw" else state["muon"].momentum
    held = [id(t) for t in tree_leaves(moments)]
    update = make_update(CFG, opt, compile=True)
    for step in range(3):
        grads = gradients(params, step)
        with torch.no_grad():
            ref_params, ref_state = whole(grads, ref_state, ref_params)
        params, state = update(tree_map(torch.clone, grads), state, params)
    assert [id(t) for t in tree_leaves(params)] == handed
    moments = state["adam"].mu if name == "adamw" else state["muon"].momentum
    assert [id(t) for t in tree_leaves(moments)] == held
    for got, want in ((params, ref_params), (state, ref_state)):
        got, want = named_leaves(got), named_leaves(want)
        for n in want:
            assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("bad", ["nan_gradient", "loss_flag"])
def test_a_skipped_step_leaves_every_state_leaf_bitwise_unchanged(name, bad):
    """The step's update alone (no loop around it) skips a step whose gradient norm is not finite, or whose
    loss the caller flags (keep=False): every parameter and every state leaf (moments, Shampoo's and SOAP's
    factors, roots and bases, Muon's momentum, the counts) is bitwise what it was; only the clip stage's
    measured norm is new. The steps around it are real: they change every leaf the skipped one keeps."""
    opt = optim.build(OptimConfig(lr=3e-2, warmup_steps=0, **OPTIMIZERS[name]), total_steps=10)
    params = tree_map(lambda p: p.requires_grad_(True), params_like_a_model())
    update = make_update(CFG, opt)
    state = opt.init(params)
    for step in range(3):    # past Shampoo's and SOAP's first preconditioner computations
        params, state = update(gradients(params, step), state, params)
    before_p, before_s = named_leaves(fresh(params)), named_leaves(tree_map(torch.clone, state))
    grads, keep = gradients(params, 3), torch.tensor(bad != "loss_flag")
    if bad == "nan_gradient":
        grads["layers"][0]["attn"]["wq"][1, 2] = float("nan")
    params, state = update(grads, state, params, keep=keep)
    after_p, after_s = named_leaves(params), named_leaves(state)
    assert after_p.keys() == before_p.keys() and after_s.keys() == before_s.keys()
    for n in before_p:
        assert torch.equal(after_p[n], before_p[n]), n
    for n in before_s:
        if n != "clip.grad_norm":
            assert torch.equal(after_s[n], before_s[n]), n
    assert torch.isnan(after_s["clip.grad_norm"]) == (bad == "nan_gradient")
    params, state = update(gradients(params, 4), state, params)     # a kept step: the counts move again
    counts = [n for n in before_s if n.endswith("count")]
    assert counts and all(torch.equal(named_leaves(state)[n], before_s[n] + 1) for n in counts)


def test_a_skipped_step_keeps_the_expert_biases_and_fp8_histories():
    """A MoE model with aux-loss-free balancing and delayed fp8 scaling: the step's update also moves the routers'
    expert biases and writes the amax histories; a step whose gradient is not finite writes neither, and the next
    finite step does both (so the comparison could fail)."""
    from nanomega.models.transformer import init
    from nanomega.train.step import make_step_fns
    cfg = ModelConfig(vocab_size=64, vocab_multiple=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16,
                      n_experts=4, top_k=2, expert_bias_rate=1e-2, fp8="delayed", fp8_amax_history=4)
    opt = optim.build(OptimConfig(name="adamw", grad_clip=1.0), total_steps=10)
    params = init(cfg, 0)
    fns = make_step_fns(cfg, opt)
    state = opt.init(params)
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [(x[:, :-1], x[:, 1:])]
    loss, grads, stats = fns.grads(params, batch)
    params, state = fns.update(grads, state, params, stats)
    before = named_leaves(fresh(params))
    special = [n for n in before if n.endswith(("expert_bias", "fp8_history"))]
    assert any(n.endswith("expert_bias") for n in special) and any(n.endswith("fp8_history") for n in special)
    loss, grads, stats = fns.grads(params, batch)
    next(g for n, g in named_leaves(grads).items() if n not in special).view(-1)[0] = float("inf")
    params, state = fns.update(grads, state, params, stats)
    assert all(torch.equal(p, before[n]) for n, p in named_leaves(params).items())
    loss, grads, stats = fns.grads(params, batch)
    params, state = fns.update(grads, state, params, stats)
    after = named_leaves(params)
    assert all(not torch.equal(after[n], before[n]) for n in special)
