#!/usr/bin/env bash
# One device call: the GPU tests and the benchmarks, on two GPUs in parallel where there are two.
#
#   source .fpdev/bin/env.sh && bash scripts/gpu_all.sh
#
# Lane "tests" (GPU 1, or after the bench lane on a one-GPU machine):
#   tests/gpu/test_kernels.py, then tests/gpu/test_sglang_engine.py   (FP_SKIP_LANE_TESTS=1 skips)
# Lane "bench" (GPU 0):
#   python -m flashprefill.bench (FP_BENCH_LENS, FP_BENCH_ARGS), then python -m fpcli.bench_e2e
#   with FP_E2E_ARGS (default: --preset issue3)                        (FP_SKIP_LANE_BENCH=1 skips)
# Limits: FP_LANE_TIMEOUT (s, default 560) for each lane; every part has its own timeout inside.
#
# Results come back as $OUT/summary.txt (short tables) and $OUT/logs.tgz (every log and JSON),
# within the device tool's limit on returned files.
set -u
OUT="${OUT:-$PWD/out-gpu-all}"
W="$OUT/work"
mkdir -p "$W"
export PYTHONPATH="$PWD/kernels:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c GPU)
LANE_TO="${FP_LANE_TIMEOUT:-560}"
summary="$OUT/summary.txt"; : > "$summary"
echo "gpus: $NGPU  commit: ${FP_COMMIT:-?}  $(date -u)" | tee -a "$summary"

tests_lane() {
  local gpu=$1
  export CUDA_VISIBLE_DEVICES=$gpu
  OUT="$W/kt" FP_SKIP_BENCH=1 timeout -k 5 "${FP_KT_TIMEOUT:-300}" bash scripts/gpu_kernels.sh > "$W/kt.log" 2>&1
  echo "kernel tests rc=$?" > "$W/kt.rc"
  OUT="$W/st" FP_SKIP_BENCH=1 FP_TEST_TIMEOUT="${FP_ST_TIMEOUT:-330}" FP_PER_TEST_TIMEOUT=300 \
      bash scripts/gpu_sglang.sh > "$W/st.log" 2>&1
  echo "sglang tests rc=$?" > "$W/st.rc"
}

bench_lane() {
  local gpu=$1
  export CUDA_VISIBLE_DEVICES=$gpu
  OUT="$W/kb" FP_SKIP_TESTS=1 FP_BENCH_LENS="${FP_BENCH_LENS:-4k,8k,32k,128k}" \
      timeout -k 5 "${FP_KB_TIMEOUT:-200}" bash scripts/gpu_kernels.sh > "$W/kb.log" 2>&1
  echo "kernel bench rc=$?" > "$W/kb.rc"
  if [ -z "${FP_SKIP_E2E:-}" ]; then
    mkdir -p "$W/eb"
    timeout -k 10 "${FP_E2E_TIMEOUT:-330}" python -m fpcli.bench_e2e \
        --model "${FP_BENCH_MODEL:-$FPDEV_MODELS/qwen2.5-coder-0.5b-instruct}" ${FP_E2E_ARGS:---preset issue3} \
        --json "$W/eb/e2e.json" --mem-fraction "${FP_BENCH_MEM:-0.5}" > "$W/eb.log" 2>&1
    echo "e2e bench rc=$?" > "$W/eb.rc"
  fi
}

t0=$(date +%s)
if [ "$NGPU" -ge 2 ]; then
  [ -z "${FP_SKIP_LANE_TESTS:-}" ] && { timeout -k 5 "$LANE_TO" bash -c "$(declare -f tests_lane); W=$W; tests_lane 1" & }
  [ -z "${FP_SKIP_LANE_BENCH:-}" ] && { timeout -k 5 "$LANE_TO" bash -c "$(declare -f bench_lane); W=$W; bench_lane 0" & }
  wait
else
  [ -z "${FP_SKIP_LANE_BENCH:-}" ] && bench_lane 0
  [ -z "${FP_SKIP_LANE_TESTS:-}" ] && tests_lane 0
fi
echo "lanes done in $(( $(date +%s) - t0 )) s" | tee -a "$summary"
{
  cat "$W"/*.rc 2>/dev/null
  echo "---- kernel tests"; grep -E "passed|failed|error" "$W/kt/gpu_tests.log" 2>/dev/null | tail -3
  grep -E "^FAILED|^ERROR" "$W/kt/gpu_tests.log" 2>/dev/null | head -20
  echo "---- sglang tests"; grep -E "passed|failed|error" "$W/st/pytest.log" 2>/dev/null | tail -3
  grep -E "^FAILED|^ERROR" "$W/st/pytest.log" 2>/dev/null | head -20
  echo "---- kernel bench"; grep -A 30 "^NVIDIA\|^variants" "$W/kb/bench.log" 2>/dev/null | grep -v "^\[" | head -40
  echo "---- e2e"; grep -A 40 "^e2e bench" "$W/eb.log" 2>/dev/null | head -50
} >> "$summary"
tar czf "$OUT/logs.tgz" -C "$W" . 2>/dev/null && rm -rf "$W"
cat "$summary"
