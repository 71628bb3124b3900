"""Autoregressive sampling as a pure function of the parameters, with a KV cache by default.

The prompt goes through the model in one call (the prefill), then each new token in a call of its own
that attends to the cached keys and values (models/transformer.py: init_cache, forward_cached), so a
token costs one position's work instead of the whole prefix's. Under greedy decoding the tokens are
those of the recompute-everything loop (`recompute=True`, and `next_logits`), which is kept:

- on a mesh (parallel/sample.py passes next_logits): the sharded model runs the whole context;
- once the context would pass max_seq_len: the model has no positions past it, so, as before, it runs
  on the last max_seq_len tokens, recomputed each step (every position moves, so no cache is valid);
  the tokens stay the recompute sampler's;
- for models whose outputs at a position depend on later positions of the same call: MoE token
  dropping (capacity_factor > 0: capacity is per sequence) and float8 matmuls (a tensor's scale is its
  amax over all the tokens of the call). There the recompute loop is the definition, so it is used.
"""
from __future__ import annotations

import numpy as np
import torch

from nanomega.config import ModelConfig
from nanomega.data.tokenizer import ByteTokenizer, separator_id
from nanomega.models import forward
from nanomega.models.transformer import forward_cached, init_cache

PROMPT_TOKENS = 16     # the default end-of-run prompt: this many tokens of a validation document's start


def cacheable(cfg: ModelConfig) -> bool:
    """Whether a KV cache reproduces the recompute loop for this model (module doc)."""
    return not cfg.capacity_factor and cfg.fp8 == "none"


def choose(logits: torch.Tensor, temperature: float, top_k: int, generator) -> torch.Tensor:
    """logits [B, V] (fp32, real vocabulary) -> the next token [B, 1]: argmax for temperature 0, else a
    draw from softmax(logits / temperature) cut to the top_k (0: no cut)."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def sample(params: dict, cfg: ModelConfig, prompt: torch.Tensor, n_new: int, temperature: float = 1.0,
           top_k: int = 0, generator: torch.Generator | None = None, next_logits=None,
           recompute: bool = False, stop=None) -> torch.Tensor:
    """prompt [B, T0] int64 -> [B, T0 + n_new]. temperature 0 means greedy; top_k 0 means no cut.
    Padding columns of the vocabulary are never sampled. next_logits(context [B, T]) -> [B, vocab] gives
    the logits of the token after each row, recomputed on the whole context (at most max_seq_len tokens);
    by default the model's forward on `params`, on a mesh the sharded model's (parallel/sample.py), which
    hands every rank the same logits, so every rank draws the same tokens from the same generator.
    Without next_logits and recompute, the first tokens come from the KV cache (module doc).
    stop(new [B, n]) -> bool, if given, sees the tokens drawn so far after each one and ends generation
    early when it returns True (lm-eval's stop strings), so the result may hold fewer than n_new new tokens."""
    stop = stop or (lambda new: False)
    tokens = prompt
    if next_logits is None and not recompute and cacheable(cfg) and n_new > 0:
        tokens, stopped = _sample_cached(params, cfg, tokens, n_new, temperature, top_k, generator, stop)
        if stopped:
            return tokens
    if next_logits is None:
        def next_logits(context):
            return forward(params, context, cfg)[:, -1]
    for _ in range(prompt.shape[1] + n_new - tokens.shape[1]):   # what the cache could not reach
        logits = next_logits(tokens[:, -cfg.max_seq_len:])[:, :cfg.vocab_size].float()
        tokens = torch.cat([tokens, choose(logits, temperature, top_k, generator)], dim=1)
        if stop(tokens[:, prompt.shape[1]:]):
            break
    return tokens


def _sample_cached(params, cfg: ModelConfig, prompt, n_new: int, temperature, top_k, generator, stop):
    """sample's first tokens with a KV cache: as many of n_new as fit before the context passes max_seq_len
    (a cropped prompt's first token only), until stop says so; (tokens, whether stop ended it)."""
    context = prompt[:, -cfg.max_seq_len:]
    steps = min(n_new, cfg.max_seq_len - context.shape[1] + 1)   # the last step's logits read position max_seq_len - 1
    weight = params["tok_embed"]["weight"]
    cache = init_cache(cfg, prompt.shape[0], min(context.shape[1] + steps - 1, cfg.max_seq_len), weight.device,
                       weight.dtype)
    new, position, step_tokens = [], 0, context
    for _ in range(steps):
        logits, cache = forward_cached(params, step_tokens, cfg, cache, position, last_only=True)
        position += step_tokens.shape[1]
        step_tokens = choose(logits[:, -1, :cfg.vocab_size].float(), temperature, top_k, generator)
        new.append(step_tokens)
        if stop(torch.cat(new, dim=1)):
            return torch.cat([prompt, *new], dim=1), True
    return torch.cat([prompt, *new], dim=1), False


# ---------------------------------------------------------------- where generation ends, and what it starts from
#
# Generation ends, as transformers' generate does with eos_token_id, at the tokenizer's stop ids (its EOS, and the
# end-of-turn ids its folder names: tokenizer.stop_ids), and at stop strings in the decoded text (sample.py's
# --stop, like generate's stop_strings); the printed text ends before them.

def stopper(stop_ids, strings=(), decode=None):
    """stop(new [B, n]) for sample(): True once every row holds one of stop_ids or, decoded, one of the strings."""
    def ended(row: torch.Tensor) -> bool:
        if stop_ids and bool(torch.isin(row, torch.tensor(list(stop_ids), device=row.device)).any()):
            return True
        return bool(strings) and any(s in decode(row.tolist()) for s in strings)
    return lambda new: all(ended(row) for row in new)


def finish(prompt: list[int], new: list[int], decode, stop_ids=(), strings=()) -> str:
    """A sampled row as text, ended where generation stopped: the new tokens before the first stop id, and the
    text before the first stop string found after the prompt."""
    end = next((k for k, t in enumerate(new) if t in stop_ids), len(new))
    text = decode(prompt + new[:end])
    after = len(decode(prompt))
    cuts = [i for i in (text.find(s, after) for s in strings) if i >= 0]
    return text[:min(cuts)] if cuts else text


def default_prompt(tok, data_path: str, val) -> list[int]:
    """The end-of-run sample's prompt when train.sample_prompt is empty: "def " for bytes on the built-in corpus
    (Python source), else the first PROMPT_TOKENS tokens of the validation split's first document, so the sample
    continues text like the run's own (a separator alone when that document is empty)."""
    if isinstance(tok, ByteTokenizer) and not data_path:
        return tok.encode("def ")
    part = val.parts[0] if hasattr(val, "parts") else val        # a blend: its first source's validation
    head = np.asarray(part[:4 * PROMPT_TOKENS]).astype(np.int64).tolist()
    sep = separator_id(tok)
    while head and head[0] == sep:          # a split that begins at a separator: the document after it
        head = head[1:]
    doc = head[:head.index(sep)] if sep in head else head
    return doc[:PROMPT_TOKENS] or [sep if sep is not None else 0]
