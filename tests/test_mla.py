"""Multi-head latent attention (models/mla.py) equals Hugging Face's DeepseekV3Attention, alone and in a
whole model, for a full and a low-rank query and both of HF's rope layouts; its gradients are finite."""
import math

import pytest
import torch

from nanomega.config import ModelConfig
from nanomega.models import forward, init, loss_fn, mla
from nanomega.models.layers import Positions, rope_tables
from nanomega.tree import named_leaves, tree_map

# v_head_dim (12) != nope + rope (14), and rope/2 = 3 is odd: a swapped split or permutation cannot hide
MLA = dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=32, init_std=0.1,
           norm_eps=1e-6, attention="mla", kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=6, v_head_dim=12)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def mla_config(q_lora_rank):
    return ModelConfig(**MLA, q_lora_rank=q_lora_rank)


def random_params(cfg, seed=0):
    """init(), with the norm gains made random too, so a swapped norm cannot hide."""
    gen = torch.Generator().manual_seed(seed + 1000)
    return tree_map(lambda t: (t + 0.2 * torch.randn(t.shape, generator=gen) if t.ndim == 1 else t).detach(),
                    init(cfg, seed))


def hf_config(cfg, interleave):
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, first_k_dense_replace=cfg.n_layers,  # every layer a dense MLP
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank or None,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_dim, qk_rope_head_dim=cfg.qk_rope_dim,
        v_head_dim=cfg.v_head_dim, rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, rope_interleave=interleave,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, tie_word_embeddings=False,
        attn_implementation="eager")


def hf_attention_state(p, cfg, interleave):
    """Our attention subtree -> DeepseekV3Attention's state dict (the converter's job, written out here)."""
    H, nope, rope = cfg.n_heads, cfg.qk_nope_dim, cfg.qk_rope_dim
    fix = mla.rope_rows_to_interleaved if interleave else (lambda w, *_: w)
    sd = {"kv_a_proj_with_mqa.weight": fix(p["wkv_a"]["weight"], 1, cfg.kv_lora_rank, rope),
          "kv_a_layernorm.weight": p["kv_a_norm"]["weight"], "kv_b_proj.weight": p["wkv_b"]["weight"],
          "o_proj.weight": p["wo"]["weight"]}
    if cfg.q_lora_rank:
        sd |= {"q_a_proj.weight": p["wq_a"]["weight"], "q_a_layernorm.weight": p["q_a_norm"]["weight"],
               "q_b_proj.weight": fix(p["wq_b"]["weight"], H, nope, rope)}
    else:
        sd["q_proj.weight"] = fix(p["wq"]["weight"], H, nope, rope)
    return sd


def hf_model_state(params, cfg, interleave):
    sd = {"model.embed_tokens.weight": params["tok_embed"]["weight"], "lm_head.weight": params["lm_head"]["weight"],
          "model.norm.weight": params["final_norm"]["weight"]}
    for i, layer in enumerate(params["layers"]):
        pre = f"model.layers.{i}."
        sd |= {pre + "self_attn." + k: v for k, v in hf_attention_state(layer["attn"], cfg, interleave).items()}
        sd |= {pre + "input_layernorm.weight": layer["attn_norm"]["weight"],
               pre + "post_attention_layernorm.weight": layer["mlp_norm"]["weight"],
               pre + "mlp.gate_proj.weight": layer["mlp"]["w_gate"]["weight"],
               pre + "mlp.up_proj.weight": layer["mlp"]["w_up"]["weight"],
               pre + "mlp.down_proj.weight": layer["mlp"]["w_down"]["weight"]}
    return sd


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_attention_matches_hugging_face(q_lora_rank, interleave):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = mla_config(q_lora_rank)
    p = random_params(cfg)["layers"][0]["attn"]
    hf_cfg = hf_config(cfg, interleave)
    module = DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    module.load_state_dict(hf_attention_state(p, cfg, interleave), strict=True)
    B, T = 2, 20
    x = torch.randn(B, T, cfg.d_model, generator=torch.Generator().manual_seed(1))
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]  # eager HF needs the mask
    with torch.no_grad():
        cos_sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, torch.arange(T)[None].expand(B, T))
        theirs = module(x, position_embeddings=cos_sin, attention_mask=causal)[0]
        ours = mla.attention(p, x, Positions(rope_tables(cfg, T, x.device)), cfg)
    assert ours.shape == (B, T, cfg.d_model) and theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interleave", [True, False])
