#!/usr/bin/env bash
# Several gpu_round.sh lanes side by side in one device call (lab tooling, never imported by the product).
#   source .fpdev/bin/env.sh && LANE_LIM=580 bash scripts/lab/lanes.sh "kernels fp8" "engines1 engines3" ...
# Each argument is one lane: words with "=" are its environment (e.g. EVAL_LENS=32k), the others its
# parts, run in order, in their own $OUT/laneN (logs, summary.txt), with
# the lane cut at $LANE_LIM seconds. Accuracy and pass/fail only: lanes share the GPU and the CPU, so
# their timings are not benchmarks. Prints every lane's summary last.
set -u
OUT=${OUT:-$PWD/out-gpu}; mkdir -p "$OUT"
OUT=$OUT/setup bash scripts/lab/gpu_round.sh > /dev/null 2>&1  # the editable install and the model links, once, before the lanes race for them
i=0
for lane in "$@"; do
  i=$((i + 1))
  vars=(); parts=()
  for w in $lane; do case $w in *=*) vars+=("$w") ;; *) parts+=("$w") ;; esac; done
  env "${vars[@]}" OUT="$OUT/lane$i" timeout -k 10 "${LANE_LIM:-580}" bash scripts/lab/gpu_round.sh "${parts[@]}" \
    > "$OUT/lane$i.log" 2>&1 &
done
wait
for j in $(seq 1 $i); do echo "== lane$j"; cat "$OUT/lane$j/summary.txt" 2>/dev/null || tail -5 "$OUT/lane$j.log"; done
