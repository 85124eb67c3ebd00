#!/usr/bin/env bash
# Device script for the flashprefill Triton kernels (issue 2): GPU tests, then the operator bench.
#
#   bash scripts/lab/gpu_kernels.sh                        # tests + bench 4k,8k,32k,128k
#   source .fpdev/bin/env.sh && bash scripts/lab/gpu_kernels.sh     # with flash-attn-4 for the FA4 baseline
#   FP_SKIP_TESTS=1 bash scripts/lab/gpu_kernels.sh        # bench only
#   FP_BENCH_LENS=8k,128k FP_SKIP_TESTS=1 bash scripts/lab/gpu_kernels.sh
#   PYTHONPATH=kernels python scripts/lab/bench_lab.py --lens 32k,128k --profile --sweep   # where the time goes
#
# Writes under $OUT (default ./out-gpu-kernels): env.txt, gpu_tests.log, bench.log, bench.json.
set -u
set -o pipefail
OUT="${OUT:-$PWD/out-gpu-kernels}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/kernels:$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
LENS="${FP_BENCH_LENS:-4k,8k,32k,128k}"
{
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -V; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1
  python -c "import flash_attn.cute as f; print('flash_attn.cute ok', f.__file__)" 2>&1 | tail -1
  git log --oneline -1 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
rc=0
if [ "${FP_SKIP_TESTS:-0}" != "1" ]; then
  # every failure in one run (device time is scarce); a hang cannot eat the call
  TO=""; python -c "import pytest_timeout" 2>/dev/null && TO="--timeout=150"
  python -m pytest tests/gpu/test_kernels.py tests/gpu/test_stats_cuda.py -q -rs --durations=10 -p no:cacheprovider $TO 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [ "${FP_SKIP_BENCH:-0}" != "1" ]; then
  python -m flashprefill.bench --lens "$LENS" --heads 32/8 --head-dim 128 --dtype bf16 \
      --json "$OUT/bench.json" ${FP_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1
fi
echo "gpu_kernels.sh: rc=$rc (tests log: $OUT/gpu_tests.log, bench: $OUT/bench.json)"
exit $rc
