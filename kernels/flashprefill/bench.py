"""Operator benchmark: FlashPrefill V2 (Triton) vs dense attention baselines, batch 1 by default.

    python -m flashprefill.bench --lens 4k,8k,32k,128k --heads 32/8 --head-dim 128 --dtype bf16 --json out.json

Inputs are SYNTHETIC with sink / local / needle structure (``synthetic_inputs``): a shared
direction ``u`` in every query, the first 4 keys and one key block in 37 ("needles") along ``u``,
and a slowly varying positional component shared by q_t and k_t (locality). The default
``SparseConfig`` unless ``config=`` (``fp bench --profile``: a profile's sparse settings); the
table's header names the settings that differ from the default. Paged KV (page size 64 unless
``--page-size``).

Per length: index ms, attention ms, total (what ``flashprefill_attention`` runs: index, then
attention), density, index memory (the ``BlockIndex`` tensors and the peak allocation delta of
``build_index``), our dense mode, and dense baselines measured in the same run: FA4 CuTe
(``flash_attn.cute``, if installed), cuDNN SDPA, FA2 (SDPA flash backend). Times are
``triton.testing.do_bench`` medians after warm-up (one helper, ``time_ms``). TFLOP/s are
dense-equivalent causal FLOPs (``flashprefill.flops``) per second: for the sparse operator an
effective rate, for the dense kernels the real one.

Profiler timelines, per-phase kernel stamps and tile sweeps live in ``scripts/lab/``.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from typing import Callable, Iterable

import torch

from .config import SparseConfig, setting_text
from .flops import dense_causal_flops
from .lengths import parse_length, parse_lengths
from .plan import make_plan

FP8_DENSE_NOTE = "FP8 dense baseline: none installed (FlashInfer not importable)"
WARMUP_MS = 50
REP_MS = 300


def _lengths(lens: Iterable) -> list[int]:
    """Lengths given as ints or as strings (``parse_length``)."""
    return [parse_length(x) if isinstance(x, str) else int(x) for x in lens]


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


SHORT_WHY = ("the engines prefill a request this short with their stock dense attention (fp lowers min_sparse_len "
             "to half the context for models of a shorter context); the operator's index marks every tile of it "
             "dense (density 100%), so the sparse path ran skipping nothing")


def short_note(L: int, config: SparseConfig) -> str | None:
    """The row note of a length ``L`` (tokens) below ``config.min_sparse_len`` (``SHORT_WHY``), else
    ``None``."""
    if L >= config.min_sparse_len:
        return None
    return f"L={L} < min_sparse_len {config.min_sparse_len:,}: {SHORT_WHY}"


def config_text(config: SparseConfig, name: str | None = None) -> str:
    """What the operator ran, for the table's header: ``"default SparseConfig"``, or ``"SparseConfig
    with alpha 0.05, block_score mass (other settings default)"`` (``SparseConfig.differences``),
    after ``name`` when given (``"profile bf16-mass: ..."``)."""
    diff = config.differences()
    what = (f"SparseConfig with {setting_text(diff)} (other settings default)" if diff
            else "default SparseConfig")
    return f"{name}: {what}" if name else what


# --device cpu: a tiny reference run for plumbing and correctness, NOT representative of GPU speed

CPU_LABEL = "CPU reference, not representative"
CPU_MAX_LEN = 8192        # the reference is O(L^2) in memory and time on the CPU
CPU_REPEATS = 3           # timed calls per measurement (after one warm-up call); the median is kept
CPU_COLS = [("L", "L", "{:d}"), ("density", "density", "{:.1%}"), ("index_ms", "index ms", "{:.1f}"),
            ("attn_ms", "attn ms", "{:.1f}"), ("total_ms", "total ms", "{:.1f}"),
            ("dense_ref_ms", "dense ref ms", "{:.1f}"), ("sdpa_ms", "SDPA ms", "{:.1f}"),
            ("speedup_vs_dense_ref", "x dense ref", "{:.2f}"), ("speedup_vs_sdpa", "x SDPA", "{:.2f}"),
            ("fp8_density", "fp8 density", "{:.1%}"), ("fp8_total_ms", "fp8 total ms", "{:.1f}"),
            ("fp8_speedup", "x bf16", "{:.2f}"), ("fp8_rel_l2", "fp8 relL2", "{:.4f}"),
            ("fp8_dense_ref_ms", "fp8 dense ref ms", "{:.1f}"),
            ("int8qk_density", "int8qk density", "{:.1%}"), ("int8qk_total_ms", "int8qk total ms", "{:.1f}"),
            ("int8qk_speedup", "x bf16", "{:.2f}"), ("int8qk_rel_l2", "int8qk relL2", "{:.4f}")]


def _fp8_columns(row: dict, index_fn, total_fn, timer, precision: str = "fp8") -> None:
    """The FP8 sparse path next to the BF16 one of the same row: ``fp8_index_ms``, ``fp8_total_ms``,
    ``fp8_density``, ``fp8_rel_l2`` (relative L2 of the FP8 output against the BF16 sparse output
    on the same inputs) and ``fp8_speedup`` (BF16 sparse total / FP8 sparse total). ``fp8_index_ms``
    includes the attention's K / V pre-pass and the means' codes, which the FP8 index makes before
    its host sync (``host_fp8.Fp8Operands``), so it is not comparable with BF16's ``index_ms``.
    ``precision="int8qk"``: the same columns for that precision, named ``int8qk_*``."""
    p = precision
    index8 = index_fn(precision=p)
    row[f"{p}_density"] = index8.nnz / max(1, int(index8.n_visible.sum()))
    row[f"{p}_index_ms"] = timer(lambda: index_fn(precision=p))
    row[f"{p}_total_ms"] = timer(lambda: total_fn(precision=p))
    out16, out8 = total_fn().double(), total_fn(precision=p).double()
    row[f"{p}_rel_l2"] = float((out8 - out16).norm() / out16.norm())
    row[f"{p}_speedup"] = row["total_ms"] / row[f"{p}_total_ms"]


FP8_TRITON_NOTE = ("the FP8 sparse attention on the Triton kernel (AttnConfig.impl='triton', the default FP8 "
                   "kernel before the Gluon one, docs/fp8.md section 11): the same index and pre-pass, its "
                   "total against BF16's")


def _fp8_triton_columns(row: dict, total_fn, timer, head_dim: int, block_size: int) -> dict:
    """``fp bench --fp8`` where the default FP8 attention is the warp-specialised Gluon kernel (sm_90,
    d 64 / 128, key blocks of 128: ``AttnConfig.impl = "auto"``): the Triton FP8 kernel beside it
    (``tiles.get_config(..., variant="triton_fp8")``): ``fp8tri_total_ms``, ``fp8tri_speedup`` (BF16
    sparse total / it), ``fp8tri_rel_l2`` (its output against BF16's). Returns the row's note: what
    the columns are, or why they are absent (the default already ran the Triton kernel here, or the
    kernel's error: an optional column does not stop the run)."""
    from .impl.triton.host_fp8 import WS_BLOCK, WS_HEAD_DIMS
    from .impl.triton.tiles import get_config

    cc = torch.cuda.get_device_capability()
    if cc != (9, 0) or head_dim not in WS_HEAD_DIMS or block_size != WS_BLOCK:
        return {"fp8_triton": f"the fp8 columns ran the Triton kernel (the Gluon kernel, the default where it runs, "
                              f"needs sm_90, d {WS_HEAD_DIMS} and key blocks of {WS_BLOCK}; here sm_{cc[0]}{cc[1]}, "
                              f"d {head_dim}, blocks {block_size})"}
    kernels = get_config(head_dim, torch.bfloat16, block_size, precision="fp8", variant="triton_fp8")
    try:
        out16, out8 = total_fn().double(), total_fn(precision="fp8", kernels=kernels).double()
        row["fp8tri_total_ms"] = timer(lambda: total_fn(precision="fp8", kernels=kernels))
    except Exception as exc:  # an optional column: its failure is reported in the row, the run goes on
        return {"fp8_triton": f"the Triton FP8 kernel failed: {type(exc).__name__}: {exc}"[:300]}
    row["fp8tri_rel_l2"] = float((out8 - out16).norm() / out16.norm())
    row["fp8tri_speedup"] = row["total_ms"] / row["fp8tri_total_ms"]
    return {"fp8_triton": FP8_TRITON_NOTE}


def _fp8_dense_baseline(row, q, k_lin, v_lin, L, batch, hq, hkv, d, scale) -> dict:
    """FlashInfer's FP8 prefill (e4m3 K / V, per-tensor scales) as the FP8 dense baseline when it
    is installed (``fp8_flashinfer_ms``); else a note saying none is."""
    try:
        import flashinfer
    except ImportError:
        return {"fp8_dense": FP8_DENSE_NOTE}
    try:
        k = k_lin.view(batch, -1, hkv, d)[:, :L].reshape(-1, hkv, d)
        v = v_lin.view(batch, -1, hkv, d)[:, :L].reshape(-1, hkv, d)
        ks = float(k.abs().amax()) / 448.0
        vs = float(v.abs().amax()) / 448.0
        k8 = (k.float() / ks).to(torch.float8_e4m3fn)
        v8 = (v.float() / vs).to(torch.float8_e4m3fn)
        fn = lambda: flashinfer.single_prefill_with_kv_cache(q[:L], k8[:L], v8[:L], causal=True, sm_scale=scale,
                                                             scale_k=ks, scale_v=vs)
        fn()
        row["fp8_flashinfer_ms"] = time_ms(fn)
        return {}
    except Exception as exc:  # an installed FlashInfer without this entry point: say so in the row
        return {"fp8_dense": f"FlashInfer FP8 prefill failed: {type(exc).__name__}: {exc}"[:200]}


def _cpu_fp8_dense_note() -> str:
    """The FP8 dense baseline of a CPU run: FlashInfer's FP8 prefill is a GPU kernel."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return FP8_DENSE_NOTE
    return "FP8 dense baseline: FlashInfer's FP8 prefill runs on the GPU only"


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
                   repeats, int8qk: bool = False) -> list[dict]:
    """The CPU rows: the reference backend (index, attention, total) against two dense baselines
    measured in the same run, ``flashprefill.dense_attention`` (reference) and torch SDPA."""
    from . import api
    cpu = platform.processor() or platform.machine() or "CPU"
    rows = []
    for L in _lengths(lens):
        if L > CPU_MAX_LEN:
            raise ValueError(f"device='cpu' runs lengths up to {CPU_MAX_LEN} tokens (the reference is O(L^2)); got {L}")
        say(f"[bench] CPU reference: L={L} batch={batch} heads {heads_q}/{heads_kv} d={head_dim} {dtype}")
        row = {"device": "cpu", "gpu": None, "cpu": cpu, "label": CPU_LABEL, "backend": "reference", "L": L,
               "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
               "dtype": str(dtype).replace("torch.", ""), "page_size": page_size,
               "inputs": "synthetic sink/local/needle", "repeats": repeats,
               "config": {f: getattr(config, f) for f in config.field_names()}, "notes": {"cpu": CPU_LABEL}}
        if short_note(L, config):
            row["notes"]["min_sparse_len"] = short_note(L, config)
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
        if fp8:
            _fp8_columns(row, lambda **p: api.build_index(q, kc, vc, pt, sl, cu, **kw, **p),
                         lambda **p: api.flashprefill_attention(q, kc, vc, pt, sl, cu, **kw, **p),
                         lambda fn: cpu_time_ms(fn, repeats))
            row["fp8_dense_ref_ms"] = cpu_time_ms(lambda: api.dense_attention(
                q, kc, vc, pt, sl, cu, scale, plan=plan, backend="reference", precision="fp8"), repeats)
            row["notes"]["fp8_dense"] = _cpu_fp8_dense_note()
        if int8qk:
            _fp8_columns(row, lambda **p: api.build_index(q, kc, vc, pt, sl, cu, **kw, **p),
                         lambda **p: api.flashprefill_attention(q, kc, vc, pt, sl, cu, **kw, **p),
                         lambda fn: cpu_time_ms(fn, repeats), precision="int8qk")
        row["speedup_vs_dense_ref"] = row["dense_ref_ms"] / row["total_ms"]
        row["dense_flops"] = dense_causal_flops(L, L, head_dim, heads_q, batch)
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
                       baselines: bool = True, device: str = "cuda", repeats: int = CPU_REPEATS,
                       int8qk: bool = False) -> list[dict]:
    """Benchmark each length; one dict per length (the JSON rows). ``lens``: ints or strings such
    as ``"128k"``. ``dtype``: torch dtype or 'bf16'/'fp16'. ``progress``: optional callable(str).
    ``config``: the sparse settings (default ``SparseConfig()``), in every row as ``config``; a
    length below its ``min_sparse_len`` gets the note ``notes["min_sparse_len"]`` (``short_note``).
    ``fp8`` / ``int8qk``: also the sparse path in that precision (``fp8_*`` / ``int8qk_*`` columns).

    ``device="cuda"`` (default): the Triton operator vs the GPU dense baselines, CUDA-event medians.
    ``device="cpu"``: the reference backend at small lengths (<= ``CPU_MAX_LEN``), ``time.perf_counter``
    medians of ``repeats`` calls, against ``flashprefill.dense_attention`` (reference) and torch
    SDPA on the CPU; every row says "CPU reference, not representative" (``label``, ``notes``).

    Raises:
        ValueError: an unknown ``device``, or a CPU length above ``CPU_MAX_LEN``.
        RuntimeError: ``device="cuda"`` without a CUDA GPU.
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
                              baselines, repeats, int8qk)
    if not torch.cuda.is_available():
        raise RuntimeError("flashprefill.bench needs a CUDA GPU (device='cpu' runs a tiny reference instead)")
    from .impl.triton import host
    gpu = torch.cuda.get_device_name()
    rows = []
    for L in _lengths(lens):
        say(f"[bench] L={L} batch={batch} heads {heads_q}/{heads_kv} d={head_dim} {dtype}")
        row = {"gpu": gpu, "L": L, "batch": batch, "heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim,
               "dtype": str(dtype).replace("torch.", ""), "page_size": page_size, "inputs": "synthetic sink/local/needle",
               "config": {f: getattr(config, f) for f in config.field_names()}, "notes": {}}
        if short_note(L, config):
            row["notes"]["min_sparse_len"] = short_note(L, config)
        q, kc, vc, pt, sl, cu, k_lin, v_lin = synthetic_inputs(L, heads_q, heads_kv, head_dim, dtype, page_size, batch)
        scale = 1.0 / math.sqrt(head_dim)
        plan = make_plan(sl, cu, heads_q // heads_kv, config.block_size)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
        torch.cuda.synchronize()
        row["index_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["index_mib"] = index.nbytes() / 2**20
        row["density"] = index.nnz / max(1, int(index.n_visible.sum()))
        row["index_ms"] = time_ms(lambda: host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
        row["attn_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index))
        row["total_ms"] = time_ms(lambda: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan))
        row["dense_mode_ms"] = time_ms(lambda: host.dense_attention(q, kc, vc, pt, sl, cu, scale, plan))
        if fp8:
            _fp8_columns(row, lambda **p: host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, **p),
                         lambda **p: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, **p)[0], time_ms)
            row["fp8_dense_mode_ms"] = time_ms(lambda: host.dense_attention(q, kc, vc, pt, sl, cu, scale, plan,
                                                                            precision="fp8"))
            row["notes"].update(_fp8_triton_columns(
                row, lambda **p: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, **p)[0], time_ms,
                head_dim, config.block_size))
            row["notes"].update(_fp8_dense_baseline(row, q, k_lin, v_lin, L, batch, heads_q, heads_kv, head_dim,
                                                    scale))
        if int8qk:
            _fp8_columns(row, lambda **p: host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, **p),
                         lambda **p: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, **p)[0], time_ms,
                         precision="int8qk")
            row["int8qk_dense_mode_ms"] = time_ms(lambda: host.dense_attention(q, kc, vc, pt, sl, cu, scale, plan,
                                                                               precision="int8qk"))
        flops = dense_causal_flops(L, L, head_dim, heads_q, batch)
        row["dense_flops"] = flops
        row["total_tflops"] = flops / row["total_ms"] / 1e9          # effective: dense-equivalent FLOPs
        row["dense_mode_tflops"] = flops / row["dense_mode_ms"] / 1e9
        if baselines:
            res, notes = _dense_baselines(q, k_lin, v_lin, L, batch, heads_q, heads_kv, head_dim, scale)
            row.update(res)
            row["notes"].update(notes)
            for key in ("fa4_ms", "cudnn_ms", "fa2_ms"):
                if key in row:
                    row["speedup_vs_" + key[:-3]] = row[key] / row["total_ms"]
                    row[key[:-3] + "_tflops"] = flops / row[key] / 1e9
        rows.append(row)
        del q, kc, vc, k_lin, v_lin, index
        torch.cuda.empty_cache()
    return rows


