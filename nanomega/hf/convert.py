"""Conversion between our parameter tree and Hugging Face `transformers` state dicts.

    hf_cfg = hf_config(cfg)          # the family's transformers config (LlamaConfig, ...: hf_family)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    model.load_state_dict(to_hf_state_dict(params, cfg))
    params = from_hf_state_dict(model.state_dict(), cfg)

Names are renamed leaf by leaf. GPT-2 stores its linears as Conv1D ([in, out], transposed)
with q, k, v fused into one `c_attn` along the output dim. HF has `vocab_size` rows in the
embedding and head where we have `padded_vocab`: exported rows are sliced, imported ones padded
with zeros. `transformers` is imported lazily: only `hf_config` needs it.

A family is declared once, in config/hf_folder.py's FAMILIES (its config class, the keys its config.json needs,
its MLP kind, whether it routes experts), which both directions read. What only this direction needs stays here:
which family a ModelConfig is (`_family`) and what it must change to be exactly that family (`hf_family`), the
config's keyword arguments (`hf_config`, the inverse of hf_folder.py's `model_fields_from_hf`), and the weight
names (_GPT2_* for GPT-2's, _LLAMA_* for every other family's).

MoE layers (transformers 5 stores experts stacked, like us): our experts.w_gate and w_up [E, f, d]
are fused into HF's `mlp.experts.gate_up_proj` [E, 2f, d] (gate rows first; HF chunks the output in
two), w_down [E, d, f] is `down_proj` as is; router.weight is `mlp.gate.weight`, DeepSeek-V3's
router.expert_bias its `e_score_correction_bias` buffer (exported as zeros when we have no bias).
DeepSeek-V3's MLA weights rename one to one, but HF rotates interleaved rope pairs: the rope rows of
wq / wq_b / wkv_a are permuted (models/mla.py). Semantics HF does not share, converted anyway:
HF's MoE layers drop no tokens (a capacity_factor > 0 model's HF logits are ours with
capacity_factor=0); Mixtral and Qwen-MoE compute the router logits in the model dtype (we and
DeepSeek-V3 use fp32), so under bf16 the chosen experts can differ near ties.
"""
from __future__ import annotations

import torch

from nanomega.config import ModelConfig
from nanomega.config.hf_folder import FAMILIES
from nanomega.models import mla
from nanomega.models.mlp import expert_dim, hidden_dim
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
                "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
                # multi-head latent attention (DeepSeek-V3); attn.wq and attn.wo as above
                "attn.wq_a": "self_attn.q_a_proj", "attn.q_a_norm": "self_attn.q_a_layernorm",
                "attn.wq_b": "self_attn.q_b_proj", "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
                "attn.kv_a_norm": "self_attn.kv_a_layernorm", "attn.wkv_b": "self_attn.kv_b_proj"}
_MOE_LEAF = {"moe.router.weight": "mlp.gate.weight", "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
             "moe.experts.w_gate": "mlp.experts.gate_up_proj", "moe.experts.w_up": "mlp.experts.gate_up_proj",
             "moe.experts.w_down": "mlp.experts.down_proj", "moe.shared_gate.weight": "mlp.shared_expert_gate.weight"}
_SHARED = {"qwen2_moe": "mlp.shared_expert", "deepseek_v3": "mlp.shared_experts"}  # + .{gate,up,down}_proj
_FUSED = {"attn.wq": 0, "attn.wk": 1, "attn.wv": 2,          # GPT-2's c_attn, in order
          "moe.experts.w_gate": 0, "moe.experts.w_up": 1}    # HF's experts.gate_up_proj
_VOCAB = ("tok_embed.weight", "lm_head.weight")                       # rows = vocabulary
_HF_BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # non-parameters in old checkpoints
_ROPE_ROWS = ("attn.wq.weight", "attn.wq_b.weight", "attn.wkv_a.weight")  # MLA: HF's interleaved rope rows


