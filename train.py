"""Train a language model: config -> data -> params -> optimizer -> compiled step -> loop.

    python train.py                                    # the CPU default on the built-in corpus
    python train.py --config=gpt2_124m --train.steps=200 --optim.lr=1e-3 --train.out_dir=runs/x
    python train.py --train.resume=true                # continue from the latest checkpoint
    torchrun --nproc-per-node 4 train.py --parallel.dp_shard=2 --parallel.tp=2   # FSDP x TP on 4 processes
"""
from __future__ import annotations

import builtins
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

from nanomega import checkpoint, optim
from nanomega.config import Config, parse_args, to_dict
from nanomega.data.sampler import DATA_ORDER, TokenSampler, eval_batches
from nanomega.data.sources import run_tokenizer
from nanomega.data.tokenizer import RUN_FOLDER, load_tokenizer, separator_id
from nanomega.eval.evaluate import read_task, sample_text, task_metrics, task_name, validation_loss
from nanomega.eval.generate import default_prompt, finish, stopper
from nanomega.hf import transfer as hf
from nanomega.hf.convert import hf_family
from nanomega.models import init
from nanomega.optim.base import step_kept
from nanomega.parallel.agreement import agreement
from nanomega.parallel.mesh import launched_world_size, model_config, pick_device
from nanomega.run.metrics import (MetricsLog, Throughput, bits_per_byte, bytes_per_token, moe_metrics, peak_flops,
                                  peak_memory_gib)
from nanomega.run.preflight import check_resume_tokenizer, is_main_process, load_data, preflight
from nanomega.run.profile import StepProfile
from nanomega.run.tracking import open_tracker
from nanomega.sim.counting import flops_per_token
from nanomega.train.step import make_step_fns, step_options


class NonFiniteLoss(RuntimeError):
    pass


# cuBLAS's deterministic workspace sizes (PyTorch's "Reproducibility" notes); any other value is not deterministic
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def make_deterministic(t_cfg) -> None:
    """train.deterministic: torch.use_deterministic_algorithms(True) before the first step (docs/testing.md,
    "Bitwise"). cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it first runs a matmul, so it is set here, before
    any parameter exists; a value the user set that is not deterministic is refused, not overwritten."""
    if not t_cfg.deterministic:
        return
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    if workspace not in DETERMINISTIC_CUBLAS:
        raise ValueError(f"train.deterministic=true needs CUBLAS_WORKSPACE_CONFIG in {DETERMINISTIC_CUBLAS} "
                         f"(cuBLAS is not deterministic otherwise), but the environment sets {workspace!r}: "
                         "unset it or set CUBLAS_WORKSPACE_CONFIG=:4096:8")
    if t_cfg.compile:
        warnings.warn("train.deterministic=true with train.compile=true: torch turns on inductor's deterministic "
                      "mode too, but the compiled CPU backward was measured to differ from run to run without it "
                      "and is untested with it (docs/testing.md); pass --train.compile=false for runs that "
                      "repeat bitwise", stacklevel=2)
    # an op with no deterministic kernel raises (naming the op) rather than running nondeterministically;
    # inductor's deterministic mode (no on-device benchmarking of kernel choices) comes with it
    torch.use_deterministic_algorithms(True)


class NonFiniteSteps:
    """Which steps had a non-finite loss or gradient norm, counted on the device: the update skips them with a
    device-side select (step.py) and the loop reads these counts only where it reads values anyway (logging,
    evaluation, checkpoints), so no other step waits for the device."""

    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first = torch.full((), -1, dtype=torch.int64, device=device)    # the first such step; -1: none
        self.reported = 0

    def add(self, finite: torch.Tensor, step: int) -> None:
        self.first = torch.where((self.first < 0) & ~finite, step, self.first)
        self.count = self.count + (~finite).long()

    def new(self) -> tuple[int, int]:
        """(steps not finite since the last call, the first step ever not finite): one host read."""
        count, first = torch.stack([self.count, self.first]).tolist()
        fresh, self.reported = count - self.reported, count
        return fresh, first


def setup(cfg: Config, device: torch.device):
    """config -> params -> optimizer: (model_cfg, params, opt, par); par is None on one process. Under torchrun
    each rank draws only its shards of the serial init (nanomega/parallel/setup.py). Under --train.init_from
    nothing random is drawn: the Hugging Face weights overwrite it."""
    model_cfg = model_config(cfg)        # the vocabulary padded to divide over tensor parallel
    if launched_world_size() == 1:
        params = init(model_cfg, cfg.train.seed, device, random=not cfg.train.init_from)
        return model_cfg, params, optim.build(cfg.optim, cfg.train.steps), None
    from nanomega.parallel.setup import setup_parallel  # imported on a mesh only: it registers the hints' runtimes
    return (model_cfg, *setup_parallel(cfg, model_cfg, device))


