"""train.py under torchrun with one fault injected, for tests/test_checkpoint_faults.py.

    torchrun --nproc-per-node 2 tests/fault_worker.py FAULT RANK STEP <train.py args...>

FAULT  raise   rank RANK's write of checkpoint STEP raises (a full disk, say); the rank lives on
       die     rank RANK's process exits in the middle of writing checkpoint STEP (its first file written)
       crash   rank RANK's process exits in training step STEP, on the job's first attempt only
               (TORCHELASTIC_RESTART_COUNT 0), as a node failure would, for torchrun --max-restarts
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train                                   # noqa: E402
from nanomega import checkpoint                 # noqa: E402

fault, rank, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mine = int(os.environ.get("RANK", "0")) == rank

if fault in ("raise", "die"):
    write = checkpoint.saving._write_trees

    def faulty(snapshot, directory, files):
        if mine and directory.name.startswith(f"ckpt-{at:08d}"):
            if fault == "raise":
                raise OSError(28, "No space left on device (injected)")
            index, tensors, metadata = next(iter(snapshot))
            checkpoint.saving._write_tensors(tensors, directory / files[index], metadata)
            os._exit(17)
        return write(snapshot, directory, files)     # {file: length and CRC-32}, for meta.json
    checkpoint.saving._write_trees = faulty
elif fault == "crash":
    make = train.make_step_fns

    def counting(*args, **kwargs):
        fns = make(*args, **kwargs)
        calls = []

        def grads(params, micro):
            calls.append(1)
            if mine and len(calls) == at and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os._exit(17)
            return fns.grads(params, micro)
        return fns._replace(grads=grads)
    train.make_step_fns = counting
else:
    sys.exit(f"unknown fault {fault!r}")

train.main(sys.argv[4:])
