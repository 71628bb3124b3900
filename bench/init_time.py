"""Start-up init: how long one rank takes to draw its parameters, its shards alone against every leaf whole.

    python bench/init_time.py                                   # llama3_8b, rank 0 of FSDP 8
    python bench/init_time.py --config=llama3_70b --dp-shard 64 --out /tmp/init

"whole" is what every rank did before init drew in tiles (models/init_streams.py): each leaf drawn whole on
the CPU, then its shard sliced off; "shard" is what parallel/setup.py does now: the shard drawn alone (the
same numbers, bitwise). Each is timed on the embedding, the head and --blocks blocks (two counts), in CPU
seconds on one thread (randn draws on one thread anyway, and CPU time holds up on a busy machine where wall
time does not), and extrapolated to the config's n_layers: fixed + n_layers * per block. Rank 0 of
dp_shard, whose FSDP shards are rows (Shard(0)); a row-parallel or FSDP-beside-tp column shard costs the
same up to one tile (128 columns) at each end. Results: <out>/init_time.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # nanomega and configs/ of this checkout

import torch  # noqa: E402

import results_io  # noqa: E402
from nanomega.config import ParallelConfig, parse_args  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.parallel.mesh import MeshShape, model_config  # noqa: E402
from nanomega.parallel.plan import layout_of, shard_index  # noqa: E402
from nanomega.tree import named_leaves  # noqa: E402


def cpu_seconds(model, cfg, blocks: int, mode: str) -> float:
    model = dataclasses.replace(model, n_layers=blocks)
    mesh = MeshShape(("dp_shard",), (cfg.parallel.dp_shard,))

    def rank0(name, part):
        shape = shapes[name]
        index = shard_index(shape, layout_of(name, shape, mesh, cfg).storage, mesh.shape, (0,))
        return part(index) if mode == "shard" else part()[index].clone()
    shapes = {n: t.shape for n, t in named_leaves(init(model, device="meta")).items()}
    start = time.process_time()
    init(model, cfg.train.seed, place=rank0)
    return time.process_time() - start


def tables(doc: dict) -> str:
    r = doc["results"]
    rows = [[mode, f"{r[mode]['per_block']:.2f}", f"{r[mode]['fixed']:.2f}", f"{r[mode]['total']:.1f}"]
            for mode in ("whole", "shard")]
    return (f"{r['config']}, rank 0 of dp_shard={r['dp_shard']}, CPU seconds on one thread\n\n"
            + results_io.table(["draw", "per block", "embedding + head", f"{r['n_layers']} blocks, extrapolated"],
                               "lrrr", rows)
            + f"\n\nshard alone: {r['whole']['total'] / r['shard']['total']:.1f}x less CPU time "
              f"(ideal {r['dp_shard']}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3_8b")
    ap.add_argument("--dp-shard", type=int, default=8)
    ap.add_argument("--blocks", type=int, nargs=2, default=[1, 3], help="two block counts to extrapolate from")
    results_io.add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        return results_io.render(args.render, tables)
    torch.set_num_threads(1)
    cfg = parse_args([f"--config={args.config}"])
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(dp_shard=args.dp_shard))
    model = model_config(cfg)
    doc = results_io.start("init_time")
    results = {"config": args.config, "dp_shard": args.dp_shard, "n_layers": model.n_layers}
    low, high = args.blocks
    cpu_seconds(model, cfg, low, "shard")    # a first run pays allocator and page-fault costs the others do not
    for mode in ("whole", "shard"):
        seconds = {b: cpu_seconds(model, cfg, b, mode) for b in (low, high)}
        per_block = (seconds[high] - seconds[low]) / (high - low)
        fixed = seconds[low] - low * per_block
        results[mode] = {"seconds": seconds, "per_block": per_block, "fixed": fixed,
                         "total": fixed + model.n_layers * per_block}
        print(mode, results[mode], flush=True)
    doc["results"] = results
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
