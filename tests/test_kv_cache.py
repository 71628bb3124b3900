"""Generation with a KV cache (models/transformer.py: init_cache, forward_cached; generate.sample's default)
against two independent references: the recompute-everything loop it replaces (the model's plain forward on
the whole context, every token) and Hugging Face's `generate` with its own cache on the exported weights.

One tiny model per attention family: GPT-2 (learned positions, LayerNorm, biases), Llama (GQA), Qwen2 (qkv
bias), Qwen3 (QK-norm), Mixtral (MoE), DeepSeek-V3 (MLA with a low-rank query, cached as its latent)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanomega.eval.generate import sample
from nanomega.models import forward
from nanomega.hf.convert import hf_config, to_hf_state_dict
from nanomega.models.transformer import forward_cached, init_cache
from nanomega.tree import tree_map
from test_hf_moe import FAMILIES as MOE_FAMILIES
from test_models import FAMILIES, random_params

CASES = {"gpt2": FAMILIES["gpt2"], "llama": FAMILIES["llama"], "qwen2": FAMILIES["qwen2"],
         "qwen3": FAMILIES["qwen3"], "mixtral": MOE_FAMILIES["mixtral"], "deepseek_v3": MOE_FAMILIES["deepseek_v3"]}
# init_std 0.3: logits spread over several units, so greedy choices are not decided by fp32 rounding
CASES = {name: dataclasses.replace(cfg, init_std=0.3) for name, cfg in CASES.items()}
# The cached logits against the full forward's: max |difference| <= 1e-5 * max |logit|: fp32 rounding of the
# same sums taken in another order (attention over a cache, MLA's absorbed weights). Measured: up to 3.5e-6 of
# the largest logit (3.4e-5 at logits of 10), the size of the fp32 forward's own distance from a float64 one
# (test_cached_logits_are_as_close_to_float64_as_the_full_forward).
BOUND = 1e-5


def prompt_of(cfg, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CASES)
def test_cached_logits_equal_the_full_forward_position_by_position(name, one_thread):
    """A prompt of 7 in one call, 3 more in one call at position 7 (the shifted causal mask), then one token
    per call up to max_seq_len; every position's logits against forward on the whole sequence. Batch 2."""
    cfg = CASES[name]
    params = random_params(cfg)
    tokens = prompt_of(cfg, 2, cfg.max_seq_len, seed=1)
    with torch.no_grad():
        full = forward(params, tokens, cfg)
    assert full.abs().max() > 1.0
    assert (cached_logits(params, tokens, cfg) - full).abs().max() <= BOUND * full.abs().max()


def cached_logits(params, tokens, cfg) -> torch.Tensor:
    """Logits of every position of tokens: 7 in one call, 3 in one call, then one per call."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], dtype=tokens_dtype(params))
    pieces, position = [], 0
    with torch.no_grad():
        for length in [7, 3] + [1] * (tokens.shape[1] - 10):
            logits, cache = forward_cached(params, tokens[:, position:position + length], cfg, cache, position)
            pieces.append(logits)
            position += length
    return torch.cat(pieces, dim=1)


def tokens_dtype(params) -> torch.dtype:
    return params["tok_embed"]["weight"].dtype


@pytest.mark.parametrize("name", ["llama", "deepseek_v3_dense"])
def test_cached_logits_are_as_close_to_float64_as_the_full_forward(name, one_thread):
    """Against the model in float64 (the rope tables and norms stay fp32, as in training): the fp32 cached
    logits are no farther from it than twice the fp32 full forward is, i.e. within fp32 rounding."""
    cfg = CASES["llama"] if name == "llama" else dataclasses.replace(CASES["deepseek_v3"], n_experts=0)
    params = random_params(cfg, seed=6)
    tokens = prompt_of(cfg, 2, cfg.max_seq_len, seed=6)
    with torch.no_grad():
        exact = forward(tree_map(lambda t: t.double(), params), tokens, cfg)
        full_error = (forward(params, tokens, cfg) - exact).abs().max()
    assert 0 < (cached_logits(params, tokens, cfg) - exact).abs().max() <= 2 * full_error


@pytest.mark.parametrize("name", CASES)
def test_greedy_tokens_equal_the_recompute_sampler(name, one_thread):
    """Batch 3, past max_seq_len: the cache runs until the context is full (32 positions), then the cropped
    window is recomputed; every token the recompute loop's."""
    cfg = CASES[name]
    params = random_params(cfg, seed=2)
    prompt = prompt_of(cfg, 3, 5, seed=2)
    ours = sample(params, cfg, prompt, cfg.max_seq_len + 3, temperature=0)
    reference = sample(params, cfg, prompt, cfg.max_seq_len + 3, temperature=0, recompute=True)
    assert torch.equal(ours, reference)


