"""Train a language model: config -> data -> params -> optimizer -> compiled step -> loop.

    python train.py                                    # the CPU default on the built-in corpus
    python train.py --config=gpt2_124m --train.steps=200 --optim.lr=1e-3 --train.out_dir=runs/x
    python train.py --train.resume=true                # continue from the latest checkpoint
    torchrun --nproc-per-node 4 train.py --parallel.dp_shard=2 --parallel.tp=2   # FSDP x TP on 4 processes
"""
from __future__ import annotations

import builtins
import datetime
import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from nanomega import checkpoint, hf, optim
from nanomega.config import Config, from_dict, parse_args, to_dict
from nanomega.data import ByteTokenizer, TokenSampler, check_vocab, eval_batches, load_splits, require_length
from nanomega.generate import sample
from nanomega.metrics import MetricsLog, Throughput, count_params, flops_per_token, moe_metrics, peak_flops
from nanomega.models import fp8, init
from nanomega.models.hf import hf_family
from nanomega.models.transformer import call, loss_and_stats
from nanomega.parallel.memory import bytes_per_rank
from nanomega.parallel.mesh import build_mesh, init_distributed, launched_world_size, model_config, validate_layout
from nanomega.step import autocast, make_runner, make_step_fns, step_options
from nanomega.tree import leaf_names


class NonFiniteLoss(RuntimeError):
    pass


def pick_device(name: str) -> torch.device:
    """The device this process trains on. A GPU without an index is GPU LOCAL_RANK (torchrun's; 0 alone),
    so each rank's first CUDA call (the preflight's memory query) opens a context on its own GPU only,
    never on GPU 0, long before init_distributed makes it the current device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"   # no CUDA context: the driver's device count only
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def cross_entropy(params, x, y, model_cfg, run=call) -> torch.Tensor:
    loss, stats = loss_and_stats(params, x, y, model_cfg, run)
    return stats.get("ce", loss)    # an MoE model's objective adds router losses: validate on the CE only


@torch.no_grad()
def evaluate(params, batches, model_cfg, t_cfg, device, par=None) -> float:
    """The mean validation cross-entropy, in the training's precision. On a mesh the model runs unit by
    unit as in training: each unit's parameters gathered only while it runs."""
    if getattr(par, "pipelined", False):
        run = make_runner(param_dtype=t_cfg.param_dtype, par=par.par)
        return par.evaluate(params, [(x.to(device), y.to(device)) for x, y in batches], model_cfg, run,
                            lambda: autocast(t_cfg.dtype, device))
    run = make_runner(param_dtype=t_cfg.param_dtype, par=par)
    total = 0.0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast(t_cfg.dtype, device):
            if par is None:
                total += cross_entropy(params, x, y, model_cfg, run).item()
                continue
            with par.context():
                x, y = par.batch(x, y)
                total += par.scalar(cross_entropy(params, x, y, model_cfg, run)).item()
    return total / len(batches)


def setup(cfg: Config, device: torch.device):
    """config -> mesh -> params -> shard -> optimizer: (model_cfg, params, opt, par); par is None on one process.

    On a mesh every rank draws the same parameters from the seed, one at a time on the CPU, and keeps
    its shard of each: the numbers are the serial run's, and no rank holds more than one whole
    parameter at once."""
    model_cfg = model_config(cfg)        # the vocabulary padded to divide over tensor parallel
    if launched_world_size() == 1:
        return model_cfg, init(model_cfg, cfg.train.seed, device), optim.build(cfg.optim, cfg.train.steps), None
    from nanomega.parallel.optimizer import ParallelOptimizer
    from nanomega.parallel.parallelize import Parallel
    init_distributed(cfg, device)
    mesh = build_mesh(cfg, device.type)
    if cfg.parallel.pp > 1:
        return setup_pipeline(cfg, model_cfg, mesh, device)
    par = Parallel(cfg, mesh, init(model_cfg, device="meta"))
    params = init(model_cfg, cfg.train.seed, "cpu", place=lambda name, whole: par.shard(name, whole, device))
    return model_cfg, params, ParallelOptimizer(cfg, par, cfg.train.steps), par


