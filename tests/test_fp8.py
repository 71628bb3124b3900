"""Float8 matmuls (nanomega/models/fp8.py) against a float64 emulation of the same scaling and rounding,
against torchao's float8 training where it runs here, and in the model.

The emulation is written independently of the code under test: float8 rounding is the nearest of the
format's 256 codes (listed from their bit patterns), ties to the even code, saturating at the format's
largest finite number; the scale is fp8_max / amax computed in float64 and rounded once to float32; the
product is computed in float64 (exact for two float32 numbers) and rounded to float32. A matmul of
float8 operands is then a float64 sum of exact products (each product of two float8 numbers and their
scales), so the code's float32 accumulation is the only difference allowed.
"""
from __future__ import annotations

import pytest
import torch

from nanomega.config import parse_args
from nanomega.models import fp8, init, moe
from nanomega.models.transformer import loss_fn
from nanomega.parallel.mesh import model_config, validate_layout

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise")


def fp8_codes(dtype):
    """(finite values as float64, sorted; their bit patterns) of a float8 format."""
    bits = torch.arange(256, dtype=torch.uint8)
    values = bits.view(dtype).double()
    keep = torch.isfinite(values)
    values, bits = values[keep], bits[keep]
    order = torch.argsort(values, stable=True)
    return values[order], bits[order]


def round_to_fp8(x: torch.Tensor, dtype) -> torch.Tensor:
    """x (float64) rounded to the nearest float8 value of `dtype`, ties to the even code, saturating."""
    values, bits = fp8_codes(dtype)
    top = values.max()
    x = x.clamp(-top, top).flatten()
    hi = torch.searchsorted(values, x).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = (x - values[lo]).abs(), (values[hi] - x).abs()
    pick = torch.where(d_lo < d_hi, lo, hi)
    tie = d_lo == d_hi
    even_lo = bits[lo] % 2 == 0
    pick = torch.where(tie, torch.where(even_lo, lo, hi), pick)
    return values[pick].view(-1)