TABLE_COLS = [("L", "L", "{:d}"), ("density", "density", "{:.1%}"), ("index_ms", "index ms", "{:.3f}"),
              ("attn_ms", "attn ms", "{:.3f}"), ("total_ms", "total ms", "{:.3f}"),
              ("total_tflops", "eff TFLOP/s", "{:.0f}"),
              ("index_mib", "idx MiB", "{:.1f}"), ("index_peak_mib", "peak MiB", "{:.1f}"),
              ("dense_mode_ms", "our dense ms", "{:.3f}"), ("fa4_ms", "FA4 ms", "{:.3f}"),
              ("fa4_tflops", "FA4 TFLOP/s", "{:.0f}"),
              ("cudnn_ms", "cuDNN ms", "{:.3f}"), ("fa2_ms", "FA2 ms", "{:.3f}"),
              ("speedup_vs_fa4", "x FA4", "{:.2f}"), ("speedup_vs_cudnn", "x cuDNN", "{:.2f}"),
              ("fp8_density", "fp8 density", "{:.1%}"), ("fp8_index_ms", "fp8 index ms", "{:.3f}"),
              ("fp8_total_ms", "fp8 total ms", "{:.3f}"), ("fp8_speedup", "x bf16", "{:.2f}"),
              ("fp8_rel_l2", "fp8 relL2", "{:.4f}"), ("fp8_dense_mode_ms", "fp8 our dense ms", "{:.3f}"),
              ("fp8_flashinfer_ms", "FI fp8 ms", "{:.3f}"),
              ("fp8tri_total_ms", "fp8 triton total ms", "{:.3f}"), ("fp8tri_speedup", "x bf16", "{:.2f}"),
              ("fp8tri_rel_l2", "fp8 triton relL2", "{:.4f}"),
              ("int8qk_density", "int8qk density", "{:.1%}"), ("int8qk_index_ms", "int8qk index ms", "{:.3f}"),
              ("int8qk_total_ms", "int8qk total ms", "{:.3f}"), ("int8qk_speedup", "x bf16", "{:.2f}"),
              ("int8qk_rel_l2", "int8qk relL2", "{:.4f}"), ("int8qk_dense_mode_ms", "int8qk our dense ms", "{:.3f}")]


