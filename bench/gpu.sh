#!/usr/bin/env bash
# The prepared check for one CUDA GPU (H200/H100), in two parts that each fit one call of a lent machine (one H200,
# 15 minutes in all, at most 10 a command, at most 8 files back), nothing from the network.
#   OUT=dir bash bench/gpu.sh [--part 1]   # part 1 (the default): <= 7 minutes on an H200, compilation included
#   OUT=dir bash bench/gpu.sh --part 2     # part 2: <= 5 minutes
#   OUT=dir bash bench/gpu.sh --dry-run [--part N]   # the same commands on the CPU default config, one step each
#   BATCH=4 ... (the ~1B model's batch, default 8 x 2048 tokens); PART_BUDGET=seconds (the part's cap, below)
#
# Part 1, each item a results file in $OUT (8 files: gpu1.log with every command's output, and)
#   scaled_mm_gpu.{json,md}  CUDA's torch._scaled_mm (nanomega/models/fp8.py, the kernel matmul_kernel picks) against
#                            the CPU emulation on the same float8 operands, per recipe, one 1B FFN shape and one
#                            ragged (padded) one: agreement with a float64 product, TFLOP/s beside bf16's
#   train_gpu.{json,md}      the ~1B LLaMA (configs/tinyllama_1b.py) under train.py, compiled, bf16 then float8
#                            tensorwise and rowwise on the same data: tokens/s, MFU, peak, first step (compilation),
#                            loss after the steps, speed-up over bf16, beside python -m nanomega.sim.step_time's
#                            prediction for the same run (--compiled, and --fp8 for the float8 rows)
#   profile_gpu.tar.gz       the bf16 run's last step through --train.profile: trace-rank0.json (Perfetto,
#                            TensorBoard, HolisticTraceAnalysis) and the CUDA memory snapshot (pytorch.org/memory_viz),
#                            the snapshot left out if the archive would pass 15 MiB. python -m nanomega.run.measured
#                            refuses CUDA traces (it points to HTA); its answer is in the log
#   throughput_gpu_moe.{json,md}  the tiny MoE (configs/tiny_qwen3_moe.py), compiled bf16, experts as one grouped GEMM
#                            (--model.expert_kernel=grouped_mm), bench/throughput.py
# Part 2 (7 files: gpu2.log and)
#   throughput_gpu.{json,md}       the ~1B model, eager bf16 against compiled bf16 (bench/throughput.py, interleaved)
#   model_gpu.{json,md}            the step-time model beside those two rows (tokens/s, peak)
#   throughput_gpu_fp8_moe.{json,md}  the tiny MoE: compiled bf16 against float8 tensorwise and rowwise
#   and, in the log only (an 8th file would be its .json and .md), the CPU default config on the GPU.
#   With more than one GPU (nvidia-smi -L; never on the one-H200 loan, where it is skipped with a message): NCCL's
#   contracts of each parallel layout on the CPU, then FSDP, TP+SP, PP, CP, EP (and PP x TP on 4) under torchrun,
#   peak beside the simulator's: layouts_gpu.{json,md} (then 9 files), run folders in the scratch folder.
#   Left out of both parts: float8 blockwise on the ~1B model (another compile of ~1.5 min; tests/test_fp8_devices.py
#   checks its CUDA contract on the CPU and scaled_mm_gpu runs its _scaled_mm path).
#
# Time budget. No GPU run of this repository has been measured yet (bench/results holds no throughput_gpu*), so the
# per-step figures are the step-time model's: the ~1B compiled bf16 step of 8 x 2048 tokens is 0.29 s on an H200
# (57k tokens/s, 42% MFU, 49 GiB peak; python -m nanomega.sim.step_time --config=tinyllama_1b --train.batch_size=8
# --train.seq_len=2048 --gpu=h200 --compiled), so 10 steps are ~3 s and what costs is everything around them:
#   part 1  setup (offline editable install, imports, CUDA start)                                      ~15 s
#           scaled_mm: 3 recipes x 2 shapes, the CPU emulation of 8192 x 2048 x 5632 on 16 cores < 1 s each  ~15 s
#           3 train.py runs of the 1B model, each: start and data (the built-in corpus is prepared once,
#           by the first) ~15 s, torch.compile of the 22-block step ~60-90 s (inductor; float8 adds its
#           casts' kernels), 10 steps ~3 s, the last step's checkpoint (13.2 GB of fp32 weights and AdamW
#           moments, into /dev/shm where it has room, deleted after) ~5-10 s                         3 x ~100 s
#           the tiny MoE: compile of a 4-block model ~40 s, 12 steps of 64 x 256 tokens ~1 s            ~45 s
#           = ~6.5 minutes expected; the step-time predictions run on the CPU beside the first training run.
#   part 2  setup ~15 s; the 1B eager vs compiled (one compile ~75 s, 12 rounds of ~0.7 s) ~100 s; the step-time
#           model twice ~20 s; the default config eager vs compiled ~40 s; the MoE in three compiled variants
#           (three compiles of ~30 s) ~100 s = ~4.6 minutes.
# On the loan: the machine's start (~1-2 min) + part 1 + part 2 as the next call while it is warm (30 s) is ~13 of
# the 15 minutes; give each call timeout_s = its cap + 60 (480, 360). A fresh machine for part 2 costs another start.
# Each item also has its own timeout, and each part a cap (PART_BUDGET: 420 s for part 1, 300 s for part 2): an
# item gets at most what is left of the cap, and items the cap no longer covers are skipped with a message, so a
# slow compile costs the later items, never the call. The order puts what no other part measures first.
#
# --dry-run runs every command of the part on the CPU (CUDA_VISIBLE_DEVICES=""): configs/default.py in place of the
# 1B model and tiny_qwen3_moe as it is, both with a batch of BATCH=2 sequences of 64 tokens, one step (train.py) or
# one warm-up and one timed step (throughput.py), _scaled_mm's CPU kernel with small shapes (the CPU's own
# _scaled_mm, not the emulation, stands for the device's), step-time predictions for an H200, and
# TORCH_COMPILE_DISABLE=1: compiled variants and --train.compile=true run eagerly, since inductor's CPU compile
# alone takes minutes on a loaded 2-core machine. The flags, variants, file names and summaries are the GPU run's,
# so a typo or a renamed flag fails there (tests/test_gpu_script.py, slow tier: ~1 minute a part on 2 loaded cores)
# and not on a loan. What it cannot check: CUDA-only paths (the memory snapshot, _scaled_mm's padding to 16, the
# grouped GEMM in bf16 on sm90, inductor's GPU code) and the minutes above.
# Assumes torch, einops, safetensors, tqdm, numpy are installed; pip is only used offline (-e . --no-deps).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PART=1 DRY=0
while [ $# -gt 0 ]; do
    case "$1" in
        --part) PART="${2:-}"; shift 2 || { echo "error: --part takes 1 or 2" >&2; exit 2; } ;;
        --part=*) PART="${1#--part=}"; shift ;;
        --dry-run) DRY=1; shift ;;
        -h|--help) sed -n '2,7p' "${BASH_SOURCE[0]}" | cut -c3-; exit 0 ;;
        *) echo "error: unknown argument '$1'; use --part 1, --part 2, --dry-run" >&2; exit 2 ;;
    esac
