#!/usr/bin/env bash
# One device call of a GPU round (lab tooling, never imported by the product).
#   source .fpdev/bin/env.sh && bash scripts/lab/gpu_round.sh PART [PART...]
# PARTs: kernels (operator GPU tests), globalkeys (SparseConfig.global_keys on CUDA), fp8 (FP8 kernel tests), fp8ws (the Gluon FP8 kernel's and the no-sync tests), engines1 / engines2 / fp8engine (engine and CLI GPU
# tests), user (fp start / fp ask x2 / fp status / fp stop / fp profile on real TeX manuals, as a user
# runs them), askcold (one cold fp ask --no-server on the TeX manual with $ASK_ARGS), eval (fp eval at 32K and 128K, $EVAL_PROFILES or dense / bf16 / fp8, two seeds), bench (fp bench: the operator
# table; BENCH_ARGS="--fp8 --e2e --model M" adds the end-to-end table, bf16 / fp8 / dense engines), benchcli (its GPU test), stats (tests/gpu/test_stats_cuda.py alone), transformers (the
# transformers engine's GPU tests), variants (scripts/lab/fp8_variants.py), cold (scripts/lab/cold_start.py), ws / probe
# (scripts/lab/ws_probe.py: its GPU test / its timing), decode (scripts/lab/decode_profile.py at 130K),
# graph (the CUDA-graph decode's GPU tests and its attention's, then decode with --cuda-graph), needle (scripts/lab/needle_recall.py: Qwen at
# 128K, one niah_multikey sample, one-shot vs 16K chunks, configs dense,base), vertical (its GPU test, then
# scripts/lab/vertical_blocks.py: Qwen, one niah_multikey sample of $VERTICAL_LEN, 32k by default). EVAL_ARGS: more fp eval options
# (one word each, e.g. --engine=transformers); EVAL_TIMEOUT: seconds before fp eval gets a Ctrl-C (SIGINT: it keeps and
# reports the finished cells); LIM: a test part's time limit. Logs and JSON land in $OUT; a short table is printed last.
set -u
OUT=${OUT:-$PWD/out-gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/kernels:$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1 FP_CACHE_DIR=/tmp/fpcache FP_GPU_LOG_DIR=$OUT
SUM=$OUT/summary.txt
say() { echo "$*" | tee -a "$SUM"; }
if ! python3 -c "import importlib.metadata as m; m.distribution('fp')" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || say "pip install -e . failed (pip.log)"
fi
export PATH="$(python3 -c 'import sys, os; print(os.path.dirname(sys.executable))'):$PATH"; hash -r
# the staged models as fp's cached models (no network on the device): fp model list finds them
for m in qwen2.5-coder-0.5b-instruct smollm2-135m-instruct; do
  src=$FPDEV_MODELS/$m; dst=$FP_CACHE_DIR/models/$m
  if [ -d "$src" ] && [ ! -e "$dst" ]; then
    mkdir -p "$(dirname "$dst")"; ln -s "$src" "$dst"
    [ -f "$src/fp-model.json" ] || echo '{"source": "staged by the device loader"}' > "$src/fp-model.json"
  fi
done
t() { local s=$(date +%s%N); "$@"; local rc=$?; local e=$(date +%s%N); echo "$* rc=$rc wall=$(( (e - s) / 1000000 ))ms" >> "$SUM"; return $rc; }  # not to stdout: a caller may redirect it into a JSON file
pyt() { local name=$1 lim=$2; shift 2
  timeout -k 5 "$lim" python -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.log" 2>&1
  say "$name: rc=$? $(grep -E '(passed|failed|error)' "$OUT/$name.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | head -12 | tee -a "$SUM"; }
ask_summaries() {  # ask_summaries NAME...: $OUT/NAME.json's summary and answer per fp ask (its .err when no JSON)
  python - "$OUT" "$@" <<'PY' | tee -a "$SUM"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for n in sys.argv[2:]:
    try:
        d = json.loads((out / f"{n}.json").read_text()); s = d["summary"]
        print(n, {k: s.get(k) for k in ("profile", "prompt_tokens", "cached_tokens", "ttft_s", "prefill_s", "wall_s",
              "engine_start_s", "stages_s", "density", "precision", "decode_mode", "engine", "model", "context")})
        print("  answer:", d["answer"][:160].replace("\n", " "))
    except Exception as e:
        print(n, "no JSON:", e, (out / f"{n}.err").read_text()[-600:] if (out / f"{n}.err").exists() else "")
PY
}
for part in "$@"; do
  case $part in
    kernels)  pyt kernels ${LIM:-330} tests/gpu/test_kernels.py tests/gpu/test_stats_cuda.py tests/gpu/test_fp8_quant.py ;;
    fp8)      pyt fp8 ${LIM:-300} tests/gpu/test_fp8.py tests/gpu/test_fp8_quant.py ;;
    int8qk)   pyt int8qk ${LIM:-300} tests/gpu/test_int8qk.py ;;
    fp8ws)    pyt fp8ws ${LIM:-300} tests/gpu/test_fp8_ws.py tests/gpu/test_fp8_nosync.py ;;
    opbench)  t python -m flashprefill.bench --lens ${OPBENCH_LENS:-32k,128k} ${OPBENCH_ARGS:---fp8 --int8qk} --json "$OUT/opbench.json" > "$OUT/opbench.txt" 2>&1; tail -20 "$OUT/opbench.txt" | cut -c1-600 | tee -a "$SUM" ;;
    ws)       pyt ws ${LIM:-240} tests/gpu/test_ws_probe.py ;;
    probe)    t python scripts/lab/ws_probe.py time --lens ${PROBE_LENS:-32k,128k} --out "$OUT" > "$OUT/probe.log" 2>&1
              tail -${PROBE_TAIL:-20} "$OUT/probe.log" | tee -a "$SUM" ;;
    engines1) pyt engines1 ${LIM:-420} tests/gpu/test_profile_cli.py tests/gpu/test_resident_engine.py ;;
    engines2) pyt engines2 ${LIM:-540} tests/gpu/test_sglang_engine.py tests/gpu/test_sessions_gpu.py ;;
    fp8engine) pyt fp8engine ${LIM:-400} tests/gpu/test_fp8_engine.py ;;
    stats)    pyt stats ${LIM:-200} tests/gpu/test_stats_cuda.py ;;
    globalkeys) pyt globalkeys ${LIM:-240} tests/gpu/test_global_keys_gpu.py ;;
    benchcli) pyt benchcli ${LIM:-600} tests/gpu/test_bench_cli.py ;;
    engines3) pyt engines3 ${LIM:-540} tests/gpu/test_cold_start.py tests/gpu/test_eval_gpu.py -s ;;
    transformers) pyt transformers ${LIM:-300} tests/gpu/test_transformers_gpu.py tests/gpu/test_transformers_decode_gpu.py -s ;;
    decode)   t python scripts/lab/decode_profile.py --len ${DECODE_LEN:-130000} --context 128k --steps ${DECODE_STEPS:-64} \
                ${DECODE_ARGS:-} --out "$OUT" > "$OUT/decode.log" 2>&1
              tail -${DECODE_TAIL:-30} "$OUT/decode.log" | tee -a "$SUM" ;;
    graph)    pyt graph ${LIM:-300} tests/gpu/test_decode_masked_gpu.py tests/gpu/test_decode_graph_gpu.py -s
              DECODE_ARGS=--cuda-graph bash "$0" decode ;;
    variants) t python scripts/lab/fp8_variants.py --lens ${VARIANT_LENS:-128k,32k} --shapes ${VARIANT_SHAPES:-32/8/128} \
        --variants ${VARIANTS:-shipped,poly_fold,pipe_fold,meanvec,fusedidx,pipe_fold_meanvec_fusedidx} --out "$OUT" \
        > "$OUT/variants.log" 2>&1; tail -${VARIANT_TAIL:-24} "$OUT/variants.log" | tee -a "$SUM" ;;
    user)
      DOC=.fpdocs/beameruserguide.pdf
      t fp start ${START_ARGS:-} > "$OUT/start.log" 2>&1; tail -3 "$OUT/start.log"
      t fp status >> "$OUT/status.log" 2>&1
      t fp ask $DOC "How do I make an item appear only on the second slide of a frame?" --json ${ASK_ARGS:-} > "$OUT/ask1.json" 2> "$OUT/ask1.err"
      t fp ask $DOC "Which command creates a frame title?" --json ${ASK_ARGS:-} > "$OUT/ask2.json" 2> "$OUT/ask2.err"
      t fp status --json > "$OUT/status.json" 2>&1
      t fp profile .fpdocs/xcolor.pdf --json --png "$OUT/xcolor.density.png" ${PROFILE_ARGS:-} > "$OUT/profile.json" 2> "$OUT/profile.err"
      t fp stop > "$OUT/stop.log" 2>&1
      sleep 2; say "left after stop: $(pgrep -fa 'fpcli|sglang' | grep -v pgrep | wc -l) processes"
      # a cold fp ask (no resident engine; Triton's cache and the document cache already warm, as on a
      # user's machine after the first run)
      t fp ask $DOC "Which command creates a frame title?" --no-server --json ${ASK_ARGS:-} > "$OUT/ask3.json" 2> "$OUT/ask3.err"
      ask_summaries ask1 ask2 ask3
      python - "$OUT" <<'PY' | tee -a "$SUM"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    p = json.loads((out / "profile.json").read_text())
    print("profile keys", sorted(p)[:12], "density", p.get("density"))
