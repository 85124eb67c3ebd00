"""Triton (CUDA) implementation of the ``flashprefill`` operator: the host side of the kernels.

Launchers, allocations and the one host sync. Same three functions and signatures as
``impl/reference.py`` (``docs/layout.md`` "Implementations"), plus ``attention`` (both calls in
one). Inputs are validated by ``flashprefill.api``; here we only refuse what the kernels cannot
take (head_dim not in 64/128/256, dtype not bf16/fp16) with a ``ValueError``.

Kernel tiles: every public function takes ``kernels`` (a ``tiles.KernelConfig``; None:
``tiles.get_config`` of q's head dim, dtype and the config's block size) and passes its parts
down to the launchers as arguments. Nothing is read from a module global or the environment.

Host syncs: none, except one in ``build_index`` to read ``nnz`` (the CSR total) before allocating
``col_idx``; ``attention`` makes it after the attention's launch (the CSR in a buffer sized from the
plan's lengths), so the GPU never waits for the host between index and attention. The ``plan``
carries every host length the launches need.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton

from ... import quant
from ...config import EIGHT_BIT_PRECISIONS, PRECISIONS, TRITON_DTYPES, TRITON_HEAD_DIMS, SparseConfig
from ...index import BlockIndex
from ...plan import BatchPlan, visible_blocks
from . import attention_kernels as ak
from . import host_fp8
from . import index_kernels as ik
from . import quant_kernels as qk
from .tiles import AttnConfig, IndexConfig, KernelConfig, get_config

# The correction reads the float32 means directly up to this KV length (no conversion launches);
# beyond it converts them to q's dtype once (half the L2 traffic of its loop). Only for an index
# without 16-bit copies (the reference's): the Triton index always writes them.
MEANS_DIRECT_MAX_KV = 32768
# ``attention`` launches the attention before the index's nnz sync when the CSR bound (4 bytes per
# causally visible (segment, block) pair, quadratic in the length: 64 MiB at 128K with 8 KV heads,
# 1 GiB at 512K) fits this many bytes; above it, the sync first and a CSR of exactly nnz entries.
ONE_CALL_CSR_MAX_BYTES = 256 * 2**20


def kv_length_thresholds() -> tuple[int, ...]:
    """KV lengths (tokens) at which the launchers switch code paths, so that a warm-up must run on
    each side of every entry to compile every kernel variant a request can hit: the mean
    correction's means dtype changes above ``MEANS_DIRECT_MAX_KV`` (another ``MC_STAGES``)."""
    return (MEANS_DIRECT_MAX_KV + 1,)

# Memoised device facts (pure functions of the device and of a compiled kernel, never settings):
# SM counts, and the resident programs per SM of each compiled selection kernel, measured from the
# kernel after its first launch (the persistent grid must not exceed one wave).
_SM_COUNT: dict[int, int] = {}
_SELECT_OCC: dict[tuple, int] = {}


def _check(q: torch.Tensor) -> None:
    d = q.shape[-1]
    if d not in TRITON_HEAD_DIMS:
        raise ValueError(
            f"triton backend: q [total_q, Hq, d] has d = {d}; the kernels take d in {TRITON_HEAD_DIMS}")
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"triton backend: q must be bfloat16 or float16 [total_q, Hq, d], got {q.dtype}")


def _kernels(q: torch.Tensor, block_size: int, kernels: KernelConfig | None, precision: str = "bf16") -> KernelConfig:
    _check(q)
    return kernels if kernels is not None else get_config(q.shape[-1], q.dtype, block_size, precision=precision)