def emulate_quantize(t: torch.Tensor, dtype, recipe: str, axis: int, weight: bool = False, amax=None):
    """(float8 values as float64, dequantizing scale as float64) as the module doc specifies; `amax`
    given: delayed scaling's (elements above it saturate)."""
    fmax = torch.finfo(dtype).max
    a = t.double().abs()
    if amax is not None:
        amax = torch.as_tensor(amax, dtype=torch.float32).double().reshape(1, 1)
        expand = lambda s: s                                                      # noqa: E731
    elif recipe == "tensorwise":
        amax = a.max().reshape(1, 1)
        expand = lambda s: s                                                      # noqa: E731
    elif recipe == "rowwise":
        amax = a.amax(dim=axis, keepdim=True)
        expand = lambda s: s                                                      # noqa: E731
    else:   # 128-long tiles along `axis`; a weight's 128 x 128 blocks
        b = fp8.BLOCK
        moved = a if axis == 1 else a.t()
        m, n = moved.shape
        tiles = moved.reshape(m, n // b, b).amax(-1)
        if weight:
            tiles = tiles.reshape(m // b, b, n // b).amax(1).repeat_interleave(b, 0)
        amax = tiles if axis == 1 else tiles.t()
        expand = lambda s: s.repeat_interleave(b, dim=axis)                       # noqa: E731
    to_fp8 = (fmax / amax.clamp(min=fp8.TINY)).float().double()          # float64 division, one float32 rounding
    product = (t.double() * expand(to_fp8)).float().double()              # exact product, rounded to float32
    q = round_to_fp8(product, dtype).view(t.shape)
    return q, (1.0 / to_fp8).float().double()


def emulate_matmul(a, sa, b, sb, recipe: str) -> torch.Tensor:
    """Sum of exact products in float64: a [M, C], b [C, N], scales along C (tile by tile for blockwise)."""
    if recipe != "blockwise":
        return (a * sa) @ (b * sb)
    blk = fp8.BLOCK
    return (a * sa.repeat_interleave(blk, 1)) @ (b * sb.repeat_interleave(blk, 0))


def operands(seed=0, m=256, k=256, n=384):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)     # columns over three decades
    w = torch.randn(n, k, generator=g) * 0.05
    dy = torch.randn(m, n, generator=g)
    x[3, 7] = 0.0
    return x, w, dy


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", [0, 1])
def test_quantize_is_the_float64_emulation_bit_for_bit(recipe, dtype, axis):
    x, w, _ = operands()
    for t, weight in ((x, False), (w, True)):
        q, scale = fp8.quantize(t, dtype, recipe, axis, weight=weight)
        want_q, want_scale = emulate_quantize(t, dtype, recipe, axis, weight)
        assert q.dtype == dtype
        assert torch.equal(q.double(), want_q)
        assert torch.equal(scale.double(), want_scale)
        assert q.double().abs().max() == torch.finfo(dtype).max   # the largest element maps to fp8_max


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_and_backward_are_float64_sums_of_the_emulated_float8_products(recipe):
    """y = x @ w.T (x, w e4m3), dx = dy @ w, dw = dy.T @ x (dy e5m2; e4m3 for blockwise), each operand scaled
    along the dimension its matmul contracts: equal to the float64 emulation up to float32 accumulation."""
    x, w, dy = operands(1)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr, recipe)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    gd = E4M3 if recipe == "blockwise" else E5M2
    qx, sx = emulate_quantize(x, E4M3, recipe, 1)
    qw, sw = emulate_quantize(w, E4M3, recipe, 1, weight=True)
    want_y = emulate_matmul(qx, sx, qw.t(), sw.t(), recipe)
    if recipe == "tensorwise":    # one scale per tensor: the same float8 operands serve the backward
        qg, sg = emulate_quantize(dy, gd, recipe, 1)
        want_dx = emulate_matmul(qg, sg, qw, sw, recipe)
        want_dw = emulate_matmul(qg.t(), sg, qx, sx, recipe)
    else:                         # re-scaled along N (dx) and along M (dw)
        qg, sg = emulate_quantize(dy, gd, recipe, 1)
        qw0, sw0 = emulate_quantize(w, E4M3, recipe, 0, weight=True)
        want_dx = emulate_matmul(qg, sg, qw0, sw0, recipe)
        qg0, sg0 = emulate_quantize(dy, gd, recipe, 0)
        qx0, sx0 = emulate_quantize(x, E4M3, recipe, 0)
        want_dw = emulate_matmul(qg0.t(), sg0.t(), qx0, sx0, recipe)
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert got.dtype == torch.float32
        assert (got.double() - want).norm() <= 2e-6 * want.norm()   # float32 accumulation over <= 384 terms


def relative_error(got, want):
    return float((got.double() - want).norm() / want.norm())


def test_error_bounds_against_bf16_and_where_finer_scales_pay():
    """On Gaussian operands every recipe's forward is within e4m3's unit roundoff 2^-4 of the float64 product
    (measured 0.037), against bf16's 2^-8 (measured 0.003). With a large outlier row, one tensorwise scale
    sends the other rows' small values into float8's subnormals, while rowwise keeps every row to 2^-4; with
    an outlier in one 128-block of every row, rowwise scales the whole row by it and blockwise keeps the
    other blocks."""
    x, w, _ = operands(2)
    exact = x.double() @ w.double().t()
    bf16 = (x.bfloat16() @ w.bfloat16().t()).double()
    assert relative_error(bf16, exact) <= 2 ** -8
    for recipe in RECIPES:
        assert relative_error(fp8.linear(x, w, recipe), exact) <= 2 ** -4, recipe
    outlier = x.clone()
    outlier[0] *= 1e5
    exact = outlier.double() @ w.double().t()
    rest = slice(1, None)
    tensorwise = relative_error(fp8.linear(outlier, w, "tensorwise")[rest], exact[rest])
    rowwise = relative_error(fp8.linear(outlier, w, "rowwise")[rest], exact[rest])
    assert rowwise <= 2 ** -4 < tensorwise
    blocky = x.clone()
    blocky[:, :fp8.BLOCK] *= 1e6
    exact = blocky[:, fp8.BLOCK:].double() @ w[:, fp8.BLOCK:].double().t()     # the other blocks' share
    w_rest = w.clone()
    w_rest[:, :fp8.BLOCK] = 0
    rowwise = relative_error(fp8.linear(blocky, w_rest, "rowwise"), exact)
    blockwise = relative_error(fp8.linear(blocky, w_rest, "blockwise"), exact)
    assert blockwise <= 2 ** -4 < rowwise


