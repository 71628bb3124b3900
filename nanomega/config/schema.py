"""Configuration: frozen dataclasses passed down, plus `--section.key=value` overrides.

A run is described by one `Config` made of sections (model, optim, data, train, parallel, eval).
Named configs live in `configs/<name>.py` as a function `config() -> Config`;
`parse_args(argv)` picks one with `--config=NAME` and applies dotted overrides.

One idea, the schema of a run, in one file: every field is declared with its meaning (and its range or choices,
`setting`) and every cross-field rule sits in `validate`, so a reader looks in one place. The command line: cli.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar


FP8_RECIPES = ("none", "tensorwise", "rowwise", "blockwise", "delayed")    # nanomega/models/fp8.py
FSDP_GATHERS = ("per_micro_batch", "per_step")     # parallel.fsdp_gather: nanomega/parallel/fsdp.py
TRACKERS = ("none", "tensorboard", "wandb")    # nanomega/run/tracking.py: where rank 0 mirrors metrics.jsonl
DTYPES = ("float32", "bfloat16")


def setting(default, interval: str = "", why: str = "", choices: tuple = ()):
    """A field with its default, and the interval ("[0, 1)": a decay or momentum; "(0, inf)": positive and finite)
    or the choices it must lie in, and why: the sections' fields here, an optimizer's own settings (optim.registry).
    Each section's validate refuses a value outside them (check_section) before any work."""
    return field(default=default, metadata={"interval": interval, "why": why, "choices": choices})


def check_section(section: str, cfg) -> None:
    """Refuse a field of the section `section` (cfg) outside its choices or its interval (`setting`)."""
    for f in dataclasses.fields(cfg):
        check_setting(f"{section}.{f.name}", getattr(cfg, f.name), f.metadata)


def check_setting(key: str, value, meta) -> None:
    """Refuse the setting `key`'s value outside the choices or the interval ("[0, 1)", "(0, inf)") its metadata
    (`setting`) gives, naming the setting, and why the range where it says."""
    if meta.get("choices") and value not in meta["choices"]:
        raise ValueError(f"{key}={value!r} is not one of {meta['choices']}")
    if not (interval := meta.get("interval")):
        return
    low, high = (float(x) for x in interval[1:-1].split(","))
    ok = math.isfinite(value) and (low <= value if interval[0] == "[" else low < value) and \
        (value <= high if interval[-1] == "]" else value < high)
    if not ok:
        raise ValueError(f"{key}={value} must lie in {interval}" + (f" ({meta['why']})" if meta["why"] else ""))


def profile_steps(spec: str, steps: int) -> tuple[int, int]:
    """train.profile: "4" -> (4, 4), "4:6" -> (4, 6), the first and last step profiled (1-based, inclusive),
    refused unless inside the run's steps 1..train.steps."""
    try:
        first, _, last = spec.partition(":")
        first, last = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"train.profile={spec!r} is not a step or a range of steps; write e.g. 4 (step 4) or 4:6 "
                         "(steps 4 to 6), or '' for no profile") from None
    if not 1 <= first <= last <= steps:
        raise ValueError(f"train.profile={spec!r} asks for steps {first} to {last}, but the run has steps 1 to "
                         f"{steps} (train.steps); choose steps inside them, after the first (which compiles)")
    return first, last


