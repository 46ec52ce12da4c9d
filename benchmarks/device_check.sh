#!/usr/bin/env bash
# Device check on ONE GPU (written for an H200; under 8 minutes, the step limits sum to 470 s).
# Writes under $OUT (or ./device_out) five files, few enough to come back from a lent machine:
#   device_check.log    every step's output (nvidia-smi, profile, comparisons, layer bench, tests)
#   profile_raw.json    runtime/bench/profile.py's measurements
#   h200-measured.yaml  the measured cluster profile (also copied to profiles/clusters/ when the
#                       profile ran on a CUDA device)
#   layer_bench.json / layer_bench.csv   the measured layer beside its prediction
#
#   bash benchmarks/device_check.sh            # OUT=./device_out
#   OUT=/some/dir MODELS=mixtral-8x7b,deepseek-v3 bash benchmarks/device_check.sh
#   DEVICE=cpu MODELS=tiny-moe LAYER_MODEL=tiny-moe SEQ_LEN=64 bash benchmarks/device_check.sh
#                                              # the plumbing on CPU (quick sizes, fp32)
#
# Steps: the environment; the micro-benchmarks (dense GEMM, grouped expert GEMM at 16..4,096
# tokens per expert for each of $MODELS' expert shapes, attention by sequence and head dim,
# HBM copy, permute / unpermute); the profile YAML; the h200 preset's prediction beside every
# measured point; one layer of $LAYER_MODEL measured at world size 1 beside the resource model's
# per-layer prediction on the measured profile (pass: time within 10%, peak memory within 5%)
# and the preset's; the `gpu`-marked tests. Each step has its own time limit; a failing step is
# logged and the script goes on; the exit code is 1 when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:-./device_out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LOG="$OUT/device_check.log"
: >"$LOG"
FAILED=()
BASE="${BASE:-h200}"
# expert GEMM shapes (hidden x expert FFN); the first is the profile's gemm_grouped table
MODELS="${MODELS:-mixtral-8x7b,deepseek-v3,qwen3-235b-a22b,gpt-oss-120b,llama4-maverick,grok-1}"
LAYER_MODEL="${LAYER_MODEL:-mixtral-8x7b}"
SEQ_LEN="${SEQ_LEN:-4096}"
DEVICE="${DEVICE:-cuda}"  # cpu: a dry run of the plumbing at the profile's --quick sizes
if [ "$DEVICE" = cuda ]; then
  PROFILE_ARGS=(--device cuda --dtype bf16)
else
  PROFILE_ARGS=(--device cpu --quick --dtype fp32)
fi
MEASURED="$OUT/$BASE-measured.yaml"

log() { echo "[device_check $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
# the CLI without relying on the console script (timeout cannot run shell functions)
PIPER=(python3 -c 'import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))')
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log its output, remember failures
  local name=$1 limit=$2
  shift 2
  log "start $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  local rc=$?
  cat "$WORK/$name.out" >>"$LOG"
  log "end $name rc=$rc in $((SECONDS - t0))s"
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name")
    tail -n 20 "$WORK/$name.err" | tee -a "$LOG"
  fi
  return "$rc"
}

log "OUT=$OUT MODELS=$MODELS LAYER_MODEL=$LAYER_MODEL SEQ_LEN=$SEQ_LEN"
{ nvidia-smi || true; } >>"$LOG" 2>&1
step env 30 python3 -c '
import platform, sys, torch
print("python", platform.python_version(), "torch", torch.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda)
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    print("device", torch.cuda.get_device_name(0))
' "$DEVICE"
cuda_ok=$?

# 1. The micro-benchmarks on one GPU (NCCL, one rank: no p2p / all-to-all tables).
step profile 170 python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
  -m runtime.bench.profile "${PROFILE_ARGS[@]}" --models "$MODELS" \
  --raw-out "$OUT/profile_raw.json"
profile_ok=$?

# 2. The cluster profile the planner reads (tables, efficiencies, hbm_efficiency).
if [ "$profile_ok" -eq 0 ]; then
  step profile_yaml 30 "${PIPER[@]}" profile --raw "$OUT/profile_raw.json" --base "$BASE" \
    --name "$BASE-measured" --out "$MEASURED"
  yaml_ok=$?
else
  log "skip profile_yaml: no measurements"
  yaml_ok=1
fi
if [ "$DEVICE" = cuda ] && [ "$cuda_ok" -eq 0 ] && [ "$yaml_ok" -eq 0 ] \
  && grep -q '"backend": "nccl"' "$OUT/profile_raw.json"; then
  cp "$MEASURED" "profiles/clusters/$BASE-measured.yaml"
  log "copied $MEASURED to profiles/clusters/$BASE-measured.yaml"
else
  log "profiles/clusters/$BASE-measured.yaml not written: the profile did not run on CUDA"
fi

# 3. The preset's fitted constants predict every measured point; the error per point/table.
if [ "$profile_ok" -eq 0 ]; then
  step predicted_vs_measured 40 python3 -m runtime.bench.predicted_vs_measured \
    "$OUT/profile_raw.json" --base "$BASE"
fi

# 4. One layer at world size 1 beside the resource model's per-layer prediction on the
#    measured profile (the target: time within 10%, peak memory within 5%), and beside the
#    preset's prediction of the same measurement (not checked).
if [ "$yaml_ok" -eq 0 ]; then
  step layer_bench 150 python3 -m runtime.bench.layer_bench --model "$LAYER_MODEL" \
    --cluster "$MEASURED" --other-cluster "$BASE" --seq-len "$SEQ_LEN" \
    --time-tol 0.10 --mem-tol 0.05 --check --out "$OUT/layer_bench"
else
  log "skip layer_bench: no measured profile"
fi

# 5. GPU-marked tests (skipped on CPU-only machines; here they must run).
step gpu_tests 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/bench

if [ "${#FAILED[@]}" -gt 0 ]; then
  log "FAILED steps: ${FAILED[*]}"
  exit 1
fi
log "all steps passed"