def save_run_tokenizer(tok, out_dir: str) -> None:
    """<out_dir>/tokenizer, beside the checkpoints (tokenizer.RUN_FOLDER says why there). A resumed run's is
    already there (preflight.check_resume_tokenizer refused any other); one left by a run that saved no checkpoint
    is replaced. Written only once the run is accepted (its checkpoint loaded), under another name and renamed,
    so neither a refused resume nor a crash changes the folder."""
    folder = Path(out_dir) / RUN_FOLDER
    if folder.is_dir() and load_tokenizer(str(folder)).identity()["sha256"] == tok.identity()["sha256"]:
        return
    tmp = folder.with_name(f"{RUN_FOLDER}.tmp{os.getpid()}")
    tok.save(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def train(cfg: Config, splits=None, quiet: bool = False, tok=None) -> dict:
    """Run the training loop described by cfg; returns the last metrics record. `splits` and `tok` (the
    run's tokenizer, which read the text) come from main(); without them they are loaded here."""
    t_cfg, device = cfg.train, pick_device(cfg.train.device)
    make_deterministic(t_cfg)
    if splits is None:  # main() has done both already, outside the loop's error handling
        preflight(cfg, device)
        tok = run_tokenizer(cfg.data)
        check_resume_tokenizer(cfg, tok)
        splits = load_data(cfg, tok)
    if tok is None:
        tok = run_tokenizer(cfg.data)
        check_resume_tokenizer(cfg, tok)
    val_batches = eval_batches(splits.val, t_cfg.seq_len, t_cfg.batch_size, t_cfg.eval_batches)
    # bits per byte need the bytes behind each validation id: token data from another tokenizer has ids past
    # this one's vocabulary (GPT-2 shards read with the default bytes), and then they are not known
    known = max(int(y.max()) for _, y in val_batches) < tok.vocab_size
    val_bytes_per_token = bytes_per_token(tok, val_batches) if known else float("nan")
    tasks = {task_name(path): read_task(path) for path in cfg.eval.tasks}     # checked in preflight

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
                                                  state_box=getattr(opt, "state_box", None))
        step, position = meta["step"], meta["data_position"]
        checkpoint.set_rng_state(meta["rng"])
        print(f"resumed from {latest} at step {step}")
    elif t_cfg.resume and main_process:
        print(f"train.resume=true, but {t_cfg.out_dir} holds no checkpoint: starting from step 0")
    if main_process:     # the run is accepted (a resume's checkpoint loaded): only now is the run folder written
        save_run_tokenizer(tok, t_cfg.out_dir)
    # the token text documents were joined with (data._join, prepare): the tokenizer's EOS, else its BOS; bytes: NUL
    sampler = TokenSampler(splits.train, t_cfg.seq_len, t_cfg.seed, cfg.data.align, separator=separator_id(tok),
                           vocab_size=cfg.model.vocab_size)

    peak = peak_flops(device, getattr(torch, t_cfg.dtype), t_cfg.peak_flops, cfg.data.cache_dir)
    if device.type != "cpu":   # MFU of the whole job: each process brings its own accelerator (CPU ranks share one)
        peak *= launched_world_size()
    throughput = Throughput(flops_per_token(cfg.model, t_cfg.seq_len), peak)
    schedule = optim.build_schedule(cfg.optim, t_cfg.steps)
    print(f"peak {peak / 1e12:.3g} TFLOP/s ({t_cfg.dtype}); corpus {len(splits.train):,} train / "
          f"{len(splits.val):,} val tokens")

    fns = make_step_fns(model_cfg, opt, par=par, **step_options(t_cfg))
    profiler = None                  # --train.profile: a trace of its steps (nanomega/run/profile.py); off: none
    if t_cfg.profile:
        profiler = StepProfile(t_cfg.profile, t_cfg.steps, t_cfg.out_dir, device, to_dict(cfg))
        fns = profiler.annotate(fns)
    log = MetricsLog(f"{t_cfg.out_dir}/metrics.jsonl") if main_process else None
    tracker = open_tracker(t_cfg.tracker, t_cfg.out_dir, to_dict(cfg)) if main_process else None   # mirrors log
    tokens_per_step = t_cfg.batch_size * t_cfg.grad_accum * t_cfg.seq_len

    agree = checkpoint.alone if par is None else agreement(t_cfg.ckpt_timeout)
    saver = checkpoint.Saver(background=t_cfg.async_save)

    def save(step_done: int) -> None:
        meta = {"step": step_done, "data_position": position, "data_order": DATA_ORDER, "rng": checkpoint.rng_state(),
                "tokenizer": tok.identity(),
                "config": to_dict(cfg)}
        if par is not None:
            meta["layout"] = par.layout_key
        saver.save(t_cfg.out_dir, step_done, params, opt_state, meta, t_cfg.keep_checkpoints,
                   agree=agree, state_box=getattr(opt, "state_box", None),
                   **{k: v for k, v in shards.items() if k != "layout"})

    bar = tqdm(total=t_cfg.steps, initial=step, disable=quiet or not main_process, dynamic_ncols=True)
    write = bar.write if main_process else print
    record, window_start, window_tokens = {}, time.perf_counter(), 0
    nonfinite = NonFiniteSteps(device)
    while step < t_cfg.steps:
        if profiler is not None:
            profiler.begin(step)
        micro = [sampler.batch(position + i * t_cfg.batch_size, t_cfg.batch_size) for i in range(t_cfg.grad_accum)]
        micro = [(x.to(device), y.to(device)) for x, y in micro]
        loss, grads, stats = fns.grads(params, micro)
        position += t_cfg.batch_size * t_cfg.grad_accum
        # A step whose loss or gradient norm is not finite changes nothing: the update decides it on the device
        # (step.py), since reading the loss here would make every step wait for it (docs/testing.md, host syncs)
        loss_finite = torch.isfinite(loss)
        params, opt_state = fns.update(grads, opt_state, params, stats, keep=loss_finite)
        del grads      # not held through the next step's forward and backward
        grad_norm = optim.grad_norm(opt_state)      # measured by the update's clip stage
        finite = step_kept(grad_norm, loss_finite)   # the update's own flag, for the count
        step += 1
        nonfinite.add(finite, step)
        if profiler is not None:
            profiler.end(step)
        window_tokens += tokens_per_step
        bar.update()

        last = step == t_cfg.steps
        logging = step % t_cfg.log_every == 0 or step % t_cfg.eval_every == 0 or last
        if logging or step % t_cfg.ckpt_every == 0:      # the host reads values here, and only here
            fresh, first = nonfinite.new()
            if fresh and t_cfg.on_nonfinite == "stop":
                raise NonFiniteLoss(f"the loss or gradient norm is not finite at step {first}; stopped without "
                                    f"saving, so the last checkpoint in {t_cfg.out_dir} is intact (no update of "
                                    "a non-finite step was applied). Lower --optim.lr, raise --optim.warmup_steps, "
                                    "or pass --train.on_nonfinite=skip to skip such steps.")
            if fresh:
                write(f"step {step}: {fresh} update(s) skipped since the last report: loss or gradient norm not "
                      f"finite (the run's first at step {first}; --train.on_nonfinite=skip)")
        if logging:
            elapsed = time.perf_counter() - window_start
            # "loss" is the cross-entropy; an MoE model's objective also holds aux_loss and z_loss times their coefs
            record = {"step": step, "loss": float(stats.get("ce", loss)), "lr": float(schedule(step - 1)),
                      "grad_norm": grad_norm.item(), **throughput.rates(window_tokens, elapsed),
                      "tokens": position * t_cfg.seq_len, "peak_memory_gib": peak_memory_gib(device),
                      **optim.state_metrics(opt_state), **moe_metrics(stats)}
            if step % t_cfg.eval_every == 0 or last:
                record["val_loss"] = validation_loss(params, val_batches, model_cfg, t_cfg, device, par)
                record["val_bpb"] = bits_per_byte(record["val_loss"], val_bytes_per_token)
                write(f"step {step}: train {float(loss):.4f}, val {record['val_loss']:.4f} nats/token, "
                      f"{record['val_bpb']:.4f} bits/byte")
                if tasks:
                    record.update(task_metrics(params, model_cfg, t_cfg, tasks, tok, device, cfg.eval.batch_size))
                    write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k[:5] == "eval/"))
            if log is not None:
                log.log(record)
            if tracker is not None:
                tracker.log(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", mfu=f"{record['mfu']:.1%}")
            window_start, window_tokens = time.perf_counter(), 0
        if step % t_cfg.ckpt_every == 0 or last:
            save(step)
    saver.wait()       # the last checkpoint is published (an asynchronous save's error is raised here)
    bar.close()
    if tracker is not None:
        tracker.close()

    if t_cfg.sample_tokens and not quiet:
        # train.sample_prompt, or the start of a validation document ("def " for bytes on the built-in corpus);
        # the sample ends at the tokenizer's EOS / end-of-turn (generate.stopper)
        ids = tok.encode(t_cfg.sample_prompt) or default_prompt(tok, cfg.data.path, splits.val)
        out = sample_text(params, model_cfg, t_cfg, torch.tensor([ids], device=device), device, par,
                          stop=stopper(tok.stop_ids))[0].tolist()
        print("--- sample ---\n" + finish(ids, out[len(ids):], tok.decode, tok.stop_ids) + "\n--------------")
    return record


def main(argv: list[str]) -> None:
    try:
        cfg = parse_args(argv)
        if is_main_process():
            print(f"config: {cfg.model}")
        preflight(cfg, pick_device(cfg.train.device))
        tok = run_tokenizer(cfg.data)          # loaded (or trained) once: it reads the text and names the run
        check_resume_tokenizer(cfg, tok)       # before anything is written
        splits = load_data(cfg, tok)
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    try:
        train(cfg, splits, tok=tok)
    except (NonFiniteLoss, checkpoint.CheckpointMismatch, checkpoint.CheckpointNotSaved) as err:
        sys.exit(f"error: {err}")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()     # no rank tears gloo down while another still works
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
