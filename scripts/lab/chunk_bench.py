"""Lab: the operator at the engine's chunked-prefill shapes (never imported by the product).

    PYTHONPATH=kernels:.:scripts/lab python scripts/lab/chunk_bench.py --heads 14/2 --head-dim 64 \
        --chunk 16k --prefixes 0,48k,112k

Why: the SGLang engine prefills a 128K prompt in chunks of 16,384 new tokens
(``chunked_prefill_size``), so each sparse layer calls the operator eight times, with 16K queries
after a prefix of 0 to 112K cached tokens. The operator benchmark (``flashprefill.bench``) times one call
with as many queries as keys. End to end on Qwen2.5-0.5B (14/2 heads, d 64) the FP8 engine was 0.95x the
BF16 one at 128K, while the FP8 operator is 1.42x at 32/8 heads, d 128 (``docs/benchmarks.md``,
twenty-first session). Work that FP8 adds per call (the K / V amax, the pre-pass over the whole prefix,
the means' codes, some seventy small launches) weighs eight times per layer there.

Per prefix and precision (bf16, then fp8 on the default kernels): one ``host.attention`` call
event-timed (median, ms); its host time with the GPU drained (``bench_lab.host_ms``); ``--layers``
calls back to back, event-timed per call (above the single call when the host cannot keep up); the
GPU's idle inside one call (``bench_lab.gpu_timeline``); and, with ``--profile``, each kernel's
device time per call (``bench_lab.profile_kernels``).
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from flashprefill import SparseConfig, make_plan
from flashprefill.bench import synthetic_inputs, time_ms
from flashprefill.lengths import parse_length


def chunk_inputs(prefix: int, chunk: int, hq: int, hkv: int, d: int, dtype=torch.bfloat16, page_size: int = 64,
                 device: str = "cuda"):
    """One request of ``prefix`` cached tokens and ``chunk`` new ones: ``flashprefill.bench``'s
    synthetic sequence of ``prefix + chunk`` tokens, its paged K / V whole and its last ``chunk`` query
    rows. Returns ``(q [chunk, hq, d], k_cache, v_cache, page_table, seq_lens int32 [1] = prefix + chunk,
    cu_seqlens_q int32 [0, chunk])``."""
    if chunk < 1 or prefix < 0:
        raise ValueError(f"chunk_inputs: chunk >= 1 and prefix >= 0 tokens, got chunk={chunk}, prefix={prefix}")
    q, kc, vc, pt, sl, _, _, _ = synthetic_inputs(prefix + chunk, hq, hkv, d, dtype, page_size, 1, device=device)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    return q[prefix:].contiguous(), kc, vc, pt, sl, cu


def run(prefix: int, chunk: int, hq: int, hkv: int, d: int, layers: int, profile: bool) -> dict:
    from bench_lab import gpu_timeline, host_ms, profile_kernels

    from flashprefill.impl.triton import host

    q, kc, vc, pt, sl, cu = chunk_inputs(prefix, chunk, hq, hkv, d)
    config = SparseConfig()
    scale = 1.0 / math.sqrt(d)
    plan = make_plan(sl, cu, hq // hkv, config.block_size)
    row = {"prefix": prefix, "chunk": chunk, "shape": f"{hq}/{hkv}/{d}"}
    for precision in ("bf16", "fp8"):
        def call():
            return host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, precision=precision)

        def sweep():
            for _ in range(layers):
                call()

        r = {"call_ms": time_ms(call), "host_ms": host_ms(call), "sweep_ms_per_call": time_ms(sweep) / layers}
        r.update({f"timeline_{k}": v for k, v in gpu_timeline(call).items() if k != "host_us"})
        if profile:
            r["kernels"] = [(name, round(ms, 4), n) for name, ms, n in profile_kernels(call)[:14]]
        row[precision] = r
    row["fp8_x_bf16"] = row["bf16"]["call_ms"] / row["fp8"]["call_ms"]
    row["fp8_x_bf16_sweep"] = row["bf16"]["sweep_ms_per_call"] / row["fp8"]["sweep_ms_per_call"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="14/2", help="query heads / KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunk", default="16k", help="new tokens per call (the engine's chunked_prefill_size)")
    ap.add_argument("--prefixes", default="0,48k,112k", help="comma-separated cached tokens before the chunk")
    ap.add_argument("--layers", type=int, default=22, help="calls back to back in the sweep (sparse layers)")
    ap.add_argument("--profile", action="store_true", help="each kernel's device time per call")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("chunk_bench.py times the Triton / Gluon kernels: it needs a CUDA GPU")
    hq, hkv = (int(x) for x in a.heads.split("/"))
    chunk = parse_length(a.chunk)
    rows = []
    print(f"{'prefix':>7} {'shape':>9} {'bf16 ms':>8} {'fp8 ms':>8} {'x':>5} {'bf16 swp':>8} {'fp8 swp':>8} {'x':>5} "
          f"{'bf16 host':>9} {'fp8 host':>8} {'bf16 idle':>9} {'fp8 idle':>8}", flush=True)
    for p in (parse_length(x) if x != "0" else 0 for x in a.prefixes.split(",") if x):
        r = run(p, chunk, hq, hkv, a.head_dim, a.layers, a.profile)
        torch.cuda.empty_cache()                # the last prefix's inputs are gone with run()'s frame
        rows.append(r)
        b, f = r["bf16"], r["fp8"]
        print(f"{p:>7} {r['shape']:>9} {b['call_ms']:8.3f} {f['call_ms']:8.3f} {r['fp8_x_bf16']:5.2f} "
              f"{b['sweep_ms_per_call']:8.3f} {f['sweep_ms_per_call']:8.3f} {r['fp8_x_bf16_sweep']:5.2f} "
              f"{b['host_ms']:9.3f} {f['host_ms']:8.3f} {b.get('timeline_idle_ms', float('nan')):9.3f} "
              f"{f.get('timeline_idle_ms', float('nan')):8.3f}", flush=True)
        if a.profile:
            for prec in ("bf16", "fp8"):
                print(f"  {prec}: " + "; ".join(f"{n} {ms:.3f}x{c}" for n, ms, c in r[prec]["kernels"]), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