def plain_table(rows: list[dict], cols, always: tuple[str, ...] = ("L",)) -> list[str]:
    """Fixed-width lines (header, then one per row; right-aligned, never truncated) of ``rows``.
    ``cols``: ``(key, title, format)`` each, ``format`` a ``str.format`` pattern or a callable of
    the value; a column no row has is left out unless its key is in ``always``; a missing or
    ``None`` value is ``-``."""
    cols = [c for c in cols if c[0] in always or any(r.get(c[0]) is not None for r in rows)]
    head = [c[1] for c in cols]

    def cell(fmt, value) -> str:
        if value is None:
            return "-"
        return fmt(value) if callable(fmt) else fmt.format(value)

    body = [[cell(c[2], r.get(c[0])) for c in cols] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w[i]) for i, h in enumerate(head))]
    lines += ["  ".join(x.rjust(w[i]) for i, x in enumerate(b)) for b in body]
    return lines


SUM_TOLERANCE = 0.01  # index ms + attn ms may differ from total ms by this share (rounding) before a note explains it


def format_table(rows: list[dict], config_name: str | None = None) -> str:
    """Plain-text table (fixed-width, no truncation) of ``run_operator_bench``'s rows, with notes.
    Density is a percentage. The CPU label is said once, in the header line (not again as a note).
    The second line says which sparse settings ran (``config_text`` of the rows' ``config``, after
    ``config_name``, e.g. ``"profile bf16-mass"``). Where ``index_ms + attn_ms`` differs from
    ``total_ms`` by more than ``SUM_TOLERANCE``, a note says why: the three are timed apart,
    ``total_ms`` being one whole call (index, then attention). Lengths below ``min_sparse_len``
    share one note."""
    if not rows:
        return "(no rows)"
    r = rows[0]
    config = "config: " + config_text(SparseConfig(**r["config"]), config_name)
    if r.get("device") == "cpu":
        lines = [f"{CPU_LABEL} of GPU speed: {r['cpu']}  batch {r['batch']}  heads {r['heads_q']}/{r['heads_kv']}  "
                 f"d {r['head_dim']}  {r['dtype']}  page {r['page_size']}  inputs: {r['inputs']}  "
                 f"median of {r['repeats']} calls", config]
        lines += plain_table(rows, CPU_COLS)
    else:
        lines = [f"{r['gpu']}  batch {r['batch']}  heads {r['heads_q']}/{r['heads_kv']}  d {r['head_dim']}  "
                 f"{r['dtype']}  page {r['page_size']}  inputs: {r['inputs']}", config]
        lines += plain_table(rows, TABLE_COLS)
    return "\n".join(lines + [f"note {line}" for line in table_notes(rows)])


