"""One decoder-only transformer as pure functions over a nested dict of tensors.

    params = init(cfg, seed)                  # {"tok_embed": {"weight": ...}, "layers": [...], ...}
    logits = forward(params, tokens, cfg)     # [B, T, padded_vocab]
    loss   = loss_fn(params, tokens, targets, cfg)
    logits, cache = forward_cached(params, tokens, cfg, cache, position)   # generation (init_cache)

GPT-2, LLaMA and Qwen2/Qwen3 are the same code with different `ModelConfig` fields.
Parameter names (dotted paths of the tree) follow one scheme used everywhere:

    tok_embed.weight          [V, d]      pos_embed.weight [T, d] (learned positions only)
    layers.{i}.attn_norm.weight (.bias)   layers.{i}.mlp_norm.weight (.bias)
    layers.{i}.attn.{wq,wk,wv,wo}.weight (.bias)   layers.{i}.attn.{q,k}_norm.weight (QK-norm)
    layers.{i}.mlp.{w_gate,w_up,w_down}.weight (.bias)    (the matrices of model.mlp's kind: models/mlp.py)
    layers.{i}.moe.{router,experts,shared,shared_gate}...   (MoE layers instead of mlp: models/moe.py)
    layers.{i}.attn.{wq | wq_a,q_a_norm,wq_b},{wkv_a,kv_a_norm,wkv_b,wo}.weight   (latent attention: models/mla.py)
    final_norm.weight (.bias)  lm_head.weight [V, d] (untied only)

Init (GPT-2 / Megatron): weights ~ N(0, init_std); the two residual projections of each
block (attn.wo, mlp.w_down) use init_std / sqrt(2 * n_layers) so the residual stream's
variance does not grow with depth; biases 0, norm gains 1. Vocabulary padding rows are 0 and
stay 0 (their logits are -inf, so they get no gradient): padding the vocabulary further, as
tensor parallel does, changes no number. The normal numbers come in tiles, each from its own
generator (models/init_streams.py), so a rank draws only its shard and gets the serial numbers.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from nanomega.config import ModelConfig
from nanomega.hints import constrain, document_mask, expert_parallel, sequence_order, vocab_parallel
from nanomega.models import mla, moe
from nanomega.models.init_streams import Tiles
from nanomega.models.layers import Positions, attention, norm, rope_tables
from nanomega.models.loss import autocast_dtype, linear_cross_entropy
from nanomega.models.mlp import SWIGLU, MLPKind, expert_dim, hidden_dim, kind_of, mlp

# leaf kinds for init
NORMAL, RESIDUAL, ZEROS, ONES, VOCAB = "normal", "residual", "zeros", "ones", "vocab"


def _linear(out_dim: int, in_dim: int, bias: bool, kind: str = NORMAL) -> dict:
    p = {"weight": ((out_dim, in_dim), kind)}
    if bias:
        p["bias"] = ((out_dim,), ZEROS)
    return p


def _norm(dim: int, cfg: ModelConfig) -> dict:
    p = {"weight": ((dim,), ONES)}
    if cfg.norm == "layernorm":
        p["bias"] = ((dim,), ZEROS)
    return p


def _mlp(kind: MLPKind, d: int, f: int, bias: bool = False) -> dict:
    """An MLP kind's matrices (models/mlp.py): column ones [f, d], row ones [d, f] (residual projections)."""
    return {**{m: _linear(f, d, bias) for m in kind.column}, **{m: _linear(d, f, bias, RESIDUAL) for m in kind.row}}


def _moe_specs(cfg: ModelConfig) -> dict:
    d, E, f = cfg.d_model, cfg.n_experts, expert_dim(cfg)
    router = {"weight": ((E, d), NORMAL)}
    if cfg.expert_bias_rate:
        router["expert_bias"] = ((E,), ZEROS)
    p = {"router": router,
         "experts": {"w_gate": ((E, f, d), NORMAL), "w_up": ((E, f, d), NORMAL), "w_down": ((E, d, f), RESIDUAL)}}
    if cfg.shared_ffn_dim:
        p["shared"] = _mlp(SWIGLU, d, cfg.shared_ffn_dim)
        if cfg.shared_gate:
            p["shared_gate"] = {"weight": ((1, d), NORMAL)}
    return p


