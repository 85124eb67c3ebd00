#!/usr/bin/env bash
# Device script for issue 3: the flashprefill SGLang backend, the embedded engine and the e2e bench.
#
#   bash scripts/lab/gpu_sglang.sh                      # tests (~4 min) + e2e bench 4k..32k native, 64k/120k YaRN (~5 min)
#   FP_SKIP_BENCH=1 bash scripts/lab/gpu_sglang.sh      # tests only
#   FP_SKIP_TESTS=1 bash scripts/lab/gpu_sglang.sh      # bench only (python scripts/lab/bench_e2e.py --preset issue3)
#   FP_BENCH_LENS=4k,32k FP_SKIP_TESTS=1 bash scripts/lab/gpu_sglang.sh   # other lengths (3 repeats)
#   FP_GPU_SLOW=1 ...                               # tests also run Qwen + YaRN 120K (a worker process)
#   FP_SKIP_INSTALL=1 ...                           # no pip step (a second call on the same machine)
#
# Writes under $OUT (default ./out-gpu-sglang): env.txt, install.log, pytest.log, junit.xml,
# workers/ (one log + result per engine worker process), bench.log, e2e.json, summary.txt.
# Prints a short table last. No network needed. Each part is capped by `timeout` (FP_TEST_TIMEOUT,
# FP_BENCH_TIMEOUT) and every test by pytest-timeout when it is installed.
set -u
OUT="${OUT:-$PWD/out-gpu-sglang}"
mkdir -p "$OUT"
MODELS="${FPDEV_MODELS:-}"
LENS="${FP_BENCH_LENS:-}"
BENCH_MODEL="${FP_BENCH_MODEL:-$MODELS/qwen2.5-coder-0.5b-instruct}"
# SGLang logs at info when the engine is started verbose (SGLangEngine(log_level="info"))
export PYTHONUNBUFFERED=1
# The checkout on the path no matter what the editable install does: the first run's
# `pip install -e .` reported success but `import flashprefill` failed in the test python.
export PYTHONPATH="$PWD/kernels:$PWD:${PYTHONPATH:-}"
export FP_GPU_LOG_DIR="$OUT"
PY="${PYTHON:-python}"
summary="$OUT/summary.txt"; : > "$summary"
note() { echo "$*" | tee -a "$summary"; }

