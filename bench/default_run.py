"""The default run, end to end: `python train.py` as the README's first command runs it, timed in a subprocess.

    python bench/default_run.py                        # the default config, 280 steps (~4-5 min on 2 cores)
    python bench/default_run.py --train.steps=20 --out /tmp/smoke       # smoke test (other train.py flags pass on)

train.py runs with its defaults (configs/default.py: 3.3M parameters, 280 steps of 16 x 256 bytes, AdamW,
compiled step, four evaluations, two checkpoints, a sample at the end) and a fresh temporary
--train.out_dir, so no earlier run's checkpoint is resumed. Wall-clock is the whole subprocess: interpreter
start, data packing when its cache is cold, the matmul-rate measurement when not cached, compilation,
training, evaluations, checkpoints and the sample. The caches are left as they are; the results say whether
each was warm (present) before the run: the packed corpus and the measured matmul rate in
~/.cache/nanomega (data.cache_dir), and torch.compile's inductor cache.

From train.py's metrics.jsonl: the validation loss at each evaluation and the last one; tokens/s as the median
over log windows after the first (the first holds the compilation; evaluation is outside the windows), and
the training tokens over the wall-clock. Results: <out>/default_run.json and .md (--render JSON: the .md again).
"""
from __future__ import annotations

import argparse
import getpass
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import results_io  # noqa: E402

from nanomega.run.metrics import read_metrics  # noqa: E402


def cache_state() -> dict:
    """What the run finds cached before it starts: the packed corpus, the matmul rate, inductor's cache."""
    data = Path.home() / ".cache" / "nanomega"
    version = sysconfig.get_python_version()
    inductor = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                    or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    files = sum(1 for p in inductor.rglob("*") if p.is_file()) if inductor.is_dir() else 0
    return {"data_cache": "warm" if any(data.glob(f"stdlib-py{version}-*.train.bin")) else "cold",
            "matmul_rate_cache": "warm" if (data / "peak_flops.json").exists() else "cold",
            "compile_cache": "warm" if files else "cold", "compile_cache_dir": str(inductor),
            "compile_cache_files": files}


def summarize(records: list[dict], wall_s: float) -> dict:
    evals = [{"step": r["step"], "val_loss": r["val_loss"], "train_loss": r["loss"]}
             for r in records if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    last = records[-1]
    return {"steps": last["step"], "tokens": last["tokens"], "evals": evals, "final_val_loss": evals[-1]["val_loss"],
            "final_train_loss": last["loss"], "wall_s": wall_s,
            "tokens_per_s": statistics.median(rates[1:] or rates), "tokens_per_s_first_window": rates[0],
            "tokens_per_s_wall": last["tokens"] / wall_s, "mfu": statistics.median(
                [r["mfu"] for r in records if r.get("mfu")][1:] or [0.0])}


def tables(doc: dict) -> str:
    r, c = doc["result"], doc["caches"]
    minutes, seconds = divmod(round(r["wall_s"]), 60)
    lines = [results_io.table(
        ["command", "steps", "tokens", "wall-clock", "final val loss", "tokens/s¹", "tokens/s over wall-clock",
         "data cache", "compile cache"], "lrrrrrrll",
        [[f"`{doc['train_command']}`", r["steps"], f"{r['tokens']:,}", f"{minutes} min {seconds} s",
          f"**{r['final_val_loss']:.4f}**", f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_wall']:,.0f}",
          c["data_cache"], f"{c['compile_cache']} ({c['compile_cache_files']} files)"]]), ""]
    lines.append(results_io.table(["step", "val loss", "train loss"], "rrr",
                                  [[e["step"], f"{e['val_loss']:.4f}", f"{e['train_loss']:.4f}"] for e in r["evals"]]))
    lines += ["", "Loss in nats/byte (the byte tokenizer). Wall-clock: the whole `train.py` process (data, "
                  "compilation, training, evaluations, checkpoints, sample). ¹ Median over log windows after the "
                  f"first, evaluation excluded (the first window, compilation included: "
                  f"{r['tokens_per_s_first_window']:,.0f} tokens/s). The matmul-rate cache was "
                  f"{c['matmul_rate_cache']}."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="Other arguments go to train.py (e.g. --train.steps=20 for a smoke test)")
    results_io.add_arguments(ap)
    args, rest = ap.parse_known_args(argv)
    if args.render:
        return results_io.render(args.render, tables)
    doc = results_io.start("default_run")
    doc["caches"] = cache_state()
    with tempfile.TemporaryDirectory(prefix="nanomega-default-run-") as tmp:
        cmd = [sys.executable, "train.py", f"--train.out_dir={tmp}", *rest]
        doc["train_command"] = " ".join(["python train.py", *rest])
        print(f"running {' '.join(cmd)} (caches: data {doc['caches']['data_cache']}, compile "
              f"{doc['caches']['compile_cache']})", flush=True)
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(done.stdout[-3000:] + done.stderr[-3000:])
            sys.exit(f"error: train.py exited with {done.returncode}")
        records = read_metrics(Path(tmp) / "metrics.jsonl")
    out = done.stdout
    sample = out.split("--- sample ---\n", 1)[1] if "--- sample ---" in out else ""
    doc["sample"] = sample.rsplit("\n--------------", 1)[0]
    doc["stdout_head"] = out.splitlines()[:6]
    doc["result"] = summarize(records, wall)
    doc["metrics"] = records
    results_io.write(doc, tables(doc), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