def _family(cfg: ModelConfig) -> str:
    """The family (config/hf_folder.py's FAMILIES) this ModelConfig's layout is closest to."""
    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp == FAMILIES["gpt2"].mlp:
        return "gpt2"
    if cfg.attention == "mla":
        return "deepseek_v3"
    if cfg.n_experts:
        return "qwen3_moe" if cfg.qk_norm else "qwen2_moe" if cfg.qkv_bias or cfg.shared_ffn_dim else "mixtral"
    return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def _moe_problems(cfg: ModelConfig, family: str) -> list[tuple[bool, str]]:
    """What an MoE (or MLA) config must change to be exactly the HF `family`."""
    deepseek, moe = family == "deepseek_v3", cfg.n_experts > 0
    experts_of_group = cfg.top_k // cfg.router_topk_groups
    return [
        (moe and cfg.router_score != ("sigmoid" if deepseek else "softmax"),
         f"router_score={'sigmoid' if deepseek else 'softmax'!r}"),
        (not deepseek and cfg.router_groups > 1, "router_groups=1 (only DeepSeek-V3 limits groups)"),
        (not deepseek and cfg.router_scale != 1.0, "router_scale=1.0"),
        (not deepseek and cfg.expert_bias_rate > 0, "expert_bias_rate=0 (only DeepSeek-V3 has the bias)"),
        (family in ("mixtral", "qwen3_moe") and cfg.shared_ffn_dim > 0, "shared_ffn_dim=0 (no shared expert)"),
        (family == "qwen2_moe" and not (cfg.shared_ffn_dim and cfg.shared_gate),
         "shared_ffn_dim > 0 and shared_gate=True (Qwen2-MoE always has a gated shared expert)"),
        (family != "qwen2_moe" and cfg.shared_gate, "shared_gate=False"),
        (family == "qwen2_moe" and not cfg.qkv_bias, "qkv_bias=True"),
        (family == "qwen2_moe" and cfg.dim_head * cfg.n_heads != cfg.d_model, "head_dim == d_model // n_heads"),
        (family == "mixtral" and cfg.n_moe_layers != cfg.n_layers,
         "every layer an MoE layer (first_dense_layers=0, moe_layer_freq=1)"),
        (family == "mixtral" and not cfg.router_norm_topk, "router_norm_topk=True"),
        (FAMILIES[family].experts and cfg.bias, "bias=False"),
        (deepseek and (cfg.qk_norm or cfg.qkv_bias), "qk_norm=False, qkv_bias=False"),
        (deepseek and cfg.norm_eps != 1e-6, "norm_eps=1e-6 (HF's latent norms use 1e-6 whatever rms_norm_eps)"),
        (deepseek and moe and cfg.moe_layer_freq != 1, "moe_layer_freq=1 (every layer after the dense ones)"),
        (deepseek and moe and not (cfg.shared_ffn_dim and cfg.shared_ffn_dim % expert_dim(cfg) == 0),
         f"shared_ffn_dim a positive multiple of the expert's {expert_dim(cfg)} (n_shared_experts)"),
        (deepseek and moe and cfg.router_groups > 1 and experts_of_group != 2,
         f"top_k // router_topk_groups == 2 (HF scores a group by its best 2 experts; here {experts_of_group})"),
    ]


def hf_family(cfg: ModelConfig) -> str:
    """The Hugging Face family (a key of config/hf_folder.py's FAMILIES: "gpt2", "llama", "qwen3_moe", ...) with
    exactly this layout; raises, naming what to change, if HF has no such model."""
    family = _family(cfg)
    mlp = FAMILIES[family].mlp      # the MLP kind (models/mlp.py) the family's blocks use
    problems = [(cfg.mlp != mlp, f"mlp={mlp!r}")]
    if family == "gpt2":
        problems += [(not cfg.bias, "bias=True"), (cfg.kv_heads != cfg.n_heads, "n_kv_heads == n_heads"),
                     (cfg.dim_head * cfg.n_heads != cfg.d_model, "head_dim == d_model // n_heads"),
                     (cfg.qk_norm, "qk_norm=False"), (cfg.n_experts > 0, "n_experts=0")]
    else:
        problems += [(cfg.position != "rope", "position='rope'"), (cfg.norm != "rmsnorm", "norm='rmsnorm'"),
                     (family in ("qwen2", "qwen3") and cfg.bias, "bias=False (Qwen has no o_proj/mlp biases)"),
                     (family in ("qwen3", "qwen3_moe") and cfg.qkv_bias, "qkv_bias=False (Qwen3 biases o_proj too)"),
                     (family == "qwen2" and cfg.dim_head * cfg.n_heads != cfg.d_model,
                      "head_dim == d_model // n_heads")]
        problems += _moe_problems(cfg, family)
    bad = [need for failed, need in problems if failed]
    if bad:
        raise ValueError(f"no Hugging Face {family} model matches this ModelConfig; it needs {', '.join(bad)}")
    return family


