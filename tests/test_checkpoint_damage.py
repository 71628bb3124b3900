"""Damaged inputs a real job meets: a checkpoint file truncated or corrupted after it was saved
(nanomega/checkpoint/integrity.py, policy: refuse, naming the file and the newest intact checkpoint), and a
Hugging Face config.json without the fields its family needs (nanomega/config/hf_folder.py).

The checkpoints are written by the real saver (checkpoint.save, one process); the damage is done to their bytes
as a cut-short copy or a bad sector would. Each refusal must come before any tensor is read and leave every
saved file where it was.
"""
from __future__ import annotations

import json
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from nanomega import checkpoint
from nanomega.checkpoint import CheckpointDamaged
from nanomega.config import ModelConfig, parse_args
from nanomega.config.hf_folder import model_fields_from_hf, model_from_hf
from nanomega.run.metrics import read_metrics
from nanomega.run.preflight import preflight
from nanomega.tree import named_leaves
from test_checkpoint import like, trained
from test_train import run_cli, tiny_args
from tiers import slow


def two_checkpoints(out: Path):
    """ckpt-00000002 and ckpt-00000004 written by checkpoint.save; the trees each holds."""
    saved = {}
    for step in (2, 4):
        params, state = trained(updates=step)
        checkpoint.save(out, step, params, state, {"data_position": step}, keep=5)
        saved[step] = params
    return saved


def truncate(file: Path, by: int = 7) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-by])


def flip(file: Path, at: int) -> None:
    data = bytearray(file.read_bytes())
    data[at] ^= 0x01
    file.write_bytes(bytes(data))


