"""Lab probe: the sparse exact-key loop (no mean correction) with TMA tensor descriptors and
Triton's warp specialisation on sm_90, in FP8 (e4m3) and BF16 (``docs/lab/kernel-notes.md``
"Version 6 probe").

    PYTHONPATH=kernels:. python scripts/lab/ws_probe.py compile [--sass DIR]
    PYTHONPATH=kernels:. python scripts/lab/ws_probe.py time --lens 32k,128k [--out DIR]

``compile`` (no GPU needed): compiles every probe configuration for sm_90 with Triton's bundled
ptxas (as ``compile_sm90.py``) and prints, per configuration, whether the loop was warp-specialised
(``ttg.warp_specialize`` in the TTGIR), its partitions, registers, shared memory, spills, the
``SETMAXNREG`` count and the per-loop SASS counts of ``sass_loops.py`` (wgmma and their waits), and
the ptxas warnings; a configuration that does not compile prints the pass's error.

``time`` (H200): for each length (32 query / 8 KV heads, d 128, ``flashprefill.bench``'s synthetic
inputs, ``SparseConfig(mean_correction=False)``, index and FP8 pre-pass built beforehand): the
shipped BF16 and FP8 attention alone, each probe configuration's time, its x-factor against the
shipped kernel of its precision and the relative L2 of its output against it. Medians of
``triton.testing.do_bench``; writes ``ws_probe.json`` into ``--out``.

The probe kernel ``_ws_fwd`` packs a Q tile as ``_attn_fwd_fp8`` does (``_tile_geometry``: one
program per (tile, KV head), heaviest tiles first, ``BLOCK_M == TILE_ROWS`` GQA-packed rows) and
walks the tile's CSR row ``col_idx[row_ptr[seg]:row_ptr[seg+1]]`` (``host.build_index``) in two
loops: the blocks every row sees whole (no mask), then the diagonal blocks (causal mask and
``pos < Lk``). Each loop runs over steps ``t`` of ``BLOCK_N`` keys, the block id loaded inside the
loop (``col_idx[lo + t // SUBS]``); the unmasked loop is the one ``tl.range(...,
warp_specialize=WS)`` marks. Keys are read through ``tl.make_tensor_descriptor`` (TMA) on one KV
head's 2-D slice:

- FP8: ``k8[h]`` ``[total_k, d]`` and ``v8t[h]`` ``[d, total_k]`` (the pre-pass buffers, request
  ``b`` from ``cu_seqlens_k[b]``), Q quantised per tile, products and scales as ``_attn_fwd_fp8``
  (``_fp8_step``: ``P8 = e4m3(p·256)``, ``lse = m + log2 l - 8``);
- BF16: ``k16[h]`` / ``v16[h]`` ``[total_k, d]`` (``bf16_operands``: the paged caches gathered into
  the same layout), the softmax of ``_attn_fwd`` (``_softmax_step``).

Keys past ``Lk`` read the next request's slots or TMA's zero fill; their logits are ``-inf``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl

from flashprefill.impl.triton import attention_fp8_kernels as fk
from flashprefill.impl.triton import attention_kernels as ak
from flashprefill.impl.triton.index_kernels import _tile_geometry
from flashprefill.impl.triton.quant_kernels import _quantize_tile

LN2 = ak.LN2
P_SCALE_LOG2 = fk.P_SCALE_LOG2


@triton.jit
def _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, lo, hi, jd, P, lk, kv0, tok, scale2,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, FP8: tl.constexpr,
             WS: tl.constexpr, STAGES: tl.constexpr):
    """Exact keys of blocks ``col_idx[lo:hi]`` in steps of ``BLOCK_N`` keys; ``MASK``: the causal
    mask ``p <= P + t`` and ``p < Lk`` on every step. ``kv0``: the request's first slot (int32);
    ``scale2``: the log2-unit logit per unit of ``q kᵀ`` (FP8: ``τ log2e s_q s_k``).

    The mask's key positions come from the loop index, not from ``col_idx``: entry ``e`` is masked
    as block ``jd + e`` (``jd = n_vis - end``). The CSR row ends with the partially visible blocks
    ``n_full .. n_vis-1`` in order (always selected: the local window), so this is the block itself
    where the mask bites, and a block below ``n_full`` (fully visible) for every earlier entry,
    where the mask keeps every key as the real block's would. The consumer warps then need no
    value loaded by the producer (Triton 3.6's Hopper pass only passes TMA-loaded buffers from the
    producer partition to the consumers)."""
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    n_steps = (hi - lo) * SUBS
    for t in tl.range(0, n_steps, num_stages=STAGES, warp_specialize=WS):
        e = lo + t // SUBS
        sub = t % SUBS
        j = tl.load(col_idx + e)
        first = j * BLOCK_SIZE + sub * BLOCK_N
        k = k_desc.load([kv0 + first, 0])
        s = tl.dot(q, tl.trans(k))
        if FP8:
            vt = v_desc.load([0, kv0 + first])
            s = s * scale2
        else:
            v = v_desc.load([kv0 + first, 0])
        if MASK:
            pos = (jd + e) * BLOCK_SIZE + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            allowed = (pos[None, :] <= P + tok[:, None]) & (pos < lk)[None, :]
            s = tl.where(allowed, s, float("-inf"))
        if FP8:
            acc, m_i, l_i = fk._fp8_step(acc, m_i, l_i, s, vt, scale2, 0, False, False)
        else:
            acc, m_i, l_i = ak._softmax_step(acc, m_i, l_i, s, v, scale2)
    return acc, m_i, l_i


@triton.jit
def _ws_fwd(qp_ptr, k_ptr, v_ptr, k_scale, v_scale, cu_seqlens_k, seq_lens, cu_seqlens_q, tile_request,
            tile_local, block_ptr, row_ptr, col_idx, out_ptr, lse_ptr,
            stride_ot, stride_oh, stride_lt, stride_lh,
            total_k, total_q, n_tiles, n_programs, n_kv_heads, scale_log2,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, WS: tl.constexpr,
            STAGES: tl.constexpr, ONE_LOOP: tl.constexpr):
    tl.static_assert(BLOCK_M == TILE_ROWS)
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    pid = tl.program_id(0)
    h = pid % n_kv_heads
    tile = n_programs - 1 - pid // n_kv_heads
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
    # the Q tile by TMA from the GQA-packed copy ``qp [Hkv, total_q * GROUP, d]`` (``pack_q``):
    # request rows from q_start * GROUP, the tile's rows contiguous; the next request's rows (past
    # n_rows) are zeroed as the shipped kernel's masked load does
    q_desc = tl.make_tensor_descriptor(qp_ptr + h.to(tl.int64) * total_q * GROUP * HEAD_DIM,
                                       shape=[total_q * GROUP, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    q = q_desc.load([q_start * GROUP + i * TILE_ROWS, 0])
    q = tl.where(row_ok[:, None], q, 0.0)
    kv0 = tl.load(cu_seqlens_k + b)
    head_base = h.to(tl.int64) * total_k * HEAD_DIM
    k_desc = tl.make_tensor_descriptor(k_ptr + head_base, shape=[total_k, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    if FP8:
        q, s_q = _quantize_tile(q.to(tl.float32))
        s_k = tl.load(k_scale + b * n_kv_heads + h)
        s_v = tl.load(v_scale + b * n_kv_heads + h)
        scale2 = scale_log2 * s_q * s_k
        v_desc = tl.make_tensor_descriptor(v_ptr + head_base, shape=[HEAD_DIM, total_k], strides=[total_k, 1],
                                           block_shape=[HEAD_DIM, BLOCK_N])
    else:
        s_v = 1.0
        scale2 = scale_log2
        v_desc = tl.make_tensor_descriptor(v_ptr + head_base, shape=[total_k, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    seg = h * n_tiles + tile
    start = tl.load(row_ptr + seg)
    end = tl.load(row_ptr + seg + 1)
    split = tl.maximum(end - (n_vis - n_full), start)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ONE_LOOP:
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, start, end, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 1, FP8, WS, STAGES)
    else:
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, start, split, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 0, FP8, WS, STAGES)
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, split, end, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 1, FP8, False, STAGES)
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc * (s_v / l_safe)[:, None]
    if FP8:
        lse = tl.where(has, (m_i + tl.log2(l_safe) - P_SCALE_LOG2) * LN2, float("-inf"))
    else:
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    l_off = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
    tl.store(lse_ptr + l_off, lse, mask=row_ok)
