#!/usr/bin/env bash
# Device check on ONE GPU (written for an H200; < 5 minutes). Writes everything under $OUT
# (or ./device_out): the measured cluster profile, predicted vs measured GEMM/attention
# throughput, a resource-model estimate on the measured profile, the runtime layer bench
# (runtime/bench/layer_bench.py, world size 1) when present, and the `gpu`-marked tests.
#
#   bash benchmarks/device_check.sh            # OUT=./device_out
#   OUT=/some/dir bash benchmarks/device_check.sh
#
# Every step has its own time limit; a failing step is logged and the script goes on, and
# the exit code is non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./device_out}"
mkdir -p "$OUT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/device_check.log"
FAILED=()
MODEL="${MODEL:-mixtral-8x7b}"   # GEMM K x N = hidden x expert_ffn of this model
BASE="${BASE:-h200}"

log() { echo "[device_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
# the CLI without relying on the console script (timeout cannot run shell functions)
PIPER=(python3 -c 'import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))')
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log, remember failures
  local name=$1 limit=$2
  shift 2
  log "start $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.err"
  local rc=$?
  log "end $name rc=$rc in $((SECONDS - t0))s"
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name")
    tail -n 20 "$OUT/$name.err" | tee -a "$LOG"
  fi
  return 0
}

log "OUT=$OUT"
{ nvidia-smi || true; } >"$OUT/nvidia-smi.txt" 2>&1
step env 60 python3 -c '
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda)
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("device", torch.cuda.get_device_name(0))
'
cat "$OUT/env.out" | tee -a "$LOG"

# 1. piper profile on 1 GPU (NCCL): GEMM at the model's shapes, grouped vs looped experts,
#    attention by sequence length, HBM bandwidth. One rank, so no p2p/all-to-all tables.
step profile 150 "${PIPER[@]}" profile --nproc 1 --device cuda --dtype bf16 --base "$BASE" \
  --model "$MODEL" --name "$BASE-measured" --out "$OUT/$BASE-measured.yaml" \
  --keep-raw "$OUT/profile_raw.json"
cat "$OUT/profile.out" >>"$LOG"

# 2. Predicted (the preset's analytic efficiency) beside measured (the profile's tables).
step predicted_vs_measured 60 python3 - "$OUT/$BASE-measured.yaml" "$BASE" "$MODEL" <<'PY'
import sys
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.resources.compute import gemm_time
from planner.specs import TrainingSpec

measured, preset = load_cluster(sys.argv[1]), load_cluster(sys.argv[2])
model = load_model(sys.argv[3])
k, n = model.hidden_size, model.first_moe.expert_ffn
tr = TrainingSpec(dtype="bf16")
print(f"GEMM {k} x {n} bf16 on {measured.device.name}: predicted ({preset.name} analytic) vs measured")
print(f"{'tokens':>8} {'pred TFLOPS':>12} {'meas TFLOPS':>12} {'error':>8}")
table = measured.table("gemm_bf16")
for m, meas in zip(table.x, table.y):
    flops = 2 * m * k * n
    t, _ = gemm_time(preset, tr, m, flops, 2 * (m * k + k * n + m * n), 1)
    pred = flops / t / 1e12
    print(f"{m:>8.0f} {pred:>12.1f} {meas:>12.1f} {100 * (pred - meas) / meas:>+7.0f}%")
att = measured.table("attention_bf16")
peak = preset.device.peak("bf16")
print(f"attention: predicted {preset.attention_efficiency * peak:.0f} TFLOPS at every length")
for s, y in zip(att.x, att.y):
    print(f"  seq {s:>6.0f}: measured {y:.1f} TFLOPS")
print(f"HBM: preset {preset.device.hbm_gbps:.0f} GB/s, measured copy {measured.device.hbm_gbps:.0f} GB/s")
PY
cat "$OUT/predicted_vs_measured.out" | tee -a "$LOG"

# 3. The resource model on the measured profile (says which measured tables it used).
step estimate 60 "${PIPER[@]}" estimate --model "$MODEL" --cluster "$OUT/$BASE-measured.yaml" \
  --pp 1 --dp 8 --ep 8 --seq-len 4096 --micro-batch 1 --global-batch 64 --json
step estimate_preset 60 "${PIPER[@]}" estimate --model "$MODEL" --cluster "$BASE" \
  --pp 1 --dp 8 --ep 8 --seq-len 4096 --micro-batch 1 --global-batch 64 --json

# 4. Runtime layer bench (world size 1), predicted beside measured, when the runtime has it.
if [ -f runtime/bench/layer_bench.py ]; then
  step layer_bench 120 python3 -m runtime.bench.layer_bench --cluster "$OUT/$BASE-measured.yaml" \
    --json --out "$OUT/layer_bench"
  cat "$OUT/layer_bench.out" | tee -a "$LOG"
else
  log "skip layer_bench: runtime/bench/layer_bench.py not in this tree"
fi

# 5. GPU-marked tests (skipped on CPU-only machines; here they must run).
step gpu_tests 90 python3 -m pytest -q -m gpu tests/runtime/bench/test_profile.py

if [ "${#FAILED[@]}" -gt 0 ]; then
  log "FAILED steps: ${FAILED[*]}"
  exit 1
fi
log "all steps passed"
