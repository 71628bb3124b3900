"""What the checkpoint's integrity checks cost (nanomega/checkpoint/integrity.py): a save and a load of 256 MiB of
parameters and 512 MiB of AdamW-shaped state, each timed beside its checksum part.

    python bench/checkpoint_checksums.py

The save's part is `file_sums` over the written files (the save reads them back from the page cache); the load's is
`check_intact`, timed as a load with it against a load with it replaced by nothing.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

import nanomega.checkpoint.loading as loading
from nanomega import checkpoint
from nanomega.checkpoint.integrity import file_sums


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    params = {f"w{i}": torch.randn(1024, 4096) for i in range(16)}                       # 256 MiB
    state = {"mu": {k: torch.randn_like(v) for k, v in params.items()},
             "nu": {k: torch.rand_like(v) for k, v in params.items()}}
    checked = loading.check_intact
    with tempfile.TemporaryDirectory() as out:
        for step in range(3):
            save = seconds(lambda: checkpoint.save(out, step, params, state, {}, keep=1))
            path = checkpoint.latest(out)
            sums = seconds(lambda: [file_sums(p) for p in Path(path).glob("*.safetensors")])
            load = seconds(lambda: checkpoint.load(path, params, state))
            loading.check_intact = lambda *args, **kwargs: None
            unchecked = seconds(lambda: checkpoint.load(path, params, state))
            loading.check_intact = checked
            print(f"save {save:.2f} s, of which checksums {sums:.2f} s; load {load:.2f} s, without the checks "
                  f"{unchecked:.2f} s")


if __name__ == "__main__":
    main()