def files_of(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def flip_in_a_name(file: Path) -> None:
    """One bit of a tensor's name in the header: still valid JSON, valid offsets; only the checksum sees it."""
    text = file.read_bytes()
    flip(file, text.index(b"layers.0.") + 1)      # 'a' -> '`'


def flip_a_brace(file: Path) -> None:
    """The header's opening brace: no longer JSON."""
    flip(file, 8)


def flip_in_the_data(file: Path) -> None:
    """One bit of the last tensor's data: header and lengths intact; only the checksum sees it."""
    flip(file, file.stat().st_size - 3)


@pytest.mark.parametrize("damage,file,says", [
    (truncate, "params.safetensors", "truncated"),
    (truncate, "optim.safetensors", "truncated"),
    (flip_a_brace, "params.safetensors", "not valid JSON"),
    (flip_in_a_name, "params.safetensors", "CRC-32"),
    (flip_in_the_data, "params.safetensors", "CRC-32"),
    (flip_in_the_data, "optim.safetensors", "CRC-32"),
])
def test_a_damaged_latest_checkpoint_is_refused_naming_the_file_and_the_newest_intact_one(tmp_path, damage, file,
                                                                                         says):
    out = tmp_path / "run"
    saved = two_checkpoints(out)
    damaged = out / "ckpt-00000004"
    damage(damaged / file)
    before = files_of(out)
    with pytest.raises(CheckpointDamaged) as refused:
        checkpoint.load(checkpoint.latest(out), *like())
    message = str(refused.value)
    assert file in message and says in message and str(out / "ckpt-00000002") in message, message
    assert f"mv {damaged} {damaged}.damaged" in message
    assert files_of(out) == before         # nothing saved is lost: the damaged checkpoint and the older one stay

    # The way the message gives: move it aside; the newest intact checkpoint loads, as saved.
    damaged.rename(f"{damaged}.damaged")
    params, _, meta = checkpoint.load(checkpoint.latest(out), *like())
    assert meta["step"] == 2
    for name, x in named_leaves(saved[2]).items():
        assert torch.equal(named_leaves(params)[name], x), name
    # ...and the next save (with pruning) keeps the damaged copy, whose name no cleanup matches.
    params, state = trained(updates=2)
    checkpoint.save(out, 4, params, state, {"data_position": 4}, keep=1)
    assert (out / "ckpt-00000004.damaged" / file).read_bytes() == before[Path("ckpt-00000004") / file]


def test_without_the_checksums_a_corrupted_data_byte_loads_silently(tmp_path):
    """Why the checksum: safetensors itself reads a flipped data bit as a different value, without a word."""
    out = tmp_path / "run"
    saved = two_checkpoints(out)
    path = out / "ckpt-00000004"
    flip_in_the_data(path / "params.safetensors")
    with safe_open(str(path / "params.safetensors"), framework="pt") as f:
        differ = [n for n in f.keys() if not torch.equal(f.get_tensor(n), named_leaves(saved[4])[n])]
    assert len(differ) == 1


def test_a_checkpoint_saved_before_checksums_is_still_checked_by_its_header(tmp_path):
    """meta.json without "files" (written before integrity.py): a truncation is found from the header's offsets."""
    out = tmp_path / "run"
    two_checkpoints(out)
    for step in (2, 4):
        meta_file = out / f"ckpt-{step:08d}" / "meta.json"
        meta = json.loads(meta_file.read_text())
        del meta["files"]
        meta_file.write_text(json.dumps(meta))
    truncate(out / "ckpt-00000004" / "params.safetensors", by=1)
    with pytest.raises(CheckpointDamaged, match=r"params.safetensors has \d+ bytes, but its header says .*truncated"):
        checkpoint.load(checkpoint.latest(out), *like())
    checkpoint.load(out / "ckpt-00000002", *like())      # intact: loads


def test_a_damaged_meta_json_and_no_intact_checkpoint_say_so(tmp_path):
    out = tmp_path / "run"
    two_checkpoints(out)
    shutil.rmtree(out / "ckpt-00000002")
    (out / "ckpt-00000004" / "meta.json").write_text('{"format": 2, "step"')     # cut short
    with pytest.raises(CheckpointDamaged, match="meta.json cannot be read as JSON.*holds no intact checkpoint"):
        checkpoint.load(out / "ckpt-00000004", *like())


def test_the_saver_records_each_file_length_and_crc32(tmp_path):
    """Against zlib over the bytes on disk, computed here."""
    out = tmp_path / "run"
    two_checkpoints(out)
    path = out / "ckpt-00000004"
    recorded = checkpoint.read_meta(path)["files"]
    assert recorded == {name: {"bytes": (path / name).stat().st_size, "crc32": zlib.crc32((path / name).read_bytes())}
                        for name in ("params.safetensors", "optim.safetensors")}


def test_a_parallel_save_records_every_rank_file_and_each_rank_checksums_the_files_it_reads(tmp_path):
    """Two ranks as threads through the real sharded save (agreement by a barrier): meta.json records all four
    files against zlib computed here; a rank in the checkpoint's own layout checksums its own files only, and
    every rank checks every file's header and length."""
    out, (params, state) = tmp_path / "run", trained(updates=2)
    barrier, votes = threading.Barrier(2), [None, None]

    def agree_of(rank):
        def agree(ok):
            votes[rank] = ok
            barrier.wait()
            answer = all(votes)
            barrier.wait()
            return answer
        return agree
    ranks = [threading.Thread(target=checkpoint.save, args=(out, 2, params, state, {}, 5),
                              kwargs=dict(rank=r, world_size=2, agree=agree_of(r))) for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    path = out / "ckpt-00000002"
    names = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(names) == 4 and not list(path.glob("sums-*"))
    assert checkpoint.read_meta(path)["files"] == {name: {"bytes": (path / name).stat().st_size,
                                                          "crc32": zlib.crc32((path / name).read_bytes())}
                                                   for name in names}
    flip_in_the_data(path / "params-rank00001.safetensors")
    checkpoint.load(path, *like(), rank=0, world_size=2)           # rank 0 does not read rank 1's file
    with pytest.raises(CheckpointDamaged, match="params-rank00001.safetensors does not match the CRC-32"):
        checkpoint.load(path, *like(), rank=1, world_size=2)
    with pytest.raises(CheckpointDamaged, match="params-rank00001.safetensors does not match the CRC-32"):
        checkpoint.load(path, *like())                              # resharding into one process reads any file
    truncate(path / "params-rank00001.safetensors")
    with pytest.raises(CheckpointDamaged, match="params-rank00001.safetensors has .*truncated"):
        checkpoint.load(path, *like(), rank=0, world_size=2)       # a length is checked by every rank


@slow     # two train.py runs (9 s); the loader's refusals of each damage stay in the fast tier
def test_train_py_refuses_to_resume_from_a_damaged_checkpoint_and_resumes_after_the_move(corpus, tmp_path):
    """As a user meets it: train.py saved steps 2 and 4; a file of step 4 is cut short."""
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.steps=4", "--train.ckpt_every=2", "--train.eval_every=100",
                     "--train.keep_checkpoints=5")
    assert run_cli(args).returncode == 0
    truncate(out / "ckpt-00000004" / "params.safetensors", by=100)
    with pytest.raises(CheckpointDamaged, match="params.safetensors has .*truncated"):    # before data and params
        preflight(parse_args([*args, "--train.resume=true"]), torch.device("cpu"))
    refused = run_cli([*args, "--train.steps=6", "--train.resume=true"])
    assert refused.returncode != 0
    assert "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "params.safetensors" in refused.stderr and "ckpt-00000002" in refused.stderr, refused.stderr[-2000:]
    command = refused.stderr.split("`")[1]           # the command the message gives
    assert command.startswith("mv ")
    Path(command.split()[1]).rename(command.split()[2])
    resumed = run_cli([*args, "--train.steps=6", "--train.resume=true"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "ckpt-00000002 at step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r][-1] == 6
    assert (out / "ckpt-00000004.damaged" / "params.safetensors").is_file()


# ---------------------------------------------------------------- Hugging Face config.json


def hf_config_json(family: str) -> dict:
    """A tiny config.json as transformers writes it for `family` (save_pretrained of a random-init model)."""
    transformers = pytest.importorskip("transformers")
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
    cfg = cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=32)
    return json.loads(cfg.to_json_string())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("missing", [["vocab_size"], ["vocab_size", "num_attention_heads"]])
def test_a_config_json_without_a_field_its_family_needs_names_the_file_the_fields_and_the_family(tmp_path, family,
                                                                                                  missing):
    folder = tmp_path / family
    folder.mkdir()
    whole = hf_config_json(family)
    model_fields_from_hf(whole)                     # the whole one reads
    (folder / "config.json").write_text(json.dumps({k: v for k, v in whole.items() if k not in missing}))
    with pytest.raises(ValueError) as refused:
        model_from_hf(str(folder), ModelConfig(), [])
    message = str(refused.value)
    assert str(folder / "config.json") in message and family in message, message
    assert all(field in message for field in missing), message
    assert "KeyError" not in type(refused.value).__name__


def test_resharding_ranks_share_the_checksums_so_each_file_is_read_in_full_once():
    """Loading in another layout, each of N ranks checksums every N-th file: the shares are disjoint and cover
    every recorded file (a job of many ranks does not read the whole checkpoint once per rank); in the
    checkpoint's own layout a rank checks its own two files; one process checks all (None)."""
    from nanomega.checkpoint.files import rank_files
    from nanomega.checkpoint.loading import _read_whole
    files = {name: {} for r in range(4) for name in rank_files(r)}          # written by 4 ranks
    meta = {"world_size": 4, "layout": {"dp_shard": 4}, "files": files}
    for world in (2, 3, 8):
        shares = [_read_whole(meta, r, world, {"dp_shard": world}) for r in range(world)]
        assert sum(len(s) for s in shares) == len(files) and set().union(*shares) == set(files)
    assert _read_whole(meta, 1, 4, {"dp_shard": 4}) == set(rank_files(1))
    assert _read_whole(meta, 0, 1, None) is None
