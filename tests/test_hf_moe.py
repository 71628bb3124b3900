"""The MoE families against Hugging Face: logits of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (MLA,
sigmoid group-limited routing, expert bias) equal ours, and the state-dict conversion round trips."""
import pytest
import torch

from nanomega.config import ModelConfig
from nanomega.hf.convert import from_hf_state_dict, hf_config, hf_family, to_hf_state_dict
from nanomega.models.mlp import expert_dim
from test_models import assert_logits_match, assert_round_trip, random_params

TINY = dict(d_model=64, n_heads=4, max_seq_len=32, init_std=0.1, n_experts=8, top_k=2, expert_ffn_dim=32)
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=12,
           norm_eps=1e-6, router_score="sigmoid", shared_ffn_dim=64, first_dense_layers=1, ffn_dim=96)
FAMILIES = {  # vocab 100 / 97 / 200 are not multiples of 64: the padded rows are exercised
    "mixtral": ModelConfig(**TINY, vocab_size=100, n_layers=2, n_kv_heads=2, rope_theta=1e6),
    # a dense middle layer (HF's mlp_only_layers), the gated shared expert, unnormalized top-k weights
    "qwen2_moe": ModelConfig(**TINY, vocab_size=97, n_layers=3, n_kv_heads=2, qkv_bias=True, ffn_dim=96,
                             moe_layer_freq=2, shared_ffn_dim=48, shared_gate=True, router_norm_topk=False),
    "qwen3_moe": ModelConfig(**TINY, vocab_size=200, n_layers=3, n_kv_heads=2, head_dim=24, qk_norm=True,
                             norm_eps=1e-6, first_dense_layers=1, ffn_dim=96, tie_embeddings=True),
    # a dense first layer, 16 experts in 4 groups (a token picks 4 from its best 2 groups), the expert bias
    "deepseek_v3": ModelConfig(**{**TINY, "n_experts": 16, "top_k": 4}, **MLA, vocab_size=100, n_layers=3,
                               router_groups=4, router_topk_groups=2, router_scale=2.5, expert_bias_rate=1e-3),
    # a full-rank query, no bias (HF's e_score_correction_bias is zeros), ungrouped, unnormalized weights
    "deepseek_v3_plain": ModelConfig(**TINY, **{**MLA, "q_lora_rank": 0, "shared_ffn_dim": 32}, vocab_size=100,
                                     n_layers=2, router_norm_topk=False),
}


def hf_model(cfg):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="eager",
                                                         experts_implementation="eager").eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_hugging_face(name, one_thread):
    cfg = FAMILIES[name]
    assert hf_family(cfg) == name.removesuffix("_plain")
    assert_logits_match(cfg, hf_model(cfg))


@pytest.mark.parametrize("name", FAMILIES)
def test_state_dict_round_trip(name):
    assert_round_trip(FAMILIES[name])


def test_experts_fuse_gate_rows_first():
    cfg = FAMILIES["mixtral"]
    params = random_params(cfg)
    fused = to_hf_state_dict(params, cfg)["model.layers.1.mlp.experts.gate_up_proj"]
    experts = params["layers"][1]["moe"]["experts"]
    f = expert_dim(cfg)
    assert fused.shape == (cfg.n_experts, 2 * f, cfg.d_model)
    assert torch.equal(fused[:, :f], experts["w_gate"]) and torch.equal(fused[:, f:], experts["w_up"])


def test_nonzero_hf_expert_bias_needs_a_place():
    cfg = FAMILIES["deepseek_v3_plain"]
    sd = to_hf_state_dict(random_params(cfg), cfg)
    sd["model.layers.1.mlp.gate.e_score_correction_bias"] = torch.full((cfg.n_experts,), 0.1)
    with pytest.raises(ValueError, match="expert_bias_rate > 0"):
        from_hf_state_dict(sd, cfg)


@pytest.mark.parametrize("base, change, needs", [
    ("mixtral", dict(first_dense_layers=1), "every layer an MoE layer"),
    ("mixtral", dict(router_score="sigmoid"), "router_score='softmax'"),
    ("mixtral", dict(router_groups=2, router_topk_groups=1), "router_groups=1"),
    ("mixtral", dict(router_norm_topk=False), "router_norm_topk=True"),
    ("qwen2_moe", dict(shared_gate=False), "shared_gate=True"),
    ("qwen2_moe", dict(qkv_bias=False), "qkv_bias=True"),
    ("qwen3_moe", dict(shared_ffn_dim=32), "shared_ffn_dim=0"),
    ("qwen3_moe", dict(expert_bias_rate=1e-3), "expert_bias_rate=0"),
    ("deepseek_v3", dict(router_score="softmax"), "router_score='sigmoid'"),
    ("deepseek_v3", dict(top_k=2), "top_k // router_topk_groups == 2"),
    ("deepseek_v3", dict(shared_ffn_dim=48), "shared_ffn_dim a positive multiple"),
    ("deepseek_v3", dict(norm_eps=1e-5), "norm_eps=1e-6"),
    ("deepseek_v3", dict(moe_layer_freq=2, n_layers=4), "moe_layer_freq=1"),
])
def test_hf_config_rejects_moe_layouts_hf_lacks(base, change, needs):
    fields = {**FAMILIES[base].__dict__, **change}
    with pytest.raises(ValueError, match="no Hugging Face .*" + needs.replace("(", r"\(").replace(")", r"\)")):
        hf_family(ModelConfig(**fields))
