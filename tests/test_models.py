"""Tests for nanomega.models: logits equal Hugging Face's for GPT-2 / LLaMA / Qwen2 / Qwen3,
weight conversion round trips, causality, the loss, and init statistics; every MLP kind models/mlp.py
registers against its float64 reference (MLP_CASES)."""
import dataclasses
import math

import pytest
import torch

from nanomega.config import ModelConfig
from nanomega.config.hf_folder import FAMILIES as HF_FAMILIES
from nanomega.models import forward, init, loss_fn
from nanomega.models.mlp import KINDS, hidden_dim, mlp
from nanomega.hf.convert import from_hf_state_dict, hf_config, hf_family, to_hf_state_dict
from nanomega.parallel.plan import tp_dim
from nanomega.tree import named_leaves, tree_map

TINY = dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=32, init_std=0.1)
FAMILIES = {  # vocab 100 / 97 / 200 are not multiples of 64: the padded rows are exercised
    "gpt2": ModelConfig(**TINY, vocab_size=100, norm="layernorm", norm_eps=1e-5, mlp="gelu", position="learned",
                        bias=True, tie_embeddings=True),
    "llama": ModelConfig(**TINY, vocab_size=128, n_kv_heads=2, rope_theta=500000.0, ffn_dim=160),
    "qwen2": ModelConfig(**TINY, vocab_size=97, n_kv_heads=1, qkv_bias=True, rope_theta=10000.0),
    "qwen2_tied": ModelConfig(**TINY, vocab_size=97, n_kv_heads=2, qkv_bias=True, rope_theta=10000.0,
                              tie_embeddings=True),
    "qwen3": ModelConfig(**TINY, vocab_size=200, n_kv_heads=2, head_dim=24, qk_norm=True, norm_eps=1e-6,
                         rope_theta=1000000.0, tie_embeddings=True),
}
LLAMA3_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                        max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False)


def random_params(cfg, seed=0):
    """init(), then norm gains and biases made random too, so a swapped norm or bias cannot hide."""
    gen = torch.Generator().manual_seed(seed + 1000)
    bump = lambda t: (t + 0.2 * torch.randn(t.shape, generator=gen) if t.ndim == 1 else t).detach()
    return tree_map(bump, init(cfg, seed))


def hf_model(cfg):
    import transformers  # a test-only dependency: `pip install -e ".[test]"`; missing, the test fails

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="eager").eval()


def zero_padding_rows(params, cfg):
    """Our leaves by name, with the embedding/head rows past vocab_size zeroed (HF has no such rows)."""
    out = dict(named_leaves(params))
    for n in ("tok_embed.weight", "lm_head.weight"):
        if n in out:
            out[n] = torch.cat([out[n][:cfg.vocab_size], torch.zeros_like(out[n][cfg.vocab_size:])])
    return out


def assert_logits_match(cfg, model):
    """Our weights loaded into the HF model give our logits; HF's weights imported give HF's."""
    params = random_params(cfg)
    model.load_state_dict(to_hf_state_dict(params, cfg), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = forward(params, tokens, cfg), model(tokens).logits
        assert ours.shape == (2, 24, cfg.padded_vocab) and theirs.abs().max() > 1.0
        torch.testing.assert_close(ours[..., :cfg.vocab_size], theirs, rtol=1e-5, atol=1e-5)
        for p in model.parameters():  # import direction: HF weights (all random) -> ours
            p.add_(0.05 * torch.randn(p.shape))
        imported = from_hf_state_dict(model.state_dict(), cfg)
        torch.testing.assert_close(forward(imported, tokens, cfg)[..., :cfg.vocab_size], model(tokens).logits,
                                   rtol=1e-5, atol=1e-5)


def assert_round_trip(cfg):
    """ours -> HF -> ours and HF -> ours -> HF are identities (padding rows aside)."""
    params = random_params(cfg)
    back = named_leaves(from_hf_state_dict(to_hf_state_dict(params, cfg), cfg))
    expected = zero_padding_rows(params, cfg)  # rows past vocab_size do not exist in HF: they come back zero
    assert list(back) == list(expected)
    for n in expected:
        assert back[n].dtype == torch.float32 and back[n].requires_grad and torch.equal(back[n], expected[n]), n
    sd = to_hf_state_dict(params, cfg)
    again = to_hf_state_dict(from_hf_state_dict(sd, cfg), cfg)
    assert list(again) == list(sd) and all(torch.equal(again[k], sd[k]) for k in sd)
    return sd


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hugging_face(name):
    cfg = FAMILIES[name]
    assert hf_family(cfg) == name.split("_")[0]
    assert_logits_match(cfg, hf_model(cfg))


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_round_trip(name):
    cfg = FAMILIES[name]
    sd = assert_round_trip(cfg)
    assert cfg.tie_embeddings == ("lm_head.weight" in sd and sd["lm_head.weight"] is next(iter(sd.values())))


def test_every_hugging_face_family_has_a_logits_case():
    """Each family config/hf_folder.py declares is exported to transformers and read back with HF's logits
    (tests/test_hf_export.py's CASES, which tests/test_hf_import.py runs too)."""
    from test_hf_export import CASES

    assert sorted({hf_family(cfg) for cfg in CASES.values()}) == sorted(HF_FAMILIES)


def test_hf_config_rejects_layouts_hf_lacks():
    for bad in (dict(position="learned"), dict(norm="layernorm"), dict(qk_norm=True, qkv_bias=True),
                dict(qkv_bias=True, bias=True), dict(norm="layernorm", mlp="gelu", position="learned")):
        with pytest.raises(ValueError, match="no Hugging Face"):
            hf_family(ModelConfig(**bad))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "qwen3"])
