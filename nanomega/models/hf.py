"""Conversion between our parameter tree and Hugging Face `transformers` state dicts.

    hf_cfg = hf_config(cfg)                          # GPT2Config | LlamaConfig | Qwen2Config | Qwen3Config
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(to_hf_state_dict(params, cfg))
    params = from_hf_state_dict(model.state_dict(), cfg)

Names are renamed leaf by leaf. GPT-2 stores its linears as Conv1D ([in, out], transposed)
with q, k, v fused into one `c_attn` along the output dim. HF has `vocab_size` rows in the
embedding and head where we have `padded_vocab`: exported rows are sliced, imported ones padded
with zeros. `transformers` is imported lazily: only `hf_config` needs it.
"""
from __future__ import annotations

import torch

from nanomega.config import ModelConfig
from nanomega.models.transformer import init
from nanomega.tree import named_leaves, tree_flatten, tree_unflatten

_GPT2_TOP = {"tok_embed": "transformer.wte", "pos_embed": "transformer.wpe",
             "final_norm": "transformer.ln_f", "lm_head": "lm_head"}
_GPT2_LAYER = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.wo": "attn.c_proj",
               "mlp.w_up": "mlp.c_fc", "mlp.w_down": "mlp.c_proj"}
_LLAMA_TOP = {"tok_embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
_LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
                "attn.wo": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
                "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj"}
_VOCAB = ("tok_embed.weight", "lm_head.weight")                       # rows = vocabulary
_QKV = ("attn.wq", "attn.wk", "attn.wv")                              # GPT-2's fused c_attn, in order
_HF_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # non-parameters in old checkpoints


def hf_family(cfg: ModelConfig) -> str:
    """"gpt2" | "qwen3" | "qwen2" | "llama"; raises if HF has no model with exactly this layout."""
    gpt2 = cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp == "gelu"
    family = "gpt2" if gpt2 else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    if gpt2:
        problems = [(not cfg.bias, "bias=True"), (cfg.kv_heads != cfg.n_heads, "n_kv_heads == n_heads"),
                    (cfg.dim_head * cfg.n_heads != cfg.d_model, "head_dim == d_model // n_heads"),
                    (cfg.qk_norm, "qk_norm=False")]
    else:
        problems = [(cfg.position != "rope", "position='rope'"), (cfg.norm != "rmsnorm", "norm='rmsnorm'"),
                    (cfg.mlp != "swiglu", "mlp='swiglu'"),
                    (family != "llama" and cfg.bias, "bias=False (Qwen has no o_proj/mlp biases)"),
                    (family == "qwen3" and cfg.qkv_bias, "qkv_bias=False (Qwen3 biases o_proj too)"),
                    (family == "qwen2" and cfg.dim_head * cfg.n_heads != cfg.d_model,
                     "head_dim == d_model // n_heads")]
    bad = [need for failed, need in problems if failed]
    if bad:
        raise ValueError(f"no Hugging Face {family} model matches this ModelConfig; it needs {', '.join(bad)}")
    return family


def hf_config(cfg: ModelConfig):
    """The `transformers` config of the HF model with our architecture (fp32, no dropout)."""
    import transformers  # test-only dependency

    family = hf_family(cfg)
    if family == "gpt2":
        eos = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, if the vocab has it
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=cfg.hidden_dim, activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=eos, eos_token_id=eos)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta}, attention_dropout=0.0,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=cfg.dim_head, attention_bias=False)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common, head_dim=cfg.dim_head, attention_bias=cfg.bias, mlp_bias=cfg.bias)


def _hf_name(name: str, gpt2: bool) -> tuple[str, int | None]:
    """HF key of one of our leaves, and its slot in GPT-2's fused c_attn (None elsewhere)."""
    *module, leaf = name.split(".")
    if module[0] != "layers":
        return f"{(_GPT2_TOP if gpt2 else _LLAMA_TOP)[module[0]]}.{leaf}", None
    i, sub = module[1], ".".join(module[2:])
    if not gpt2:
        return f"model.layers.{i}.{_LLAMA_LAYER[sub]}.{leaf}", None
    if sub in _QKV:
        return f"transformer.h.{i}.attn.c_attn.{leaf}", _QKV.index(sub)
    return f"transformer.h.{i}.{_GPT2_LAYER[sub]}.{leaf}", None


def _conv1d(hf_key: str, gpt2: bool, ndim: int) -> bool:
    return gpt2 and ndim == 2 and hf_key.startswith("transformer.h.")


def to_hf_state_dict(params: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (detached; unfused tensors are views of `params`). Tied: lm_head.weight is the embedding."""
    gpt2 = hf_family(cfg) == "gpt2"
    sd: dict[str, torch.Tensor | list] = {}
    for name, t in named_leaves(params).items():
        key, slot = _hf_name(name, gpt2)
        t = t.detach()[:cfg.vocab_size] if name in _VOCAB else t.detach()
        if slot is None:
            sd[key] = t
        else:
            sd.setdefault(key, [None] * len(_QKV))[slot] = t
    for key, t in sd.items():
        t = torch.cat(t) if isinstance(t, list) else t
        sd[key] = t.t().contiguous() if _conv1d(key, gpt2, t.ndim) else t
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd[_hf_name("tok_embed.weight", gpt2)[0]]
    return sd


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Our parameter tree (fresh fp32 leaves that require grad) from an HF state dict; inverse of the above."""
    gpt2 = hf_family(cfg) == "gpt2"
    template = init(cfg, device="meta")
    qkv_rows = [cfg.n_heads * cfg.dim_head] + 2 * [cfg.kv_heads * cfg.dim_head]
    leaves, used = [], set()
    for name, like in named_leaves(template).items():
        key, slot = _hf_name(name, gpt2)
        if key not in sd:
            raise KeyError(f"{key!r} (for our {name!r}) is missing from the Hugging Face state dict")
        used.add(key)
        t = sd[key].detach()
        if _conv1d(key, gpt2, t.ndim):
            t = t.t()
        if slot is not None:
            t = t[sum(qkv_rows[:slot]):sum(qkv_rows[:slot + 1])]
        if name in _VOCAB:
            t = torch.cat([t, t.new_zeros(like.shape[0] - t.shape[0], *t.shape[1:])])
        if t.shape != like.shape:
            raise ValueError(f"{key!r} has shape {tuple(sd[key].shape)}; our {name!r} needs {tuple(like.shape)}")
        leaves.append(t.to(torch.float32).clone(memory_format=torch.contiguous_format).requires_grad_(True))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    unused = [k for k in sd if k not in used and not k.endswith(_HF_BUFFERS)]
    if unused:
        raise ValueError(f"Hugging Face tensors with no place in this ModelConfig: {unused[:8]}")
    return tree_unflatten(leaves, tree_flatten(template)[1])
