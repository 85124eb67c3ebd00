"""Triton block-sparse prefill attention with fused mean correction (``docs/method.md`` section 4).

One kernel, ``_attn_fwd``, with its modes chosen at compile time (tiles: ``tiles.AttnConfig``,
launched by ``host.launch_attention``):

- ``SPARSE=True, MEAN_CORR=True``: the product path. Exact keys of the segment's selected blocks
  (``col_idx[row_ptr[seg]:row_ptr[seg+1]]``), then the mean keys of the pruned blocks ``U`` that
  every row of the tile fully sees, all in one online softmax. ``MC_BITS``: the pruned candidates
  are read from the index's selection bitmask (``BlockIndex.sel_bits``); without it (an index
  built elsewhere, e.g. by the reference) every candidate is folded in and the selected ones are
  taken out again (``_mean_all`` + ``_mean_subtract``);
- ``SPARSE=True, MEAN_CORR=False``: the same without the correction (``SparseConfig.mean_correction``);
- ``SPARSE=False``: dense causal attention over all visible blocks (the honest dense baseline of
  the same kernel, and the fallback for dense layers).

Grid ``(n_tiles * TILE_ROWS // BLOCK_M * Hkv,)``: one program per (KV head, query tile, sub-tile
of ``BLOCK_M`` packed rows), the KV head fastest. Program ids run from the last tile to the first,
all heads of a tile together, so the heaviest tiles (late in a request, dense tail) start first. A packed row ``ρ`` of KV head ``h`` is token
``ρ // g`` and query head ``h*g + ρ % g`` (GQA packing, ``docs/layout.md``): one K/V load serves
the whole group.

Per program:
  setup     load the packed Q tile once; tile geometry (``P``, ``t_first``, ``t_last``);
  loop 1    selected blocks fully seen by every row of the tile (no mask);
  loop 2    the trailing selected blocks that need the causal / ``p < Lk`` mask. They are exactly
            the last ``n_vis - n_full`` entries of the segment: the local window always selects
            every block from ``n_full = (P + t_first + 1) // B`` to ``n_vis - 1``;
  loop 3    mean correction: candidates ``j < n_U`` (fully seen by the tile's first row) in chunks
            of ``BLOCK_U``, the selected ones excluded by the selection bitmask (no dense
            workspace); logit ``τ q·k̄_j + ln n_j``, value ``v̄_j``;
  epilogue  ``out = acc / l`` in q's dtype, ``lse = ln l + m`` float32; a row with no logit gives
            0 / -inf, never NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .index_kernels import _n_fully_seen, _tile_geometry

LOG2E = 1.4426950408889634  # 1 / ln(2)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): lse = (m2 + log2 l) * LN2


@triton.jit
def _softmax_p(m_i, l_i, s, scale):
    """The first half of ``_softmax_step``: ``(p, alpha, m_new, l_new)`` for logits
    ``scale * s`` (``scale > 0``); the caller rescales ``acc`` by ``alpha`` and adds ``p @ v``.
    The row max is taken on the unscaled ``s`` and scaled once per row (the same value: scaling
    by a positive number is monotonic), and ``scale * s - m`` is one FMA per logit."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(s, scale, -m_safe[:, None]))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, scale):
    """One online-softmax step (log2 units): fold logits ``scale * s`` ``[M, N]`` (``-inf`` =
    masked) and values ``v`` ``[N, d]`` into ``acc`` ``[M, d]`` / running max ``m_i`` /
    denominator ``l_i`` (``[M]``, float32). A row with no finite logit yet keeps ``m = -inf``
    and adds nothing."""
    p, alpha, m_new, l_i = _softmax_p(m_i, l_i, s, scale)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _count_logs(lk, BLOCK_SIZE: tl.constexpr):
    """``(j_part, log2 n_part, log2 B)``: the request's last block ``j_part`` (the only one that
    can hold fewer than ``B`` valid tokens, ``n_part = Lk - j_part B``) and the two values of the
    correction's logit offset ``log2 n_j`` (scalars, computed once per program: a per-element
    ``tl.log2`` compiles to a libdevice polynomial, ~15 FFMA per candidate and thread)."""
    j_part = (lk + BLOCK_SIZE - 1) // BLOCK_SIZE - 1
    log2_part = tl.log2((lk - j_part * BLOCK_SIZE).to(tl.float32))
    log2_full = tl.log2(tl.full([], BLOCK_SIZE, tl.float32))
    return j_part, log2_part, log2_full


