"""The results set a benchmark writes into --out (default bench/results/): <name>.json (every number, and how
it was made: date, command, machine, commit), <name>.md (the tables it prints, under one header line that
says the same) and, where the benchmark plots, <name>.png.

    doc = results_io.start("throughput")               # {"meta": {date, command, machine, ...}}
    doc["results"] = ...                               # every number
    results_io.write(doc, tables(doc), args.out)       # prints the tables, writes throughput.json and .md

Each benchmark builds its markdown with one function of the JSON alone, tables(doc), so that

    python bench/throughput.py --render bench/results/throughput.json

writes throughput.md again from the JSON (nothing is rerun), with the run's own date, command and machine.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def add_arguments(ap, out=RESULTS) -> None:
    ap.add_argument("--out", default=str(out), help="folder for the results set (<name>.json, .md, .png)")
    ap.add_argument("--render", default="", metavar="JSON",
                    help="only write the .md beside this results JSON again, from its numbers (no run)")


def chosen(ap, text: str, known, what: str = "") -> list[str]:
    """A comma-separated choice from the command line, in its order; an unknown name ends the run (ap.error) with
    the known ones."""
    names = text.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown {what}{unknown}; choose from {list(known)}")
    return names


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine() -> dict:
    import torch
    m = {"cpu": cpu_model(), "processor": platform.processor(), "cores": cores(), "logical_cpus": os.cpu_count(),
         "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
         "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        m.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return m


def describe_machine(m: dict) -> str:
    if not m.get("recorded", True):
        return m.get("note", "machine not recorded")
    gpu = f", {m['gpu']} (CUDA {m['cuda']})" if m.get("gpu") else ""
    return f"{m['cpu']}, {m['cores']} cores{gpu}, torch {m['torch']}"


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+changes" if head and dirty else "")


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def start(name: str) -> dict:
    """A new results document: its meta, and the clock its write() reads the run's seconds from."""
    meta = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command_line(), "machine": machine(), "commit": git_commit(),
            "load_average_before": round(os.getloadavg()[0], 2), "started": time.time()}
    return {"meta": meta}


def header(meta: dict, rendered: bool = False) -> str:
    """The .md's header line: date, command(s), machine, commit, duration, load."""
    commands = meta["command"] if isinstance(meta["command"], list) else [meta["command"]]
    parts = [f"**{meta['benchmark']}**, run {meta['date']}: " + "; ".join(f"`{c}`" for c in commands),
             describe_machine(meta["machine"])]
    if meta.get("commit"):
        parts.append(f"commit {meta['commit']}")
    if meta.get("seconds") is not None:
        parts.append(f"{meta['seconds']:,.0f} s")
    if meta.get("load_average_before") is not None:
        parts.append(f"1-min load average {meta['load_average_before']:.1f} before, "
                     f"{meta.get('load_average_after', float('nan')):.1f} after")
    if meta.get("note"):
        parts.append(meta["note"])
    line = " · ".join(parts) + f" · numbers: {meta['benchmark']}.json"
    if rendered:
        line += f" (this table re-rendered from it on {datetime.date.today().isoformat()})"
    return line


def write(doc: dict, md: str, out, quiet: bool = False) -> Path:
    """Finish the meta (seconds, load after), print the tables, write <out>/<name>.json and <name>.md."""
    meta = doc["meta"]
    # "started" stays: a benchmark that writes after every run (so an interrupted one keeps its runs) gets the
    # seconds since its start each time, not since its previous write
    meta["seconds"] = round(time.time() - meta.get("started", time.time()), 1)
    meta["load_average_after"] = round(os.getloadavg()[0], 2)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{meta['benchmark']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text(header(meta) + "\n\n" + md.strip() + "\n")
    if not quiet:
        print("\n" + md.strip() + f"\n\nwrote {path} and {path.with_suffix('.md').name}", flush=True)
    return path


def render(json_path, tables) -> int:
    """Write the .md beside a results JSON again, from its numbers, with tables(doc)."""
    path = Path(json_path)
    doc = json.loads(path.read_text())
    md = tables(doc)
    path.with_suffix(".md").write_text(header(doc["meta"], rendered=True) + "\n\n" + md.strip() + "\n")
    print(md.strip() + f"\n\nwrote {path.with_suffix('.md')}")
    return 0


def table(head: list[str], align: str, rows: list[list]) -> str:
    """A markdown table; align has one letter per column: l (text) or r (numbers)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if a == "l" else "--:" for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


NO_PNG = "no PNG: matplotlib is not installed (pip install matplotlib; a bench-only dependency)"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed (plots are a
    bench-only extra: a benchmark without it still writes its JSON and tables, and says NO_PNG)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path, dpi: int = 120) -> str:
    """Lay out, write and close a figure of pyplot(); the line a benchmark prints."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return f"wrote {path}"