def _with_amax_history(spec: dict, length: int) -> dict:
    """Delayed fp8 scaling's state next to every float8 linear's weight (models/fp8.py): "fp8_history"
    [3, length], the amaxes of its input, weight and output gradient over the last steps. A parameter
    leaf, so checkpoints and layouts carry it; no gradient reaches the optimizer (step.py)."""
    if "weight" in spec and len(spec["weight"][0]) == 2:
        return {**spec, "fp8_history": ((3, length), ZEROS)}
    return {k: v if k in ("router", "shared_gate") or not isinstance(v, dict) else _with_amax_history(v, length)
            for k, v in spec.items()}


def param_specs(cfg: ModelConfig) -> dict:
    """The parameter tree with (shape, init kind) leaves: the single source of the layout. Refuses an MLP kind
    models/mlp.py has not registered (kind_of), before anything else."""
    ffn = _mlp(kind_of(cfg), cfg.d_model, hidden_dim(cfg), cfg.bias)
    d, hd, V = cfg.d_model, cfg.dim_head, cfg.padded_vocab
    qkv_bias = cfg.bias or cfg.qkv_bias
    attn = mla.param_specs(cfg, _linear, RESIDUAL) if cfg.attention == "mla" else {
        "wq": _linear(cfg.n_heads * hd, d, qkv_bias),
        "wk": _linear(cfg.kv_heads * hd, d, qkv_bias),
        "wv": _linear(cfg.kv_heads * hd, d, qkv_bias),
        "wo": _linear(d, cfg.n_heads * hd, cfg.bias, RESIDUAL),
    }
    if cfg.qk_norm and cfg.attention == "mha":
        attn["q_norm"] = {"weight": ((hd,), ONES)}
        attn["k_norm"] = {"weight": ((hd,), ONES)}

    def layer(i: int) -> dict:
        feed_forward = {"moe": _moe_specs(cfg)} if cfg.is_moe_layer(i) else {"mlp": ffn}
        spec = {"attn_norm": _norm(d, cfg), "attn": attn, "mlp_norm": _norm(d, cfg), **feed_forward}
        return _with_amax_history(spec, cfg.fp8_amax_history) if cfg.block_config(i).fp8 == "delayed" else spec

    specs = {"tok_embed": {"weight": ((V, d), VOCAB)}}
    if cfg.position == "learned":
        specs["pos_embed"] = {"weight": ((cfg.max_seq_len, d), NORMAL)}
    specs["layers"] = [layer(i) for i in range(cfg.n_layers)]
    specs["final_norm"] = _norm(d, cfg)
    if not cfg.tie_embeddings:
        specs["lm_head"] = {"weight": ((V, d), VOCAB)}
    return specs


def named_specs(specs, name: str = "") -> dict:
    """{dotted name: (shape, init kind)} of param_specs' tree, in the order init and the tree list them."""
    if isinstance(specs, dict):
        items = specs.items()
    elif isinstance(specs, list):
        items = enumerate(specs)
    else:
        return {name: specs}
    return {n: spec for k, v in items for n, spec in named_specs(v, f"{name}.{k}" if name else str(k)).items()}