@triton.jit
def _load_means(k_mean, v_mean, first, rel, valid, h, stride_mb, stride_mh, dtype, HEAD_DIM: tl.constexpr):
    """Mean keys / values ``[len(rel), d]`` of the pooled blocks ``first + rel`` (``valid`` ones;
    others 0) rounded to ``dtype``. ``first``: a scalar (its 64-bit offset computed once);
    ``rel``: int32 block offsets from it (32-bit row arithmetic and compares in the loops)."""
    dims = tl.arange(0, HEAD_DIM)
    base = first.to(tl.int64) * stride_mb + h * stride_mh
    rows = rel * stride_mb
    km = tl.load(k_mean + base + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(dtype)
    vm = tl.load(v_mean + base + rows[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(dtype)
    return km, vm


@triton.jit
def _kv_tile(k_cache, v_cache, pt_row, j, sub, P, lk, tok, q, scale_log2,
             stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             PAGE_SIZE: tl.constexpr, MASK: tl.constexpr):
    """Keys ``j * B + sub * BLOCK_N + [0, BLOCK_N)`` of one step, gathered through the page
    table: ``(qk, v)`` with the unscaled ``qk = q kᵀ`` ``[M, BLOCK_N]`` (the softmax applies
    ``scale_log2``) masked per ``MASK`` (see ``_attn_inner``) and ``v`` ``[BLOCK_N, d]``."""
    dims = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    pos = j * BLOCK_SIZE + sub * BLOCK_N + offs_n
    if MASK == 0:
        pos_c = pos
    else:
        p_ok = pos < lk
        pos_c = tl.where(p_ok, pos, 0)
    if PAGE_SIZE % BLOCK_N == 0:
        # the BLOCK_N keys (BLOCK_N-aligned) share one page: a scalar 64-bit base and
        # 32-bit in-page offsets, contiguous rows
        first = j * BLOCK_SIZE + sub * BLOCK_N
        # (clamped: a sub-block past Lk of a partial last block must not read past the
        # request's page-table row; its keys are masked anyway)
        page = tl.load(pt_row + tl.minimum(first, lk - 1) // PAGE_SIZE).to(tl.int64)
        slot = first % PAGE_SIZE + offs_n
        k_base = k_cache + page * stride_kp + h * stride_kh
        v_base = v_cache + page * stride_vp + h * stride_vh
        k_ptrs = k_base + (slot * stride_ks)[:, None] + dims[None, :]
        v_ptrs = v_base + (slot * stride_vs)[:, None] + dims[None, :]
    else:
        page = tl.load(pt_row + pos_c // PAGE_SIZE).to(tl.int64)
        slot = (pos_c % PAGE_SIZE).to(tl.int64)
        k_off = page * stride_kp + slot * stride_ks + h * stride_kh
        v_off = page * stride_vp + slot * stride_vs + h * stride_vh
        k_ptrs = k_cache + k_off[:, None] + dims[None, :]
        v_ptrs = v_cache + v_off[:, None] + dims[None, :]
    if MASK == 0:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=p_ok[:, None], other=0.0)
    qk = tl.dot(q, tl.trans(k))          # unscaled: _softmax_step applies scale_log2 in its FMA
    if MASK == 1:
        allowed = (pos[None, :] <= P + tok[:, None]) & p_ok[None, :]
        qk = tl.where(allowed, qk, float("-inf"))
    if MASK == 0:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=p_ok[:, None], other=0.0)
    return qk, v


@triton.jit
def _attn_inner(acc, m_i, l_i, q, k_cache, v_cache, pt_row, col_idx, lo, hi,
                P, lk, tok, scale_log2,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                PAGE_SIZE: tl.constexpr, SPARSE: tl.constexpr, MASK: tl.constexpr, STAGES: tl.constexpr,
                PAIR: tl.constexpr):
    """Online softmax over key blocks ``col_idx[lo:hi]`` (``SPARSE``) or ``lo..hi-1`` (dense).

    ``MASK``: 0 = no mask (every key of every step is visible to every row); 1 = apply the
    bottom-right causal mask ``p <= P + t`` and ``p < Lk`` on every step (padded keys get
    ``-inf``, never logit 0). Logits are in log2 units (``scale_log2 = τ log2 e``). One loop step
    per key block, its ``BLOCK_SIZE // BLOCK_N`` sub-tiles unrolled (Triton pipelines each
    sub-tile's loads ``STAGES`` deep).

    ``PAIR`` (two sub-tiles per block): one online-softmax update per key block instead of one
    per sub-tile (half the rescales of the ``[M, d]`` accumulator, the dominant non-MMA cost of a
    step).
    """
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    for e in tl.range(lo, hi, num_stages=STAGES):
        if SPARSE:
            j = tl.load(col_idx + e)
        else:
            j = e
        if PAIR and SUBS == 2:
            # one softmax update (row max, rescale of acc) per key block: both sub-tiles' logits
            # first, then their two p v products
            qk0, v0 = _kv_tile(k_cache, v_cache, pt_row, j, 0, P, lk, tok, q, scale_log2,
                               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                               HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGE_SIZE, MASK)
            qk1, v1 = _kv_tile(k_cache, v_cache, pt_row, j, 1, P, lk, tok, q, scale_log2,
                               stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                               HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGE_SIZE, MASK)
            m_new = tl.maximum(m_i, tl.maximum(tl.max(qk0, axis=1), tl.max(qk1, axis=1)) * scale_log2)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p0 = tl.exp2(tl.fma(qk0, scale_log2, -m_safe[:, None]))
            p1 = tl.exp2(tl.fma(qk1, scale_log2, -m_safe[:, None]))
            l_i = l_i * alpha + tl.sum(p0, axis=1) + tl.sum(p1, axis=1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p0.to(v0.dtype), v0, acc)
            acc = tl.dot(p1.to(v1.dtype), v1, acc)
            m_i = m_new
        else:
            for sub in tl.static_range(SUBS):
                qk, v = _kv_tile(k_cache, v_cache, pt_row, j, sub, P, lk, tok, q, scale_log2,
                                 stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                                 HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGE_SIZE, MASK)
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, qk, v, scale_log2)
    return acc, m_i, l_i


@triton.jit
def _mean_all(acc, m_i, l_i, q, k_mean, v_mean, n_u, blk0, h, lk, scale_log2, stride_mb, stride_mh,
              HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr):
    """Fold EVERY candidate ``j < n_u`` in as ``n_j`` mean tokens (the correction of an index
    without a selection bitmask, first half).

    Same logit and value as ``_mean_bits``, no membership test: the chunk loads depend on
    the loop index only, so Triton pipelines them. The selected candidates' terms are taken out
    again by ``_mean_subtract``.
    """
    j_part, log2_part, log2_full = _count_logs(lk, BLOCK_SIZE)
    for u0 in tl.range(0, n_u, BLOCK_U, num_stages=STAGES):
        # per-candidate work against chunk-relative ids (a constant arange per thread, compared
        # with scalars: 32-bit, not a widened loop counter)
        rel_j = tl.arange(0, BLOCK_U)
        cand = rel_j < n_u - u0
        km, vm = _load_means(k_mean, v_mean, blk0 + u0, rel_j, cand, h, stride_mb, stride_mh, q.dtype, HEAD_DIM)
        log2_n = tl.where(rel_j == j_part - u0, log2_part, log2_full)      # ln n_j in log2 units
        # the mask folded into a per-candidate bias (-inf = excluded): one FMA per logit
        bias = tl.where(cand, log2_n, float("-inf"))
        s = tl.fma(tl.dot(q, tl.trans(km)), scale_log2, bias[None, :])
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, vm, 1.0)
    return acc, m_i, l_i


@triton.jit
def _mean_bits(acc, m_i, l_i, q, k_mean, v_mean, bits_row, n_words, n_u, blk0, h, lk, scale_log2, stride_mb,
               stride_mh, HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               STAGES: tl.constexpr):
    """Fold the pruned candidates ``j < n_u``, ``j ∉ S``, in as ``n_j`` mean tokens.

    Logit ``τ q·k̄_j + ln n_j`` (log2 units: ``scale_log2 q·k̄_j + log2 n_j``), value ``v̄_j``;
    ``k_mean`` / ``v_mean``: ``[n_blocks, Hkv, d]``, float32 or q's dtype, rounded to q's dtype
    after the load for the tensor-core dots. Membership from the index's selection bitmask
    (``bits_row``: the segment's int32 words, bit ``j % 32`` of word ``j // 32`` set iff block
    ``j`` is selected): two scalar word loads per 64-candidate chunk, addressed by the loop
    index only, so they pipeline with the means' and nothing is taken out again afterwards.
    """
    tl.static_assert(BLOCK_U == 64)
    j_part, log2_part, log2_full = _count_logs(lk, BLOCK_SIZE)
    for u0 in tl.range(0, n_u, BLOCK_U, num_stages=STAGES):
        # per-candidate work against chunk-relative ids (a constant arange per thread, compared
        # with scalars: 32-bit, not a widened loop counter)
        rel_j = tl.arange(0, BLOCK_U)
        cand = rel_j < n_u - u0
        km, vm = _load_means(k_mean, v_mean, blk0 + u0, rel_j, cand, h, stride_mb, stride_mh, q.dtype, HEAD_DIM)
        log2_n = tl.where(rel_j == j_part - u0, log2_part, log2_full)      # ln n_j in log2 units
        # the chunk's 64 bits: two scalar words (u0 is a multiple of 64; the second may lie past
        # the row's last word, then its candidates are past n_u anyway)
        w0 = tl.load(bits_row + u0 // 32)
        w1 = tl.load(bits_row + u0 // 32 + 1, mask=u0 // 32 + 1 < n_words, other=0)
        word = tl.where(rel_j < 32, w0, w1)
        use = cand & (((word >> (rel_j % 32)) & 1) == 0)
        # the mask folded into a per-candidate bias (-inf = excluded): one FMA per logit
        bias = tl.where(use, log2_n, float("-inf"))
        s = tl.fma(tl.dot(q, tl.trans(km)), scale_log2, bias[None, :])
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, vm, 1.0)
    return acc, m_i, l_i


@triton.jit
def _clock(TIMING: tl.constexpr):
    """``%globaltimer`` (ns) when ``TIMING``, else 0 (the lab's per-phase breakdown,
    ``scripts/lab/``; False in every shipped launch)."""
    if TIMING:
        return tl.extra.cuda.globaltimer()
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _mean_subtract(acc, m_i, l_i, q, k_mean, v_mean, col_idx, start, end, n_u, blk0, h, lk, scale_log2,
                   stride_mb, stride_mh,
                   HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr):
    """Take the mean terms of the selected candidates (``col_idx[start:end]`` entries ``< n_u``)
    out of ``acc`` / ``l_i`` again (second half of ``_mean_all``; ``m_i`` is kept: it is
    already >= every candidate logit).

    Exact up to rounding: a subtracted term ``n_j e^{τ q·k̄_j}`` never exceeds the block's exact
    contribution ``Σ_t e^{τ q·k_t}`` already in ``l_i`` (Jensen), so ``l_i`` stays positive and
    the cancellation is bounded by the 16-bit rounding of ``p`` in the PV product.
    """
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    j_part, log2_part, log2_full = _count_logs(lk, BLOCK_SIZE)
    for e0 in tl.range(start, end, BLOCK_U, num_stages=STAGES):
        offs = e0 + tl.arange(0, BLOCK_U)
        js = tl.load(col_idx + offs, mask=offs < end, other=2147483647)
        sel = js < n_u
        js = tl.where(sel, js, 0)
        km, vm = _load_means(k_mean, v_mean, blk0, js, sel, h, stride_mb, stride_mh, q.dtype, HEAD_DIM)
        log2_n = tl.where(js == j_part, log2_part, log2_full)      # ln n_j in log2 units
        # the mask folded into a per-candidate bias (-inf = excluded): one FMA per logit
        bias = tl.where(sel, log2_n, float("-inf"))
        s = tl.fma(tl.dot(q, tl.trans(km)), scale_log2, bias[None, :])
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i - tl.sum(p, axis=1)
        acc = tl.dot((-p).to(vm.dtype), vm, acc)
    return acc, l_i


@triton.jit
def _attn_fwd(
    q_ptr, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, tile_request, tile_local, block_ptr,
    row_ptr, col_idx, k_mean, v_mean, sel_bits, t_ptr,
    out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_pt, stride_mb, stride_mh, n_words,
    n_tiles, tile_lo, n_programs, n_kv_heads, scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_U: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPARSE: tl.constexpr,
    MEAN_CORR: tl.constexpr,
    MC_BITS: tl.constexpr,           # the correction reads sel_bits (else: fold all, subtract the selected)
    MAIN_STAGES: tl.constexpr,
    MC_STAGES: tl.constexpr,
    PAIR_SOFTMAX: tl.constexpr,
    TIMING: tl.constexpr,            # per-program %globaltimer stamps into t_ptr (lab only)
):
    tl.static_assert(TILE_ROWS % BLOCK_M == 0)
    tl.static_assert(BLOCK_U % 64 == 0)
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    SUBS: tl.constexpr = TILE_ROWS // BLOCK_M
    # ---------------------------------------------------------------- setup
    t0 = _clock(TIMING)
    pid = tl.program_id(0)
    h = pid % n_kv_heads
    idx = n_programs - 1 - pid // n_kv_heads    # heaviest (last) tiles first, all heads together
    tile = tile_lo + idx // SUBS                # this launch covers tiles tile_lo ..
    sub = idx % SUBS
    # scalars of the whole 128-row tile (the index kernels' definition)
    b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0 = _tile_geometry(
        tile, h, n_tiles, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
        GROUP, TILE_ROWS, BLOCK_SIZE)
    n_rows = lq * GROUP
    n_full = (P + t_first + 1) // BLOCK_SIZE              # blocks 0..n_full-1: no mask needed
    rows = i * TILE_ROWS + sub * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = rows // GROUP
    head = h * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    pt_row = page_table + b.to(tl.int64) * stride_pt
    seg = h * n_tiles + tile
    if SPARSE:
        start = tl.load(row_ptr + seg)
        end = tl.load(row_ptr + seg + 1)
    else:
        start = 0
        end = n_vis
    split = tl.maximum(end - (n_vis - n_full), start)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    t1 = _clock(TIMING)
    t2 = t1
    # ---------------------------------------------------------------- exact keys
    acc, m_i, l_i = _attn_inner(acc, m_i, l_i, q, k_cache, v_cache, pt_row, col_idx, start, split,
                                P, lk, tok, scale_log2,
                                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                                HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGE_SIZE, SPARSE, 0, MAIN_STAGES, PAIR_SOFTMAX)
    t2 = _clock(TIMING)
    acc, m_i, l_i = _attn_inner(acc, m_i, l_i, q, k_cache, v_cache, pt_row, col_idx, split, end,
                                P, lk, tok, scale_log2,
                                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, h,
                                HEAD_DIM, BLOCK_N, BLOCK_SIZE, PAGE_SIZE, SPARSE, 1, MAIN_STAGES, PAIR_SOFTMAX)
    t3 = _clock(TIMING)
    t4 = t3
    # ---------------------------------------------------------------- mean correction
    if SPARSE and MEAN_CORR:
        x = P + t_first + 1
        n_u = _n_fully_seen(x, lk, BLOCK_SIZE)           # blocks with e_j <= P + t_first + 1
        n_u = tl.where(end - start >= n_vis, 0, n_u)     # everything selected: U is empty
        if MC_BITS:
            acc, m_i, l_i = _mean_bits(acc, m_i, l_i, q, k_mean, v_mean, sel_bits + seg.to(tl.int64) * n_words,
                                       n_words, n_u, blk0, h, lk, scale_log2, stride_mb, stride_mh,
                                       HEAD_DIM, BLOCK_U, BLOCK_SIZE, MC_STAGES)
            t4 = _clock(TIMING)
        else:
            acc, m_i, l_i = _mean_all(acc, m_i, l_i, q, k_mean, v_mean, n_u, blk0, h, lk, scale_log2,
                                      stride_mb, stride_mh, HEAD_DIM, BLOCK_U, BLOCK_SIZE, MC_STAGES)
            t4 = _clock(TIMING)
            # the selected candidates (< n_u) are a prefix of the segment: when the first row does
            # not see the whole request, n_u = n_full and they end at `split` (the window blocks
            # from n_full on are never candidates); nothing to take out when U is empty
            sub_end = tl.where(n_u == 0, start, tl.where(x >= lk, end, split))
            acc, l_i = _mean_subtract(acc, m_i, l_i, q, k_mean, v_mean, col_idx, start, sub_end, n_u, blk0, h, lk,
                                      scale_log2, stride_mb, stride_mh, HEAD_DIM, BLOCK_U, BLOCK_SIZE, MC_STAGES)
    t5 = _clock(TIMING)
    # ---------------------------------------------------------------- epilogue
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * LN2, float("-inf"))
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    l_off = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
    tl.store(lse_ptr + l_off, lse, mask=row_ok)
    if TIMING:
        # per program: start, after setup, loop 1, loop 2, the correction's mean loop, its
        # subtract loop, end (ns) and the SM it ran on
        t6 = _clock(TIMING)
        row = t_ptr + pid.to(tl.int64) * 8
        tl.store(row + 0, t0)
        tl.store(row + 1, t1)
        tl.store(row + 2, t2)
        tl.store(row + 3, t3)
        tl.store(row + 4, t4)
        tl.store(row + 5, t5)
        tl.store(row + 6, t6)
        tl.store(row + 7, tl.extra.cuda.smid().to(tl.int64))
