"""Triton FP8 (e4m3) block-sparse prefill attention with fused mean correction (``docs/fp8.md``).

``_attn_fwd_fp8`` is a separate kernel from ``attention_kernels._attn_fwd`` (the BF16 kernel's
compiled code is untouched by it); same grid, program order, tile geometry, loops and epilogue
(see that module's docstring), with the products of ``docs/fp8.md`` section 1:

- the Q tile (``BLOCK_M == TILE_ROWS`` packed rows: its scale is the whole tile's) is quantised
  once where it is loaded (``quant_kernels._quantize_tile``: the reference's codes, bit for bit);
- exact keys: ``Q8 K8ᵀ`` with K8 from the pre-pass buffer ``k8 [Hkv, total_k, d]`` (requests back
  to back at ``cu_seqlens_k``, no page table), logits ``(τ log2e s_q s_k) Σ q8 k8`` in fp32;
- ``P8 = e4m3(p · 256)``, the factor folded into the exponent (``exp2(ℓ - m + 8)``); ``l`` sums the
  same unquantised ``p · 256`` in fp32, so ``out = s_v acc / l`` and ``lse = m + log2 l - 8``
  (log2 units) carry no factor;
- ``P8 V8`` with V8 from the transposed buffer ``v8t [Hkv, d, total_k]``: the ``[d, BLOCK_N]``
  tile is loaded and ``tl.trans`` of it is the B operand, K-major in shared memory as Hopper's
  8-bit ``wgmma`` requires. Each request starts at a multiple of ``TMA_ALIGN`` tokens
  (``tl.multiple_of``): the tile's rows are then 16-byte cp.async copies in the software pipeline,
  where an unaligned start compiles to one-byte synchronous loads (64 per thread per step at d 128);
- precision "int8qk" (``QK_INT8``, ``docs/fp8.md`` section 10): the Q tile, ``k8`` and ``k_mean8``
  are int8 codes (``quant_kernels._quantize_tile_int8``, scales ``amax / 127``); each ``Q K^T`` /
  ``q·k̄`` dot is an exact int32 sum converted to fp32 before the same logit factor. V, P and the
  rest as above (the e4m3 dots' ``.to(tl.float32)`` is the identity: the FP8 code is unchanged);
- mean correction from the selection bitmask only: ``k_mean8 [n_blocks, Hkv, d]`` and
  ``v_mean8t [Hkv, d, n_cols]`` (both with their request's K / V scale), logit
  ``τ q·k̄ + ln n_j``; request ``b``'s first ``v_mean8t`` column is ``mean_cols[b]`` (``MEAN_VEC``:
  a multiple of ``TMA_ALIGN``, 16-byte loads; else ``block_ptr[b]``, one-byte loads).

Keys past ``Lk`` are masked (never read: the last request's block may end past ``total_k``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import quant
from .attention_kernels import LN2, _count_logs
from .index_kernels import _n_fully_seen, _tile_geometry
from .quant_kernels import TMA_ALIGN as _TMA_ALIGN
from .quant_kernels import _quantize_tile, _quantize_tile_int8

TMA_ALIGN = tl.constexpr(_TMA_ALIGN)

P_SCALE_LOG2 = tl.constexpr(float(quant.P_SCALE_LOG2))


# The softmax's exp2 (``AttnConfig.exp_impl``, constexpr ``EXP``): index into this tuple.
EXP_IMPLS = ("mufu", "f16", "poly_half")
# Lower clamp of the half-precision exp2's argument: 2^-30 is below fp16's smallest subnormal
# (2^-24), so masked (-inf) logits become exactly the p = 0 they stand for, never fp16 garbage.
EXP_F16_FLOOR = tl.constexpr(-30.0)
# Lower clamp of the polynomial exp2's argument: 2^-100 is a normal float32 (the exponent field
# arithmetic below stays in range) and 0 after the e4m3 cast.
EXP_POLY_FLOOR = tl.constexpr(-100.0)
# 1.5 * 2^23: x + this rounds x to the nearest integer n, held in the low mantissa bits.
ROUND_MAGIC = tl.constexpr(12582912.0)
# 2^f on [-1/2, 1/2], degree 3, least squares in relative error: max relative error 7.7e-5
# (e4m3's rounding step of P is 2^-3, its bound 2^-4; docs/fp8.md section 4).
C0 = tl.constexpr(0.9999289048020072)
C1 = tl.constexpr(0.6932762833525732)
C2 = tl.constexpr(0.2426046562099919)
C3 = tl.constexpr(0.05508876707445849)


@triton.jit
def _exp2_f16(x, INLINE_ASM: tl.constexpr):
    """``2^x`` of fp32 ``x`` (``x <= P_SCALE_LOG2``; ``-inf`` = masked) in half precision: fp16, same
    shape. ``INLINE_ASM``: ``ex2.approx.f16x2``; else ``tl.exp2`` of the same fp16 argument rounded
    to fp16 (the interpreter has no inline PTX). sm_90 runs it as two ``MUFU.EX2.F16``: no fewer
    MUFU operations than fp32, plus the conversions."""
    h = tl.maximum(x, EXP_F16_FLOOR).to(tl.float16)
    if INLINE_ASM:
        p = tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [h], dtype=tl.float16,
                                      is_pure=True, pack=2)
    else:
        p = tl.exp2(h.to(tl.float32)).to(tl.float16)
    return p


@triton.jit
def _exp2_poly(x):
    """``2^x`` of fp32 ``x`` (``x <= P_SCALE_LOG2``; ``-inf`` = masked) on the FMA / integer pipes,
    no MUFU: ``n = round(x)``, ``2^(x-n)`` by a degree-3 polynomial, ``n`` added to the exponent
    field. fp32, same shape; relative error <= 7.7e-5 down to ``2^-100`` (below: ``~2^-100``)."""
    x = tl.maximum(x, EXP_POLY_FLOOR)
    t = x + ROUND_MAGIC
    f = x - (t - ROUND_MAGIC)                                   # in [-1/2, 1/2]
    p = tl.fma(tl.fma(tl.fma(f, C3, C2), f, C1), f, C0)
    n_shifted = t.to(tl.int32, bitcast=True) << 23              # n in the exponent field (mod 2^32)
    return (p.to(tl.int32, bitcast=True) + n_shifted).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_p(x, EXP: tl.constexpr, INLINE_ASM: tl.constexpr):
    """``p·256 = 2^x`` of log2-unit ``x`` ``[M, N]`` by ``EXP_IMPLS[EXP]``; fp32 or fp16 (``f16``)."""
    if EXP == 1:
        p = _exp2_f16(x, INLINE_ASM)
    elif EXP == 2:
        # even columns on MUFU, odd ones by the polynomial: a thread of the wgmma accumulator
        # layout holds column pairs, so the split and join move no data between threads
        M: tl.constexpr = x.shape[0]
        N: tl.constexpr = x.shape[1]
        a, b = tl.split(tl.reshape(x, [M, N // 2, 2]))
        p = tl.reshape(tl.join(tl.exp2(a), _exp2_poly(b)), [M, N])
    else:
        p = tl.exp2(x)
    return p


@triton.jit
def _fp8_step(acc, m_i, l_i, s, vt, scale2, EXP: tl.constexpr, INLINE_ASM: tl.constexpr, FOLD: tl.constexpr):
    """One online-softmax step on log2-unit logits ``s`` ``[M, N]`` (``-inf`` = masked) and the
    transposed e4m3 values ``vt`` ``[d, N]``: ``p·256`` (``_exp2_p``) summed in fp32 into ``l``,
    its e4m3 cast into the ``P V`` product. ``FOLD``: ``s`` is the raw ``Σ q8 k8`` and the logit
    scale ``scale2`` (> 0: the Q / K scales are never 0) is applied to the row max and, in one
    FFMA with the max subtraction, to the exp2 argument; else ``scale2`` is unused."""
    if FOLD:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale2)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    if FOLD:
        x = tl.fma(s, scale2, P_SCALE_LOG2 - m_safe[:, None])     # (a constexpr indexed fails in the interpreter)
    else:
        x = s - (m_safe - P_SCALE_LOG2)[:, None]
    p = _exp2_p(x, EXP, INLINE_ASM)                              # p * 256, in (0, 256]
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(tl.float8e4nv), tl.trans(vt), acc)
    return acc, m_new, l_i


@triton.jit
def _fp8_inner(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, lo, hi, P, lk, kv0, tok, scale2, total_k,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               SPARSE: tl.constexpr, MASK: tl.constexpr, STAGES: tl.constexpr, EXP: tl.constexpr,
               INLINE_ASM: tl.constexpr, FOLD: tl.constexpr, GUARD: tl.constexpr):
    """Exact keys of blocks ``col_idx[lo:hi]`` (``SPARSE``) or ``lo..hi-1``; ``MASK`` as in
    ``attention_kernels._attn_inner``. ``k8_h`` / ``v8t_h``: the KV head's slice of the pre-pass
    buffers; ``kv0``: the request's first token slot (int64).

    ``GUARD`` (``AttnConfig.loop_guard``): the loop runs inside an explicit ``if hi > lo``, the
    same steps on the same values. Without it, the sparse loop compiles (Triton 3.6, sm_90) with
    the loop's zero-trip path on an edge block of its own that sets the ``P V`` accumulator
    registers to the initial values and joins the loop's exit before the ``wgmma`` wait: ptxas
    reports C7515 and serializes every ``wgmma`` of the kernel (each waited right after issue)."""
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    lk_al = tl.multiple_of((lk + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN, TMA_ALIGN)
    dims = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    # without GUARD ``run`` is a Python bool (the ``if`` resolved at compile time); the loop stays
    # inline here: moved into a helper function it changed ptxas' register allocation of the shipped
    # kernel (d 64) through the debug line information alone
    if GUARD:
        run = hi > lo
    else:
        run = True
    if run:
        for e in tl.range(lo, hi, num_stages=STAGES):
            if SPARSE:
                j = tl.load(col_idx + e)
            else:
                j = e
            for sub in tl.static_range(SUBS):
                pos = j * BLOCK_SIZE + sub * BLOCK_N + offs_n
                slot = kv0 + pos
                k_ptrs = k8_h + slot[:, None] * HEAD_DIM + dims[None, :]
                v_ptrs = v8t_h + dims[:, None].to(tl.int64) * total_k + slot[None, :]
                if MASK == 0:
                    k = tl.load(k_ptrs)
                    vt = tl.load(v_ptrs)
                else:
                    p_ok = pos < lk
                    k = tl.load(k_ptrs, mask=p_ok[:, None], other=0.0)
                    # V8^T masked in groups of TMA_ALIGN tokens (16-byte copies): the slots in
                    # [lk, lk_al) are the pre-pass's zero gap, their logits are -inf below
                    vt = tl.load(v_ptrs, mask=(pos < lk_al)[None, :], other=0.0)
                s = tl.dot(q8, tl.trans(k)).to(tl.float32)      # int8 (int8qk): exact int32 sum
                if not FOLD:
                    s = s * scale2
                if MASK == 1:
                    allowed = (pos[None, :] <= P + tok[:, None]) & (pos < lk)[None, :]
                    s = tl.where(allowed, s, float("-inf"))
                acc, m_i, l_i = _fp8_step(acc, m_i, l_i, s, vt, scale2, EXP, INLINE_ASM, FOLD)
    return acc, m_i, l_i


@triton.jit
def _fp8_step_pos(t, lo, col_idx, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPARSE: tl.constexpr):
    """Key positions ``[BLOCK_N]`` (int32, request-relative) of step ``t`` of ``_fp8_inner_pipe``:
    sub-tile ``t % SUBS`` of key block ``col_idx[lo + t // SUBS]`` (``SPARSE``) or ``lo + t // SUBS``,
    ``SUBS = BLOCK_SIZE // BLOCK_N``."""
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    e = lo + t // SUBS
    if SPARSE:
        j = tl.load(col_idx + e)
    else:
        j = e
    return j * BLOCK_SIZE + (t % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _fp8_k_tile(k8_h, kv0, pos, lk, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    """e4m3 ``[BLOCK_N, d]`` K tile at request positions ``pos`` (past ``lk`` zero when ``MASK``)."""
    dims = tl.arange(0, HEAD_DIM)
    k_ptrs = k8_h + (kv0 + pos)[:, None] * HEAD_DIM + dims[None, :]
    if MASK == 0:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(pos < lk)[:, None], other=0.0)
    return k


@triton.jit
def _fp8_v_tile(v8t_h, kv0, pos, lk_al, total_k, HEAD_DIM: tl.constexpr, MASK: tl.constexpr):
    """e4m3 ``[d, BLOCK_N]`` V^T tile at request positions ``pos`` (``MASK``: zero from ``lk_al``,
    the request's length rounded up to ``TMA_ALIGN``, as ``_fp8_inner``)."""
    dims = tl.arange(0, HEAD_DIM)
    v_ptrs = v8t_h + dims[:, None].to(tl.int64) * total_k + (kv0 + pos)[None, :]
    if MASK == 0:
        vt = tl.load(v_ptrs)
    else:
        vt = tl.load(v_ptrs, mask=(pos < lk_al)[None, :], other=0.0)
    return vt


@triton.jit
def _fp8_inner_pipe(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, lo, hi, P, lk, kv0, tok, scale2, total_k,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    SPARSE: tl.constexpr, MASK: tl.constexpr, STAGES: tl.constexpr, EXP: tl.constexpr,
                    INLINE_ASM: tl.constexpr, FOLD: tl.constexpr):
    """``_fp8_inner`` software-pipelined by hand (``AttnConfig.pipeline``): the loop carries the raw
    ``Σ q8 k8`` tile of the next step, so step ``t`` issues ``S_{t+1} = Q8 K8_{t+1}ᵀ`` before its
    own softmax and ``P V``; the prologue computes ``S_0``. Same operations on the same values per
    step as ``_fp8_inner`` (scale, mask, ``_fp8_step``); the last step recomputes its own logits as
    the unused "next" ones (no extra masks on the loop's loads).

    What Triton 3.6 makes of it (sm_90, ``docs/fp8.md``): the ``S_{t+1}`` wgmma is still waited
    for where it is issued (its result feeds the next step's softmax, which is not a wgmma), but
    that wait now also covers step ``t - 1``'s ``P V`` wgmma, which no longer has its own: ``P V``
    runs under the first part of the next step's softmax."""
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    lk_al = tl.multiple_of((lk + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN, TMA_ALIGN)
    n_steps = (hi - lo) * SUBS
    last = tl.maximum(n_steps - 1, 0)
    if n_steps > 0:
        k = _fp8_k_tile(k8_h, kv0, _fp8_step_pos(0, lo, col_idx, BLOCK_N, BLOCK_SIZE, SPARSE), lk, HEAD_DIM, MASK)
        s_next = tl.dot(q8, tl.trans(k)).to(tl.float32)
        for t in tl.range(0, n_steps, num_stages=STAGES):
            s = s_next
            pos = _fp8_step_pos(t, lo, col_idx, BLOCK_N, BLOCK_SIZE, SPARSE)
            vt = _fp8_v_tile(v8t_h, kv0, pos, lk_al, total_k, HEAD_DIM, MASK)
            pos_next = _fp8_step_pos(tl.minimum(t + 1, last), lo, col_idx, BLOCK_N, BLOCK_SIZE, SPARSE)
            k = _fp8_k_tile(k8_h, kv0, pos_next, lk, HEAD_DIM, MASK)
            s_next = tl.dot(q8, tl.trans(k)).to(tl.float32)
            if not FOLD:
                s = s * scale2
            if MASK == 1:
                allowed = (pos[None, :] <= P + tok[:, None]) & (pos < lk)[None, :]
                s = tl.where(allowed, s, float("-inf"))
            acc, m_i, l_i = _fp8_step(acc, m_i, l_i, s, vt, scale2, EXP, INLINE_ASM, FOLD)
    return acc, m_i, l_i


@triton.jit
def _fp8_means(acc, m_i, l_i, q8, k_mean8, v_mean8t_h, bits_row, n_words, n_u, blk0, col0, h, lk, scale2,
               stride_mb, stride_mh, n_blocks_pad,
               HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_SIZE: tl.constexpr, STAGES: tl.constexpr,
               EXP: tl.constexpr, INLINE_ASM: tl.constexpr, MEAN_VEC: tl.constexpr):
    """The pruned candidates ``j < n_u``, ``j ∉ S`` (selection bitmask, as
    ``attention_kernels._mean_bits``) as ``n_j`` e4m3 mean tokens. ``blk0``: the request's first
    row of ``k_mean8``; ``col0``: its first column of ``v_mean8t`` (``MEAN_VEC``: a multiple of
    ``TMA_ALIGN``, and the ``[d, BLOCK_U]`` tile is masked in groups of ``TMA_ALIGN`` columns: those
    past ``n_u`` are the request's later blocks or the zero gap, their logits ``-inf``)."""
    tl.static_assert(BLOCK_U == 64)
    j_part, log2_part, log2_full = _count_logs(lk, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    n_u_al = tl.multiple_of((n_u + TMA_ALIGN - 1) // TMA_ALIGN * TMA_ALIGN, TMA_ALIGN)
    for u0 in tl.range(0, n_u, BLOCK_U, num_stages=STAGES):
        rel_j = tl.arange(0, BLOCK_U)
        cand = rel_j < n_u - u0
        blk = (blk0 + u0).to(tl.int64) + rel_j
        km = tl.load(k_mean8 + blk[:, None] * stride_mb + h * stride_mh + dims[None, :], mask=cand[:, None],
                     other=0.0)
        if MEAN_VEC:
            col = tl.multiple_of(col0 + u0, TMA_ALIGN).to(tl.int64) + rel_j
            vmt = tl.load(v_mean8t_h + dims[:, None].to(tl.int64) * n_blocks_pad + col[None, :],
                          mask=(rel_j < tl.multiple_of(n_u_al - u0, TMA_ALIGN))[None, :], other=0.0)
        else:
            vmt = tl.load(v_mean8t_h + dims[:, None].to(tl.int64) * n_blocks_pad + blk[None, :], mask=cand[None, :],
                          other=0.0)
        log2_n = tl.where(rel_j == j_part - u0, log2_part, log2_full)
        w0 = tl.load(bits_row + u0 // 32)
        w1 = tl.load(bits_row + u0 // 32 + 1, mask=u0 // 32 + 1 < n_words, other=0)
        word = tl.where(rel_j < 32, w0, w1)
        use = cand & (((word >> (rel_j % 32)) & 1) == 0)
        bias = tl.where(use, log2_n, float("-inf"))
        s = tl.fma(tl.dot(q8, tl.trans(km)).to(tl.float32), scale2, bias[None, :])
        acc, m_i, l_i = _fp8_step(acc, m_i, l_i, s, vmt, scale2, EXP, INLINE_ASM, False)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_fp8(
    q_ptr, k8, v8t, k_mean8, v_mean8t, k_scale, v_scale, cu_seqlens_k,
    mean_cols, seq_lens, cu_seqlens_q, tile_request, tile_local, block_ptr,
    row_ptr, col_idx, sel_bits, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
    stride_mb, stride_mh, n_words, total_k, n_blocks_pad,
    n_tiles, n_programs, n_kv_heads, scale_log2,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_U: tl.constexpr,
    SPARSE: tl.constexpr,
    MEAN_CORR: tl.constexpr,
    MAIN_STAGES: tl.constexpr,
    MC_STAGES: tl.constexpr,
    EXP: tl.constexpr,
    INLINE_ASM: tl.constexpr,
    FOLD_SCALE: tl.constexpr,
    PIPELINE: tl.constexpr,
    MEAN_VEC: tl.constexpr,
    LOOP_GUARD: tl.constexpr,
    QK_INT8: tl.constexpr = False,
):
    tl.static_assert(BLOCK_M == TILE_ROWS)       # the Q scale is the whole tile's
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    # ---------------------------------------------------------------- setup
    pid = tl.program_id(0)
    h = pid % n_kv_heads
    tile = n_programs - 1 - pid // n_kv_heads    # heaviest (last) tiles first, all heads together
    b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0 = _tile_geometry(
        tile, h, n_tiles, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
        GROUP, TILE_ROWS, BLOCK_SIZE)
    n_rows = lq * GROUP
    n_full = (P + t_first + 1) // BLOCK_SIZE
    rows = i * TILE_ROWS + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = rows // GROUP
    head = h * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    if QK_INT8:
        q8, s_q = _quantize_tile_int8(q.to(tl.float32))
    else:
        q8, s_q = _quantize_tile(q.to(tl.float32))
    s_k = tl.load(k_scale + b * n_kv_heads + h)
    s_v = tl.load(v_scale + b * n_kv_heads + h)
    scale2 = scale_log2 * s_q * s_k                  # log2-unit logit per unit of Σ q8 k8
    kv0 = tl.multiple_of(tl.load(cu_seqlens_k + b).to(tl.int64), TMA_ALIGN)   # a request's first slot
    total_k = tl.multiple_of(total_k.to(tl.int64), TMA_ALIGN)          # the V8^T row stride
    n_blocks_pad = tl.multiple_of(n_blocks_pad.to(tl.int64), TMA_ALIGN)
    k8_h = k8 + h.to(tl.int64) * total_k * HEAD_DIM
    v8t_h = v8t + h.to(tl.int64) * HEAD_DIM * total_k
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
    # ---------------------------------------------------------------- exact keys
    if PIPELINE:
        acc, m_i, l_i = _fp8_inner_pipe(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, start, split, P, lk, kv0, tok,
                                        scale2, total_k, HEAD_DIM, BLOCK_N, BLOCK_SIZE, SPARSE, 0, MAIN_STAGES, EXP,
                                        INLINE_ASM, FOLD_SCALE)
        acc, m_i, l_i = _fp8_inner_pipe(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, split, end, P, lk, kv0, tok,
                                        scale2, total_k, HEAD_DIM, BLOCK_N, BLOCK_SIZE, SPARSE, 1, MAIN_STAGES, EXP,
                                        INLINE_ASM, FOLD_SCALE)
    else:
        acc, m_i, l_i = _fp8_inner(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, start, split, P, lk, kv0, tok, scale2,
                                   total_k, HEAD_DIM, BLOCK_N, BLOCK_SIZE, SPARSE, 0, MAIN_STAGES, EXP, INLINE_ASM, FOLD_SCALE,
                                   LOOP_GUARD)
        acc, m_i, l_i = _fp8_inner(acc, m_i, l_i, q8, k8_h, v8t_h, col_idx, split, end, P, lk, kv0, tok, scale2,
                                   total_k, HEAD_DIM, BLOCK_N, BLOCK_SIZE, SPARSE, 1, MAIN_STAGES, EXP, INLINE_ASM, FOLD_SCALE,
                                   LOOP_GUARD)
    # ---------------------------------------------------------------- mean correction
    if SPARSE and MEAN_CORR:
        n_u = _n_fully_seen(P + t_first + 1, lk, BLOCK_SIZE)
        n_u = tl.where(end - start >= n_vis, 0, n_u)
        col0 = blk0
        if MEAN_VEC:
            col0 = tl.multiple_of(tl.load(mean_cols + b), TMA_ALIGN)
        acc, m_i, l_i = _fp8_means(acc, m_i, l_i, q8, k_mean8, v_mean8t + h.to(tl.int64) * HEAD_DIM * n_blocks_pad,
                                   sel_bits + seg.to(tl.int64) * n_words, n_words, n_u, blk0,
                                   col0, h, lk,
                                   scale2, stride_mb, stride_mh, n_blocks_pad, HEAD_DIM, BLOCK_U, BLOCK_SIZE,
                                   MC_STAGES, EXP, INLINE_ASM, MEAN_VEC)
    # ---------------------------------------------------------------- epilogue
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc * (s_v / l_safe)[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe) - P_SCALE_LOG2) * LN2, float("-inf"))
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    l_off = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
    tl.store(lse_ptr + l_off, lse, mask=row_ok)
