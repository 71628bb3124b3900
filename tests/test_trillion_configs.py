"""configs/kimi_k2.py and configs/qwen3_235b_a22b.py against their published config.json: the architecture
our Hugging Face reader makes of the file, the parameter count (total and active per token) counted by hand
tensor by tensor from its numbers, the count transformers' own model of that shape gives, and the totals the
model's authors publish."""
import dataclasses

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from nanomega.config.cli import parse_args
from nanomega.config.hf_folder import model_fields_from_hf
from nanomega.models import layers, mla
from nanomega.models.transformer import init
from nanomega.sim.counting import count_params
from nanomega.tree import named_leaves

# moonshotai/Kimi-K2-Base (= Kimi-K2-Instruct) config.json, the keys that fix the architecture
KIMI_K2 = {
    "model_type": "kimi_k2", "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_routed_experts": 384, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
}
# Qwen/Qwen3-235B-A22B config.json, likewise
QWEN3_235B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960, "attention_bias": False,
}


def kimi_k2_by_hand(c: dict) -> tuple[int, int]:
    """(total, active per token): every tensor of the checkpoint, as DeepSeek-V3's modeling code names them."""
    d, H, V = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    attention = (q_rank * d                      # q_a_proj
                 + q_rank                        # q_a_layernorm
                 + H * (nope + rope) * q_rank    # q_b_proj
                 + (kv_rank + rope) * d          # kv_a_proj_with_mqa: the latent and the one shared rope key
                 + kv_rank                       # kv_a_layernorm
                 + H * (nope + v) * kv_rank      # kv_b_proj
                 + d * H * v)                    # o_proj
    norms = 2 * d                                # input_layernorm, post_attention_layernorm
    dense_mlp = 3 * d * c["intermediate_size"]   # gate_proj, up_proj, down_proj
    expert = 3 * d * c["moe_intermediate_size"]
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    router = E * d                               # mlp.gate.weight (its e_score_correction_bias: a buffer, not trained)
    shared = c["n_shared_experts"] * expert      # shared_experts, one SwiGLU of n_shared x moe_intermediate_size
    n_dense = c["first_k_dense_replace"]
    n_moe = c["num_hidden_layers"] - n_dense
    ends = V * d + V * d + d                     # embed_tokens, lm_head (untied), final norm
    assert c["num_nextn_predict_layers"] == 0    # no multi-token-prediction module in the checkpoint
    dense_layers = n_dense * (attention + norms + dense_mlp)
    total = ends + dense_layers + n_moe * (attention + norms + router + shared + E * expert)
    active = ends + dense_layers + n_moe * (attention + norms + router + shared + k * expert)
    return total, active


def qwen3_moe_by_hand(c: dict) -> tuple[int, int]:
    d, V, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    attention = (Hq * hd * d                     # q_proj
                 + 2 * Hkv * hd * d              # k_proj, v_proj
                 + d * Hq * hd                   # o_proj
                 + 2 * hd)                       # q_norm, k_norm (over one head's dims, shared by the heads)
    norms = 2 * d
    expert = 3 * d * c["moe_intermediate_size"]
    E, k = c["num_experts"], c["num_experts_per_tok"]
    router = E * d                               # mlp.gate.weight
    ends = V * d + V * d + d                     # embed_tokens, lm_head (untied), final norm
    assert c["decoder_sparse_step"] == 1 and not c["mlp_only_layers"]   # every layer is MoE, none shared
    L = c["num_hidden_layers"]
    return ends + L * (attention + norms + router + E * expert), ends + L * (attention + norms + router + k * expert)


CASES = {   # config name: (its config.json, the hand count, transformers' model of it)
    "kimi_k2": (KIMI_K2, kimi_k2_by_hand, (DeepseekV3Config, DeepseekV3ForCausalLM)),
    "qwen3_235b_a22b": (QWEN3_235B, qwen3_moe_by_hand, (Qwen3MoeConfig, Qwen3MoeForCausalLM)),
}


def readable(c: dict) -> dict:
    """The config.json as nanomega's reader takes it: Kimi K2 is DeepSeek-V3's architecture (its config.json's
    architectures is DeepseekV3ForCausalLM), under a model_type of its own that hf_folder.FAMILIES lacks."""
    return {**c, "model_type": "deepseek_v3"} if c["model_type"] == "kimi_k2" else c


@pytest.mark.parametrize("name", CASES)
def test_config_is_the_published_architecture(name):
    model = parse_args([f"--config={name}"]).model
    published = model_fields_from_hf(readable(CASES[name][0]))
    assert dataclasses.replace(model, **published) == model


@pytest.mark.parametrize("name", CASES)
def test_parameter_count_equals_the_hand_count(name):
    config_json, by_hand, _ = CASES[name]
    cfg = parse_args([f"--config={name}"]).model
    total, active = by_hand(config_json)
    assert count_params(cfg) == total and count_params(cfg, active=True) == active
    # the vocabularies are multiples of 64: nothing padded, so the tree the model allocates holds as many
    assert cfg.padded_vocab == cfg.vocab_size
    leaves = named_leaves(init(cfg, device="meta"))
    assert sum(t.numel() for n, t in leaves.items() if not n.endswith("expert_bias")) == total