@dataclass(frozen=True)
class ModelConfig:
    """One decoder-only transformer; GPT-2, LLaMA and Qwen differ only in these fields."""
    vocab_size: int = setting(256, "[1, inf)")
    vocab_multiple: int = 64          # the embedding is padded to a multiple of this
    d_model: int = setting(256, "[1, inf)")
    n_layers: int = setting(4, "[1, inf)")
    n_heads: int = setting(8, "[1, inf)")
    n_kv_heads: int = 0               # 0 means n_heads (multi-head); fewer means GQA
    head_dim: int = 0                 # 0 means d_model // n_heads (Qwen3 sets it explicitly)
    ffn_dim: int = 0                  # 0 means the MLP kind's default width (models/mlp.py: gelu 4*d_model)
    max_seq_len: int = setting(256, "[1, inf)")
    norm: str = setting("rmsnorm", choices=("rmsnorm", "layernorm"))
    norm_eps: float = setting(1e-5, "(0, inf)", "it keeps the norm's division finite")
    mlp: str = "swiglu"               # an MLP kind registered in models/mlp.py ("swiglu" | "gelu"); checked there
    position: str = setting("rope", choices=("rope", "learned"))
    rope_theta: float = setting(10000.0, "(0, inf)")
    # rope scaling: a model pretrained on rope_original_max_len positions read further (Hugging Face's
    # rope_scaling / rope_parameters; the maths in models/layers.py rope_frequencies; yarn: Qwen2/3, DeepSeek-V3)
    rope_scaling: str = setting("none", choices=("none", "llama3", "yarn"))  # llama3: Llama 3.1/3.2
    rope_factor: float = 1.0          # how many times longer the context is than the pretraining one
    rope_original_max_len: int = 0    # the pretraining context (original_max_position_embeddings)
    rope_low_freq_factor: float = 1.0   # llama3: wavelengths over original/low_freq_factor are slowed by factor,
    rope_high_freq_factor: float = 4.0  # those under original/high_freq_factor kept, the ones between blended
    rope_beta_fast: float = 32.0      # yarn: dims turning more than beta_fast times in the original context kept,
    rope_beta_slow: float = 1.0       # those turning fewer than beta_slow times slowed by factor, a ramp between
    rope_mscale: float = 0.0          # yarn: cos/sin times mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    rope_mscale_all_dim: float = 0.0  # (both 0: times mscale(factor, 1)); MLA's softmax times mscale(.., all_dim)^2
    rope_attention_factor: float = 0.0  # yarn: the cos/sin factor given outright (0: from the mscales above)
    # packed documents kept apart (data.mask=document sets it from the tokenizer: config.cli.with_document_mask): the
    # token that opens each document; a token attends only to earlier tokens of its own (hints.document_mask)
    document_separator: int = setting(-1, "[-1, inf)", "-1 attends across documents")
    tie_embeddings: bool = False
    bias: bool = False                # biases on every linear and norm (GPT-2)
    qkv_bias: bool = False            # biases on q, k, v only (Qwen2)
    qk_norm: bool = False             # RMSNorm on each head of q and k (Qwen3)
    init_std: float = setting(0.02, "(0, inf)")
    # --- attention variant: "mha" (MHA/GQA/MQA by n_kv_heads) | "mla" (DeepSeek-V2/V3 multi-head latent)
    attention: str = setting("mha", choices=("mha", "mla"))
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
    first_dense_layers: int = setting(0, "[0, inf)")  # DeepSeek: the first layers keep a dense MLP of ffn_dim
    moe_layer_freq: int = setting(1, "[1, inf)")  # layer i >= first_dense_layers is MoE when i % moe_layer_freq is 0
    router_score: str = setting("softmax", choices=("softmax", "sigmoid"))  # sigmoid: DeepSeek-V3
    router_softmax_first: bool = True # softmax over all experts, then top-k; false: top-k logits, then softmax
    router_norm_topk: bool = True     # renormalize the k chosen weights to sum to 1 (Mixtral, Qwen3, DeepSeek-V3)
    router_scale: float = 1.0         # multiplies the chosen weights (DeepSeek-V3's routed_scaling_factor)
    router_groups: int = 1            # group-limited routing: experts split in groups ...
    router_topk_groups: int = 1       # ... and each token picks experts only from its best groups
    aux_loss: str = setting("micro_batch", choices=("micro_batch", "sequence"))  # balancing: GShard/Switch | DeepSeek
    aux_loss_coef: float = setting(0.0, "[0, inf)")  # weight of the load-balancing loss (0 = off)
    z_loss_coef: float = setting(0.0, "[0, inf)")  # weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)
    expert_bias_rate: float = setting(0.0, "[0, inf)")  # aux-loss-free balancing (DeepSeek-V3): bias step size, 0 = off
    capacity_factor: float = setting(0.0, "[0, inf)")  # expert capacity per sequence ceil(cf*T*k/E); 0 = dropless
    # over capacity, keep the highest-weight tokens ("probs") or the first ("position")
    drop_policy: str = setting("probs", choices=("probs", "position"))
    pad_to_capacity: bool = False     # token dropping: every expert gets exactly its capacity (static shapes)
    expert_kernel: str = setting("auto", choices=("auto", "grouped_mm"))  # auto: grouped where it runs, else per expert
    moe_overlap_chunks: int = 1       # ep > 1: the all-to-alls in this many pieces, each hidden behind another's
                                      # experts (parallel/experts.py; docs/moe.md says when more than 1 pays)
    moe_sub_batches: int = 1          # ep > 1: the forward as a wavefront over this many sub-batches of whole
                                      # sequences, every all-to-all behind another's compute (parallel/wavefront.py)
    # float8 matmuls for the blocks' linear layers and experts (nanomega/models/fp8.py; "delayed": tensorwise, scaled
    # by an amax history carried in the parameters); the embedding, the head, the router and attention stay in the
    # compute dtype. The model's own numerics, as Megatron's TransformerConfig holds them: nothing copies them.
    fp8: str = setting("none", choices=FP8_RECIPES)
    fp8_bf16_layers: int = 0          # the first and the last N blocks stay in the compute dtype (Megatron's)
    # delayed scaling: steps of amax history (TransformerEngine's amax_history_len)
    fp8_amax_history: int = setting(16, "[1, inf)")
    fp8_margin: int = setting(0, "[0, inf)")  # delayed scaling: scale by the history's amax times 2^margin
    # The head's matmul and the cross-entropy fused, the logits of loss_chunk tokens (per rank) at a time
    # (nanomega/models/loss.py): O(loss_chunk x vocab) memory rather than four [tokens, vocab] tensors, for one
    # more head matmul in the backward; 0 makes the logits of every token at once (the unchunked loss)
    loss_chunk: int = 4096
    # delayed scaling's amaxes on a mesh: "linear" reduces each as it is taken; "step" keeps each rank's own until
    # the step's one reduction at its end (parallel/fp8.py). Not a field, so no setting: the train step runs the
    # model as an AmaxesAtStepEnd config (below) once the histories hold a step; the model never reads global state
    fp8_amax_reduction: ClassVar[str] = "linear"

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
        check_section("model", self)
        if self.attention == "mla":
            for key in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
                if getattr(self, key) < 1:
                    raise ValueError(f"model.attention='mla' needs model.{key} >= 1, got {getattr(self, key)}")
            if self.qk_rope_dim % 2:
                raise ValueError(f"RoPE needs an even model.qk_rope_dim, got {self.qk_rope_dim}")
        if self.n_experts:
            self._validate_moe()
        if self.fp8_bf16_layers < 0 or 2 * self.fp8_bf16_layers > self.n_layers:
            raise ValueError(f"model.fp8_bf16_layers={self.fp8_bf16_layers} keeps the first and last N of the "
                             f"{self.n_layers} blocks out of fp8; use 0 <= N <= {self.n_layers // 2}")
        if not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ValueError(f"model.loss_chunk={self.loss_chunk!r} must be a whole number of tokens >= 0 (0: the "
                             "logits of every token at once; e.g. 4096 bounds the loss's memory to 4096 tokens' logits)")
        if self.document_separator >= self.vocab_size:
            raise ValueError(f"model.document_separator={self.document_separator} is no id of the vocabulary of "
                             f"{self.vocab_size}; --data.mask=document sets it from the tokenizer")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"model.n_kv_heads={self.kv_heads} must divide model.n_heads={self.n_heads}")
        if not self.head_dim and self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} must divide model.d_model={self.d_model}, "
                             "or set model.head_dim explicitly")
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
        if self.pad_to_capacity and not self.capacity_factor:
            raise ValueError("model.pad_to_capacity=true needs a model.capacity_factor > 0 (dropless has no capacity)")
        if not isinstance(self.moe_overlap_chunks, int) or self.moe_overlap_chunks < 1:
            raise ValueError(f"model.moe_overlap_chunks={self.moe_overlap_chunks!r} must be a whole number >= 1 "
                             "(1: each all-to-all whole, waited for at once)")
        if self.router_score == "softmax" and not self.router_softmax_first and not self.router_norm_topk:
            raise ValueError("model.router_softmax_first=false already normalizes the k weights; "
                             "set model.router_norm_topk=true")