def _is_fp8(precision: str) -> bool:
    """Whether ``precision`` runs the 8-bit kernels ("fp8", "int8qk"); raises on an unknown one."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision in EIGHT_BIT_PRECISIONS


def _descale_means(mean: torch.Tensor, descale, plan: BatchPlan) -> torch.Tensor:
    """Means of an e4m3 cache's codes -> means of ``code * descale`` (float32 ``[n_blocks, Hkv, d]``,
    in place)."""
    grid = qk.descale_grid(descale, plan.batch, mean.shape[1])
    return mean.mul_(grid[qk.block_requests(plan, mean.device)][:, :, None])


def _n_programs(device: torch.device, n_segments: int, per_sm: int) -> int:
    if device.type != "cuda":           # TRITON_INTERPRET on CPU tensors
        return max(1, min(n_segments, 4))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(1, min(n_segments, _SM_COUNT[idx] * per_sm))


def _occupancy(kernel, device: torch.device) -> int | None:
    """Programs of a compiled Triton kernel resident per SM: the least of the register, shared
    memory and thread limits (registers allocated per warp in units of 256). None if unknown."""
    try:
        regs = int(kernel.n_regs)
        smem = int(kernel.metadata.shared)
        warps = int(kernel.metadata.num_warps)
        props = torch.cuda.get_device_properties(device)
    except Exception:
        return None
    if regs <= 0 or warps <= 0:
        return None
    regs_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
    threads_sm = int(getattr(props, "max_threads_per_multi_processor", 2048))
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = regs_sm // (per_warp * warps)
    by_smem = smem_sm // (smem + 1024) if smem else threads_sm
    by_threads = threads_sm // (32 * warps)
    return max(1, min(by_regs, by_smem, by_threads))


def _scale(softmax_scale, d: int) -> float:
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


# --------------------------------------------------------------------------------------------
# Index stage


def _alloc_means(cache, plan: BatchPlan, lowp_dtype=None):
    """Empty float32 ``[n_blocks, Hkv, d]`` means of one cache and, when ``lowp_dtype`` is given,
    their 16-bit copy (else ``None``)."""
    _, _, hkv, d = cache.shape
    mean = torch.empty(plan.n_blocks, hkv, d, dtype=torch.float32, device=cache.device)
    lowp = torch.empty(plan.n_blocks, hkv, d, dtype=lowp_dtype, device=cache.device) if lowp_dtype else None
    return mean, lowp


def launch_means(cache, page_table, seq_lens, plan: BatchPlan, block_size: int, tiles: IndexConfig, out,
                 amax: torch.Tensor | None = None):
    """Block means of one cache (K or V) into ``out = (mean, lowp)`` (``_alloc_means``): float32
    ``[n_blocks, Hkv, d]`` and, when ``lowp`` is not None, the same rounded to its 16-bit dtype.
    Grid ``(max blocks per request, Hkv, batch)``: no per-block request table. ``amax``: int32
    ``[batch, Hkv]``, zeroed: also ``max |x|`` per (request, KV head) as float32 bits (the FP8
    scales, ``IndexConfig.fused_amax``). Returns ``out``."""
    _, page_size, hkv, d = cache.shape
    mean, lowp = out
    max_nb = plan.max_blocks(block_size)
    extra = {} if amax is None else dict(amax=amax, AMAX=True)
    if plan.n_blocks and max_nb:
        ik._block_means_kernel[(max_nb, hkv, plan.batch)](
            cache, page_table, seq_lens, plan.block_ptr, mean, lowp if lowp is not None else mean,
            cache.stride(0), cache.stride(1), cache.stride(2),
            page_table.stride(0), mean.stride(0), mean.stride(1),
            HEAD_DIM=d, BLOCK_SIZE=block_size, TOKENS=min(tiles.means_tokens, block_size), PAGE_SIZE=page_size,
            WRITE_LOWP=lowp is not None, num_warps=tiles.means_warps, **extra,
        )
    return mean, lowp


def block_means(k_cache, v_cache, page_table, seq_lens, plan: BatchPlan, block_size: int,
                tiles: IndexConfig | None = None):
    """``(k_mean, v_mean)`` float32 ``[n_blocks, Hkv, d]`` over valid tokens (``docs/method.md``
    section 3.1). ``tiles``: default ``IndexConfig()``."""
    tiles = tiles or IndexConfig()
    return (launch_means(k_cache, page_table, seq_lens, plan, block_size, tiles, _alloc_means(k_cache, plan))[0],
            launch_means(v_cache, page_table, seq_lens, plan, block_size, tiles, _alloc_means(v_cache, plan))[0])


def _queue_nnz_copy(row_ptr: torch.Tensor):
    """Queue the copy of ``row_ptr[-1]`` (``nnz``) to the host now; return a function that
    waits for that copy only (not for work queued after it) and returns ``nnz`` as an int."""
    if row_ptr.device.type != "cuda":
        return lambda: int(row_ptr[-1].item())
    host = torch.empty(1, dtype=row_ptr.dtype, pin_memory=True)
    host.copy_(row_ptr[-1:], non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(row_ptr.device))   # the stream the copy went to

    def wait() -> int:
        done.synchronize()
        return int(host[0])
    return wait


def _launch_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
                  softmax_scale, plan: BatchPlan, *, kernels: KernelConfig | None = None,
                  precision: str = "bf16", k_descale=None, v_descale=None) -> tuple:
    """``build_index`` up to its one host sync: every launch but the expand. Returns ``(partial,
    nnz_ready, expand)``: ``partial`` the ``BlockIndex`` with an empty ``col_idx`` (its other tensors
    queued on the stream), ``nnz_ready()`` waits for ``nnz`` (None without segments) and
    ``expand(col_idx)`` launches the bitmask-to-CSR expand into any int32 buffer of at least ``nnz``
    entries (it reads ``row_ptr`` on the device: no sync). Arguments as ``build_index``."""
    fp8 = _is_fp8(precision)
    int8 = precision == "int8qk"
    e4m3 = k_cache.dtype == quant.E4M3
    chosen = _kernels(q, config.block_size, kernels, precision)
    tiles = chosen.index
    B = config.block_size
    if plan.block_size != B:
        raise ValueError(f"plan.block_size {plan.block_size} != config.block_size {B}")
    d = q.shape[2]
    hkv = k_cache.shape[2]
    g = plan.group_size
    dev = q.device
    scale = _scale(softmax_scale, d)
    block_j = tiles.select_block_j
    # Every allocation and host computation first, then the launches back to back: the GPU runs
    # the K means (0.01-0.1 ms) while the host launches the selection, instead of idling. The
    # means kernel also writes 16-bit copies of k̄ / v̄ (2 MiB each at 128K): k̄ for the one-dot
    # scores, both for the mean correction (so nothing converts them after the nnz sync).
    n_tiles = plan.n_tiles
    n_seg = hkv * n_tiles
    max_nb = plan.max_blocks(B)
    n_words = max(1, -(-max_nb // ik.BITS_PER_WORD))
    k_out = _alloc_means(k_cache, plan, None if fp8 else q.dtype)
    v_out = _alloc_means(v_cache, plan, None if fp8 else q.dtype)
    # the select kernel writes row_ptr[0] = 0 and the segment counts; row_ptr[1:] = cumsum(counts)
    row_ptr = torch.empty(n_seg + 1, dtype=torch.int32, device=dev)
    counts = torch.empty(n_seg, dtype=torch.int32, device=dev)
    n_visible = torch.empty(n_seg, dtype=torch.int32, device=dev)
    if n_seg:
        bits = torch.empty(n_seg, n_words, dtype=torch.int32, device=dev)
        alpha = float(config.alpha)
        prunable, mass = config.threshold_max == "prunable", config.block_score == "mass"
        occ_key = (dev, d, q.dtype, g, B, plan.tile_rows, tiles, alpha == 0.0, fp8, prunable, mass, int8)
        n_prog = _n_programs(dev, n_seg, _SELECT_OCC.get(occ_key, tiles.select_programs_per_sm))
        scratch_cols = max(block_j, triton.cdiv(max_nb, block_j) * block_j)
        scratch = torch.empty(n_prog, scratch_cols, dtype=torch.float32, device=dev)
        log2_alpha = math.log2(alpha) if alpha > 0 else 0.0
    # FP8 of 16-bit caches with fused_amax: the means kernels also write max |K|, max |V| per
    # (request, KV head) (int32 float bits), so the pre-pass needs no amax launch of its own
    amax = (torch.zeros(2, plan.batch, hkv, dtype=torch.int32, device=dev)
            if fp8 and not e4m3 and tiles.fused_amax else None)
    k_mean, k_lowp = launch_means(k_cache, page_table, seq_lens, plan, B, tiles, k_out,
                                  None if amax is None else amax[0])
    k_scale = k_mean                    # not read by the 16-bit selection
    kv_amax = None if amax is None else amax.view(torch.float32)    # float32 [2, batch, Hkv] once written
    if e4m3:
        _descale_means(k_mean, k_descale, plan)
    if fp8:
        if e4m3:
            k_scale = qk.descale_grid(k_descale, plan.batch, hkv)
            k_inv = 1.0 / k_scale
        elif amax is not None:
            k_scale, k_inv = (quant.int8_scales if int8 else quant.amax_scales)(kv_amax[0])
        else:
            # one amax launch (K and V), kept for the pre-pass below, which would otherwise launch its own
            kv_amax = qk.kv_amax(k_cache, v_cache, page_table, seq_lens, plan)
            scale2, inv2 = qk.kv_scales_for(kv_amax, int8)
            k_scale, k_inv = scale2[0].contiguous(), inv2[0]
        quantize = quant.quantize_int8 if int8 else quant.quantize
        k_lowp = quantize(k_mean, k_inv[qk.block_requests(plan, dev)][:, :, None])   # k_mean8
    if n_seg:
        compiled = ik._select_kernel[(n_prog,)](
            q, k_mean, k_lowp, plan.tile_request, plan.tile_local,
            cu_seqlens_q, seq_lens, plan.block_ptr,
            scratch, counts, row_ptr, n_visible, bits,
            q.stride(0), q.stride(1), k_mean.stride(0), k_mean.stride(1), scratch.stride(0), n_words,
            n_tiles, n_seg, n_prog, scale * ik.LOG2E, log2_alpha,
            config.sink_tokens, config.window_tokens, config.dense_tail_tokens, config.min_sparse_len, k_scale,
            GROUP=g, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_SIZE=B, BLOCK_J=block_j,
            KEEP_ALL_SCORED=alpha == 0.0, FP8=fp8, HW_CVT=fp8 and tiles.hw_cvt and q.is_cuda, MAX_PRUNABLE=prunable,
            ROW_MASS=mass, QK_INT8=int8,
            num_warps=tiles.select_num_warps, num_stages=tiles.select_num_stages,
        )
        if dev.type == "cuda" and occ_key not in _SELECT_OCC:
            occ = _occupancy(compiled, dev)
            _SELECT_OCC[occ_key] = occ if occ is not None else tiles.select_programs_per_sm
        del scratch
        torch.cumsum(counts, 0, out=row_ptr[1:])
    else:
        row_ptr.zero_()
    # The one host sync, for nnz: its copy and event are queued first, then V's means (not needed
    # by the selection), so the GPU computes them while the host waits and launches the expand.
    nnz_ready = _queue_nnz_copy(row_ptr) if n_seg else None
    v_mean, v_lowp = launch_means(v_cache, page_table, seq_lens, plan, B, tiles, v_out,
                                  None if amax is None else amax[1])
    if e4m3:
        _descale_means(v_mean, v_descale, plan)
    fp8_ops = None
    if fp8:
        k_lowp = None                   # the e4m3 means are the attention's to make (with V's scale)
        if n_seg:
            # the attention's pre-pass and mean codes, queued before the sync: the GPU runs them while
            # the host waits for nnz, so only the expand and the attention's launch follow the sync
            fp8_ops = host_fp8.prepare(
                q, k_cache, v_cache, page_table, seq_lens, plan, chosen.attn, k_mean=k_mean, v_mean=v_mean,
                bits=bits, row_ptr=row_ptr, mean_correction=bool(config.mean_correction), block_size=B,
                k_descale=k_descale, v_descale=v_descale, amax=kv_amax,
                hw_cvt=tiles.hw_cvt and q.is_cuda, k_int8=int8)
    # owned copies of the plan's pointers, made before the sync so they overlap the GPU work
    block_ptr, tile_ptr = plan.block_ptr.clone(), plan.tile_ptr.clone()

    def expand(col_idx: torch.Tensor) -> None:
        if n_seg:
            ik._expand_kernel[(n_seg,)](bits, row_ptr, n_visible, col_idx, n_words, col_idx.numel(),
                                        WORDS=tiles.expand_words, num_warps=4)

    partial = BlockIndex(
        row_ptr=row_ptr,
        col_idx=torch.empty(0, dtype=torch.int32, device=dev),
        k_mean=k_mean,
        v_mean=v_mean,
        block_ptr=block_ptr,
        tile_ptr=tile_ptr,
        n_visible=n_visible,
        block_size=B,
        group_size=g,
        tile_rows=plan.tile_rows,
        k_mean_lowp=k_lowp,
        v_mean_lowp=v_lowp,
        sel_bits=bits if n_seg else None,
        kv_amax=None if amax is None else amax.view(torch.float32),
        fp8_operands=fp8_ops,
    )
    return partial, nnz_ready, expand


def build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
                softmax_scale, plan: BatchPlan, *, kernels: KernelConfig | None = None,
                precision: str = "bf16", k_descale=None, v_descale=None) -> BlockIndex:
    """Block means, selection and CSR of a batch (``docs/method.md`` sections 3.1-3.6) on the GPU.

    Memory: the index tensors (``k_mean``/``v_mean`` ``2 x n_blocks x Hkv x d x 4`` bytes, their
    16-bit copies half that, CSR ``4 x (n_segments + 1 + nnz)`` bytes, the selection bitmask
    ``sel_bits`` ``n_segments x ceil(max_blocks / 32)`` int32 that the mean correction reads)
    plus, during the call only, a scratch of ``n_programs x max_blocks`` float32 (at 128K, 32/8
    heads, d 128: 8 + 4 MiB means, 4 MiB bitmask, 3 MiB CSR, 2 MiB scratch). At precision "fp8" /
    "int8qk" the index also holds the attention's operands (``fp8_operands``: the K and V codes, one
    byte per cached K or V element, 256 MiB at 128K with 8 KV heads of d 128, while the index
    lives; ``attention`` returns its index without them).

    One host sync: ``row_ptr[-1]`` (``nnz``) to size ``col_idx``; it waits for the selection
    only, while the GPU computes the value means.

    ``precision="fp8"`` (``docs/fp8.md``): the selection scores e4m3 Q tiles against the e4m3 key
    means (K's per (request, KV head) scale: one ``quant_kernels.kv_amax_scales`` launch, or the
    descales of e4m3 caches ``k_cache`` / ``v_cache`` with ``k_descale`` / ``v_descale``); the
    index holds float32 means only (no 16-bit copies). ``tiles.fused_amax`` (16-bit caches): the
    block-means kernels also write ``max |K|`` / ``max |V|`` per (request, KV head) into
    ``BlockIndex.kv_amax``: K's scale without a separate launch, and the attention's pre-pass
    (``sparse_attention``) skips its own amax launch. ``tiles.hw_cvt``: the selection's Q-tile
    codes (and, in ``sparse_attention``, the pre-pass's K / V codes) by the hardware cast.
    ``precision="int8qk"`` (``docs/fp8.md`` section 10, 16-bit caches): the same with int8 Q tiles
    and int8 key means (``amax / 127`` scales), the selection's ``QK_INT8`` mode.

    Raises:
        ValueError: ``plan.block_size != config.block_size``, or a head dim / dtype the kernels
            do not take.
    """
    return _finish_index(*_launch_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config,
                                        softmax_scale, plan, kernels=kernels, precision=precision,
                                        k_descale=k_descale, v_descale=v_descale))


def _finish_index(partial: BlockIndex, nnz_ready, expand) -> BlockIndex:
    """``_launch_index``'s result made whole: the wait for ``nnz`` (none without segments), a CSR of
    exactly ``nnz`` entries and its expand."""
    nnz = nnz_ready() if nnz_ready is not None else 0
    col_idx = torch.empty(nnz, dtype=torch.int32, device=partial.row_ptr.device)
    expand(col_idx)
    return dataclasses.replace(partial, col_idx=col_idx)


# --------------------------------------------------------------------------------------------
# Attention


def attention_programs(plan: BatchPlan, n_kv_heads: int, tiles: AttnConfig) -> int:
    """Programs (grid size) of one ``_attn_fwd`` launch for ``plan``: one per (KV head, tile,
    ``block_m``-row sub-tile)."""
    return plan.n_tiles * (plan.tile_rows // tiles.block_m) * n_kv_heads


def launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, plan: BatchPlan,
                     tiles: AttnConfig, *, sparse: bool, mean_correction: bool, block_size: int,
                     row_ptr=None, col_idx=None, k_mean=None, v_mean=None, sel_bits=None,
                     timing: torch.Tensor | None = None):
    """Launch ``_attn_fwd`` on the current stream (no host sync); returns ``(out, lse)``.

    ``out`` ``[total_q, Hq, d]`` q's dtype, ``lse`` ``[total_q, Hq]`` float32 (natural log).
    ``k_mean`` / ``v_mean``: ``[n_blocks, Hkv, d]`` float32 or q's dtype (only read with the
    correction). ``sel_bits``: int32 ``[n_segments, n_words]`` selection bitmask
    (``BlockIndex.sel_bits``); without it the correction folds every candidate in and takes the
    selected ones out again. ``timing`` (lab only, ``scripts/lab/``): int64 ``[n_programs, 8]``
    (``attention_programs``) receiving each program's phase timestamps (ns, ``%globaltimer``),
    else None (every product launch).

    Raises:
        ValueError: ``timing`` of the wrong shape, or (without ``sel_bits``) block offsets of the
            means that overflow 32 bits.
    """
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    page_size = k_cache.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if plan.n_tiles == 0 or total_q == 0:
        return out, lse
    if not sparse:
        row_ptr = col_idx = plan.tile_ptr      # unused placeholders (dense mode)
    if k_mean is None:
        k_mean = v_mean = q.new_zeros(1, hkv, d)
    mc_stages = tiles.mc_stages or tiles.num_stages
    if k_mean.element_size() == 4:
        # float32 means (short requests: no 16-bit copies) are twice the bytes per stage: 4 stages
        # of 64 x d float32 K and V means do not fit next to the K/V ring (sm_90: 227 KiB)
        mc_stages = min(mc_stages, 2)
    per_head = plan.n_tiles * (plan.tile_rows // tiles.block_m)
    grid = (per_head * hkv,)                 # = attention_programs(...)
    bits = sel_bits is not None and sparse and mean_correction
    if timing is not None and (timing.shape != (grid[0], 8) or timing.dtype != torch.int64
                               or not timing.is_contiguous()):
        raise ValueError(f"timing must be a contiguous int64 [{grid[0]}, 8] (one row per program), got "
                         f"{timing.dtype} {list(timing.shape)} with strides {timing.stride()}")
    if sparse and mean_correction and not bits:
        # the fallback addresses a selected block's means as (32-bit block id) x row stride
        max_nb = plan.max_blocks(block_size)
        if max_nb * k_mean.stride(0) >= 2**31:
            raise ValueError(
                f"mean correction without a selection bitmask: {max_nb} key blocks x means row stride "
                f"{k_mean.stride(0)} overflows 32-bit offsets; pass an index with sel_bits (built by the "
                "Triton backend)")
    ak._attn_fwd[grid](
        q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, plan.tile_request, plan.tile_local,
        plan.block_ptr, row_ptr, col_idx, k_mean, v_mean, sel_bits if bits else row_ptr,
        timing if timing is not None else lse, out, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0), k_mean.stride(0), k_mean.stride(1), sel_bits.shape[1] if bits else 0,
        plan.n_tiles, 0, per_head, hkv, float(softmax_scale) * ak.LOG2E,
        GROUP=plan.group_size, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, BLOCK_U=tiles.block_u,
        PAGE_SIZE=page_size, SPARSE=sparse, MEAN_CORR=mean_correction, MC_BITS=bits,
        MAIN_STAGES=tiles.num_stages, MC_STAGES=mc_stages, PAIR_SOFTMAX=tiles.pair_softmax,
        TIMING=timing is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, lse


def _correction_means(q, plan: BatchPlan, index: BlockIndex):
    """The mean keys / values the correction reads: the 16-bit copies when the index has them
    in q's dtype, else the float32 means (short batches) or 16-bit conversions (long ones)."""
    lowp = (index.k_mean_lowp, index.v_mean_lowp)
    if all(t is not None and t.dtype == q.dtype for t in lowp):
        return lowp                         # rounded by the means kernel, before the nnz sync
    if plan.max_kv_len <= MEANS_DIRECT_MAX_KV:
        # short: the kernel reads the float32 means and rounds them itself (saves two
        # conversion launches + allocations per call)
        return index.k_mean, index.v_mean
    # long: 16-bit copies halve the correction loop's L2 traffic (every tile re-reads the means
    # of all its pruned blocks: ~8.6 GB in bf16 at 128K)
    return index.k_mean.to(q.dtype), index.v_mean.to(q.dtype)


