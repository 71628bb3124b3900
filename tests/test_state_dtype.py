"""Shampoo's and SOAP's factors and roots/bases stored in bf16 (optim.factor_dtype, optim.basis_dtype).

The specification: a bf16-stored optimizer is the fp32 optimizer whose factors (bases) are rounded to bf16 and
back after every update, the maths in between staying fp32. The reference below is exactly that, written by
rounding an fp32 optimizer's state between calls; the updates must agree bit for bit.
"""
import pytest
import torch

from nanomega import checkpoint, optim
from nanomega.config import OptimConfig
from nanomega.optim.memory import state_bytes
from nanomega.optim.shampoo import scale_by_shampoo
from nanomega.optim.soap import scale_by_soap
from nanomega.tree import map_with_name, named_leaves, tree_map
from tiers import slow

# Where each optimizer keeps what each field stores (state names: "<direction>.<field>.<param>.<index>")
STORED = {"shampoo": {"factor_dtype": ".factors.", "basis_dtype": ".roots."},
          "soap": {"factor_dtype": ".factors.", "basis_dtype": ".bases."}}
CASES = [(name, fields) for name in STORED for fields in (("factor_dtype",), ("basis_dtype",),
                                                          ("factor_dtype", "basis_dtype"))]


def params_of(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return {"layers": [{"w": torch.randn(12, 8, generator=gen, dtype=dtype),
                        "experts": torch.randn(3, 6, 5, generator=gen, dtype=dtype)}],
            "bias": torch.randn(8, generator=gen, dtype=dtype)}


def gradients(params, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [tree_map(lambda p: torch.randn(p.shape, generator=gen, dtype=p.dtype), params) for _ in range(steps)]


def build(name, **fields):
    # A refresh every other step, so the steps exercise both branches (refresh and keep).
    fast = {"start_preconditioning_step": 1} if name == "shampoo" else {}    # soap preconditions from step 1
    return optim.build(OptimConfig(name=name, precondition_frequency=2, **fast, **fields), 20)


def rounded(state, markers):
    """The state with every leaf whose name contains one of markers rounded to bf16 and back to its dtype."""
    return map_with_name(lambda n, x: x.to(torch.bfloat16).to(x.dtype) if any(m in n for m in markers) else x, state)


@pytest.mark.parametrize("name, fields", CASES)
def test_bf16_storage_halves_exactly_those_leaves(name, fields):
    params = params_of()
    fp32 = build(name).init(params)
    low = build(name, **{f: "bfloat16" for f in fields}).init(params)
    markers = [STORED[name][f] for f in fields]
    chosen = {n: x for n, x in named_leaves(fp32).items() if any(m in n for m in markers)}
    assert chosen, "the optimizer stores no leaf of this kind: the test would prove nothing"
    for n, x in named_leaves(low).items():
        assert x.dtype == (torch.bfloat16 if n in chosen else named_leaves(fp32)[n].dtype), n
    assert state_bytes(fp32) - state_bytes(low) == sum(x.nbytes for x in chosen.values()) // 2


@pytest.mark.parametrize("name, fields", CASES)
def test_bf16_storage_is_fp32_rounded_after_every_update(name, fields):
    params, steps = params_of(), 6
    markers = [STORED[name][f] for f in fields]
    low, ref = build(name, **{f: "bfloat16" for f in fields}), build(name)
    s_low, s_ref = low.init(params), ref.init(params)
    for step, g in enumerate(gradients(params, steps)):
        u_low, s_low = low.update(g, s_low, params)
        u_ref, s_ref = ref.update(g, s_ref, params)
        s_ref = rounded(s_ref, markers)
        for n, x in named_leaves(u_ref).items():
            assert torch.equal(named_leaves(u_low)[n], x), (step, n)
        for n, x in named_leaves(s_ref).items():
            assert torch.equal(named_leaves(s_low)[n].to(x.dtype), x), (step, n)
    # the rounding did something: without it, the fp32 optimizer moves elsewhere on some step (Shampoo's bf16
    # roots only on steps between refreshes: a refresh step uses its fresh roots unrounded)
    plain, low = build(name), build(name, **{f: "bfloat16" for f in fields})
    s_plain, s_low = plain.init(params), low.init(params)
    differs = []
    for g in gradients(params, steps):
        (u_plain, s_plain), (u_low, s_low) = plain.update(g, s_plain, params), low.update(g, s_low, params)
        differs.append(not torch.equal(u_plain["layers"][0]["w"], u_low["layers"][0]["w"]))
    assert any(differs)


@pytest.mark.parametrize("name", STORED)
def test_float32_stores_as_computed(name):
    """optim.factor_dtype="float32" (the default) stores factors and bases in the maths' dtype: fp32 for fp32
    parameters, fp64 for fp64 ones (fp32 is not forced on them, as it was not before the field existed)."""
    for dtype in (torch.float32, torch.float64):
        state = build(name).init(params_of(dtype))
        stored = {x.dtype for n, x in named_leaves(state).items() if any(m in n for m in STORED[name].values())}
        assert stored == {dtype}


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="soap", factor_dtype="float16"), "optim.factor_dtype='float16' is not one of ('float32', 'bfloat16')"),
    (dict(name="shampoo", basis_dtype="fp8"), "optim.basis_dtype='fp8' is not one of ('float32', 'bfloat16')"),
    (dict(name="muon", factor_dtype="bfloat16"), "optim.factor_dtype is not read by muon; muon reads optim.beta1"),
    (dict(name="adamw", basis_dtype="bfloat16"), "optim.basis_dtype is not read by adamw"),
])
def test_bad_storage_dtype_is_refused_before_building(kwargs, message):
    with pytest.raises(ValueError) as err:
        optim.build(OptimConfig(**kwargs), 10)
    assert message in str(err.value)


