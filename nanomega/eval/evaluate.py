"""Evaluation and the end-of-run sample, on one process or on a mesh: what train.py runs between steps and
after the last one, and what the contract checker (nanomega/sim/contracts.py) runs on every rank of a layout.

On a mesh the model runs unit by unit as in training, each unit's parameters gathered only while it runs,
and the sample never gathers the whole model onto one device (parallel/sample.py). Evaluation keeps each
batch's loss on the device and reads them on the host once, at the end (a read drains the device's queue).

Downstream evaluation: multiple-choice tasks in HellaSwag's layout (a JSONL file of contexts, endings and
labels), scored as lm-evaluation-harness scores them (acc, acc_norm), every train.eval_every with
--eval.tasks=a.jsonl,b.jsonl, or on a checkpoint:

    python -m nanomega.eval --run runs/x --tasks a.jsonl,b.jsonl

score_pairs (continuation log-likelihoods) is also what the lm-eval adapter (nanomega/eval/lm_eval_adapter.py)
runs, so a task scored here and the same task run through lm-eval give the same numbers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from nanomega.checkpoint import read_meta
from nanomega.data.tokenizer import load_run_tokenizer, separator_id
from nanomega.eval.generate import sample
from nanomega.hf.transfer import checkpoint_dir, whole_model
from nanomega.models.transformer import call, forward, loss_and_stats
from nanomega.parallel.mesh import pick_device
from nanomega.train.step import autocast, make_runner
from nanomega.tree import tree_map


def cross_entropy(params, x, y, model_cfg, run=call) -> torch.Tensor:
    """The batch's mean cross-entropy: an MoE model's objective adds router losses; validation is on the CE."""
    loss, stats = loss_and_stats(params, x, y, model_cfg, run)
    return stats.get("ce", loss)


@torch.no_grad()
def validation_loss(params, batches, model_cfg, t_cfg, device, par=None) -> float:
    """The mean cross-entropy over `batches` (pairs of inputs and targets), in the training's precision. On a mesh
    each batch's is the layout's (par.cross_entropy: parallel/parallelize.py's Layout, a Pipeline's through its
    stages), the same scalar on every rank."""
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    run = make_runner(param_dtype=t_cfg.param_dtype, par=None if par is None else par.unit_par)
    losses = []
    for x, y in batches:
        if par is not None:
            losses.append(par.cross_entropy(params, x, y, model_cfg, run, lambda: autocast(t_cfg.dtype, device)))
            continue
        with autocast(t_cfg.dtype, device):
            losses.append(cross_entropy(params, x, y, model_cfg, run).float())
    return sum(torch.stack(losses).tolist()) / len(batches)      # the one host read


@torch.no_grad()
def sample_text(params, model_cfg, t_cfg, prompt, device, par=None, n_new: int | None = None,
                stop=None) -> torch.Tensor:
    """The end-of-run sample, [1, prompt + n_new] (train.sample_tokens by default) on every rank. On a mesh every
    rank samples with the same logits and generator (a collective), the model sharded as in training."""
    gen = torch.Generator(device=device).manual_seed(t_cfg.seed) if t_cfg.temperature > 0 else None   # 0: greedy
    next_logits = None
    if par is not None:
        from nanomega.parallel.sample import next_logits as on_mesh
        run = make_runner(param_dtype=t_cfg.param_dtype, par=par.unit_par)
        next_logits = on_mesh(par, params, model_cfg, run, lambda: autocast(t_cfg.dtype, device))
    n_new = t_cfg.sample_tokens if n_new is None else n_new
    return sample(params, model_cfg, prompt, n_new, t_cfg.temperature, t_cfg.top_k, gen, next_logits, stop=stop)


# ---------------------------------------------------------------- multiple choice, in HellaSwag's layout
#
# Scored as lm-evaluation-harness scores its `multiple_choice` tasks (hellaswag among them): each ending is
# the continuation " " + ending of the context (the task's target_delimiter, a space); its log-likelihood is
# the sum of the log-probabilities of the continuation's tokens only. acc takes the ending of the largest
# sum; acc_norm the largest sum divided by the ending's length, which lm-eval counts in characters of the
# ending (`len(choice)`, the delimiter not counted): bytes for ASCII text, and what makes our numbers equal
# lm-eval's on any text. The tokens follow lm-eval's rules for a causal model (TemplateLM._encode_pair and
# HFLM._loglikelihood_tokens): the context's trailing spaces move to the continuation, context + continuation
# is encoded whole and split where the context's own encoding ends (a BPE merges across the boundary as in
# running text), an empty context is the EOS token, and a pair longer than the model's positions loses
# tokens from the left, keeping max_seq_len + 1 tokens.

class Example(NamedTuple):
    context: str
    endings: list[str]
    label: int


def _hellaswag_clean(text: str) -> str:
    """lm-eval's hellaswag preprocessing of raw HellaSwag text: WikiHow's " [title]" becomes ". ", other
    bracketed tags ("[header]", "[step]") go, double spaces become single."""
    text = re.sub(r"\[.*?\]", "", text.strip().replace(" [title]", ". "))
    return text.replace("  ", " ")


def _example(doc: dict, where: str) -> Example:
    """One JSONL record in one of the three layouts read_task accepts."""
    if {"query", "choices", "gold"} <= doc.keys():          # lm-eval's hellaswag, after its process_docs
        context, endings, label = doc["query"], doc["choices"], doc["gold"]
    elif {"ctx_a", "ctx_b", "activity_label", "endings", "label"} <= doc.keys():    # raw HellaSwag: lm-eval's prompt
        context = _hellaswag_clean(f"{doc['activity_label']}: {doc['ctx_a']} {doc['ctx_b'].capitalize()}")
        endings, label = [_hellaswag_clean(e) for e in doc["endings"]], doc["label"]
    elif {"ctx", "endings", "label"} <= doc.keys():
        context, endings, label = doc["ctx"], doc["endings"], doc["label"]
    else:
        raise ValueError(f"{where}: a record needs query/choices/gold (lm-eval's hellaswag after its preprocessing) "
                         f"or ctx/endings/label (HellaSwag's own); it has {sorted(doc)}")
    if not isinstance(context, str) or not isinstance(endings, list) or not endings or \
            not all(isinstance(e, str) and e for e in endings):
        raise ValueError(f"{where}: the context must be a string and the endings a list of non-empty strings")
    try:
        label = int(label)          # HellaSwag on the Hub stores the label as a string
    except (TypeError, ValueError):
        raise ValueError(f"{where}: the label must be an integer index into the endings, got {label!r}") from None
    if not 0 <= label < len(endings):
        raise ValueError(f"{where}: label {label} is not an index into its {len(endings)} endings")
    return Example(context, endings, label)


def read_task(path) -> list[Example]:
    """A multiple-choice task from a JSONL file, one example a line, in HellaSwag's layout. Accepted fields:
    "query", "choices", "gold" (lm-eval's hellaswag after its process_docs: used as they are); "ctx_a",
    "ctx_b", "activity_label", "endings", "label" (a raw HellaSwag file: the prompt is built and cleaned as
    lm-eval's hellaswag builds it, so the numbers compare with lm-eval's); "ctx", "endings", "label" (used as
    they are). The label is the index of the right ending."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {path} does not exist (give a JSONL file, one example a line)")
    examples = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not a JSON object ({err}); a task file holds one JSON object "
                                 "a line") from None
            examples.append(_example(doc, f"{path}:{n}"))
    if not examples:
        raise ValueError(f"task file {path} holds no examples")
    return examples


