"""Rope scaling read from Hugging Face folders: Llama 3.1's "llama3" and YaRN (Qwen3, DeepSeek-V3 with its
mscale on MLA's softmax), against `transformers` itself.

The folders are random transformers models whose config.json carries the scaling (built from transformers'
own config classes, not from our export), read as `--train.init_from` reads them (hf_config.model_from_hf,
hf.load_params): our logits equal theirs at a sequence longer than the pretraining context the scaling
stretches. The frequencies alone are compared with transformers' ROPE_INIT_FUNCTIONS at real models' sizes,
and an exported scaled model reads back with the same rope_parameters.
"""
from __future__ import annotations

import json

import pytest
import torch

from nanomega import checkpoint

from nanomega.hf import transfer as hf
from nanomega.config import Config, ModelConfig, to_dict
from nanomega.config.hf_folder import model_fields_from_hf, model_from_hf
from nanomega.models import forward, init, layers
from nanomega.hf.convert import hf_config

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

T, ORIGINAL = 48, 16     # the test sequence is 3x the pretraining context the scaling stretches
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# DeepSeek-V3 ships mscale == mscale_all_dim (cos/sin factor 1); unequal ones exercise both of their uses
DEEPSEEK_YARN = {**YARN, "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}
SIZES = dict(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64, initializer_range=0.1)


def hf_model_config(family: str):
    if family == "llama3":
        return transformers.LlamaConfig(**SIZES, num_key_value_heads=2, head_dim=32, rope_parameters=dict(LLAMA3))
    if family == "qwen3_yarn":
        return transformers.Qwen3Config(**SIZES, num_key_value_heads=2, head_dim=32, rope_parameters=dict(YARN),
                                        rms_norm_eps=1e-6)
    return transformers.DeepseekV3Config(**SIZES, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                                         qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=12, rms_norm_eps=1e-6,
                                         first_k_dense_replace=2, num_mtp_layers=0,
                                         rope_parameters=dict(DEEPSEEK_YARN))


def saved(family: str, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_model_config(family), attn_implementation="eager")
    model.save_pretrained(str(path))
    return path


def logits_of_folder(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("family", ["llama3", "qwen3_yarn", "deepseek_v3_yarn"])
def test_a_scaled_rope_folder_gives_transformers_logits_past_the_original_context(tmp_path, family, one_thread):
    folder = saved(family, tmp_path / "hf")
    cfg = model_from_hf(str(folder), ModelConfig(), [])           # what --train.init_from does
    assert cfg.rope_scaling == family.split("_")[-1] and cfg.rope_original_max_len == ORIGINAL
    params = hf.load_params(folder, init(cfg, seed=5), cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    theirs = logits_of_folder(folder, tokens)
    with torch.no_grad():
        ours = forward(params, tokens, cfg)[..., :cfg.vocab_size]
        unscaled = forward(params, tokens, ModelConfig(**{**cfg.__dict__, "rope_scaling": "none"}))[..., :cfg.vocab_size]
    assert (theirs - ours).norm() <= 1e-5 * ours.norm()
    assert (theirs - unscaled).norm() > 1e-3 * ours.norm()        # the scaling is not a no-op here


# Real models' rope settings (head dims, contexts, thetas): Llama 3.1 8B, Qwen3 with YaRN as its card says,
# DeepSeek-V3, and YaRN with an attention factor given outright.
REAL = {
    "llama3.1": ("llama", dict(head_dim=128, max_position_embeddings=131072), {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3_yarn": ("qwen3", dict(head_dim=128, max_position_embeddings=131072), {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32768}),
    "deepseek_v3": ("deepseek_v3", dict(qk_rope_head_dim=64, max_position_embeddings=163840, num_mtp_layers=0), {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}),
    "yarn_attention_factor": ("qwen3", dict(head_dim=64, max_position_embeddings=65536), {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "attention_factor": 0.8,
        "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 8192}),
}


@pytest.mark.parametrize("name", REAL)
def test_rope_frequencies_equal_transformers_init_functions(name):
    kind, sizes, rope = REAL[name]
    config = transformers.AutoConfig.for_model(kind, hidden_size=256, num_attention_heads=2, num_hidden_layers=1,
                                               vocab_size=16, intermediate_size=64, **sizes,
                                               rope_parameters=dict(rope))
    their_inv_freq, their_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    cfg = ModelConfig(**model_fields_from_hf(config.to_dict()))
    inv_freq, factor = layers.rope_frequencies(cfg)                 # float64
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == their_inv_freq.shape
    torch.testing.assert_close(inv_freq, their_inv_freq.double(), rtol=1e-6, atol=0)   # theirs is fp32's rounding
    assert factor == pytest.approx(their_factor, rel=1e-12)
    unscaled = layers.rope_frequencies(ModelConfig(**{**cfg.__dict__, "rope_scaling": "none"}))[0]
    assert not torch.allclose(inv_freq, unscaled)
    # the tables (fp32, as the model uses them) against float64 ones from theirs, within the rounding of an
    # fp32 angle below 64 (further out fp32's position x frequency rounds more, theirs alike)
    cos, sin = layers.rope_tables(cfg, 64, "cpu")
    angles = torch.outer(torch.arange(64, dtype=torch.float64), their_inv_freq.double())
    torch.testing.assert_close(cos.double(), angles.cos() * their_factor, rtol=0, atol=1e-5)
    torch.testing.assert_close(sin.double(), angles.sin() * their_factor, rtol=0, atol=1e-5)


def test_an_exported_scaled_model_reads_back_with_its_rope_parameters_and_logits(tmp_path, one_thread):
    folder = saved("deepseek_v3_yarn", tmp_path / "hf")
    cfg = model_from_hf(str(folder), ModelConfig(), [])
    params = hf.load_params(folder, init(cfg, seed=5), cfg)
    checkpoint.save(tmp_path / "run", 1, params, {},
                    {"config": to_dict(Config(model=cfg))}, keep=1)
    out = hf.export(tmp_path / "run", tmp_path / "out")
    written = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert written == {**DEEPSEEK_YARN, "beta_fast": 32.0, "beta_slow": 1.0, "factor": 4.0}
    assert model_from_hf(str(out), ModelConfig(), []) == cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(logits_of_folder(out, tokens), logits_of_folder(folder, tokens), rtol=0, atol=0)
    assert hf_config(cfg).rope_parameters == written


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "longrope"},
                                  {"type": "linear", "factor": 2.0}])
def test_a_rope_scaling_we_do_not_compute_is_refused_naming_it_and_what_we_do(rope):
    config = hf_model_config("llama3").to_dict()
    with pytest.raises(ValueError, match=rf"rope_type={rope.get('rope_type', rope.get('type'))!r}.*'llama3', 'yarn'"):
        model_fields_from_hf({**config, "rope_parameters": None, "rope_scaling": rope}, source="x/config.json")


def test_transformers_4s_rope_scaling_spelling_reads_the_same(tmp_path):
    """A config.json written by transformers 4: rope_scaling with "type", rope_theta at the top."""
    config = hf_model_config("qwen3_yarn").to_dict()
    old = {**{k: v for k, v in config.items() if k != "rope_parameters"}, "rope_theta": YARN["rope_theta"],
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}}
    assert model_fields_from_hf(old) == model_fields_from_hf(config)
