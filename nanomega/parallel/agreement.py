"""Do all ranks agree? A yes/no vote over the job's key-value store, with a timeout.

    agree = agreement(cfg.train.ckpt_timeout)      # once, after the process group exists
    if not agree(my_files_are_complete): ...       # every rank calls it, in the same order

checkpoint.save asks it three times per parallel save (the directory exists, every rank's files are
written, rank 0 has published) so that a checkpoint is published only when every rank's part is on disk.
"""
from __future__ import annotations

import datetime
import itertools
import os

import torch

from nanomega import checkpoint


def agreement(timeout_s: float):
    """agree(ok) -> whether every rank passed ok (checkpoint.save's), through the job's key-value store
    (each rank sets its answer, then waits for all of them, at most timeout_s): a rank that died or hangs
    in a save fails the others' agreement with an error, not a wait for the process group's 30 minutes.
    The store rather than a collective or a second gloo group: a group created after torchrun restarted
    the job connects to the dead attempt's addresses. Keys carry the attempt and a per-save counter."""
    store = torch.distributed.distributed_c10d._get_default_store()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    prefix = f"nanomega/agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    calls = itertools.count()

    def agree(ok: bool) -> bool:
        key = f"{prefix}/{next(calls)}"
        store.set(f"{key}/{rank}", "1" if ok else "0")
        try:
            store.wait([f"{key}/{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:   # DistStoreError: the time ran out, or the store is gone
            raise checkpoint.CheckpointNotSaved(
                f"the ranks could not agree that a checkpoint is complete within {timeout_s:g} s "
                f"(train.ckpt_timeout): a rank died or hangs ({str(err).splitlines()[0][:200]}); nothing was "
                "published, the latest checkpoint is unchanged") from err
        return all(store.get(f"{key}/{r}") == b"1" for r in range(world))
    return agree
