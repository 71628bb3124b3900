"""Each optimizer's cost at scale, predicted: update time and communication as a share of the train step.

    python bench/optimizer_cost.py                          # both layouts, every optimizer (~5 min on 2 cores)
    python bench/optimizer_cost.py --layouts 8b --optimizers adamw,muon --out /tmp/smoke

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

Layouts:
  llama3_8b on 8 H100, FSDP 8: bench/published.py's torchtitan layout (local batch 2 x 8,192, selective
    recomputation, bf16 parameters), on that row's GPU (Grand Teton's H100, 96 GB HBM2e), compiled.
  llama3_70b on 64 H100 SXM (80 GB), FSDP 8 x TP 8 with sequence parallel: 16 sequences of 8,192 per data-
    parallel rank (torchtitan's 70B local batch), full recomputation, bf16 parameters, compiled.
Optimizers at OptimConfig's defaults (Muon: 5 bf16 Newton-Schulz steps; Shampoo: blocks of 1,024, roots every
10 steps; SOAP: max_precond_dim 1,024, bases refreshed every 10 steps), and SOAP with max_precond_dim 16,384
(soap_16k: every hidden dim preconditioned). Under FSDP x TP the owners gather each matrix whole over tp too
(parallel.muon_tp=duplicated: "distributed", Newton-Schulz on the tp shards, is refused with dp_shard > 1).
The update costs the same whatever the batch; its share falls as a step carries more tokens. "x8 tokens" is the
share with 8 times this step's tokens (gradient accumulation: forward + backward x 8, the update once), from the
same figures: update / (update + 8 x (step - update)); Moonlight's steps carry millions of tokens. Published for Muon: Moonlight (Liu et al.
2025, "Muon is Scalable for LLM Training") puts its overhead at ~1-3% of a step; modded-nanogpt alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402
from published import TT_8B  # noqa: E402

from nanomega import optim  # noqa: E402
from nanomega.config import parse_args  # noqa: E402
from nanomega.sim.devices import Efficiency  # noqa: E402
from nanomega.sim.step_time import update_cost  # noqa: E402

GiB = 2 ** 30
# row: flags. SOAP at its default max_precond_dim (1,024) preconditions no dim of these models (all are longer:
# 4,096 and up), so it runs as Adam; the second SOAP row gives every hidden dim a basis (not the vocabulary's).
OPTIMIZERS = {**dict.fromkeys(optim.REGISTRY, []),     # every registered optimizer at its defaults
              "soap_16k": ["--optim.name=soap", "--optim.max_precond_dim=16384"]}
ACCUMULATED = 8     # the share again with this many times the tokens a step (module doc)
TT_70B_64 = ["--config=llama3_70b", "--parallel.dp_shard=8", "--parallel.tp=8", "--parallel.sequence_parallel=true",
             "--train.batch_size=128", "--train.seq_len=8192", "--train.activation_checkpointing=full",
             "--train.param_dtype=bfloat16"]
# name: (layout in words, flags, gpu, blocks simulated)
LAYOUTS = {
    "8b": ("Llama 3.1 8B, 8 H100 (96 GB), FSDP 8, 2 x 8,192 a GPU, selective recomputation", TT_8B,
           "h100_hbm2e", (8, 16)),
    "70b": ("Llama 3.1 70B, 64 H100 (80 GB), FSDP 8 x TP 8, 16 x 8,192 a DP rank, full recomputation", TT_70B_64,
            "h100", (8, 16)),
}
PUBLISHED_MUON = (0.01, 0.03)      # Moonlight: Muon's overhead, share of a step


def measure(layout: str, name: str) -> dict:
    words, flags, gpu, layers = LAYOUTS[layout]
    cfg = parse_args(list(flags) + (OPTIMIZERS[name] or [f"--optim.name={name}"]))
    started = time.time()
    out = {}
    effs = {"model": Efficiency(), "linalg_quarter": dataclasses.replace(Efficiency(), linalg=Efficiency().linalg / 4)}
    for label, r in zip(effs, update_cost(cfg, gpu, tuple(effs.values()), compiled=True, layers=layers)):
        a, steady = r["amortized"], r["steady"]
        update = a["phases"].get("update", {})
        out[label] = {"step_s": a["step_s"], "update_s": a["update_s"], "update_share": a["update_share"],
                      "update_compute_s": update.get("compute_s", 0.0), "update_exposed_s": update.get("exposed_s", 0.0),
                      "update_comm_s": update.get("comm_s", 0.0), "update_comm_bytes": update.get("comm_bytes", 0.0),
                      "steady_step_s": steady["step_s"], "refresh_step_s": r["refresh"]["step_s"],
                      "first_step_s": r["first"]["step_s"], "precondition_frequency": a["precondition_frequency"],
                      "forward_backward": a["phases"].get("forward_backward", {}),
                      "peak_gib": steady["peak_bytes"] / GiB, "fits": steady["fits"],
                      "tokens_per_s_per_gpu": steady["tokens_per_s_per_gpu"] * steady["step_s"] / a["step_s"]}
    out["seconds_to_simulate"] = time.time() - started
    print(layout, name, f"update {out['model']['update_share']:.1%} of {out['model']['step_s']:.2f} s, "
          f"peak {out['model']['peak_gib']:.1f} GiB ({out['seconds_to_simulate']:.0f} s)", flush=True)
    return out


def tables(doc: dict) -> str:
    parts = []
    for layout, rows in doc["results"].items():
        head = ["optimizer", "step (s)", "update (ms)", "update share", "share, linalg 4x slower",
                f"share, x{ACCUMULATED} tokens", "update comm (GB sent)", "update comm exposed (ms)", "refresh step (s)", "peak (GiB)", "fits"]
        table = []
        for name, r in rows.items():
            m, q = r["model"], r["linalg_quarter"]
            table.append([name, f"{m['step_s']:.3f}", f"{m['update_s'] * 1e3:,.1f}", f"{m['update_share']:.2%}",
                          f"{q['update_share']:.2%}", f"{m['update_s'] / (m['update_s'] + ACCUMULATED * (m['step_s'] - m['update_s'])):.2%}",
                          f"{m['update_comm_bytes'] / 1e9:.2f}",
                          f"{m['update_exposed_s'] * 1e3:,.1f}",
                          f"{m['refresh_step_s']:.3f}" if m["precondition_frequency"] > 1 else "-",
                          f"{m['peak_gib']:.1f}", "yes" if m["fits"] else "**no**"])
        parts.append(f"**{LAYOUTS[layout][0]}** ({LAYOUTS[layout][2]}, compiled)\n\n"
                     + results_io.table(head, "lrrrrrrrrrl", table))
        lo, hi = PUBLISHED_MUON
        if "muon" in rows:
            m = rows["muon"]["model"]
            share_more = m["update_s"] / (m["update_s"] + ACCUMULATED * (m["step_s"] - m["update_s"]))
            parts.append(f"Muon's update: {m['update_share']:.2%} of the step predicted ({share_more:.2%} with "
                         f"{ACCUMULATED}x the tokens a step); published (Moonlight) {lo:.0%}-{hi:.0%}.")
    eff = doc["efficiency"]
    parts.append("Update = the update phase's compute plus the exposure of its own collectives, amortized over "
                 "precondition_frequency (refresh step = the step that recomputes roots or bases). Constants "
                 "(nanomega/sim/devices.py): " + ", ".join(f"{k} {v}" for k, v in eff.items()) + ".")
    return "\n\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    layouts, names = args.layouts.split(","), args.optimizers.split(",")
    for given, known in ((layouts, LAYOUTS), (names, OPTIMIZERS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"unknown {unknown}; choose from {list(known)}")
    doc = results_io.start("optimizer_cost")
    doc["efficiency"] = dict(vars(Efficiency()))
    doc["published_muon_share"] = list(PUBLISHED_MUON)
    doc["results"] = {layout: {name: measure(layout, name) for name in names} for layout in layouts}
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
