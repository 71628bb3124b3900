#!/usr/bin/env bash
# One prepared throughput check for a CUDA machine (H100/H200), under 11 minutes, nothing from the network.
#   bash bench/gpu.sh                 # results sets and the log go to $OUT if set, else to a temporary folder
#   BATCH=4 bash bench/gpu.sh         # smaller batch for the ~1B run (default 8 x 2048 tokens)
# 1) the ~1B LLaMA (configs/tinyllama_1b.py): compiled-bf16 vs eager-bf16, seq 2048, interleaved rounds;
# 2) the CPU default config (3.3M parameters) on the GPU, a quick second line;
# 3) float8 recipes vs bf16 on the ~1B model and an MoE (about 6 more minutes; FP8=0 skips them).
# Each is one bench/throughput.py results set, named as bench/results/ names them: throughput_gpu.{json,md}
# (the 1B model), throughput_gpu_default, throughput_gpu_fp8 (1B), throughput_gpu_fp8_moe; log throughput_gpu.log.
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

# ~1.1B parameters, 8 x 2048 = 16k tokens/step; compilation (~1-2 min) is in the warm-up, not the timing.
# Eager first: its warm-up line (first and last warm-up step) is printed even if compilation runs out of time.
run throughput_gpu 190 --config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048 \
    --variants=eager-bf16,compiled-bf16 --steps 10 --warmup 2
run throughput_gpu_default 60 --config=default --variants=eager-bf16,compiled-bf16 --steps 20 --warmup 2
# 3) float8 (train.fp8) against bf16, compiled: the ~1B dense model, then an MoE (experts per-expert float8).
#    The goal: tensorwise >= 1.3x bf16 tokens/s on the 1B model. FP8=0 skips this part.
if [ "${FP8:-1}" != 0 ]; then
run throughput_gpu_fp8 240 --config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048 \
    --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise,compiled-fp8blockwise --steps 6 --warmup 2
run throughput_gpu_fp8_moe 120 --config=tiny_qwen3_moe --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise \
    --steps 10 --warmup 2
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
