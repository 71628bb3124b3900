"""Before any work: the device, the data, and every refusal a run can be given cheaply.

    device = pick_device(cfg.train.device)
    preflight(cfg, device)       # layout rules, fp8 support, out_dir, init_from's headers, memory
    splits = load_data(cfg)      # the corpus read, checked against the vocabulary and the sequence length

A refusal says what to change and happens before data, process groups or parameters exist, so nothing
saved is touched. The memory check counts what the most loaded rank holds between steps from the plan
(instant), and simulates the step on fake tensors only when that comes close to the free memory.
"""
from __future__ import annotations

import dataclasses

import json
import os
import warnings
from pathlib import Path

import torch

from nanomega import checkpoint
from nanomega.config import Config
from nanomega.data.sampler import check_data_order
from nanomega.data.sources import (check_documents, check_prepared, check_vocab, declared_vocab_size, load_splits,
                                   require_length, run_tokenizer)
from nanomega.data.tokenizer import RUN_FOLDER, ByteTokenizer, load_tokenizer, vocab_size_of
from nanomega.eval.evaluate import read_task, task_name
from nanomega.hf import transfer as hf
from nanomega.models import fp8
from nanomega.parallel.mesh import launched_world_size, model_config, validate_layout
from nanomega.run.tracking import require_tracker
from nanomega.sim.counting import count_params, flops_per_token
from nanomega.sim.rank_bytes import bytes_per_rank

# Simulate the step when the held bytes exceed 1/SIMULATE_ABOVE of the free memory (the default run on a
# CPU: 50 MB of 24 GB, no simulation); PEAK_MARGIN covers the allocator's rounding, fragmentation and the
# workspaces no tensor shows (the tracked peak is 5% above the resident-set growth on a CPU).
SIMULATE_ABOVE = 16
PEAK_MARGIN = 0.10


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def load_data(cfg: Config, tok=None):
    """Everything that can fail on bad data fails here, before any expensive work. Text is read with `tok`,
    the run's tokenizer (data.run_tokenizer(cfg.data) when not given)."""
    check_prepared(cfg.data, cfg.model.vocab_size)      # from meta.json, before any token is read
    splits = load_splits(cfg.data, cfg.train.seq_len, tok if tok is not None else run_tokenizer(cfg.data))
    check_vocab(splits, cfg.model.vocab_size, declared_vocab_size(cfg.data))
    if cfg.model.document_separator >= 0:
        check_documents(splits, cfg.model.document_separator)
    require_length(splits, cfg.train.seq_len)
    return splits


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":   # pick_device's indexed GPU: a bare "cuda" would query (and open) the current one
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_tasks(paths, world_size: int) -> None:
    """--eval.tasks: each file read and checked (evaluate.read_task), names distinct, one process. On a mesh
    the scorer would need every position's logits of the sharded model (the sample's path reads one row), which
    it does not have yet; a run's checkpoint is scored after training with python -m nanomega.eval."""
    if world_size > 1:
        raise ValueError(f"eval.tasks runs on one process, and this job has {world_size}: leave --eval.tasks out "
                         "and score the checkpoint after the run with python -m nanomega.eval --run "
                         "<out_dir> --tasks <files> (it reads a checkpoint of any layout)")
    names = [task_name(p) for p in paths]
    if len(set(names)) < len(names):
        raise ValueError(f"eval.tasks={','.join(paths)}: two files share a name ({names}); tasks are logged by "
                         "file name, so rename one")
    for path in paths:
        read_task(path)


