"""Tests for nanomega.checkpoint: bitwise round trips, retention, crash safety and mismatch errors."""
import dataclasses
import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nanomega import checkpoint, optim
from nanomega.config import Config, ModelConfig, from_dict, to_dict
from nanomega.models.transformer import init, loss_fn
from nanomega.optim import apply_updates
from nanomega.tree import named_leaves, tree_flatten, tree_leaves, tree_unflatten

TINY = Config(model=ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16))


def fresh(cfg=TINY, seed=0):
    params = init(cfg.model, seed)
    opt = optim.build(cfg.optim, total_steps=10)
    return params, opt, opt.init(params)


def like(cfg=TINY):
    """Freshly initialized (params, opt_state): what a resuming run passes to load."""
    params, _, state = fresh(cfg)
    return params, state


def trained(cfg=TINY, updates=2):
    """Params and AdamW state after real updates, so moments and counts are non-trivial."""
    params, opt, state = fresh(cfg, seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(updates):
        grads = [torch.randn(p.shape, generator=gen) for p in tree_leaves(params)]
        grads = tree_unflatten(grads, tree_flatten(params)[1])
        updates_, state = opt.update(grads, state, params)
        params = apply_updates(params, updates_)
    return params, state


def meta(step=0):
    return {"step": step, "data_position": 123 * step, "rng": checkpoint.rng_state(), "config": to_dict(TINY)}


def assert_bitwise_equal(a, b):
    na, nb = named_leaves(a), named_leaves(b)
    assert list(na) == list(nb)
    for name in na:
        assert na[name].dtype == nb[name].dtype, name
        assert torch.equal(na[name], nb[name]), name


def steps_in(out_dir):
    return sorted(p.name for p in out_dir.iterdir())


# ---------------------------------------------------------------- round trips

def test_round_trip_is_bitwise_and_keeps_structure(tmp_path):
    params, state = trained()
    path = checkpoint.save(tmp_path, 7, params, state, meta(7), keep=2)
    assert path == tmp_path / "ckpt-00000007"
    assert {p.name for p in path.iterdir()} == {"params.safetensors", "optim.safetensors", "meta.json"}

    like_params, _, like_state = fresh()
    got_params, got_state, got_meta = checkpoint.load(path, like_params, like_state)
    assert_bitwise_equal(got_params, params)
    assert_bitwise_equal(got_state, state)
    assert tree_flatten(got_params)[1] == tree_flatten(params)[1]
    assert tree_flatten(got_state)[1] == tree_flatten(state)[1]     # NamedTuple types survive
    assert type(got_state["adam"]).__name__ == "AdamState" and got_state["adam"].count.item() == 2
    for p in tree_leaves(got_params):
        assert p.is_leaf and p.requires_grad
    assert got_meta["step"] == 7 and got_meta["data_position"] == 7 * 123


def test_files_are_keyed_by_dotted_names(tmp_path):
    params, state = trained(updates=1)
    path = checkpoint.save(tmp_path, 1, params, state, meta(1), keep=1)
    with safe_open(str(path / "optim.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("adam.count").shape == ()
    assert {"adam.count", "adam.mu.layers.0.attn.wq.weight", "adam.nu.lm_head.weight"} <= keys
    with safe_open(str(path / "params.safetensors"), "pt") as f:
        assert set(f.keys()) == set(named_leaves(params))


def test_loaded_params_train_on(tmp_path):
    params, state = trained()
    path = checkpoint.save(tmp_path, 2, params, state, meta(2), keep=1)
    got, _, _ = checkpoint.load(path, *like())
    tokens = torch.randint(0, 256, (2, 8))
    loss_fn(got, tokens, tokens, TINY.model).backward()
    assert got["layers"][0]["attn"]["wq"]["weight"].grad is not None


def test_meta_round_trip_with_config(tmp_path):
    cfg = dataclasses.replace(TINY, train=dataclasses.replace(TINY.train, seed=5))
    params, _, state = fresh()
    m = {"data_position": 4096, "rng": checkpoint.rng_state(), "config": to_dict(cfg)}
    path = checkpoint.save(tmp_path, 3, params, state, m, keep=1)
    got = checkpoint.read_meta(path)
    assert got["format"] == 2 and got["world_size"] == 1 and got["step"] == 3 and got["data_position"] == 4096
    assert from_dict(got["config"]) == cfg
    assert checkpoint.load(path, params, state)[2] == got


def test_rng_round_trip():
    torch.manual_seed(1)
    random.seed(1)
    state = json.loads(json.dumps(checkpoint.rng_state()))     # must survive JSON
    expected = (torch.rand(5), torch.randint(0, 1000, (5,)), [random.random() for _ in range(3)])
    torch.manual_seed(99)
    random.seed(99)
    checkpoint.set_rng_state(state)
    got = (torch.rand(5), torch.randint(0, 1000, (5,)), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


# ---------------------------------------------------------------- retention and discovery

def test_keep_last_k(tmp_path):
    params, _, state = fresh()
    for step in (10, 20, 30, 40, 50):
        checkpoint.save(tmp_path, step, params, state, meta(step), keep=3)
    assert steps_in(tmp_path) == ["ckpt-00000030", "ckpt-00000040", "ckpt-00000050"]
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-00000050"


def test_keep_never_deletes_the_checkpoint_just_written(tmp_path):
    params, _, state = fresh()
    for step in (10, 20):
        checkpoint.save(tmp_path, step, params, state, meta(step), keep=2)
    checkpoint.save(tmp_path, 5, params, state, meta(5), keep=2)     # a rerun from an earlier step
    assert steps_in(tmp_path) == ["ckpt-00000005", "ckpt-00000020"]


def test_resaving_a_step_replaces_it(tmp_path):
    params, state = trained(updates=1)
    checkpoint.save(tmp_path, 4, *like(), meta(4), keep=2)
    path = checkpoint.save(tmp_path, 4, params, state, meta(4), keep=2)
    assert steps_in(tmp_path) == ["ckpt-00000004"]
    assert_bitwise_equal(checkpoint.load(path, *like())[0], params)


def test_latest_ignores_tmp_and_incomplete_dirs(tmp_path):
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    params, _, state = fresh()
    checkpoint.save(tmp_path, 100, params, state, meta(100), keep=5)
    stale = tmp_path / "ckpt-00000300.tmp-99999999"                   # a crashed writer's leftovers
    stale.mkdir()
    (stale / "meta.json").write_text("{}")
    (tmp_path / "ckpt-00000200").mkdir()                               # no meta.json: incomplete
    (tmp_path / "ckpt-00000200" / "params.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-00000100"
    checkpoint.save(tmp_path, 150, params, state, meta(150), keep=5)
    assert not stale.exists()                                          # the next save cleans it up
    assert checkpoint.latest(tmp_path) == tmp_path / "ckpt-00000150"


# ---------------------------------------------------------------- crash safety

@pytest.mark.parametrize("fail_on_call", [1, 2])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch, fail_on_call):
    params, state = trained()
    good = checkpoint.save(tmp_path, 10, params, state, meta(10), keep=1)
    real, calls = checkpoint.saving.save_file, []

    def crashing_save_file(tensors, filename):
        calls.append(filename)
        if len(calls) == fail_on_call:
            with open(filename, "wb") as f:
                f.write(b"half a file")                               # a partial write, then the crash
            raise OSError("disk full")
        real(tensors, filename)

    monkeypatch.setattr(checkpoint.saving, "save_file", crashing_save_file)
    new_params, new_state = trained(updates=3)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 20, new_params, new_state, meta(20), keep=1)
    assert steps_in(tmp_path) == ["ckpt-00000010"]                     # no final-named partial dir, no tmp
    assert checkpoint.latest(tmp_path) == good
    got_params, got_state, _ = checkpoint.load(good, *like())
    assert_bitwise_equal(got_params, params)
    assert_bitwise_equal(got_state, state)


def test_failed_rename_while_resaving_same_step_restores_old_copy(tmp_path, monkeypatch):
    params, state = trained()
    good = checkpoint.save(tmp_path, 10, params, state, meta(10), keep=1)
    real_rename = Path.rename

    def rename(self, target):
        if ".tmp-" in self.name:                                       # the old copy is already aside
            raise OSError("rename failed")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        checkpoint.save(tmp_path, 10, *like(), meta(10), keep=1)
    monkeypatch.undo()
    assert steps_in(tmp_path) == ["ckpt-00000010"]
    assert_bitwise_equal(checkpoint.load(good, *like())[0], params)


def test_interrupted_replace_is_recovered(tmp_path):
    """A crash between moving the old copy aside and renaming the new one in loses nothing."""
    params, _, state = fresh()
    checkpoint.save(tmp_path, 10, params, state, meta(10), keep=5)
    os.rename(tmp_path / "ckpt-00000010", tmp_path / "ckpt-00000010.old-99999999")
    checkpoint.save(tmp_path, 20, params, state, meta(20), keep=5)
    assert steps_in(tmp_path) == ["ckpt-00000010", "ckpt-00000020"]


# ---------------------------------------------------------------- asynchronous saves

def test_async_save_writes_the_state_of_its_call_while_training_changes_it(tmp_path):
    """The host copy is taken before save returns: in-place changes afterwards (the next steps) do not
    reach the files, which hold the bits a synchronous save writes."""
    params, state = trained()
    want_params = tree_unflatten([p.detach().clone() for p in tree_leaves(params)], tree_flatten(params)[1])
    want_state = tree_unflatten([t.clone() for t in tree_leaves(state)], tree_flatten(state)[1])
    sync = checkpoint.save(tmp_path / "sync", 10, params, state, meta(10), keep=2)
    saver = checkpoint.Saver(background=True)
    path = saver.save(tmp_path / "async", 10, params, state, meta(10), keep=2)
    with torch.no_grad():
        for t in tree_leaves(params) + tree_leaves(state):
            t.add_(1)                                 # training moves on while the thread writes
    saver.wait()
    got_params, got_state, got_meta = checkpoint.load(path, *like())
    assert_bitwise_equal(got_params, want_params)
    assert_bitwise_equal(got_state, want_state)
    assert got_meta == checkpoint.read_meta(sync)
    for name in (checkpoint.PARAMS_FILE, checkpoint.OPTIM_FILE):
        assert (path / name).read_bytes() == (sync / name).read_bytes()


def test_async_save_failure_is_raised_by_the_next_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    params, state = trained()
    saver = checkpoint.Saver(background=True)
    good = saver.save(tmp_path, 10, params, state, meta(10), keep=1)
    saver.wait()
    real = checkpoint.saving.save_file

    def full_disk(tensors, filename, **kwargs):
        if "ckpt-00000020" in filename:
            raise OSError(28, "No space left on device (injected)")
        real(tensors, filename, **kwargs)
    monkeypatch.setattr(checkpoint.saving, "save_file", full_disk)
    saver.save(tmp_path, 20, params, state, meta(20), keep=1)          # returns: the failure is in the thread
    with pytest.raises(OSError, match="No space left"):
        saver.save(tmp_path, 30, params, state, meta(30), keep=1)     # raised before anything else is written
    assert steps_in(tmp_path) == ["ckpt-00000010"]
    assert checkpoint.latest(tmp_path) == good
    saver.wait()                                                       # the error was raised once
    saver.save(tmp_path, 30, params, state, meta(30), keep=1)
    saver.wait()
    assert steps_in(tmp_path) == ["ckpt-00000030"]


# ---------------------------------------------------------------- mismatch errors

def test_shape_mismatch_names_the_tensor(tmp_path):
    params, _, state = fresh()
    path = checkpoint.save(tmp_path, 100, params, state, meta(100), keep=1)
    bigger = dataclasses.replace(TINY, model=dataclasses.replace(TINY.model, d_model=64))
    like_params, _, like_state = fresh(bigger)
    with pytest.raises(ValueError, match=r"ckpt-00000100 tensor 'tok_embed.weight' has shape \(256, 32\) "
                                         r"but the model expects \(256, 64\).*different config"):
        checkpoint.load(path, like_params, like_state)


def test_dtype_mismatch_names_the_tensor(tmp_path):
    params, _, state = fresh()
    path = checkpoint.save(tmp_path, 1, params, state, meta(1), keep=1)
    like = {**params, "final_norm": {"weight": params["final_norm"]["weight"].to(torch.bfloat16)}}
    with pytest.raises(ValueError, match=r"'final_norm.weight' has dtype torch.float32 but the model expects"):
        checkpoint.load(path, like, state)


def test_missing_tensor_is_named(tmp_path):
    params, _, state = fresh()
    del params["lm_head"]
    path = checkpoint.save(tmp_path, 1, params, state, meta(1), keep=1)
    with pytest.raises(ValueError, match=r"lacks tensor 'lm_head.weight'.*the model expects"):
        checkpoint.load(path, *like())


def test_extra_tensor_is_named(tmp_path):
    params, _, state = fresh()
    params["pos_embed"] = {"weight": torch.zeros(16, 32)}
    path = checkpoint.save(tmp_path, 1, params, state, meta(1), keep=1)
    with pytest.raises(ValueError, match=r"has tensor 'pos_embed.weight'.*which the model does not have"):
        checkpoint.load(path, *like())


def test_optimizer_state_mismatch_is_named(tmp_path):
    params, _, state = fresh()
    path = checkpoint.save(tmp_path, 1, params, state, meta(1), keep=1)
    sgd_cfg = dataclasses.replace(TINY, optim=dataclasses.replace(TINY.optim, name="sgd"))
    like_params, _, like_state = fresh(sgd_cfg)
    with pytest.raises(ValueError, match=r"lacks tensor 'momentum\.trace\.tok_embed\.weight'.*the optimizer state expects"):
        checkpoint.load(path, like_params, like_state)


def test_meta_device_like_tree_loads_onto_cpu(tmp_path):
    params, state = trained()
    path = checkpoint.save(tmp_path, 2, params, state, meta(2), keep=1)
    shapes_only = init(TINY.model, device="meta")
    got_params, got_state, _ = checkpoint.load(path, shapes_only, optim.build(TINY.optim, 10).init(shapes_only))
    assert_bitwise_equal(got_params, params)
    assert_bitwise_equal(got_state, state)


# ---------------------------------------------------------------- older checkpoints: refused, saying what to do

def test_a_format1_checkpoint_is_refused_naming_the_commit_that_reads_it(tmp_path):
    """Format 1 named optimizer state by its position in the chain; this version no longer renames it. Refused
    before any tensor is read, parameters-only loads included."""
    params, state = trained()
    path = checkpoint.save(tmp_path, 2, params, state, meta(2), keep=1)
    stored = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**stored, "format": 1}))
    for opt_state in (state, None):
        with pytest.raises(checkpoint.CheckpointMismatch, match=r"ckpt-00000002 is format 1 .*'1\.mu\.<param>'.*no "
                                                                r"longer reads; retrain, or resume it with nanomega "
                                                                r"at commit 12e7aa1"):
            checkpoint.load(path, params, opt_state)
    (path / "meta.json").write_text(json.dumps({**stored, "format": 3}))
    with pytest.raises(checkpoint.CheckpointMismatch, match="has format 3; this version reads format 2 only"):
        checkpoint.load(path, params, state)


