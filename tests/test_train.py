"""train.py end to end: exact resume in a fresh process, compiled == eager, non-finite handling, CLI errors."""
from __future__ import annotations

import collections
import gc
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import train as train_script
from nanomega import checkpoint, optim
from nanomega.run import preflight
from nanomega.config import parse_args
from nanomega.data.sampler import TokenSampler
from nanomega.run.metrics import read_metrics
from nanomega.models import init
from nanomega.train.step import make_step_fns
from nanomega.tree import named_leaves, tree_leaves
from tiers import slow

ROOT = Path(__file__).resolve().parent.parent


def tiny_args(corpus: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        "--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=64", "--model.max_seq_len=32", "--train.seq_len=32", "--train.batch_size=4",
        "--train.compile=false", "--train.eval_batches=2", "--train.sample_tokens=0", "--train.log_every=1",
        "--optim.warmup_steps=2", f"--data.path={corpus}", f"--data.cache_dir={out_dir.parent}",
        f"--train.out_dir={out_dir}", *extra,
    ]


def run_cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


# fp32 in the fast tier; the amax histories and the asynchronous save (5-6 s each) in the slow one
@pytest.mark.parametrize("extra", [[], pytest.param(["--model.fp8=delayed", "--model.fp8_amax_history=3"], marks=slow),
                                   pytest.param(["--train.async_save=true"], marks=slow)],
                         ids=["fp32", "fp8_delayed", "async_save"])