def init(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu", place=None, random: bool = True) -> dict:
    """Fresh parameters (fp32 leaves that require grad). device="meta" allocates nothing.

    place(name, part) -> leaf, if given, is called for each leaf instead of drawing it whole: part(index)
    draws the slices `index` of it (one per dim, as parallel.plan.shard_index gives; None: the whole) on
    the CPU, and place returns what to keep, e.g. a rank's shard, drawn alone: the numbers are the serial
    init's, bitwise, whichever parts are drawn (models/init_streams.py). random=False leaves the random
    weights zero, for a caller that overwrites them (--train.init_from)."""
    cfg.validate()
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    specs = param_specs(cfg)
    # a vocabulary leaf's random numbers cover its real rows only, so padding it further changes none of them
    random_shapes = {name: (cfg.vocab_size, shape[1]) if kind == VOCAB else shape
                     for name, (shape, kind) in named_specs(specs).items() if kind in (NORMAL, RESIDUAL, VOCAB)}
    tiles = Tiles.number(seed, random_shapes)

    def part(name: str, shape, kind: str, index=None) -> torch.Tensor:
        index = tuple(slice(None) for _ in shape) if index is None else tuple(index)
        local = [len(range(*s.indices(n))) for s, n in zip(index, shape)]
        if torch.device(device).type == "meta":
            return torch.empty(local, device="meta")
        if kind == ONES:
            return torch.ones(local)
        if kind == ZEROS or not random:
            return torch.zeros(local)
        if kind == VOCAB:   # real rows drawn, padding rows 0
            start, stop, _ = index[0].indices(shape[0])
            real = slice(min(start, cfg.vocab_size), min(stop, cfg.vocab_size))
            drawn = tiles.draw(name, random_shapes[name], (real, *index[1:]))
            return F.pad(drawn.mul_(cfg.init_std), (0, 0, 0, local[0] - drawn.shape[0]))
        return tiles.draw(name, shape, index).mul_(residual_std if kind == RESIDUAL else cfg.init_std)

    def build(node, name=""):
        if isinstance(node, dict):
            return {k: build(v, f"{name}.{k}" if name else k) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v, f"{name}.{i}") for i, v in enumerate(node)]
        draw = functools.partial(part, name, *node)
        if place is None:
            return draw().to(device).requires_grad_(True)
        return place(name, draw)

    return build(specs)


# ---------------------------------------------------------------- the three kinds of unit

def embed(p: dict, tokens: torch.Tensor, cfg: ModelConfig, position: int = 0) -> torch.Tensor:
    """p = {"tok_embed", ("pos_embed")}: tokens [B, T] at positions position.. -> the residual stream [B, T, d]."""
    x = constrain(F.embedding(constrain(tokens, tokens, whole_sequence=True), p["tok_embed"]["weight"]), tokens)
    if cfg.position == "learned":   # rows in the tokens' order
        x = x + sequence_order(p["pos_embed"]["weight"][position:position + tokens.shape[1]], tokens)
    # the residual stream in the compute dtype, like the matmuls' outputs added to it (Megatron's
    # default; an fp32 stream would make every sequence-parallel gather move fp32)
    dtype = autocast_dtype(x.device.type)
    return x if dtype is None else x.to(dtype)


def moe_mlp(p: dict, h: torch.Tensor, tokens: torch.Tensor, cfg: ModelConfig):
    """An MoE block's MLP: the routed experts through the sharding hint `expert_parallel` (moe.routed_moe itself on
    plain tensors; on a mesh, on this rank's tokens and experts, with the all-to-all and the statistics' reductions:
    parallel/experts.py), the shared expert handed in to run while the routed experts' first all-to-all is in
    flight (moe.routed). A function of its own: the closure would make block's locals cell variables, and a
    compiled dense block then failed AOTAutograd's tangent check ("Expected a DTensor tangent but got a plain
    Tensor") under cp x tp with sequence parallel."""
    shared = []

    def shared_expert():
        shared.append(constrain(moe.shared_expert(p, constrain(h, tokens, whole_sequence=True), cfg), tokens))
    routed = functools.partial(moe.routed_moe, beside=shared_expert if "shared" in p else None)
    y, stats = expert_parallel(routed, {"router": p["router"], "experts": p["experts"]}, h, cfg)
    return (y + shared[0] if shared else y), stats