def setup_pipeline(cfg: Config, model_cfg, mesh, device: torch.device):
    """setup under pipeline parallel: this rank's stages (parallel/pipeline.py) and their parameters,
    sharded within the stage's mesh if it has one; returns the Pipeline as `par`."""
    from nanomega.parallel.mesh import stage_mesh
    from nanomega.parallel.optimizer import ParallelOptimizer
    from nanomega.parallel.parallelize import Parallel
    from nanomega.parallel.pipeline import Pipeline
    pipe = Pipeline(cfg, mesh, model_cfg)
    mine = pipe.keep(pipe.whole)
    sub = stage_mesh(mesh)
    pipe.par = Parallel(cfg, sub, mine) if sub is not None else None
    names = set(leaf_names(mine))

    def place(name, whole):   # every rank draws every parameter (the serial numbers) and keeps its own
        if name not in names:
            return None
        return pipe.par.shard(name, whole, device) if pipe.par else whole.to(device).requires_grad_(True)
    params = pipe.keep(init(model_cfg, cfg.train.seed, "cpu", place=place))
    if pipe.par is not None:
        opt = ParallelOptimizer(cfg, pipe.par, cfg.train.steps, over_stages=pipe.norm_over_stages)
    else:
        opt = optim.build(cfg.optim, cfg.train.steps, norm=pipe.global_norm)
    return model_cfg, params, opt, pipe


def format1_state_names(stored: list[str], meta: dict) -> dict:
    """How an older checkpoint's optimizer state is renamed on resume (checkpoint.load; from the config it was written with)."""
    return optim.format1_state_names(from_dict(meta["config"]).optim, stored)


def agreement(timeout_s: float):
    """agree(ok) -> whether every rank passed ok (checkpoint.save's), through the job's key-value store
    (each rank sets its answer, then waits for all of them, at most timeout_s): a rank that died or hangs
    in a save fails the others' agreement with an error, not a wait for the process group's 30 minutes.
    The store rather than a collective or a second gloo group: a group created after torchrun restarted
    the job connects to the dead attempt's addresses. Keys carry the attempt and a per-save counter."""
    store = torch.distributed.distributed_c10d._get_default_store()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    prefix = f"nanomega/agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    calls = itertools.count()

    def agree(ok: bool) -> bool:
        key = f"{prefix}/{next(calls)}"
        store.set(f"{key}/{rank}", "1" if ok else "0")
        try:
            store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:   # DistStoreError: the time ran out, or the store is gone
            raise checkpoint.CheckpointNotSaved(
                f"the ranks could not agree that a checkpoint is complete within {timeout_s:g} s "
                f"(train.ckpt_timeout): a rank died or hangs ({str(err).splitlines()[0][:200]}); nothing was "
                "published, the latest checkpoint is unchanged") from err
        return all(store.get(f"{key}/{r}") == b"1" for r in range(world))
    return agree


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def load_data(cfg: Config):
    """Everything that can fail on bad data fails here, before any expensive work."""
    splits = load_splits(cfg.data, cfg.train.seq_len)
    check_vocab(splits, cfg.model.vocab_size)
    require_length(splits, cfg.train.seq_len)
    return splits


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":   # pick_device's indexed GPU: a bare "cuda" would query (and open) the current one
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def preflight(cfg: Config, device: torch.device) -> None:
    """Describe the model and refuse what cannot work, before data or parameters are touched."""
    t_cfg = cfg.train
    validate_layout(cfg, launched_world_size())
    if t_cfg.fp8 != "none" and (refused := fp8.device_refusal(device)):
        raise ValueError(refused)
    n_params, fpt = count_params(cfg.model), flops_per_token(cfg.model, t_cfg.seq_len)
    if is_main_process():
        active = count_params(cfg.model, active=True)
        moe = f" ({active / 1e6:,.2f}M active per token)" if active != n_params else ""
        print(f"model: {n_params / 1e6:,.2f}M parameters ({n_params:,}){moe}, {fpt / 1e9:.4g} GFLOP/token (train, "
              f"seq {t_cfg.seq_len}), device {device}")
    if Path(t_cfg.out_dir).exists() and not Path(t_cfg.out_dir).is_dir():
        raise ValueError(f"train.out_dir={t_cfg.out_dir} is a file, not a directory; choose another --train.out_dir")
    if t_cfg.init_from:      # names and shapes against the model, from the files' headers
        hf.check_folder(t_cfg.init_from, model_config(cfg))
    latest = checkpoint.latest(t_cfg.out_dir)
    if latest is not None and not t_cfg.resume:
        raise ValueError(f"{t_cfg.out_dir} already holds checkpoints (latest {latest.name}); pass --train.resume=true "
                         "to continue that run, or choose a new --train.out_dir (nothing was overwritten)")
    # What the most loaded rank holds between steps (the plan's count, instant) bounds its step's peak from
    # below. Well under the free memory it is enough; otherwise the step is simulated (nanomega.estimate:
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
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:   # not simulated yet (nanomega.estimate says so)
        print(f"preflight: the plan holds {held / 2**30:,.1f} GiB per rank of {have / 2**30:,.1f} GiB; the step's "
              "peak is not simulated under parallel.pp or parallel.cp")
        return
    from nanomega.estimate import estimate, what_to_change
    result = estimate(cfg, ranks="0")
    need = result["peak_bytes"] * ranks * (1 + PEAK_MARGIN)
    if need > have:
        raise ValueError(f"a train step peaks at {result['peak_bytes'] / 2**30:,.1f} GiB per rank (simulated: "
                         f"python -m nanomega.estimate with these flags), {need / 2**30:,.1f} GiB with a "
                         f"{PEAK_MARGIN:.0%} margin, but {device} has {have / 2**30:,.1f} GiB free; "
                         + what_to_change(cfg, result))