done
if [ "$PART" != 1 ] && [ "$PART" != 2 ]; then echo "error: --part is 1 or 2, got '$PART'" >&2; exit 2; fi

LOG_DIR="${OUT:-$(mktemp -d)}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(cd "$LOG_DIR" && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONUNBUFFERED=1
# run folders (a 1B checkpoint is 13 GB) and throw-away sets: never under $OUT, whose files all come back
if [ "$DRY" = 0 ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt 31457280 ]; then
    SCRATCH=$(mktemp -d /dev/shm/gpu_sh.XXXXXX)
else
    SCRATCH=$(mktemp -d)
fi
trap 'rm -rf "$SCRATCH"' EXIT
START=$SECONDS
BUDGET="${PART_BUDGET:-$([ "$PART" = 1 ] && echo 420 || echo 300)}"
status=0

if [ "$DRY" = 1 ]; then
    export CUDA_VISIBLE_DEVICES="" TORCH_COMPILE_DISABLE=1
    BATCH="${BATCH:-2}"
    BIG=(--config=default --train.batch_size="$BATCH" --train.seq_len=64 --train.device=cpu)
    SMALL=(--train.batch_size="$BATCH" --train.seq_len=64 --train.device=cpu)   # the tiny MoE's, the default's
    TRAIN_STEPS=1 BENCH=(--steps 1 --warmup 1) GPU_ENTRY=h200
    SHAPES="64x256x128,40x128x24"
