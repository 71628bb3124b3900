"""The step's in-place update (step.update_in_place, optim.optimizer's leaf_by_leaf): the numbers of the pure
update bit for bit, a peak of the held state plus one parameter's temporaries, nothing written on a non-finite
gradient; compiled, the whole-tree update's numbers written into the old tensors."""
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
    """A NaN in one gradient makes the global norm NaN: no parameter and no moment is written (the loop's
    skip of a non-finite step, train.py keep_where, then restores the counts it is handed)."""
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
    # the per-parameter state (moments, traces) stays; the scalars (counts) come back new, and the loop keeps
    # the old ones (train.py keep_where)
    pairs = [(a, b) for a, b in zip(tree_leaves(new_state), tree_leaves(before_s)) if b.dim() > 0]
    assert pairs and all(torch.equal(a, b) for a, b in pairs)
    params, _ = update(gradients(params, 1), new_state, params, keep=torch.tensor(True))
    assert not all(torch.equal(a, b) for a, b in zip(tree_leaves(params), tree_leaves(before_p)))


@slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_compiled_update_writes_the_whole_updates_numbers_into_the_old_tensors(name):
    """Compiled, the step's update (step.update_written_back) copies opt.update's results into the old parameters
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