def as_parallel(path: Path, world_size: int, boxes: bool) -> None:
    """Turn a serial checkpoint into a data-parallel one of world_size replicas (every rank file holds the
    whole tensors), its rank files recording where their pieces lie (boxes=True, as saved since resharding
    exists) or not (as saved before); meta.json's file sums follow."""
    from safetensors.torch import load_file, save_file
    from nanomega.checkpoint.integrity import file_sums
    stored = json.loads((path / "meta.json").read_text())
    sums = {}
    for kind, rank_file in ((checkpoint.PARAMS_FILE, "params"), (checkpoint.OPTIM_FILE, "optim")):
        tensors = load_file(str(path / kind))
        where = {"nanomega.boxes": json.dumps({n: [list(t.shape), [0] * t.ndim] for n, t in tensors.items()})}
        for rank in range(world_size):
            file = path / f"{rank_file}-rank{rank:05d}.safetensors"
            save_file(tensors, str(file), metadata=where if boxes else None)
            sums[file.name] = file_sums(file)
        (path / kind).unlink()
    layout = {"dp_replicate": world_size}
    (path / "meta.json").write_text(json.dumps({**stored, "world_size": world_size, "layout": layout, "files": sums}))


@pytest.mark.parametrize("boxes", [True, False])
def test_a_parallel_checkpoint_from_before_resharding_is_refused(tmp_path, boxes):
    """The same data-parallel checkpoint with and without its pieces' places: with them it loads into one
    process (resharding); without them (written before resharding existed) it is refused, in any layout."""
    params, state = trained()
    path = checkpoint.save(tmp_path, 2, params, state, meta(2), keep=1)
    as_parallel(path, 2, boxes)
    if boxes:
        got_params, got_state, _ = checkpoint.load(path, *like())
        assert_bitwise_equal(got_params, params)
        assert_bitwise_equal(got_state, state)
        return
    for where in ({}, {"rank": 0, "world_size": 2, "layout": {"dp_replicate": 2}}):
        with pytest.raises(checkpoint.CheckpointMismatch, match=r"written by a parallel run before resharding "
                                                                r"existed .*retrain, or resume it with nanomega at "
                                                                r"commit 12e7aa1.*world_size 2"):
            checkpoint.load(path, *like(), **where)


