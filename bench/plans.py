"""Plans: what fits on 80 GB GPUs, from the memory simulator (nanomega.sim.estimate), for the README's table.

    python bench/plans.py                              # every row (~40 min on 2 loaded cores, one CPU process)
    python bench/plans.py --rows llama3_8b_full_ac --out /tmp/smoke      # one row (~20 s)

Each row is `python -m nanomega.sim.estimate <flags>`, i.e. nanomega.sim.estimate.estimate(cfg, ranks): the real train
step (setup_parallel, make_step_fns, as train.py builds them) on fake tensors with torch's fake
process group, one rank at a time, nothing allocated. AdamW, bf16 compute with bf16 gathers
(train.param_dtype=bfloat16), fp32 master parameters, gradients and moments, one sequence per data-parallel
rank, sequence 8192 (Mixtral and DeepSeek-V3: their 4096). Per row: the largest simulated rank's peak and the
phase it falls in (forward + backward, or the update), both phases' peaks, the activations at the forward +
backward peak, what
the rank holds between steps (parameters, gradients, optimizer state after the update), Megatron's formula
per rank for the same parameter count (18 B/param over d ranks, as ZeRO-3; 6 + 12/d with its distributed
optimizer alone), whether the peak fits in 72 GB (80 GB less a 10% margin, as train.py's preflight), the
seconds the simulation took, and the bytes each collective kind sends per step (rank 0, ring algorithms).
The pipeline rows (llama3_405b, deepseek_v3) simulate one rank per stage: the first stage keeps the most
micro-batches in flight, the last holds the head and the loss, the others differ in layers. GB = 10^9 bytes.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402

from nanomega.config import parse_args  # noqa: E402
from nanomega.sim.estimate import estimate  # noqa: E402
from nanomega.sim.counting import count_params  # noqa: E402
from nanomega.sim.rank_bytes import bytes_per_rank  # noqa: E402
from nanomega.parallel.mesh import model_config  # noqa: E402

GB, GPU, FITS = 1e9, 80e9, 72e9
BF16 = ["--train.param_dtype=bfloat16"]
FULL = ["--train.activation_checkpointing=full"]
ROWS = {  # name: (layout, estimate's flags, --ranks)
    "llama3_8b_full_ac": ("FSDP 8, full AC, bf16 gathers", ["--config=llama3_8b", "--parallel.dp_shard=8",
                          "--train.batch_size=8", "--train.seq_len=8192", *FULL, *BF16], "auto"),
    "llama3_8b_selective_ac": ("FSDP 8, selective AC, bf16 gathers", ["--config=llama3_8b", "--parallel.dp_shard=8",
                               "--train.batch_size=8", "--train.seq_len=8192",
                               "--train.activation_checkpointing=selective", *BF16], "auto"),
    "llama3_8b_no_ac": ("FSDP 8, no AC, bf16 gathers", ["--config=llama3_8b", "--parallel.dp_shard=8",
                        "--train.batch_size=8", "--train.seq_len=8192", *BF16], "auto"),
    "llama3_70b_full_ac": ("FSDP 64, full AC, bf16 gathers", ["--config=llama3_70b", "--parallel.dp_shard=64",
                           "--train.batch_size=64", "--train.seq_len=8192", *FULL, *BF16], "0"),
    "mixtral_fsdp8": ("FSDP 8, full AC", ["--config=mixtral_8x7b", "--parallel.dp_shard=8", "--train.batch_size=8",
                      *FULL, *BF16], "0"),
    "mixtral_fsdp32": ("FSDP 32 (experts split on edp), full AC", ["--config=mixtral_8x7b", "--parallel.dp_shard=32",
                       "--train.batch_size=32", *FULL, *BF16], "0"),
    "mixtral_fsdp8_ep8": ("FSDP 8 x ep 8, full AC¹", ["--config=mixtral_8x7b", "--parallel.dp_shard=8",
                          "--parallel.ep=8", "--train.batch_size=8", *FULL, *BF16], "0"),
    "mixtral_fsdp32_ep8": ("FSDP 32, experts ep 8 x edp 4, full AC¹", ["--config=mixtral_8x7b",
                           "--parallel.dp_shard=32", "--parallel.ep=8", "--train.batch_size=32", *FULL, *BF16], "0"),
    # pipeline rows: stage s's first rank is s * world / pp (pp is the mesh's outer dim). The 405B: every stage.
    # DeepSeek-V3 (2 min a rank here): the stages that differ, 0 (embedding, 3 dense layers and 1 MoE, 16 micro-batches
    # in flight), 1 (4 MoE layers, 15 in flight: stages 2-12 hold the same with fewer), 13 (3 MoE layers) and
    # 15 (the head and the loss)
    "llama3_405b_fsdp4_tp8_pp8": ("FSDP 4 x TP 8 (SP) x PP 8, 1F1B over 8 micro-batches, full AC²",
                                  ["--config=llama3_405b", "--parallel.dp_shard=4", "--parallel.tp=8",
                                   "--parallel.sequence_parallel=true", "--parallel.pp=8", "--train.batch_size=4",
                                   "--train.grad_accum=8", "--train.seq_len=8192", *FULL, *BF16],
                                  ",".join(str(32 * s) for s in range(8))),
    "deepseek_v3_fsdp32_ep32_pp16": ("FSDP 32 x ep 32 x PP 16, 1F1B over 16 micro-batches, full AC¹ ²",
                                     ["--config=deepseek_v3", "--parallel.dp_shard=32", "--parallel.ep=32",
                                      "--parallel.pp=16", "--train.batch_size=32", "--train.grad_accum=16", *FULL,
                                      *BF16], "0,32,416,480"),
}


def held_bytes(rank: dict) -> int:
    return sum(rank["held_after"].values())


def run_row(name: str) -> dict:
    layout, flags, ranks = ROWS[name]
    cfg = parse_args(flags)
    row = {"name": name, "layout": layout, "flags": flags, "ranks_simulated": ranks, "world_size":
           cfg.parallel.world_size, "n_params": count_params(model_config(cfg)), "plan_held_bytes":
           bytes_per_rank(cfg).total}
    if ranks is None:
        return row
    start = time.perf_counter()
    result = estimate(cfg, ranks)
    row["seconds"] = time.perf_counter() - start
    # each rank's collective schedule (thousands of entries for the pipeline rows) is nanomega.sim.step_time's, not a plan's
    row["estimate"] = {**result, "ranks": {str(k): {f: x for f, x in v.items() if f != "schedule"}
                                           for k, v in result["ranks"].items()}}
    return row


def megatron(n: float, d: int) -> tuple[float, float]:
    """Megatron's bytes per rank: 18 B/param over d ranks (ZeRO-3), and 6 + 12/d (distributed optimizer)."""
    return 18 * n / d, (6 + 12 / d) * n


