#!/usr/bin/env bash
# One prepared throughput check for a CUDA machine (H100/H200), about 13 minutes, nothing from the network.
#   bash bench/gpu.sh                 # results sets and the log go to $OUT if set, else to a temporary folder
#   BATCH=4 bash bench/gpu.sh         # smaller batch for the ~1B run (default 8 x 2048 tokens)
# 1) the ~1B LLaMA (configs/tinyllama_1b.py): compiled-bf16 vs eager-bf16, seq 2048, interleaved rounds;
# 2) the CPU default config (3.3M parameters) on the GPU, a quick second line;
# 3) float8 recipes vs bf16 on the ~1B model and an MoE (about 6 more minutes; FP8=0 skips them);
# 5) the step-time model (nanomega/sim/step_time.py) beside 1): the same config and batch predicted for this GPU,
#    eager and compiled, measured/predicted tokens/s and peak (model_gpu.{json,md}; MODEL=0 skips it);
# 4) only where more than one GPU is present (nvidia-smi -L): the parallel layouts (FSDP, TP, PP, CP, EP) of a small
#    model under torchrun with NCCL, a few steps each, their measured peak memory beside the simulator's (up to
#    LAYOUT_LIMIT=150 s per layout; LAYOUTS=0 skips them). NCCL's contracts are checked for the same layouts on the
#    CPU first (python -m nanomega.sim.contracts, seconds each): a violation stops part 4 before it touches a GPU.
# Each is one bench/throughput.py results set, named as bench/results/ names them: throughput_gpu.{json,md}
# (the 1B model), throughput_gpu_default, throughput_gpu_fp8 (1B), throughput_gpu_fp8_moe; log throughput_gpu.log;
# part 5: model_gpu.{json,md};
# part 4: layouts_gpu.{json,md} and each layout's folder (logs, simulated.json, peaks, the run) under layouts/.
# Assumes torch, einops, safetensors, tqdm, numpy are installed; pip is only used offline (-e . --no-deps).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$LOG_DIR"
BATCH="${BATCH:-8}"
PY="${PYTHON:-python}"
START=$SECONDS
status=0

run() {  # run NAME SECONDS ARGS...: one results set under a time limit; a failure is reported, not fatal
    local label=$1 limit=$2 rc=0
    shift 2
    echo; echo "== $label (limit ${limit}s, $((SECONDS - START))s elapsed)"
    timeout --kill-after=10 "$limit" "$PY" bench/throughput.py "$@" --out "$LOG_DIR" --name "$label" || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "== $label FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ': timed out'))"
        status=1
    fi
}

# 4) the layouts, 2 GPUs each (every case fits any machine with more than one GPU), and one of 4 where there are
#    4: "name|GPUs|flags". The dense default model (3.3M parameters), its MoE twin for EP; eager, as the simulator
#    runs the step; flags as README's "Running at scale".
LAYOUT_CASES=(
    "fsdp|2|--config=default --parallel.dp_shard=2"
    "tp_sp|2|--config=default --parallel.tp=2 --parallel.sequence_parallel=true"
    "pp_1f1b|2|--config=default --parallel.pp=2 --train.grad_accum=4"
    "cp|2|--config=default --parallel.cp=2"
    "ep_fsdp|2|--config=tiny_mixtral --parallel.dp_shard=2 --parallel.ep=2"
    "pp_tp|4|--config=default --parallel.pp=2 --parallel.tp=2 --train.grad_accum=4"
)
# a few steps, one evaluation and one checkpoint (the last step's), no sample: each run ends as a real one does
LAYOUT_STEPS=(--train.steps=6 --train.log_every=1 --train.eval_every=6 --train.ckpt_every=6 --train.sample_tokens=0
              --train.compile=false --train.batch_size=8)
LAYOUT_LIMIT="${LAYOUT_LIMIT:-150}"    # seconds per layout: NCCL waits rather than fails, so a hang shows as this
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)   # 0 without nvidia-smi: part 4 is skipped, never fatal

layout_cases() {  # the cases this machine has the GPUs for, one "name|GPUs|flags" line each
    local case need
    for case in "${LAYOUT_CASES[@]}"; do
        IFS='|' read -r _ need _ <<< "$case"
        if [ "$need" -le "$GPUS" ]; then echo "$case"; fi
    done
}

