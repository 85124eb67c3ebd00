export PYTHONPATH=$PWD/kernels:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
(timeout -k 5 300 python -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_kernels.py tests/gpu/test_stats_cuda.py > $OUT/kernels.log 2>&1; echo "kernels rc=$? $(tail -1 $OUT/kernels.log)") &
(timeout -k 5 300 python -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_fp8.py tests/gpu/test_fp8_quant.py > $OUT/fp8.log 2>&1; echo "fp8 rc=$? $(tail -1 $OUT/fp8.log)"; grep -E "^(FAILED|ERROR)" $OUT/fp8.log | head) &
wait
timeout -k 5 240 python scripts/lab/fp8_variants.py --out $OUT 2>&1 | tail -30
grep -E "^(FAILED|ERROR)" $OUT/kernels.log | head
