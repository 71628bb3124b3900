"""Peak memory per rank inside the train step, measured on real runs beside the simulator's figure.

    python bench/peak.py [--layers 4] [--seq 1024] [--d-model 512] [--optim adamw]

A 4-layer LLaMA-style model under FSDP over 2 gloo processes (torchrun), one step of train.py's loop
(forward + backward over the micro-batches, then the AdamW update), in five memory settings:
    keep gathers    parallel.reshard_after_forward=false: every unit's gathered parameters live from
                    its forward to its backward, so at the end of the forward the whole model is
                    gathered on every rank (what one whole-model gather at the start of the step held)
    per unit        the default: each unit's parameters gathered just before it runs, freed after its
                    forward, gathered again for its backward
    + selective AC  matmul and attention outputs kept, the rest recomputed (nanomega/recompute.py)
    + full AC       every block's forward recomputed in its backward
    + full AC, bf16 gathers   train.param_dtype=bfloat16: the gathers and the compute in bf16
Measured by nanomega.estimate's MemoryTracker (every storage an op creates, from creation to release)
on the real tensors of rank 0; "simulated" runs the same flags on fake tensors (python -m
nanomega.estimate). "held" is what the rank keeps between steps (16 B/param / 2 for AdamW); "step adds"
is the forward and backward's peak above it: what a layout's gathering and activation policy cost. The
update's peak (the functional AdamW update holds the old and the new moments at once) is shown apart.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "keep gathers": ["--parallel.reshard_after_forward=false"],
    "per unit": [],
    "per unit + selective AC": ["--train.activation_checkpointing=selective"],
    "per unit + full AC": ["--train.activation_checkpointing=full"],
    "per unit + full AC, bf16 gathers": ["--train.activation_checkpointing=full", "--train.param_dtype=bfloat16"],
}


def base_args(a) -> list[str]:
    return [f"--model.d_model={a.d_model}", f"--model.n_layers={a.layers}", "--model.n_heads=8", "--model.n_kv_heads=4",
            f"--model.ffn_dim={4 * a.d_model}", f"--model.max_seq_len={a.seq}", f"--train.seq_len={a.seq}",
            "--train.batch_size=2", "--train.device=cpu", "--train.compile=false", "--parallel.dp_shard=2",
            f"--optim.name={a.optim}"] + (["--optim.momentum=0"] if a.optim == "sgd" else [])


def worker(out: str, spec: str) -> None:
    import torch
    from nanomega import estimate
    from nanomega.config import parse_args
    torch.distributed.init_process_group("gloo")
    results = {name: estimate.track_step(parse_args(args), estimate.MemoryTracker(), torch.device("cpu"))
               for name, args in json.loads(spec).items()}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--optim", default="adamw", help="adamw, or sgd (plain, no state: what gathering adds shows alone)")
    a = parser.parse_args()
    from nanomega import estimate
    from nanomega.config import parse_args
    spec = {name: base_args(a) + extra for name, extra in SETTINGS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "measured.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", str(out), json.dumps(spec)]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL)
        measured = json.loads(out.read_text())
    mib = 2**20

    def fwd_bwd(result):
        return result["phases"]["forward_backward"]["peak_bytes"]
    first = fwd_bwd(measured["keep gathers"])
    print(f"FSDP 2 ranks, {a.layers} layers, d {a.d_model}, sequence {a.seq}, batch 2 (1 per rank), {a.optim}, eager; "
          "rank 0, MiB. Peaks of the forward + backward (measured / simulated) and of the update (measured).")
    print("| setting | fwd+bwd peak | simulated | held | fwd+bwd adds | gathered² | activations² | update peak | "
          "fwd+bwd vs keep gathers |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, args in spec.items():
        real = measured[name]
        sim = estimate._in_child(estimate.simulate_rank, parse_args(args), 0)
        held = sum(real["held_after"].values())
        split = real["phases"]["forward_backward"]["by_category"]
        print(f"| {name} | {fwd_bwd(real) / mib:,.1f} | {fwd_bwd(sim) / mib:,.1f} | {held / mib:,.1f} | "
              f"{(fwd_bwd(real) - held) / mib:,.1f} | {split['gathered_parameters'] / mib:,.1f} | "
              f"{split['activations'] / mib:,.1f} | {real['phases']['update']['peak_bytes'] / mib:,.1f} | "
              f"{fwd_bwd(real) / first:.2f}x |")
    print("² at the forward + backward peak")

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