def prefix_id(tokenizer) -> int:
    """What an empty context is: the EOS token (lm-eval's prefix_token_id), else the BOS token."""
    found = separator_id(tokenizer)
    if found is None:
        raise ValueError(f"tokenizer {tokenizer.name} has neither an EOS nor a BOS token, and an empty context "
                         "(or the first token of a rolling log-likelihood) is conditioned on one")
    return found


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) by lm-eval's rules for a causal model (see above)."""
    if not context:
        ids, start = tokenizer.encode(continuation), prefix_id(tokenizer)
        return (ids[:1], ids[1:]) if ids and ids[0] == start else ([start], ids)
    kept = context.rstrip()
    continuation, context = context[len(kept):] + continuation, kept
    whole, head = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return head, whole[len(head):]


@torch.no_grad()
def score_pairs(params, model_cfg, pairs, device, batch_size: int = 16, dtype: str = "float32",
                run=call) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (the continuation's log-likelihood, whether greedy decoding
    yields it), as lm-eval's loglikelihood returns. Pairs run batch_size at a time, the longest first (rows of
    a batch have similar lengths), padded on the right: attention is causal, so padding changes no logit
    before it (an MoE model with token dropping, model.capacity_factor > 0, routes the padding too, so its scores
    depend on the batch, as its training does). One process only (train.py refuses eval.tasks on a mesh)."""
    if not pairs:
        return []
    limit, rows = model_cfg.max_seq_len, []
    for context, continuation in pairs:
        if not 0 < len(continuation) <= limit:
            raise ValueError(f"a continuation of {len(continuation)} tokens cannot be scored by a model of "
                             f"max_seq_len={limit} (it must hold 1 to {limit} tokens)")
        rows.append((list(context) + list(continuation))[-(limit + 1):])   # lm-eval's truncation: from the left
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    sums, greedy = [None] * len(rows), [None] * len(rows)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        x = torch.zeros(len(batch), max(len(rows[i]) for i in batch) - 1, dtype=torch.long)
        for j, i in enumerate(batch):
            x[j, :len(rows[i]) - 1] = torch.tensor(rows[i][:-1])
        with autocast(dtype, device):
            logits = forward(params, x.to(device), model_cfg, run)
        logp = torch.log_softmax(logits[..., :model_cfg.vocab_size].float(), dim=-1)   # padding columns: no mass
        for j, i in enumerate(batch):
            n, end = len(pairs[i][1]), len(rows[i]) - 1
            target = torch.tensor(rows[i][-n:], device=device)
            picked = logp[j, end - n:end]         # position p predicts token p + 1
            sums[i] = picked.gather(1, target[:, None]).sum()
            greedy[i] = (picked.argmax(-1) == target).all()
    values = torch.stack([torch.stack(sums).double(), torch.stack(greedy).double()]).tolist()   # one host read
    return [(s, bool(g)) for s, g in zip(*values)]


def multiple_choice(params, model_cfg, tokenizer, examples, device, batch_size: int = 16, dtype: str = "float32",
                    run=call) -> dict:
    """{"acc", "acc_norm", "examples"} of a multiple-choice task (read_task), as lm-eval computes them."""
    pairs = [encode_pair(tokenizer, ex.context, " " + ending) for ex in examples for ending in ex.endings]
    scores = iter(score_pairs(params, model_cfg, pairs, device, batch_size, dtype, run))
    acc = acc_norm = 0
    for ex in examples:
        lls = [next(scores)[0] for _ in ex.endings]
        best = max(range(len(lls)), key=lls.__getitem__)             # the first of equal ones, as np.argmax
        best_norm = max(range(len(lls)), key=lambda k: lls[k] / len(ex.endings[k]))
        acc, acc_norm = acc + (best == ex.label), acc_norm + (best_norm == ex.label)
    return {"acc": acc / len(examples), "acc_norm": acc_norm / len(examples), "examples": len(examples)}


def task_name(path) -> str:
    """A task's name in the metrics: its file's name without the extension."""
    return Path(path).stem


def task_metrics(params, model_cfg, t_cfg, tasks: dict, tokenizer, device, batch_size: int) -> dict:
    """eval/<task>/acc and eval/<task>/acc_norm of every task ({name: examples}), in the training's precision."""
    run = make_runner(param_dtype=t_cfg.param_dtype)
    record = {}
    for name, examples in tasks.items():
        scores = multiple_choice(params, model_cfg, tokenizer, examples, device, batch_size, t_cfg.dtype, run)
        record[f"eval/{name}/acc"], record[f"eval/{name}/acc_norm"] = scores["acc"], scores["acc_norm"]
    return record


