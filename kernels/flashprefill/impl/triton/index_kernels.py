"""Triton kernels of the index stage (``docs/method.md`` sections 3.1-3.6, ``docs/layout.md``).

Tiles come from ``tiles.IndexConfig``, passed by the launchers in ``host.py``.

Four launches (means of K and of V, selection, expand), no dense ``tiles x blocks`` float workspace:

1. ``_block_means_kernel``  grid ``(blocks, Hkv, batch)``, once for K and once for V: the mean
   of one key block of one KV head, read through the page table (any page size), float32 sums
   of the ``n_j`` valid tokens only. K's launch precedes the selection; V's follows it, so it
   runs while the host waits for ``nnz`` (~0.33 ms for both at 128K on an H200).
2. ``_select_kernel``  persistent grid ``(n_programs,)`` looping over segments
   ``seg = h * n_tiles + tile``. Per segment:
     - setup: load the GQA-packed Q tile once (packed row ``ρ`` = token ``ρ // g``, head
       ``h*g + ρ % g``);
     - pass A sweeps the scored blocks in chunks of ``BLOCK_J``: ``ℓ = τ q·k̄`` (in log2 units,
       one tensor-core dot on k̄ rounded to q's 16-bit dtype) and writes the chunk's
       absolute log-energy ``log2 E_j = M_c + log2 Σ_ρ 2^(ℓ - M_c)`` (``M_c`` the running max)
       to a per-program scratch row ``[max_blocks]`` (L2-resident, ``n_programs x max_blocks``
       floats: 2 MiB at 128K) and keeps ``max_j log2 E_j`` (with ``threshold_max="prunable"``
       over the blocks that sink and window do not keep). ``E_j / max E`` does not depend on
       ``M``, so no second sweep of dot products is needed;
     - pass B sweeps every causally visible block in chunks of ``BLOCK_J`` (a multiple of 32):
       keep = dense tile | sink | window | (scored & ``log2 E_j >= log2 α + max``); writes the
       segment's count, ``n_visible`` and a packed bitmask (int32 words, ``n_seg x ceil(max_blocks
       / 32)``: 4 MiB at 128K, freed after the call).
3. ``_expand_kernel``  grid ``(n_segments,)``: after ``row_ptr = cumsum(counts)`` (one host sync
   for ``nnz``), turn each segment's bitmask into ascending ``col_idx`` entries.

Example (``B = 128``, ``P = 0``, ``g = 4``, tile 3 = rows 384..511 = tokens 96..127): one scored
block? ``e_0 = 128 <= P + t_last + 1 = 128`` yes, so block 0 is scored (and also in the window).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .quant_kernels import _quantize_tile, _quantize_tile_int8

LOG2E = 1.4426950408889634  # 1 / ln(2): exp(x) = exp2(x * LOG2E)
# Relative slack of the threshold test in the log2 domain: keeps a block whose energy equals the
# max up to float rounding (alpha = 1 must keep the arg-max block). ~1e-6 relative in E.
TIE_LOG2_SLACK = tl.constexpr(1.5e-6)
BITS_PER_WORD = 32


@triton.jit
def _kv_rows(pt_row, pos, PAGE_SIZE: tl.constexpr, stride_page, stride_slot):
    """Element offsets (of head 0, dim 0) of KV positions ``pos`` through one page-table row.

    ``pos`` lives at ``cache[page_table[b, pos // PAGE_SIZE], pos % PAGE_SIZE]``. Callers mask
    ``pos >= Lk``; masked positions read page-table entry 0 of the row (always allocated).
    """
    page = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64)
    return page * stride_page + (pos % PAGE_SIZE).to(tl.int64) * stride_slot


# --------------------------------------------------------------------------------------------
# 1. Block means


@triton.jit
def _block_means_kernel(
    x_ptr, page_table, seq_lens, block_ptr,
    x_mean, x_lowp,
    stride_xp, stride_xs, stride_xh,
    stride_pt,
    stride_mb, stride_mh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,          # tokens summed per step (BLOCK_SIZE % TOKENS == 0)
    PAGE_SIZE: tl.constexpr,
    WRITE_LOWP: tl.constexpr,      # also write the mean rounded to x_lowp's 16-bit dtype
    amax=None,                     # int32 [batch, Hkv] (zeroed) when AMAX
    AMAX: tl.constexpr = False,    # also max |x| per (request, KV head) into amax (FP8 scales)
):
    """Mean of one cache (K or V) per key block and KV head. Grid ``(max blocks per request,
    Hkv, batch)``: programs past a request's last block exit. One launch per cache, so the V
    means can run while the host waits for the selection's ``nnz``.

    ``AMAX``: the FP8 pre-pass's ``max |x|`` of the request and KV head from the same loads (NaN
    ignored, an int32 ``atomic_max`` on the float bits, as ``quant_kernels._kv_amax_kernel``):
    ``amax`` int32 ``[batch, Hkv]``, read as float32 once the launch is done."""
    tl.static_assert(BLOCK_SIZE % TOKENS == 0)
    # --- setup: (local block, head, request) -> pooled block
    j = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    lk = tl.load(seq_lens + b)
    if j * BLOCK_SIZE >= lk:
        return
    gb = tl.load(block_ptr + b) + j
    pt_row = page_table + b.to(tl.int64) * stride_pt
    n_valid = tl.minimum(BLOCK_SIZE, lk - j * BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    x_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    if AMAX:   # elementwise over the steps, one cross-thread reduction at the end (a max is exact)
        x_max = tl.zeros([TOKENS, HEAD_DIM], dtype=tl.float32)
    # --- loop: fp32 sums of the valid tokens
    for s in tl.static_range(BLOCK_SIZE // TOKENS):
        pos = j * BLOCK_SIZE + s * TOKENS + tl.arange(0, TOKENS)
        ok = pos < lk
        pos = tl.where(ok, pos, 0)
        page = tl.load(pt_row + pos // PAGE_SIZE).to(tl.int64)
        slot = (pos % PAGE_SIZE).to(tl.int64)
        off = page * stride_xp + slot * stride_xs + h * stride_xh
        x = tl.load(x_ptr + off[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        x_sum += tl.sum(x.to(tl.float32), axis=0)
        if AMAX:
            a = tl.abs(x.to(tl.float32))
            x_max = tl.maximum(x_max, tl.where(a == a, a, 0.0))   # NaN ignored
    # --- epilogue: divide by n_j (never by B)
    mean = x_sum * (1.0 / n_valid.to(tl.float32))
    out = gb.to(tl.int64) * stride_mb + h * stride_mh + dims
    tl.store(x_mean + out, mean)
    if WRITE_LOWP:
        tl.store(x_lowp + out, mean.to(x_lowp.dtype.element_ty))
    if AMAX:
        # non-negative floats compare like their int32 bits
        tl.atomic_max(amax + b * tl.num_programs(1) + h,
                      tl.max(tl.max(x_max, axis=1), axis=0).to(tl.int32, bitcast=True))


# --------------------------------------------------------------------------------------------
# 2. Selection


@triton.jit
def _tile_geometry(tile, h, n_tiles, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
                   GROUP: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Scalars of one tile (docs/layout.md "GQA packing and tiles", "Key blocks").

    Returns ``(b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0)``; ``n_vis`` =
    ``(P + t_last) // B + 1`` causally visible blocks.
    """
    b = tl.load(tile_request + tile)
    i = tl.load(tile_local + tile)
    q_start = tl.load(cu_seqlens_q + b)
    lq = tl.load(cu_seqlens_q + b + 1) - q_start
    lk = tl.load(seq_lens + b)
    P = lk - lq
    row_end = tl.minimum(i * TILE_ROWS + TILE_ROWS, lq * GROUP)
    t_first = (i * TILE_ROWS) // GROUP
    t_last = (row_end - 1) // GROUP
    n_vis = (P + t_last) // BLOCK_SIZE + 1
    blk0 = tl.load(block_ptr + b)
    return b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0


@triton.jit
def _n_fully_seen(x, lk, BLOCK_SIZE: tl.constexpr):
    """Number of blocks ``j`` with ``e_j = min((j+1)B, Lk) <= x`` (``x <= Lk``); they are 0..n-1."""
    nb = (lk + BLOCK_SIZE - 1) // BLOCK_SIZE
    return tl.where(x >= lk, nb, x // BLOCK_SIZE)


@triton.jit
def _load_mean_keys(k_lowp, j0, n_scored, blk0, h, stride_mb, stride_mh,
                    HEAD_DIM: tl.constexpr, BLOCK_J: tl.constexpr):
    """16-bit mean keys of blocks ``j0 .. j0+BLOCK_J-1`` (rows past ``n_scored`` are 0). Issued
    one chunk ahead of its use (register prefetch: the global-load latency overlaps the previous
    chunk's dot and exponentials)."""
    js = j0 + tl.arange(0, BLOCK_J)
    j_ok = js < n_scored
    dims = tl.arange(0, HEAD_DIM)
    offs = (blk0 + js).to(tl.int64)[:, None] * stride_mb + h * stride_mh + dims[None, :]
    return tl.load(k_lowp + offs, mask=j_ok[:, None], other=0.0)


@triton.jit
def _chunk_logits(kc, qT, j0, n_scored, rows_tok, row_ok, P, lk, scale_log2, sink_tokens, win_lo,
                  BLOCK_J: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_PRUNABLE: tl.constexpr):
    """``ℓ2ᵀ`` ``[BLOCK_J, TILE_ROWS]`` of blocks ``j0 ..`` (log2 units), ``-inf`` off the valid
    (row, block) pairs and, with ``MAX_PRUNABLE``, on the blocks sink and window keep anyway."""
    js = j0 + tl.arange(0, BLOCK_J)
    e_j = tl.minimum((js + 1) * BLOCK_SIZE, lk)
    ok = (js < n_scored)[:, None] & row_ok[None, :] & (e_j[:, None] <= P + rows_tok[None, :] + 1)
    if MAX_PRUNABLE:
        ok = ok & ((js * BLOCK_SIZE >= sink_tokens) & (js < win_lo))[:, None]
    # (int8 operands of int8qk: the exact int32 sum as fp32; the 16-bit / e4m3 dot is fp32 already)
    return tl.where(ok, tl.dot(kc, qT).to(tl.float32) * scale_log2, float("-inf"))


@triton.jit
def _row_log_mass(k_lowp, qT, n_scored, blk0, h, stride_mb, stride_mh, rows_tok, row_ok, P, lk,
                  scale_log2, sink_tokens, win_lo, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr,
                  BLOCK_J: tl.constexpr, BLOCK_SIZE: tl.constexpr, MAX_PRUNABLE: tl.constexpr):
    """``block_score="mass"``'s pre-pass: each row's log2-sum-exp2 of ``ℓ2`` over the blocks it
    scores (an online log-sum-exp over the chunks; 0 for a row with none), ``[TILE_ROWS]``. The
    scores then subtract it, so a row's terms are its softmax over the blocks."""
    m_r = tl.full([TILE_ROWS], float("-inf"), dtype=tl.float32)
    s_r = tl.zeros([TILE_ROWS], dtype=tl.float32)
    for j0 in range(0, n_scored, BLOCK_J):
        kc = _load_mean_keys(k_lowp, j0, n_scored, blk0, h, stride_mb, stride_mh, HEAD_DIM, BLOCK_J)
        x = _chunk_logits(kc, qT, j0, n_scored, rows_tok, row_ok, P, lk, scale_log2, sink_tokens, win_lo,
                          BLOCK_J, BLOCK_SIZE, MAX_PRUNABLE)
        m_new = tl.maximum(m_r, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_r = s_r * tl.exp2(m_r - m_safe) + tl.sum(tl.exp2(x - m_safe[None, :]), axis=0)
        m_r = m_new
    return tl.where(s_r > 0, m_r + tl.log2(s_r), 0.0)


@triton.jit
def _score_chunk(kc, qT, j0, n_scored, rows_tok, row_ok, P, lk, scale_log2, need_mask,
                 BLOCK_J: tl.constexpr, BLOCK_SIZE: tl.constexpr, row_lse, ROW_MASS: tl.constexpr):
    """Log2-energy of blocks ``j0 .. j0+BLOCK_J-1``: ``log2 Σ_{valid ρ} 2^(ℓ2(ρ, j))``.

    ``kc``: their mean keys (``_load_mean_keys``). Transposed product ``ℓᵀ = k̄ qᵀ``
    ``[BLOCK_J, TILE_ROWS]``: the per-block reductions over the tile's rows run along the
    accumulator's rows (inside a warp: shuffles, no shared-memory round trip).
    ``ℓ2 = τ q·k̄ · log2(e)``, one tensor-core dot on the 16-bit copy of k̄. ``need_mask``
    (runtime): some (row, block) pair of the chunk is not valid (a block not fully seen by the
    tile's first row, or a partial tile); otherwise the mask is skipped. Each block's own max is
    subtracted (exact log-sum-exp per block). Blocks past ``n_scored`` get ``-inf``.
    ``ROW_MASS`` (``block_score="mass"``): ``ℓ2 - row_lse`` per row (``_row_log_mass``), so the
    result is ``log2 Σ_ρ softmax_ρ(ℓ)_j``.
    """
    js = j0 + tl.arange(0, BLOCK_J)
    j_ok = js < n_scored
    dotT = tl.dot(kc, qT).to(tl.float32)                           # q·k̄ [BLOCK_J, TILE_ROWS], unscaled
    if need_mask:
        e_j = tl.minimum((js + 1) * BLOCK_SIZE, lk)
        valid = row_ok[None, :] & j_ok[:, None] & (e_j[:, None] <= P + rows_tok[None, :] + 1)
        dotT = tl.where(valid, dotT, float("-inf"))
    # ℓ2 = scale_log2 q·k̄ (scale_log2 > 0: the max of ℓ2 is the scaled max of q·k̄), and
    # ℓ2 - m_j as one FMA per element
    if ROW_MASS:
        x = dotT * scale_log2 - row_lse[None, :]
        m_j = tl.max(x, axis=1)
        m_j = tl.where(m_j == float("-inf"), 0.0, m_j)
        energy = tl.sum(tl.exp2(x - m_j[:, None]), axis=1)
    else:
        m_j = tl.max(dotT, axis=1) * scale_log2
        m_j = tl.where(m_j == float("-inf"), 0.0, m_j)
        energy = tl.sum(tl.exp2(tl.fma(dotT, scale_log2, -m_j[:, None])), axis=1)       # [BLOCK_J]
    return tl.where(j_ok, m_j + tl.log2(energy), float("-inf"))


@triton.jit
def _select_kernel(
    q_ptr, k_mean, k_lowp, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
    scratch, counts, row_ptr, n_visible, bits,
    stride_qt, stride_qh, stride_mb, stride_mh, stride_scratch, n_words,
    n_tiles, n_segments, n_prog, scale_log2, log2_alpha,
    sink_tokens, window_tokens, dense_tail_tokens, min_sparse_len, k_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_J: tl.constexpr,
    KEEP_ALL_SCORED: tl.constexpr,   # alpha == 0
    FP8: tl.constexpr = False,       # e4m3 scores (docs/fp8.md): k_lowp holds k_mean8, k_scale the K scales
    HW_CVT: tl.constexpr = False,    # FP8: the Q tile's codes by the hardware cast (quant_kernels._to_e4m3)
    MAX_PRUNABLE: tl.constexpr = False,  # threshold_max "prunable": max E over blocks not sink / window
    ROW_MASS: tl.constexpr = False,      # block_score "mass": each row's softmax over its blocks, summed
    QK_INT8: tl.constexpr = False,       # with FP8, precision "int8qk": int8 Q tile and k_mean8 (docs/fp8.md 10)
):
    """Selection of every segment (pass A: block energies, pass B: rules + threshold), see the
    module docstring. ``k_mean`` (float32 means) is not read: the scores use ``k_lowp``; it stays
    in the parameter list so the compiled kernel is the one measured (``docs/lab/variants.md``).

    ``FP8``: the Q tile is quantised where it is loaded (``quant_kernels._quantize_tile``, scale
    ``s_q``), ``k_lowp`` holds the e4m3 means ``k_mean8`` (K's scale, float32 ``k_scale
    [batch, Hkv]``), and the segment's logit factor is ``scale_log2 * s_q * s_k``. Without it
    ``k_scale`` is not read. ``QK_INT8`` (with ``FP8``): the Q tile's codes and ``k_lowp`` are int8
    (``quant_kernels._quantize_tile_int8``, ``amax / 127``), the dot an exact int32 sum."""
    tl.static_assert(BLOCK_J % 32 == 0)
    tl.static_assert(TILE_ROWS >= 16)
    WORDS: tl.constexpr = BLOCK_J // 32
    pid = tl.program_id(0)
    dims = tl.arange(0, HEAD_DIM)
    scratch_row = scratch + pid.to(tl.int64) * stride_scratch
    for seg0 in range(0, n_segments, n_prog):
        # --- setup (the last round's spare programs redo the last segment, stores masked off)
        seg_live = seg0 + pid < n_segments
        seg = tl.minimum(seg0 + pid, n_segments - 1)
        h = seg // n_tiles
        tile = seg - h * n_tiles
        b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0 = _tile_geometry(
            tile, h, n_tiles, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
            GROUP, TILE_ROWS, BLOCK_SIZE)
        rows = i * TILE_ROWS + tl.arange(0, TILE_ROWS)
        row_ok = rows < lq * GROUP
        tok = rows // GROUP
        head = h * GROUP + rows % GROUP
        q_off = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        if FP8:
            if QK_INT8:
                q, s_q = _quantize_tile_int8(q.to(tl.float32))
            else:
                q, s_q = _quantize_tile(q.to(tl.float32), HW_CVT)
            seg_scale = scale_log2 * s_q * tl.load(k_scale + b * (n_segments // n_tiles) + h)
        else:
            seg_scale = scale_log2
        qT = tl.trans(q)                                                           # [d, TILE_ROWS]
        dense = (t_last >= lq - dense_tail_tokens) | (lq < min_sparse_len)
        n_scored = _n_fully_seen(P + t_last + 1, lk, BLOCK_SIZE)
        n_score_loop = tl.where(dense, 0, n_scored)
        if KEEP_ALL_SCORED:
            n_score_loop = 0
        # chunks ending at or before n_first need no mask: every row fully sees their blocks
        n_first = tl.where(lq * GROUP - i * TILE_ROWS >= TILE_ROWS,
                           _n_fully_seen(P + t_first + 1, lk, BLOCK_SIZE), 0)
        win_lo = tl.maximum(P + t_first - window_tokens + 1, 0) // BLOCK_SIZE
        if ROW_MASS:  # pass A0: each row's log-sum-exp over the blocks it scores (one more sweep)
            row_lse = _row_log_mass(k_lowp, qT, n_score_loop, blk0, h, stride_mb, stride_mh, tok, row_ok, P, lk,
                                    seg_scale, sink_tokens, win_lo, HEAD_DIM, TILE_ROWS, BLOCK_J, BLOCK_SIZE,
                                    MAX_PRUNABLE)
        else:
            row_lse = tl.zeros([TILE_ROWS], dtype=tl.float32)    # not read
        # --- pass A: log2-energies of scored blocks -> scratch, and their max
        e_max_v = tl.full([BLOCK_J], float("-inf"), dtype=tl.float32)
        kc = _load_mean_keys(k_lowp, 0, n_score_loop, blk0, h, stride_mb, stride_mh, HEAD_DIM, BLOCK_J)
        for j0 in range(0, n_score_loop, BLOCK_J):
            k_cur = kc
            kc = _load_mean_keys(k_lowp, j0 + BLOCK_J, n_score_loop, blk0, h, stride_mb, stride_mh,
                                 HEAD_DIM, BLOCK_J)
            log_e = _score_chunk(k_cur, qT, j0, n_score_loop, tok, row_ok, P, lk, seg_scale,
                                 j0 + BLOCK_J > n_first, BLOCK_J, BLOCK_SIZE, row_lse, ROW_MASS)
            tl.store(scratch_row + j0 + tl.arange(0, BLOCK_J), log_e)
            if MAX_PRUNABLE:  # the bar is set by the blocks the threshold decides, not by sink / window
                js = j0 + tl.arange(0, BLOCK_J)
                log_e = tl.where((js * BLOCK_SIZE >= sink_tokens) & (js < win_lo), log_e, float("-inf"))
            e_max_v = tl.maximum(e_max_v, log_e)
        e_max = tl.max(e_max_v, axis=0)
        tl.debug_barrier()  # scratch written by other threads of this program
        # no prunable block (MAX_PRUNABLE): e_max = -inf, threshold -inf, every scored block is kept
        # by sink / window anyway
        threshold = e_max + log2_alpha - TIE_LOG2_SLACK * tl.abs(e_max)
        # --- pass B: rules + threshold -> bitmask words, count
        count = 0
        for j0 in range(0, n_vis, BLOCK_J):
            js = j0 + tl.arange(0, BLOCK_J)
            vis = js < n_vis
            log_e = tl.load(scratch_row + js, mask=js < n_score_loop, other=float("-inf"))
            keep = (log_e >= threshold) & (js < n_score_loop)
            if KEEP_ALL_SCORED:
                keep = js < n_scored
            keep = keep | dense | (js * BLOCK_SIZE < sink_tokens) | (js >= win_lo)
            keep = keep & vis
            count += tl.sum(keep.to(tl.int32), axis=0)
            shifted = keep.to(tl.int32) << (tl.arange(0, BLOCK_J) % 32)
            words = tl.sum(tl.reshape(shifted, [WORDS, 32]), axis=1)
            w_idx = j0 // 32 + tl.arange(0, WORDS)
            tl.store(bits + seg.to(tl.int64) * n_words + w_idx, words, mask=(w_idx < n_words) & seg_live)
        tl.debug_barrier()  # the next segment's pass A overwrites scratch
        tl.store(counts + seg, count, mask=seg_live)
        tl.store(n_visible + seg, n_vis, mask=seg_live)
    tl.store(row_ptr, 0, mask=pid == 0)        # row_ptr[1:] = cumsum(counts), by the host side


# --------------------------------------------------------------------------------------------
# 3. Bitmask -> CSR


@triton.jit
def _expand_kernel(bits, row_ptr, n_visible, col_idx, n_words, n_col,
                   WORDS: tl.constexpr):
    """One segment's bitmask -> its ascending ``col_idx`` entries (from ``row_ptr[seg]``),
    ``WORDS`` int32 words (``32 * WORDS`` key blocks) per step. ``n_col``: ``col_idx``'s length; no
    write lands past it (a ``row_ptr`` beyond the buffer, from lengths that disagree with the plan,
    leaves entries unwritten instead of writing out of bounds)."""
    seg = tl.program_id(0)
    start = tl.load(row_ptr + seg)
    n_vis = tl.load(n_visible + seg)
    CHUNK: tl.constexpr = WORDS * 32
    shifts = tl.arange(0, 32)
    written = 0
    for j0 in range(0, n_vis, CHUNK):
        w_idx = j0 // 32 + tl.arange(0, WORDS)
        words = tl.load(bits + seg.to(tl.int64) * n_words + w_idx, mask=w_idx < n_words, other=0)
        sel = tl.reshape((words[:, None] >> shifts[None, :]) & 1, [CHUNK])
        js = j0 + tl.arange(0, CHUNK)
        sel = tl.where(js < n_vis, sel, 0)
        pos = tl.cumsum(sel, axis=0) - 1
        dst = start + written + pos
        tl.store(col_idx + dst, js, mask=(sel != 0) & (dst < n_col))
        written += tl.sum(sel, axis=0)