def hf_config(cfg: ModelConfig):
    """The `transformers` config of the HF model with our architecture (fp32, no dropout)."""
    import transformers  # test-only dependency

    family = hf_family(cfg)
    config_class = getattr(transformers, FAMILIES[family].config_class)
    if family == "gpt2":
        eos = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, if the vocab has it
        return config_class(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.n_heads, n_inner=hidden_dim(cfg), activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings,
            bos_token_id=eos, eos_token_id=eos)
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=hidden_dim(cfg),
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg), attention_dropout=0.0,
        initializer_range=cfg.init_std, tie_word_embeddings=cfg.tie_embeddings)
    experts = dict(num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=expert_dim(cfg),
                   norm_topk_prob=cfg.router_norm_topk, decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i)])
    if family == "mixtral":
        return config_class(**{**common, "intermediate_size": expert_dim(cfg)}, head_dim=cfg.dim_head,
                            num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                            router_jitter_noise=0.0, sliding_window=None)
    if family == "qwen2_moe":
        return config_class(**common, **experts, shared_expert_intermediate_size=cfg.shared_ffn_dim, qkv_bias=True)
    if family == "qwen3_moe":
        return config_class(**common, **experts, head_dim=cfg.dim_head, attention_bias=False)
    if family == "deepseek_v3":
        moe = dict(n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=expert_dim(cfg),
                   n_shared_experts=cfg.shared_ffn_dim // expert_dim(cfg), routed_scaling_factor=cfg.router_scale,
                   n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.router_norm_topk,
                   first_k_dense_replace=cfg.first_dense_layers) if cfg.n_experts else dict(
                   first_k_dense_replace=cfg.n_layers)
        return config_class(
            **{**common, "num_key_value_heads": cfg.n_heads}, **moe, q_lora_rank=cfg.q_lora_rank or None,
            kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_dim, qk_rope_head_dim=cfg.qk_rope_dim,
            v_head_dim=cfg.v_head_dim, rope_interleave=True, attention_bias=False, num_mtp_layers=0)
    if family == "qwen3":
        return config_class(**common, head_dim=cfg.dim_head, attention_bias=False)
    if family == "qwen2":
        return config_class(**common)
    return config_class(**common, head_dim=cfg.dim_head, attention_bias=cfg.bias, mlp_bias=cfg.bias)


