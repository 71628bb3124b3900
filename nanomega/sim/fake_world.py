"""This process as one rank of a fake world: torch's fake process group (every collective and transfer completes at
once, nothing is sent), on which the simulator (estimate.py), the step-time model (step_time.py) and the contract
checker (contracts.py) run a rank's real step on fake tensors."""
from __future__ import annotations

import contextlib
import os

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, backend: str = "fake"):
    """This process as `rank` of `world_size` on torch's fake process group (collectives complete at once);
    backend "cpu:fake,meta:fake" takes meta tensors too (nanomega/sim/contracts.py)."""
    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        if world_size > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore
            dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
        with _redistribution_plans_cached():
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _redistribution_plans_cached():
    """DTensor plans each redistribution (which collectives, in which order) once per pair of specs and caches
    it, except under a fake mode, where it assumes it is tracing symbolic shapes and plans again every time. The
    simulator's shapes are concrete, so its plans are cached here, as a real run's are: with nested shards (cp x
    tp, FSDP over dp x cp) DTensor searches placements for the cheapest path, ~3 ms a redistribution, which was
    half of a cp 2 x tp 2 rank's simulated step (7.7 of 16.4 s, cProfile, 2026-12-05). A spec that does not hash
    (a symbolic shape) is planned as torch would."""
    from torch.distributed.tensor import _redistribute
    plan = _redistribute._gen_transform_infos_non_cached
    plans = {}

    def cached(src_spec, dst_spec, use_graph_based_transform=None):
        key = (src_spec, dst_spec, use_graph_based_transform)
        try:
            hash(key)
        except TypeError:             # unhashable: a symbolic shape
            return plan(*key)
        if key not in plans:
            plans[key] = plan(*key)
        return plans[key]

    _redistribute._gen_transform_infos_non_cached = cached
    try:
        yield
    finally:
        _redistribute._gen_transform_infos_non_cached = plan