else
    BATCH="${BATCH:-8}"
    BIG=(--config=tinyllama_1b --train.batch_size="$BATCH" --train.seq_len=2048)
    SMALL=(--train.batch_size=64)       # 16k tokens of 256 a step: GEMMs a GPU can time, not the CPU's 16
    TRAIN_STEPS=10 BENCH=(--steps 10 --warmup 2) GPU_ENTRY=""
    SHAPES="8192x2048x5632,1000x2048x1000"
fi

limit_for() {  # limit_for SECONDS: the item's limit, cut to what is left of the part's cap; 0: skip it
    local left=$((BUDGET - (SECONDS - START) - 10))
    if [ "$left" -lt 20 ]; then echo 0; elif [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

failed() {  # failed LABEL RC: say so (124: the timeout) and mark the part failed
    echo "== $1 FAILED (exit $2$([ "$2" -eq 124 ] && echo ': timed out'))"
    status=1
}

bench() {  # bench NAME SECONDS OUTDIR ARGS...: one bench/throughput.py results set; a failure is reported, not fatal
    local label=$1 limit rc=0 dir=$3
    limit=$(limit_for "$2")
    shift 3
    echo; echo "== $label (limit ${limit}s, $((SECONDS - START))s elapsed)"
    if [ "$limit" = 0 ]; then echo "== $label skipped: the part's ${BUDGET}s are spent"; status=1; return 0; fi
    timeout --kill-after=10 "$limit" "$PY" bench/throughput.py "$@" --out "$dir" --name "$label" || rc=$?
    if [ "$rc" -ne 0 ]; then failed "$label" "$rc"; fi
}

train_run() {  # train_run NAME SECONDS ARGS...: train.py into $SCRATCH/NAME, its checkpoints deleted after
    local label=$1 limit rc=0 start=$SECONDS dir="$SCRATCH/$1"
    limit=$(limit_for "$2")
    shift 2
    echo; echo "== train.py $label (limit ${limit}s, $((SECONDS - START))s elapsed): $*"
    if [ "$limit" = 0 ]; then echo "== $label skipped: the part's ${BUDGET}s are spent"; status=1; return 0; fi
    timeout --kill-after=15 "$limit" "$PY" train.py "${BIG[@]}" --train.steps="$TRAIN_STEPS" --train.log_every=1 \
        --train.eval_every="$TRAIN_STEPS" --train.eval_batches=1 --train.ckpt_every="$TRAIN_STEPS" \
        --train.sample_tokens=0 --train.compile=true --train.out_dir="$dir" "$@" || rc=$?
    echo "$rc $((SECONDS - start))" > "$dir.exit"
    rm -rf "$dir"/ckpt-*
    if [ "$rc" -ne 0 ]; then failed "train.py $label" "$rc"; fi
}

predict() {  # predict NAME ARGS...: step_time's prediction for this GPU into $SCRATCH/NAME.json
    local gpu=$GPU_ENTRY name=$1
    shift
    if [ -z "$gpu" ]; then
        gpu=$("$PY" -c "import torch; n = torch.cuda.get_device_name().upper()
print(next((g for g in ('B200', 'H200', 'H100', 'A100') if g in n), ''))")
    fi
    if [ -z "$gpu" ]; then echo "   no device table entry for this GPU: no prediction ($name)"; return 0; fi
    timeout 300 "$PY" -m nanomega.sim.step_time "$@" --gpu="${gpu,,}" --json > "$SCRATCH/$name.json" \
        || { echo "   step_time ($name) failed"; return 1; }
}

setup() {
    echo "== $(date -u +%FT%TZ) ${HOSTNAME:-?}, repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')," \
         "part $PART" \
         "$([ "$DRY" = 1 ] && echo '(dry run on the CPU)'), results in $LOG_DIR, scratch $SCRATCH, cap ${BUDGET}s"
    if [ "$DRY" = 0 ]; then nvidia-smi || echo "warning: nvidia-smi failed"; fi
    if ! (cd / && "$PY" -c "import nanomega") 2>/dev/null; then
        echo "== nanomega not installed; pip install --no-deps --no-build-isolation -e . (offline)"
        "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . \
            || echo "warning: editable install failed; the scripts import this checkout directly anyway"
    fi
    "$PY" - "$DRY" <<'EOF'
import sys
import torch, einops  # noqa: F401  (fail here, clearly, if a dependency is missing)
if sys.argv[1] == "1":
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads")
else:
    assert torch.cuda.is_available(), "CUDA is not available to torch"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
}

scaled_mm_check() {  # CUDA's _scaled_mm against the CPU emulation on the same float8 operands
    local limit rc=0
    limit=$(limit_for 90)
    echo; echo "== scaled_mm_gpu (limit ${limit}s, $((SECONDS - START))s elapsed)"
    if [ "$limit" = 0 ]; then echo "== scaled_mm_gpu skipped: the part's ${BUDGET}s are spent"; status=1; return 0; fi
    timeout --kill-after=10 "$limit" "$PY" - "$LOG_DIR" "$DRY" "$SHAPES" <<'EOF' || rc=$?
"""Per recipe and shape: float8 operands quantized once on the CPU as nanomega's forward does (x [M, K] and
w [N, K] along K); the device's product (fp8.scaled_matmul with matmul_kernel's Kernel: CUDA's _scaled_mm, padded
to 16) against fp8.emulated_matmul (the CPU's float32 emulation) and both against the float64 product of the
dequantized operands; rates: the device's median of 10 (after 3 warm-ups), bf16's on the unquantized operands."""
import statistics, sys, time
from pathlib import Path
import torch
sys.path[:0] = [".", "bench"]
import results_io
from nanomega.models import fp8

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[3].split(",")]
device = torch.device("cpu" if dry else "cuda")
kernel = fp8.SCALED_MM if dry else fp8.matmul_kernel(device)   # dry: the CPU's own _scaled_mm, not the emulation


def rate(fn, flops, repeats):
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return flops / statistics.median(times) / 1e12


def error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


doc = results_io.start("scaled_mm_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh" + (" --dry-run" if dry else "")
doc.update(device=str(device), hardware=torch.cuda.get_device_name() if not dry else "cpu", kernel=kernel._asdict(),
           rows=[])
g = torch.Generator().manual_seed(0)
for m, k, n in shapes:
    # rows of unequal size (a token's activations, a feature's weights): what the finer recipes are for
    x = torch.randn(m, k, generator=g) * torch.randn(m, 1, generator=g).exp()
    w = torch.randn(n, k, generator=g) * 0.02
    xb, wb = x.to(device, torch.bfloat16), w.to(device, torch.bfloat16).t()
    bf16 = rate(lambda: xb @ wb, 2 * m * k * n, 3 if dry else 10)
    # blockwise scales a weight in 128 x 128 blocks: the model refuses other shapes (fp8.refusal), so does this
    for recipe in ("tensorwise", "rowwise") + (("blockwise",) if k % fp8.BLOCK == n % fp8.BLOCK == 0 else ()):
        qx, sx = fp8.quantize(x, fp8.E4M3, recipe, 1)
        qw, sw = fp8.quantize(w, fp8.E4M3, recipe, 1, weight=True)
        full = (lambda s: s.repeat_interleave(fp8.BLOCK, 1)) if recipe == "blockwise" else (lambda s: s)
        want = (qx.double() * full(sx).double()) @ (qw.double() * full(sw).double()).t()
        t = time.perf_counter()
        emulated = fp8.emulated_matmul(qx, sx, qw.t(), sw.t(), recipe)
        emulated_s = time.perf_counter() - t
        args = [v.to(device) for v in (qx, sx, qw.t(), sw.t())]
        got = fp8.scaled_matmul(args[0], args[1], args[2], args[3], torch.float32, recipe, kernel).cpu()
        device_rate = rate(lambda: fp8.scaled_matmul(*args[:4], torch.float32, recipe, kernel), 2 * m * k * n,
                           1 if dry else 10)
        doc["rows"].append({"recipe": recipe, "m": m, "k": k, "n": n,
                            "device_vs_emulation": error(got, emulated.double()),
                            "device_vs_float64": error(got, want), "emulation_vs_float64": error(emulated, want),
                            "device_tflops": device_rate, "bf16_tflops": bf16,
                            "emulation_tflops": 2 * m * k * n / emulated_s / 1e12})
rows = [[r["recipe"], f"{r['m']} x {r['k']} x {r['n']}", f"{r['device_vs_emulation']:.2e}",
         f"{r['device_vs_float64']:.2e}", f"{r['emulation_vs_float64']:.2e}", f"{r['device_tflops']:.3g}",
         f"{r['bf16_tflops']:.3g}", f"{r['device_tflops'] / r['bf16_tflops']:.2f}", f"{r['emulation_tflops']:.3g}"]
        for r in doc["rows"]]
text = (f"Float8 (e4m3) products of the same quantized operands, float32 out, on {doc['hardware']} "
        f"(kernel {doc['kernel']}) against the CPU's emulation; errors: max |difference| / max |float64 product|; "
        "TFLOP/s: the device's _scaled_mm path (blockwise: one row-scaled _scaled_mm per 128-long slice of K), "
        "bf16's matmul on the same device, the emulation on the CPU.\n\n" + results_io.table(
            ["recipe", "M x K x N", "device vs emulation", "device vs float64", "emulation vs float64",
             "TFLOP/s", "bf16 TFLOP/s", "fp8 / bf16", "emulation TFLOP/s"], "llrrrrrrr", rows))
results_io.write(doc, text, out)
worst = max(r["device_vs_emulation"] for r in doc["rows"])
sys.exit(0 if worst < 1e-2 else f"the device's float8 product is {worst:.1e} from the emulation (more than 1e-2)")
EOF
    if [ "$rc" -ne 0 ]; then failed scaled_mm_gpu "$rc"; fi
}

train_summary() {  # train_gpu.{json,md}: the training runs and the step-time model's prediction of each
    "$PY" - "$LOG_DIR" "$SCRATCH" "$DRY" "$*" <<'EOF' || status=1
import json, statistics, sys
from pathlib import Path
sys.path[:0] = ["bench"]
import results_io
out, scratch, dry, flags = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
doc = results_io.start("train_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh" + (" --dry-run" if dry else "")
doc.update(flags=flags, rows=[])
for variant, predicted in (("bf16", "predict_bf16"), ("fp8tensorwise", "predict_fp8"), ("fp8rowwise", "predict_fp8")):
    run, done = scratch / f"train_{variant}", scratch / f"train_{variant}.exit"
    if not done.exists():
        continue
    rc, seconds = map(int, done.read_text().split())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    records = [r for r in records if "tokens_per_s" in r]
    # the steady steps: not the first (compilation) nor the last (profiled, evaluated, checkpointed)
    steady = records[1:-1] or records
    row = {"variant": variant, "exit": rc, "seconds": seconds, "steps": len(records)}
    if records:
        row.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                   mfu=statistics.median(r["mfu"] for r in steady),
                   peak_gib=max(r.get("peak_memory_gib", 0.0) for r in records),
                   first_step_s=records[0]["tokens"] / records[0]["tokens_per_s"],
                   loss=records[-1]["loss"], val_loss=records[-1].get("val_loss"))
    path = scratch / f"{predicted}.json"
    if path.exists() and path.read_text().strip():
        p = json.loads(path.read_text())
        row.update(predicted_tokens_per_s=p["tokens_per_s_per_gpu"], predicted_mfu=p["mfu"],
                   predicted_peak_gib=p["peak_bytes"] / 2**30, gpu=p["gpu"])
    doc["rows"].append(row)
base = next((r.get("tokens_per_s") for r in doc["rows"] if r["variant"] == "bf16"), None)


def f(value, spec):
    return "-" if value is None else format(value, spec)


rows = [[r["variant"], "ok" if r["exit"] == 0 else f"exit {r['exit']}", r["steps"], f(r.get("tokens_per_s"), ",.0f"),
         f(r.get("mfu"), ".1%"), f(r.get("peak_gib"), ".1f"), f(r.get("first_step_s"), ".1f"), f(r.get("loss"), ".4f"),
         f(r.get("val_loss"), ".4f"),
         f(r["tokens_per_s"] / base if base and r.get("tokens_per_s") else None, ".2f"),
         f(r.get("predicted_tokens_per_s"), ",.0f"),
         f(r["predicted_tokens_per_s"] / r["tokens_per_s"] if r.get("tokens_per_s") and
           r.get("predicted_tokens_per_s") else None, ".2f"), f(r.get("predicted_peak_gib"), ".1f")]
        for r in doc["rows"]]
text = (f"python train.py {flags} (+ --model.fp8=<recipe>): compiled, the built-in corpus, the same batches for each. "
        "tokens/s and MFU: the median step but the first (compilation) and the last (profiled, evaluated); peak: "
        "torch.cuda.max_memory_allocated over the run; loss: the last step's training loss, val: one validation batch "
        "after it. Predicted: python -m nanomega.sim.step_time with the same flags --compiled (float8 rows: --fp8) for "
        f"{doc['rows'][0].get('gpu', 'this GPU') if doc['rows'] else '-'}.\n\n" + results_io.table(
            ["variant", "result", "steps", "tokens/s", "MFU", "peak GiB", "first step s", "loss", "val loss",
             "vs bf16", "predicted tokens/s", "predicted / measured", "predicted peak GiB"], "llrrrrrrrrrrr", rows))
results_io.write(doc, text, out)
sys.exit(0 if doc["rows"] else "no training run finished")
EOF
}

profile_results() {  # the bf16 run's profile: measured.py's reading (the CPU's; CUDA: a pointer to HTA), the archive
    local dir="$SCRATCH/train_bf16/profile" rc=0
    echo; echo "== the profiled step ($((SECONDS - START))s elapsed)"
    if [ ! -f "$dir/trace-rank0.json" ]; then echo "== no trace in $dir"; status=1; return 0; fi
    timeout 180 "$PY" -m nanomega.run.measured "$SCRATCH/train_bf16" || rc=$?
    if [ "$rc" -ne 0 ] && [ "$DRY" = 1 ]; then failed "nanomega.run.measured on the CPU trace" "$rc"; fi
    tar -czf "$LOG_DIR/profile_gpu.tar.gz" -C "$dir" .
    if [ "$(stat -c %s "$LOG_DIR/profile_gpu.tar.gz")" -gt 15728640 ]; then
        echo "   the archive passes 15 MiB: the memory snapshot left out"
        tar -czf "$LOG_DIR/profile_gpu.tar.gz" -C "$dir" --exclude='memory-rank*' .
    fi
    echo "   $(tar -tzf "$LOG_DIR/profile_gpu.tar.gz" | tr '\n' ' ')($(stat -c %s "$LOG_DIR/profile_gpu.tar.gz") bytes)"
}

part1() {
    local pids=() pid
    scaled_mm_check
    # the step-time model on the CPU, beside the first training run
    predict predict_bf16 "${BIG[@]}" --compiled & pids+=($!)
    predict predict_fp8 "${BIG[@]}" --compiled --fp8 & pids+=($!)
    train_run train_bf16 150 --train.profile="$TRAIN_STEPS"
    train_run train_fp8tensorwise 130 --model.fp8=tensorwise
    train_run train_fp8rowwise 130 --model.fp8=rowwise
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    echo; echo "== train_gpu ($((SECONDS - START))s elapsed)"
    train_summary "${BIG[@]}" --train.steps="$TRAIN_STEPS"
    profile_results
    bench throughput_gpu_moe 90 "$LOG_DIR" --config=tiny_qwen3_moe --model.expert_kernel=grouped_mm \
        --variants=compiled-bf16 "${BENCH[@]}" "${SMALL[@]}"
}

# part 2's layouts, 2 GPUs each, and one of 4 where there are 4: "name|GPUs|flags". The dense default model
# (3.3M parameters), its MoE twin for EP; eager, as the simulator runs the step; flags as README's "Running at scale".
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
if [ "$DRY" = 1 ]; then GPUS=0; else GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true); fi

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
        timeout 300 "$PY" -m nanomega.sim.contracts $flags "${LAYOUT_STEPS[@]}" \
            > "$SCRATCH/layouts/$name.contracts.txt" 2>&1 || rc=$?
        echo "   $name: $(tail -n 1 "$SCRATCH/layouts/$name.contracts.txt") (exit $rc)"
        if [ "$rc" -ne 0 ]; then broken=1; fi
    done < <(layout_cases)
    return "$broken"
}

run_layouts() {  # each layout under torchrun (NCCL) with its peak per rank, beside the simulator's for the same flags
    local name need flags rc start dir
    # train.py records no memory figure: this runs its main, then writes the rank's CUDA peak
    cat > "$SCRATCH/layouts/train_peak.py" <<'EOF'
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
        dir="$SCRATCH/layouts/$name"
        rm -rf "$dir" && mkdir -p "$dir"
        echo "   $name ($need GPUs, limit ${LAYOUT_LIMIT}s, $((SECONDS - START))s elapsed): $flags"
        # a layout the simulator cannot run: its error is the table's "not simulated"
        # shellcheck disable=SC2086
        "$PY" -m nanomega.sim.estimate $flags "${LAYOUT_STEPS[@]}" --json > "$dir/simulated.json" \
            2> "$dir/simulated.err" || echo "      not simulated: $(tail -n 1 "$dir/simulated.err")"
        rc=0 start=$SECONDS
        # shellcheck disable=SC2086
        timeout --kill-after=15 "$LAYOUT_LIMIT" "$PY" -m torch.distributed.run --standalone --nproc-per-node="$need" \
            "$SCRATCH/layouts/train_peak.py" "$dir" $flags "${LAYOUT_STEPS[@]}" --train.out_dir="$dir/run" \
            > "$dir/train.log" 2>&1 || rc=$?
        echo "$rc $((SECONDS - start))" > "$dir/exit"
        if [ "$rc" -ne 0 ]; then
            echo "   $name FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ': timed out, a hang'))"
            tail -n 5 "$dir/train.log"
            status=1
        fi
    done < <(layout_cases)
    "$PY" - "$LOG_DIR" "$SCRATCH/layouts" "${LAYOUT_CASES[@]}" <<'EOF' || status=1
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import results_io
out, folder, cases = Path(sys.argv[1]), Path(sys.argv[2]), [c.split("|") for c in sys.argv[3:]]
doc = results_io.start("layouts_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh --part 2"
doc["cases"] = []
GiB = 2 ** 30
for name, gpus, flags in cases:
    d = folder / name
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
            "nanomega.sim.estimate --json with the same flags (one step, every role of rank); GiB.\n\n"
            + results_io.table(["layout", "GPUs", "flags (+ a few steps)", "result", "s", "peak", "simulated",
                                "val loss"], "lrllrrrr", rows))


results_io.write(doc, tables(doc), out)
EOF
}

model_vs_measured() {  # the step-time model's prediction for throughput_gpu's runs, beside their measurement
    predict model_eager "${BIG[@]}" || status=1
    predict model_compiled "${BIG[@]}" --compiled || status=1
    "$PY" - "$LOG_DIR" "$SCRATCH" "$DRY" <<'EOF' || status=1
import json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import results_io
out, scratch, dry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
measured = {r["variant"]: r for r in json.loads((out / "throughput_gpu.json").read_text())["results"]}
doc = results_io.start("model_gpu")
doc["meta"]["command"] = "bash bench/gpu.sh --part 2" + (" --dry-run" if dry else "")
doc["rows"] = []
for variant in ("eager", "compiled"):
    got, path = measured.get(f"{variant}-bf16"), scratch / f"model_{variant}.json"
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
text = ("throughput_gpu's model and batch, one GPU: tokens/s measured by bench/throughput.py and "
        "predicted by python -m nanomega.sim.step_time (the constants of nanomega/sim/devices.py, fixed; compiled "
        "differs from eager in the model only by pointwise ops fused away); peaks: torch.cuda.max_memory_allocated "
        "against the simulator's.\n\n" + results_io.table(["variant", "GPU", "measured tokens/s", "predicted",
                                               "predicted / measured", "measured peak GiB", "predicted peak GiB"],
                                              "llrrrrr", rows))
results_io.write(doc, text, out)
sys.exit(0 if doc["rows"] else "no row: throughput_gpu or the predictions are missing")
EOF
}

part2() {
    local layouts_ok=1
    if [ "$GPUS" -gt 1 ] && [ "${LAYOUTS:-1}" != 0 ]; then
        # first, on the CPU: a layout that breaks an NCCL contract would hang or crash on the GPUs
        echo; echo "== NCCL contracts of the layouts for $GPUS GPUs (CPU, fake tensors)"
        mkdir -p "$SCRATCH/layouts"
        if ! check_contracts; then
            echo "== a layout breaks NCCL's contracts (above; the .contracts.txt files): the layouts will not run"
            layouts_ok=0
            status=1
        fi
    fi
    # 8 x 2048 = 16k tokens a step; compilation is in the warm-up, not the timing. Eager first: its warm-up line is
    # printed even if compilation runs out of time.
    bench throughput_gpu 170 "$LOG_DIR" "${BIG[@]}" --variants=eager-bf16,compiled-bf16 "${BENCH[@]}"
    echo; echo "== the step-time model against throughput_gpu ($((SECONDS - START))s elapsed)"
    model_vs_measured
    # its results set into the scratch folder (the 8-file limit): its table is in the log, which throughput.py prints
    bench throughput_gpu_default 60 "$SCRATCH" --config=default --variants=eager-bf16,compiled-bf16 "${BENCH[@]}" \
        "${SMALL[@]}"
    # float8 on the MoE: experts per-expert float8 (the goal on the 1B model, part 1: tensorwise >= 1.3x bf16)
    bench throughput_gpu_fp8_moe 120 "$LOG_DIR" --config=tiny_qwen3_moe \
        --variants=compiled-bf16,compiled-fp8tensorwise,compiled-fp8rowwise "${BENCH[@]}" "${SMALL[@]}"
    if [ "$GPUS" -le 1 ]; then
        echo; echo "== parallel layouts skipped: they need more than one GPU, this machine has $GPUS"
    elif [ "${LAYOUTS:-1}" != 0 ] && [ "$layouts_ok" = 1 ]; then
        echo; echo "== parallel layouts on $GPUS GPUs ($((SECONDS - START))s elapsed)"
        run_layouts
    fi
}

summary() {
    echo; echo "== summary: part $PART, $((SECONDS - START))s of the ${BUDGET}s cap, exit $status"
    "$PY" - "$LOG_DIR" <<'EOF'
import json, sys
from pathlib import Path
for path in (Path(sys.argv[1]) / f"throughput_gpu{name}.json" for name in ("", "_moe", "_fp8_moe")):
    if not path.exists():
        continue
    d = json.loads(path.read_text())
    s = d["summary"]
    for r in d["results"]:
        print(f"{s['config']:>14} B{s['batch_size']} T{s['seq_len']} {r['variant']:>22}: "
              f"{r['tokens_per_s']:>10,.0f} tokens/s  {r['tflops']:7.1f} TFLOP/s  MFU {r['mfu']:6.1%}  "
              f"first step {r['first_step_s']:5.1f} s  peak {r.get('peak_mem_gib', 0):5.1f} GiB")
    for v, msg in d["errors"].items():
        print(f"{s['config']:>14} {v}: {msg}")
EOF
    echo "   files: $(cd "$LOG_DIR" && find . -type f | sort | tr '\n' ' ')"
}

main() {
    setup
    if [ "$PART" = 1 ]; then part1; else part2; fi
    summary
    return "$status"
}

main 2>&1 | tee -a "$LOG_DIR/gpu$PART.log"      # pipefail: the exit status is main's
