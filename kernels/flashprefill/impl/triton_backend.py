"""Triton (CUDA) implementation of the ``flashprefill`` operator: host side of the kernels.

Same three functions and signatures as ``impl/reference.py`` (``docs/layout.md``
"Implementations"). Inputs are validated by ``flashprefill.api``; here we only refuse what the
kernels cannot take (head_dim not in 64/128/256, dtype not bf16/fp16) with a ``ValueError``.

Host syncs: none, except one in ``build_index`` to read ``nnz`` (the CSR total) before allocating
``col_idx``. The ``plan`` carries every host length the launches need.
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Callable

import torch
import triton

from ..config import INDEX_VARIANTS, SparseConfig
from ..index import BlockIndex
from ..plan import BatchPlan, dense_tail_start
from . import triton_index as ti
from .triton_attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, launch_attention

# Selection kernel tiles (H200): BLOCK_J mean keys scored per dot (the M side of the transposed
# product k̄ qᵀ: 64 = one warpgroup's wgmma M); programs per SM of the persistent selection grid =
# its occupancy (scripts/compile_sm90.py, Triton 3.6: 4 warps, 195 registers, 48 KiB smem -> 2
# resident per SM; more would queue behind the first wave). SELECT_PROGRAMS_PER_SM is the first
# call's guess; later calls use the occupancy of the compiled kernel (``_occupancy``).
SELECT_BLOCK_J = 64
SELECT_PROGRAMS_PER_SM = 2
SELECT_NUM_WARPS = 4
SELECT_NUM_STAGES = 2
SELECT_PIPE_STAGES = 0           # > 0: the scoring loop pipelined by Triton this deep (INDEX_VARIANTS)
EXPAND_WORDS = 8                 # 256 blocks per expand step
MEANS_DIRECT_MAX_KV = 32768      # sparse_attention reads the float32 means directly up to this Lk
TAIL_SPLIT_MIN_KV = 16384        # ``attention`` runs the dense-tail tiles on a side stream from this Lk
MEANS_TOKENS = 64                # tokens summed per step of the block-means kernel (one cache per
MEANS_WARPS = 4                  # launch: 64 x d 16-bit loads in flight, as 32 of K + 32 of V before)

# EXACT_SCORES: ℓ = τ q·k̄ from k̄ split hi/lo (two 16-bit dots, ~fp32). False: one dot on k̄
# rounded to q's dtype (half the index FLOPs and k̄ bytes; threshold ties vs the float32 reference
# measured well under the 1% the tests allow: docs/kernel-notes.md).
EXACT_SCORES = False

_SM_COUNT: dict[int, int] = {}


@contextlib.contextmanager
def index_variant(name: str):
    """Run the index stage with ``INDEX_VARIANTS[name]`` (module constants of this backend, e.g.
    ``MEANS_TOKENS``) inside the block; the previous values come back on exit, also on errors.

    Raises:
        KeyError: ``name`` is not in ``INDEX_VARIANTS``.
    """
    over = INDEX_VARIANTS[name]
    module = sys.modules[__name__]
    saved = {k: getattr(module, k) for k in over}
    try:
        for k, v in over.items():
            setattr(module, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def _check(q: torch.Tensor) -> None:
    d = q.shape[-1]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"triton backend: q [total_q, Hq, d] has d = {d}; the kernels take d in {SUPPORTED_HEAD_DIMS}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton backend: q must be bfloat16 or float16 [total_q, Hq, d], got {q.dtype}")


# Resident programs per SM of each compiled selection variant, measured from the compiled kernel
# after its first launch (the persistent grid must not exceed one wave).
_SELECT_OCC: dict[tuple, int] = {}


def _n_programs(device: torch.device, n_segments: int, occ_key=None) -> int:
    if device.type != "cuda":           # TRITON_INTERPRET on CPU tensors
        return max(1, min(n_segments, 4))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    per_sm = _SELECT_OCC.get(occ_key, SELECT_PROGRAMS_PER_SM)
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


def _alloc_means(cache, plan: BatchPlan, lowp_dtype=None):
    """Empty float32 ``[n_blocks, Hkv, d]`` means of one cache and, when ``lowp_dtype`` is given,
    their 16-bit copy (else ``None``)."""
    _, _, hkv, d = cache.shape
    mean = torch.empty(plan.n_blocks, hkv, d, dtype=torch.float32, device=cache.device)
    lowp = torch.empty(plan.n_blocks, hkv, d, dtype=lowp_dtype, device=cache.device) if lowp_dtype else None
    return mean, lowp


def _launch_means(cache, page_table, seq_lens, plan: BatchPlan, block_size: int, lowp_dtype=None, out=None):
    """Block means of one cache (K or V): float32 ``[n_blocks, Hkv, d]`` and, when
    ``lowp_dtype`` (bf16/fp16) is given, the same rounded to it (else ``None``), written into
    ``out`` (``_alloc_means``) when given. Grid ``(max blocks per request, Hkv, batch)``: no
    per-block request table."""
    _, page_size, hkv, d = cache.shape
    mean, lowp = out if out is not None else _alloc_means(cache, plan, lowp_dtype)
    max_nb = plan.max_blocks(block_size)
    if plan.n_blocks and max_nb:
        ti._block_means_kernel[(max_nb, hkv, plan.batch)](
            cache, page_table, seq_lens, plan.block_ptr, mean, lowp if lowp is not None else mean,
            cache.stride(0), cache.stride(1), cache.stride(2),
            page_table.stride(0), mean.stride(0), mean.stride(1),
            HEAD_DIM=d, BLOCK_SIZE=block_size, TOKENS=min(MEANS_TOKENS, block_size), PAGE_SIZE=page_size,
            WRITE_LOWP=lowp is not None, num_warps=MEANS_WARPS,
        )
    return mean, lowp


def block_means(k_cache, v_cache, page_table, seq_lens, plan: BatchPlan, block_size: int):
    """``(k_mean, v_mean)`` float32 ``[n_blocks, Hkv, d]`` over valid tokens (section 3.1)."""
    return (_launch_means(k_cache, page_table, seq_lens, plan, block_size)[0],
            _launch_means(v_cache, page_table, seq_lens, plan, block_size)[0])


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


def build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
                softmax_scale, plan: BatchPlan, after_select: Callable[[], None] | None = None) -> BlockIndex:
    """Block means, selection and CSR of a batch (sections 3.1-3.6) on the GPU.

    Memory: the index tensors (``k_mean``/``v_mean`` ``2 x n_blocks x Hkv x d x 4`` bytes, their
    16-bit copies half that, CSR ``4 x (n_segments + 1 + nnz)`` bytes, the selection bitmask
    ``sel_bits`` ``n_segments x ceil(max_blocks / 32)`` int32 that the mean correction reads)
    plus, during the call only, a scratch of ``n_programs x max_blocks`` float32 (at 128K, 32/8
    heads, d 128: 8 + 4 MiB means, 4 MiB bitmask, 3 MiB CSR, 2 MiB scratch).

    One host sync: ``row_ptr[-1]`` (``nnz``) to size ``col_idx``; it waits for the selection
    only, while the GPU computes the value means. ``after_select``: called once the selection
    is queued, before the sync (``attention`` launches the dense-tail tiles from it).
    """
    _check(q)
    B = config.block_size
    if plan.block_size != B:
        raise ValueError(f"plan.block_size {plan.block_size} != config.block_size {B}")
    d = q.shape[2]
    hkv = k_cache.shape[2]
    g = plan.group_size
    dev = q.device
    scale = _scale(softmax_scale, d)
    exact = EXACT_SCORES
    # 16-bit copies of k̄ / v̄ (pooled blocks x Hkv x d; 2 MiB each at 128K), written by the means
    # kernel: k̄ for one-dot scores, both for the mean correction (so nothing converts them after
    # the nnz sync). Not made with EXACT_SCORES (the correction then converts or reads float32).
    lowp_dtype = None if exact else q.dtype
    # Every allocation and host computation first, then the launches back to back: the GPU runs
    # the K means (0.01-0.1 ms) while the host launches the selection, instead of idling.
    n_tiles = plan.n_tiles
    n_seg = hkv * n_tiles
    max_nb = plan.max_blocks(B)
    n_words = max(1, -(-max_nb // ti.BITS_PER_WORD))
    k_out = _alloc_means(k_cache, plan, lowp_dtype)
    v_out = _alloc_means(v_cache, plan, lowp_dtype)
    # the select kernel writes row_ptr[0] = 0 and the segment counts; row_ptr[1:] = cumsum(counts)
    row_ptr = torch.empty(n_seg + 1, dtype=torch.int32, device=dev)
    counts = torch.empty(n_seg, dtype=torch.int32, device=dev)
    n_visible = torch.empty(n_seg, dtype=torch.int32, device=dev)
    if n_seg:
        bits = torch.empty(n_seg, n_words, dtype=torch.int32, device=dev)
        occ_key = (dev, d, q.dtype, g, B, plan.tile_rows, SELECT_BLOCK_J, SELECT_NUM_WARPS, SELECT_NUM_STAGES,
                   SELECT_PIPE_STAGES, exact, float(config.alpha) == 0.0)
        n_prog = _n_programs(dev, n_seg, occ_key)
        scratch_cols = max(SELECT_BLOCK_J, triton.cdiv(max_nb, SELECT_BLOCK_J) * SELECT_BLOCK_J)
        scratch = torch.empty(n_prog, scratch_cols, dtype=torch.float32, device=dev)
        alpha = float(config.alpha)
        log2_alpha = math.log2(alpha) if alpha > 0 else 0.0
    k_mean, k_lowp = _launch_means(k_cache, page_table, seq_lens, plan, B, out=k_out)
    if n_seg:
        compiled = ti._select_kernel[(n_prog,)](
            q, k_mean, k_lowp if k_lowp is not None else k_mean, plan.tile_request, plan.tile_local,
            cu_seqlens_q, seq_lens, plan.block_ptr,
            scratch, counts, row_ptr, n_visible, bits,
            q.stride(0), q.stride(1), k_mean.stride(0), k_mean.stride(1), scratch.stride(0), n_words,
            n_tiles, n_seg, n_prog, scale * ti.LOG2E, log2_alpha,
            config.sink_tokens, config.window_tokens, config.dense_tail_tokens, config.min_sparse_len,
            GROUP=g, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_SIZE=B, BLOCK_J=SELECT_BLOCK_J,
            KEEP_ALL_SCORED=alpha == 0.0, EXACT=exact, PIPE_STAGES=SELECT_PIPE_STAGES,
            num_warps=SELECT_NUM_WARPS, num_stages=SELECT_NUM_STAGES,
        )
        if dev.type == "cuda" and occ_key not in _SELECT_OCC:
            occ = _occupancy(compiled, dev)
            _SELECT_OCC[occ_key] = occ if occ is not None else SELECT_PROGRAMS_PER_SM
        del scratch
        torch.cumsum(counts, 0, out=row_ptr[1:])
    else:
        row_ptr.zero_()
    # The one host sync, for nnz: its copy and event are queued first, then V's means (not needed
    # by the selection), so the GPU computes them while the host waits and launches the expand.
    nnz_ready = _queue_nnz_copy(row_ptr) if n_seg else None
    if after_select is not None:
        after_select()
    v_mean, v_lowp = _launch_means(v_cache, page_table, seq_lens, plan, B, out=v_out)
    # owned copies of the plan's pointers, made before the sync so they overlap the GPU work
    block_ptr, tile_ptr = plan.block_ptr.clone(), plan.tile_ptr.clone()
    nnz = nnz_ready() if nnz_ready is not None else 0
    col_idx = torch.empty(nnz, dtype=torch.int32, device=dev)
    if n_seg:
        ti._expand_kernel[(n_seg,)](bits, row_ptr, n_visible, col_idx, n_words,
                                    WORDS=EXPAND_WORDS, num_warps=4)
    else:
        bits = None
    return BlockIndex(
        row_ptr=row_ptr,
        col_idx=col_idx,
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
        sel_bits=bits,
    )


def _correction_means(q, plan: BatchPlan, index: BlockIndex):
    """The mean keys / values the correction reads: the 16-bit copies when the index has them
    in q's dtype, else the float32 means (short batches) or 16-bit conversions (long ones)."""
    lowp = (index.k_mean_lowp, index.v_mean_lowp)
    if all(t is not None and t.dtype == q.dtype for t in lowp):
        return lowp                         # rounded by the means kernel, before the nnz sync
    if plan.max_kv_len <= MEANS_DIRECT_MAX_KV:
        # short: the kernel reads the float32 means and rounds them itself (saves two
        # conversion launches + allocations per call, ~tens of us of host time)
        return index.k_mean, index.v_mean
    # long: 16-bit copies halve the correction loop's L2 traffic (every tile re-reads the means
    # of all its pruned blocks: ~8.6 GB in bf16 at 128K)
    return index.k_mean.to(q.dtype), index.v_mean.to(q.dtype)


def sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
                     softmax_scale, plan: BatchPlan, index: BlockIndex, timing=None, tiles=None,
                     out=None, lse=None):
    """Block-sparse attention with mean correction (section 4). No host sync.

    ``timing``, ``tiles``, ``out``, ``lse``: see ``triton_attention.launch_attention`` (the
    bench's per-phase breakdown; a subset of the query tiles written into given outputs).

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, natural log)``.
    """
    _check(q)
    scale = _scale(softmax_scale, q.shape[2])
    mc = bool(config.mean_correction)
    km, vm = _correction_means(q, plan, index) if mc else (None, None)
    return launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan,
                            sparse=True, mean_correction=mc, row_ptr=index.row_ptr, col_idx=index.col_idx,
                            k_mean=km, v_mean=vm, sel_bits=index.sel_bits, block_size=index.block_size,
                            timing=timing, tiles=tiles, out=out, lse=lse)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]


def attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config: SparseConfig,
              softmax_scale, plan: BatchPlan):
    """``build_index`` + ``sparse_attention`` in one call; returns ``(out, lse, index)``.

    When the last request's KV is at least ``TAIL_SPLIT_MIN_KV`` tokens, its
    dense-tail tiles (``plan.dense_tail_start``: they select every visible block, so they need no
    index) run in the kernel's dense mode on a side CUDA stream, started once the selection is
    queued: they fill the GPU while the host waits for ``nnz`` and launches the expand, instead
    of leaving it idle. The sparse launch covers the other tiles; the current stream waits for
    the side stream before returning. Same results as the two calls (a dense tile's CSR row is
    every visible block, its correction set is empty, and the loops visit the same blocks in
    the same order). On the CPU (``TRITON_INTERPRET``) the two launches run one after the other.

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, BlockIndex)``.
    """
    _check(q)
    lo = plan.n_tiles
    if plan.kv_lens and plan.kv_lens[-1] >= TAIL_SPLIT_MIN_KV:     # the split concerns the last request
        lo = dense_tail_start(plan, config.dense_tail_tokens, config.min_sparse_len)
    if lo >= plan.n_tiles:
        index = build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan)
        out, lse = sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config,
                                    softmax_scale, plan, index)
        return out, lse, index
    scale = _scale(softmax_scale, q.shape[2])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    done = []

    def launch_tail() -> None:
        on_side = contextlib.nullcontext()          # CPU (TRITON_INTERPRET): in order, no streams
        if q.device.type == "cuda":
            main = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device)
            side.wait_stream(main)                  # the selection (and everything before it) first
            on_side = torch.cuda.stream(side)
        with on_side:
            launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan, sparse=False,
                             mean_correction=False, block_size=config.block_size, tiles=(lo, plan.n_tiles),
                             out=out, lse=lse)
        if q.device.type == "cuda":
            done.append((main, side))

    try:
        index = build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan,
                            after_select=launch_tail)
        sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan,
                         index, tiles=(0, lo), out=out, lse=lse)
    finally:
        # also when something after the tail launch raises (the nnz sync, an allocation, the
        # sparse launch): the current stream must not reuse out / lse while the side stream may
        # still write them
        for main, side in done:
            main.wait_stream(side)
    return out, lse, index


def dense_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, plan: BatchPlan):
    """Dense causal attention (bottom-right aligned) over the paged KV: the same kernel, all
    causally visible blocks, no correction. No host sync.

    Returns ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq] float32, natural log)``.
    """
    _check(q)
    scale = _scale(softmax_scale, q.shape[2])
    return launch_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan,
                            sparse=False, mean_correction=False)