check_contracts() {  # NCCL's contracts of every layout, on the CPU, before a GPU is used: 1 if one is broken
    local name need flags rc broken=0
    while IFS='|' read -r name need flags; do
        rc=0
        # shellcheck disable=SC2086  # the flags are words
        timeout 300 "$PY" -m nanomega.sim.contracts $flags "${LAYOUT_STEPS[@]}" > "$LOG_DIR/layouts/$name.contracts.txt" 2>&1 \
            || rc=$?
        echo "   $name: $(tail -n 1 "$LOG_DIR/layouts/$name.contracts.txt") (exit $rc)"
        if [ "$rc" -ne 0 ]; then broken=1; fi
    done < <(layout_cases)
    return "$broken"
}

run_layouts() {  # each layout under torchrun (NCCL) with its peak per rank, beside the simulator's for the same flags
    local name need flags rc start dir
    # train.py records no memory figure: this runs its main, then writes the rank's CUDA peak
    cat > "$LOG_DIR/layouts/train_peak.py" <<'EOF'
"""train.py's main under torchrun, then this rank's CUDA peak (allocated, reserved) into <folder>/peak-rank<r>.json."""
import json, os, sys
import torch
sys.path.insert(0, os.getcwd())
import train
folder, argv = sys.argv[1], sys.argv[2:]
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
train.main(argv)
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(folder, f"peak-rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "max_allocated": torch.cuda.max_memory_allocated(device),
               "max_reserved": torch.cuda.max_memory_reserved(device)}, f)
EOF
    while IFS='|' read -r name need flags; do
        dir="$LOG_DIR/layouts/$name"
        rm -rf "$dir" && mkdir -p "$dir"
        echo "   $name ($need GPUs, limit ${LAYOUT_LIMIT}s, $((SECONDS - START))s elapsed): $flags"
        # a layout the simulator cannot run: its error is the table's "not simulated"
        # shellcheck disable=SC2086
        "$PY" -m nanomega.sim.estimate $flags "${LAYOUT_STEPS[@]}" --json > "$dir/simulated.json" 2> "$dir/simulated.err" \
            || echo "      not simulated: $(tail -n 1 "$dir/simulated.err")"
        rc=0 start=$SECONDS
        # shellcheck disable=SC2086
        timeout --kill-after=15 "$LAYOUT_LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node="$need" \
            "$LOG_DIR/layouts/train_peak.py" "$dir" $flags "${LAYOUT_STEPS[@]}" --train.out_dir="$dir/run" \
            > "$dir/train.log" 2>&1 || rc=$?
        echo "$rc $((SECONDS - start))" > "$dir/exit"
        if [ "$rc" -ne 0 ]; then
            echo "   $name FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ': timed out, a hang'))"
            tail -n 5 "$dir/train.log"
            status=1
        fi
    done < <(layout_cases)
    "$PY" - "$LOG_DIR" "${LAYOUT_CASES[@]}" <<'EOF' || status=1
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import results_io
out, cases = Path(sys.argv[1]), [c.split("|") for c in sys.argv[2:]]
doc = results_io.start("layouts_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh"
doc["cases"] = []
GiB = 2 ** 30
for name, gpus, flags in cases:
    d = out / "layouts" / name
    if not (d / "exit").exists():
        continue
    rc, seconds = map(int, (d / "exit").read_text().split())
    peaks = sorted((json.loads(p.read_text()) for p in d.glob("peak-rank*.json")), key=lambda p: p["rank"])
    try:
        simulated = json.loads((d / "simulated.json").read_text())
        sim = {"peak_bytes": simulated["peak_bytes"], "peak_rank": simulated["peak_rank"]}
    except (OSError, ValueError, KeyError):
        err = (d / "simulated.err").read_text().strip().splitlines() if (d / "simulated.err").exists() else []
        sim = {"not_simulated": err[-1] if err else "no output"}
    metrics = d / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    doc["cases"].append({"name": name, "gpus": int(gpus), "flags": flags, "exit": rc, "seconds": seconds,
                         "timed_out": rc in (124, 137), "peaks": peaks, "simulated": sim, "loss": last.get("loss"),
                         "val_loss": last.get("val_loss"), "tokens_per_s": last.get("tokens_per_s")})


def tables(doc):
    rows = []
    for c in doc["cases"]:
        measured = max((p["max_allocated"] for p in c["peaks"]), default=None)
        sim = c["simulated"]
        rows.append([c["name"], c["gpus"], f"`{c['flags']}`",
                     "hang (timed out)" if c["timed_out"] else "ok" if c["exit"] == 0 else f"exit {c['exit']}",
                     c["seconds"], "-" if measured is None else f"{measured / GiB:.3f}",
                     f"{sim['peak_bytes'] / GiB:.3f}" if "peak_bytes" in sim else "not simulated",
                     "-" if c["val_loss"] is None else f"{c['val_loss']:.4f}"])
    return ("Each layout: 6 eager steps under torchrun (NCCL). Peak: torch.cuda.max_memory_allocated over the whole "
            "run (the steps, the evaluation, the checkpoint), the largest over the ranks; simulated: python -m "
            "nanomega.sim.estimate --json with the same flags (one step, every role of rank); GiB.\n\n" + results_io.table(
                ["layout", "GPUs", "flags (+ a few steps)", "result", "s", "peak", "simulated", "val loss"],
                "lrllrrrr", rows))


results_io.write(doc, tables(doc), out)
EOF
}

