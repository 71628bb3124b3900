"""Where a trillion parameters bind (docs/scaling.md): the planner's best layout for a dense and a mixture-of-experts
trillion, where each step's time goes, what each rank holds, and an ablation, one technique changed at a time.

    python bench/scaling.py                                  # every case (~1 h on 2 loaded cores)
    python bench/scaling.py --cases=dense_1t_a100 --out /tmp/scaling
    python bench/scaling.py --render bench/results/scaling.json

Per case: `nanomega.sim.plan.plan` (the layout search: python -m nanomega.sim.plan with the case's arguments) picks
the fastest layout that fits; `nanomega.sim.step_time.predict` times it (the real step of one rank of one stage on
fake tensors, replayed on the device's clocks) and splits the step into
    compute          the stage's forward, backward and recomputation at the modelled kernel rates
    update           the optimizer's update (its compute and its collectives' exposure)
    pipeline bubble  the time the stage waits on its neighbours in the schedule
    tp, cp, ep, dp   the exposed seconds of the collectives over each group (sequence parallel's all-gathers and
                     reduce-scatters, context parallel's K/V, the expert all-to-alls, the data-parallel
                     gathers and reductions: FSDP, the distributed optimizer, DDP), where the code waits for them
and the bytes each rank holds at its peak by category. Then the ablation: the same layout with one technique
changed (removed where the layout has it, added where it does not), each timed the same way, with its tokens/s
per GPU, its ratio to the best and its peak. Three of them come from the best layout's own trace (time_step's
variants): FP8, and the all-to-all hidden behind other work (a bound on what overlapping it could give).

Cases (the issue's): Megatron's 1T GPT (configs/megatron_1t.py) on 3,072 A100 and on 1,024 H100 at the published
global batch (3,072 sequences of 2,048), and Kimi K2 (configs/kimi_k2.py) on 2,048 H100 at the planner's default
batch (two sequences of 4,096 a GPU). Predicted, not measured: no such machine is available to this project.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import results_io  # noqa: E402

from nanomega.config import parse_args  # noqa: E402
from nanomega.sim import plan as planner  # noqa: E402
from nanomega.sim.devices import Efficiency  # noqa: E402
from nanomega.sim.devices import device as device_named  # noqa: E402
from nanomega.sim.step_time import predict  # noqa: E402

GiB = 2**30
# megatron_1t ties its output layer to the embedding, which nanomega's pipeline refuses (the two live on different
# stages; Megatron keeps a copy on the last stage and all-reduces their gradients): planned untied, 1.31B parameters
# more (0.13%) on the last stage, the same FLOPs
UNTIED = ["--model.tie_embeddings=false"]
CASES = {   # name: (what, the planner's model arguments, GPUs, GPU, global batch tokens or None: the default)
    "dense_1t_a100": ("Megatron 1T GPT, 3,072 A100", ["--config=megatron_1t", *UNTIED], 3072, "a100", 3072 * 2048),
    "dense_1t_h100": ("Megatron 1T GPT, 1,024 H100", ["--config=megatron_1t", *UNTIED], 1024, "h100", 3072 * 2048),
    "moe_1t_h100": ("Kimi K2 (1.03T MoE), 2,048 H100", ["--config=kimi_k2"], 2048, "h100", None),
}
PARTS = ("compute", "update", "pipeline bubble", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send",
         "other")


def flag_dict(flags: list[str]) -> dict:
    return dict(f[2:].split("=", 1) for f in flags)


def as_flags(d: dict) -> list[str]:
    return [f"--{k}={v}" for k, v in d.items()]


# One technique changed at a time: name -> f(the best layout's flags as a dict, case) -> (label, flags) or None
# where it does not apply to this layout or model.
def _interleaving(f, case):
    if int(f.get("parallel.pp", 1)) == 1:
        return None
    if f.get("parallel.pp_schedule") == "interleaved_1f1b":
        return "without interleaving (1F1B)", {**f, "parallel.pp_schedule": "1f1b", "parallel.pp_virtual": "1"}
    return "with interleaving (2 virtual stages)", {**f, "parallel.pp_schedule": "interleaved_1f1b",
                                                    "parallel.pp_virtual": "2"}


def _sequence_parallel(f, case):
    if int(f.get("parallel.tp", 1)) == 1:
        return None
    return "without sequence parallel", {**f, "parallel.sequence_parallel": "false"}


def _sharded_state(f, case):
    """FSDP or the distributed optimizer removed: every data-parallel rank holds the whole state (DDP)."""
    dp = int(f.get("parallel.dp_shard", 1)) * int(f.get("parallel.dp_replicate", 1))
    if dp == 1:
        return None
    return "without FSDP / distributed optimizer (DDP)", {**f, "parallel.dp_shard": "1", "parallel.dp_replicate":
                                                          str(dp), "parallel.distributed_optimizer": "false"}


def _recomputation(f, case):
    now = f.get("train.activation_checkpointing", "none")
    other = {"full": "selective", "selective": "full", "none": "selective"}[now]
    return f"recomputation {other} (not {now})", {**f, "train.activation_checkpointing": other}


def _tp_across_nodes(f, case):
    """tp 16: twice a node's 8 GPUs, the factor taken from the data-parallel ranks (or the pipeline)."""
    tp = int(f.get("parallel.tp", 1))
    factor = 16 // tp
    g = dict(f)
    for key in ("parallel.dp_shard", "parallel.dp_replicate", "parallel.pp"):
        if int(g.get(key, 1)) % factor == 0 and int(g.get(key, 1)) > 1:
            g[key] = str(int(g[key]) // factor)
            break
    else:
        return None
    dp = int(g.get("parallel.dp_shard", 1)) * int(g.get("parallel.dp_replicate", 1))
    micro = int(f["train.batch_size"]) // (int(f.get("parallel.dp_shard", 1)) * int(f.get("parallel.dp_replicate", 1)))
    g.update({"parallel.tp": "16", "parallel.sequence_parallel": "true", "train.batch_size": str(micro * dp),
              "train.grad_accum": str(int(f["train.grad_accum"]) * int(f["train.batch_size"]) // (micro * dp))})
    return "tp 16 (across two nodes)", g


def _optimizer(name):
    def change(f, case):
        base = parse_args(case[1] + as_flags(f))
        if base.optim.name == name:
            return None
        # kimi_k2's Muon setting (update RMS matched to AdamW's) is refused by the others as unread: its default
        reset = {"optim.muon_scale": "spectral"} if base.optim.name == "muon" else {}
        return f"{name} in place of {base.optim.name}", {**f, "optim.name": name, **reset}
    return change


def _overlap(f, case):
    base = parse_args(case[1] + as_flags(f))
    if not base.model.n_experts or int(f.get("parallel.ep", 1)) == 1:
        return None
    chunks = 1 if base.model.moe_overlap_chunks > 1 else 4
    return f"all-to-all in {chunks} chunk{'s' * (chunks > 1)} (overlap {'on' if chunks > 1 else 'off'})", \
        {**f, "model.moe_overlap_chunks": str(chunks)}


ABLATIONS = {"interleaving": _interleaving, "sequence parallel": _sequence_parallel,
             "FSDP / distributed optimizer": _sharded_state, "recomputation": _recomputation,
             "tp across nodes": _tp_across_nodes, "Muon": _optimizer("muon"), "SOAP": _optimizer("soap"),
             "AdamW": _optimizer("adamw"), "all-to-all overlap": _overlap}
# from the best layout's own trace (time_step's variants): label -> the variant
VARIANTS = {"FP8 (tensorwise) on the blocks' matmuls": {"fp8": True},
            "all-to-all hidden behind other work (bound)": {"hidden": {"all_to_all"}}}


def timed(case, flags: list[str], variants=None):
    cfg = parse_args(case[1] + flags)
    p = cfg.parallel
    stage_layers = cfg.model.n_layers // p.pp
    return predict(cfg, case[3], Efficiency(), layers=(1, 2) if stage_layers > 2 else None,
                   micro=(2, 3) if cfg.train.grad_accum > 4 else None, variants=variants)


def parts(r: dict) -> dict:
    """The step split into PARTS, seconds: the compute of the forward and backward (recomputation included), the
    update's compute, the pipeline bubble, and the exposed seconds of each collective kind (the model keys them by
    kind; which group each serves is the layout's: docs/scaling.md names it per case); "other" is what is left of
    the step (the pipeline replay's rank-to-rank differences)."""
    update = r["phases"].get("update", {}).get("compute_s", 0.0)
    out = {"compute": r["compute_s"] - update, "update": update, "pipeline bubble": r.get("bubble_s", 0.0)}
    out.update(r["exposed_s"])
    out["other"] = r["step_s"] - sum(out.values())
    return out


def run_case(name: str, log) -> dict:
    case = CASES[name]
    what, args, gpus, gpu, batch = case
    found = planner.plan(args, gpus, gpu, global_batch_tokens=batch, top=3, log=log)
    budget = device_named(gpu).hbm_bytes * (1 - planner.MARGIN)
    log(f"{name}: best {found['best'][0]['layout'].describe()}")
    best = found["best"][0]
    flags = flag_dict(best["flags"])
    dev = device_named(gpu)
    extra = {label: v for label, v in VARIANTS.items()
             if (not v.get("fp8") or dev.fp8_flops) and (not v.get("hidden") or parse_args(args).model.n_experts)}
    base, *var = timed(case, as_flags(flags), variants=[{}] + list(extra.values()))
    row = {"what": what, "plan": {k: v for k, v in found.items() if k != "best"} | {
        "best": [{"layout": r["layout"].describe(), "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
                  "mfu": r["mfu"], "peak_gib": r["peak_bytes"] / GiB, "flags": r["flags"]} for r in found["best"]]},
           "best": {"layout": best["layout"].describe(), "flags": best["flags"], "step_s": base["step_s"],
                    "tokens_per_s_per_gpu": base["tokens_per_s_per_gpu"], "mfu": base["mfu"],
                    "tflops_per_gpu": base["tflops_per_gpu"], "parts_s": parts(base),
                    "peak_gib": base["peak_bytes"] / GiB,
                    "memory_gib": {k: v / GiB for k, v in base["by_category"].items()}},
           "ablations": []}
    row["plan"]["failed"] = [(layout.describe(), err) for layout, err in found.get("failed", [])]
    for label, r in zip(extra, var):
        row["ablations"].append(_ablation_row(label, r, base, budget))
    for key, change in ABLATIONS.items():
        changed = change(flags, case)
        if changed is None:
            continue
        label, new = changed
        log(f"{name}: {label}")
        try:
            r = timed(case, as_flags(new))
        except (ValueError, RuntimeError) as err:
            row["ablations"].append({"change": label, "error": str(err).strip().splitlines()[-1][:200]})
            continue
        row["ablations"].append(_ablation_row(label, r, base, budget))
    return row


def _ablation_row(label, r, base, budget):
    return {"change": label, "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"],
            "ratio": r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], "peak_gib": r["peak_bytes"] / GiB,
            "fits": r["peak_bytes"] <= budget, "mfu": r["mfu"]}


def tables(doc: dict) -> str:
    out = []
    for name, row in doc["results"].items():
        b = row["best"]
        step = b["step_s"]
        out.append(f"### {row['what']}\n\nbest: {b['layout']}: {b['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                   f"MFU {b['mfu']:.1%} ({b['tflops_per_gpu']:.0f} TFLOP/s), step {step:,.1f} s, peak "
                   f"{b['peak_gib']:.1f} GiB (planner: {row['plan']['simulated']} simulated of "
                   f"{row['plan']['candidates']} layouts in {row['plan']['seconds']:.0f} s)\n")
        out.append("| part | seconds | share of the step |\n|---|--:|--:|")
        out += [f"| {k} | {v:,.2f} | {v / step:.1%} |" for k, v in b["parts_s"].items() if v > 0.0005 * step]
        out.append("\n| held at the peak | GiB |\n|---|--:|")
        out += [f"| {k} | {v:,.1f} |" for k, v in sorted(b["memory_gib"].items(), key=lambda kv: -kv[1]) if v >= 0.05]
        out.append("\n| change (one at a time) | tokens/s/GPU | vs best | peak GiB |\n|---|--:|--:|--:|")
        for a in row["ablations"]:
            if "error" in a:
                out.append(f"| {a['change']} | refused: {a['error']} | | |")
            else:
                out.append(f"| {a['change']} | {a['tokens_per_s_per_gpu']:,.0f} | {a['ratio']:.2f}x | "
                           f"{a['peak_gib']:.1f}{'' if a['fits'] else ' (does not fit)'} |")
        out.append("")
    return "\n".join(out)


def svg(doc: dict) -> str:
    """The step's time by part per case: one horizontal bar each, parts stacked, as an SVG (no plotting library)."""
    colours = dict(zip(PARTS, ("#4c72b0", "#8172b2", "#c44e52", "#dd8452", "#937860", "#da8bc3", "#55a868",
                               "#ccb974", "#8c8c8c")))
    rows = list(doc["results"].items())
    width, left, bar, gap = 760, 230, 26, 14
    height = 40 + len(rows) * (bar + gap) + 40
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
          f'font-size="12">', '<text x="10" y="20" font-size="14">Where the step goes (share of the step, '
          'predicted)</text>']
    for i, (name, row) in enumerate(rows):
        y = 36 + i * (bar + gap)
        el.append(f'<text x="10" y="{y + bar * 0.65}">{row["what"]}</text>')
        x, step = left, row["best"]["step_s"]
        for part in PARTS:
            w = (width - left - 20) * row["best"]["parts_s"].get(part, 0.0) / step
            if w > 0.2:
                el.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{colours[part]}">'
                          f'<title>{part}: {row["best"]["parts_s"][part] / step:.1%}</title></rect>')
            x += w
    y = height - 22
    for j, part in enumerate(PARTS):
        el.append(f'<rect x="{10 + j * 84}" y="{y}" width="12" height="12" fill="{colours[part]}"/>'
                  f'<text x="{26 + j * 84}" y="{y + 10}">{part}</text>')
    return "\n".join(el + ["</svg>"]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--keep", default="", metavar="JSON", help="a results JSON whose cases are kept, not rerun "
                    "(a run that stopped part way: each case takes minutes)")
    results_io.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    cases = results_io.chosen(ap, args.cases, CASES)
    doc = results_io.start("scaling")
    kept = json.loads(Path(args.keep).read_text())["results"] if args.keep else {}
    doc["results"] = {}
    for name in cases:    # written after each: a case takes minutes
        doc["results"][name] = kept.get(name) or run_case(name, lambda s: print("  " + s, file=sys.stderr,
                                                                                    flush=True))
        path = results_io.write(doc, tables(doc), args.out, quiet=True)
        path.with_suffix(".svg").write_text(svg(doc))
    print(tables(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
