"""`python -m nanomega.hf export`: a checkpoint of any layout -> a folder transformers loads, with our logits.

Every family's tiny model (tests/test_models.py, tests/test_hf_moe.py) is saved as a serial checkpoint,
exported in several safetensors shards, loaded with AutoModelForCausalLM.from_pretrained, and its fp32
logits compared with nanomega's forward (<= 1e-5 relative). A parallel run's per-rank checkpoint is
exported in tests/test_parallel_train.py (FSDP 2) and tests/test_pipeline.py (pp 2 x tp 2 x ep 2).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanomega import checkpoint, hf
from nanomega.config import Config, to_dict
from nanomega.models import forward, init
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