def _check_fp8_impl(q, tiles: AttnConfig, precision: str, plan: BatchPlan, block_size: int) -> None:
    """``impl="gluon_ws"`` at precision "fp8" on inputs its kernel cannot run: the ``ValueError``
    (``host_fp8.ws_error``) before the index or the pre-pass does any work. No host sync."""
    if precision == "fp8" and tiles.impl == "gluon_ws":
        why = host_fp8.ws_unsupported(q, quant.E4M3, plan, block_size)
        if why:
            raise ValueError(host_fp8.ws_error(why))


def sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
                     softmax_scale, plan: BatchPlan, index: BlockIndex, *, kernels: KernelConfig | None = None,
                     timing: torch.Tensor | None = None, precision: str = "bf16", k_descale=None, v_descale=None):
    """Block-sparse attention with mean correction (``docs/method.md`` section 4). No host sync.

    ``timing``: see ``launch_attention`` (lab only). ``precision="fp8"``: the e4m3 kernel
    (``host_fp8``, ``docs/fp8.md``) after the quantisation pre-pass (or on e4m3 caches with
    ``k_descale`` / ``v_descale``); no ``timing``.

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, natural log)``.
    """
    chosen = _kernels(q, index.block_size, kernels, precision)
    tiles = chosen.attn
    scale = _scale(softmax_scale, q.shape[2])
    mc = bool(config.mean_correction)
    if _is_fp8(precision):
        _check_fp8_impl(q, tiles, precision, plan, index.block_size)
        k_int8 = precision == "int8qk"
        ops = index.fp8_operands
        sources = (k_cache, v_cache, k_descale, v_descale, index.k_mean, index.v_mean)
        if not (isinstance(ops, host_fp8.Fp8Operands)
                and ops.matches(ws=host_fp8.runs_ws(q, ops.kv.k8.dtype, plan, tiles, index.block_size),
                                mean_correction=mc, tiles=tiles, k_int8=k_int8, sources=sources, bits=index.sel_bits)):
            bits = host_fp8.mean_bits(index, plan) if mc and plan.n_tiles else None
            ops = host_fp8.prepare(q, k_cache, v_cache, page_table, seq_lens, plan, tiles, k_mean=index.k_mean,
                                   v_mean=index.v_mean, bits=bits, row_ptr=index.row_ptr, mean_correction=mc,
                                   block_size=index.block_size, k_descale=k_descale, v_descale=v_descale,
                                   amax=index.kv_amax, hw_cvt=chosen.index.hw_cvt, k_int8=k_int8)
        return host_fp8.launch_attention_fp8(q, ops.kv, seq_lens, cu_seqlens_q, scale, plan, tiles, sparse=True,
                                             mean_correction=mc, block_size=index.block_size, index=index,
                                             means=ops.means)
    km, vm = _correction_means(q, plan, index) if mc else (None, None)
    return launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan, tiles,
                            sparse=True, mean_correction=mc, block_size=index.block_size,
                            row_ptr=index.row_ptr, col_idx=index.col_idx, k_mean=km, v_mean=vm,
                            sel_bits=index.sel_bits, timing=timing)


def attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
              softmax_scale, plan: BatchPlan, *, kernels: KernelConfig | None = None,
              precision: str = "bf16", k_descale=None, v_descale=None):
    """``build_index`` + ``sparse_attention`` with one ``KernelConfig``, the attention launched before
    the index's one host sync: the expand writes the CSR into a buffer of the largest ``nnz`` the
    plan allows (``Hkv x plan.visible_blocks``, from host lengths: 4 bytes per causally visible
    (segment, block) pair, 64 MiB at 128K with 32 / 8 heads), the attention reads it, and only then
    does the host wait for ``nnz`` and copy the ``nnz`` entries out (queued after the attention), so
    the GPU never waits for the host between index and attention (``docs/benchmarks.md``, twentieth
    session). Above ``ONE_CALL_CSR_MAX_BYTES`` of bound (~256K tokens with 8 KV heads) it waits
    first, as the two calls do. Same results as the two calls, bit for bit.

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, BlockIndex)``; the index
    without ``fp8_operands`` (the attention has read them).
    """
    kernels = _kernels(q, config.block_size, kernels, precision)
    _check_fp8_impl(q, kernels.attn, precision, plan, config.block_size)
    extra = dict(precision=precision, k_descale=k_descale, v_descale=v_descale)
    partial, nnz_ready, expand = _launch_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config,
                                               softmax_scale, plan, kernels=kernels, **extra)
    bound = k_cache.shape[2] * sum(visible_blocks(plan)) if nnz_ready is not None else 0
    early = nnz_ready is not None and 4 * bound <= ONE_CALL_CSR_MAX_BYTES
    if early:                            # the attention on the bound-sized CSR, then the wait
        csr = torch.empty(bound, dtype=torch.int32, device=q.device)
        expand(csr)
        index = dataclasses.replace(partial, col_idx=csr)
    else:                                # no segments (nothing to wait for), or a CSR bound too large
        index = _finish_index(partial, nnz_ready, expand)
    out, lse = sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale,
                                plan, index, kernels=kernels, **extra)
    # the returned index: exactly nnz CSR entries, and without the FP8 codes (used up; 256 MiB at 128K)
    col_idx = csr[:nnz_ready()].clone() if early else index.col_idx
    return out, lse, dataclasses.replace(index, col_idx=col_idx, fp8_operands=None)


def dense_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, plan: BatchPlan,
                    *, kernels: KernelConfig | None = None, precision: str = "bf16", k_descale=None, v_descale=None):
    """Dense causal attention (bottom-right aligned) over the paged KV: the same kernel, all
    causally visible blocks, no correction. No host sync.

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, natural log)``.
    """
    tiles = _kernels(q, plan.block_size, kernels, precision).attn
    scale = _scale(softmax_scale, q.shape[2])
    if _is_fp8(precision):
        kv = host_fp8.kv_operands(k_cache, v_cache, page_table, seq_lens, plan, k_descale, v_descale,
                                  k_int8=precision == "int8qk")
        return host_fp8.launch_attention_fp8(q, kv, seq_lens, cu_seqlens_q, scale, plan, tiles, sparse=False,
                                             mean_correction=False, block_size=plan.block_size)
    return launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan, tiles,
                            sparse=False, mean_correction=False, block_size=plan.block_size)

