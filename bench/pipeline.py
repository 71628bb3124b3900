"""The pipeline bubble of each schedule, measured on this machine beside the theory.

    python bench/pipeline.py                    # pp 2 and 4, m 4 and 8, four schedules (16 launches)
    python bench/pipeline.py --pp 2 --micro 4 --schedules 1f1b --steps 2 --out /tmp/smoke   # smoke test

For each pipeline size and schedule, one torchrun launch of pp gloo processes trains a LLaMA-style
model (d 256, 8 blocks, sequence 256, batch 4 per micro-batch, AdamW, fp32, eager) for a few steps
under parallel.pp alone. The executor (nanomega/parallel/pipeline.py) times each action's computation
from after its inputs arrived to its end; for the last step the bubble is
    1 - (sum over ranks of compute time) / (pp * (last end - first start))
the idle share of the step across the ranks, the definition schedules.theoretical_bubble uses
((pp-1)/(m+pp-1) for GPipe and 1F1B, divided about by v for interleaved 1F1B, (pp-1)/(6m+pp-1) for
ZB-V with the step as a barrier). Point-to-point transfers, the loss's all-reduce and Python overhead
count as idle. With pp = 4 the four processes share this machine's cores, so a rank's compute slows
while others compute: read those rows as the order of the schedules, not as their bubbles.
Results: <out>/pipeline.json (every row, with each rank's (action, start, end) of the last step) and .md.
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

import results_io  # noqa: E402

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zb_v": 2}
MODEL = ["--model.d_model=256", "--model.n_layers=8", "--model.n_heads=8", "--model.n_kv_heads=4",
         "--model.ffn_dim=768", "--model.max_seq_len=256", "--train.seq_len=256", "--train.batch_size=4",
         "--train.compile=false", "--train.device=cpu", "--optim.warmup_steps=1"]


def worker(out: str, spec: str) -> None:
    import torch
    import train
    from nanomega.config import parse_args
    from nanomega.train.step import make_step_fns, step_options
    args = json.loads(spec)
    cfg = parse_args(args["argv"])
    torch.manual_seed(0)
    model_cfg, params, opt, pipe = train.setup(cfg, torch.device("cpu"))
    state = opt.init(params)
    fns = make_step_fns(model_cfg, opt, par=pipe, **step_options(cfg.train))
    gen = torch.Generator().manual_seed(0)
    t = cfg.train
    for _ in range(args["steps"]):
        x = torch.randint(0, cfg.model.vocab_size, (t.grad_accum, t.batch_size, t.seq_len + 1), generator=gen)
        loss, grads, stats = fns.grads(params, [(m[:, :-1], m[:, 1:]) for m in x])
        params, state = fns.update(grads, state, params, stats)
    timeline = [(str(a), start, end) for a, start, end in pipe.timeline]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, timeline)
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def bubble(timelines: list) -> tuple[float, float]:
    """(measured idle share, the step's span in seconds) from every rank's (action, start, end)."""
    first = min(start for rank in timelines for _, start, _ in rank)
    last = max(end for rank in timelines for _, _, end in rank)
    busy = sum(end - start for rank in timelines for _, start, end in rank)
    return 1 - busy / (len(timelines) * (last - first)), last - first


def tables(doc: dict) -> str:
    rows = [[r["pp"], r["m"], r["schedule"], r["v"], f"{r['measured']:.3f}", f"{r['theory']:.3f}", f"{r['span_s']:.2f}"]
            for r in doc["rows"]]
    return (f"{doc['steps']} steps per launch, the last one timed; model: {' '.join(doc['model_args'])}\n\n"
            + results_io.table(["pp", "m", "schedule", "v", "measured bubble", "theory", "step (s)"], "rrlrrrr", rows)
            + "\n\nMeasured: 1 - (sum over ranks of compute time) / (pp x the step's span), from the executor's "
              "per-action times; transfers, the loss's all-reduce and Python between actions count as idle. Theory: "
              "schedules.theoretical_bubble. pp = 4 runs 4 processes on this machine's cores (see its header).")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"from {', '.join(SCHEDULES)}")
    results_io.add_arguments(parser)
    a = parser.parse_args()
    if a.render:
        return results_io.render(a.render, tables)
    from nanomega.parallel.schedules import theoretical_bubble
    doc = results_io.start("pipeline")
    doc.update(steps=a.steps, model_args=MODEL, rows=[])
    for pp in a.pp:
        for m in a.micro:
            for name in a.schedules.split(","):
                v = SCHEDULES[name]
                argv = MODEL + [f"--parallel.pp={pp}", f"--parallel.pp_schedule={name}", f"--parallel.pp_virtual={v}",
                                f"--train.grad_accum={m}"]
                if name == "interleaved_1f1b" and m % pp:
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp, "timeline.json")
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}",
                           __file__, "--worker", str(out), json.dumps({"argv": argv, "steps": a.steps})]
                    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    timelines = json.loads(out.read_text())
                measured, span = bubble(timelines)
                theory = float(theoretical_bubble(name, pp, m, v))
                doc["rows"].append({"pp": pp, "m": m, "schedule": name, "v": v, "measured": measured, "theory": theory,
                                    "span_s": span, "timelines": timelines})
                print(f"pp {pp}, m {m}, {name} (v {v}): measured {measured:.3f}, theory {theory:.3f}, step "
                      f"{span:.2f} s", flush=True)
    results_io.write(doc, tables(doc), a.out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