def test_blockwise_pads_the_rows_to_whole_tiles():
    """A token count that is not a multiple of 128: zero rows complete the last tile (they change no amax)."""
    x, w, dy = operands(3, m=200)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr, "blockwise")
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    pad = torch.zeros(56, x.shape[1])
    xp, wp = torch.cat([x, pad]).requires_grad_(), w.clone().requires_grad_()
    yp = fp8.linear(xp, wp, "blockwise")
    dxp, dwp = torch.autograd.grad(yp, (xp, wp), torch.cat([dy, torch.zeros(56, dy.shape[1])]))
    assert torch.equal(y, yp[:200]) and torch.equal(dx, dxp[:200]) and torch.equal(dw, dwp)


def test_autocast_gives_the_compute_dtype_and_gradients_keep_their_operands_dtypes():
    x, w, _ = operands(4)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.linear(xr, wr, "rowwise")
    assert y.dtype == torch.bfloat16
    dx, dw = torch.autograd.grad(y.float().sum(), (xr, wr))
    assert dx.dtype == dw.dtype == torch.float32


# ------------------------------------------------------------------ delayed scaling

def delayed(x, w, dy, history, margin=0):
    xr, wr, hr = x.clone().requires_grad_(), w.clone().requires_grad_(), history.clone().requires_grad_()
    y = fp8.linear(xr, wr, "delayed", history=hr, margin=margin)
    return (y, *torch.autograd.grad(y, (xr, wr, hr), dy))


def test_delayed_scaling_starts_as_tensorwise_and_hands_back_its_history_one_step_on():
    """An empty history (the first step) scales by the amaxes now: tensorwise, bit for bit. The history's
    "gradient" is the history rolled by one step with this step's amaxes of x, w and dy in front."""
    x, w, dy = operands(6)
    history = torch.zeros(3, 4)
    y, dx, dw, rolled = delayed(x, w, dy, history)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_t = fp8.linear(xr, wr, "tensorwise")
    dx_t, dw_t = torch.autograd.grad(y_t, (xr, wr), dy)
    assert torch.equal(y, y_t) and torch.equal(dx, dx_t) and torch.equal(dw, dw_t)
    assert torch.equal(rolled[:, 0], torch.stack([x.abs().max(), w.abs().max(), dy.abs().max()]))
    assert torch.equal(rolled[:, 1:], history[:, :-1])
    again = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    assert torch.equal(delayed(x, w, dy, again)[3][:, 1:], again[:, :3])     # the oldest entry drops out


@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_scales_by_the_history_and_saturates_what_exceeds_it(margin):
    """Scales from the largest amax in the history (x 2^margin), not from the tensors now: the forward and
    both gradients equal the float64 emulation with those amaxes; x's history is set below x's amax, so its
    largest elements saturate at e4m3's 448."""
    x, w, dy = operands(7)
    ax, aw, ag = 0.5 * float(x.abs().max()), 2.0 * float(w.abs().max()), 3.0 * float(dy.abs().max())
    history = torch.tensor([[ax / 4, ax, 0.0], [aw, aw / 2, aw / 8], [0.0, 0.0, ag]])
    y, dx, dw, _ = delayed(x, w, dy, history, margin)
    k = 2.0 ** margin
    qx, sx = emulate_quantize(x, E4M3, "tensorwise", 1, amax=ax * k)
    qw, sw = emulate_quantize(w, E4M3, "tensorwise", 1, amax=aw * k)
    qg, sg = emulate_quantize(dy, E5M2, "tensorwise", 1, amax=ag * k)
    assert margin or (qx.abs() == torch.finfo(E4M3).max).sum() > 1      # saturated
    for got, want in ((y, (qx * sx) @ (qw * sw).t()), (dx, (qg * sg) @ (qw * sw)), (dw, (qg * sg).t() @ (qx * sx))):
        assert (got.double() - want).norm() <= 2e-6 * want.norm()