@pytest.mark.parametrize("name", CASES)
def test_transformers_model_of_the_published_shape_has_as_many_parameters(name):
    config_json, by_hand, (config_class, model_class) = CASES[name]
    keys = {k: v for k, v in config_json.items() if k not in ("model_type", "rope_scaling")}
    with torch.device("meta"):
        model = model_class(config_class(**keys))
    assert sum(p.numel() for p in model.parameters()) == by_hand(config_json)[0]


def test_qwen3_235b_a22b_rounds_to_the_published_235b_and_22b():
    """Qwen3 report (arXiv 2505.09388): 235B total, 22B activated. There is no MTP module; the 235B counts
    both embedding tables (without the 0.62B LM head it would round to 234B)."""
    total, active = qwen3_moe_by_hand(QWEN3_235B)
    assert (total, active) == (235_093_634_560, 22_190_763_520)
    assert round(total / 1e9) == 235 and round(active / 1e9) == 22
    head = QWEN3_235B["vocab_size"] * QWEN3_235B["hidden_size"]
    assert round((total - head) / 1e9) == 234


def test_kimi_k2_against_the_published_1_04t_and_32_6b():
    """The Kimi K2 report (arXiv 2507.20534, Table 2) gives 1.04T total and 32.6B activated, the model card
    1T and 32B. Its own config.json does not give 1.04T / 32.6B at that rounding: 1.026T total (both embedding
    tables counted; num_nextn_predict_layers 0 and the released weights hold no MTP module, so none is in
    the count) and 32.86B active (32.6B lies between the count with one embedding table, 31.69B, and with
    both). Asserted here: the exact count, the model card's figures, and how far the report's lie from it."""
    total, active = kimi_k2_by_hand(KIMI_K2)
    assert (total, active) == (1_026_408_209_408, 32_861_477_888)
    assert round(total / 1e12) == 1 and int(active / 1e9) == 32      # the model card: "1T", "32B"
    assert 0.01 < (1.04e12 - total) / 1.04e12 < 0.015                  # the report's 1.04T: 1.3% over the count
    assert 0.005 < (active - 32.6e9) / 32.6e9 < 0.01                   # its 32.6B: 0.8% under
    one_table = active - KIMI_K2["vocab_size"] * KIMI_K2["hidden_size"]
    assert one_table < 32.6e9 < active


def test_kimi_k2_yarn_equals_transformers_with_beta_fast_equal_to_beta_slow():
    """Kimi K2's YaRN sets beta_fast = beta_slow = 1 (DeepSeek-V3's: 32 and 1): the ramp between kept and slowed
    dims is one dim wide. Our frequencies, cos/sin factor and MLA softmax scale against transformers' own."""
    c = KIMI_K2
    rope = {"rope_type": "yarn", "rope_theta": c["rope_theta"], **{k: v for k, v in c["rope_scaling"].items()
                                                                   if k != "type"}}
    keys = {k: v for k, v in c.items() if k not in ("model_type", "rope_scaling", "rope_theta")}
    config = DeepseekV3Config(**{**keys, "num_hidden_layers": 1}, rope_parameters=rope)
    their_inv_freq, their_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    cfg = parse_args(["--config=kimi_k2"]).model
    inv_freq, factor = layers.rope_frequencies(cfg)
    torch.testing.assert_close(inv_freq, their_inv_freq.double(), rtol=1e-6, atol=0)   # theirs is fp32's rounding
    assert factor == their_factor == 1.0                 # mscale == mscale_all_dim: nothing on cos and sin ...
    with torch.device("meta"):
        their_scale = DeepseekV3Attention(config, layer_idx=0).scaling
    assert mla.softmax_scale(cfg) == pytest.approx(their_scale, rel=1e-12)
    assert mla.softmax_scale(cfg) > 1.8 * 192 ** -0.5    # ... all of it on the softmax: (0.1 ln 32 + 1)^2 = 1.81


def test_megatron_1t_is_the_published_1_008t():
    """configs/megatron_1t.py: Megatron-LM's 1T GPT (Narayanan et al. 2021, Table 1: 1.008T) counted three ways:
    by hand from its shapes, by nanomega's count, and by transformers' GPT-2 of that shape (learned positions,
    biases, LayerNorm, GELU 4 x d, the output layer tied to the embedding), built on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = parse_args(["--config=megatron_1t"])
    m = cfg.model
    d, L, V, T = 25600, 128, 51200, 2048
    assert (m.d_model, m.n_layers, m.n_heads, m.vocab_size, m.max_seq_len) == (d, L, 160, V, T)
    block = (2 * d                      # ln_1
             + 3 * d * d + 3 * d        # fused q, k, v with biases
             + d * d + d                # attention output
             + 2 * d                    # ln_2
             + 4 * d * d + 4 * d        # MLP up
             + 4 * d * d + d)           # MLP down
    by_hand = V * d + T * d + L * block + 2 * d          # embeddings (tied output), blocks, the final LayerNorm
    assert count_params(m) == by_hand
    assert round(by_hand / 1e12, 3) == 1.008
    with torch.device("meta"):
        reference = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=d, n_layer=L, n_head=160,
                                               tie_word_embeddings=True))
    assert sum(p.numel() for p in reference.parameters()) == by_hand       # parameters() lists the tied one once
