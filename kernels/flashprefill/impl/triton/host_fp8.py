"""Host side of the Triton FP8 attention (``docs/fp8.md``): the pre-pass operands and the launch of
``attention_fp8_kernels._attn_fwd_fp8``. Called by ``host.py``'s public functions with
``precision="fp8"``; no host sync (the plan carries the lengths).
"""
from __future__ import annotations

import torch

from ... import quant
from ...index import BlockIndex
from ...plan import BatchPlan
from . import attention_fp8_kernels as fk
from . import quant_kernels as qk
from .attention_kernels import LOG2E
from .tiles import AttnConfig


def kv_operands(k_cache, v_cache, page_table, seq_lens, plan: BatchPlan, k_descale=None, v_descale=None,
                amax: torch.Tensor | None = None, hw_cvt: bool = False, k_int8: bool = False) -> qk.Fp8KV:
    """The e4m3 K / V of a batch: quantised by the pre-pass (bf16 / fp16 caches) or the e4m3 caches'
    codes as they are, with their descales (``docs/fp8.md`` sections 5 and 7). ``amax``: float32
    ``[2, batch, Hkv]`` (``BlockIndex.kv_amax``) or None, ``hw_cvt``: see ``quant_kernels.quantize_kv``.
    ``k_int8`` (precision "int8qk", 16-bit caches only: ``api`` refuses e4m3 ones): K as int8 codes."""
    if k_cache.dtype == quant.E4M3:
        return qk.gather_e4m3_kv(k_cache, v_cache, page_table, plan, k_descale, v_descale)
    return qk.quantize_kv(k_cache, v_cache, page_table, seq_lens, plan, amax=amax, hw_cvt=hw_cvt, k_int8=k_int8)


def mean_bits(index: BlockIndex, plan: BatchPlan) -> torch.Tensor:
    """The selection bitmask of an index (``BlockIndex.sel_bits``), built from its CSR when the
    index has none (one built by the reference): int32 ``[n_segments, ceil(max_blocks / 32)]``."""
    if index.sel_bits is not None:
        return index.sel_bits
    n_seg = index.n_segments
    n_words = max(1, -(-plan.max_blocks(index.block_size) // 32))
    dev = index.row_ptr.device
    seg = torch.repeat_interleave(torch.arange(n_seg, device=dev), index.row_ptr[1:] - index.row_ptr[:-1])
    col = index.col_idx.long()
    bits = torch.zeros(n_seg * n_words, dtype=torch.int64, device=dev)
    bits.index_add_(0, seg * n_words + col // 32, torch.ones_like(col) << (col % 32))   # distinct bits: add = or
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(n_seg, n_words)


def launch_attention_fp8(q, kv: qk.Fp8KV, seq_lens, cu_seqlens_q, softmax_scale: float, plan: BatchPlan,
                         tiles: AttnConfig, *, sparse: bool, mean_correction: bool, block_size: int,
                         index: BlockIndex | None = None):
    """Launch ``_attn_fwd_fp8`` (no host sync); returns ``(out [total_q, Hq, d] q.dtype, lse
    [total_q, Hq] float32, natural log)``.

    ``index``: the batch's ``BlockIndex`` (``sparse``); its float32 means are quantised with
    their request's K / V scale (``qk.quantize_means``; ``tiles.mean_vec``: ``v_mean8t``'s request
    columns aligned, ``qk.mean_columns``) for the correction. An int8 ``kv.k8`` (precision "int8qk")
    launches the kernel's ``QK_INT8`` mode (int8 Q tile and key means, ``docs/fp8.md`` section 10).
    """
    total_q, hq, d = q.shape
    hkv = kv.k8.shape[0]
    out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if plan.n_tiles == 0 or total_q == 0:
        return out, lse
    if tiles.block_m != plan.tile_rows:
        raise ValueError(f"the FP8 attention needs block_m = tile_rows = {plan.tile_rows}, got {tiles.block_m}")
    mc = sparse and mean_correction
    int8 = kv.k8.dtype == torch.int8
    if sparse:
        row_ptr, col_idx = index.row_ptr, index.col_idx
        bits = mean_bits(index, plan) if mc else row_ptr
    else:
        row_ptr = col_idx = bits = plan.tile_ptr            # unused placeholders (dense mode)
    if mc:
        k_mean8, v_mean8t, mean_cols = qk.quantize_means(index.k_mean, index.v_mean, kv, plan, aligned=tiles.mean_vec)
    else:
        k_mean8 = torch.zeros(1, hkv, d, dtype=kv.k8.dtype, device=q.device)
        v_mean8t = torch.zeros(hkv, d, qk.TMA_ALIGN, dtype=quant.E4M3, device=q.device)
        mean_cols = plan.block_ptr                          # unused placeholder
    n_prog = plan.n_tiles
    grid = (n_prog * hkv,)
    fk._attn_fwd_fp8[grid](
        q, kv.k8, kv.v8t, k_mean8, v_mean8t, kv.k_scale.contiguous(), kv.v_scale.contiguous(), kv.cu_seqlens_k,
        mean_cols, seq_lens, cu_seqlens_q, plan.tile_request, plan.tile_local, plan.block_ptr,
        row_ptr, col_idx, bits, out, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        k_mean8.stride(0), k_mean8.stride(1), bits.shape[1] if mc else 0,
        kv.k8.shape[1], v_mean8t.shape[2],
        plan.n_tiles, n_prog, hkv, float(softmax_scale) * LOG2E,
        GROUP=plan.group_size, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_SIZE=block_size, BLOCK_U=tiles.block_u,
        SPARSE=sparse, MEAN_CORR=mc, MAIN_STAGES=tiles.num_stages, MC_STAGES=tiles.mc_stages or tiles.num_stages,
        EXP=fk.EXP_IMPLS.index(tiles.exp_impl), FOLD_SCALE=tiles.fold_scale, PIPELINE=tiles.pipeline,
        MEAN_VEC=tiles.mean_vec, LOOP_GUARD=tiles.loop_guard, QK_INT8=int8,
        INLINE_ASM=q.is_cuda,     # CPU tensors: the Triton interpreter (no PTX)
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out, lse