# ------------------------------------------------------------------ experts that receive no tokens

@pytest.mark.parametrize("recipe", RECIPES + ("delayed",))
def test_an_empty_input_gives_an_empty_output_and_a_zero_weight_gradient(recipe):
    """No rows (an expert without tokens): an empty float8 matmul, whose sums are empty; the weight gradient
    is exactly zero and delayed scaling records amax 0 for x and dy."""
    _, w, _ = operands(9)
    x = torch.zeros(0, w.shape[1], requires_grad=True)
    wr = w.clone().requires_grad_()
    history = torch.zeros(3, 2, requires_grad=True) if recipe == "delayed" else None
    y = fp8.linear(x, wr, recipe, history=history)
    assert y.shape == (0, w.shape[0])
    grads = torch.autograd.grad(y, (x, wr) + ((history,) if history is not None else ()), torch.zeros(y.shape))
    assert grads[0].shape == x.shape and torch.equal(grads[1], torch.zeros_like(w))
    if history is not None:
        assert torch.equal(grads[2][:, 0], torch.stack([torch.tensor(0.0), w.abs().max(), torch.tensor(0.0)]))


@pytest.mark.parametrize("recipe", RECIPES + ("delayed",))
def test_experts_without_tokens_change_nothing_for_the_others(recipe):
    """Expert counts [5, 0, 5, 0]: the other experts' outputs and every gradient are bit for bit those of the
    run without the empty experts (counts [5, 5] over experts 0 and 2), and the empty experts' weight
    gradients are zero. Delayed scaling's histories sit beside 2-D weights only, so the stacked experts scale
    as tensorwise does."""
    g = torch.Generator().manual_seed(8)
    d, f = 128, 256
    w = {"w_gate": torch.randn(4, f, d, generator=g) * 0.05, "w_up": torch.randn(4, f, d, generator=g) * 0.05,
         "w_down": torch.randn(4, d, f, generator=g) * 0.05}
    rows, dy = torch.randn(10, d, generator=g), torch.randn(10, d, generator=g)

    def run(weights, counts, recipe):
        wr = {k: v.clone().requires_grad_() for k, v in weights.items()}
        xr = rows.clone().requires_grad_()
        out = moe.expert_mlp(wr, xr, torch.tensor(counts), fp8=recipe)
        dx, *dw = torch.autograd.grad(out, (xr, *wr.values()), dy)
        return out, dx, dict(zip(wr, dw))

    out, dx, dw = run(w, [5, 0, 5, 0], recipe)
    want_out, want_dx, want_dw = run({k: v[[0, 2]] for k, v in w.items()}, [5, 5],
                                     "tensorwise" if recipe == "delayed" else recipe)
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx)
    for k in w:
        assert torch.equal(dw[k][[0, 2]], want_dw[k])
        assert torch.equal(dw[k][[1, 3]], torch.zeros_like(want_dw[k]))


# ------------------------------------------------------------------ an independent implementation

def torchao_linear(recipe: str, w: torch.Tensor):
    torchao_float8 = pytest.importorskip("torchao.float8")   # a test extra (pyproject [test])
    from torchao.float8.config import CastConfig, ScalingGranularity
    if recipe == "tensorwise":
        config = torchao_float8.Float8LinearConfig.from_recipe_name("tensorwise")
    else:   # torchao's "rowwise" rounds scales to powers of 2 and uses e4m3 for gradients; ours does neither
        axis = ScalingGranularity.AXISWISE
        config = torchao_float8.Float8LinearConfig(
            cast_config_input=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
            cast_config_weight=CastConfig(scaling_granularity=axis, target_dtype=E4M3),
            cast_config_grad_output=CastConfig(scaling_granularity=axis, target_dtype=E5M2),
            round_scales_to_power_of_2=False)
    layer = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
    with torch.no_grad():
        layer[0].weight.copy_(w)
    torchao_float8.convert_to_float8_training(layer, config=config)
    return layer