{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -V; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  python -c "import sglang; print('sglang', sglang.__version__)" 2>&1
  echo "FPDEV_MODELS=$MODELS"; ls "$MODELS" 2>&1
  git log --oneline -1 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. Install fp without dependencies, with the python that runs the tests, so the
#    sglang.srt.plugins entry point is in its metadata (the Engine subclass registers anyway).
if [ -n "${FP_SKIP_INSTALL:-}" ]; then
  note "install: skipped (FP_SKIP_INSTALL; PYTHONPATH has the checkout)"
elif "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1; then
  note "install: pip ok ($("$PY" -c 'import sys; print(sys.executable)'))"
else
  note "install: FAILED (see install.log); PYTHONPATH and the Engine subclass still register the backend"
  tail -5 "$OUT/install.log"
fi
"$PY" - <<'PY' 2>&1 | tee -a "$summary"
import sys
from importlib.metadata import entry_points
eps = [f"{e.name} -> {e.value}" for e in entry_points(group="sglang.srt.plugins")]
print("python:", sys.executable)
print("entry points sglang.srt.plugins:", eps or "NONE (the engine-subclass path registers the backend)")
try:
    import flashprefill, fpcli
    print("import flashprefill:", flashprefill.__file__, "| fpcli:", fpcli.__file__)
    print("flashprefill operator API:", [n for n in ("flashprefill_attention", "dense_attention", "build_index", "make_plan") if hasattr(flashprefill, n)])
    from flashprefill.integrations.sglang import plugin
    plugin.register(source="direct")
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    print("registered in this process:", "flashprefill" in ATTENTION_BACKENDS)
except Exception as exc:
    print("PRECHECK FAILED:", type(exc).__name__, exc)
PY

# 2. Tests: one engine in the test process + worker processes started together (~3-4 min warm).
rc_tests=skipped
if [ -z "${FP_SKIP_TESTS:-}" ]; then
  t0=$(date +%s)
  TO=""
  "$PY" -c "import pytest_timeout" 2>/dev/null && TO="--timeout=${FP_PER_TEST_TIMEOUT:-420}"
  timeout -k 10 "${FP_TEST_TIMEOUT:-480}" "$PY" -m pytest tests/gpu/test_sglang_engine.py -q -s -rA $TO \
      --junitxml="$OUT/junit.xml" -p no:cacheprovider > "$OUT/pytest.log" 2>&1
  rc_tests=$?
  # worker process groups left by a pytest killed on timeout (each worker is a session leader)
  for f in "$OUT"/workers/*.pid; do
    [ -f "$f" ] || continue; pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then note "killing leftover worker group $pid ($f)"; kill -9 -- "-$pid" 2>/dev/null; fi
    rm -f "$f"
  done
  note "pytest: rc=$rc_tests in $(( $(date +%s) - t0 )) s ${TO:-(no pytest-timeout)}"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error" "$OUT/pytest.log" | tail -30 | tee -a "$summary"
  grep -hE "registered in SGLang by|already registered by|flashprefill backend: layers|smol 6K|qwen 28K|qwen YaRN|radix:|page sizes:|engine .* started|warm-up|one-shot top5|chunked  top5|logprob diff|no prefill statistics|engine subprocesses|: start .* decode graph" \
      "$OUT/pytest.log" "$OUT"/workers/*.log 2>/dev/null | cut -c1-400 | sort -u | tail -40 >> "$summary"
  if [ "$rc_tests" != 0 ]; then
    echo "---- pytest.log tail ----"; tail -60 "$OUT/pytest.log"
  fi
fi

# 3. End-to-end TTFT, flashprefill vs dense triton prefill, same engine settings, radix cache off.
#    Default: --preset issue3 (4k,8k,16k,32k native, 64k,120k YaRN x4; one warm-up + one run each).
rc_bench=skipped
if [ -z "${FP_SKIP_BENCH:-}" ]; then
  if [ -f "$BENCH_MODEL/config.json" ]; then
    t0=$(date +%s)
    if [ -n "$LENS" ]; then BARGS="--lens $LENS --repeats ${FP_BENCH_REPEATS:-3}"; else BARGS="--preset issue3"; fi
    timeout -k 10 "${FP_BENCH_TIMEOUT:-500}" "$PY" scripts/lab/bench_e2e.py --model "$BENCH_MODEL" $BARGS \
        --json "$OUT/e2e.json" --mem-fraction "${FP_BENCH_MEM:-0.5}" > "$OUT/bench.log" 2>&1
    rc_bench=$?
    note "bench: rc=$rc_bench in $(( $(date +%s) - t0 )) s (model $BENCH_MODEL, $BARGS)"
    grep -E "^\S+ \S+ fpcli|\[bench\]" "$OUT/bench.log" | grep -E "\[bench\]|warm-up" | cut -c1-300 >> "$summary"
    if [ "$rc_bench" != 0 ]; then echo "---- bench.log tail ----"; tail -60 "$OUT/bench.log"; fi
  else
    note "bench: skipped, no model at $BENCH_MODEL"
  fi
fi

echo
echo "==== summary ($OUT) ===="
cat "$summary"
[ -f "$OUT/bench.log" ] && { echo "---- e2e TTFT ----"; grep -A20 -E "^ +len +tokens" "$OUT/bench.log"; }
[ -f "$OUT/bench.log" ] && ! grep -qE "^ +len +tokens" "$OUT/bench.log" && [ -f "$OUT/e2e.json" ] && \
  "$PY" -c "import json,sys; sys.path.insert(0,'.'); sys.path.insert(0,'scripts/lab'); from bench_e2e import format_table; print('(partial)'); print(format_table(json.load(open('$OUT/e2e.json'))['rows']))"
[ "$rc_tests" = 0 ] || [ "$rc_tests" = skipped ] || exit 1
[ "$rc_bench" = 0 ] || [ "$rc_bench" = skipped ] || exit 2
exit 0
