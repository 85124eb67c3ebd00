"""Lab: where the operator's time goes on a GPU (never imported by the product).

    PYTHONPATH=kernels python scripts/lab/bench_lab.py --lens 32k,128k [--profile] [--sweep]

Per length, on the operator benchmark's synthetic inputs (``flashprefill.bench``):
attention without mean correction (same index), the block-means kernel alone, the host time of
one ``build_index`` call (its launch + sync floor); ``--sweep`` times attention tile configs
given explicitly (``KernelConfig`` passed to the launchers, against the default's output);
``--profile`` prints the device time of every kernel of one index + attention call
(torch.profiler), the GPU's idle time inside that call (``gpu_timeline``) and the attention
kernel's time per phase from per-program ``%globaltimer`` stamps (``attention_phases``, the
kernel's ``TIMING`` constexpr, False in every shipped launch). Measured losers and their numbers:
``docs/lab/variants.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Callable

import torch

from flashprefill import SparseConfig, make_plan
from flashprefill.bench import synthetic_inputs, time_ms
from flashprefill.impl.triton import host
from flashprefill.impl.triton.tiles import get_config
from flashprefill.lengths import parse_lengths

# attention tile configs timed besides the default: name -> AttnConfig field changes
ATTN_SWEEP = {"mc_stages3": {"mc_stages": 3}}


def host_ms(fn: Callable[[], object], n: int = 20) -> float:
    """Mean host (wall) milliseconds of ``fn`` per call, the GPU synchronised before and after:
    for a call that syncs internally (``build_index`` reads ``nnz``) this is its latency floor."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def profile_kernels(fn: Callable[[], object], n: int = 5) -> list[tuple[str, float, int]]:
    """``(kernel name, device ms per call, launches per call)`` of ``fn``, by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        if str(getattr(ev, "device_type", "")).endswith("CPU") and ev.key.startswith(("aten::", "cuda")):
            continue                    # host-side ops: their kernels are listed by name
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t and ev.count:
            rows.append((ev.key[:60], t / 1e3 / n, ev.count // n))
    rows.sort(key=lambda r: -r[1])
    return rows


PHASES = ("setup", "exact", "exact masked", "mean loop", "mean subtract", "epilogue")


def attention_phases(run: Callable[[torch.Tensor], object], n_programs: int) -> dict:
    """Where one attention launch spends its SM time, from per-program ``%globaltimer`` stamps
    (``host.launch_attention(timing=...)``): per phase (``PHASES``) the summed program time divided by
    the SM count (ms; the phases add up to ``busy_ms``, comparable with the kernel time when
    one program is resident per SM), the launch's span and the least / most busy SM (ms: load
    balance). ``run(timing)`` launches the attention with the int64 ``[n_programs, 8]`` buffer."""
    t = torch.zeros(n_programs, 8, dtype=torch.int64, device="cuda")
    run(t)                                     # compile + warm
    torch.cuda.synchronize()
    run(t)
    torch.cuda.synchronize()
    t = t.cpu()
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    stamps = t[:, :7].double()
    per_phase = (stamps[:, 1:] - stamps[:, :-1]).sum(0) / n_sm / 1e6
    program = (stamps[:, 6] - stamps[:, 0]) / 1e6
    per_sm = torch.zeros(int(t[:, 7].max()) + 1, dtype=torch.float64).index_add_(0, t[:, 7], program)
    per_sm = per_sm[per_sm > 0]
    out = {name: float(ms) for name, ms in zip(PHASES, per_phase)}
    out.update(busy_ms=float(program.sum() / n_sm), span_ms=float((stamps[:, 6].max() - stamps[:, 0].min()) / 1e6),
               sm_busy_min_ms=float(per_sm.min()), sm_busy_max_ms=float(per_sm.max()), n_sm_used=int(per_sm.numel()))
    return out


def gpu_timeline(fn: Callable[[], object], n: int = 3) -> dict:
    """GPU idle time inside one call of ``fn`` (torch.profiler device timestamps): span from the
    first kernel's start to the last one's end, busy (union of kernels and copies), idle = span -
    busy, and the longest gap with the kernels around it; the median call of ``n`` (ms)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    calls = []
    for _ in range(n):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = list(prof.events())
        ev = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                     if str(getattr(e, "device_type", "")).endswith("CUDA")), key=lambda x: x[0])
        if not ev:
            continue
        # the host side: when each CUDA runtime / driver call (launches, copies, syncs) started
        # and how long it took, relative to the first (us), to tell host gaps from device gaps
        host = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                      if str(getattr(e, "device_type", "")).endswith("CPU") and e.name.startswith("cu"))
        h0 = host[0][0] if host else 0.0
        busy, cur_s, cur_e, gap = 0.0, ev[0][0], ev[0][1], (0.0, "", "")
        prev = ev[0][2]
        for st, en, name in ev[1:]:
            if st > cur_e:
                busy += cur_e - cur_s
                if st - cur_e > gap[0]:
                    gap = (st - cur_e, prev[:40], name[:40])
                cur_s, cur_e = st, en
            else:
                cur_e = max(cur_e, en)
            prev = name
        busy += cur_e - cur_s
        span = max(e for _, e, _ in ev) - ev[0][0]
        calls.append({"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
                      "longest_gap_ms": gap[0] / 1e3, "gap_after": gap[1], "gap_before": gap[2],
                      "host_us": " ".join(f"{n}@{st - h0:.0f}+{en - st:.0f}" for st, en, n in host[:40])})
    if not calls:
        return {}
    calls.sort(key=lambda c: c["span_ms"])
    return calls[len(calls) // 2]


def run(L: int, hq: int, hkv: int, d: int, dtype, page_size: int, profile: bool, sweep: bool,
        precisions: tuple[str, ...] = ("bf16",)) -> dict:
    cfg = SparseConfig()
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, hq, hkv, d, dtype, page_size)
    scale = 1.0 / math.sqrt(d)
    plan = make_plan(sl, cu, hq // hkv, cfg.block_size)
    kernels = get_config(d, dtype, cfg.block_size)
    index = host.build_index(q, kc, vc, pt, sl, cu, cfg, scale, plan, kernels=kernels)
    row = {"L": L, "density": index.nnz / max(1, int(index.n_visible.sum())), "notes": {}}
    row["attn_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, index))
    nomc = cfg.replace(mean_correction=False)
    row["attn_nomc_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, nomc, scale, plan, index))
    row["means_ms"] = time_ms(lambda: host.block_means(kc, vc, pt, sl, plan, cfg.block_size))
    row["index_host_ms"] = host_ms(lambda: host.build_index(q, kc, vc, pt, sl, cu, cfg, scale, plan))
    if sweep:
        ref_out, ref_lse = host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, index)
        for name, over in ATTN_SWEEP.items():
            alt = dataclasses.replace(kernels, attn=dataclasses.replace(kernels.attn, **over))
            try:
                row[f"attn_{name}_ms"] = time_ms(
                    lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, index, kernels=alt))
                o, lse = host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, index, kernels=alt)
                row[f"attn_{name}_maxdiff"] = float((o.float() - ref_out.float()).abs().max())
                row[f"attn_{name}_lse_maxdiff"] = float((lse - ref_lse).abs().max())
            except Exception as e:  # e.g. out of shared memory: report, go on
                row["notes"][name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        # the fallback correction (an index without its selection bitmask)
        nobits = dataclasses.replace(index, sel_bits=None)
        row["attn_subtract_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, nobits))
    if profile:
        for p in precisions:   # each precision's default kernels (fp8: the Gluon attention on sm_90)
            tag = "" if p == "bf16" else f"_{p}"
            total = lambda: host.attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, precision=p)  # noqa: E731
            row[f"total{tag}_ms"] = time_ms(total)
            row[f"profile{tag}"] = profile_kernels(total)
            row[f"timeline{tag}"] = gpu_timeline(total)
            row[f"total_host{tag}_ms"] = host_ms(total)
        n_prog = host.attention_programs(plan, hkv, kernels.attn)
        row["phases"] = attention_phases(
            lambda t: host.sparse_attention(q, kc, vc, pt, sl, cu, cfg, scale, plan, index, timing=t), n_prog)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="32k,128k")
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--precisions", default="bf16", help="with --profile: comma list of precisions to profile "
                    "(bf16,fp8,int8qk), each with its default kernels")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    rows = [run(L, hq, hkv, a.head_dim, torch.bfloat16, a.page_size, a.profile, a.sweep, tuple(a.precisions.split(",")))
            for L in parse_lengths(a.lens)]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    for r in rows:
        if not a.profile:
            print(json.dumps(r))
            continue
        print(f"L={r['L']} density {r['density']:.4f}")   # the profile, short: the whole row is in --json
        for p in a.precisions.split(","):
            tag = "" if p == "bf16" else f"_{p}"
            tl = r.get(f"timeline{tag}") or {}
            print(f"  {p}: total {r[f'total{tag}_ms']:.3f} ms (host {r[f'total_host{tag}_ms']:.3f}); GPU span "
                  f"{tl.get('span_ms', 0):.3f} busy {tl.get('busy_ms', 0):.3f} idle {tl.get('idle_ms', 0):.3f}, longest gap "
                  f"{tl.get('longest_gap_ms', 0):.3f} after {tl.get('gap_after')} before {tl.get('gap_before')}")
            for name, ms, n in r[f"profile{tag}"][:12]:
                print(f"    {ms:8.3f} ms  x{n:<3d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