@pytest.mark.parametrize("recipe,kernel,tol", [("tensorwise", fp8.SCALED_MM, 0.0), ("tensorwise", fp8.EMULATED, 2e-6),
                                               ("rowwise", fp8.SCALED_MM, 5e-3), ("rowwise", fp8.EMULATED, 5e-3)],
                         ids=["tensorwise-scaled_mm", "tensorwise-emulated", "rowwise-scaled_mm", "rowwise-emulated"])
def test_torchao_float8_training_agrees(recipe, kernel, tol):
    """torchao's Float8Linear on this CPU: tensorwise is bit for bit ours (forward and both gradients) when both
    run torch._scaled_mm, and within float32 accumulation with our CPU's emulation (the same sums in another
    order; measured 1.0e-7). Rowwise, configured like ours (axiswise e4m3 / e5m2, float32 scales), agrees to
    0.24% (measured; its axiswise path on the CPU does not reproduce torch._scaled_mm's row-scaled product bit
    for bit)."""
    x, w, dy = operands(5, m=128)
    layer = torchao_linear(recipe, w)
    xa = x.clone().requires_grad_()
    y_ref = layer(xa)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xa, layer[0].weight), dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.linear(xr, wr, recipe, kernel=kernel)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
        assert (got - want).norm() <= tol * want.norm()


# ------------------------------------------------------------------ in the model

TINY = ["--model.d_model=128", "--model.n_heads=4", "--model.n_kv_heads=4", "--model.ffn_dim=256",
        "--model.n_layers=2", "--model.max_seq_len=64", "--train.seq_len=64"]


def model_loss(args, tokens):
    m = model_config(parse_args(TINY + args))
    return loss_fn(init(m, 0), tokens, tokens, m)


def test_the_first_and_last_blocks_can_stay_out_of_fp8():
    """fp8_bf16_layers=1 on two blocks leaves none in float8: the loss is the plain model's, bit for bit;
    with every block in float8 it is not."""
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    plain = model_loss([], tokens)
    assert torch.equal(model_loss(["--model.fp8=rowwise", "--model.fp8_bf16_layers=1"], tokens), plain)
    assert not torch.equal(model_loss(["--model.fp8=rowwise"], tokens), plain)
    assert abs(model_loss(["--model.fp8=rowwise"], tokens) - plain) <= 1e-2 * plain


@pytest.mark.parametrize("args,message", [
    (["--model.fp8=blockwise", "--model.d_model=96", "--model.n_heads=4"],
     "layers.0.attn.wq.weight has out_features 96 and in_features 96 (on each rank) not divisible by 128"),
    (["--model.fp8=blockwise", "--model.d_model=256", "--model.n_heads=8", "--model.n_kv_heads=4",
      "--model.ffn_dim=768", "--parallel.tp=2"],
     "layers.0.attn.wk.weight has out_features 64 (on each rank) not divisible by 128"),
    (["--model.fp8=mxfp8"], "model.fp8='mxfp8' is not one of"),
    (["--model.fp8=delayed", "--model.fp8_amax_history=0"], "model.fp8_amax_history=0 must lie in"),
    (["--model.fp8=rowwise", "--model.fp8_bf16_layers=2", "--model.n_layers=3"], "use 0 <= N <= 1"),
])
def test_bad_fp8_settings_are_refused_before_any_work(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        validate_layout(parse_args(args))


def test_devices_without_float8_matmuls_are_refused():
    assert fp8.device_refusal(torch.device("cpu")) is None
    assert "not on mps" in fp8.device_refusal(torch.device("mps"))