def positions(tokens: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype) -> Positions:
    """Where the tokens [B, T] sit, for every block's attention: RoPE's tables in the tokens' order (learned
    positions: None), and with model.document_separator the mask that keeps each packed document to itself
    (hints.document_mask: made once per forward in attention's dtype, the residual stream's, shared by the
    layers). Positions do not restart at a document, Llama 3's choice: RoPE's scores depend on the distance between
    two tokens only, so a document's numbers are the same wherever it sits in the row (learned positions do see
    where it sits)."""
    rope = None if cfg.position == "learned" else sequence_order(rope_tables(cfg, tokens.shape[1], tokens.device),
                                                                  tokens)
    documents = None if cfg.document_separator < 0 else document_mask(tokens, cfg.document_separator, dtype)
    return Positions(rope, documents)


def block(layer: dict, x: torch.Tensor, tokens: torch.Tensor, at: Positions, cfg: ModelConfig,
          cache: dict | None = None, position: int = 0):
    """One transformer block on the residual stream: (x, MoEStats or None for a dense block). at: `positions`'
    of the tokens. cache: the block's part of init_cache's (generation), x then holding positions position.."""
    attend = mla.attention if cfg.attention == "mla" else attention
    h = constrain(norm(layer["attn_norm"], x, cfg), tokens, whole_sequence=True)
    x = x + constrain(attend(layer["attn"], h, at, cfg, cache, position), tokens)
    if "moe" in layer:   # each rank routes its own tokens: no sequence gather before the router
        y, stats = moe_mlp(layer["moe"], constrain(norm(layer["mlp_norm"], x, cfg), tokens), tokens, cfg)
        return x + y, stats
    h = constrain(norm(layer["mlp_norm"], x, cfg), tokens, whole_sequence=True)
    return x + constrain(mlp(layer["mlp"], h, cfg), tokens), None


def head(p: dict, x: torch.Tensor, tokens: torch.Tensor, cfg: ModelConfig, targets: torch.Tensor | None = None):
    """p = {"final_norm", "lm_head" (or "tok_embed", tied)}: the residual stream -> logits [B, T, V], or given
    targets [B, T], the head and the loss as one unit: the mean cross-entropy, cfg.loss_chunk tokens' logits at a
    time (models/loss.py: the matmul fused with the loss, O(chunk x vocab) memory, vocab-parallel on a mesh). With
    loss_chunk=0 run_units asks for the logits and the loss takes them whole (`cross_entropy`), after the unit has
    let its gathered weights go."""
    x = constrain(norm(p["final_norm"], x, cfg), tokens, whole_sequence=True)
    w = p["tok_embed" if cfg.tie_embeddings else "lm_head"]["weight"]
    if targets is None:
        return F.linear(x, w)
    return vocab_parallel(linear_cross_entropy, x, w, targets, cfg.vocab_size, cfg.loss_chunk) / targets.numel()


def call(name: str, fn, p: dict, *args):
    """The plain way to run a unit: fn(p, *args). `name` is the dotted name of p's root ("" where p's
    keys are top-level names, "layers.3" for a block), so a runner can name every leaf of p."""
    return fn(p, *args)


def units(params: dict, cfg: ModelConfig) -> list[tuple[str, dict]]:
    """(name, parameters) of every unit in the order the forward runs them: embedding, blocks, head.
    A pipeline stage's tree holds some of them (parallel/pipeline.py): no embedding or head key, and its
    blocks as {"<index>": block}, so every leaf keeps its name."""
    first = {k: params[k] for k in ("tok_embed", "pos_embed") if params.get(k) is not None}
    last = {k: params[k] for k in ("final_norm", "tok_embed" if cfg.tie_embeddings else "lm_head")
            if params.get(k) is not None}
    blocks = params.get("layers", [])   # a stage's: {"<index>": block} of the blocks it holds
    blocks = blocks.items() if isinstance(blocks, dict) else enumerate(blocks)
    layers = [(f"layers.{i}", layer) for i, layer in blocks]
    return [("", first)] * bool(first) + layers + [("", last)] * ("final_norm" in last)