# Simulate the step when the held bytes exceed 1/SIMULATE_ABOVE of the free memory (the default run on a
# CPU: 50 MB of 24 GB, no simulation); PEAK_MARGIN covers the allocator's rounding, fragmentation and the
# workspaces no tensor shows (the tracked peak is 5% above the resident-set growth on a CPU).
SIMULATE_ABOVE = 16
PEAK_MARGIN = 0.10


def train(cfg: Config, splits=None, quiet: bool = False) -> dict:
    """Run the training loop described by cfg; returns the last metrics record."""
    t_cfg, device = cfg.train, pick_device(cfg.train.device)
    if splits is None:  # main() has done both already, outside the loop's error handling
        preflight(cfg, device)
        splits = load_data(cfg)
    sampler = TokenSampler(splits.train, t_cfg.seq_len, t_cfg.seed)
    val_batches = eval_batches(splits.val, t_cfg.seq_len, t_cfg.batch_size, t_cfg.eval_batches)

    torch.manual_seed(t_cfg.seed)
    model_cfg, params, opt, par = setup(cfg, device)
    main_process = is_main_process()
    print = builtins.print if main_process else (lambda *args, **kwargs: None)
    resuming = t_cfg.resume and checkpoint.latest(t_cfg.out_dir) is not None
    if t_cfg.init_from and not resuming:     # each rank reads only its pieces of the Hugging Face weights
        params = hf.load_params(t_cfg.init_from, params, model_cfg)
        print(f"initialized from {t_cfg.init_from} ({hf_family(model_cfg)})")
    elif t_cfg.init_from:
        print(f"train.init_from={t_cfg.init_from} is not read: resuming from {t_cfg.out_dir}'s latest checkpoint")
    opt_state = opt.init(params)
    step, position = 0, 0
    # Parallel runs save one file per rank; a checkpoint of any layout resumes in this one (checkpoint.load).
    shards = {} if par is None else {"rank": torch.distributed.get_rank(), "world_size": launched_world_size(),
                                     "layout": par.layout_key}
    if t_cfg.resume and (latest := checkpoint.latest(t_cfg.out_dir)) is not None:
        params, opt_state, meta = checkpoint.load(latest, params, opt_state, **shards,
                                                  rename_format1_state=format1_state_names,
                                                  state_box=getattr(opt, "state_box", None))
        step, position = meta["step"], meta["data_position"]
        checkpoint.set_rng_state(meta["rng"])
        renamed = " (format 1: optimizer state renamed by what it is, e.g. '1.mu.<p>' -> 'adam.mu.<p>')"
        print(f"resumed from {latest} at step {step}" + (renamed if meta["format"] == 1 else ""))
    elif t_cfg.resume and main_process:
        print(f"train.resume=true, but {t_cfg.out_dir} holds no checkpoint: starting from step 0")

    peak = peak_flops(device, getattr(torch, t_cfg.dtype), t_cfg.peak_flops, cfg.data.cache_dir)
    if device.type != "cpu":   # MFU of the whole job: each process brings its own accelerator (CPU ranks share one)
        peak *= launched_world_size()
    throughput = Throughput(flops_per_token(cfg.model, t_cfg.seq_len), peak)
    schedule = optim.build_schedule(cfg.optim, t_cfg.steps)
    print(f"peak {peak / 1e12:.3g} TFLOP/s ({t_cfg.dtype}); corpus {len(splits.train):,} train / "
          f"{len(splits.val):,} val tokens")

    fns = make_step_fns(model_cfg, opt, par=par, **step_options(t_cfg))
    log = MetricsLog(f"{t_cfg.out_dir}/metrics.jsonl") if main_process else None
    tokens_per_step = t_cfg.batch_size * t_cfg.grad_accum * t_cfg.seq_len

    agree = agreement(t_cfg.ckpt_timeout) if par else checkpoint.alone
    saver = checkpoint.Saver(background=t_cfg.async_save)

    def save(step_done: int) -> None:
        meta = {"step": step_done, "data_position": position, "rng": checkpoint.rng_state(), "config": to_dict(cfg)}
        if par is not None:
            meta["layout"] = par.layout_key
        saver.save(t_cfg.out_dir, step_done, params, opt_state, meta, t_cfg.keep_checkpoints,
                   agree=agree, state_box=getattr(opt, "state_box", None),
                   **{k: v for k, v in shards.items() if k != "layout"})

    bar = tqdm(total=t_cfg.steps, initial=step, disable=quiet or not main_process, dynamic_ncols=True)
    write = bar.write if main_process else print
    record, window_start, window_tokens = {}, time.perf_counter(), 0
    while step < t_cfg.steps:
        micro = [sampler.batch(position + i * t_cfg.batch_size, t_cfg.batch_size) for i in range(t_cfg.grad_accum)]
        micro = [(x.to(device), y.to(device)) for x, y in micro]
        loss, grads, stats = fns.grads(params, micro)
        loss = loss.item()
        position += t_cfg.batch_size * t_cfg.grad_accum
        if math.isfinite(loss):
            params, opt_state = fns.update(grads, opt_state, params, stats)
            del grads      # not held through the next step's forward and backward
            grad_norm = optim.grad_norm(opt_state)     # measured by the update's clip stage
        elif t_cfg.on_nonfinite == "stop":
            raise NonFiniteLoss(f"loss is {loss} at step {step}; stopped without saving, so the last checkpoint "
                                f"in {t_cfg.out_dir} is intact. Lower --optim.lr, raise --optim.warmup_steps, "
                                "or pass --train.on_nonfinite=skip to skip such steps.")
        else:
            write(f"step {step}: loss is {loss}; update skipped (--train.on_nonfinite=skip)")
            grad_norm = torch.tensor(float("nan"))
        step += 1
        window_tokens += tokens_per_step
        bar.update()

        last = step == t_cfg.steps
        if step % t_cfg.log_every == 0 or step % t_cfg.eval_every == 0 or last:
            elapsed = time.perf_counter() - window_start
            # "loss" is the cross-entropy; an MoE model's objective also holds aux_loss and z_loss times their coefs
            record = {"step": step, "loss": float(stats.get("ce", loss)), "lr": float(schedule(step - 1)),
                      "grad_norm": grad_norm.item(), **throughput.rates(window_tokens, elapsed),
                      "tokens": position * t_cfg.seq_len, **optim.state_metrics(opt_state), **moe_metrics(stats)}
            if step % t_cfg.eval_every == 0 or last:
                record["val_loss"] = evaluate(params, val_batches, model_cfg, t_cfg, device, par)
                write(f"step {step}: train {loss:.4f}, val {record['val_loss']:.4f} nats/token")
            if log is not None:
                log.log(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.1%}")
            window_start, window_tokens = time.perf_counter(), 0
        if step % t_cfg.ckpt_every == 0 or last:
            save(step)
    saver.wait()       # the last checkpoint is published (an asynchronous save's error is raised here)
    bar.close()

    if t_cfg.sample_tokens and not quiet:
        prompt = torch.tensor([ByteTokenizer().encode("def ")], device=device)
        gen = torch.Generator(device=device).manual_seed(t_cfg.seed)
        # on a mesh, whole on rank 0 only, one parameter at a time (a collective: all ranks, before the rank-0 test)
        whole = params if par is None else par.full_on_main(params)
        if main_process:
            out = sample(whole, model_cfg, prompt, t_cfg.sample_tokens, t_cfg.temperature, t_cfg.top_k, gen)
            print("--- sample ---\n" + ByteTokenizer().decode(out[0].tolist()) + "\n--------------")
    return record


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
        if is_main_process():
            print(f"config: {cfg.model}")
        preflight(cfg, pick_device(cfg.train.device))
        splits = load_data(cfg)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        train(cfg, splits)
    except (NonFiniteLoss, checkpoint.CheckpointMismatch, checkpoint.CheckpointNotSaved) as err:
        sys.exit(f"error: {err}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()     # no rank tears gloo down while another still works
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
