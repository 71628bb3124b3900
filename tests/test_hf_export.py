"""`python -m nanomega.hf export`: a checkpoint of any layout -> a folder transformers loads, with our logits.

Every family's tiny model (tests/test_models.py, tests/test_hf_moe.py) is saved as a serial checkpoint,
exported in several safetensors shards, loaded with AutoModelForCausalLM.from_pretrained, and its fp32
logits compared with nanomega's forward (<= 1e-5 relative). A parallel run's per-rank checkpoint is
exported in tests/test_parallel_train.py (FSDP 2) and tests/test_pipeline.py (pp 2 x tp 2 x ep 2), and here
from a 2-rank FSDP checkpoint written by hand. The export's dtype (the run's train.param_dtype, or --dtype)
is checked bitwise against the checkpoint cast, and its host memory by a counter of the bytes alive.
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint

from nanomega.hf import transfer as hf
from nanomega.config import Config, ModelConfig, to_dict
from nanomega.models import forward, init
from nanomega.tree import named_leaves
from test_hf_moe import FAMILIES as MOE_FAMILIES
from test_models import FAMILIES

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
CASES = {**{k: FAMILIES[k] for k in ("gpt2", "llama", "qwen2", "qwen3")}, **MOE_FAMILIES}


def assert_hf_logits_equal_ours(folder: Path, params: dict, model_cfg, seed: int = 0) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, model_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        theirs = model(input_ids=tokens).logits
        ours = forward(params, tokens, model_cfg)[..., :model_cfg.vocab_size]
    assert (theirs - ours).norm() <= 1e-5 * ours.norm()


@pytest.mark.parametrize("family", CASES)
def test_a_checkpoint_exports_to_a_folder_transformers_loads_with_our_logits(tmp_path, family):
    model_cfg = CASES[family]
    params = init(model_cfg, seed=3)
    run = tmp_path / "run"
    checkpoint.save(run, 7, params, {}, {"config": to_dict(Config(model=model_cfg))}, keep=1)
    out = hf.export(run, tmp_path / "hf", shard_bytes=40_000)         # a run directory: its latest checkpoint
    index = json.loads((out / hf.INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert (out / "config.json").is_file()
    assert_hf_logits_equal_ours(out, params, model_cfg)


def test_the_command_line_names_what_it_cannot_export(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "nanomega.hf", "export", str(tmp_path / "nothing"), str(tmp_path / "o")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "is neither a checkpoint" in bad.stderr


# ---------------------------------------------------------------- the export's dtype, and its memory

def fsdp_checkpoint(path: Path, model_cfg, params: dict, train=None) -> Path:
    """A 2-process FSDP checkpoint written by hand to its published layout (nanomega/checkpoint, format 2): rank r's
    params-rank0000r.safetensors holds chunk r of every (dense) parameter along dim 0 (DTensor's Shard(0),
    torch.chunk's sizes), its header each piece's global shape and offset; meta.json the run's config
    (dp_shard=2) and world_size 2."""
    from safetensors.torch import save_file
    from nanomega.checkpoint.files import BOXES
    from nanomega.config import ParallelConfig, TrainConfig
    path.mkdir(parents=True)
    leaves = named_leaves(params)
    for rank in range(2):
        pieces = {n: t.detach().chunk(2, dim=0)[rank].contiguous() for n, t in leaves.items()}
        boxes = {n: [list(t.shape), [rank * -(-t.shape[0] // 2)] + [0] * (t.dim() - 1)] for n, t in leaves.items()}
        save_file(pieces, str(path / f"params-rank{rank:05d}.safetensors"), {BOXES: json.dumps(boxes)})
    config = Config(model=model_cfg, parallel=ParallelConfig(dp_shard=2), train=train or TrainConfig())
    (path / checkpoint.META_FILE).write_text(json.dumps({"format": checkpoint.FORMAT, "config": to_dict(config),
                                                         "world_size": 2, "step": 1}))
    return path


def saved_run(tmp_path: Path, model_cfg, layout: str, param_dtype: str) -> tuple[Path, dict]:
    from nanomega.config import TrainConfig
    params = init(model_cfg, seed=3)
    train = TrainConfig(param_dtype=param_dtype)
    if layout == "fsdp2":
        return fsdp_checkpoint(tmp_path / "ckpt", model_cfg, params, train), params
    checkpoint.save(tmp_path / "run", 7, params, {}, {"config": to_dict(Config(model=model_cfg, train=train))}, keep=1)
    return tmp_path / "run", params


def assert_folder_is_the_checkpoint_in(folder: Path, params: dict, model_cfg, dtype: torch.dtype) -> None:
    """from_pretrained(folder) holds, bitwise, our parameters (renamed: to_hf_state_dict) cast to dtype."""
    from nanomega.hf.convert import to_hf_state_dict
    name = str(dtype).removeprefix("torch.")
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == name
    for file in set(json.loads((folder / hf.INDEX).read_text())["weight_map"].values()):
        with hf.safe_open(str(folder / file), framework="pt") as f:
            assert all(f.get_slice(k).get_dtype() == {"bfloat16": "BF16", "float32": "F32"}[name] for k in f.keys())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    assert model.dtype == dtype
    theirs = model.state_dict()
    ours = to_hf_state_dict(params, model_cfg)
    for key, t in ours.items():   # (DeepSeek-V3 keeps its router in fp32: what it upcast from the file)
        assert torch.equal(theirs[key], t.to(dtype).to(theirs[key].dtype)), key


@pytest.mark.parametrize("family, layout", [("gpt2", "serial"), ("deepseek_v3", "serial"), ("llama", "fsdp2")])
def test_a_bf16_run_exports_in_bf16_equal_to_its_checkpoint(tmp_path, family, layout):
    """train.param_dtype=bfloat16 -> bf16 weights and config.json dtype, by default; --dtype float32 -> fp32."""
    model_cfg = CASES[family]
    src, params = saved_run(tmp_path, model_cfg, layout, "bfloat16")
    out = hf.export(src, tmp_path / "bf16", shard_bytes=40_000)
    assert_folder_is_the_checkpoint_in(out, params, model_cfg, torch.bfloat16)
    assert hf.main(["export", str(src), str(tmp_path / "fp32"), "--dtype", "float32"]) == 0
    assert_folder_is_the_checkpoint_in(tmp_path / "fp32", params, model_cfg, torch.float32)


class HeldBytes:
    """Counts the bytes of the storages alive among the tensors the export read from the checkpoint and
    those it made of them (hf_tensor's results: the shards' tensors in fp32), and the most ever alive at
    once: a high-water mark of the export's host memory. A storage counts while any tensor seen on it lives
    (a view of a read tensor keeps it)."""

    def __init__(self):
        self.alive: dict[int, list] = {}        # storage address -> [bytes, tensors seen on it still alive]
        self.peak = 0

    def _drop(self, key: int) -> None:
        self.alive[key][1] -= 1
        if not self.alive[key][1]:
            del self.alive[key]

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        entry = self.alive.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        entry[1] += 1
        weakref.finalize(t, self._drop, storage.data_ptr())
        self.peak = max(self.peak, sum(n for n, _ in self.alive.values()))
        return t


@pytest.mark.parametrize("layout", ["serial", "fsdp2"])
def test_an_export_holds_one_shard_and_one_tensor_not_the_model(tmp_path, monkeypatch, layout):
    model_cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=6, n_heads=4, ffn_dim=384, max_seq_len=64)
    src, params = saved_run(tmp_path, model_cfg, layout, "float32")
    biggest = max(t.numel() * 4 for t in named_leaves(params).values())
    total = sum(t.numel() * 4 for t in named_leaves(params).values())
    held = HeldBytes()
    real_open, real_tensor = hf.checkpoint_tensors, hf.hf_tensor

    @contextlib.contextmanager
    def counted_open(path):
        with real_open(path) as read:
            yield lambda name: held.hold(read(name))
    monkeypatch.setattr(hf, "checkpoint_tensors", counted_open)
    monkeypatch.setattr(hf, "hf_tensor", lambda *a: held.hold(real_tensor(*a)))
    del params
    shard = 3 * biggest
    out = hf.export(src, tmp_path / "hf", shard_bytes=shard, dtype="float32")
    files = set(json.loads((out / hf.INDEX).read_text())["weight_map"].values())
    assert len(files) >= 5 and total >= 5 * shard
    print(f"export peak {held.peak} bytes held; shard {shard}, biggest tensor {biggest}, model {total}")
    assert 0 < held.peak <= shard + 2 * biggest, (held.peak, shard, biggest, total)   # not the model's `total`
