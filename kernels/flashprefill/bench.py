"""Operator benchmark: FlashPrefill V2 (Triton) vs dense attention baselines, batch 1 by default.

    python -m flashprefill.bench --lens 4k,8k,32k,128k --heads 32/8 --head-dim 128 --dtype bf16 --json out.json

Inputs are SYNTHETIC with sink / local / needle structure (``synthetic_inputs``): a shared
direction ``u`` in every query, the first 4 keys and one key block in 37 ("needles") along ``u``,
and a slowly varying positional component shared by q_t and k_t (locality). Default
``SparseConfig``. Paged KV (page size 64 unless ``--page-size``).

Per length: index ms, attention ms, total, density, index memory (the ``BlockIndex`` tensors and
the peak allocation delta of ``build_index``), our dense mode, and dense baselines measured in the
same run: FA4 CuTe (``flash_attn.cute``, if installed), cuDNN SDPA, FA2 (SDPA flash backend).
Times are ``triton.testing.do_bench`` medians after warm-up (one helper, ``time_ms``).

``--variants`` adds where-the-time-goes columns: attention without mean correction (same index),
the other mean-correction modes and tile configs, the index with exact (two-dot, ~fp32) scores,
the block-means kernel alone, and the host time of one ``build_index`` call (the launch + sync
floor). ``--profile`` prints the device time of every kernel of one index + attention call
(torch.profiler, mean of 5 calls), the GPU's idle time inside that call (``gpu_timeline``), and
the attention kernel's time per phase from per-program timestamps (``attention_phases``). The
plain-text table is printed last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from typing import Callable

import torch

from .config import ATTN_VARIANTS, SparseConfig
from .config import INDEX_VARIANTS as CFG_INDEX_VARIANTS  # named apart from the bench's column list
from .plan import make_plan

FP8_NOTE = "FP8 e4m3 path not implemented in the Triton kernels yet (bf16/fp16 only)"
WARMUP_MS = 50
REP_MS = 300


def parse_len(s: str) -> int:
    """``4k`` -> 4096, ``128k`` -> 131072, ``131072`` -> 131072."""
    s = s.strip().lower()
    if s.endswith("k"):
        return int(float(s[:-1]) * 1024)
    if s.endswith("m"):
        return int(float(s[:-1]) * 1024 * 1024)
    return int(s)


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events, warm-up first)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))


def synthetic_inputs(L: int, hq: int, hkv: int, d: int, dtype, page_size: int = 64, batch: int = 1, seed: int = 0,
                     device: str = "cuda"):
    """Paged batch of ``batch`` requests of ``L`` tokens with sink / local / needle structure."""
    dev = device
    gen = torch.Generator(device=dev).manual_seed(seed)
    g = hq // hkv
    total = L * batch
    pages_per = -(-L // page_size)
    n_pages = pages_per * batch
    q = torch.randn(total, hq, d, generator=gen, device=dev, dtype=torch.float32)
    k = torch.randn(n_pages * page_size, hkv, d, generator=gen, device=dev, dtype=torch.float32)
    v = torch.randn(n_pages * page_size, hkv, d, generator=gen, device=dev, dtype=torch.float32)
    u = torch.randn(hkv, d, generator=gen, device=dev)
    u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(d)
    for b in range(batch):
        pos = torch.arange(L, device=dev)
        slow = torch.randn(L // 256 + 2, hkv, d, generator=gen, device=dev) * 0.5
        drift = slow[pos // 256]                                              # local structure
        base = b * pages_per * page_size
        k[base:base + L] += drift
        q[b * L:(b + 1) * L] += drift.repeat_interleave(g, 1) + 0.5 * u.repeat_interleave(g, 0)
        pick = (pos < 4) | ((pos // 128) % 37 == 5)                            # sink + needles
        k[base:base + L][pick] += 0.7 * u
    k = k.view(n_pages, page_size, hkv, d).to(dtype)
    v = v.view(n_pages, page_size, hkv, d).to(dtype)
    perm = torch.randperm(n_pages, generator=gen, device=dev).to(torch.int32)
    inv = torch.empty_like(perm)
    inv[perm.long()] = torch.arange(n_pages, dtype=torch.int32, device=dev)
    # scatter the pages: logical page i of the pool now lives at physical page perm[i]
    k_cache = torch.empty_like(k)
    v_cache = torch.empty_like(v)
    k_cache[perm.long()] = k
    v_cache[perm.long()] = v
    page_table = perm.view(batch, pages_per).contiguous()
    seq_lens = torch.full((batch,), L, dtype=torch.int32, device=dev)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev) * L
    return q.to(dtype), k_cache, v_cache, page_table, seq_lens, cu, k.view(-1, hkv, d), v.view(-1, hkv, d)


def _dense_baselines(q, k_lin, v_lin, L, batch, hq, hkv, d, scale):
    """FA4 CuTe, cuDNN SDPA, FA2 (SDPA flash): ms or a note each."""
    res, notes = {}, {}
    g = hq // hkv
    qb = q.view(batch, L, hq, d)
    kb = k_lin.view(batch, -1, hkv, d)[:, :L]
    vb = v_lin.view(batch, -1, hkv, d)[:, :L]
    try:
        from flash_attn.cute import flash_attn_func  # FA4, imported lazily
        qc, kc, vc = qb.contiguous(), kb.contiguous(), vb.contiguous()
        res["fa4_ms"] = time_ms(lambda: flash_attn_func(qc, kc, vc, softmax_scale=scale, causal=True))
    except Exception as e:  # absent or failing: say so, never fake it
        notes["fa4"] = f"skipped: {type(e).__name__}: {str(e)[:160]}"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qs = qb.transpose(1, 2)
    ks = kb.repeat_interleave(g, 2).transpose(1, 2).contiguous()
    vs = vb.repeat_interleave(g, 2).transpose(1, 2).contiguous()
    qs = qs.contiguous()
    for key, backend in (("cudnn_ms", SDPBackend.CUDNN_ATTENTION), ("fa2_ms", SDPBackend.FLASH_ATTENTION)):
        try:
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            res[key] = time_ms(run)
        except Exception as e:
            notes[key[:-3]] = f"skipped: {type(e).__name__}: {str(e)[:160]}"
    del ks, vs
    return res, notes


# --variants: attention tile configs timed besides the default (d=128: all fit in sm_90 smem,
# scripts/compile_sm90.py)
# index-stage tiles (config.INDEX_VARIANTS); selection BLOCK_J 128 / 8 warps were slower (2026-11-30)
INDEX_VARIANTS: list[tuple[str, str]] = [(f"index_{name}_ms", name) for name in CFG_INDEX_VARIANTS]
# "flat", "flat st4", "flat+merged" and "m64 st2" lost at every length on 2026-11-30 (H200,
# docs/benchmarks.md) and were dropped; "m64" stays measured as the named variant the tests run.
ATTN_CONFIG_VARIANTS = [("attn_sub_ms", {"mc_mode": "subtract"}),
                        ("attn_mask_ms", {"mc_mode": "mask"}),
                        ("attn_mcst3_ms", {"mc_stages": 3}),
                        ("attn_m64_ms", ATTN_VARIANTS["m64"]),
                        ("attn_nopair_ms", ATTN_VARIANTS["nopair"])]


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
    (``launch_attention(timing=...)``): per phase (``PHASES``) the summed program time divided by
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


# --device cpu: a tiny reference run for plumbing and correctness, NOT representative of GPU speed

CPU_LABEL = "CPU reference, not representative"
CPU_MAX_LEN = 8192        # the reference is O(L^2) in memory and time on the CPU
CPU_REPEATS = 3           # timed calls per measurement (after one warm-up call); the median is kept
CPU_COLS = [("L", "L", "{:d}"), ("density", "density", "{:.4f}"), ("index_ms", "index ms", "{:.1f}"),
            ("attn_ms", "attn ms", "{:.1f}"), ("total_ms", "total ms", "{:.1f}"),
            ("dense_ref_ms", "dense ref ms", "{:.1f}"), ("sdpa_ms", "SDPA ms", "{:.1f}"),
            ("speedup_vs_dense_ref", "x dense ref", "{:.2f}"), ("speedup_vs_sdpa", "x SDPA", "{:.2f}")]


def cpu_time_ms(fn: Callable[[], object], repeats: int = CPU_REPEATS) -> float:
    """Median wall milliseconds of ``fn`` over ``repeats`` calls after one warm-up call
    (``time.perf_counter``; CPU tensors, nothing to synchronise)."""
    fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _run_cpu_bench(lens, heads_q, heads_kv, head_dim, dtype, fp8, batch, say, page_size, config, baselines,
                   variants, profile, repeats) -> list[dict]:
    """The CPU rows: the reference backend (index, attention, total) against two dense baselines
    measured in the same run, ``flashprefill.dense_attention`` (reference) and torch SDPA."""
    from . import api
    cpu = platform.processor() or platform.machine() or "CPU"
    rows = []
    for L in [parse_len(x) if isinstance(x, str) else int(x) for x in lens]:
        if L > CPU_MAX_LEN:
            raise ValueError(f"device='cpu' runs lengths up to {CPU_MAX_LEN} tokens (the reference is O(L^2)); got {L}")
        say(f"[bench] {CPU_LABEL}: L={L} batch={batch} heads {heads_q}/{heads_kv} d={head_dim} {dtype}")
        row = {"device": "cpu", "gpu": None, "cpu": cpu, "label": CPU_LABEL, "backend": "reference", "L": L,
               "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
               "dtype": str(dtype).replace("torch.", ""), "page_size": page_size,
               "inputs": "synthetic sink/local/needle", "repeats": repeats,
               "config": {f: getattr(config, f) for f in config.field_names()}, "notes": {"cpu": CPU_LABEL}}
        if fp8:
            row["notes"]["fp8"] = FP8_NOTE
        if variants or profile:
            row["notes"]["variants"] = "--variants / --profile measure GPU kernels: skipped on the CPU"
        q, kc, vc, pt, sl, cu, k_lin, v_lin = synthetic_inputs(L, heads_q, heads_kv, head_dim, dtype, page_size,
                                                               batch, device="cpu")
        scale = 1.0 / math.sqrt(head_dim)
        plan = make_plan(sl, cu, heads_q // heads_kv, config.block_size)
        kw = dict(config=config, softmax_scale=scale, plan=plan, backend="reference")
        index = api.build_index(q, kc, vc, pt, sl, cu, **kw)
        row["density"] = index.nnz / max(1, int(index.n_visible.sum()))
        row["index_ms"] = cpu_time_ms(lambda: api.build_index(q, kc, vc, pt, sl, cu, **kw), repeats)
        row["attn_ms"] = cpu_time_ms(lambda: api.flashprefill_attention(q, kc, vc, pt, sl, cu, index=index, **kw),
                                     repeats)
        row["total_ms"] = cpu_time_ms(lambda: api.flashprefill_attention(q, kc, vc, pt, sl, cu, **kw), repeats)
        row["dense_ref_ms"] = cpu_time_ms(lambda: api.dense_attention(q, kc, vc, pt, sl, cu, scale, plan=plan,
                                                                      backend="reference"), repeats)
        row["speedup_vs_dense_ref"] = row["dense_ref_ms"] / row["total_ms"]
        if baselines:
            g = heads_q // heads_kv
            qs = q.view(batch, L, heads_q, head_dim).transpose(1, 2).contiguous()
            ks = k_lin.view(batch, -1, heads_kv, head_dim)[:, :L].repeat_interleave(g, 2).transpose(1, 2).contiguous()
            vs = v_lin.view(batch, -1, heads_kv, head_dim)[:, :L].repeat_interleave(g, 2).transpose(1, 2).contiguous()
            row["sdpa_ms"] = cpu_time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale), repeats)
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["total_ms"]
        rows.append(row)
    return rows


def run_operator_bench(lens, heads_q: int, heads_kv: int, head_dim: int, dtype, fp8: bool = False, batch: int = 1,
                       progress=None, page_size: int = 64, config: SparseConfig | None = None,
                       baselines: bool = True, variants: bool = False, profile: bool = False,
                       device: str = "cuda", repeats: int = CPU_REPEATS) -> list[dict]:
    """Benchmark each length; one dict per length (the JSON rows). ``dtype``: torch dtype or
    'bf16'/'fp16'. ``progress``: optional callable(str).

    ``device="cuda"`` (default): the Triton operator vs the GPU dense baselines, CUDA-event medians.
    ``device="cpu"``: the reference backend at small lengths (<= ``CPU_MAX_LEN``), ``time.perf_counter``
    medians of ``repeats`` calls, against ``flashprefill.dense_attention`` (reference) and torch
    SDPA on the CPU; every row says "CPU reference, not representative" (``label``, ``notes``).
    """
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                 "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[dtype]
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    config = config or SparseConfig()
    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    if device == "cpu":
        return _run_cpu_bench(lens, heads_q, heads_kv, head_dim, dtype, fp8, batch, say, page_size, config,
                              baselines, variants, profile, repeats)
    from .impl import triton_backend as tb
    if not torch.cuda.is_available():
        raise RuntimeError("flashprefill.bench needs a CUDA GPU (device='cpu' runs a tiny reference instead)")
    gpu = torch.cuda.get_device_name()
    rows = []
    for L in [parse_len(x) if isinstance(x, str) else int(x) for x in lens]:
        say(f"[bench] L={L} batch={batch} heads {heads_q}/{heads_kv} d={head_dim} {dtype}")
        row = {"gpu": gpu, "L": L, "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
               "dtype": str(dtype).replace("torch.", ""), "page_size": page_size, "inputs": "synthetic sink/local/needle",
               "config": {f: getattr(config, f) for f in config.field_names()}, "notes": {}}
        if fp8:
            row["notes"]["fp8"] = FP8_NOTE
        q, kc, vc, pt, sl, cu, k_lin, v_lin = synthetic_inputs(L, heads_q, heads_kv, head_dim, dtype, page_size, batch)
        scale = 1.0 / math.sqrt(head_dim)
        plan = make_plan(sl, cu, heads_q // heads_kv, config.block_size)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        index = tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
        torch.cuda.synchronize()
        row["index_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["index_mib"] = index.nbytes() / 2**20
        row["density"] = index.nnz / max(1, int(index.n_visible.sum()))
        row["index_ms"] = time_ms(lambda: tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
        row["attn_ms"] = time_ms(lambda: tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index))

        def total():                    # what flashprefill_attention runs (no index given)
            return tb.attention(q, kc, vc, pt, sl, cu, config, scale, plan)
        row["total_ms"] = time_ms(total)

        def two_calls():                # build_index, then sparse_attention (no dense-tail overlap)
            idx = tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
            return tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, idx)
        if variants:
            row["total_2call_ms"] = time_ms(two_calls)
            cfg_nomc = config.replace(mean_correction=False)
            row["attn_nomc_ms"] = time_ms(lambda: tb.sparse_attention(q, kc, vc, pt, sl, cu, cfg_nomc, scale, plan, index))
            saved = tb.EXACT_SCORES
            try:
                tb.EXACT_SCORES = not saved
                key = "index_exact_ms" if not saved else "index_onedot_ms"
                row[key] = time_ms(lambda: tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
                alt = tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
                from .impl import reference as ref
                max_nb = plan.max_blocks(config.block_size)
                diff = (ref._csr_to_mask(alt, heads_kv, plan.n_tiles, max_nb)
                        != ref._csr_to_mask(index, heads_kv, plan.n_tiles, max_nb)).sum()
                row["exact_vs_onedot_mismatch"] = int(diff) / max(1, int(index.n_visible.sum()))
                del alt
            finally:
                tb.EXACT_SCORES = saved
            from .impl import triton_attention as ta
            base_cfg = ta.get_config
            # every variant's output against the default's (the "mask" variant: the two
            # mean-correction modes must agree at full size too)
            ref_out, ref_lse = tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index)
            for key, over in ATTN_CONFIG_VARIANTS:   # the same kernel, other tiles (sm_90 fit checked)
                try:
                    ta.get_config = lambda *a, _o=over, **k: dataclasses.replace(base_cfg(*a, **k), **_o)
                    row[key] = time_ms(lambda: tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index))
                    alt, alt_lse = tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index)
                    row[key[:-3] + "_maxdiff"] = float((alt.float() - ref_out.float()).abs().max())
                    row[key[:-3] + "_lse_maxdiff"] = float((alt_lse - ref_lse).abs().max())
                    del alt, alt_lse
                except Exception as e:  # e.g. out of shared memory: report, go on
                    row["notes"][key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                finally:
                    ta.get_config = base_cfg
            del ref_out, ref_lse
            for key, name in INDEX_VARIANTS:         # index-stage tiles (module constants of the backend)
                try:
                    with tb.index_variant(name):
                        row[key] = time_ms(lambda: tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
                except Exception as e:
                    row["notes"][key] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            row["select_programs_per_sm"] = sorted(set(tb._SELECT_OCC.values()))
            row["means_ms"] = time_ms(lambda: tb.block_means(kc, vc, pt, sl, plan, config.block_size))
            row["index_host_ms"] = host_ms(lambda: tb.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
        if profile:
            try:
                row["profile"] = profile_kernels(total)
                say(f"[profile] L={L}: " + "; ".join(f"{k} {ms:.3f} ms x{c}" for k, ms, c in row["profile"]))
                row["timeline"] = gpu_timeline(total)
                row["timeline_2call"] = gpu_timeline(two_calls)
                say(f"[timeline] L={L}: fused {json.dumps(row['timeline'])}; two calls "
                    f"{json.dumps(row['timeline_2call'])}")
            except Exception as e:  # CUPTI missing etc.: say so
                row["notes"]["profile"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
            from .impl import triton_attention as ta
            n_prog = ta.attention_programs(plan, heads_kv, head_dim, q.dtype, config.block_size)
            row["phases"] = {}
            for mode in ("subtract", "bits"):
                saved_mode = ta.MC_MODE
                try:
                    ta.MC_MODE = mode
                    row["phases"][mode] = attention_phases(
                        lambda t: tb.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index, timing=t),
                        n_prog)
                    say(f"[phases] L={L} mc_mode={mode}: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in row["phases"][mode].items()))
                except Exception as e:
                    row["notes"][f"phases_{mode}"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
                finally:
                    ta.MC_MODE = saved_mode
        row["dense_mode_ms"] = time_ms(lambda: tb.dense_attention(q, kc, vc, pt, sl, cu, scale, plan))
        # causal dense FLOPs: 4 * L^2/2 * d * Hq per request
        flops = 4.0 * (L * L / 2) * head_dim * heads_q * batch
        row["dense_mode_tflops"] = flops / row["dense_mode_ms"] / 1e9
        if baselines:
            res, notes = _dense_baselines(q, k_lin, v_lin, L, batch, heads_q, heads_kv, head_dim, scale)
            row.update(res)
            row["notes"].update(notes)
            for key in ("fa4_ms", "cudnn_ms", "fa2_ms"):
                if key in row:
                    row["speedup_vs_" + key[:-3]] = row[key] / row["total_ms"]
        rows.append(row)
        del q, kc, vc, k_lin, v_lin, index
        torch.cuda.empty_cache()
    return rows


TABLE_COLS = [("L", "L", "{:d}"), ("density", "density", "{:.4f}"), ("index_ms", "index ms", "{:.3f}"),
              ("attn_ms", "attn ms", "{:.3f}"), ("total_ms", "total ms", "{:.3f}"),
              ("index_mib", "idx MiB", "{:.1f}"), ("index_peak_mib", "peak MiB", "{:.1f}"),
              ("dense_mode_ms", "our dense ms", "{:.3f}"), ("fa4_ms", "FA4 ms", "{:.3f}"),
              ("cudnn_ms", "cuDNN ms", "{:.3f}"), ("fa2_ms", "FA2 ms", "{:.3f}"),
              ("speedup_vs_fa4", "x FA4", "{:.2f}"), ("speedup_vs_cudnn", "x cuDNN", "{:.2f}")]
VARIANT_COLS = [("L", "L", "{:d}"), ("attn_ms", "attn ms", "{:.3f}"), ("attn_nomc_ms", "attn no-MC ms", "{:.3f}"),
                ("total_ms", "total ms", "{:.3f}"), ("total_2call_ms", "total 2-call ms", "{:.3f}"),
                ("attn_sub_ms", "attn MCsub ms", "{:.3f}"), ("attn_sub_maxdiff", "MCsub maxdiff", "{:.1e}"),
                ("attn_mask_ms", "attn MCmask ms", "{:.3f}"), ("attn_mcst3_ms", "MC st3 ms", "{:.3f}"),
                ("attn_m64_ms", "M64x2/SM ms", "{:.3f}"), ("attn_m64_maxdiff", "M64 maxdiff", "{:.1e}"),
                ("attn_nopair_ms", "no-pair ms", "{:.3f}"), ("attn_nopair_maxdiff", "no-pair maxdiff", "{:.1e}"),
                ("attn_mask_maxdiff", "MCmask maxdiff", "{:.1e}"),
                ("index_ms", "index ms", "{:.3f}"), ("index_exact_ms", "idx exact ms", "{:.3f}"),
                ("index_onedot_ms", "idx 1-dot ms", "{:.3f}"), ("exact_vs_onedot_mismatch", "CSR diff frac", "{:.2e}"),
                *[(key, key[:-3], "{:.3f}") for key, _ in INDEX_VARIANTS],
                ("means_ms", "means ms", "{:.3f}"), ("index_host_ms", "idx host ms", "{:.3f}")]


def _plain(rows: list[dict], cols) -> list[str]:
    cols = [c for c in cols if c[0] == "L" or any(c[0] in r for r in rows)]
    head = [c[1] for c in cols]
    body = [[(c[2].format(r[c[0]]) if c[0] in r else "-") for c in cols] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x.rjust(w[i]) for i, x in enumerate(b)) for b in body]
    return lines


def format_table(rows: list[dict]) -> str:
    """Plain-text tables (fixed-width, no truncation): main columns, then variants if measured."""
    if not rows:
        return "(no rows)"
    r = rows[0]
    if r.get("device") == "cpu":
        lines = [f"{CPU_LABEL}: {r['cpu']}  batch {r['batch']}  heads {r['heads_q']}/{r['heads_kv']}  "
                 f"d {r['head_dim']}  {r['dtype']}  page {r['page_size']}  inputs: {r['inputs']}  "
                 f"median of {r['repeats']} calls"]
        lines += _plain(rows, CPU_COLS)
        notes = {k: v for row in rows for k, v in row["notes"].items()}
        return "\n".join(lines + [f"note {k}: {v}" for k, v in notes.items()])
    lines = [f"{r['gpu']}  batch {r['batch']}  heads {r['heads_q']}/{r['heads_kv']}  d {r['head_dim']}  "
             f"{r['dtype']}  page {r['page_size']}  inputs: {r['inputs']}  config: default SparseConfig"]
    lines += _plain(rows, TABLE_COLS)
    if any("attn_nomc_ms" in r for r in rows):
        lines += ["", "variants (where the time goes):"] + _plain(rows, VARIANT_COLS)
    occ = sorted({x for r in rows for x in r.get("select_programs_per_sm", [])})
    if occ:
        lines.append(f"select kernel resident programs per SM (compiled variants): {occ}")
    notes = {k: v for r in rows for k, v in r["notes"].items()}
    lines += [f"note {k}: {v}" for k, v in notes.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashprefill.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="4k,8k,32k,128k", help="comma list: 4k, 128k, 131072")
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 path (not implemented: reported as such)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--variants", action="store_true",
                    help="also time attention without mean correction, the index with the other score mode, "
                         "block means alone, build_index host latency")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times of one index + attention call")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a tiny reference run (<= 8k tokens), NOT representative of GPU speed")
    a = ap.parse_args(argv)
    hq, hkv = (int(x) for x in a.heads.split("/"))
    rows = run_operator_bench(a.lens.split(","), hq, hkv, a.head_dim, a.dtype, fp8=a.fp8, batch=a.batch,
                              page_size=a.page_size, baselines=not a.no_baselines, variants=a.variants,
                              profile=a.profile, device=a.device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    for r in rows:
        for name, ms, count in r.get("profile", []):
            print(f"profile L={r['L']:>7d}  {ms:9.3f} ms  x{count:<3d} {name}")
    print(format_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