def test_causal(name):
    cfg, T = FAMILIES[name], 16
    params = random_params(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        base = forward(params, tokens, cfg)
        for t in (0, 5, T - 1):
            changed = tokens.clone()
            changed[0, t] = (tokens[0, t] + 1) % cfg.vocab_size
            out = forward(params, changed, cfg)
            torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
            assert (out[:, t] - base[:, t]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_loss_matches_float64_reference(name):
    cfg = FAMILIES[name]
    params = random_params(cfg)
    gen = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (3, 20), generator=gen) for _ in range(2))
    with torch.no_grad():
        logits = forward(params, tokens, cfg)[..., :cfg.vocab_size].double()  # padding columns are not tokens
        m = logits.max(-1, keepdim=True).values
        logp = logits - m - (logits - m).exp().sum(-1, keepdim=True).log()
        reference = -logp.gather(-1, targets[..., None]).mean()
        loss = loss_fn(params, tokens, targets, cfg)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert abs(loss.item() - reference.item()) < 1e-6 * reference.item()


@pytest.mark.parametrize("kw", [dict(norm="layernorm", mlp="gelu", position="learned", bias=True),
                                dict(n_kv_heads=4, qk_norm=True, qkv_bias=True, tie_embeddings=True)])
def test_init_statistics(kw):
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=4, n_heads=8, init_std=0.02, **kw)
    a, b, c = (named_leaves(init(cfg, seed)) for seed in (0, 0, 1))
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for n, t in a.items():
        assert t.dtype == torch.float32 and t.requires_grad and torch.equal(t, b[n]), n
        if t.ndim == 1:
            assert torch.equal(t, torch.zeros_like(t) if n.endswith(".bias") else torch.ones_like(t)), n
            continue
        std = residual if n.endswith(("attn.wo.weight", "mlp.w_down.weight")) else cfg.init_std
        assert abs(t.std().item() / std - 1) < 0.03 and abs(t.mean().item()) < 0.03 * std, n
        assert not torch.equal(t, c[n]), n


def test_init_meta_llama3_8b():
    params = init(LLAMA3_8B, device="meta")
    leaves = list(named_leaves(params).values())
    assert all(t.is_meta for t in leaves)
    assert sum(t.numel() for t in leaves) == 8_030_261_248
    assert LLAMA3_8B.padded_vocab == LLAMA3_8B.vocab_size == 128256


# ---------------------------------------------------------------- MLP kinds (models/mlp.py)

def gelu_reference(w: dict, x):
    """GPT-2's MLP in float64: tanh-GELU(x W_up^T + b) W_down^T + b, the tanh formula written out."""
    h = x @ w["w_up.weight"].T + w.get("w_up.bias", 0)
    h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    return h @ w["w_down.weight"].T + w.get("w_down.bias", 0)


def swiglu_reference(w: dict, x):
    """LLaMA's MLP in float64: (silu(x W_gate^T) * x W_up^T) W_down^T, silu(z) = z / (1 + e^-z)."""
    g = x @ w["w_gate.weight"].T
    return (g / (1 + torch.exp(-g)) * (x @ w["w_up.weight"].T)) @ w["w_down.weight"].T