def run_units(params: dict, x, tokens: torch.Tensor, cfg: ModelConfig, run=call, targets=None):
    """The units `params` holds, in order, on x (None: the tree starts with the embedding, which reads
    `tokens`): (logits if it ends with the head, or given targets and a cfg.loss_chunk the mean cross-entropy
    (head), else the residual stream [B, T, d]; [MoEStats])."""
    at, stats = None, []
    for name, p in units(params, cfg):
        if "tok_embed" in p and x is None:
            x = run(name, embed, p, tokens, cfg)
        elif "final_norm" in p:
            x = run(name, head, p, x, tokens, cfg, targets if cfg.loss_chunk else None)
        else:
            at = positions(tokens, cfg, x.dtype) if at is None else at     # made once, by the first block
            x, layer_stats = run(name, block, p, x, tokens, at, cfg.block_config(int(name.split(".")[1])))
            stats += [] if layer_stats is None else [layer_stats]
    return x, stats


def forward(params: dict, tokens: torch.Tensor, cfg: ModelConfig, run=call) -> torch.Tensor:
    """tokens [B, T] int64 -> logits [B, T, padded_vocab] (padding columns are never targets).

    The forward is a sequence of units (`units`: embedding, blocks, head), each a pure function of its
    own parameters, and each called as run(name, fn, its parameters, *args). The plain `call` runs it;
    the train step passes a runner that also recomputes activations (nanomega/models/recompute.py), casts the
    parameters to train.param_dtype, or, on a mesh, gathers a unit's sharded parameters just before it
    runs (FSDP per unit: nanomega/parallel/fsdp.py). `constrain` calls are sharding hints
    (nanomega/hints.py): identity on plain tensors; on a mesh they keep the residual stream laid out
    like the tokens and gather the sequence where a tensor-parallel matmul needs it."""
    return run_units(params, None, tokens, cfg, run)[0]


# ---------------------------------------------------------------- generation with a KV cache

def init_cache(cfg: ModelConfig, batch: int, max_len: int, device="cpu", dtype=torch.float32) -> dict:
    """An empty KV cache for forward_cached: a pytree of zero buffers for `batch` sequences of up to
    max_len (<= max_seq_len) positions, and the rope tables, made once rather than every token.

        {"rope": (cos, sin) [max_len, rotary/2] or None (learned positions),
         "layers": [{"k", "v"}: [B, kv_heads, max_len, dim_head]              (MHA / GQA / MQA)
                    or {"kv"}: [B, 1, max_len, kv_lora_rank + qk_rope_dim]]}  (MLA: the latent and rope key)

    Per token and layer: 2 * kv_heads * dim_head numbers, or kv_lora_rank + qk_rope_dim for MLA."""
    if max_len > cfg.max_seq_len:
        raise ValueError(f"a cache of {max_len} positions is longer than model.max_seq_len={cfg.max_seq_len}: "
                         f"the model has no positions past it; ask for at most {cfg.max_seq_len}")
    zeros = functools.partial(torch.zeros, device=device, dtype=dtype)
    if cfg.attention == "mla":
        layer = lambda: {"kv": zeros(batch, 1, max_len, cfg.kv_lora_rank + cfg.qk_rope_dim)}
    else:
        layer = lambda: {"k": zeros(batch, cfg.kv_heads, max_len, cfg.dim_head),
                         "v": zeros(batch, cfg.kv_heads, max_len, cfg.dim_head)}
    rope = None if cfg.position == "learned" else rope_tables(cfg, max_len, device)
    return {"rope": rope, "layers": [layer() for _ in range(cfg.n_layers)]}