def peak_cells(row: dict) -> dict:
    est = row["estimate"]
    top = est["ranks"][str(est["peak_rank"])]
    phases = top["phases"]
    return {"peak": top["peak_bytes"], "phase": "update" if top["peak_phase"] == "update" else "fwd/bwd",
            "fwd_bwd": phases["forward_backward"]["peak_bytes"], "update": phases["update"]["peak_bytes"],
            "activations": phases["forward_backward"]["by_category"]["activations"], "held": held_bytes(top),
            "rank": est["peak_rank"]}


def tables(doc: dict) -> str:
    rows = []
    for r in doc["rows"]:
        n, d = r["n_params"], r["world_size"]
        zero3, distopt = megatron(n, d)
        model = f"{r['flags'][0].split('=')[1]} ({n / 1e9:.2f}B)"
        if "estimate" not in r:
            rows.append([model, d, r["layout"], "—", "—", "—", "—", f"{r['plan_held_bytes'] / GB:.1f} (plan)",
                         f"18/{d}: {zero3 / GB:.1f}", f"{distopt / GB:.1f}", "—", ""])
            continue
        c = peak_cells(r)
        fits = (f"yes, {1 - c['peak'] / GPU:.0%} of 80 GB free" if c["peak"] <= FITS else "no")
        rows.append([model, d, r["layout"], f"**{c['peak'] / GB:.1f} GB** ({c['phase']}, rank {c['rank']})",
                     f"{c['fwd_bwd'] / GB:.1f}", f"{c['update'] / GB:.1f}", f"{c['activations'] / GB:.1f}",
                     f"{c['held'] / GB:.1f}", f"18/{d}: {zero3 / GB:.1f}", f"{distopt / GB:.1f}", fits,
                     f"{r['seconds']:.0f}"])
    plans = results_io.table(
        ["model", "ranks x 80 GB", "layout", "simulated peak / rank", "fwd+bwd peak", "update peak",
         "activations at fwd+bwd peak", "held between steps", "Megatron 18/d", "Megatron 6 + 12/d", "fits (72 GB)",
         "s"], "lrlrrrrrrrlr", rows)
    comm = []
    for r in doc["rows"]:
        if "estimate" not in r:
            continue
        ranks = r["estimate"]["ranks"]
        rank = "0" if "0" in ranks else str(r["estimate"]["peak_rank"])
        coll = ranks[rank]["collectives"]
        kinds = "; ".join(f"{k} {v['count']}x {v['bytes_sent'] / GB:.1f}" for k, v in sorted(coll.items()))
        total = sum(v["bytes_sent"] for v in coll.values())
        comm.append([r["flags"][0].split("=")[1], r["layout"], rank, f"{total / GB:.1f}", kinds or "none"])
    collectives = results_io.table(["model", "layout", "rank", "GB sent per step", "per kind: count x GB"],
                                   "lllrl", comm)
    notes = ("GB = 10^9 bytes, per rank. Simulated peak: the largest simulated rank's; its phase: forward + backward "
             "or the optimizer update. "
             "Held between steps: parameters + gradients + optimizer state after the update. Megatron's formula "
             "(bf16 parameters, fp32 gradients, master copy and moments) counts no activations or temporaries. "
             "Fits: the peak within 72 GB (80 GB less the preflight's 10% margin). s: seconds to simulate the "
             "row's ranks.\n¹ Balanced routing: every expert gets N x top_k / E tokens (fake tensors carry no "
             "routing). ² Pipeline parallel: the ranks simulated are one per stage, each running "
             "the real pipeline runtime on its 1F1B action list (stage 0 holds every micro-batch's activations "
             "in flight up to pp of them); the peak is the largest stage's.")
    return (f"AdamW, bf16 compute and gathers, one sequence per data-parallel rank, sequence 8192 (Mixtral, DeepSeek-V3 4096); "
            f"nanomega.sim.estimate on fake tensors.\n\n{plans}\n\nCollectives per step (bytes this rank sends, ring "
            f"algorithms):\n\n{collectives}\n\n{notes}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from: {', '.join(ROWS)}")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    names = [n for n in args.rows.split(",") if n]
    if bad := [n for n in names if n not in ROWS]:
        sys.exit(f"error: unknown row(s) {bad}; choose from {', '.join(ROWS)}")
    doc = results_io.start("plans")
    doc["rows"] = []
    for name in names:
        row = run_row(name)
        doc["rows"].append(row)
        peak = row.get("estimate", {}).get("peak_bytes")
        print(f"{name}: " + (f"peak {peak / GB:.1f} GB, {row['seconds']:.0f} s" if peak else
                             f"plan holds {row['plan_held_bytes'] / GB:.1f} GB per rank"), flush=True)
    doc["commands"] = {n: "python -m nanomega.sim.estimate " + " ".join(ROWS[n][1])
                       + (f" --ranks={ROWS[n][2]}" if ROWS[n][2] not in (None, "auto") else "") for n in names}
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
