"""A Hugging Face config.json as nanomega's model fields: the architecture a folder's weights fix.

    fields = model_fields_from_hf(json.load(open("Qwen3-0.6B/config.json")))   # {"d_model": 1024, ...}
    model = model_from_hf("Qwen3-0.6B", ModelConfig(), overridden=[])          # what --train.init_from does

Read without `transformers` (a dict is enough). The run's own choices (vocabulary padding, router losses,
capacity, fp8) are not in config.json and stay the run's; rope scaling of type llama3 and yarn becomes the
model's rope_* fields; what our models do not compute the same way (other rope scalings, sliding windows,
other activations, multi-token prediction) is refused by name. The other direction, a ModelConfig as a
`transformers` config, is hf/convert.py's `hf_config`.

Ground floor: imports nothing from nanomega, so config.parse_args can resolve --train.init_from with it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple


def model_from_hf(folder: str, model, overridden: list[str]):
    """`model` with the architecture of the Hugging Face folder's config.json (`model_fields_from_hf`,
    below); the run's own choices (router losses, capacity, vocab padding) stay. A field in `overridden`
    (set with --model.X) that contradicts the weights is refused, except a rope model's max_seq_len, which
    no weight depends on."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise ValueError(f"--train.init_from={folder}: no config.json there; point it at a Hugging Face model "
                         "folder (config.json and *.safetensors, as save_pretrained writes it)")
    fields = model_fields_from_hf(json.loads(path.read_text()), source=str(path))
    if fields["position"] == "rope" and "max_seq_len" in overridden:
        fields.pop("max_seq_len")
    for key in overridden:
        if key in fields and getattr(model, key) != fields[key]:
            raise ValueError(f"--model.{key}={getattr(model, key)!r} contradicts {path}, whose weights have "
                             f"{key}={fields[key]!r}; drop the override (--train.init_from sets the architecture)")
    return dataclasses.replace(model, **fields)


class Family(NamedTuple):
    """A Hugging Face model family nanomega reads and writes, declared once (FAMILIES, by config.json's model_type,
    which is also the family's name here). hf/convert.py reads it for the other direction.

    config_class  transformers' config class for it (hf/convert.py's hf_config builds one)
    required      the keys its config.json must hold: the sizes the weights have. transformers would fill a missing
                  one with its class default (LlamaConfig's vocab_size=32000), which the weights need not have; we
                  do not guess. A tuple inside is one-of (Qwen-MoE's expert count has had two names).
    mlp           the MLP kind of its dense blocks (models/mlp.py)
    experts       whether its blocks may route experts (MoE)"""
    config_class: str
    required: tuple
    mlp: str = "swiglu"
    experts: bool = False