def forward_cached(params: dict, tokens: torch.Tensor, cfg: ModelConfig, cache: dict, position: int,
                   last_only: bool = False) -> tuple[torch.Tensor, dict]:
    """tokens [B, T] at positions position..position+T-1, the cache holding positions 0..position-1 ->
    (logits [B, T, padded_vocab] (only the last position's, [B, 1, V], if last_only), the cache holding
    0..position+T-1). A prompt goes in one call (position 0), then one token per call.

    The same blocks as forward, each attending to the cached keys and values too; the logits equal
    forward's on the whole sequence up to fp32 rounding. The cache's buffers are written in place at
    positions position.. (models/layers.py's `cached`), like a donated buffer: the cache returned is
    the one passed in, and the positions before `position` are never touched, so a caller may restart
    from any earlier position. No MoE statistics (nothing trains here)."""
    end, size = position + tokens.shape[1], next(iter(cache["layers"][0].values())).shape[2]
    if end > size:
        raise ValueError(f"positions up to {end} do not fit a cache of {size}; make a longer one (init_cache)")
    # no document mask: a prompt is one document (a separator in it is read as text is)
    at = Positions(None if cache["rope"] is None else tuple(t[position:end] for t in cache["rope"]))
    x = embed(params, tokens, cfg, position)
    for i, (layer, layer_cache) in enumerate(zip(params["layers"], cache["layers"])):
        x, _ = block(layer, x, tokens, at, cfg.block_config(i), layer_cache, position)
    return head(params, x[:, -1:] if last_only else x, tokens, cfg), cache


def loss_and_stats(params: dict, tokens: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig, run=call):
    """(training objective, stats): cross-entropy plus, for MoE models, aux_loss_coef times the sum
    of the layers' balancing losses and z_loss_coef times the sum of their z-losses (Megatron adds
    each layer's). stats (detached) holds "ce", and for MoE the per-layer means "aux_loss", "z_loss",
    "expert_load" [moe layers, E] assignments and "dropped" [moe layers]; {} for a dense model.

    Cross-entropy is the mean over tokens in nats, in fp32 whatever the autocast dtype. Padding
    columns of the vocabulary get -inf (no probability mass) rather than being sliced off, so
    vocab-parallel logits are never gathered; the sum over tokens divided by their count is the mean
    that a vocab-parallel loss can compute on any mesh. The head runs with the loss (`head` given the targets)."""
    return objective(*run_units(params, None, tokens, cfg, run, targets), tokens, targets, cfg)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The mean cross-entropy of whole logits [B, T, padded_vocab] against targets [B, T], in fp32."""
    logits = logits.float()
    if cfg.padded_vocab > cfg.vocab_size:
        ids = torch.arange(cfg.padded_vocab, device=targets.device)
        logits = logits + torch.where(ids < cfg.vocab_size, 0.0, float("-inf"))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / targets.numel()


def objective(out: torch.Tensor, moe_stats: list, tokens: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig):
    """loss_and_stats from the head's output and the MoE layers' statistics (the last pipeline stage's part).
    out: the mean cross-entropy (a scalar: run_units given the targets) or the logits [B, T, padded_vocab]."""
    ce = out if out.ndim == 0 else cross_entropy(out, targets, cfg)
    if not moe_stats:
        return ce, {}
    aux, z, loss = add_router_losses(ce, moe_stats, cfg)
    n = len(moe_stats)
    return loss, {"ce": ce.detach(), "aux_loss": aux.detach() / n, "z_loss": z.detach() / n,
                  "expert_load": torch.stack([s.load for s in moe_stats]),
                  "dropped": torch.stack([s.dropped for s in moe_stats])}


def add_router_losses(loss, moe_stats: list, cfg: ModelConfig):
    """(the layers' summed balancing losses, their summed z-losses, loss + aux_loss_coef * the first +
    z_loss_coef * the second). loss may be None (a pipeline stage without the head adds only its
    layers' terms); the third is None where nothing is added."""
    # summed from the first layer's value, not from 0: adding an int to a DTensor partial sum reduces it
    aux = sum((s.aux_loss for s in moe_stats[1:]), moe_stats[0].aux_loss)
    z = sum((s.z_loss for s in moe_stats[1:]), moe_stats[0].z_loss)
    for coef, value in ((cfg.aux_loss_coef, aux), (cfg.z_loss_coef, z)):
        if coef:
            loss = coef * value if loss is None else loss + coef * value
    return aux, z, loss


def loss_fn(params: dict, tokens: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig, run=call) -> torch.Tensor:
    """The training objective (loss_and_stats): mean next-token cross-entropy (+ MoE router losses)."""
    return loss_and_stats(params, tokens, targets, cfg, run)[0]