@pytest.mark.parametrize("change, message", [
    ({"format": 1}, r"is format 1 .*no longer reads; retrain, or resume it with nanomega at commit 12e7aa1"),
    ({"data_order": "randperm"}, r"drew its batches in data order 'randperm' .*no longer draws.*commit 12e7aa1"),
    ({"data_order": None}, r"drew its batches in data order 'randperm'"),      # runs before the shuffle stored none
])
def test_resuming_a_run_from_an_older_checkpoint_is_refused_before_any_work(corpus, tmp_path, monkeypatch, change,
                                                                            message):
    """train.py's preflight reads the latest checkpoint's meta.json before data or parameters are touched."""
    import train as train_script
    from nanomega.config import parse_args
    from test_train import tiny_args
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.steps=2", "--train.ckpt_every=2", "--train.eval_every=100")
    train_script.train(parse_args(args), quiet=True)
    path = checkpoint.latest(out)
    stored = json.loads((path / "meta.json").read_text())
    assert stored["data_order"] == "shuffle"
    changed = {k: v for k, v in {**stored, **change}.items() if v is not None}
    (path / "meta.json").write_text(json.dumps(changed))
    touched = []
    monkeypatch.setattr(train_script, "setup", lambda cfg, device: touched.append("setup"))
    with pytest.raises(ValueError, match=message):
        train_script.train(parse_args(args + ["--train.resume=true", "--train.steps=4"]), quiet=True)
    assert touched == []