except Exception as e:
    print("profile: no JSON:", e, (out / "profile.err").read_text()[-600:])
PY
      ;;
    askcold)  # one cold fp ask (no resident engine) on the TeX manual, with $ASK_ARGS (e.g. --profile accurate)
      t fp ask .fpdocs/beameruserguide.pdf "Which command creates a frame title?" --no-server --json ${ASK_ARGS:-} \
        > "$OUT/askcold.json" 2> "$OUT/askcold.err"
      ask_summaries askcold ;;
    eval)
      t timeout -s INT -k 30 ${EVAL_TIMEOUT:-86400} fp eval --len ${EVAL_LENS:-32k,128k} --task ${EVAL_TASKS:-niah_single,niah_multikey,vt} --samples ${EVAL_N:-2} \
        --seed ${EVAL_SEEDS:-0,1} --profiles ${EVAL_PROFILES:-dense,bf16,fp8} ${EVAL_ARGS:-} --no-server --json --report "$OUT/eval.json" \
        > /dev/null 2> "$OUT/eval.err"; tail -25 "$OUT/eval.err" | tee -a "$SUM" ;;
    cold) t python scripts/lab/cold_start.py --configs ${COLD_CONFIGS:-warm,nowarm} --budget ${COLD_BUDGET:-240} > "$OUT/cold.log" 2>&1; tail -30 "$OUT/cold.log" | tee -a "$SUM" ;;
    bench) COLUMNS=400 t fp bench --len ${BENCH_LENS:-8k,32k,128k} ${BENCH_ARGS:-} > "$OUT/bench.txt" 2> "$OUT/bench.err"
      tee -a "$SUM" < "$OUT/bench.txt"; tail -8 "$OUT/bench.err" ;;
    needle) t timeout -k 5 ${LIM:-290} python scripts/lab/needle_recall.py --device cuda --model qwen2.5-coder-0.5b-instruct \
        --context 128k --dtype bfloat16 --len ${NEEDLE_LEN:-128k} --index 0 --seed 0 --chunk ${NEEDLE_CHUNK:-16384} \
        --configs ${NEEDLE_CONFIGS:-dense,base} --json "$OUT/needle.json" > "$OUT/needle.log" 2>&1
      tail -${NEEDLE_TAIL:-20} "$OUT/needle.log" | tee -a "$SUM" ;;
    vertical) pyt vertical_test 120 tests/gpu/test_vertical_blocks_gpu.py
      t timeout -k 5 ${LIM:-400} python scripts/lab/vertical_blocks.py --device cuda --model qwen2.5-coder-0.5b-instruct \
        --context 128k --dtype bfloat16 --len ${VERTICAL_LEN:-32k} --layers ${VERTICAL_LAYERS:-2-23} --json "$OUT/vertical.json" \
        > "$OUT/vertical.log" 2>&1
      tail -${VERTICAL_TAIL:-40} "$OUT/vertical.log" | tee -a "$SUM" ;;
  esac
done
say "done: $*"