def check_tokenizer(cfg: Config) -> None:
    """The run's tokenizer against the model (its vocabulary fits), the --train.init_from folder's config.json
    (the same BOS, EOS and padding ids), prepared data (made with it) and a resumed run (trained with it).
    Loads a tokenizer file, trains nothing ("train:<vocab>" is checked by its size)."""
    spec, vocab, model_vocab = cfg.data.tokenizer, None, cfg.model.vocab_size
    init_from = Path(cfg.train.init_from).expanduser() if cfg.train.init_from else None
    if spec == "bytes" and init_from is not None and not (init_from / "tokenizer.json").is_file():
        warnings.warn(f"--train.init_from={init_from} has no tokenizer.json, so this run reads its text as bytes "
                      f"(ids 0-255) for a model of {model_vocab:,} ids; give the model's tokenizer with "
                      "--data.tokenizer=<folder or tokenizer.json>", stacklevel=2)
    tok = None if spec.startswith("train:") else load_tokenizer(spec)
    vocab = vocab_size_of(spec) if tok is None else tok.vocab_size
    if vocab > model_vocab and spec != "bytes":     # bytes: as before, the data's ids are checked instead
        raise ValueError(f"tokenizer {spec} has {vocab:,} ids but model.vocab_size={model_vocab:,}; set "
                         f"--model.vocab_size={vocab} (or more), or use a tokenizer of at most {model_vocab:,} ids")
    # The byte tokenizer has no special tokens of its own (its "EOS" is the NUL data.py joins documents with), so
    # a folder without a tokenizer is only warned about above, not held to its config.json's ids
    if tok is not None and not isinstance(tok, ByteTokenizer) and init_from is not None \
            and (init_from / "config.json").is_file():
        hf = json.loads((init_from / "config.json").read_text())
        for role in ("bos", "eos", "pad"):
            want, have = hf.get(f"{role}_token_id"), getattr(tok, f"{role}_id")
            allowed = want if isinstance(want, list) else [want]
            if want is not None and have is not None and have not in allowed:
                raise ValueError(f"tokenizer {spec} has {role.upper()} id {have}, but {init_from / 'config.json'} says "
                                 f"{role}_token_id={want}: the tokenizer is not this model's; give the model's own "
                                 "with --data.tokenizer, or fix the folder's tokenizer_config.json / config.json")
            if role == "eos" and want is not None and have is None:
                raise ValueError(f"tokenizer {spec} has no EOS token, but {init_from / 'config.json'} says "
                                 f"eos_token_id={want}: documents would not end the way the model learned; add "
                                 "eos_token to the tokenizer_config.json, or give the model's own tokenizer")
    if tok is not None:
        check_prepared(cfg.data, model_vocab, tok)
        check_resume_tokenizer(cfg, tok)
    elif cfg.train.resume and (recorded := _resumed_tokenizer(cfg)) is not None and recorded["kind"] == "bytes":
        # a BPE about to be trained is never the bytes the checkpoint read: refused before training it
        raise _other_tokenizer(cfg, recorded, spec)


def _resumed_tokenizer(cfg: Config) -> dict | None:
    """The tokenizer identity recorded by the checkpoint a resume would load (bytes when it records none, as
    runs from before tokenizers did); None when nothing would be resumed."""
    latest = checkpoint.latest(cfg.train.out_dir) if cfg.train.resume else None
    if latest is None:
        return None
    return checkpoint.read_meta(latest).get("tokenizer") or ByteTokenizer().identity()


def _other_tokenizer(cfg: Config, recorded: dict, name: str) -> ValueError:
    stored = Path(cfg.train.out_dir) / RUN_FOLDER
    return ValueError(f"{cfg.train.out_dir} was trained with tokenizer {recorded.get('name')} ({recorded.get('kind')}, "
                      f"sha256 {recorded.get('sha256', '')[:12]}...), but this run's is {name}; resume with "
                      f"--data.tokenizer={stored if stored.is_dir() else 'bytes'}, or choose a new --train.out_dir "
                      f"(nothing in {cfg.train.out_dir} was changed)")


def check_resume_tokenizer(cfg: Config, tok) -> None:
    """A resumed run reads its text with the tokenizer its checkpoint recorded: `tok` (the run's, trained if it
    is "train:<vocab>") against that identity. Called before anything is written: train.py writes the run's
    tokenizer folder only once the checkpoint has loaded, so a refused resume leaves the run folder as it was."""
    recorded = _resumed_tokenizer(cfg)
    if recorded is not None and recorded.get("sha256") != tok.identity()["sha256"]:
        raise _other_tokenizer(cfg, recorded, f"{tok.name} ({tok.identity()['sha256'][:12]}...)")