@pytest.mark.parametrize("name", STORED)
def test_bf16_state_round_trips_through_a_checkpoint(name, tmp_path):
    fields = {"factor_dtype": "bfloat16", "basis_dtype": "bfloat16"}
    params, opt = params_of(), build(name, **fields)
    state = opt.init(params)
    for g in gradients(params, 3):
        _, state = opt.update(g, state, params)
    path = checkpoint.save(tmp_path, 3, params, state, {"step": 3}, keep=1)
    _, got, _ = checkpoint.load(path, params, opt.init(params))
    for n, x in named_leaves(state).items():
        assert named_leaves(got)[n].dtype == x.dtype and torch.equal(named_leaves(got)[n], x), n
    assert any(x.dtype == torch.bfloat16 for x in named_leaves(got).values())


@slow
@pytest.mark.parametrize("transform", [scale_by_shampoo, scale_by_soap])
def test_compiled_bf16_storage_matches_eager(transform):
    """torch.compile traces the whole update with bf16 factors and bases (fullgraph: both branches of each
    refresh return the same dtypes) and gives eager's updates. fp64 parameters: compiled, SOAP's first eigh runs
    in fp64 (linalg.eigenbasis), so only an fp64 run picks eager's basis in the null space of a rank-deficient factor."""
    params = {"w": params_of(torch.float64)["layers"][0]["w"]}
    kw = dict(precondition_frequency=2, factor_dtype=torch.bfloat16)
    opt = transform(**kw, **({"root_dtype": torch.bfloat16, "start_preconditioning_step": 1}
                             if transform is scale_by_shampoo else {"basis_dtype": torch.bfloat16}))
    update = torch.compile(opt.update, backend="aot_eager", fullgraph=True)
    s_eager = s_comp = opt.init(params)
    for g in gradients(params, 5):
        u_eager, s_eager = opt.update(g, s_eager, params)
        u_comp, s_comp = update(g, s_comp, params)
        torch.testing.assert_close(u_comp["w"], u_eager["w"], atol=1e-6, rtol=1e-5)
    assert {x.dtype for n, x in named_leaves(s_comp).items() if ".factors." in n or n.startswith("factors")} \
        == {torch.bfloat16}