# ---------------------------------------------------------------- a run's checkpoint, for evaluation outside training

def load_run(path, device) -> tuple[dict, object, object, Path]:
    """(parameters on `device`, Config, tokenizer, checkpoint directory) of a checkpoint or a run's latest,
    whatever layout saved it (the whole model on one process); the tokenizer is the run's (<out_dir>/tokenizer,
    checked against the checkpoint's record of it)."""
    ckpt = checkpoint_dir(path)
    params, cfg = whole_model(ckpt)
    params = tree_map(lambda t: t.to(device), params)
    return params, cfg, load_run_tokenizer(ckpt, read_meta(ckpt).get("tokenizer")), ckpt


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="python -m nanomega.eval",
                                 description="Multiple-choice tasks (JSONL in HellaSwag's layout) on a checkpoint: "
                                             "acc and acc_norm as lm-evaluation-harness computes them.")
    ap.add_argument("--run", required=True, help="a run directory (its latest checkpoint) or a checkpoint directory")
    ap.add_argument("--tasks", required=True, help="JSONL files, comma-separated")
    ap.add_argument("--batch_size", type=int, default=16, help="sequences (context + one ending) per forward")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="autocast dtype")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    try:
        tasks = {task_name(p): read_task(p) for p in args.tasks.split(",") if p}
        device = pick_device(args.device)
        params, cfg, tokenizer, ckpt = load_run(args.run, device)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(f"# {ckpt} (step {read_meta(ckpt)['step']})")
    print(f"{'task':<24} {'examples':>8} {'acc':>8} {'acc_norm':>8}")
    for name, examples in tasks.items():
        s = multiple_choice(params, cfg.model, tokenizer, examples, device, args.batch_size, args.dtype)
        print(f"{name:<24} {s['examples']:>8} {s['acc']:>8.4f} {s['acc_norm']:>8.4f}")