def preflight(cfg: Config, device: torch.device) -> None:
    """Describe the model and refuse what cannot work, before data or parameters are touched."""
    t_cfg = cfg.train
    require_tracker(t_cfg.tracker)       # a missing tensorboard or wandb, before anything else
    validate_layout(cfg, launched_world_size())
    if cfg.model.fp8 != "none" and (refused := fp8.device_refusal(device)):
        raise ValueError(refused)
    n_params, fpt = count_params(cfg.model), flops_per_token(cfg.model, t_cfg.seq_len)
    if is_main_process():
        active = count_params(cfg.model, active=True)
        moe = f" ({active / 1e6:,.2f}M active per token)" if active != n_params else ""
        print(f"model: {n_params / 1e6:,.2f}M parameters ({n_params:,}){moe}, {fpt / 1e9:.4g} GFLOP/token (train, "
              f"seq {t_cfg.seq_len}), device {device}")
    if Path(t_cfg.out_dir).exists() and not Path(t_cfg.out_dir).is_dir():
        raise ValueError(f"train.out_dir={t_cfg.out_dir} is a file, not a directory; choose another --train.out_dir")
    check_tokenizer(cfg)
    if t_cfg.init_from:      # names and shapes against the model, from the files' headers
        hf.check_folder(t_cfg.init_from, model_config(cfg))
    latest = checkpoint.latest(t_cfg.out_dir)
    if latest is not None and not t_cfg.resume:
        raise ValueError(f"{t_cfg.out_dir} already holds checkpoints (latest {latest.name}); pass --train.resume=true "
                         "to continue that run, or choose a new --train.out_dir (nothing was overwritten)")
    if latest is not None:    # a truncated or corrupted file, from lengths and headers; the checksums when loading
        checkpoint.check_intact(latest, checksummed=lambda meta: ())
        checkpoint.check_readable(latest)                       # an old format
        check_data_order(checkpoint.read_meta(latest).get("data_order"), str(latest))
    if cfg.eval.tasks:
        check_tasks(cfg.eval.tasks, launched_world_size())
    # What the most loaded rank holds between steps (the plan's count, instant) bounds its step's peak from
    # below. Well under the free memory it is enough; otherwise the step is simulated (nanomega.sim.estimate:
    # the real step on fake tensors, ~20 s for llama3_8b), since activations, gathered parameters and the
    # update's transients come on top: 2.5-5x the held bytes for llama3_8b at sequence 8192. CPU ranks share one host.
    ranks = cfg.parallel.world_size if device.type == "cpu" else 1
    held = bytes_per_rank(cfg).total
    have = available_memory(device)
    if held * ranks > have:
        raise ValueError(f"training this model needs at least {held * ranks / 2**30:,.0f} GiB for parameters, "
                         f"gradients and optimizer state ({held / 2**30:,.1f} GiB per rank in this layout), but "
                         f"{device} has {have / 2**30:,.0f} GiB free; pick a smaller --config or shard it over more "
                         "devices (--parallel.dp_shard, --parallel.tp, --parallel.ep)")
    if held * ranks * SIMULATE_ABOVE < have:
        return
    from nanomega.sim.estimate import estimate, what_to_change

    # rank 0, and under pp each stage's first rank: each holds other blocks and keeps a different number of
    # micro-batches in flight (pp is the mesh's outermost dim)
    stage_ranks = range(0, cfg.parallel.world_size, cfg.parallel.world_size // cfg.parallel.pp)
    # the kernels of the device this run resolved to ("auto" on a machine without a GPU is the CPU's)
    on_device = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device=device.type))
    result = estimate(on_device, ranks=",".join(map(str, stage_ranks)))
    need = result["peak_bytes"] * ranks * (1 + PEAK_MARGIN)
    if need > have:
        raise ValueError(f"a train step peaks at {result['peak_bytes'] / 2**30:,.1f} GiB per rank (simulated: "
                         f"python -m nanomega.sim.estimate with these flags), {need / 2**30:,.1f} GiB with a "
                         f"{PEAK_MARGIN:.0%} margin, but {device} has {have / 2**30:,.1f} GiB free; "
                         + what_to_change(cfg, result))
