"""Train a language model: config -> data -> params -> optimizer -> compiled step -> loop.

    python train.py                                    # the CPU default on the built-in corpus
    python train.py --config=gpt2_124m --train.steps=200 --optim.lr=1e-3 --train.out_dir=runs/x
    python train.py --train.resume=true                # continue from the latest checkpoint
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch
from tqdm import tqdm

from nanomega import checkpoint, optim
from nanomega.config import Config, parse_args, to_dict
from nanomega.data import ByteTokenizer, TokenSampler, check_vocab, eval_batches, load_splits, require_length
from nanomega.generate import sample
from nanomega.metrics import MetricsLog, Throughput, count_params, flops_per_token, peak_flops
from nanomega.models import init, loss_fn
from nanomega.step import autocast, make_step_fns


class NonFiniteLoss(RuntimeError):
    pass


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@torch.no_grad()
def evaluate(params, batches, cfg: Config, device) -> float:
    total = 0.0
    for x, y in batches:
        with autocast(cfg.train.dtype, device):
            total += loss_fn(params, x.to(device), y.to(device), cfg.model).item()
    return total / len(batches)


def load_data(cfg: Config):
    """Everything that can fail on bad data fails here, before any expensive work."""
    splits = load_splits(cfg.data, cfg.train.seq_len)
    check_vocab(splits, cfg.model.vocab_size)
    require_length(splits, cfg.train.seq_len)
    return splits


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def preflight(cfg: Config, device: torch.device) -> None:
    """Describe the model and refuse what cannot work, before data or parameters are touched."""
    t_cfg = cfg.train
    n_params, fpt = count_params(cfg.model), flops_per_token(cfg.model, t_cfg.seq_len)
    print(f"model: {n_params / 1e6:,.2f}M parameters ({n_params:,}), {fpt / 1e9:.4g} GFLOP/token (train, "
          f"seq {t_cfg.seq_len}), device {device}")
    latest = checkpoint.latest(t_cfg.out_dir)
    if latest is not None and not t_cfg.resume:
        raise ValueError(f"{t_cfg.out_dir} already holds checkpoints (latest {latest.name}); pass --train.resume=true "
                         "to continue that run, or choose a new --train.out_dir (nothing was overwritten)")
    # fp32 parameters, gradients and two Adam moments: 16 bytes per parameter before any activation.
    need, have = 16 * count_params(cfg.model, padded=True), available_memory(device)
    if need > have:
        raise ValueError(f"training this model needs at least {need / 2**30:,.0f} GiB for parameters, gradients and "
                         f"optimizer state, but {device} has {have / 2**30:,.0f} GiB; pick a smaller --config or "
                         "shard it over more devices")


def train(cfg: Config, splits=None, quiet: bool = False) -> dict:
    """Run the training loop described by cfg; returns the last metrics record."""
    t_cfg, device = cfg.train, pick_device(cfg.train.device)
    if splits is None:  # main() has done both already, outside the loop's error handling
        preflight(cfg, device)
        splits = load_data(cfg)
    sampler = TokenSampler(splits.train, t_cfg.seq_len, t_cfg.seed)
    val_batches = eval_batches(splits.val, t_cfg.seq_len, t_cfg.batch_size, t_cfg.eval_batches)

    torch.manual_seed(t_cfg.seed)
    params = init(cfg.model, t_cfg.seed, device)
    opt = optim.build(cfg.optim, t_cfg.steps)
    opt_state = opt.init(params)
    step, position = 0, 0
    if t_cfg.resume and (latest := checkpoint.latest(t_cfg.out_dir)) is not None:
        params, opt_state, meta = checkpoint.load(latest, params, opt_state)
        step, position = meta["step"], meta["data_position"]
        checkpoint.set_rng_state(meta["rng"])
        print(f"resumed from {latest} at step {step}")

    peak = peak_flops(device, getattr(torch, t_cfg.dtype), t_cfg.peak_flops, cfg.data.cache_dir)
    throughput = Throughput(flops_per_token(cfg.model, t_cfg.seq_len), peak)
    schedule = optim.build_schedule(cfg.optim, t_cfg.steps)
    print(f"peak {peak / 1e12:.3g} TFLOP/s ({t_cfg.dtype}); corpus {len(splits.train):,} train / "
          f"{len(splits.val):,} val tokens")

    fns = make_step_fns(cfg.model, opt, compile=t_cfg.compile, dtype=t_cfg.dtype)
    log = MetricsLog(f"{t_cfg.out_dir}/metrics.jsonl")
    tokens_per_step = t_cfg.batch_size * t_cfg.grad_accum * t_cfg.seq_len

    def save(step_done: int) -> None:
        meta = {"step": step_done, "data_position": position, "rng": checkpoint.rng_state(), "config": to_dict(cfg)}
        checkpoint.save(t_cfg.out_dir, step_done, params, opt_state, meta, t_cfg.keep_checkpoints)

    bar = tqdm(total=t_cfg.steps, initial=step, disable=quiet, dynamic_ncols=True)
    record, window_start, window_tokens = {}, time.perf_counter(), 0
    while step < t_cfg.steps:
        micro = [sampler.batch(position + i * t_cfg.batch_size, t_cfg.batch_size) for i in range(t_cfg.grad_accum)]
        micro = [(x.to(device), y.to(device)) for x, y in micro]
        loss, grads = fns.grads(params, micro)
        loss = loss.item()
        position += t_cfg.batch_size * t_cfg.grad_accum
        if math.isfinite(loss):
            params, opt_state, grad_norm = fns.update(grads, opt_state, params)
        elif t_cfg.on_nonfinite == "stop":
            raise NonFiniteLoss(f"loss is {loss} at step {step}; stopped without saving, so the last checkpoint "
                                f"in {t_cfg.out_dir} is intact. Lower --optim.lr, raise --optim.warmup_steps, "
                                "or pass --train.on_nonfinite=skip to skip such steps.")
        else:
            bar.write(f"step {step}: loss is {loss}; update skipped (--train.on_nonfinite=skip)")
            grad_norm = torch.tensor(float("nan"))
        step += 1
        window_tokens += tokens_per_step
        bar.update()

        last = step == t_cfg.steps
        if step % t_cfg.log_every == 0 or step % t_cfg.eval_every == 0 or last:
            elapsed = time.perf_counter() - window_start
            record = {"step": step, "loss": loss, "lr": float(schedule(step - 1)), "grad_norm": grad_norm.item(),
                      **throughput.rates(window_tokens, elapsed), "tokens": position * t_cfg.seq_len,
                      **optim.state_metrics(opt_state)}
            if step % t_cfg.eval_every == 0 or last:
                record["val_loss"] = evaluate(params, val_batches, cfg, device)
                bar.write(f"step {step}: train {loss:.4f}, val {record['val_loss']:.4f} nats/token")
            log.log(record)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.1%}")
            window_start, window_tokens = time.perf_counter(), 0
        if step % t_cfg.ckpt_every == 0 or last:
            save(step)
    bar.close()

    if t_cfg.sample_tokens and not quiet:
        prompt = torch.tensor([ByteTokenizer().encode("def ")], device=device)
        gen = torch.Generator(device=device).manual_seed(t_cfg.seed)
        out = sample(params, cfg.model, prompt, t_cfg.sample_tokens, t_cfg.temperature, t_cfg.top_k, gen)
        print("--- sample ---\n" + ByteTokenizer().decode(out[0].tolist()) + "\n--------------")
    return record


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
        print(f"config: {cfg.model}")
        preflight(cfg, pick_device(cfg.train.device))
        splits = load_data(cfg)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        train(cfg, splits)
    except (NonFiniteLoss, checkpoint.CheckpointMismatch) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main(sys.argv[1:])