def table_notes(rows: list[dict]) -> list[str]:
    """The notes under ``format_table`` (each printed after ``note ``), one line each: the lengths
    below ``min_sparse_len`` (one line for all), index + attention times that do not add up to the
    total (``SUM_TOLERANCE``), then every other row note once (``"fa4: skipped: ..."``); the CPU
    label is not one (the table's header says it). ``fp bench --json`` carries the same lines."""
    notes = {k: v for row in rows for k, v in (row.get("notes") or {}).items() if k not in ("cpu", "min_sparse_len")}
    return _short_notes(rows) + _sum_notes(rows) + [f"{k}: {v}" for k, v in notes.items()]


def _short_notes(rows: list[dict]) -> list[str]:
    """One note for every row below its ``min_sparse_len`` (``short_note``), naming the lengths."""
    short = [row for row in rows if "min_sparse_len" in (row.get("notes") or {})]
    if not short:
        return []
    lens = ", ".join(str(row["L"]) for row in short)
    msl = short[0]["config"]["min_sparse_len"]
    return [f"min_sparse_len: L={lens} < min_sparse_len {msl:,}: {SHORT_WHY}"]


def _sum_notes(rows: list[dict]) -> list[str]:
    """One note when a row's ``index_ms + attn_ms`` is off ``total_ms`` by more than ``SUM_TOLERANCE``:
    e.g. 67.3 + 1395.8 = 1463.1 against a total of 1405.2 (the columns are separate timings)."""
    off = [r for r in rows if all(k in r for k in ("index_ms", "attn_ms", "total_ms"))
           and abs(r["index_ms"] + r["attn_ms"] - r["total_ms"]) > SUM_TOLERANCE * r["total_ms"]]
    if not off:
        return []
    what = "; ".join(f"L={r['L']}: {r['index_ms']:.1f} + {r['attn_ms']:.1f} = {r['index_ms'] + r['attn_ms']:.1f} "
                     f"vs total {r['total_ms']:.1f}" for r in off)
    return [f"timing: index ms, attn ms and total ms are three separate timings (total ms: one whole call, "
            f"index then attention), so they need not add up; the difference is timing noise "
            f"(median of a few calls) plus the work a whole call adds or shares ({what})"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashprefill.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="4k,8k,32k,128k", help="comma list: 4k, 128k, 131072")
    ap.add_argument("--heads", default="32/8", help="Hq/Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--fp8", action="store_true",
                    help="also run the FP8 e4m3 sparse path (and FP8 dense baselines) next to BF16")
    ap.add_argument("--int8qk", action="store_true",
                    help="also run the int8qk sparse path (int8 Q K^T, e4m3 P V; docs/fp8.md section 10) next to BF16")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a tiny reference run (<= 8k tokens), NOT representative of GPU speed")
    a = ap.parse_args(argv)
    try:
        lens = parse_lengths(a.lens)
    except ValueError as exc:
        ap.error(f"--lens: {exc}")
    hq, hkv = (int(x) for x in a.heads.split("/"))
    rows = run_operator_bench(lens, hq, hkv, a.head_dim, a.dtype, fp8=a.fp8, batch=a.batch,
                              page_size=a.page_size, baselines=not a.no_baselines, device=a.device, int8qk=a.int8qk)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(format_table(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
