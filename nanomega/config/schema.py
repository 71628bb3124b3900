"""Configuration: frozen dataclasses passed down, plus `--section.key=value` overrides.

A run is described by one `Config` made of sections (model, optim, data, train, parallel, eval).
Named configs live in `configs/<name>.py` as a function `config() -> Config`;
`parse_args(argv)` picks one with `--config=NAME` and applies dotted overrides.

One idea, the schema of a run, in one file: every field is declared with its meaning and every cross-field
rule sits in `validate`, so a reader looks in one place. How a command line fills it is cli.py; a Hugging
Face folder's config.json is read by hf_folder.py (for --train.init_from).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer; GPT-2, LLaMA and Qwen differ only in these fields."""
    vocab_size: int = 256
    vocab_multiple: int = 64          # the embedding is padded to a multiple of this
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0               # 0 means n_heads (multi-head); fewer means GQA
    head_dim: int = 0                 # 0 means d_model // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 0                  # 0 means 4*d_model (gelu) or LLaMA's rounded 8/3*d_model (swiglu)
    max_seq_len: int = 256
    norm: str = "rmsnorm"             # "rmsnorm" | "layernorm"
    norm_eps: float = 1e-5
    mlp: str = "swiglu"               # "swiglu" | "gelu"
    position: str = "rope"            # "rope" | "learned"
    rope_theta: float = 10000.0
    # rope scaling: a model pretrained on rope_original_max_len positions read further (Hugging Face's
    # rope_scaling / rope_parameters; the maths in models/layers.py rope_frequencies)
    rope_scaling: str = "none"        # "none" | "llama3" (Llama 3.1/3.2) | "yarn" (Qwen2/3, DeepSeek-V3)
    rope_factor: float = 1.0          # how many times longer the context is than the pretraining one
    rope_original_max_len: int = 0    # the pretraining context (original_max_position_embeddings)
    rope_low_freq_factor: float = 1.0   # llama3: wavelengths over original/low_freq_factor are slowed by factor,
    rope_high_freq_factor: float = 4.0  # those under original/high_freq_factor kept, the ones between blended
    rope_beta_fast: float = 32.0      # yarn: dims turning more than beta_fast times in the original context kept,
    rope_beta_slow: float = 1.0       # those turning fewer than beta_slow times slowed by factor, a ramp between
    rope_mscale: float = 0.0          # yarn: cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    rope_mscale_all_dim: float = 0.0  # (both 0: times mscale(factor, 1)); MLA's softmax times mscale(.., all_dim)^2
    rope_attention_factor: float = 0.0  # yarn: the cos/sin factor given outright (0: from the mscales above)
    tie_embeddings: bool = False
    bias: bool = False                # biases on every linear and norm (GPT-2)
    qkv_bias: bool = False            # biases on q, k, v only (Qwen2)
    qk_norm: bool = False             # RMSNorm on each head of q and k (Qwen3)
    init_std: float = 0.02
    # --- attention variant: "mha" (MHA/GQA/MQA by n_kv_heads) | "mla" (DeepSeek-V2/V3 multi-head latent)
    attention: str = "mha"
    q_lora_rank: int = 0              # mla: rank of the query's low-rank projection (0 = a full wq)
    kv_lora_rank: int = 0             # mla: rank of the compressed key/value latent
    qk_nope_dim: int = 0              # mla: per-head query/key dims without RoPE
    qk_rope_dim: int = 0              # mla: per-head query/key dims with RoPE (the key's is shared by all heads)
    v_head_dim: int = 0               # mla: per-head value dim
    # --- mixture of experts (n_experts = 0: every layer is a dense MLP)
    n_experts: int = 0                # routed experts per MoE layer
    top_k: int = 2                    # experts each token is sent to
    expert_ffn_dim: int = 0           # hidden size of one expert (0 = ffn_dim)
    shared_ffn_dim: int = 0           # hidden size of the shared expert(s) every token passes (0 = none)
    shared_gate: bool = False         # Qwen2-MoE: the shared expert's output scaled by sigmoid(x . w)
    first_dense_layers: int = 0       # DeepSeek: the first layers keep a dense MLP of ffn_dim
    moe_layer_freq: int = 1           # layer i >= first_dense_layers is MoE when i % moe_layer_freq == 0
    router_score: str = "softmax"     # "softmax" | "sigmoid" (DeepSeek-V3)
    router_softmax_first: bool = True # softmax over all experts, then top-k; false: top-k logits, then softmax
    router_norm_topk: bool = True     # renormalize the k chosen weights to sum to 1 (Mixtral, Qwen3, DeepSeek-V3)
    router_scale: float = 1.0         # multiplies the chosen weights (DeepSeek-V3's routed_scaling_factor)
    router_groups: int = 1            # group-limited routing: experts split in groups ...
    router_topk_groups: int = 1       # ... and each token picks experts only from its best groups
    aux_loss: str = "micro_batch"     # load balancing over the micro-batch (GShard/Switch) | "sequence" (DeepSeek)
    aux_loss_coef: float = 0.0        # weight of the load-balancing loss (0 = off)
    z_loss_coef: float = 0.0          # weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)
    expert_bias_rate: float = 0.0     # aux-loss-free balancing (DeepSeek-V3): per-step bias update (0 = off)
    capacity_factor: float = 0.0      # token dropping: expert capacity per sequence = ceil(cf*T*k/E) (0 = dropless)
    drop_policy: str = "probs"        # over capacity, keep the highest-weight tokens ("probs") or the first ("position")
    pad_to_capacity: bool = False     # token dropping: every expert gets exactly its capacity (static shapes)
    expert_kernel: str = "auto"       # "auto" | "grouped_mm" (torch._grouped_mm) | "loop" (one matmul per expert)
    # float8 matmuls (nanomega/models/fp8.py): set from train.fp8 / train.fp8_bf16_layers by the run's setup
    # (parallel.mesh.model_config), like the vocabulary padding; the model reads them here
    fp8: str = "none"
    fp8_bf16_layers: int = 0
    fp8_amax_history: int = 16
    fp8_margin: int = 0
    # tokens whose logits the loss makes at a time (nanomega/models/loss.py): set from train.loss_chunk by the
    # run's setup (parallel.mesh.model_config), like the float8 recipe
    loss_chunk: int = 4096
    # delayed scaling's amaxes on a mesh: "linear" reduces each as it is taken; "step" keeps each rank's own until
    # the step's one reduction at its end. Not a setting: the train step (nanomega/train/step.py) switches to "step" once
    # the histories hold a step (parallel/fp8.py), in a config of its own, so the model never reads global state
    fp8_amax_reduction: str = "linear"

    @property
    def padded_vocab(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim:
            return self.ffn_dim
        if self.mlp == "gelu":
            return 4 * self.d_model
        return (int(8 * self.d_model / 3) + 255) // 256 * 256

    @property
    def expert_dim(self) -> int:
        return self.expert_ffn_dim or self.hidden_dim

    def block_config(self, i: int) -> "ModelConfig":
        """The config block i runs with: without fp8 among the first and last fp8_bf16_layers blocks."""
        if self.fp8 != "none" and (i < self.fp8_bf16_layers or i >= self.n_layers - self.fp8_bf16_layers):
            return _without_fp8(self)
        return self

    def is_moe_layer(self, i: int) -> bool:
        return self.n_experts > 0 and i >= self.first_dense_layers and i % self.moe_layer_freq == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def validate(self) -> None:
        choices = {"norm": ("rmsnorm", "layernorm"), "mlp": ("swiglu", "gelu"), "position": ("rope", "learned"),
                   "attention": ("mha", "mla"), "router_score": ("softmax", "sigmoid"),
                   "aux_loss": ("micro_batch", "sequence"), "drop_policy": ("probs", "position"),
                   "expert_kernel": ("auto", "grouped_mm", "loop")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key}={getattr(self, key)!r} is not one of {allowed}")
        if self.attention == "mla":
            for key in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
                if getattr(self, key) < 1:
                    raise ValueError(f"model.attention='mla' needs model.{key} >= 1, got {getattr(self, key)}")
            if self.qk_rope_dim % 2:
                raise ValueError(f"RoPE needs an even model.qk_rope_dim, got {self.qk_rope_dim}")
        if self.n_experts:
            self._validate_moe()
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads={self.kv_heads} must divide model.n_heads={self.n_heads}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}, "
                             "or set model.head_dim explicitly")
        if self.rope_scaling not in ("none", "llama3", "yarn"):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} is not one of ('none', 'llama3', 'yarn')")
        if self.rope_scaling != "none" and (self.position != "rope" or self.rope_factor < 1
                                            or self.rope_original_max_len < 1):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} needs model.position='rope', model.rope_factor "
                             f">= 1 (got {self.rope_factor}) and model.rope_original_max_len >= 1 (got "
                             f"{self.rope_original_max_len}), the context the model was pretrained on")
        if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ValueError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor (llama3 blends "
                             "between the two wavelengths)")
        if self.position == "rope" and self.attention == "mha" and self.dim_head % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.dim_head}")

    def _validate_moe(self) -> None:
        E, k = self.n_experts, self.top_k
        if not 1 <= k <= E:
            raise ValueError(f"model.top_k={k} must be between 1 and model.n_experts={E}")
        if self.mlp != "swiglu":
            raise ValueError("mixture-of-experts layers use SwiGLU experts; set model.mlp='swiglu'")
        if self.moe_layer_freq < 1 or self.first_dense_layers < 0:
            raise ValueError("model.moe_layer_freq must be >= 1 and model.first_dense_layers >= 0")
        if self.n_moe_layers == 0:
            raise ValueError(f"model.n_experts={E} but no layer is an MoE layer (first_dense_layers="
                             f"{self.first_dense_layers}, moe_layer_freq={self.moe_layer_freq}, n_layers={self.n_layers})")
        g, tg = self.router_groups, self.router_topk_groups
        if g < 1 or E % g:
            raise ValueError(f"model.router_groups={g} must divide model.n_experts={E}")
        if not 1 <= tg <= g or k % tg or k > tg * (E // g):
            raise ValueError(f"group-limited routing picks top_k={k} experts from router_topk_groups={tg} of "
                             f"router_groups={g} groups of {E // g}: tg must divide top_k and the groups must hold "
                             "top_k experts")
        if self.capacity_factor < 0 or self.aux_loss_coef < 0 or self.z_loss_coef < 0 or self.expert_bias_rate < 0:
            raise ValueError("model.capacity_factor, aux_loss_coef, z_loss_coef and expert_bias_rate must be >= 0")
        if self.pad_to_capacity and not self.capacity_factor:
            raise ValueError("model.pad_to_capacity=true needs a model.capacity_factor > 0 (dropless has no capacity)")
        if self.router_score == "softmax" and not self.router_softmax_first and not self.router_norm_topk:
            raise ValueError("model.router_softmax_first=false already normalizes the k weights; "
                             "set model.router_norm_topk=true")


FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise", "delayed")    # nanomega/models/fp8.py
TRACKERS = ("none", "tensorboard", "wandb")    # nanomega/run/tracking.py: where rank 0 mirrors metrics.jsonl

# Every numeric setting with a range, in one place (Config.validate checks them before any work): the
# interval it must lie in ("(0, inf)": positive and finite; "[0, 1)": a decay or momentum), and why.
RANGES = {
    "model.vocab_size": ("[1, inf)", ""), "model.d_model": ("[1, inf)", ""), "model.n_layers": ("[1, inf)", ""),
    "model.n_heads": ("[1, inf)", ""), "model.max_seq_len": ("[1, inf)", ""),
    "model.norm_eps": ("(0, inf)", "it keeps the norm's division finite"),
    "model.init_std": ("(0, inf)", ""), "model.rope_theta": ("(0, inf)", ""),
    "optim.lr": ("(0, inf)", "the peak learning rate"),
    "optim.min_lr_ratio": ("[0, 1]", "the final lr as a fraction of the peak"),
    "optim.warmup_steps": ("[0, inf)", ""), "optim.decay_fraction": ("(0, 1]", "wsd's decaying share of the steps"),
    "optim.weight_decay": ("[0, inf)", "a negative decay grows the weights"),
    "optim.beta1": ("[0, 1)", "an EMA coefficient"), "optim.beta2": ("[0, 1)", "an EMA coefficient"),
    "optim.eps": ("(0, inf)", ""), "optim.grad_clip": ("[0, inf)", "0 disables clipping"),
    "optim.momentum": ("[0, 1)", ""), "optim.muon_momentum": ("[0, 1)", ""), "optim.shampoo_momentum": ("[0, 1)", ""),
    "optim.adam_lr_ratio": ("(0, inf)", ""), "optim.ns_steps": ("[1, inf)", ""),
    "optim.precondition_frequency": ("[1, inf)", ""), "optim.shampoo_beta": ("(0, 1]", "1 sums the factors"),
    "optim.shampoo_eps": ("(0, inf)", ""), "optim.start_preconditioning_step": ("[0, inf)", ""),
    "optim.shampoo_block_size": ("[1, inf)", ""), "optim.max_precond_dim": ("[1, inf)", ""),
    "optim.shampoo_inv_root": ("[0, inf)", "0 = twice the parameter's rank"),
    "optim.normuon_beta2": ("[0, 1)", "0 turns NorMuon off"),
    "train.keep_checkpoints": ("[1, inf)", "how many of the newest checkpoints to keep"),
    "train.temperature": ("[0, inf)", "0 samples greedily"), "train.top_k": ("[0, inf)", "0 keeps every token"),
    "train.sample_tokens": ("[0, inf)", ""), "train.eval_batches": ("[1, inf)", ""),
    "train.peak_flops": ("[0, inf)", "0 looks the peak up"), "parallel.bucket_mb": ("(0, inf)", ""),
    "eval.batch_size": ("[1, inf)", ""),
}


def _check_range(cfg, key: str, interval: str, why: str) -> None:
    section, field_name = key.split(".")
    value = getattr(getattr(cfg, section), field_name)
    low, high = (float(x) for x in interval[1:-1].split(","))
    ok = math.isfinite(value) and (low <= value if interval[0] == "[" else low < value) and \
        (value <= high if interval[-1] == "]" else value < high)
    if not ok:
        raise ValueError(f"{key}={value} must lie in {interval}" + (f" ({why})" if why else ""))


@functools.cache
def _without_fp8(cfg: ModelConfig) -> ModelConfig:   # one object per config: torch.compile guards on it
    return dataclasses.replace(cfg, fp8="none")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer. Settings read by one optimizer only carry its name (muon_*, shampoo_*) or say so;
    changing one while another optimizer is chosen is refused (`validate`), not silently ignored."""
    name: str = "adamw"               # "adamw" | "sgd" | "muon" | "shampoo" | "soap"
    lr: float = 3e-3
    min_lr_ratio: float = 0.1         # final lr = lr * min_lr_ratio
    schedule: str = "cosine"          # "cosine" (warmup + cosine) | "wsd" (warmup-stable-decay) | "constant"
    warmup_steps: int = 100
    decay_fraction: float = 0.2       # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("*norm*", "*.bias", "tok_embed.*", "pos_embed.*")
    beta1: float = 0.9                # Adam: AdamW, and the Adam part of muon / shampoo (its graft) / soap
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0            # global-norm clipping; 0 disables (the norm is still measured and logged)
    state_dtype: str = "float32"      # "float32" | "bfloat16": dtype of momentum buffers
    momentum: float = 0.9             # sgd only: heavy-ball (or Nesterov) momentum
    nesterov: bool = False            # sgd only
    # Matrix optimizers (muon, shampoo, soap) update the hidden 2-D matrices; every other parameter
    # (embeddings, LM head, norms, biases) goes to AdamW with lr * adam_lr_ratio.
    adam_lr_ratio: float = 1.0
    muon_momentum: float = 0.95       # muon: EMA momentum with Nesterov (Keller Jordan's and torch.optim.Muon's)
    ns_steps: int = 5                 # muon: Newton-Schulz iterations
    muon_scale: str = "spectral"      # muon: "spectral" sqrt(max(1, rows/cols)) | "match_adam" 0.2*sqrt(max(rows, cols))
    ns_dtype: str = "bfloat16"        # muon: dtype of the Newton-Schulz iteration ("float32" for exact parity tests)
    ns_coefficients: str = "jordan"   # muon: "jordan" (3.4445, -4.7750, 2.0315) every step | "polar_express" (per step)
    normuon_beta2: float = 0.0        # muon: NorMuon's per-neuron second moment after Newton-Schulz (0: off; paper 0.95)
    precondition_frequency: int = 10  # shampoo / soap: steps between preconditioner (eigenbasis) refreshes
    shampoo_beta: float = 0.95        # shampoo / soap: EMA of the Kronecker factors (shampoo: 1.0 = AdaGrad sum)
    shampoo_eps: float = 1e-12        # shampoo / soap: added to factors before inverse roots / eigh
    start_preconditioning_step: int = 1    # shampoo: Adam-grafted steps before preconditioning starts
    shampoo_momentum: float = 0.0     # shampoo: momentum on the grafted direction (0: the graft's Adam b1 only)
    shampoo_block_size: int = 1024    # shampoo: longer dimensions are cut into blocks of this size
    shampoo_inv_root: int = 0         # shampoo: roots L^(-1/r); 0 = 2 x rank (-1/4 for a matrix), 2 = -1/2 per side
    # shampoo: what P applies to, "first_moment" (Adam's m_hat, as Distributed Shampoo) | "gradient" (this step's G).
    # The defaults here (first_moment, no momentum after, roots from step 1) won the ablation (README).
    shampoo_precondition: str = "first_moment"
    shampoo_graft: str = "adam"       # shampoo: "adam" (each block at Adam's norm) | "none"
    max_precond_dim: int = 1024       # soap only: a longer dimension keeps the identity (no factor, no basis)
    # shampoo / soap: stored dtype of the Kronecker factors, and of shampoo's inverse roots / soap's eigenbases
    # ("float32" | "bfloat16"; float32 stores them as computed, fp64 for fp64 parameters; the maths stays fp32)
    factor_dtype: str = "float32"
    basis_dtype: str = "float32"

    def validate(self) -> None:
        choices = {"name": ("adamw", "sgd", "muon", "shampoo", "soap"), "state_dtype": ("float32", "bfloat16"),
                   "factor_dtype": ("float32", "bfloat16"), "basis_dtype": ("float32", "bfloat16"),
                   "muon_scale": ("spectral", "match_adam"), "schedule": ("cosine", "wsd", "constant"),
                   "ns_dtype": ("float32", "bfloat16"), "ns_coefficients": ("jordan", "polar_express"),
                   "shampoo_precondition": ("gradient", "first_moment"),
                   "shampoo_graft": ("adam", "none")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"optim.{key}={getattr(self, key)!r} is not one of {allowed}")
        # One setting, one optimizer: a value changed for another optimizer than the chosen one would do
        # nothing, so it is refused, naming the chosen optimizer's own setting where there is one.
        own = {"momentum": {"sgd": "momentum", "muon": "muon_momentum", "shampoo": "shampoo_momentum"},
               "size": {"shampoo": "shampoo_block_size", "soap": "max_precond_dim"}}
        only_for = {"momentum": ("sgd", "momentum"), "nesterov": ("sgd", None), "muon_momentum": ("muon", "momentum"),
                    "shampoo_momentum": ("shampoo", "momentum"), "shampoo_block_size": ("shampoo", "size"),
                    "ns_coefficients": ("muon", None), "normuon_beta2": ("muon", None),
                    "shampoo_inv_root": ("shampoo", None), "shampoo_precondition": ("shampoo", None),
                    "shampoo_graft": ("shampoo", None),
                    "max_precond_dim": ("soap", "size"),
                    "factor_dtype": (("shampoo", "soap"), None), "basis_dtype": (("shampoo", "soap"), None)}
        defaults = OptimConfig()
        for key, (owner, kind) in only_for.items():
            owners = owner if isinstance(owner, tuple) else (owner,)
            if self.name not in owners and getattr(self, key) != getattr(defaults, key):
                instead = own.get(kind, {}).get(self.name)
                raise ValueError(f"optim.{key} is read by {' and '.join(owners)} only, and optim.name={self.name!r}; "
                                 + (f"{self.name}'s own setting is optim.{instead}" if instead else
                                    f"leave optim.{key} at its default ({getattr(defaults, key)})"))


@dataclass(frozen=True)
class ParallelConfig:
    """How the run is laid out on a mesh of world_size = pp * dp_replicate * dp_shard * cp * tp processes
(expert parallel folds onto the data-parallel ranks: parallel/mesh.py).

    train.batch_size stays the global micro-batch: a parallel run sees the same data as the serial one.
    """
    dp_replicate: int = 1             # data parallel with replicated parameters (DDP); with dp_shard: HSDP
    dp_shard: int = 1                 # data parallel with sharded parameters, gradients and state (FSDP / ZeRO-3)
    tp: int = 1                       # tensor parallel (Megatron column/row, vocab-parallel embedding and loss)
    sequence_parallel: bool = False   # tp: residual stream and norms sharded on the sequence between blocks
    # FSDP gathers each unit's parameters (embedding, each block, head) just before it runs; True frees them
    # after its forward and gathers them again for its backward (FSDP2's default), False keeps them until then.
    reshard_after_forward: bool = True
    # FSDP gathers one unit ahead (the next unit in the forward, the one before in the backward) so the
    # gather overlaps compute, at the cost of one more unit gathered at a time (FSDP2's default prefetch)
    prefetch: bool = True
    bucket_mb: float = 25.0           # the step's data-parallel gradient reductions, packed into buckets of this size (MB)
    distributed_optimizer: bool = False   # ZeRO-1: optimizer state sharded over dp_replicate (Megatron's)
    muon_tp: str = "duplicated"       # TP-sharded Muon: "duplicated" (gather, orthogonalize whole) | "distributed"
    ep: int = 1                       # expert parallel: experts split over ep of the ranks that hold different tokens
    pp: int = 1                       # pipeline parallel: the layers split into pp stages (parallel/pipeline.py)
    pp_virtual: int = 1               # stages per pipeline rank (interleaved 1F1B: v; zb_v: 2)
    pp_schedule: str = "1f1b"         # "gpipe" | "1f1b" | "interleaved_1f1b" | "zb_v" (parallel/schedules.py)
    pp_layers: tuple[int, ...] = ()   # blocks per stage, in stage order (sums to n_layers); () = as even as possible
    cp: int = 1                       # context parallel: each sequence split over cp ranks (parallel/context.py)
    cp_method: str = "all_gather"     # "all_gather" (Megatron's default: K/V gathered) | "ring" (K/V passed around)
    backend: str = "auto"             # "auto" (nccl on CUDA, gloo on CPU) | "gloo" | "nccl"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


@dataclass(frozen=True)
class DataConfig:
    path: str = ""                    # "" = built-in corpus (this interpreter's standard library)
    val_fraction: float = 0.02        # share of documents held out for validation
    cache_dir: str = ""               # "" = ~/.cache/nanomega
    val_path: str = ""                # "" = hold out val_fraction of path; else a separate validation source
    align: str = "none"               # "none": sequences cut anywhere | "bos": each starts where a document does
    # How text becomes ids (nanomega/data/tokenizer.py): "bytes" | a tokenizer.json | a folder holding one | "train:<vocab>"
    # (a BPE trained on data.path's text, cached). Left unset, --train.init_from's folder or a prepared
    # data.path brings its own (default_tokenizer), and model.vocab_size follows a tokenizer other than bytes.
    tokenizer: str = "bytes"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32              # sequences per micro-batch
    seq_len: int = 256
    grad_accum: int = 1
    seed: int = 0
    dtype: str = "float32"            # "float32" | "bfloat16" (autocast; parameters stay fp32)
    # Mixed precision for parameters (FSDP2's MixedPrecisionPolicy): the fp32 master (and its shard) stays
    # as it is; each unit (embedding, block, head) casts its parameters to param_dtype where it runs (before
    # FSDP's gather, so the gather moves param_dtype), and gradients are reduced in reduce_dtype.
    param_dtype: str = "float32"      # "float32" | "bfloat16"
    reduce_dtype: str = "float32"     # "float32" | "bfloat16": dtype of the data-parallel gradient reduction
    # Activation recomputation (nanomega/models/recompute.py): "none"; "full" recomputes a block's forward in its
    # backward; "selective" saves the matmul and attention outputs and recomputes the rest.
    activation_checkpointing: str = "none"
    ac_every: int = 1                 # recompute every ac_every-th block (1: every block, 2: every other one)
    # float8 matmuls for the blocks' linear layers and experts (nanomega/models/fp8.py): "none" | "tensorwise" |
    # "rowwise" | "blockwise" | "delayed" (tensorwise, scaled by an amax history carried in the parameters);
    # the embedding, the head, the router and attention stay in the compute dtype
    fp8: str = "none"
    fp8_bf16_layers: int = 0          # the first and the last N blocks stay in the compute dtype (Megatron's)
    fp8_amax_history: int = 16        # delayed scaling: steps of amax history (TransformerEngine's amax_history_len)
    fp8_margin: int = 0               # delayed scaling: scale by the history's amax times 2^margin
    # The head's matmul and the cross-entropy fused, the logits of loss_chunk tokens (per rank) at a time
    # (nanomega/models/loss.py): O(loss_chunk x vocab) memory rather than four [tokens, vocab] tensors, for one
    # more head matmul in the backward; 0 makes the logits of every token at once (the unchunked loss)
    loss_chunk: int = 4096
    compile: bool = True
    # torch.use_deterministic_algorithms(True) and cuBLAS's deterministic workspace: a GPU run that repeats
    # bitwise, at the cost of slower kernels (docs/testing.md, "Bitwise"); a CPU eager run repeats without it
    deterministic: bool = False
    device: str = "auto"              # "auto" | "cpu" | "cuda" | ...
    out_dir: str = "runs/default"
    eval_every: int = 250
    eval_batches: int = 20
    log_every: int = 10
    ckpt_every: int = 500
    keep_checkpoints: int = 2
    ckpt_timeout: float = 300.0       # seconds a rank waits for the others to confirm a parallel save's files
    async_save: bool = False          # write checkpoints in a background thread from a host copy (checkpoint.Saver)
    init_from: str = ""               # a Hugging Face model folder: its architecture and weights (nanomega/hf/transfer.py)
    resume: bool = False
    on_nonfinite: str = "stop"        # "stop" | "skip"
    peak_flops: float = 0.0           # 0 = look up the accelerator, or measure this CPU once
    # Experiment tracking (nanomega/run/tracking.py): "none" | "tensorboard" (<out_dir>/tb) | "wandb". Rank 0 mirrors
    # every metrics.jsonl record there; metrics.jsonl stays the record of the run. Each is an optional extra.
    tracker: str = "none"
    sample_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 40


@dataclass(frozen=True)
class EvalConfig:
    """Downstream evaluation during training (nanomega/eval/evaluate.py), every train.eval_every and at the end."""
    # multiple-choice tasks, JSONL files in HellaSwag's layout (evaluate.read_task); each logged as
    # eval/<file name without extension>/acc and eval/<...>/acc_norm, computed as lm-evaluation-harness does
    tasks: tuple[str, ...] = ()
    batch_size: int = 16              # sequences (a context and one ending) per forward


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate(self) -> None:
        for key, (interval, why) in RANGES.items():
            _check_range(self, key, interval, why)
        self.model.validate()
        t = self.train
        if t.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        for key in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "log_every", "ckpt_every"):
            if getattr(t, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(t, key)}")
        if t.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"train.dtype={t.dtype!r} is not one of ('float32', 'bfloat16')")
        if self.data.align not in ("none", "bos"):
            raise ValueError(f"data.align={self.data.align!r} is not one of ('none', 'bos')")
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(t, key) not in ("float32", "bfloat16"):
                raise ValueError(f"train.{key}={getattr(t, key)!r} is not one of ('float32', 'bfloat16')")
        if t.activation_checkpointing not in ("none", "full", "selective"):
            raise ValueError(f"train.activation_checkpointing={t.activation_checkpointing!r} is not one of "
                             "('none', 'full', 'selective')")
        if t.ac_every < 1:
            raise ValueError(f"train.ac_every must be >= 1 (1 recomputes every block), got {t.ac_every}")
        if t.fp8 not in FP8_RECIPES:
            raise ValueError(f"train.fp8={t.fp8!r} is not one of {FP8_RECIPES}")
        if t.fp8_amax_history < 1 or t.fp8_margin < 0:
            raise ValueError(f"train.fp8_amax_history must be >= 1 and train.fp8_margin >= 0, got "
                             f"{t.fp8_amax_history} and {t.fp8_margin}")
        if self.model.fp8_amax_reduction != "linear":
            raise ValueError("model.fp8_amax_reduction is the train step's to switch (nanomega/train/step.py), not a "
                             "setting; leave it out")
        if t.fp8_bf16_layers < 0 or 2 * t.fp8_bf16_layers > self.model.n_layers:
            raise ValueError(f"train.fp8_bf16_layers={t.fp8_bf16_layers} keeps the first and last N of the "
                             f"{self.model.n_layers} blocks out of fp8; use 0 <= N <= {self.model.n_layers // 2}")
        if not isinstance(t.loss_chunk, int) or t.loss_chunk < 0:
            raise ValueError(f"train.loss_chunk={t.loss_chunk!r} must be a whole number of tokens >= 0 (0: the "
                             "logits of every token at once; e.g. 4096 bounds the loss's memory to 4096 tokens' logits)")
        if self.model.loss_chunk != ModelConfig.loss_chunk and self.model.loss_chunk != t.loss_chunk:
            raise ValueError("model.loss_chunk is set from train.loss_chunk by the run's setup; set "
                             f"--train.loss_chunk={self.model.loss_chunk} instead")
        if t.ckpt_timeout <= 0:
            raise ValueError(f"train.ckpt_timeout must be > 0 seconds, got {t.ckpt_timeout}")
        if t.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={t.on_nonfinite!r} is not one of ('stop', 'skip')")
        if t.tracker not in TRACKERS:
            raise ValueError(f"train.tracker={t.tracker!r} is not one of {TRACKERS}")
        self.optim.validate()
        # The parallel layout's rules (sizes against the model and the process count) are checked by whoever
        # builds the mesh, before any work: nanomega.parallel.mesh.validate_layout.
