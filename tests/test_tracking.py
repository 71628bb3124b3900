"""--train.tracker: TensorBoard's and wandb's own files, read back with their own readers, hold metrics.jsonl's
numbers step by step; a missing package stops the run before any work; validation bits per byte."""
from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train as train_script
from nanomega.config import parse_args, to_dict
from nanomega.run.metrics import bits_per_byte, bytes_per_token, read_metrics
from test_train import tiny_args


def expected_scalars(records: list[dict]) -> dict[int, dict[str, float]]:
    """step -> every number metrics.jsonl holds for it, written out here rather than by tracking.scalars
    (lists, one value per MoE layer, as name/i)."""
    out = {}
    for record in records:
        row = out[record["step"]] = {}
        for key, value in record.items():
            values = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, v in values:
                if key != "step" and isinstance(v, (int, float)):
                    row[key if i is None else f"{key}/{i}"] = float(v)
    return out


def three_steps(corpus: Path, out: Path, tracker: str, *extra: str):
    """3 steps, every one logged, the validation loss at steps 2 and 3."""
    return parse_args(tiny_args(corpus, out, "--train.steps=3", "--train.eval_every=2", f"--train.tracker={tracker}",
                                *extra))


MOE = ("--model.n_experts=4", "--model.top_k=2")     # per-layer lists in the record: expert_load_cv/0, ...


@pytest.mark.parametrize("extra", [(), MOE], ids=["dense", "moe"])
def test_tensorboard_events_equal_metrics_jsonl(corpus, tmp_path, extra):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "run"
    train_script.train(three_steps(corpus, out, "tensorboard", *extra), quiet=True)
    expected = expected_scalars(read_metrics(out / "metrics.jsonl"))
    assert sorted(expected) == [1, 2, 3] and "val_bpb" in expected[3] and "grad_norm" in expected[1]
    assert ("expert_load_cv/1" in expected[1]) == bool(extra)

    events = event_accumulator.EventAccumulator(str(out / "tb"), size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    assert sorted(got) == sorted(expected)
    for step, values in expected.items():
        assert sorted(got[step]) == sorted(values), step
        for tag, value in values.items():   # an event stores a float32: exactly metrics.jsonl's value, rounded
            assert got[step][tag] == float(np.float32(value)), (step, tag)


def wandb_records(path: Path):
    """The protobuf records of a .wandb run file: W&B's LevelDB-style log, a 7-byte file header (":W&B", magic,
    version) then 32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last) and its bytes; a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2
    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", data[:7]
    pos, pending = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:
            break
        pending += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline_run_equals_metrics_jsonl(corpus, tmp_path, monkeypatch):
    """Offline (no network): the run file's history rows are metrics.jsonl's records, the run is named after
    out_dir and holds the config."""
    pytest.importorskip("wandb", reason="wandb is an optional extra (pip install wandb), not in .[test]")
    import json
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    out = tmp_path / "tiny-run"
    cfg = three_steps(corpus, out, "wandb")
    train_script.train(cfg, quiet=True)
    expected = expected_scalars(read_metrics(out / "metrics.jsonl"))

    (run_file,) = (tmp_path / "wandb_dir").glob("wandb/offline-run-*/run-*.wandb")
    got, run = {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            got[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    assert got == expected                  # JSON floats: the same doubles, exactly
    assert run.display_name == "tiny-run"
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == json.loads(json.dumps(to_dict(cfg)))


@pytest.mark.parametrize("tracker,module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_missing_package_stops_before_any_work(corpus, tmp_path, monkeypatch, tracker, module):
    """The package made unimportable: train() refuses before data, parameters or out_dir are touched, and the
    command line says what to install."""
    monkeypatch.setitem(sys.modules, module, None)          # `import module` now raises ImportError
    touched = []
    monkeypatch.setattr(train_script, "load_data", lambda cfg: touched.append("data"))
    monkeypatch.setattr(train_script, "setup", lambda cfg, device: touched.append("setup"))
    out = tmp_path / "run"
    args = tiny_args(corpus, out, "--train.steps=3", f"--train.tracker={tracker}")
    with pytest.raises(ValueError, match=rf"pip install {tracker}"):
        train_script.train(parse_args(args), quiet=True)
    with pytest.raises(SystemExit, match=rf"error: --train.tracker={tracker} needs .* pip install {tracker}"):
        train_script.main(args)
    assert touched == [] and not out.exists()


def test_unknown_tracker_is_refused_by_config():
    with pytest.raises(ValueError, match="train.tracker='mlflow' is not one of"):
        parse_args(["--train.tracker=mlflow"])


def test_val_bpb_is_val_loss_over_ln2_for_bytes(corpus, tmp_path):
    """The byte tokenizer: a token is a byte, so bits per byte = nats per token / ln 2."""
    record = train_script.train(three_steps(corpus, tmp_path / "run", "none"), quiet=True)
    assert record["val_bpb"] == pytest.approx(record["val_loss"] / math.log(2), rel=1e-12)


def test_bits_per_byte_counts_the_tokens_bytes():
    """A tokenizer whose ids stand for strings of different UTF-8 lengths: bits per byte is the total loss in
    bits over the text's bytes, counted from the strings themselves."""
    pieces = ["a", "é", "the", "€", " ", "nanomega"]

    class Pieces:
        def token_bytes(self):
            return [len(p.encode("utf-8")) for p in pieces]

    gen = torch.Generator().manual_seed(0)
    batches = [(None, torch.randint(len(pieces), (2, 5), generator=gen)) for _ in range(3)]
    ids = [i for _, y in batches for i in y.flatten().tolist()]
    text_bytes = len("".join(pieces[i] for i in ids).encode("utf-8"))
    nats_per_token = 1.7
    per_token = bytes_per_token(Pieces(), batches)
    assert per_token == pytest.approx(text_bytes / len(ids), rel=1e-15)
    assert bits_per_byte(nats_per_token, per_token) == pytest.approx(
        nats_per_token * len(ids) / (math.log(2) * text_bytes), rel=1e-14)
