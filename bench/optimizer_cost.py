"""Each optimizer's cost at scale, predicted: update time and communication as a share of the train step.

    python bench/optimizer_cost.py                          # 8b and 70b, every optimizer (~5 min on 2 cores)
    python bench/optimizer_cost.py --layouts 8b --optimizers adamw,muon --out /tmp/smoke
    python bench/optimizer_cost.py --layouts kimi,kimi_tp --optimizers muon,adamw   # -> optimizer_cost_kimi.*

For each layout and optimizer, nanomega.sim.step_time.update_cost traces the real step of rank 0 under fake tensors
(a and b blocks, extrapolated to the model's depth) and times it on the device model: the step split into
forward + backward and the optimizer update, the periodic work (Shampoo's inverse roots, SOAP's QR refresh of
its bases: every precondition_frequency steps) amortized as steady + (refresh - steady) / frequency. Under FSDP
the matrix optimizers gather whole matrices to their owners and send the updates back (parallel/optimizer.py):
those collectives are the update's communication here. Each figure is also given with Efficiency.linalg at a
quarter of its value (factorizations 4x slower), to show how much rests on that assumed constant.

Blocks simulated: 8 and 16, extrapolated. Fewer would mislead: rank 0's share of the owners' work (largest
matrix first, to the least-loaded owner) is not linear in the blocks until every owner gets the same matrices
(at 1 and 2 blocks rank 0 owns one MLP matrix either way: Muon's Newton-Schulz at 8B came out 15x too small);
with 8 owners and 7 matrices a block, 8 and 16 blocks give each owner the same share of each kind.
A model with leading dense blocks (kimi_k2) is always traced at one MoE block, two, and a dense one before a MoE
one (step_time.predict), whatever `layers` says: there the owners' shares are not linear (a block's 9 experts of
a rank's 3 go over 16 edp owners; its 8 dense matrices over 1,024 or 2,048), and the trace overstates rank 0's
share. The column "owned cost, traced / whole" says by how much: rank 0's update cost in the optimizer's
matrix_cost units, as those blocks extrapolate it, over the whole model's, both from parallel/ownership.py's
assign (owner_extrapolation; 1.00 for 8b and 70b).

Layouts:
  llama3_8b on 8 H100, FSDP 8: bench/published.py's torchtitan layout (local batch 2 x 8,192, selective
    recomputation, bf16 parameters), on that row's GPU (Grand Teton's H100, 96 GB HBM2e), compiled.
  llama3_70b on 64 H100 SXM (80 GB), FSDP 8 x TP 8 with sequence parallel: 16 sequences of 8,192 per data-
    parallel rank (torchtitan's 70B local batch), full recomputation, bf16 parameters, compiled.
  kimi_k2 on 2,048 H100 (80 GB), the planner's two best layouts (docs/performance.md, plan.Candidate.flags):
    "kimi" EP 128 x FSDP 2,048, 2 x 4,096 a GPU; "kimi_tp" TP 2 (sequence parallel) x EP 128 x FSDP 4 x DDP 256
    with the distributed optimizer (owners over 1,024 ranks), 1 x 4,096 a DP rank and 4 micro-batches; both
    16,777,216 tokens a step, full recomputation, bf16 parameters. kimi_k2 configures Muon (muon_scale
    match_adam); the other optimizers drop that setting. Published beside it: Megatron's Kimi K2 on 256 GB300,
    AdamW 1,051 and Muon 1,029 model TFLOP/s/GPU (Muon 2.1% slower; their 2-4% for emerging optimizers).
Optimizers at OptimConfig's defaults (Muon: 5 bf16 Newton-Schulz steps; Shampoo: blocks of 1,024, roots every
10 steps; SOAP: max_precond_dim 1,024, bases refreshed every 10 steps), and SOAP with max_precond_dim 16,384
(soap_16k: every hidden dim preconditioned). Under FSDP x TP the owners gather each matrix whole over tp too
(parallel.muon_tp=duplicated: "distributed", Newton-Schulz on the tp shards, is refused with dp_shard > 1).
The update costs the same whatever the batch; its share falls as a step carries more tokens. "x8 tokens" is the
share with 8 times this step's tokens (gradient accumulation: forward + backward x 8, the update once), from the
same figures: update / (update + 8 x (step - update)); Moonlight's steps carry millions of tokens. Published for
Muon: Moonlight (Liu et al. 2025, "Muon is Scalable for LLM Training") puts its overhead at ~1-3% of a step;
modded-nanogpt alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402
from published import TT_8B  # noqa: E402

from nanomega import optim  # noqa: E402
from nanomega.config import parse_args  # noqa: E402
from nanomega.models import init  # noqa: E402
from nanomega.parallel.mesh import mesh_shapes, model_config  # noqa: E402
from nanomega.parallel.ownership import assign, matrix_cost  # noqa: E402
from nanomega.parallel.plan import is_expert, layout_of  # noqa: E402
from nanomega.sim.devices import Efficiency  # noqa: E402
from nanomega.sim.step_time import update_cost  # noqa: E402
from nanomega.tree import named_leaves  # noqa: E402

GiB = 2 ** 30
# row: flags. SOAP at its default max_precond_dim (1,024) preconditions no dim of these models (all are longer:
# 4,096 and up), so it runs as Adam; the second SOAP row gives every hidden dim a basis (not the vocabulary's).
OPTIMIZERS = {**dict.fromkeys(optim.REGISTRY, []),     # every registered optimizer at its defaults
              "soap_16k": ["--optim.name=soap", "--optim.max_precond_dim=16384"]}
ACCUMULATED = 8     # the share again with this many times the tokens a step (module doc)
TT_70B_64 = ["--config=llama3_70b", "--parallel.dp_shard=8", "--parallel.tp=8", "--parallel.sequence_parallel=true",
             "--train.batch_size=128", "--train.seq_len=8192", "--train.activation_checkpointing=full",
             "--train.param_dtype=bfloat16"]
# kimi_k2's two best layouts on 2,048 H100 from the planner (docs/performance.md), as plan.Candidate.flags spells
# them: 16,777,216 tokens a step (4,096 sequences of 4,096)
KIMI = ["--config=kimi_k2", "--train.seq_len=4096", "--train.activation_checkpointing=full",
        "--train.param_dtype=bfloat16", "--parallel.ep=128"]
KIMI_EP_FSDP = KIMI + ["--parallel.dp_shard=2048", "--train.batch_size=4096", "--train.grad_accum=1"]
KIMI_TP_DDP = KIMI + ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.dp_shard=4",
                      "--parallel.dp_replicate=256", "--parallel.distributed_optimizer=true",
                      "--train.batch_size=1024", "--train.grad_accum=4"]
# name: (layout in words, flags, gpu, blocks simulated)
LAYOUTS = {
    "8b": ("Llama 3.1 8B, 8 H100 (96 GB), FSDP 8, 2 x 8,192 a GPU, selective recomputation", TT_8B,
           "h100_hbm2e", (8, 16)),
    "70b": ("Llama 3.1 70B, 64 H100 (80 GB), FSDP 8 x TP 8, 16 x 8,192 a DP rank, full recomputation", TT_70B_64,
            "h100", (8, 16)),
    "kimi": ("Kimi K2, 2,048 H100 (80 GB), EP 128 x FSDP 2,048, 2 x 4,096 a GPU, full recomputation", KIMI_EP_FSDP,
             "h100", (1, 2)),
    "kimi_tp": ("Kimi K2, 2,048 H100 (80 GB), TP 2 x EP 128 x FSDP 4 x DDP 256 (distributed optimizer), 1 x 4,096 "
                "a DP rank, 4 micro-batches, full recomputation", KIMI_TP_DDP, "h100", (1, 2)),
}
PUBLISHED_MUON = (0.01, 0.03)      # Moonlight: Muon's overhead, share of a step
PUBLISHED_KIMI_GB300 = (1051, 1029)     # Megatron, Kimi K2 on 256 GB300: model TFLOP/s/GPU with AdamW, with Muon


def layout_config(layout: str, name: str):
    """The layout's config with optimizer `name` (a row of OPTIMIZERS). A config's own optimizer settings are
    its optimizer's (kimi_k2's muon_scale): another optimizer drops them, as it would refuse them."""
    flags = LAYOUTS[layout][1]
    base = parse_args(list(flags))
    cfg = parse_args(list(flags) + (OPTIMIZERS[name] or [f"--optim.name={name}"]))
    if cfg.optim.name == base.optim.name:
        return cfg
    own = tuple(kv for kv in cfg.optim.settings if kv not in base.optim.settings)
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, settings=own))


def owned_cost(cfg, n_layers: int, dense: int) -> tuple[float, float]:
    """(rank 0's, the most loaded owner's) whole-matrix update cost, in the optimizer's matrix_cost units, with
    the model cut to n_layers blocks (the first `dense` dense): dense hidden matrices over the owner dims, each
    expert over its edp line, assigned as parallel/ownership.py assigns them (rank 0 is owner 0 of both)."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers, first_dense_layers=dense))
    p = cfg.parallel
    mesh, experts = mesh_shapes(cfg)
    cost = matrix_cost(cfg.optim)
    dense_units, expert_units = {}, {}
    for name, x in named_leaves(init(model_config(cfg), 0, "meta")).items():
        if optim.spec_of(cfg.optim.name).elementwise or not optim.hidden_matrix(name, x):
            continue
        if is_expert(name) and layout_of(name, x.shape, mesh, cfg, experts).mesh is experts:
            expert_units[name] = (x.shape[0] // p.ep, cost(x.shape[1:]))
        else:
            dense_units[name] = (1, cost(x.shape))
    sharded = {"dp_shard"} | ({"dp_replicate"} if p.distributed_optimizer else set())
    owners = math.prod(size for d, size in zip(mesh.mesh_dim_names, mesh.shape) if d in sharded)
    loads = []
    for units, n in ((dense_units, owners), (expert_units, p.world_size // p.pp // p.ep)):
        taken = assign(units, n)
        loads.append([sum(taken[name][o] * units[name][1] for name in units) for o in range(n)])
    return sum(load[0] for load in loads), sum(max(load) for load in loads)


def owner_extrapolation(cfg, layers: tuple[int, int]) -> dict:
    """Rank 0's owned update cost as step_time.predict extrapolates it from the blocks it traces (a and b
    blocks; with leading dense blocks: one MoE block, two, and a dense one before a MoE one), against the
    whole model's: where owners do not each get the same share of every kind of matrix, the two differ."""
    m = cfg.model
    if 0 < m.first_dense_layers < m.n_layers:
        moe = m.n_layers - m.first_dense_layers
        x1, x2, y2 = (owned_cost(cfg, n, d)[0] for n, d in ((1, 0), (2, 0), (2, 1)))
        extrapolated = (2.0 - m.first_dense_layers - moe) * x1 + (moe - 1.0) * x2 + m.first_dense_layers * y2
    else:
        (a, b), dense = layers, m.first_dense_layers
        ya, yb = owned_cost(cfg, a, min(dense, a))[0], owned_cost(cfg, b, min(dense, b))[0]
        extrapolated = ya + (yb - ya) * (m.n_layers - a) / (b - a)
    exact, most = owned_cost(cfg, m.n_layers, m.first_dense_layers)
    return {"extrapolated": extrapolated, "exact": exact, "most_loaded": most}


def measure(layout: str, name: str) -> dict:
    words, flags, gpu, layers = LAYOUTS[layout]
    cfg = layout_config(layout, name)
    started = time.time()
    out = {}
    effs = {"model": Efficiency(), "linalg_quarter": dataclasses.replace(Efficiency(), linalg=Efficiency().linalg / 4)}
    for label, r in zip(effs, update_cost(cfg, gpu, tuple(effs.values()), compiled=True, layers=layers)):
        a, steady = r["amortized"], r["steady"]
        update = a["phases"].get("update", {})
        out[label] = {"step_s": a["step_s"], "update_s": a["update_s"], "update_share": a["update_share"],
                      "update_compute_s": update.get("compute_s", 0.0),
                      "update_exposed_s": update.get("exposed_s", 0.0),
                      "update_comm_s": update.get("comm_s", 0.0), "update_comm_bytes": update.get("comm_bytes", 0.0),
                      "steady_step_s": steady["step_s"], "refresh_step_s": r["refresh"]["step_s"],
                      "first_step_s": r["first"]["step_s"], "precondition_frequency": a["precondition_frequency"],
                      "forward_backward": a["phases"].get("forward_backward", {}),
                      "peak_gib": steady["peak_bytes"] / GiB, "fits": steady["fits"],
                      "tokens_per_s_per_gpu": steady["tokens_per_s_per_gpu"] * steady["step_s"] / a["step_s"]}
    out["seconds_to_simulate"] = time.time() - started
    out["owner_cost"] = owner_extrapolation(cfg, layers)
    print(layout, name, f"update {out['model']['update_share']:.1%} of {out['model']['step_s']:.2f} s, "
          f"peak {out['model']['peak_gib']:.1f} GiB ({out['seconds_to_simulate']:.0f} s)", flush=True)
    return out


def owned_ratio(row: dict) -> str:
    """Rank 0's owned update cost as the traced blocks extrapolate it, over the whole model's (owner_extrapolation)."""
    owner = row.get("owner_cost")
    return f"{owner['extrapolated'] / owner['exact']:.2f}" if owner and owner["exact"] else "-"


def tables(doc: dict) -> str:
    parts = []
    for layout, rows in doc["results"].items():
        head = ["optimizer", "step (s)", "update (ms)", "update share", "share, linalg 4x slower",
                f"share, x{ACCUMULATED} tokens", "update comm (GB sent)", "update comm exposed (ms)",
                "refresh step (s)", "peak (GiB)", "fits", "owned cost, traced / whole"]
        table = []
        for name, r in rows.items():
            m, q = r["model"], r["linalg_quarter"]
            table.append([name, f"{m['step_s']:.3f}", f"{m['update_s'] * 1e3:,.1f}", f"{m['update_share']:.2%}",
                          f"{q['update_share']:.2%}",
                          f"{m['update_s'] / (m['update_s'] + ACCUMULATED * (m['step_s'] - m['update_s'])):.2%}",
                          f"{m['update_comm_bytes'] / 1e9:.2f}",
                          f"{m['update_exposed_s'] * 1e3:,.1f}",
                          f"{m['refresh_step_s']:.3f}" if m["precondition_frequency"] > 1 else "-",
                          f"{m['peak_gib']:.1f}", "yes" if m["fits"] else "**no**", owned_ratio(r)])
        parts.append(f"**{LAYOUTS[layout][0]}** ({LAYOUTS[layout][2]}, compiled)\n\n"
                     + results_io.table(head, "lrrrrrrrrrlr", table))
        lo, hi = PUBLISHED_MUON
        if "muon" in rows:
            m = rows["muon"]["model"]
            share_more = m["update_s"] / (m["update_s"] + ACCUMULATED * (m["step_s"] - m["update_s"]))
            text = (f"Muon's update: {m['update_share']:.2%} of the step predicted ({share_more:.2%} with "
                    f"{ACCUMULATED}x the tokens a step); published (Moonlight) {lo:.0%}-{hi:.0%}")
            owner = rows["muon"].get("owner_cost")
            if owner and owner["extrapolated"] > owner["exact"] * 1.001:
                fair = m["update_s"] * owner["exact"] / owner["extrapolated"]
                text += (f"; {fair / (m['step_s'] - m['update_s'] + fair):.2%} with the update scaled to rank 0's "
                         "whole-model ownership (a lower estimate: not all of the update scales with it)")
            if layout.startswith("kimi"):
                adamw, muon = PUBLISHED_KIMI_GB300
                text += (f"; Megatron's Kimi K2 on 256 GB300: AdamW {adamw:,} and Muon {muon:,} model TFLOP/s/GPU, "
                         f"Muon {1 - muon / adamw:.1%} slower")
            parts.append(text + ".")
    eff = doc["efficiency"]
    parts.append("Update = the update phase's compute plus the exposure of its own collectives, amortized over "
                 "precondition_frequency (refresh step = the step that recomputes roots or bases). Constants "
                 "(nanomega/sim/devices.py): " + ", ".join(f"{k} {v}" for k, v in eff.items()) + ".")
    return "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="8b,70b", help=f"comma-separated, of {', '.join(LAYOUTS)}; the kimi ones "
                    "alone write optimizer_cost_kimi.*")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    layouts, names = results_io.chosen(ap, args.layouts, LAYOUTS), results_io.chosen(ap, args.optimizers, OPTIMIZERS)
    doc = results_io.start("optimizer_cost_kimi" if all(x.startswith("kimi") for x in layouts) else "optimizer_cost")
    doc["efficiency"] = dict(vars(Efficiency()))
    doc["published_muon_share"] = list(PUBLISHED_MUON)
    doc["results"] = {}
    for layout in layouts:
        for name in names:    # written after each: a trillion-parameter row takes minutes
            doc["results"].setdefault(layout, {})[name] = measure(layout, name)
            results_io.write(doc, tables(doc), args.out, quiet=True)
    print(tables(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