def rope_parameters(cfg: ModelConfig) -> dict:
    """config.json's rope_parameters for our rope fields: the inverse of hf_config.py's `rope_fields`, so
    an exported folder reads back to the same ModelConfig and transformers computes our rope tables."""
    out = {"rope_type": "default" if cfg.rope_scaling == "none" else cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "none":
        return out
    out.update(factor=cfg.rope_factor, original_max_position_embeddings=cfg.rope_original_max_len)
    if cfg.rope_scaling == "llama3":
        return dict(out, low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow)
    optional = {"mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
                "attention_factor": cfg.rope_attention_factor}
    return dict(out, **{k: v for k, v in optional.items() if v})     # 0 means "not given"


def _hf_name(name: str, family: str) -> tuple[str, int | None]:
    """HF key of one of our leaves, and its slot in a fused HF tensor (None elsewhere):
    GPT-2's c_attn (q, k, v) and the experts' gate_up_proj (gate, up), both along the output dim."""
    gpt2 = family == "gpt2"
    *module, leaf = name.split(".")
    if module[0] != "layers":
        return f"{(_GPT2_TOP if gpt2 else _LLAMA_TOP)[module[0]]}.{leaf}", None
    i, sub = module[1], ".".join(module[2:])
    if gpt2:
        if sub in _FUSED:
            return f"transformer.h.{i}.attn.c_attn.{leaf}", _FUSED[sub]
        return f"transformer.h.{i}.{_GPT2_LAYER[sub]}.{leaf}", None
    if f"{sub}.{leaf}" in _MOE_LEAF:
        return f"model.layers.{i}.{_MOE_LEAF[sub + '.' + leaf]}", _FUSED.get(f"{sub}.{leaf}")
    if sub.startswith("moe.shared."):   # moe.shared.w_up -> {shared}.up_proj
        return f"model.layers.{i}.{_SHARED[family]}.{_LLAMA_LAYER['mlp.' + module[-1]][4:]}.{leaf}", None
    return f"model.layers.{i}.{_LLAMA_LAYER[sub]}.{leaf}", None


def _conv1d(hf_key: str, family: str, ndim: int) -> bool:
    return family == "gpt2" and ndim == 2 and hf_key.startswith("transformer.h.")


def _fuse_dim(t: torch.Tensor) -> int:
    """The output dim, along which fused tensors are concatenated: -2 of a weight, 0 of a bias."""
    return -2 if t.ndim >= 2 else 0


def _rope_rows(name: str, cfg: ModelConfig, family: str):
    """(n_heads, nope) of an MLA weight whose rope rows HF interleaves; None for every other leaf."""
    if family != "deepseek_v3" or not name.endswith(_ROPE_ROWS):
        return None
    return (1, cfg.kv_lora_rank) if name.endswith("attn.wkv_a.weight") else (cfg.n_heads, cfg.qk_nope_dim)


def _hf_constants(cfg: ModelConfig, family: str) -> dict[str, torch.Tensor]:
    """HF tensors we have no parameter for, with the value that makes HF compute what we compute."""
    if family != "deepseek_v3" or cfg.expert_bias_rate:
        return {}
    return {f"model.layers.{i}.mlp.gate.e_score_correction_bias": torch.zeros(cfg.n_experts)
            for i in range(cfg.n_layers) if cfg.is_moe_layer(i)}


def hf_layout(cfg: ModelConfig) -> dict[str, list[str]]:
    """{HF key: our leaf names it is made of, in slot order (several for a fused tensor)} in our parameter
    order; the HF constants (`_hf_constants`) and a tied lm_head are not in it. With `hf_tensor`, what lets
    an export convert one tensor at a time (nanomega/hf/transfer.py)."""
    family = hf_family(cfg)
    slots: dict[str, dict[int, str]] = {}
    for name in named_leaves(init(cfg, device="meta")):
        key, slot = _hf_name(name, family)
        slots.setdefault(key, {})[slot or 0] = name
    return {key: [parts[s] for s in sorted(parts)] for key, parts in slots.items()}


def hf_tensor(key: str, names: list[str], parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """HF tensor `key` from our leaves `names` (hf_layout's) with values `parts`: the vocabulary's padding rows
    cut, MLA's rope rows interleaved, fused parts concatenated, GPT-2's Conv1D transposed. Detached; a view
    of the part where nothing needs a copy."""
    family = hf_family(cfg)
    out = []
    for name, t in zip(names, parts):
        t = t.detach()[:cfg.vocab_size] if name in _VOCAB else t.detach()
        if (rope := _rope_rows(name, cfg, family)) is not None:
            t = mla.rope_rows_to_interleaved(t, *rope, cfg.qk_rope_dim)
        out.append(t)
    t = out[0] if len(out) == 1 else torch.cat(out, dim=_fuse_dim(out[0]))
    return t.t().contiguous() if _conv1d(key, family, t.ndim) else t


def to_hf_state_dict(params: dict, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF state dict (detached; unfused tensors are views of `params`). Tied: lm_head.weight is the embedding."""
    leaves = named_leaves(params)
    sd = {key: hf_tensor(key, names, [leaves[n] for n in names], cfg) for key, names in hf_layout(cfg).items()}
    sd.update(_hf_constants(cfg, hf_family(cfg)))
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd[_hf_name("tok_embed.weight", hf_family(cfg))[0]]
    return sd


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict:
    """Our parameter tree (fresh fp32 leaves that require grad) from an HF state dict; inverse of the above."""
    family = hf_family(cfg)
    tree = init(cfg, device="meta")
    template = named_leaves(tree)
    names = {name: _hf_name(name, family) for name in template}
    fused: dict[str, dict[int, int]] = {}    # HF key -> {slot: its size along the output dim}
    for name, (key, slot) in names.items():
        if slot is not None:
            fused.setdefault(key, {})[slot] = template[name].shape[_fuse_dim(template[name])]
    leaves, used = [], set()
    for name, like in template.items():
        key, slot = names[name]
        if key not in sd:
            raise KeyError(f"{key!r} (for our {name!r}) is missing from the Hugging Face state dict")
        used.add(key)
        t = sd[key].detach()
        if _conv1d(key, family, t.ndim):
            t = t.t()
        if slot is not None:
            t = t.split([fused[key][s] for s in sorted(fused[key])], dim=_fuse_dim(t))[slot]
        if name in _VOCAB:
            t = torch.cat([t, t.new_zeros(like.shape[0] - t.shape[0], *t.shape[1:])])
        if t.shape != like.shape:
            raise ValueError(f"{key!r} has shape {tuple(sd[key].shape)}; our {name!r} needs {tuple(like.shape)}")
        if (rope := _rope_rows(name, cfg, family)) is not None:
            t = mla.rope_rows_from_interleaved(t, *rope, cfg.qk_rope_dim)
        leaves.append(t.to(torch.float32).clone(memory_format=torch.contiguous_format).requires_grad_(True))
    for key, value in _hf_constants(cfg, family).items():
        if key in sd and not torch.equal(sd[key].detach().cpu().to(value.dtype), value):
            raise ValueError(f"{key!r} is not {value.flatten()[:1].item()} everywhere and this ModelConfig has no "
                             "place for it; set model.expert_bias_rate > 0 to keep the expert bias")
        used.add(key)
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    unused = [k for k in sd if k not in used and not k.endswith(_HF_BUFFERS)]
    if unused:
        raise ValueError(f"Hugging Face tensors with no place in this ModelConfig: {unused[:8]}")
    return tree_unflatten(leaves, tree_flatten(tree)[1])
