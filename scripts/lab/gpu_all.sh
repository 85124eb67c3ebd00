#!/usr/bin/env bash
# One device call: the GPU tests and the benchmarks, on two GPUs in parallel where there are two.
#
#   source .fpdev/bin/env.sh && bash scripts/lab/gpu_all.sh
#
# Lane "tests" (GPU 1, or after the bench lane on a one-GPU machine):
#   tests/gpu/test_kernels.py, then tests/gpu/test_sglang_engine.py   (FP_SKIP_LANE_TESTS=1 skips)
# Lane "bench" (GPU 0):
#   python -m flashprefill.bench (FP_BENCH_LENS, FP_BENCH_ARGS), then python scripts/lab/bench_e2e.py
#   with FP_E2E_ARGS (default: --preset issue3)      (FP_SKIP_LANE_BENCH=1 / FP_SKIP_E2E=1 skip)
#
# Time: every part gets min(its own limit, what is left of the call's budget). FP_BUDGET (s,
# default 540: the device allows 600 s a command) is the whole call's; on two GPUs each lane has
# all of it, on one GPU the lanes share it. Part limits: FP_KB_TIMEOUT (operator bench, 200),
# FP_E2E_TIMEOUT (330), FP_KT_TIMEOUT (kernel tests, 300), FP_ST_TIMEOUT (SGLang tests, 330).
# When the lanes end, leftover test / bench / SGLang processes are killed (GNU timeout leaves the
# process groups of nested timeouts alive), so the logs are complete when they are packed.
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
T0=$(date +%s)
export FP_DEADLINE=$(( T0 + ${FP_BUDGET:-540} ))
summary="$OUT/summary.txt"; : > "$summary"
echo "gpus: $NGPU  commit: ${FP_COMMIT:-?}  budget: ${FP_BUDGET:-540} s  $(date -u)" | tee -a "$summary"

# seconds for a part: min(limit, time left before the deadline - 15 s for packing); 0 = skip
part_s() {
  local left=$(( FP_DEADLINE - $(date +%s) - 15 ))
  [ "$left" -lt "$1" ] && echo $(( left > 0 ? left : 0 )) || echo "$1"
}

tests_lane() {
  export CUDA_VISIBLE_DEVICES=$1
  local s
  s=$(part_s "${FP_KT_TIMEOUT:-300}")
  if [ "$s" -gt 0 ]; then
    OUT="$W/kt" FP_SKIP_BENCH=1 timeout -k 5 "$s" bash scripts/lab/gpu_kernels.sh > "$W/kt.log" 2>&1
    echo "kernel tests rc=$? (limit $s s)" > "$W/kt.rc"
  fi
  s=$(part_s "${FP_ST_TIMEOUT:-330}")
  if [ "$s" -gt 30 ]; then
    OUT="$W/st" FP_SKIP_BENCH=1 FP_TEST_TIMEOUT="$s" FP_PER_TEST_TIMEOUT=300 \
        bash scripts/lab/gpu_sglang.sh > "$W/st.log" 2>&1
    echo "sglang tests rc=$? (limit $s s)" > "$W/st.rc"
  else
    echo "sglang tests: skipped, no time left" > "$W/st.rc"
  fi
}

bench_lane() {
  export CUDA_VISIBLE_DEVICES=$1
  local s
  s=$(part_s "${FP_KB_TIMEOUT:-200}")
  if [ "$s" -gt 0 ]; then
    OUT="$W/kb" FP_SKIP_TESTS=1 FP_BENCH_LENS="${FP_BENCH_LENS:-4k,8k,32k,128k}" \
        timeout -k 5 "$s" bash scripts/lab/gpu_kernels.sh > "$W/kb.log" 2>&1
    echo "kernel bench rc=$? (limit $s s)" > "$W/kb.rc"
  fi
  s=$(part_s "${FP_E2E_TIMEOUT:-330}")
  if [ -z "${FP_SKIP_E2E:-}" ] && [ "$s" -gt 30 ]; then
    mkdir -p "$W/eb"
    # shellcheck disable=SC2086  # FP_E2E_ARGS is a list of arguments
    timeout -k 10 "$s" python scripts/lab/bench_e2e.py \
        --model "${FP_BENCH_MODEL:-${FPDEV_MODELS:-}/qwen2.5-coder-0.5b-instruct}" ${FP_E2E_ARGS:---preset issue3} \
        --json "$W/eb/e2e.json" --mem-fraction "${FP_BENCH_MEM:-0.5}" > "$W/eb.log" 2>&1
    echo "e2e bench rc=$? (limit $s s)" > "$W/eb.rc"
  fi
}

if [ "$NGPU" -ge 2 ]; then
  [ -z "${FP_SKIP_LANE_TESTS:-}" ] && tests_lane 1 &
  [ -z "${FP_SKIP_LANE_BENCH:-}" ] && bench_lane 0 &
  wait
else
  [ -z "${FP_SKIP_LANE_BENCH:-}" ] && bench_lane 0
  [ -z "${FP_SKIP_LANE_TESTS:-}" ] && tests_lane 0
fi
# leftovers of parts cut by their timeouts (pytest, benches, SGLang schedulers / workers)
pkill -TERM -f "tests/gpu/|flashprefill.bench|bench_e2e.py|sglang_worker|sglang::" 2>/dev/null
sleep 2
pkill -KILL -f "tests/gpu/|flashprefill.bench|bench_e2e.py|sglang_worker|sglang::" 2>/dev/null
echo "lanes done in $(( $(date +%s) - T0 )) s" | tee -a "$summary"
{
  cat "$W"/*.rc 2>/dev/null
  echo "---- kernel tests"; grep -E "passed|failed|error|skipped" "$W/kt/gpu_tests.log" 2>/dev/null | tail -3
  grep -E "^FAILED|^ERROR" "$W/kt/gpu_tests.log" 2>/dev/null | head -20
  echo "---- sglang tests"; grep -E "passed|failed|error|skipped" "$W/st/pytest.log" 2>/dev/null | tail -3
  grep -E "^FAILED|^ERROR" "$W/st/pytest.log" 2>/dev/null | head -20
  echo "---- kernel bench"; grep -A 30 "^NVIDIA\|^variants" "$W/kb/bench.log" 2>/dev/null | grep -v "^\[" | head -40
  echo "---- e2e"; grep -A 40 "^e2e bench" "$W/eb.log" 2>/dev/null | head -50
} >> "$summary"
tar czf "$OUT/logs.tgz" --warning=no-file-changed -C "$W" . 2>/dev/null
rm -rf "$W"
cat "$summary"