def test_resume_in_fresh_process_is_bitwise(corpus, tmp_path, extra):
    """8 straight steps == 4 steps, checkpoint, a new process that resumes, 4 more steps. With fp8 delayed
    scaling the amax histories are part of the state: saved, resumed, and the resumed scales are the same.
    With asynchronous saves (written while the next steps run) the files hold the same bits."""
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.steps=8", "--train.ckpt_every=4", "--train.eval_every=4",
                     "--train.keep_checkpoints=5", *extra)
    done = run_cli(args)
    assert done.returncode == 0, done.stderr
    straight = tmp_path / "straight-00000008"
    shutil.move(out / "ckpt-00000008", straight)        # as if the run had died after step 4
    straight_losses = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")}

    resumed = run_cli(args + ["--train.resume=true"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "ckpt-00000004" in resumed.stdout
    records = read_metrics(out / "metrics.jsonl")[8:]
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    for r in records:
        assert r["loss"] == straight_losses[r["step"]]   # bitwise: same floats
    for name in ("params.safetensors", "optim.safetensors"):
        a, b = load_file(straight / name), load_file(out / "ckpt-00000008" / name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resume"
    assert checkpoint.read_meta(out / "ckpt-00000008")["data_position"] == 8 * 4
    if "--model.fp8=delayed" in extra:   # the histories were carried: full (3 steps of amaxes) and moving
        history = load_file(out / "ckpt-00000008" / "params.safetensors")["layers.0.attn.wq.fp8_history"]
        saved = load_file(out / "ckpt-00000004" / "params.safetensors")["layers.0.attn.wq.fp8_history"]
        assert (history > 0).all() and not torch.equal(history, saved)


@slow     # three runs (6 s); a bitwise resume stays in the fast tier
def test_resume_after_toggling_grad_clip(corpus, tmp_path):
    """Optimizer state is named by what it is ("adam.mu.<param>"), not by the position of its transform, so a
    run saved with clipping resumes with --optim.grad_clip=0: the resumed step is bitwise one unclipped
    update of the saved parameters and state on the next batch, computed here in-process."""
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.ckpt_every=1", "--train.eval_every=100", "--train.keep_checkpoints=5")
    first = run_cli(args + ["--train.steps=2", "--optim.grad_clip=0.05"])
    assert first.returncode == 0, first.stderr
    assert all(r["grad_norm"] > 0.05 for r in read_metrics(out / "metrics.jsonl")), "clipping never engaged"
    resumed = run_cli(args + ["--train.steps=3", "--optim.grad_clip=0", "--train.resume=true"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "ckpt-00000002" in resumed.stdout

    cfg = parse_args(args + ["--train.steps=3", "--optim.grad_clip=0"])
    opt = optim.build(cfg.optim, cfg.train.steps)
    like = init(cfg.model, 0)
    params, state, meta = checkpoint.load(out / "ckpt-00000002", like, opt.init(like))
    sampler = TokenSampler(preflight.load_data(cfg).train, cfg.train.seq_len, cfg.train.seed)
    batch = [sampler.batch(meta["data_position"], cfg.train.batch_size)]
    fns = make_step_fns(cfg.model, opt)
    loss, grads, stats = fns.grads(params, batch)
    assert optim.global_norm(grads) > 0.05            # the clipped run would have scaled this update
    params, state = fns.update(grads, state, params)
    got, got_state, _ = checkpoint.load(out / "ckpt-00000003", like, opt.init(like))
    for a, b in zip(tree_leaves((params, state)), tree_leaves((got, got_state))):
        assert torch.equal(a.detach(), b.detach())


@slow
def test_compiled_step_equals_eager():
    cfg = parse_args(["--model.d_model=32", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                      "--model.ffn_dim=64", "--model.max_seq_len=16", "--train.seq_len=16"])
    gen = torch.Generator().manual_seed(0)
    batches = [[(x[:, :-1], x[:, 1:])] for x in (torch.randint(0, 256, (2, 17), generator=gen) for _ in range(3))]
    results = []
    for compiled in (False, True):
        params = init(cfg.model, 0)
        opt = optim.build(cfg.optim, 10)
        state, fns, losses = opt.init(params), make_step_fns(cfg.model, opt, compile=compiled), []
        for micro in batches:
            loss, grads, _ = fns.grads(params, micro)
            params, state = fns.update(grads, state, params)
            losses.append(loss.item())
        results.append((losses, named_leaves(params)))
    (eager_losses, eager_params), (comp_losses, comp_params) = results
    torch.testing.assert_close(torch.tensor(comp_losses), torch.tensor(eager_losses), rtol=1e-5, atol=1e-6)
    for name, p in eager_params.items():
        torch.testing.assert_close(comp_params[name], p, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=slow)], ids=["eager", "compiled"])
def test_update_returns_fresh_leaves_and_memory_stays_flat(compiled):
    """The new parameters carry no autograd history: weight decay reads parameters that require grad,
    and a recorded update chained every step's parameters to the previous ones (an eager run grew by
    ~170 tensors per step until a 24 GB machine ran out)."""
    cfg = parse_args(["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=4", "--model.ffn_dim=64",
                      "--model.max_seq_len=16", "--train.seq_len=16", "--optim.weight_decay=0.1"])
    params = init(cfg.model, 0)
    opt = optim.build(cfg.optim, 10)
    state, fns = opt.init(params), make_step_fns(cfg.model, opt, compile=compiled)
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    counts = []
    for _ in range(4):
        _, grads, _ = fns.grads(params, [(x[:, :-1], x[:, 1:])])
        params, state = fns.update(grads, state, params)
        del grads
        gc.collect()
        counts.append(sum(isinstance(o, torch.Tensor) for o in gc.get_objects()))
    assert all(p.is_leaf and p.grad_fn is None and p.requires_grad for p in named_leaves(params).values())
    assert all(s.grad_fn is None for s in tree_leaves(state) if isinstance(s, torch.Tensor))
    # no growth (a leak grew ~170 tensors a step); in a full suite other tests' tensors may still be freed meanwhile
    assert counts[-1] <= counts[1], counts


def test_grad_accumulation_equals_one_big_batch():
    cfg = parse_args(["--model.d_model=32", "--model.n_layers=1", "--model.n_heads=4", "--model.ffn_dim=64",
                      "--model.max_seq_len=16", "--train.seq_len=16"])
    params = init(cfg.model, 0)
    fns = make_step_fns(cfg.model, optim.build(cfg.optim, 10))
    x = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    loss_big, g_big, _ = fns.grads(params, [(x[:, :-1], x[:, 1:])])
    loss_acc, g_acc, _ = fns.grads(params, [(x[:2, :-1], x[:2, 1:]), (x[2:, :-1], x[2:, 1:])])
    torch.testing.assert_close(loss_acc, loss_big)
    for name, g in named_leaves(g_big).items():
        torch.testing.assert_close(named_leaves(g_acc)[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_nonfinite_loss_stops_and_keeps_last_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = parse_args(tiny_args(corpus, out, "--train.steps=6", "--train.ckpt_every=1", "--optim.lr=1e30",
                               "--optim.grad_clip=0", "--optim.warmup_steps=0", "--train.eval_every=100"))
    with pytest.raises(train_script.NonFiniteLoss, match="last checkpoint .* is intact"):
        train_script.train(cfg, quiet=True)
    last = checkpoint.latest(out)
    logged = read_metrics(out / "metrics.jsonl")
    assert last is not None and logged and checkpoint.read_meta(last)["step"] == logged[-1]["step"] < 6
    params = init(cfg.model, 0)
    loaded, _, _ = checkpoint.load(last, params, optim.build(cfg.optim, 6).init(params))
    assert all(torch.isfinite(p).all() for p in named_leaves(loaded).values())
    assert sorted(p.name for p in out.iterdir()) == sorted([last.name, "metrics.jsonl", "tokenizer"])


def test_nonfinite_loss_skip_leaves_parameters_unchanged(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = parse_args(tiny_args(corpus, out, "--train.steps=5", "--train.ckpt_every=1", "--optim.lr=1e30",
                               "--optim.grad_clip=0", "--optim.warmup_steps=0", "--train.eval_every=100",
                               "--train.keep_checkpoints=10", "--train.on_nonfinite=skip"))
    train_script.train(cfg, quiet=True)
    steps = sorted(int(p.name[5:]) for p in out.glob("ckpt-*"))
    assert steps[-1] == 5
    first_bad = next(s for s in steps if s > 1)     # after a 1e30 update every later loss is non-finite
    a = load_file(out / f"ckpt-{first_bad - 1:08d}" / "params.safetensors")
    b = load_file(out / "ckpt-00000005" / "params.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_rejects_unknown_key_with_valid_keys():
    with pytest.raises(ValueError, match=r"unknown config key 'train.stpes'.*train\.steps"):
        parse_args(["--train.stpes=3"])
    with pytest.raises(ValueError, match=r"unknown config key 'modle'.*model"):
        parse_args(["--modle.d_model=3"])


def test_cli_rejects_wrong_type_naming_the_key():
    with pytest.raises(ValueError, match=r"--train.steps='many' is not a valid int"):
        parse_args(["--train.steps=many"])
    with pytest.raises(ValueError, match=r"--train.compile='maybe' is not a valid bool"):
        parse_args(["--train.compile=maybe"])
    with pytest.raises(ValueError, match=r"unknown config 'nope'; available: .*default"):
        parse_args(["--config=nope"])


def test_cli_overrides_and_validation():
    cfg = parse_args(["--train.steps=7", "--optim.lr=0.5", "--train.compile=false", "--optim.no_decay=*.bias,x"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.train.compile, cfg.optim.no_decay) == (7, 0.5, False, ("*.bias", "x"))
    with pytest.raises(ValueError, match="n_kv_heads=3 must divide model.n_heads=8"):
        parse_args(["--model.n_kv_heads=3"])
    with pytest.raises(ValueError, match="seq_len=512 exceeds model.max_seq_len=256"):
        parse_args(["--train.seq_len=512"])


def test_cli_bad_data_path_fails_before_training(tmp_path):
    done = run_cli(["--data.path=/no/such/file.txt", f"--train.out_dir={tmp_path / 'r'}"])
    assert done.returncode != 0
    assert "error:" in done.stderr and "/no/such/file.txt" in done.stderr
    assert not (tmp_path / "r").exists()


def test_fresh_run_refuses_to_overwrite_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    cfg = parse_args(tiny_args(corpus, out, "--train.steps=1", "--train.eval_every=1"))
    train_script.train(cfg, quiet=True)
    before = (out / "ckpt-00000001" / "params.safetensors").read_bytes()
    with pytest.raises(ValueError, match="already holds checkpoints.*--train.resume=true"):
        train_script.train(cfg, quiet=True)
    assert (out / "ckpt-00000001" / "params.safetensors").read_bytes() == before


# the three that fit this machine run the memory simulation too (3-5 s each): the slow tier's
@pytest.mark.parametrize("name, published", [("llama3_8b", 8_030_261_248),
                                             pytest.param("gpt2_124m", 124_439_808, marks=pytest.mark.slow),
                                             pytest.param("tinyllama_1b", 1_100_048_384, marks=pytest.mark.slow),
                                             pytest.param("qwen3_0_6b", 596_049_920, marks=pytest.mark.slow),
                                             ("mixtral_8x7b", 46_702_792_704), ("qwen3_30b_a3b", 30_532_122_624),
                                             ("qwen3_235b_a22b", 235_093_634_560)])
def test_named_configs_state_published_sizes(name, published, capsys, tmp_path):
    cfg = parse_args([f"--config={name}", f"--train.out_dir={tmp_path}"])
    try:
        preflight.preflight(cfg, torch.device("cpu"))
    except ValueError as err:                      # too big for this machine: said before allocating anything
        assert "GiB" in str(err) and "pick a smaller --config" in str(err)
    assert f"({published:,})" in capsys.readouterr().out


def test_cli_refuses_a_model_larger_than_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(preflight, "available_memory", lambda device: 24 * 2**30)
    with pytest.raises(SystemExit, match="needs at least 120 GiB .* has 24 GiB"):
        train_script.main(["--config=llama3_8b", f"--train.out_dir={tmp_path / 'r'}"])
    assert "8,030,261,248" in capsys.readouterr().out
    assert not (tmp_path / "r").exists()


def test_resume_with_a_different_model_names_the_tensor(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train_script.main(tiny_args(corpus, out, "--train.steps=1", "--train.eval_every=1"))
    with pytest.raises(SystemExit, match=r"tensor 'tok_embed.weight' has shape \(256, 32\) but the model expects \(256, 48\)"):
        train_script.main(tiny_args(corpus, out, "--train.steps=2", "--train.resume=true", "--model.d_model=48"))


def test_every_named_config_parses_and_validates():
    from nanomega.config import available_configs
    names = available_configs()
    assert {"default", "default_muon", "default_soap", "default_shampoo", "default_sgd", "llama3_8b"} <= set(names)
    for name in names:
        cfg = parse_args([f"--config={name}"])
        optim.build(cfg.optim, cfg.train.steps)      # every optimizer config builds


def test_a_config_file_of_ones_own_loads_by_path_and_a_missing_one_is_named(tmp_path):
    """--config=path/to/file.py runs a user's config() (named configs ship inside the package as
    nanomega.configs, so --config=NAME works from any directory: .ci/run checks it from a wheel)."""
    mine = tmp_path / "mine.py"
    mine.write_text("from nanomega.config import Config, ModelConfig\n\n"
                    "def config():\n    return Config(model=ModelConfig(d_model=48, n_heads=4))\n")
    cfg = parse_args([f"--config={mine}", "--model.n_layers=3"])
    assert (cfg.model.d_model, cfg.model.n_layers) == (48, 3)
    with pytest.raises(ValueError, match=r"--config=.*nothere.py: no such file"):
        parse_args([f"--config={tmp_path / 'nothere.py'}"])
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no config"):
        parse_args([f"--config={tmp_path / 'empty.py'}"])


@pytest.mark.parametrize("arg,message", [
    ("--optim.lr=-1", "optim.lr=-1.0 must lie in (0, inf)"),
    ("--optim.lr=nan", "optim.lr=nan must lie in (0, inf)"),
    ("--optim.lr=inf", "optim.lr=inf must lie in (0, inf)"),
    ("--optim.beta1=1.5", "optim.beta1=1.5 must lie in [0, 1)"),
    ("--optim.beta2=1", "optim.beta2=1.0 must lie in [0, 1)"),
    ("--optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must lie in [0, inf)"),
    ("--optim.grad_clip=-1", "optim.grad_clip=-1.0 must lie in [0, inf) (0 disables clipping)"),
    ("--optim.eps=0", "optim.eps=0.0 must lie in (0, inf)"),
    ("--optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5 must lie in [0, 1]"),
    ("--optim.warmup_steps=-5", "optim.warmup_steps=-5 must lie in [0, inf)"),
    ("--train.temperature=-1", "train.temperature=-1.0 must lie in [0, inf) (0 samples greedily)"),
    ("--train.keep_checkpoints=0", "train.keep_checkpoints=0 must lie in [1, inf)"),
    ("--train.top_k=-1", "train.top_k=-1 must lie in [0, inf)"),
    ("--model.norm_eps=0", "model.norm_eps=0.0 must lie in (0, inf)"),
    ("--parallel.bucket_mb=0", "parallel.bucket_mb=0.0 must lie in (0, inf)"),
])
def test_a_setting_out_of_its_range_is_refused_with_the_range(arg, message):
    """By parse_args, or for an optimizer's own setting (beta1: AdamW's) by optim.check, the first check of
    train.py's preflight (validate_layout), before any work."""
    from nanomega.parallel.mesh import validate_layout
    with pytest.raises(ValueError) as err:
        validate_layout(parse_args([arg]))
    assert message in str(err.value)


def outside(interval: str, integer: bool) -> list:
    """Values just outside a setting's interval: below (or at an open) lower bound, above (or at an open)
    upper bound when finite."""
    low, high = (float(x) for x in interval[1:-1].split(","))
    step = 1 if integer else 1e-3 * max(1.0, abs(low))
    values = [low - step if interval[0] == "[" else low]
    if high != float("inf"):
        values.append(high + (1 if integer else 1e-3 * max(1.0, abs(high))) if interval[-1] == "]" else high)
    return [int(v) if integer else v for v in values]


def test_every_range_rule_refuses_the_values_just_outside_it():
    """Every config field with an interval (config.setting), rule by rule: each value just outside it is
    refused, naming the setting and the interval, before any work."""
    import dataclasses
    from nanomega.config import Config
    defaults, ranged, checked = Config(), 0, 0
    for section in dataclasses.fields(defaults):
        for f in dataclasses.fields(getattr(defaults, section.name)):
            key, interval = f"{section.name}.{f.name}", f.metadata.get("interval")
            ranged += bool(interval)
            for value in outside(interval, isinstance(f.default, int)) if interval else []:
                with pytest.raises(ValueError, match=rf"{key}={value}.* must lie in {re.escape(interval)}"):
                    parse_args([f"--{key}={value}"])
                checked += 1
    assert ranged > 30 and checked >= ranged


def test_an_out_dir_that_is_a_file_is_refused_and_resume_without_checkpoints_says_it_starts_fresh(corpus, tmp_path):
    (tmp_path / "afile").write_text("keep me")
    bad = run_cli(tiny_args(corpus, tmp_path / "afile", "--train.steps=1"))
    assert bad.returncode != 0 and "is a file, not a directory" in bad.stderr
    assert (tmp_path / "afile").read_text() == "keep me"
    fresh = run_cli(tiny_args(corpus, tmp_path / "run", "--train.steps=1", "--train.resume=true"))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert "holds no checkpoint: starting from step 0" in fresh.stdout


class HostReads(TorchDispatchMode):
    """Reads of a tensor's value on the host (aten._local_scalar_dense: .item(), float(), .tolist(): on a GPU
    the queue of work drains), per step of train.py: a read belongs to the step whose batch was drawn last.
    The data sampler's own reads are left out: its tensors live on the host and never reach the device."""

    def __init__(self):
        super().__init__()
        self.step, self.in_data, self.per_step = 0, False, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.in_data:
            self.per_step[self.step] += 1
        return func(*args, **(kwargs or {}))


def test_only_logging_steps_read_values_on_the_host(corpus, tmp_path, monkeypatch):
    """Issue 24: the loop read the loss after every backward (.item(), to decide whether to update), so
    every step waited for the device. Finiteness is now decided on the device; steps that neither log,
    evaluate nor save read nothing."""
    reads = HostReads()

    class CountedSampler(TokenSampler):
        def batch(self, position, batch_size):
            reads.step, reads.in_data = position // batch_size + 1, True     # grad_accum 1: one batch a step
            try:
                return super().batch(position, batch_size)
            finally:
                reads.in_data = False

    monkeypatch.setattr(train_script, "TokenSampler", CountedSampler)
    cfg = parse_args(tiny_args(corpus, tmp_path / "run", "--train.steps=8", "--train.log_every=4",
                               "--train.eval_every=8", "--train.ckpt_every=8"))
    with reads:
        train_script.train(cfg, quiet=True)
    assert all(reads.per_step[s] == 0 for s in (1, 2, 3, 5, 6, 7)), dict(reads.per_step)
    assert reads.per_step[4] > 0 and reads.per_step[8] > 0      # the logging steps read the loss and norm


def test_a_nonfinite_step_between_logs_is_stopped_at_the_next_read_and_never_saved(corpus, tmp_path):
    """With the check on the device, a non-finite step between logging steps applies no update and is
    reported at the next logging or checkpoint step, before anything is saved."""
    out = tmp_path / "run"
    cfg = parse_args(tiny_args(corpus, out, "--train.steps=8", "--train.log_every=4", "--train.ckpt_every=4",
                               "--optim.lr=1e30", "--optim.grad_clip=0", "--optim.warmup_steps=0",
                               "--train.eval_every=100"))
    with pytest.raises(train_script.NonFiniteLoss, match=r"not finite at step 2; .*last checkpoint .* is intact"):
        train_script.train(cfg, quiet=True)
    assert checkpoint.latest(out) is None and not (out / "metrics.jsonl").exists()


def test_deterministic_is_set_before_the_first_step(corpus, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kw: calls.append(("deterministic", mode)))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")       # restored as it was when the test ends
    make_step_fns = train_script.make_step_fns

    def recording(*args, **kwargs):
        fns = make_step_fns(*args, **kwargs)
        return fns._replace(grads=lambda *a: (calls.append("step"), fns.grads(*a))[1])
    monkeypatch.setattr(train_script, "make_step_fns", recording)
    train_script.train(parse_args(tiny_args(corpus, tmp_path / "a", "--train.steps=1")), quiet=True)
    assert calls == ["step"]            # off by default
    calls.clear()
    train_script.train(parse_args(tiny_args(corpus, tmp_path / "b", "--train.steps=1", "--train.deterministic=true")),
                       quiet=True)
    assert calls == [("deterministic", True), "step"]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"   # before any cuBLAS call, as cuBLAS requires


def test_deterministic_refuses_a_nondeterministic_cublas_setting_and_warns_about_compile(monkeypatch):
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda mode, **kw: None)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    cfg = parse_args(["--train.deterministic=true", "--train.compile=false"])
    with pytest.raises(ValueError, match=r"CUBLAS_WORKSPACE_CONFIG.*':0:0'.*set CUBLAS_WORKSPACE_CONFIG=:4096:8"):
        train_script.make_deterministic(cfg.train)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.warns(UserWarning, match="compiled CPU backward .* --train.compile=false"):
        train_script.make_deterministic(parse_args(["--train.deterministic=true"]).train)