def test_model_logits_match_hugging_face(interleave):
    import transformers

    cfg = mla_config(24)
    params = random_params(cfg)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config(cfg, interleave)).eval()
    model.load_state_dict(hf_model_state(params, cfg, interleave), strict=True)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = forward(params, tokens, cfg), model(tokens).logits
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_rope_row_permutations_are_inverse_and_touch_only_rope_rows():
    H, nope, rope, d = 3, 4, 6, 5
    w = torch.randn(H * (nope + rope), d)
    ours = mla.rope_rows_from_interleaved(w, H, nope, rope)
    assert torch.equal(mla.rope_rows_to_interleaved(ours, H, nope, rope), w)
    assert torch.equal(mla.rope_rows_from_interleaved(mla.rope_rows_to_interleaved(w, H, nope, rope), H, nope, rope), w)
    heads, new = w.view(H, nope + rope, d), ours.view(H, nope + rope, d)
    assert torch.equal(new[:, :nope], heads[:, :nope])
    assert torch.equal(new[:, nope:], heads[:, nope:][:, [0, 2, 4, 1, 3, 5]])


def test_rope_tables_use_the_rope_dims_for_mla_only():
    def reference(dim, theta, T):  # HF's default rope: inv_freq = 1 / theta^(2i / dim)
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
        return angles.cos(), angles.sin()

    for cfg, dim in ((ModelConfig(d_model=64, n_heads=4, rope_theta=500000.0), 16),
                     (ModelConfig(d_model=64, n_heads=4, head_dim=24, qk_rope_dim=6), 24),  # mha ignores qk_rope_dim
                     (mla_config(0), 6)):
        cos, sin = rope_tables(cfg, 20, "cpu")
        ref_cos, ref_sin = reference(dim, cfg.rope_theta, 20)
        assert cos.dtype == torch.float32 and cos.shape == (20, dim // 2)
        torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=1e-5)
        torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_init_shapes_and_finite_gradients(q_lora_rank):
    cfg = mla_config(q_lora_rank)
    H, qk, v, r = cfg.n_heads, cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.v_head_dim, cfg.kv_lora_rank
    expected = {"wkv_a.weight": (r + cfg.qk_rope_dim, cfg.d_model), "kv_a_norm.weight": (r,),
                "wkv_b.weight": (H * (cfg.qk_nope_dim + v), r), "wo.weight": (cfg.d_model, H * v)}
    expected |= ({"wq_a.weight": (24, cfg.d_model), "q_a_norm.weight": (24,), "wq_b.weight": (H * qk, 24)}
                 if q_lora_rank else {"wq.weight": (H * qk, cfg.d_model)})
    params = init(cfg, seed=0)
    attn = named_leaves(params["layers"][0]["attn"])
    assert {n: tuple(t.shape) for n, t in attn.items()} == expected
    for n, t in attn.items():
        if t.ndim == 1:
            assert torch.equal(t, torch.ones_like(t)), n
        else:  # wo is a residual projection: init_std / sqrt(2 * n_layers)
            std = cfg.init_std / (math.sqrt(2 * cfg.n_layers) if n == "wo.weight" else 1)
            assert abs(t.std().item() / std - 1) < 0.1, n
    gen = torch.Generator().manual_seed(3)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (2, 16), generator=gen) for _ in range(2))
    loss_fn(params, tokens, targets, cfg).backward()
    for n, t in named_leaves(params).items():
        if ".attn." in n:
            assert t.grad is not None and t.grad.isfinite().all() and t.grad.abs().max() > 0, n
