"""The measured split of a profiled step beside the step-time model's predicted one (nanomega/sim/step_time.py).

    python train.py ... --train.profile=4:5               # writes <out_dir>/profile/ (nanomega/run/profile.py)
    python -m nanomega.run.measured <out_dir> [--json]     # per step and rank: measured | predicted, per part

The parts are step_time's: compute (the forward and backward's ops), each collective kind's exposed time,
pipeline idle (point-to-point waits; predicted: the bubble plus what the transfers add), the optimizer update
(its ops; its collectives' waits are under their kinds), and host gaps (the step's time on the calling thread
inside no op: Python, the data batch, the profiler's own cost; the model predicts none). They sum to the step.

CPU / gloo traces, read here without a library. gloo runs a collective on its own threads and the caller blocks,
so the calling (main) thread's time is cut into: ops that launch or wait for a collective
(_c10d_functional::wait_tensor, c10d::allreduce_, ...: a wait is charged to the kind of the oldest launch whose
tensor has its shape), other top-level ops (compute, or the update inside the "nanomega: update" annotation),
and time inside no op. A Work.wait() from Python (the pipeline's batch_isend_irecv) is no op: the main thread's
idle time that a gloo event overlaps is charged to its kind (gloo:send / gloo:recv, annotated on the main thread
from the post until the transfer completes: "send", the pipeline's idle time; gloo:all_reduce and the others, on
gloo's threads), the rest is a host gap. GPU traces: the waits worth counting are on the communication streams, and
HolisticTraceAnalysis (Meta's HTA: its temporal breakdown, communication/computation overlap and idle time per
rank read torch.profiler's traces) does that analysis; it is not a dependency here (not installable in this
environment), so this reader refuses a CUDA trace and says to use HTA on it.

The prediction runs step_time.predict on this machine's CPU as a device entry (cpu_device): the matmul rate, a
copy's memory bandwidth, one small op's cost (eager dispatch: the model's per-kernel constant) and gloo's
all-reduce bandwidth and latency, each measured by as many processes as the run had ranks, at once and with the
run's threads, so that ranks sharing cores are measured sharing them. Efficiencies are 1: the rates are achieved
ones already. The matmul rate stands for attention too (the CPU's SDPA is no flash kernel: a known distance).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from nanomega.run.metrics import measure_matmul_flops
from nanomega.run.profile import FOLDER
from nanomega.sim.devices import Device, Efficiency

# a collective op's name -> step_time's kind (memory_tracker's names); "send": point-to-point
KINDS = (("reduce_scatter", "reduce_scatter"), ("all_gather", "all_gather"), ("allgather", "all_gather"),
         ("all_reduce", "all_reduce"), ("allreduce", "all_reduce"), ("all_to_all", "all_to_all"),
         ("alltoall", "all_to_all"), ("broadcast", "broadcast"), ("send", "send"), ("recv", "send"))
PARTS = ("compute", "update", "pipeline idle", "host gaps")


def kind_of(name: str) -> str | None:
    """The collective kind an op (or a gloo thread's event) belongs to; None for any other op."""
    low = name.lower()
    if not any(k in low for k in ("c10d", "gloo", "nccl")):
        return None
    if "wait" in low:
        return "wait"
    return next((kind for key, kind in KINDS if key in low), None)


def _dims(event) -> tuple:
    dims = event.get("args", {}).get("Input Dims") or [[]]
    first = dims[0] if dims else []
    return tuple(first[0] if first and isinstance(first[0], list) else first)


def _covered(spans: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of spans (sorted by start) inside [lo, hi]."""
    total, end = 0.0, lo
    for a, b in spans:
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _split(gaps: list[tuple[float, float]], spans: list[tuple[float, float]]) -> tuple[float, list]:
    """(time of `gaps` that `spans` cover, the gaps' uncovered pieces)."""
    found, rest = 0.0, []
    for a, b in gaps:
        for c, d in spans:
            if d <= a or c >= b:
                continue
            if c > a:
                rest.append((a, c))
            found += min(b, d) - max(a, c)
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            rest.append((a, b))
    return found, rest


def read_trace(path: str | Path) -> dict[int, dict]:
    """{step: {"step_s", "compute_s", "update_s", "host_s", "exposed_s": {kind: s}}} of one rank's chrome trace
    (the module doc's rules); "send" in exposed_s is the pipeline's idle time."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    if any(e.get("cat") in ("kernel", "gpu_memcpy") for e in events):
        raise ValueError(f"{path} is a CUDA trace: its exposed communication is on the GPU's communication streams, "
                         "which HolisticTraceAnalysis reads (pip install HolisticTraceAnalysis; its temporal and "
                         "communication/computation overlap breakdowns); this reader splits CPU / gloo traces")
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    if not steps:
        raise ValueError(f"{path} has no ProfilerStep# annotation: not a trace of --train.profile")
    main = steps[0]["tid"]
    ops = sorted((e for e in events if e["tid"] == main and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))
    updates = [e for e in events if e["name"] == "nanomega: update"]
    # gloo's events, by kind: a transfer's (gloo:send / gloo:recv, on the main thread from its post until it
    # completes) and a collective's (on gloo's threads), to charge the main thread's idle time they overlap
    gloo: dict[str, list] = {}
    for e in events:
        if e["name"].startswith("gloo:") and (kind := kind_of(e["name"])) not in (None, "wait"):
            gloo.setdefault(kind, []).append((e["ts"], e["ts"] + e["dur"]))
    order = sorted(gloo, key=lambda k: k != "send")       # a transfer first: the pipeline's waits
    out = {}
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in ops if lo <= e["ts"] < hi]
        top, stack, comm = [], [], []          # top-level ops; the outermost collective ops
        for e in inside:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            kind = kind_of(e["name"])
            if not stack:
                top.append(e)
            if kind and not any(kind_of(x["name"]) for x in stack):
                comm.append((e, kind))
            stack.append(e)
        exposed: dict[str, float] = {}
        pending: list[tuple[tuple, str]] = []  # launched collectives not yet waited: (tensor shape, kind)
        comm_in_update = 0.0
        for e, kind in comm:
            if kind == "wait":
                shape = _dims(e)
                hit = next((i for i, (d, _) in enumerate(pending) if d == shape), 0 if pending else None)
                kind = pending.pop(hit)[1] if hit is not None else "all_reduce"
            else:
                pending.append((_dims(e), kind))
            exposed[kind] = exposed.get(kind, 0.0) + e["dur"]
            if any(u["ts"] <= e["ts"] < u["ts"] + u["dur"] for u in updates):
                comm_in_update += e["dur"]
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in top]
        busy = _covered(spans, lo, hi)
        in_update = sum(_covered(spans, u["ts"], u["ts"] + u["dur"]) for u in updates if lo <= u["ts"] < hi)
        # the main thread's idle time, and the parts of it gloo's events overlap (a wait from Python: no op)
        gaps, end = [], lo
        for a, b in spans:
            if a > end:
                gaps.append((end, min(a, hi)))
            end = max(end, b)
        if end < hi:
            gaps.append((end, hi))
        idle = sum(b - a for a, b in gaps)
        waited = 0.0
        for kind in order:
            found, gaps = _split(gaps, sorted(gloo[kind]))
            if found:
                exposed[kind] = exposed.get(kind, 0.0) + found
                waited += found
        comm_total = sum(exposed.values()) - waited
        step = int(s["name"].split("#")[1])
        us = 1e-6
        out[step] = {"step_s": s["dur"] * us, "update_s": (in_update - comm_in_update) * us,
                     "compute_s": (busy - in_update - (comm_total - comm_in_update)) * us,
                     "host_s": (idle - waited) * us, "exposed_s": {k: v * us for k, v in exposed.items()}}
    return out


def _probe(rank: int, world: int, threads: int, port: int, out) -> None:
    """One process of cpu_device's measurement (its docstring)."""
    import torch.distributed as dist
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()
    flops = measure_matmul_flops(torch.device("cpu"), torch.float32, n=512, seconds=1.0)
    big = torch.randn(16 * 2**20 // 4)
    copy = torch.empty_like(big)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        copy.copy_(big)
        best = min(best, time.perf_counter() - start)
    bandwidth = 2 * big.numel() * 4 / best             # read and written
    small = torch.randn(64)
    start = time.perf_counter()
    for _ in range(2000):
        small = small.mul(1.0)
    kernel = (time.perf_counter() - start) / 2000
    dist.barrier()
    grad = torch.randn(4 * 2**20 // 4)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        dist.all_reduce(grad)
        times.append(time.perf_counter() - start)
    one = torch.zeros(1)
    lat = []
    for _ in range(20):
        start = time.perf_counter()
        dist.all_reduce(one)
        lat.append(time.perf_counter() - start)
    latency = sorted(lat)[len(lat) // 2]
    # an all-reduce's ring sends 2 (n - 1) / n of the buffer (memory_tracker's count): the link's rate
    link = 2 * (world - 1) / world * grad.numel() * 4 / max(sorted(times)[len(times) // 2] - latency, 1e-9)
    result = torch.tensor([flops, bandwidth, kernel, link, latency], dtype=torch.float64)
    dist.all_reduce(result)
    if rank == 0:
        out.put((result / world).tolist())
    dist.barrier()
    dist.destroy_process_group()


def cpu_device(world: int, threads: int = 1) -> tuple[Device, Efficiency, dict]:
    """This CPU as the step-time model's device, measured by `world` gloo processes of `threads` threads at once
    (module doc): (Device, Efficiency with the measured per-op and per-collective constants, the figures)."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_probe, args=(r, max(world, 2), threads, port, queue)) for r in range(max(world, 2))]
    for p in procs:
        p.start()
    flops, bandwidth, kernel, link, latency = queue.get(timeout=300)
    for p in procs:
        p.join()
    figures = {"matmul_flops": flops, "copy_bytes_per_s": bandwidth, "op_s": kernel, "gloo_bytes_per_s": link,
               "gloo_latency_s": latency, "processes": max(world, 2), "threads": threads}
    dev = Device("CPU (measured)", flops, None, 1e15, bandwidth, link, link, fp32_flops=flops)
    eff = Efficiency(matmul=1.0, grouped_matmul=1.0, attention=1.0, hbm=1.0, bus=1.0, kernel_s=kernel,
                     collective_s=latency, linalg=1.0)
    return dev, eff, figures


def predicted_parts(cfg, dev: Device, eff: Efficiency) -> dict:
    """step_time.predict's step in the measured parts (module doc)."""
    from nanomega.sim.step_time import predict
    r = predict(cfg, dev, eff)
    exposed = dict(r["exposed_s"])
    idle = exposed.pop("send", 0.0) + r.get("bubble_s", 0.0)
    if "pipeline" in r:
        pipe = r["pipeline"]
        update = pipe["update_s"] - sum(pipe["exposed_in_update_s"].values())
    else:
        update = r["phases"].get("update", {}).get("compute_s", 0.0)
    return {"step_s": r["step_s"], "compute_s": r["compute_s"] - update, "update_s": update,
            "pipeline_idle_s": idle, "host_s": 0.0, "exposed_s": exposed}


def measured_parts(m: dict) -> dict:
    exposed = dict(m["exposed_s"])
    return {"step_s": m["step_s"], "compute_s": m["compute_s"], "update_s": m["update_s"],
            "pipeline_idle_s": exposed.pop("send", 0.0), "host_s": m["host_s"], "exposed_s": exposed}


def split(out_dir: str | Path, device: tuple | None = None) -> dict:
    """Every rank's profiled steps, measured, beside the prediction for the run's config on this CPU."""
    from nanomega.config import from_dict
    folder = Path(out_dir) / FOLDER
    info_path = folder / "run.json"
    if not info_path.exists():
        raise FileNotFoundError(f"{info_path} not found: run train.py with --train.profile=<steps> and "
                                f"--train.out_dir={out_dir} first")
    info = json.loads(info_path.read_text())
    if info["device"] != "cpu":
        raise ValueError(f"{out_dir} was profiled on {info['device']}: read its traces with HolisticTraceAnalysis "
                         "(module doc); this reader splits CPU / gloo traces")
    cfg = from_dict(info["config"])
    traces = sorted(folder.glob("trace-rank*.json"), key=lambda p: int(p.stem.split("rank")[1]))
    if len(traces) != info["world_size"]:
        raise ValueError(f"{folder} holds {len(traces)} traces for a run of {info['world_size']} ranks")
    dev, eff, figures = device or cpu_device(info["world_size"], max(info["threads"]))
    measured = {int(p.stem.split("rank")[1]): {step: measured_parts(m) for step, m in read_trace(p).items()}
                for p in traces}
    return {"measured": measured, "predicted": predicted_parts(cfg, dev, eff), "device": figures,
            "steps": info["steps"], "world_size": info["world_size"]}


def _parts(x: dict, kinds: list[str]) -> list[float]:
    return [x["compute_s"], *(x["exposed_s"].get(k, 0.0) for k in kinds), x["pipeline_idle_s"], x["update_s"],
            x["host_s"], x["step_s"]]


def table(result: dict) -> str:
    """Per step and rank, each part in ms, measured | predicted, and the measured / predicted ratio."""
    pred = result["predicted"]
    kinds = sorted({k for r in result["measured"].values() for m in r.values() for k in m["exposed_s"]}
                   | set(pred["exposed_s"]))
    names = ["compute", *kinds, "pipeline idle", "update", "host gaps", "step"]
    lines = ["| rank | step | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 2)]
    p = _parts(pred, kinds)
    for rank, steps in sorted(result["measured"].items()):
        for step, m in sorted(steps.items()):
            cells = [f"{a * 1e3:.1f} / {b * 1e3:.1f}" for a, b in zip(_parts(m, kinds), p)]
            lines.append(f"| {rank} | {step} | " + " | ".join(cells) + " |")
    d = result["device"]
    return "\n".join(lines) + (
        f"\n\nms, measured / predicted (step_time on this CPU: matmul {d['matmul_flops'] / 1e9:.1f} GFLOP/s, "
        f"copy {d['copy_bytes_per_s'] / 1e9:.1f} GB/s, {d['op_s'] * 1e6:.1f} us an op, gloo "
        f"{d['gloo_bytes_per_s'] / 1e9:.2f} GB/s + {d['gloo_latency_s'] * 1e6:.0f} us, measured by "
        f"{d['processes']} processes of {d['threads']} threads)")


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 1:
        sys.exit("usage: python -m nanomega.run.measured <out_dir of a run with --train.profile> [--json]")
    try:
        result = split(args[0])
    except (ValueError, FileNotFoundError) as err:
        sys.exit(f"error: {err}")
    print(json.dumps(result) if "--json" in argv else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