class MLPCase:
    """What a registered MLP kind must be, written independently of its entry: the float64 reference of its
    forward (reference(weights by "matrix.leaf", x)), its matrices ({name: "column" | "row"}), and a published
    (d_model, default width) pair."""
    def __init__(self, reference, matrices: dict, width: tuple[int, int], **config):
        self.reference, self.matrices, self.width, self.config = reference, matrices, width, config


# A kind nanomega registers needs a case here (test_every_registered_mlp_kind_has_a_case); a kind registered
# outside the package (a fork's test, tests/test_mlp_kinds.py) runs these same checks from its own test file.
MLP_CASES = {
    "gelu": MLPCase(gelu_reference, {"w_up": "column", "w_down": "row"}, (768, 3072), bias=True),   # GPT-2 small
    "swiglu": MLPCase(swiglu_reference, {"w_gate": "column", "w_up": "column", "w_down": "row"},
                      (4096, 11008)),                                                               # LLaMA-7B
}


def assert_mlp_kind(name: str, case: MLPCase) -> None:
    """The kind `name` against `case`: its parameter names and shapes at the default width, init kinds (row
    matrices are residual projections), tensor-parallel dims, forward against the float64 reference, and a
    whole model that runs it (finite loss, gradients reaching every MLP matrix)."""
    d, width = case.width
    assert hidden_dim(ModelConfig(d_model=d, n_heads=8, mlp=name)) == width
    cfg = ModelConfig(vocab_size=64, d_model=48, n_layers=2, n_heads=4, max_seq_len=16, init_std=0.1, mlp=name,
                      **case.config)
    f = hidden_dim(cfg)
    shapes = {n: tuple(t.shape) for n, t in named_leaves(init(cfg, device="meta")).items()
              if n.startswith("layers.0.mlp.")}
    leaves = [".weight", ".bias"] if cfg.bias else [".weight"]
    assert list(shapes) == [f"layers.0.mlp.{m}{leaf}" for m in case.matrices for leaf in leaves]
    for m, role in case.matrices.items():
        out_dim, in_dim = (f, cfg.d_model) if role == "column" else (cfg.d_model, f)
        assert shapes[f"layers.0.mlp.{m}.weight"] == (out_dim, in_dim), m
        assert tp_dim(f"layers.0.mlp.{m}.weight") == (0 if role == "column" else 1), m
        if cfg.bias:
            assert shapes[f"layers.0.mlp.{m}.bias"] == (out_dim,)
            assert tp_dim(f"layers.0.mlp.{m}.bias") == (0 if role == "column" else None), m
    params = tree_map(lambda t: t.requires_grad_(True), random_params(cfg))
    w = {n.removeprefix("layers.0.mlp."): t for n, t in named_leaves(params).items() if n.startswith("layers.0.mlp.")}
    x = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = case.reference({n: t.double() for n, t in w.items()}, x.double())
        got = mlp(params["layers"][0]["mlp"], x, cfg)
    assert got.dtype == torch.float32 and want.abs().max() > 0.1
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, 12), generator=torch.Generator().manual_seed(5))
    loss = loss_fn(params, tokens, targets, cfg)
    grads = torch.autograd.grad(loss, [layer["mlp"][m]["weight"] for layer in params["layers"] for m in case.matrices])
    assert torch.isfinite(loss) and all(g.abs().sum() > 0 for g in grads)
    big = dataclasses.replace(cfg, d_model=128, ffn_dim=512, init_std=0.02)
    drawn = init(big, seed=0)["layers"][0]["mlp"]
    for m, role in case.matrices.items():
        std = big.init_std / math.sqrt(2 * big.n_layers) if role == "row" else big.init_std
        assert abs(drawn[m]["weight"].std().item() / std - 1) < 0.03, m


@pytest.mark.parametrize("name", MLP_CASES)
def test_mlp_kind_matches_its_float64_reference_shapes_and_sharding(name):
    assert_mlp_kind(name, MLP_CASES[name])


def test_every_registered_mlp_kind_has_a_case():
    """A kind models/mlp.py (or any nanomega module) registers without a case in MLP_CASES fails here."""
    ours = {name for name, kind in KINDS.items() if kind.forward.__module__.split(".")[0] == "nanomega"}
    assert ours - MLP_CASES.keys() == set(), f"add an MLP_CASES entry for {sorted(ours - MLP_CASES.keys())}"
    assert ours == MLP_CASES.keys()


def test_an_unknown_mlp_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"model.mlp='relu3' is not a registered MLP kind; choose one of \[.*'gelu'.*"
                                         r"'swiglu'"):
        init(ModelConfig(mlp="relu3"), device="meta")