@dataclass(frozen=True)
class AmaxesAtStepEnd(ModelConfig):
    """The model config as the train step runs it once delayed scaling's histories hold a step: each rank keeps
    its amaxes until the step's one reduction (ModelConfig.fp8_amax_reduction; nanomega/train/step.py)."""
    fp8_amax_reduction: ClassVar[str] = "step"


@functools.cache
def _without_fp8(cfg: ModelConfig) -> ModelConfig:   # one object per config: torch.compile guards on it
    return dataclasses.replace(cfg, fp8="none")


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer: the settings every optimizer shares, and `settings`, the chosen optimizer's own.

    An optimizer's own settings (Muon's muon_momentum, Shampoo's precondition_frequency, Adam's beta1...)
    and their defaults are declared in its file under nanomega/optim/ (optim.registry), not here: config
    sits below optim and names no optimizer. `--optim.KEY=VALUE` with a KEY that is no field below, or
    `OptimConfig(name="muon", muon_momentum=0.9)` in Python, lands in `settings` as given; optim.check
    (optim.build, and parallel.mesh.validate_layout at the start of train.py's preflight and of the
    simulator) types it against the optimizer's own and refuses an unknown name or a setting it does not
    read. `--optim.NAME.KEY=VALUE` addresses optimizer NAME only (read when NAME is chosen, checked always):
    one config for several optimizers (tests/parity.py)."""
    name: str = "adamw"               # a registered optimizer: nanomega.optim.REGISTRY (docs/optimizers.md)
    lr: float = setting(3e-3, "(0, inf)", "the peak learning rate")
    min_lr_ratio: float = setting(0.1, "[0, 1]", "the final lr as a fraction of the peak")
    schedule: str = setting("cosine", choices=("cosine", "wsd", "constant"))  # each warms up; wsd: warmup-stable-decay
    warmup_steps: int = setting(100, "[0, inf)")
    decay_fraction: float = setting(0.2, "(0, 1]", "wsd decays linearly over this last share of the steps")
    weight_decay: float = setting(0.1, "[0, inf)", "a negative decay grows the weights")
    no_decay: tuple[str, ...] = ("*norm*", "*.bias", "tok_embed.*", "pos_embed.*")
    grad_clip: float = setting(1.0, "[0, inf)", "0 disables clipping")  # global-norm clipping; its norm always logged
    state_dtype: str = setting("float32", choices=DTYPES)  # dtype of momentum buffers
    settings: tuple[tuple[str, object], ...] = ()     # the optimizer's own, as given: ((key, value), ...) by key

    def __post_init__(self):
        # one spelling of the same settings (sorted pairs), whatever made them: kwargs, replace, JSON's lists
        object.__setattr__(self, "settings", tuple(sorted((str(k), v) for k, v in dict(self.settings).items())))

    def validate(self) -> None:
        check_section("optim", self)


def _optim_config_init(self, *args, settings=(), **kwargs):
    """OptimConfig(name="muon", muon_momentum=0.9): keyword arguments that are no field join `settings`
    (dataclasses.replace passes them the same way)."""
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    own = {k: kwargs.pop(k) for k in [k for k in kwargs if k not in fields]}
    _dataclass_init(self, *args, settings=tuple({**dict(settings), **own}.items()), **kwargs)


_dataclass_init, OptimConfig.__init__ = OptimConfig.__init__, _optim_config_init


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
    # "per_micro_batch": FSDP gathers and reduce-scatters each unit for every micro-batch (FSDP2's default);
    # "per_step": once per step, the gathered parameters and their unsharded gradients kept from the step's first
    # micro-batch to its last backward (torchtitan under a pipeline; parallel/fsdp.py OncePerStep), which moots
    # reshard_after_forward. The planner picks it by parallel.fsdp.gather_once_default.
    fsdp_gather: str = setting("per_micro_batch", choices=FSDP_GATHERS)
    bucket_mb: float = setting(25.0, "(0, inf)")  # data-parallel gradient reductions in buckets of this many MB
    distributed_optimizer: bool = False   # ZeRO-1: optimizer state sharded over dp_replicate (Megatron's)
    muon_tp: str = "duplicated"       # TP-sharded Muon: "duplicated" (gather, orthogonalize whole) | "distributed"
    ep: int = 1                       # expert parallel: experts split over ep of the ranks that hold different tokens
    pp: int = 1                       # pipeline parallel: the layers split into pp stages (parallel/pipeline.py)
    pp_virtual: int = 1               # stages per pipeline rank (interleaved 1F1B: v; zb_v: 2)
    pp_schedule: str = "1f1b"         # "gpipe" | "1f1b" | "interleaved_1f1b" | "zb_v" (parallel/schedules.py)
    pp_layers: tuple[int, ...] = ()   # blocks per stage, in stage order (sums to n_layers); () = as even as possible
    cp: int = 1                       # context parallel: each sequence split over cp ranks (parallel/context.py)
    cp_method: str = "all_gather"     # "all_gather" (Megatron's default: K/V gathered) | "ring" (K/V passed around)

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
    align: str = setting("none", choices=("none", "bos"))  # none: cut anywhere; bos: each starts where a document does
    # what a token attends to in a sequence packed with several documents: "causal" (every earlier token, as
    # GPT-2 and Llama 3's pretraining) or "document" (earlier tokens of its own document only: Megatron's
    # --reset-attention-mask, torchtitan's document masking); documents open at the tokenizer's separator
    mask: str = setting("causal", choices=("causal", "document"))
    # How text becomes ids (nanomega/data/tokenizer.py): "bytes" | a tokenizer.json | a folder holding one | "train:<vocab>"
    # (a BPE trained on data.path's text, cached). Left unset, --train.init_from's folder or a prepared
    # data.path brings its own (default_tokenizer), and model.vocab_size follows a tokenizer other than bytes.
    tokenizer: str = "bytes"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(1000, "[1, inf)")
    batch_size: int = setting(32, "[1, inf)")  # sequences per micro-batch
    seq_len: int = setting(256, "[1, inf)")
    grad_accum: int = setting(1, "[1, inf)")
    seed: int = 0
    dtype: str = setting("float32", choices=DTYPES)   # bfloat16: autocast; parameters stay fp32
    # Mixed precision for parameters (FSDP2's MixedPrecisionPolicy): the fp32 master (and its shard) stays
    # as it is; each unit (embedding, block, head) casts its parameters to param_dtype where it runs (before
    # FSDP's gather, so the gather moves param_dtype), and gradients are reduced in reduce_dtype.
    param_dtype: str = setting("float32", choices=DTYPES)
    reduce_dtype: str = setting("float32", choices=DTYPES)  # dtype of the data-parallel gradient reduction
    # Activation recomputation (nanomega/models/recompute.py): "none"; "full" recomputes a block's forward in its
    # backward; "selective" saves the matmul and attention outputs and recomputes the rest.
    activation_checkpointing: str = setting("none", choices=("none", "full", "selective"))
    ac_every: int = setting(1, "[1, inf)", "1 recomputes every block")  # recompute every ac_every-th block
    compile: bool = True
    # torch.use_deterministic_algorithms(True) and cuBLAS's deterministic workspace: a GPU run that repeats
    # bitwise, at the cost of slower kernels (docs/testing.md, "Bitwise"); a CPU eager run repeats without it
    deterministic: bool = False
    device: str = "auto"              # "auto" | "cpu" | "cuda" | ...
    out_dir: str = "runs/default"
    eval_every: int = setting(250, "[1, inf)")
    eval_batches: int = setting(20, "[1, inf)")
    log_every: int = setting(10, "[1, inf)")
    ckpt_every: int = setting(500, "[1, inf)")
    keep_checkpoints: int = setting(2, "[1, inf)", "how many of the newest checkpoints to keep")
    ckpt_timeout: float = setting(300.0, "(0, inf)", "seconds a rank waits for the others to confirm a save")
    async_save: bool = False          # write checkpoints in a background thread from a host copy (checkpoint.Saver)
    init_from: str = ""               # a Hugging Face model folder: its architecture and weights (nanomega/hf/transfer.py)
    resume: bool = False
    on_nonfinite: str = setting("stop", choices=("stop", "skip"))
    peak_flops: float = setting(0.0, "[0, inf)", "0 looks it up, or measures this CPU once")
    # Experiment tracking (TRACKERS; "tensorboard" writes <out_dir>/tb), each an optional extra: rank 0 mirrors
    # every metrics.jsonl record there; metrics.jsonl stays the record of the run.
    tracker: str = setting("none", choices=TRACKERS)
    # a torch.profiler trace of these steps on every rank, under <out_dir>/profile (nanomega/run/profile.py):
    # "4" or "4:6" (steps as the log numbers them, inclusive); "" (the default) profiles nothing, at no cost
    profile: str = setting("", why="profile_steps: a step or first:last inside [1, train.steps]")
    sample_tokens: int = setting(200, "[0, inf)")
    # the end-of-run sample's prompt; "": "def " for bytes on the built-in corpus, else the start of a validation
    # document (eval/generate.default_prompt). The sample stops at the tokenizer's EOS / end-of-turn ids.
    sample_prompt: str = ""
    temperature: float = setting(0.8, "[0, inf)", "0 samples greedily")
    top_k: int = setting(40, "[0, inf)", "0 keeps every token")


@dataclass(frozen=True)
class EvalConfig:
    """Downstream evaluation during training (nanomega/eval/evaluate.py), every train.eval_every and at the end."""
    # multiple-choice tasks, JSONL files in HellaSwag's layout (evaluate.read_task); each logged as
    # eval/<file name without extension>/acc and eval/<...>/acc_norm, computed as lm-evaluation-harness does
    tasks: tuple[str, ...] = ()
    batch_size: int = setting(16, "[1, inf)")  # sequences (a context and one ending) per forward


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def validate_sub_batches(self) -> None:
        """model.moe_sub_batches > 1 (parallel/wavefront.py): what the wavefront runs, or what to change."""
        S, p, t = self.model.moe_sub_batches, self.parallel, self.train
        name = f"model.moe_sub_batches={S}"
        if not isinstance(S, int) or S < 1:
            raise ValueError(f"{name!r} must be a whole number >= 1 (1: the plain forward)")
        if p.ep == 1:
            raise ValueError(f"{name} hides the experts' all-to-alls, which only parallel.ep > 1 has; set it to 1 "
                             "or choose an ep")
        unsupported = {"parallel.pp > 1": p.pp > 1,
                       "parallel.reshard_after_forward under FSDP (the parameters a unit's phases share stay "
                       "gathered; set it to false)": p.dp_shard > 1 and p.reshard_after_forward,
                       "train.activation_checkpointing": t.activation_checkpointing != "none",
                       "train.compile": t.compile, "model.pad_to_capacity": self.model.pad_to_capacity,
                       "model.moe_overlap_chunks > 1": self.model.moe_overlap_chunks > 1}
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"{name} runs the forward as a wavefront of sub-batches, which does not support "
                                 f"{what}; set model.moe_sub_batches=1 or turn that off")
        local = t.batch_size // p.dp
        if t.batch_size % p.dp or local % S:
            raise ValueError(f"{name} splits each rank's {local} sequences (train.batch_size={t.batch_size} over "
                             f"parallel.dp_replicate * dp_shard = {p.dp}) into {S} sub-batches of whole sequences; "
                             f"choose a divisor of {local}")

    def validate(self) -> None:
        self.model.validate()
        if self.model.moe_overlap_chunks > 1 and self.parallel.ep == 1:
            raise ValueError(f"model.moe_overlap_chunks={self.model.moe_overlap_chunks} splits the experts' "
                             "all-to-all, which only parallel.ep > 1 has; set it to 1 or choose an ep")
        if self.model.moe_sub_batches != 1:
            self.validate_sub_batches()
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}")
        for section in ("data", "train", "parallel", "eval"):
            check_section(section, getattr(self, section))
        if self.train.profile:
            profile_steps(self.train.profile, self.train.steps)
        self.optim.validate()
        if self.parallel.fsdp_gather == "per_step" and self.parallel.dp_shard == 1:
            raise ValueError("parallel.fsdp_gather='per_step' gathers FSDP's shards once per step, and there are "
                             "none: set parallel.dp_shard > 1, or leave fsdp_gather='per_micro_batch'")
        # The parallel layout's rules (sizes against the model and the process count) are checked by whoever
        # builds the mesh, before any work: nanomega.parallel.mesh.validate_layout.