_DECODER = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings")
_ROUTED = ("num_experts_per_tok", "moe_intermediate_size")
FAMILIES = {
    "gpt2": Family("GPT2Config", ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"), mlp="gelu"),
    "llama": Family("LlamaConfig", _DECODER),
    "qwen2": Family("Qwen2Config", _DECODER),
    "qwen3": Family("Qwen3Config", _DECODER),
    "mixtral": Family("MixtralConfig", (*_DECODER, "num_local_experts", "num_experts_per_tok"), experts=True),
    "qwen2_moe": Family("Qwen2MoeConfig", (*_DECODER, *_ROUTED, ("num_experts", "num_local_experts"),
                                           "shared_expert_intermediate_size"), experts=True),
    "qwen3_moe": Family("Qwen3MoeConfig", (*_DECODER, *_ROUTED, ("num_experts", "num_local_experts")), experts=True),
    "deepseek_v3": Family("DeepseekV3Config", (*_DECODER, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                               "v_head_dim"), experts=True),
}


def _require(hf: dict, kind: str, source: str) -> None:
    """Refuse a config.json that lacks keys its family needs, naming all of them, before anything reads one."""
    need = list(FAMILIES[kind].required)
    if kind == "deepseek_v3" and hf.get("n_routed_experts") and hf.get("first_k_dense_replace", 0) < hf.get(
            "num_hidden_layers", 1):
        need += _ROUTED
    missing = [" or ".join(keys) for keys in (key if isinstance(key, tuple) else (key,) for key in need)
               if all(hf.get(k) is None for k in keys)]
    if missing:
        raise ValueError(f"{source} (model_type={kind!r}) lacks {', '.join(missing)}, which a {kind} model's "
                         f"architecture needs; add {'them' if len(missing) > 1 else 'it'} with the values the "
                         "weights were trained with (save_pretrained writes every one)")


def model_fields_from_hf(hf: dict, source: str = "config.json") -> dict:
    """The ModelConfig fields a Hugging Face config.json (as a dict) determines (module doc). Refuses, naming the
    key, what our models do not compute the same way, and names every key its family needs that it lacks
    (`FAMILIES`); `source` (the file's path) is named in those errors. The inverse of hf/convert.py's `hf_config`."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{source} has model_type={kind!r}; nanomega reads {', '.join(FAMILIES)}")
    _require(hf, kind, source)

    def refuse(bad: bool, what: str) -> None:
        if bad:
            raise ValueError(f"config.json ({kind}) has {what}, which nanomega's models do not compute")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        refuse(act not in ("gelu_new", "gelu_pytorch_tanh"), f"activation_function={act!r} (we have tanh-GELU)")
        refuse(bool(hf.get("scale_attn_by_inverse_layer_idx")) or bool(hf.get("reorder_and_upcast_attn")),
               "scale_attn_by_inverse_layer_idx or reorder_and_upcast_attn")
        return dict(vocab_size=hf["vocab_size"], d_model=hf["n_embd"], n_layers=hf["n_layer"], n_heads=hf["n_head"],
                    n_kv_heads=0, head_dim=0, ffn_dim=hf.get("n_inner") or 4 * hf["n_embd"],
                    max_seq_len=hf["n_positions"], norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                    mlp=FAMILIES[kind].mlp, position="learned", tie_embeddings=hf.get("tie_word_embeddings", True),
                    bias=True, qkv_bias=False, qk_norm=False, attention="mha", n_experts=0)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act={hf.get('hidden_act')!r} (our MLPs are SwiGLU)")
    refuse(bool(hf.get("use_sliding_window")) or "sliding_attention" in (hf.get("layer_types") or ()),
           "sliding-window attention")
    out = dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
               n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
               head_dim=hf.get("head_dim") or 0, ffn_dim=hf["intermediate_size"],
               max_seq_len=hf["max_position_embeddings"], norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6),
               mlp=FAMILIES[kind].mlp, position="rope",
               rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
               tie_embeddings=hf.get("tie_word_embeddings", False), bias=False, qkv_bias=False, qk_norm=False,
               attention="mha", n_experts=0, shared_ffn_dim=0, shared_gate=False, first_dense_layers=0,
               moe_layer_freq=1, router_score="softmax", router_softmax_first=True, router_scale=1.0,
               router_groups=1, router_topk_groups=1, **rope_fields(hf, rope, source))
    if kind == "llama":
        refuse(bool(hf.get("mlp_bias", False)) != bool(hf.get("attention_bias", False)),
               "mlp_bias != attention_bias (our bias=True puts biases on both)")
        out["bias"] = bool(hf.get("attention_bias", False))
    if kind in ("qwen2", "qwen2_moe"):
        out["qkv_bias"] = True
    if kind in ("qwen3", "qwen3_moe"):
        refuse(bool(hf.get("attention_bias", False)), "attention_bias=true")
        out["qk_norm"] = True
    if kind == "mixtral":
        out.update(n_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"], router_norm_topk=True,
                   expert_ffn_dim=hf["intermediate_size"])
    if kind in ("qwen2_moe", "qwen3_moe"):
        refuse(hf.get("decoder_sparse_step", 1) != 1, f"decoder_sparse_step={hf.get('decoder_sparse_step')}")
        n, dense = hf["num_hidden_layers"], sorted(hf.get("mlp_only_layers") or [])
        # ours: layer i is MoE when i >= first_dense_layers and i % moe_layer_freq == 0
        pattern = next(((first, freq) for freq in range(1, n + 1) for first in range(n + 1)
                        if [i for i in range(n) if i < first or i % freq] == dense), None)
        refuse(pattern is None, f"mlp_only_layers={dense} (not first_dense_layers + every moe_layer_freq-th)")
        out.update(n_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                   expert_ffn_dim=hf["moe_intermediate_size"], router_norm_topk=bool(hf.get("norm_topk_prob", False)),
                   first_dense_layers=pattern[0], moe_layer_freq=pattern[1])
        if kind == "qwen2_moe":
            out.update(shared_ffn_dim=hf["shared_expert_intermediate_size"], shared_gate=True)
    if kind == "deepseek_v3":
        refuse(not hf.get("rope_interleave", True), "rope_interleave=false")
        refuse(bool(hf.get("attention_bias", False)), "attention_bias=true")
        refuse(hf.get("num_nextn_predict_layers", 0) or hf.get("num_mtp_layers", 0), "multi-token prediction layers")
        out.update(attention="mla", n_kv_heads=0, head_dim=0, q_lora_rank=hf.get("q_lora_rank") or 0,
                   kv_lora_rank=hf["kv_lora_rank"], qk_nope_dim=hf["qk_nope_head_dim"],
                   qk_rope_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"])
        refuse(hf.get("moe_layer_freq", 1) != 1, f"moe_layer_freq={hf.get('moe_layer_freq')}")
        first_dense = hf.get("first_k_dense_replace", 0)
        if first_dense < hf["num_hidden_layers"] and hf.get("n_routed_experts"):
            out.update(n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                       expert_ffn_dim=hf["moe_intermediate_size"],
                       shared_ffn_dim=(hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
                       router_score="sigmoid", router_scale=float(hf.get("routed_scaling_factor", 1.0)),
                       router_groups=hf.get("n_group") or 1, router_topk_groups=hf.get("topk_group") or 1,
                       router_norm_topk=bool(hf.get("norm_topk_prob", True)), first_dense_layers=first_dense)
    return out


ROPE_TYPES = ("default", "llama3", "yarn")


def rope_fields(hf: dict, rope: dict, source: str) -> dict:
    """The ModelConfig rope-scaling fields of a config.json's rope_parameters (transformers 5) or rope_scaling
    (transformers 4, with "type" the older spelling of "rope_type"); what is missing takes transformers'
    default. Refuses a rope type we do not compute (linear, dynamic, longrope, ...) naming those we do."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{source} has rope scaling rope_type={kind!r}, which nanomega's models do not compute; "
                         f"they compute {', '.join(map(repr, ROPE_TYPES))} (drop rope_scaling to read the model "
                         "at its pretraining context)")
    if kind == "default":
        return dict(rope_scaling="none")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{source} has partial_rotary_factor={rope['partial_rotary_factor']}; nanomega rotates "
                         "whole heads")
    # transformers gives a top-level original_max_position_embeddings precedence (Phi-3 writes it there)
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or \
        hf["max_position_embeddings"]
    out = dict(rope_scaling=kind, rope_original_max_len=int(original))
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if rope.get(k) is None]
        if missing:
            raise ValueError(f"{source}'s llama3 rope scaling lacks {', '.join(missing)}; add the values the model "
                             "was trained with")
        return dict(out, rope_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                    rope_high_freq_factor=float(rope["high_freq_factor"]))
    if rope.get("truncate", True) is False:
        raise ValueError(f"{source}'s yarn rope scaling has truncate=false, which nanomega does not compute (its "
                         "ramp's ends are floored and ceiled, as YaRN's paper and Qwen/DeepSeek have them)")
    # DeepSeek-V3 may leave factor out: then it is the ratio of the two contexts, as in transformers
    factor = rope.get("factor") or hf["max_position_embeddings"] / original
    return dict(out, rope_factor=float(factor), rope_beta_fast=float(rope.get("beta_fast") or 32),
                rope_beta_slow=float(rope.get("beta_slow") or 1), rope_mscale=float(rope.get("mscale") or 0),
                rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                rope_attention_factor=float(rope.get("attention_factor") or 0))
