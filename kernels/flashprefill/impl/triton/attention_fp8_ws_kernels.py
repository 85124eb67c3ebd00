"""Gluon (Triton's explicit-layout dialect) FP8 (e4m3) block-sparse prefill attention for sm_90:
warp-specialised, FA3's structure (``docs/fp8.md`` section 11; lab history:
``docs/lab/kernel-notes.md`` "Version 7").

The same products, scales, softmax and output as ``attention_fp8_kernels._attn_fwd_fp8`` with
``fold_scale`` (``docs/fp8.md`` sections 1-4: ``P8 = e4m3(p·256)``, ``lse = m + log2 l - 8``), on the
same pre-pass buffers (``k8 [Hkv, total_k, d]``, ``v8t [Hkv, d, total_k]``, the aligned
``v_mean8t`` columns of ``quant_kernels.quantize_means``), grid and program order (one program per
(Q tile, KV head), heaviest tiles first). What differs is how the work is spread over warps:

- the default warps load the tile's 128 GQA-packed Q rows, quantise them with one scale
  (``docs/fp8.md`` section 3, ``div_rn`` as ``quant_kernels._quantize_tile``) into shared memory,
  then the program splits (``gl.warp_specialize``) into
- a **producer** (1 warp, 24 registers): walks the tile's CSR row and copies each key block's
  ``K8 [B, d]`` / ``V8ᵀ [d, B]`` by TMA into a ``STAGES``-deep ring (``ready`` / ``empty`` mbarriers),
  then the correction's mean keys / values in chunks of ``B`` candidates (``k_mean8`` rows,
  ``v_mean8t`` columns) through the same ring;
- **two consumers** (4 warps each, 240 registers): rows 0-63 and 64-127 of the tile. Each step
  issues ``S_t = Q8 K8_tᵀ`` and the previous step's ``acc += P8_{t-1} V8_{t-1}`` as async wgmma,
  waits for ``S_t`` only, runs the softmax of ``S_t`` while ``P V`` runs on the tensor cores, then
  waits for ``P V``, releases its stage and rescales. Mean-key steps add ``log2 n_j`` (in units of
  ``S``: divided by the logit scale, so every step is one FFMA per logit) on the pruned candidates
  (selection bit 0) and ``-inf`` elsewhere. ``PINGPONG`` orders the two consumers' issues with an
  mbarrier pair (FA3's inter-warpgroup schedule; measured slower here, kept for the lab).

``V_PERM`` (``Fp8KV.v_perm``, the pre-pass's choice for this kernel): ``v8t`` / ``v_mean8t`` hold
each 16 keys in the order of the ``S`` accumulator's registers (``quant_kernels.wgmma_slot``), so
``P8`` goes to the ``P V`` wgmma as the registers the softmax left, four codes packed per register
(``_e4m3x4``), with no shuffle; without it, a layout conversion of the codes each step.

Shapes: d 64 or 128, key blocks ``B = 128``, 128-row tiles (``host_fp8.launch_attention_fp8_ws``
checks them). Gluon has no interpreter: these kernels run on an sm_90 GPU only
(``tests/gpu/test_fp8_ws.py``); ``scripts/lab/compile_sm90.py``-style compilation for sm_90 runs
on any machine (``tests/test_fp8_ws_dispatch.py``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ... import quant

E4M3_MAX = gl.constexpr(quant.E4M3_MAX)
AMAX_FLOOR = gl.constexpr(quant.AMAX_FLOOR)
P_SCALE_LOG2 = gl.constexpr(float(quant.P_SCALE_LOG2))
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _clock(TIMING: gl.constexpr):
    """``%globaltimer`` (ns) when ``TIMING``, else 0: the lab's per-phase stamps (``timing`` of
    ``host_fp8.launch_attention_fp8_ws``), compiled away in every shipped launch."""
    if TIMING:
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)
    else:
        return gl.to_tensor(0).to(gl.int64)


@gluon.jit
def _e4m3x4(x):
    """``x.to(float8e4nv)`` (round to nearest, saturating: what Triton emits for e4m3 on sm_90), four
    values at a time into one 32-bit register: a thread's four consecutive values of an 8-bit A operand
    (``DotOperandLayout`` ``k_width=4``) come out as the register the wgmma reads."""
    return gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
        "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [x], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _producer(a, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, PINGPONG: gl.constexpr):
    """The TMA partition (1 warp): step ``t`` waits for its stage to be released by both consumers,
    then copies exact block ``col_idx[start + t]`` (``t < end - start``) or mean-key chunk ``t - (end -
    start)`` into it, both copies signalling ``ready``. ``a``: the program's values (``_attn_fwd_fp8_ws``)."""
    (k_desc, v_desc, km_desc, vm_desc, q_smem, k_bufs, v_bufs, ready, empty, turn, col_idx, start, split, end,
     k_row0, v_row0, kv0, blk0, col0, n_u, bits_row, n_words, j_part, log2_part, log2_full,
     P, lk, tile_row0, q_start, lq, h, scale2, s_v, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh,
     t_row, t_start) = a
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    n_exact = end - start
    for t in range(n_exact + gl.cdiv(n_u, BLOCK_SIZE)):
        s = t % STAGES
        ph = (t // STAGES) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)          # a fresh barrier passes parity 1
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        if t < n_exact:
            j = gl.load(col_idx + start + t)
            tma.async_copy_global_to_shared(k_desc, [k_row0 + j * BLOCK_SIZE, 0], ready.index(s), k_bufs.index(s))
            tma.async_copy_global_to_shared(v_desc, [v_row0, kv0 + j * BLOCK_SIZE], ready.index(s), v_bufs.index(s))
        else:
            # a chunk of BLOCK_SIZE mean keys / values (the correction's candidates u0 ..)
            u0 = (t - n_exact) * BLOCK_SIZE
            tma.async_copy_global_to_shared(km_desc, [blk0 + u0, v_row0], ready.index(s), k_bufs.index(s))
            tma.async_copy_global_to_shared(vm_desc, [v_row0, col0 + u0], ready.index(s), v_bufs.index(s))


@gluon.jit
def _consumer(a, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, PINGPONG: gl.constexpr,
              CID: gl.constexpr, TIMING: gl.constexpr, V_PERM: gl.constexpr):
    """Consumer ``CID`` (one warpgroup): rows ``64 CID .. 64 CID + 63`` of the Q tile through every
    step of the ring (module docstring), then their output and LSE. ``TIMING`` (consumer 0 only):
    ``%globaltimer`` stamps into the program's row of ``t_row`` (``_attn_fwd_fp8_ws``)."""
    (k_desc, v_desc, km_desc, vm_desc, q_smem, k_bufs, v_bufs, ready, empty, turn, col_idx, start, split, end,
     k_row0, v_row0, kv0, blk0, col0, n_u, bits_row, n_words, j_part, log2_part, log2_full,
     P, lk, tile_row0, q_start, lq, h, scale2, s_v, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh,
     t_row, t_start) = a
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    gl.static_assert(BLOCK_SIZE == 128)          # one chunk of mean keys = 4 bitmask words
    M: gl.constexpr = 64
    # S [64, B] and the accumulator [64, d]: one warpgroup's wgmma each (e4m3: K 32 per instruction)
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_SIZE, 32])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=4)
    row_l: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_l: gl.constexpr = gl.SliceLayout(0, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    q = q_smem.slice(CID * M, M, dim=0)
    rows = tile_row0 + CID * M + gl.arange(0, M, layout=row_l)
    tok = rows // GROUP
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([M], gl.float32, layout=row_l)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=mma_o)
    zero = gl.zeros([M, BLOCK_SIZE], gl.float32, layout=mma_s)
    if V_PERM:
        # P stays float32 between steps and becomes codes where the P V wgmma reads it: carried across
        # the loop as bytes, Triton keeps each code in its own register and packs them again (~110
        # PRMT / LOP3 per step)
        p8 = gl.convert_layout(zero, p_layout)
    else:
        p8 = gl.convert_layout(zero.to(gl.float8e4nv), p_layout)
    cols = gl.arange(0, BLOCK_SIZE, layout=col_l)
    n_exact = end - start
    n = n_exact + gl.cdiv(n_u, BLOCK_SIZE)
    inv_scale2 = 1.0 / scale2
    STAMP: gl.constexpr = TIMING and CID == 0
    t_loop = _clock(STAMP)
    t_split = t_loop
    for t in range(n):
        if STAMP:
            t_split = gl.where(t == n_exact, _clock(STAMP), t_split)     # the first correction step
        s = t % STAGES
        # this step's scalars, loaded before the waits: the block id (the diagonal steps' mask) or
        # the chunk's 4 selection words (mean-key steps)
        exact = t < n_exact
        j = gl.load(col_idx + start + t, mask=exact, other=0)
        c = gl.maximum(t - n_exact, 0) * 4
        w0 = gl.load(bits_row + c, mask=(not exact) & (c < n_words), other=0)
        w1 = gl.load(bits_row + c + 1, mask=(not exact) & (c + 1 < n_words), other=0)
        w2 = gl.load(bits_row + c + 2, mask=(not exact) & (c + 2 < n_words), other=0)
        w3 = gl.load(bits_row + c + 3, mask=(not exact) & (c + 3 < n_words), other=0)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn.index(CID), (t & 1) ^ (1 - CID))
        S = warpgroup_mma(q, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        # the previous step's P V (at t == 0: zero codes times this step's V, a finite tile)
        sp = gl.maximum(t - 1, 0) % STAGES
        if V_PERM:
            acc = warpgroup_mma(_e4m3x4(p8), v_bufs.index(sp).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(p8, v_bufs.index(sp).permute((1, 0)), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - CID), count=1)
        S = warpgroup_mma_wait(num_outstanding=1, deps=(S, ))
        if exact:
            if start + t >= split:
                pos = j * BLOCK_SIZE + cols
                allowed = (pos[None, :] <= P + tok[:, None]) & (pos < lk)[None, :]
                S = gl.where(allowed, S, float("-inf"))
        else:
            # mean keys: logit tau q.k_mean + log2 n_j on the pruned candidates (selection bit 0), -inf
            # elsewhere; the offset enters in units of S (divided by the logit scale) so the step stays
            # one FFMA per logit
            u = c * 32 + cols
            w = gl.where(cols < 32, w0, gl.where(cols < 64, w1, gl.where(cols < 96, w2, w3)))
            use = (u < n_u) & (((w >> (cols % 32)) & 1) == 0)
            log2_n = gl.where(u == j_part, log2_part, log2_full)
            # where(), not + (-inf): a NaN mean-key code past n_u (a later block, another request) must
            # not reach these rows, as the Triton kernel's masked loads keep it out
            S = gl.where(use[None, :], S + (log2_n * inv_scale2)[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(S, axis=1) * scale2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(S * scale2 + (P_SCALE_LOG2 - m_safe)[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(sp), count=1, pred=t > 0)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        if V_PERM:
            # v8t / v_mean8t hold the keys in the wgmma order (quant_kernels.wgmma_slot): column
            # 16h + 4q + 2a + b of the A operand is S column 16h + 8a + 2q + b, which the thread
            # already holds, so no data moves (assert_trivial); without it the conversion is
            # shuffles and byte permutes (docs/fp8.md section 11)
            p8 = gl.reshape(p, [M, BLOCK_SIZE // 16, 2, 4, 2])
            p8 = gl.reshape(gl.permute(p8, [0, 1, 3, 2, 4]), [M, BLOCK_SIZE])
            p8 = gl.convert_layout(p8, p_layout, assert_trivial=True)
        else:
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        m_i = m_new
    if n > 0:
        sl = (n - 1) % STAGES
        if V_PERM:
            acc = warpgroup_mma(_e4m3x4(p8), v_bufs.index(sl).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(p8, v_bufs.index(sl).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    t_done = _clock(STAMP)
    if STAMP:
        t_split = gl.where(n_exact >= n, t_done, t_split)                  # no correction step
    m_i = gl.convert_layout(m_i, row_o)
    l_i = gl.convert_layout(l_i, row_o)
    rows = gl.convert_layout(rows, row_o)
    tok = rows // GROUP
    has = l_i > 0.0
    l_safe = gl.where(has, l_i, 1.0)
    out = acc * (s_v / l_safe)[:, None]
    lse = gl.where(has, (m_i + gl.log2(l_safe) - P_SCALE_LOG2) * LN2, float("-inf"))
    row_ok = rows < lq * GROUP
    head = h * GROUP + rows % GROUP
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma_o))
    o_off = (q_start + tok).to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    gl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    l_off = (q_start + tok).to(gl.int64) * stride_lt + head.to(gl.int64) * stride_lh
    gl.store(lse_ptr + l_off, lse, mask=row_ok)
    if STAMP:
        # [program start, consumer start, first correction step (= loop end without one), loop end,
        #  stores done, SM id, exact steps, correction steps]
        t_end = _clock(STAMP)
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=True, pack=1)
        gl.store(t_row + 0, t_start)
        gl.store(t_row + 1, t_loop)
        gl.store(t_row + 2, t_split)
        gl.store(t_row + 3, t_done)
        gl.store(t_row + 4, t_end)
        gl.store(t_row + 5, sm.to(gl.int64))
        gl.store(t_row + 6, n_exact.to(gl.int64))
        gl.store(t_row + 7, (n - n_exact).to(gl.int64))


@gluon.jit
def _consumer0(a, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, PINGPONG: gl.constexpr,
               TIMING: gl.constexpr, V_PERM: gl.constexpr):
    _consumer(a, GROUP, HEAD_DIM, BLOCK_SIZE, PINGPONG, 0, TIMING, V_PERM)


@gluon.jit
def _consumer1(a, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, PINGPONG: gl.constexpr,
               TIMING: gl.constexpr, V_PERM: gl.constexpr):
    _consumer(a, GROUP, HEAD_DIM, BLOCK_SIZE, PINGPONG, 1, TIMING, V_PERM)


@gluon.jit
def _attn_fwd_fp8_ws(q_ptr, k_desc, v_desc, km_desc, vm_desc, k_scale, v_scale, cu_seqlens_k, seq_lens, cu_seqlens_q,
            tile_request, tile_local, block_ptr, mean_cols, row_ptr, col_idx, sel_bits, out_ptr, lse_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
            n_words, total_k, n_tiles, n_programs, n_kv_heads, scale_log2,
            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, TILE_ROWS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
            STAGES: gl.constexpr, PINGPONG: gl.constexpr, MEAN_CORR: gl.constexpr, CONSUMER_REGS: gl.constexpr,
            PRODUCER_REGS: gl.constexpr, V_PERM: gl.constexpr, t_ptr=None, TIMING: gl.constexpr = False):
    gl.static_assert(TILE_ROWS == 2 * 64)
    t_start = _clock(TIMING)
    pid = gl.program_id(0)
    h = pid % n_kv_heads
    tile = n_programs - 1 - pid // n_kv_heads
    b = gl.load(tile_request + tile)
    i = gl.load(tile_local + tile)
    q_start = gl.load(cu_seqlens_q + b)
    lq = gl.load(cu_seqlens_q + b + 1) - q_start
    lk = gl.load(seq_lens + b)
    P = lk - lq
    row_end = gl.minimum(i * TILE_ROWS + TILE_ROWS, lq * GROUP)
    t_first = (i * TILE_ROWS) // GROUP
    t_last = (row_end - 1) // GROUP
    n_vis = (P + t_last) // BLOCK_SIZE + 1
    n_full = (P + t_first + 1) // BLOCK_SIZE
    seg = h * n_tiles + tile
    start = gl.load(row_ptr + seg)
    end = gl.load(row_ptr + seg + 1)
    split = gl.maximum(end - (n_vis - n_full), start)
    # the mean correction's candidates: blocks every row of the tile sees whole (none when the CSR
    # row holds every visible block), as attention_fp8_kernels._attn_fwd_fp8
    n_u = 0
    if MEAN_CORR:
        x = P + t_first + 1
        n_u = gl.where(x >= lk, (lk + BLOCK_SIZE - 1) // BLOCK_SIZE, x // BLOCK_SIZE)
        n_u = gl.where(end - start >= n_vis, 0, n_u)
    j_part = (lk + BLOCK_SIZE - 1) // BLOCK_SIZE - 1
    log2_part = gl.log2((lk - j_part * BLOCK_SIZE).to(gl.float32))
    log2_full = gl.log2(gl.full([], BLOCK_SIZE, gl.float32))
    blk0 = gl.load(block_ptr + b)
    col0 = gl.load(mean_cols + b)
    bits_row = sel_bits + seg.to(gl.int64) * n_words
    # the Q tile, quantised with one scale (docs/fp8.md section 3), into shared memory
    ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = i * TILE_ROWS + gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(1, ql))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ql))
    row_ok = rows < lq * GROUP
    tok = rows // GROUP
    head = h * GROUP + rows % GROUP
    q_off = (q_start + tok).to(gl.int64) * stride_qt + head.to(gl.int64) * stride_qh
    q = gl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0).to(gl.float32)
    a = gl.abs(q)
    a = gl.where(a == a, a, 0.0)
    amax = gl.max(gl.max(a, axis=1), axis=0)
    tiny = amax < AMAX_FLOOR
    safe = gl.where(tiny, 1.0, amax)
    s_q = gl.where(tiny, 1.0, gl.div_rn(safe, E4M3_MAX))
    inv = gl.where(tiny, 1.0, gl.div_rn(gl.full([], E4M3_MAX, gl.float32), safe))
    y = q * inv
    y = gl.where(y > E4M3_MAX, E4M3_MAX, gl.where(y < -E4M3_MAX, -E4M3_MAX, y))
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [TILE_ROWS, HEAD_DIM], k_desc.layout, y.to(gl.float8e4nv))
    fence_async_shared()
    s_k = gl.load(k_scale + b * n_kv_heads + h)
    s_v = gl.load(v_scale + b * n_kv_heads + h)
    scale2 = scale_log2 * s_q * s_k
    kv0 = gl.load(cu_seqlens_k + b)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_SIZE, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HEAD_DIM, BLOCK_SIZE], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)       # both consumers release a stage
    if PINGPONG:
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
    else:
        turn = ready                                  # never waited on: no barrier of its own
    args = (k_desc, v_desc, km_desc, vm_desc, q_smem, k_bufs, v_bufs, ready, empty, turn, col_idx, start, split,
            end, h * total_k + kv0, h * HEAD_DIM, kv0, blk0, col0, n_u, bits_row, n_words, j_part, log2_part,
            log2_full, P, lk, i * TILE_ROWS, q_start, lq, h, scale2, s_v,
            out_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh,
            t_ptr + pid.to(gl.int64) * 8 if TIMING else out_ptr, t_start)
    gl.warp_specialize([(_consumer0, (args, GROUP, HEAD_DIM, BLOCK_SIZE, PINGPONG, TIMING, V_PERM)),
                        (_consumer1, (args, GROUP, HEAD_DIM, BLOCK_SIZE, PINGPONG, TIMING, V_PERM)),
                        (_producer, (args, GROUP, HEAD_DIM, BLOCK_SIZE, PINGPONG))], [4, 1],
                       [CONSUMER_REGS, PRODUCER_REGS])