model_vs_measured() {  # 5) the step-time model's prediction for throughput_gpu's runs, beside their measurement
    local gpu variant
    gpu=$("$PY" -c "import torch; n = torch.cuda.get_device_name().upper(); print(next((g for g in ('B200', 'H200', 'H100', 'A100') if g in n), ''))")
    if [ -z "$gpu" ]; then echo "   no device table entry for this GPU: part 5 skipped"; return 0; fi
    for variant in eager compiled; do
        # shellcheck disable=SC2046  # --compiled is one word or none
        timeout 300 "$PY" -m nanomega.sim.step_time --config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048 \
            --gpu="${gpu,,}" $([ "$variant" = compiled ] && echo --compiled) --json > "$LOG_DIR/model_$variant.json" \
            || { echo "   step_time ($variant) failed"; status=1; }
    done
    "$PY" - "$LOG_DIR" <<'EOF' || status=1
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import results_io
out = Path(sys.argv[1])
measured = {r["variant"]: r for r in json.loads((out / "throughput_gpu.json").read_text())["results"]}
doc = results_io.start("model_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh"
doc["rows"] = []
for variant in ("eager", "compiled"):
    got, path = measured.get(f"{variant}-bf16"), out / f"model_{variant}.json"
    if got is None or not path.exists() or not path.read_text().strip():
        continue
    want = json.loads(path.read_text())
    doc["rows"].append({"variant": f"{variant}-bf16", "measured_tokens_per_s": got["tokens_per_s"],
                        "predicted_tokens_per_s": want["tokens_per_s_per_gpu"],
                        "measured_peak_gib": got.get("peak_mem_gib"), "predicted_peak_gib": want["peak_bytes"] / 2**30,
                        "gpu": want["gpu"]})
rows = [[r["variant"], r["gpu"], f"{r['measured_tokens_per_s']:,.0f}", f"{r['predicted_tokens_per_s']:,.0f}",
         f"{r['predicted_tokens_per_s'] / r['measured_tokens_per_s']:.2f}",
         "-" if r["measured_peak_gib"] is None else f"{r['measured_peak_gib']:.1f}", f"{r['predicted_peak_gib']:.1f}"]
        for r in doc["rows"]]
text = ("configs/tinyllama_1b, one GPU, the batch of throughput_gpu: tokens/s measured by bench/throughput.py and "
        "predicted by python -m nanomega.sim.step_time (the constants of nanomega/sim/devices.py, fixed; compiled differs from "
        "eager in the model only by pointwise ops fused away); peaks: torch.cuda.max_memory_allocated against the "
        "simulator's.\n\n" + results_io.table(["variant", "GPU", "measured tokens/s", "predicted", "predicted / measured",
                                               "measured peak GiB", "predicted peak GiB"], "llrrrrr", rows))
results_io.write(doc, text, out)
print(text)
EOF
}

main() {
echo "== $(date -u +%FT%TZ) ${HOSTNAME:-?}, repo $(git rev-parse --short HEAD 2>/dev/null || echo '?'), logs in $LOG_DIR"
nvidia-smi || echo "warning: nvidia-smi failed"
if ! (cd / && "$PY" -c "import nanomega") 2>/dev/null; then
    echo "== nanomega not installed; pip install --no-deps --no-build-isolation -e . (offline)"
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . \
        || echo "warning: editable install failed; bench/throughput.py imports this checkout directly anyway"
fi
"$PY" - <<'EOF'
import torch, einops  # noqa: F401  (fail here, clearly, if a dependency is missing)
assert torch.cuda.is_available(), "CUDA is not available to torch"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
layouts_ok=1
if [ "$GPUS" -gt 1 ] && [ "${LAYOUTS:-1}" != 0 ]; then
    # 4) first, on the CPU: a layout that breaks an NCCL contract would hang or crash on the GPUs
    echo; echo "== NCCL contracts of the layouts for $GPUS GPUs (CPU, fake tensors)"
    mkdir -p "$LOG_DIR/layouts"
    if ! check_contracts; then
        echo "== a layout breaks NCCL's contracts (above; $LOG_DIR/layouts/*.contracts.txt): part 4 will not run"
        layouts_ok=0
        status=1
    fi
fi

# ~1.1B parameters, 8 x 2048 = 16k tokens/step; compilation (~1-2 min) is in the warm-up, not the timing.
# Eager first: its warm-up line (first and last warm-up step) is printed even if compilation runs out of time.
run throughput_gpu 190 --config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048 \
    --variants=eager-bf16,compiled-bf16 --steps 10 --warmup 2
if [ "${MODEL:-1}" != 0 ]; then
    echo; echo "== the step-time model against throughput_gpu ($((SECONDS - START))s elapsed)"
    model_vs_measured
fi
run throughput_gpu_default 60 --config=default --variants=eager-bf16,compiled-bf16 --steps 20 --warmup 2
# 3) float8 (model.fp8) against bf16, compiled: the ~1B dense model, then an MoE (experts per-expert float8).
#    The goal: tensorwise >= 1.3x bf16 tokens/s on the 1B model. FP8=0 skips this part.
if [ "${FP8:-1}" != 0 ]; then
run throughput_gpu_fp8 240 --config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048 \
    --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise,compiled-fp8blockwise --steps 6 --warmup 2
run throughput_gpu_fp8_moe 120 --config=tiny_qwen3_moe --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise \
    --steps 10 --warmup 2
fi

if [ "$GPUS" -gt 1 ] && [ "${LAYOUTS:-1}" != 0 ] && [ "$layouts_ok" = 1 ]; then
    echo; echo "== parallel layouts on $GPUS GPUs ($((SECONDS - START))s elapsed)"
    run_layouts
fi

echo; echo "== summary ($((SECONDS - START))s total)"
"$PY" - "$LOG_DIR" <<'EOF'
import json, sys
from pathlib import Path
for path in (Path(sys.argv[1]) / f"throughput_gpu{name}.json" for name in ("", "_default", "_fp8", "_fp8_moe")):
    if not path.exists():
        continue
    d = json.loads(path.read_text())
    s = d["summary"]
    for r in d["results"]:
        print(f"{s['config']:>13} B{s['batch_size']} T{s['seq_len']} {r['variant']:>14}: "
              f"{r['tokens_per_s']:>10,.0f} tokens/s  {r['tflops']:7.1f} TFLOP/s  MFU {r['mfu']:6.1%}  "
              f"first step {r['first_step_s']:5.1f} s  peak {r.get('peak_mem_gib', 0):5.1f} GiB")
    for v, msg in d["errors"].items():
        print(f"{s['config']:>13} {v}: {msg}")
EOF
return "$status"
}

main 2>&1 | tee -a "$LOG_DIR/throughput_gpu.log"      # pipefail: the exit status is main's