def test_a_prompt_of_one_token_and_generation_to_max_seq_len(one_thread):
    """A 1-token prompt generating exactly to max_seq_len stays on the cache all the way (no recompute:
    checked by making the fallback fail) and equals the recompute loop."""
    cfg = CASES["llama"]
    params = random_params(cfg, seed=3)
    prompt = prompt_of(cfg, 2, 1, seed=3)
    n_new = cfg.max_seq_len - 1
    reference = sample(params, cfg, prompt, n_new, temperature=0, recompute=True)

    def no_recompute(context):
        raise AssertionError(f"recomputed a context of {context.shape[1]}")

    import nanomega.eval.generate as generate
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate, "forward", no_recompute)
        ours = sample(params, cfg, prompt, n_new, temperature=0)
    assert ours.shape == (2, cfg.max_seq_len) and torch.equal(ours, reference)


def test_seeded_sampling_draws_the_recompute_samplers_tokens(one_thread):
    """temperature and top-k: the same generator gives the same draws, since the logits agree to rounding."""
    cfg = CASES["qwen3"]
    params = random_params(cfg, seed=4)
    prompt = prompt_of(cfg, 2, 4, seed=4)
    ours = sample(params, cfg, prompt, 20, 0.8, 10, torch.Generator().manual_seed(0))
    reference = sample(params, cfg, prompt, 20, 0.8, 10, torch.Generator().manual_seed(0), recompute=True)
    assert torch.equal(ours, reference)


def test_a_cache_longer_than_the_model_or_overrun_is_refused():
    cfg = CASES["llama"]
    with pytest.raises(ValueError, match="max_seq_len=32"):
        init_cache(cfg, 1, 33)
    cache = init_cache(cfg, 1, 4)
    with pytest.raises(ValueError, match="do not fit a cache of 4"):
        forward_cached(random_params(cfg), torch.zeros(1, 5, dtype=torch.long), cfg, cache, 0)


def test_mla_caches_the_latent_and_rope_key_only():
    cfg = CASES["deepseek_v3"]
    cache = init_cache(cfg, 2, 10)
    assert [tuple(layer) for layer in cache["layers"]] == [("kv",)] * cfg.n_layers
    assert cache["layers"][0]["kv"].shape == (2, 1, 10, cfg.kv_lora_rank + cfg.qk_rope_dim)


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_greedy_tokens_equal_hugging_face_generate(name, one_thread):
    """Our weights exported (hf_convert.to_hf_state_dict) into transformers' model of the family; its greedy
    `generate` with its own cache gives our cached sampler's tokens. Batch 2, 8-token prompt, 20 new."""
    transformers = pytest.importorskip("transformers")
    cfg = CASES[name]
    params = random_params(cfg, seed=5)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(cfg), attn_implementation="eager",
                                                          **({"experts_implementation": "eager"}
                                                             if cfg.n_experts else {})).eval()
    model.load_state_dict(to_hf_state_dict(params, cfg), strict=True)
    prompt = prompt_of(cfg, 2, 8, seed=5)
    with torch.no_grad():
        theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False,
                                use_cache=True, eos_token_id=None, pad_token_id=0)
    assert torch.equal(sample(params, cfg, prompt, 20, temperature=0), theirs)
