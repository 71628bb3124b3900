"""bench/gpu.sh's dry run: every command of each part on the CPU, so that a renamed flag, a variant that no longer
exists or a broken summary fails here and not on a lent GPU (15 minutes in all, one call a part)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiers import slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.sh"
RETURNED = 8      # files a lent machine hands back from $OUT


def dry_run(out: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@slow
def test_part_1_runs_every_command_on_the_cpu(tmp_path):
    done = dry_run(tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"gpu1.log", "scaled_mm_gpu.json", "scaled_mm_gpu.md", "train_gpu.json", "train_gpu.md",
                     "profile_gpu.tar.gz", "throughput_gpu_moe.json", "throughput_gpu_moe.md"}
    assert len(files) <= RETURNED
    train = json.loads((tmp_path / "train_gpu.json").read_text())
    assert [r["variant"] for r in train["rows"]] == ["bf16", "fp8tensorwise", "fp8rowwise"]
    for row in train["rows"]:
        assert row["exit"] == 0 and row["steps"] == 1 and math.isfinite(row["loss"]) and row["tokens_per_s"] > 0
        assert row["predicted_tokens_per_s"] > 0          # the step-time model ran for each
    scaled = json.loads((tmp_path / "scaled_mm_gpu.json").read_text())
    # the CPU's own _scaled_mm against the emulation: both are float32 sums of the same float8 products
    assert {r["recipe"] for r in scaled["rows"]} == {"tensorwise", "rowwise", "blockwise"}
    assert all(r["device_vs_emulation"] < 1e-5 for r in scaled["rows"])
    moe = json.loads((tmp_path / "throughput_gpu_moe.json").read_text())
    assert [r["variant"] for r in moe["results"]] == ["compiled-bf16"] and not moe["errors"]
    log = (tmp_path / "gpu1.log").read_text()
    assert "trace-rank0.json" in log and "measured / predicted" in log      # the profile, read by measured.py


@slow
def test_part_2_runs_every_command_on_the_cpu(tmp_path):
    done = dry_run(tmp_path, "--part", "2")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"gpu2.log", "throughput_gpu.json", "throughput_gpu.md", "model_gpu.json", "model_gpu.md",
                     "throughput_gpu_fp8_moe.json", "throughput_gpu_fp8_moe.md"}
    model = json.loads((tmp_path / "model_gpu.json").read_text())
    assert [r["variant"] for r in model["rows"]] == ["eager-bf16", "compiled-bf16"]
    fp8_moe = json.loads((tmp_path / "throughput_gpu_fp8_moe.json").read_text())
    assert len(fp8_moe["results"]) == 3 and not fp8_moe["errors"]
    log = (tmp_path / "gpu2.log").read_text()
    assert "throughput_gpu_default" in log and "parallel layouts skipped" in log


@pytest.mark.parametrize("args, message", [(["--part", "3"], "--part is 1 or 2"),
                                           (["--parts=1"], "unknown argument '--parts=1'")])
def test_bad_arguments_are_refused_before_any_work(tmp_path, args, message):
    done = dry_run(tmp_path, *args, timeout=60)
    assert done.returncode == 2 and message in done.stderr
    assert not any(tmp_path.iterdir())
