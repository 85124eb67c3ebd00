"""FP8 quantisation pre-pass on the GPU (``docs/fp8.md`` section 7), the rules of ``flashprefill.quant``.

Two launches per layer call, then torch ops on tiny tensors:

1. ``_kv_amax_kernel``: ``max |x|`` per (request, KV head) of K and V, read through the page table
   (chunks of ``BLOCK_T`` tokens, an int32 ``atomic_max`` on the float bits: non-negative floats
   order like their bit patterns; NaN entries ignored).
2. scales from the amax with ``quant.amax_scales`` (the same code as the reference);
3. ``_kv_quant_kernel``: codes of K into ``k8 [Hkv, total_k, d]`` and of V, transposed, into
   ``v8t [Hkv, d, total_k]`` (request ``b`` at token slot ``cu_seqlens_k[b]``, each request's start
   a multiple of ``REQUEST_ALIGN``, the gaps zero); with ``v_perm`` (for the Gluon kernel) each 16
   keys of ``v8t`` in the wgmma order (``wgmma_slot``, ``docs/fp8.md`` section 11);
4. ``quantize_means``: the float32 block means with their request's scales (``quant.quantize``), the
   values' columns in ``v8t``'s key order.

The e4m3 rounding is done in fp32 arithmetic (``_e4m3_rne``) before the cast, so the cast only
converts exactly representable values: bit-exact on the GPU and under ``TRITON_INTERPRET=1``,
whose own float8 cast neither rounds to nearest nor saturates (Triton 3.6). Inputs: bf16 / fp16
caches (e4m3 caches need no pre-pass for K: ``docs/fp8.md`` section 5).

``precision="int8qk"`` (``docs/fp8.md`` section 10): the K codes are int8 (``K_INT8``, scale
``amax / 127``, ``_to_int8``: round half to even by the fp32 ``+ 1.5 * 2**23`` trick, exact for
``|y| <= 127`` and bit-exact under the interpreter), the Q tiles too (``_quantize_tile_int8``); V stays e4m3.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import quant
from ...plan import BatchPlan

# Each request's first token slot in k8 / v8t, and the token count of a V8^T row, are multiples of
# this: 16 e4m3 bytes, so a V8^T tile row (tokens contiguous) starts 16-byte aligned and the attention
# kernel loads it with 16-byte cp.async (TMA needs the same row stride). Unaligned starts compile to
# one-byte global loads outside the software pipeline.
TMA_ALIGN = 16
_TMA_ALIGN_C = tl.constexpr(TMA_ALIGN)
# Each request's first token slot in k8 / v8t and its first column in the aligned v_mean8t are
# multiples of this (a multiple of TMA_ALIGN): a 128-token TMA box of the Gluon kernel
# (attention_fp8_ws_kernels, key blocks of 128) that starts in a request ends inside it, in its zero
# gap, never in the next request's slots, whose NaN would otherwise reach the request's rows through
# 0 * NaN in the P V product (docs/fp8.md section 11). At most 127 zero slots per request and KV head.
REQUEST_ALIGN = 128
_REQUEST_ALIGN_C = tl.constexpr(REQUEST_ALIGN)
# Tokens per program of both kernels.
BLOCK_T = 64


@dataclass(frozen=True)
class Fp8KV:
    """Quantised K / V of one batch and one layer (``docs/fp8.md`` section 7)."""

    k8: torch.Tensor           # e4m3 (int8 for int8qk) [Hkv, total_k, d]; request b's tokens at
                               # cu_seqlens_k[b], zero gaps
    v8t: torch.Tensor          # e4m3 [Hkv, d, total_k]; V transposed (tokens contiguous), zero gaps
    k_scale: torch.Tensor      # float32 [batch, Hkv]; amax / 448 (int8: / 127) of the request's K (dequant factor)
    v_scale: torch.Tensor      # float32 [batch, Hkv]; same for V
    k_inv_scale: torch.Tensor  # float32 [batch, Hkv]; 448 (int8: 127) / amax (the quantisation factor)
    v_inv_scale: torch.Tensor  # float32 [batch, Hkv]
    cu_seqlens_k: torch.Tensor  # int32 [batch + 1]; request b's first slot, cumulative Lk each rounded
                                # up to a multiple of REQUEST_ALIGN (total_k = cu_seqlens_k[-1])
    v_perm: bool = False       # v8t's keys in the wgmma order within each 16 slots (wgmma_slot): for
                               # the Gluon kernel only (docs/fp8.md section 11); else in token order


def wgmma_slot(pos: torch.Tensor) -> torch.Tensor:
    """The ``v8t`` slot (or aligned ``v_mean8t`` column) of key ``pos`` in the wgmma order
    (``Fp8KV.v_perm``, ``docs/fp8.md`` section 11): within each 16, key ``16h + 8a + 2q + b`` goes to
    slot ``16h + 4q + 2a + b`` (``q`` 0-3, ``a`` and ``b`` 0-1), so the ``S`` accumulator column a
    thread holds at register position ``r`` of a 16 is the ``P V`` A operand's column ``r``. A
    permutation of each 16 (bits 1-2 and 3 of the position swap places); integer tensors of any shape."""
    return (pos & ~15) | (((pos >> 1) & 3) << 2) | (((pos >> 3) & 1) << 1) | (pos & 1)


@triton.jit
def _e4m3_rne(y):
    """``y`` (fp32, already clamped to [-448, 448]) rounded to the nearest e4m3fn value, ties to even,
    as fp32 (sign kept, -0 included; NaN stays NaN)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = bits & -2147483648                                   # 0x80000000
    a = tl.abs(y)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127      # floor(log2 a) for normals
    e = tl.maximum(e, -6)                                       # e4m3 subnormals: step 2**-9
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)    # 3 mantissa bits
    inv_ulp = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    t = a * inv_ulp                                             # exact: a power of two, t < 16
    r = ((t + 8388608.0) - 8388608.0) * ulp                     # + 2**23 rounds to an integer, ties to even
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


AMAX_FLOOR = tl.constexpr(quant.AMAX_FLOOR)
E4M3_MAX = tl.constexpr(quant.E4M3_MAX)


@triton.jit
def _to_e4m3(y, HW_CVT: tl.constexpr = False):
    """e4m3 codes of fp32 ``y`` already clamped to [-448, 448] (NaN kept), rounded to nearest, ties
    to even. ``HW_CVT``: Triton's cast alone, ``cvt.rn.satfinite.e4m3x2.f32`` on sm_89+ (one
    ``F2FP`` per two values; the same codes by the PTX rounding rule, checked on the device by
    ``tests/gpu/test_fp8_quant.py``); else ``_e4m3_rne`` in fp32 first (about 15 integer / float
    operations per value), which the interpreter needs: its cast neither rounds nor saturates."""
    if HW_CVT:
        codes = y.to(tl.float8e4nv)
    else:
        codes = _e4m3_rne(y).to(tl.float8e4nv)
    return codes


@triton.jit
def _quantize_tile(x, HW_CVT: tl.constexpr = False):
    """One quantisation group in registers (a Q tile: ``docs/fp8.md`` section 3): ``(codes, scale)``.

    ``x``: fp32 ``[M, d]`` (masked rows zero). ``codes``: e4m3 ``[M, d]`` with ``inv_scale =
    448 / amax`` (``div_rn``, NaN ignored in ``amax``, ``amax < AMAX_FLOOR`` -> 1); ``scale``: fp32
    scalar ``amax / 448``. The codes equal ``quant.quantize`` bit for bit (``_to_e4m3``)."""
    a = tl.abs(x)
    a = tl.where(a == a, a, 0.0)
    amax = tl.max(tl.max(a, axis=1), axis=0)
    tiny = amax < AMAX_FLOOR
    safe = tl.where(tiny, 1.0, amax)
    scale = tl.where(tiny, 1.0, tl.math.div_rn(safe, E4M3_MAX))
    inv = tl.where(tiny, 1.0, tl.math.div_rn(E4M3_MAX, safe))
    y = x * inv
    y = tl.where(y > E4M3_MAX, E4M3_MAX, tl.where(y < -E4M3_MAX, -E4M3_MAX, y))     # saturate, NaN kept
    return _to_e4m3(y, HW_CVT), scale


INT8_MAX = tl.constexpr(quant.INT8_MAX)
# 1.5 * 2**23: y + this rounds fp32 y (|y| < 2**22) to an integer, ties to even, in the low mantissa bits.
RNE_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _to_int8(y):
    """int8 codes of fp32 ``y`` (any range): NaN -> 0, clamp to [-127, 127], round half to even
    (``(y + 1.5 * 2**23) - 1.5 * 2**23``: 2 FADD, exact in fp32 for ``|y| <= 127``), then the exact cast.
    The codes of ``quant.quantize_int8`` bit for bit, on the GPU and under the interpreter."""
    y = tl.where(y == y, y, 0.0)
    y = tl.where(y > INT8_MAX, INT8_MAX, tl.where(y < -INT8_MAX, -INT8_MAX, y))
    r = (y + RNE_MAGIC) - RNE_MAGIC
    return r.to(tl.int8)


@triton.jit
def _quantize_tile_int8(x):
    """``_quantize_tile`` for the int8 Q operand of precision "int8qk" (``docs/fp8.md`` section 10):
    ``(codes int8 [M, d], scale)`` with ``scale = amax / 127``, ``inv = 127 / amax`` (``div_rn``, NaN
    ignored in ``amax``, ``amax < AMAX_FLOOR`` -> 1); the codes equal ``quant.quantize_int8``."""
    a = tl.abs(x)
    a = tl.where(a == a, a, 0.0)
    amax = tl.max(tl.max(a, axis=1), axis=0)
    tiny = amax < AMAX_FLOOR
    safe = tl.where(tiny, 1.0, amax)
    scale = tl.where(tiny, 1.0, tl.math.div_rn(safe, INT8_MAX))
    inv = tl.where(tiny, 1.0, tl.math.div_rn(INT8_MAX, safe))
    return _to_int8(x * inv), scale


@triton.jit
def _load_tokens(cache_ptr, page_table_ptr, b, h, t0, lk, stride_pt, stride_page, stride_slot, stride_head,
                 PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens ``[t0, t0 + BLOCK_T)`` of request ``b``, KV head ``h``: (fp32 [BLOCK_T, D], valid [BLOCK_T])."""
    pos = t0 + tl.arange(0, BLOCK_T)
    valid = pos < lk
    page = tl.load(page_table_ptr + b * stride_pt + pos // PAGE_SIZE, mask=valid, other=0)
    row = page.to(tl.int64) * stride_page + (pos % PAGE_SIZE) * stride_slot + h * stride_head
    x = tl.load(cache_ptr + row[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    return x.to(tl.float32), valid


@triton.jit
def _kv_amax_kernel(k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, amax_ptr,
                    stride_pt, k_stride_page, k_stride_slot, k_stride_head,
                    v_stride_page, v_stride_slot, v_stride_head, n_pairs,
                    HKV: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    # setup: program (request b, KV head h, token chunk c); amax_ptr is int32 [2, batch, Hkv] (K, V)
    b = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    lk = tl.load(seq_lens_ptr + b)
    if t0 < lk:
        k, _ = _load_tokens(k_ptr, page_table_ptr, b, h, t0, lk, stride_pt, k_stride_page, k_stride_slot,
                            k_stride_head, PAGE_SIZE, D, BLOCK_T)
        v, _ = _load_tokens(v_ptr, page_table_ptr, b, h, t0, lk, stride_pt, v_stride_page, v_stride_slot,
                            v_stride_head, PAGE_SIZE, D, BLOCK_T)
        ak = tl.abs(k)
        av = tl.abs(v)
        ak = tl.where(ak == ak, ak, 0.0)                        # NaN ignored
        av = tl.where(av == av, av, 0.0)
        mk = tl.max(tl.max(ak, axis=1), axis=0)
        mv = tl.max(tl.max(av, axis=1), axis=0)
        # non-negative floats compare like their int32 bits
        tl.atomic_max(amax_ptr + b * HKV + h, mk.to(tl.int32, bitcast=True))
        tl.atomic_max(amax_ptr + n_pairs + b * HKV + h, mv.to(tl.int32, bitcast=True))


@triton.jit
def _kv_quant_kernel(k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, cu_k_ptr, inv_ptr, k8_ptr, v8t_ptr,
                     stride_pt, k_stride_page, k_stride_slot, k_stride_head,
                     v_stride_page, v_stride_slot, v_stride_head, n_pairs, total_k,
                     HKV: tl.constexpr, PAGE_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                     HW_CVT: tl.constexpr = False, K_INT8: tl.constexpr = False, V_PERM: tl.constexpr = False):
    # setup: program (request b, KV head h, token chunk c); inv_ptr is float32 [2, batch, Hkv] (K, V);
    # HW_CVT: codes by the hardware cast (_to_e4m3); K_INT8: K codes int8 (_to_int8, int8qk);
    # V_PERM: V's tokens in the wgmma order within each 16 (wgmma_slot), permuted in registers so
    # the stores stay 16 bytes wide
    b = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    lk = tl.load(seq_lens_ptr + b)
    # the request's slots run to its length rounded up to REQUEST_ALIGN: the slots in [lk, lk_al) get
    # the codes of the masked loads' zeros (the zero gap), so every slot of k8 / v8t is written (the
    # buffers are torch.empty); the first slot and lk_al are multiples of TMA_ALIGN, so the stores are
    # masked in whole 16-token groups (16-byte V8^T stores, not one byte each)
    lk_al = tl.multiple_of((lk + _REQUEST_ALIGN_C - 1) // _REQUEST_ALIGN_C * _REQUEST_ALIGN_C, _TMA_ALIGN_C)
    if t0 < lk_al:
        start = tl.multiple_of(tl.load(cu_k_ptr + b), _TMA_ALIGN_C).to(tl.int64)
        pos = t0 + tl.arange(0, BLOCK_T)
        dst = start + pos.to(tl.int64)                          # token slot in the batch
        in_al = pos < lk_al
        dims = tl.arange(0, D)
        k, _ = _load_tokens(k_ptr, page_table_ptr, b, h, t0, lk, stride_pt, k_stride_page, k_stride_slot,
                            k_stride_head, PAGE_SIZE, D, BLOCK_T)
        y = k * tl.load(inv_ptr + b * HKV + h)
        if K_INT8:
            k8_row = k8_ptr + h.to(tl.int64) * total_k * D + dst[:, None] * D + dims[None, :]
            tl.store(k8_row, _to_int8(y), mask=in_al[:, None])
        else:
            y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))      # saturate, NaN kept
            k8_row = k8_ptr + h.to(tl.int64) * total_k * D + dst[:, None] * D + dims[None, :]
            tl.store(k8_row, _to_e4m3(y, HW_CVT), mask=in_al[:, None])
        v, _ = _load_tokens(v_ptr, page_table_ptr, b, h, t0, lk, stride_pt, v_stride_page, v_stride_slot,
                            v_stride_head, PAGE_SIZE, D, BLOCK_T)
        y = v * tl.load(inv_ptr + n_pairs + b * HKV + h)
        y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
        if V_PERM:
            # row 16h + 8a + 2q + b moves to row 16h + 4q + 2a + b (wgmma_slot; t0 is a multiple of 16)
            y = tl.reshape(tl.permute(tl.reshape(y, [BLOCK_T // 16, 2, 4, 2, D]), [0, 2, 1, 3, 4]), [BLOCK_T, D])
        # V transposed: element (token, dim) goes to v8t[h, dim, token]
        v8_col = v8t_ptr + h.to(tl.int64) * D * total_k + dims[None, :].to(tl.int64) * total_k + dst[:, None]
        tl.store(v8_col, _to_e4m3(y, HW_CVT), mask=in_al[:, None])


def request_span(n: int) -> int:
    """``n`` slots (tokens of a request, or its key blocks' mean columns) rounded up to a multiple of
    ``REQUEST_ALIGN``: what a request takes in ``k8`` / ``v8t`` or the aligned ``v_mean8t``."""
    return -(-n // REQUEST_ALIGN) * REQUEST_ALIGN


def _cu_seqlens_k(plan: BatchPlan, device) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens_k int32 [batch + 1], total_k)`` from the plan's host lengths: request starts
    at multiples of ``REQUEST_ALIGN`` (each ``Lk`` rounded up). The tensor is made once per plan and
    device (``BatchPlan.derive``)."""
    cu = [0]
    for lk in plan.kv_lens:
        cu.append(cu[-1] + request_span(lk))
    return plan.derive("cu_seqlens_k", device, lambda: host_ints(cu, device)), cu[-1]


def host_ints(values: list[int], device) -> torch.Tensor:
    """int32 tensor of host ints on ``device`` without a stream sync: on CUDA copied from pinned
    memory with ``non_blocking`` (PyTorch's pinned allocator keeps the buffer until the copy is
    done); a tensor made from a Python list directly on the GPU is a synchronous copy that drains
    the stream first."""
    t = torch.tensor(values, dtype=torch.int32)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _launch_shape(k_cache, v_cache, page_table, plan: BatchPlan):
    hkv = k_cache.shape[2]
    slots = request_span(plan.max_kv_len)      # a request's slots, zero gap included
    grid = (plan.batch, hkv, max(1, -(-slots // BLOCK_T)))
    strides = (page_table.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3], plan.batch * hkv)
    return grid, strides


def kv_amax(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
            plan: BatchPlan) -> torch.Tensor:
    """``max |x|`` per (request, KV head) of K and V (one launch, ``_kv_amax_kernel``): float32
    ``[2, batch, Hkv]`` (index 0: K, 1: V), NaN ignored. Args: as ``quantize_kv``."""
    _, page_size, hkv, d = k_cache.shape
    amax = torch.zeros(2, plan.batch, hkv, dtype=torch.int32, device=k_cache.device)
    grid, strides = _launch_shape(k_cache, v_cache, page_table, plan)
    if sum(plan.kv_lens):
        _kv_amax_kernel[grid](k_cache, v_cache, page_table, seq_lens, amax, *strides,
                              HKV=hkv, PAGE_SIZE=page_size, D=d, BLOCK_T=BLOCK_T)
    return amax.view(torch.float32)


def kv_amax_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                   plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (request, KV head) scales of K and V (one launch, ``_kv_amax_kernel``).

    Args: as ``quantize_kv``.
    Returns:
        ``(scale, inv_scale)`` float32 ``[2, batch, Hkv]`` (index 0: K, 1: V), ``quant.amax_scales``.
    """
    return quant.amax_scales(kv_amax(k_cache, v_cache, page_table, seq_lens, plan))


def kv_scales_for(amax: torch.Tensor, k_int8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inv_scale)`` float32 ``[2, batch, Hkv]`` of ``amax`` ``[2, batch, Hkv]`` (K, V): e4m3
    rules for both, or with ``k_int8`` (precision "int8qk") K's by ``quant.int8_scales``."""
    scale, inv = quant.amax_scales(amax)
    if k_int8:
        ks, kinv = quant.int8_scales(amax[0])
        scale, inv = torch.stack([ks, scale[1]]), torch.stack([kinv, inv[1]])
    return scale, inv


def quantize_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                plan: BatchPlan, amax: torch.Tensor | None = None, hw_cvt: bool = False, k_int8: bool = False,
                v_perm: bool = False) -> Fp8KV:
    """Quantise a batch's K and V for the FP8 attention (``docs/fp8.md`` sections 2, 3, 7).

    Args:
        k_cache, v_cache: ``[num_pages, page_size, Hkv, d]`` bf16 / fp16, ``d`` a power of two.
        page_table: int32 ``[batch, max_pages]``; seq_lens: int32 ``[batch]`` (``Lk``).
        plan: the batch plan (its host ``kv_lens``: no sync here).
        amax: float32 ``[2, batch, Hkv]``, ``max |K|`` (0) and ``max |V|`` (1) per (request, KV head)
            already reduced (``BlockIndex.kv_amax``, written by the block-means kernels), or None:
            one ``kv_amax_scales`` launch. Same scales either way (a max is exact).
        hw_cvt: the codes by the hardware cast (``_to_e4m3``; CUDA tensors only, else ignored).
        k_int8: precision "int8qk": ``k8`` int8 with ``amax / 127`` scales (``docs/fp8.md`` section 10).
        v_perm: ``v8t``'s keys in the Gluon kernel's wgmma order (``wgmma_slot``, ``Fp8KV.v_perm``).
    Returns:
        ``Fp8KV`` (fresh tensors).
    """
    _, page_size, hkv, d = k_cache.shape
    dev = k_cache.device
    cu_k, total_k = _cu_seqlens_k(plan, dev)
    # every slot is written by _kv_quant_kernel (the zero gaps included): no memset
    k8 = torch.empty(hkv, total_k, d, dtype=torch.int8 if k_int8 else quant.E4M3, device=dev)
    v8t = torch.empty(hkv, d, total_k, dtype=quant.E4M3, device=dev)
    if amax is None:
        amax = kv_amax(k_cache, v_cache, page_table, seq_lens, plan)
    scale, inv = kv_scales_for(amax, k_int8)
    grid, strides = _launch_shape(k_cache, v_cache, page_table, plan)
    if total_k:
        _kv_quant_kernel[grid](k_cache, v_cache, page_table, seq_lens, cu_k, inv.contiguous(), k8, v8t, *strides,
                               total_k, HKV=hkv, PAGE_SIZE=page_size, D=d, BLOCK_T=BLOCK_T,
                               HW_CVT=hw_cvt and k_cache.is_cuda, K_INT8=k_int8, V_PERM=v_perm)
    return Fp8KV(k8=k8, v8t=v8t, k_scale=scale[0], v_scale=scale[1], k_inv_scale=inv[0], v_inv_scale=inv[1],
                 cu_seqlens_k=cu_k, v_perm=v_perm)


def descale_grid(descale: torch.Tensor, batch: int, hkv: int) -> torch.Tensor:
    """An e4m3 cache's descale (float32 0-dim or ``[batch, Hkv]``) as float32 ``[batch, Hkv]``."""
    return descale.to(torch.float32).expand(batch, hkv).contiguous()


def gather_e4m3_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, plan: BatchPlan,
                   k_descale: torch.Tensor, v_descale: torch.Tensor, v_perm: bool = False) -> Fp8KV:
    """The pre-pass buffers of e4m3 caches (``docs/fp8.md`` section 5): the codes as they are,
    gathered through the page table (byte copies; V transposed), ``scale = descale``,
    ``inv_scale = 1 / descale``. Only the pages the batch reads are touched.

    Args:
        k_cache, v_cache: ``float8_e4m3fn [num_pages, page_size, Hkv, d]``.
        k_descale, v_descale: float32 0-dim or ``[batch, Hkv]``.
        v_perm: ``v8t``'s keys in the wgmma order (``wgmma_slot``, ``Fp8KV.v_perm``).
    Returns:
        ``Fp8KV``.
    """
    _, page_size, hkv, d = k_cache.shape
    dev = k_cache.device
    cu_k, total_k = _cu_seqlens_k(plan, dev)
    k8 = torch.zeros(hkv, total_k, d, dtype=quant.E4M3, device=dev)
    v8t = torch.zeros(hkv, d, total_k, dtype=quant.E4M3, device=dev)
    start = 0
    for b, lk in enumerate(plan.kv_lens):
        if lk:
            pos = torch.arange(lk, device=dev)
            pages = page_table[b, pos // page_size].long()
            slots = pos % page_size
            # byte views: index_select on float8 is not implemented everywhere
            k8.view(torch.uint8)[:, start:start + lk] = k_cache.view(torch.uint8)[pages, slots].permute(1, 0, 2)
            dst = start + (wgmma_slot(pos) if v_perm else pos)
            v8t.view(torch.uint8)[:, :, dst] = v_cache.view(torch.uint8)[pages, slots].permute(1, 2, 0)
        start += request_span(lk)
    ks = descale_grid(k_descale, plan.batch, hkv)
    vs = descale_grid(v_descale, plan.batch, hkv)
    return Fp8KV(k8=k8, v8t=v8t, k_scale=ks, v_scale=vs, k_inv_scale=1.0 / ks, v_inv_scale=1.0 / vs,
                 cu_seqlens_k=cu_k, v_perm=v_perm)


def block_requests(plan: BatchPlan, device) -> torch.Tensor:
    """int64 ``[n_blocks]``: the request of each pooled key block (``BlockIndex.k_mean`` rows), from
    the plan's device ``block_ptr`` (block ``r`` is request ``b``'s when ``block_ptr[b] <= r <
    block_ptr[b + 1]``). Device ops only: no host-to-device copy, so no stream sync (a tensor made
    from a Python list is copied synchronously: three of them per FP8 attention call drained the
    GPU, ``docs/benchmarks.md`` nineteenth session). Made once per plan and device
    (``BatchPlan.derive``): every layer of a forward reads the same tensor."""
    def make():
        bp = plan.block_ptr.to(device)
        rows = torch.arange(plan.n_blocks, device=device, dtype=bp.dtype)
        return torch.searchsorted(bp[1:].contiguous(), rows, right=True)

    return plan.derive("block_requests", device, make)


def mean_columns(plan: BatchPlan, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Columns of the pooled key blocks in ``v_mean8t`` with each request's first column a multiple
    of ``REQUEST_ALIGN`` (its block count rounded up; the gap columns stay zero), from the plan's host
    lengths (no sync).

    Example: ``B = 128``, ``Lk = (300, 5000)`` -> blocks ``(3, 40)``; ``cu = [0, 128, 256]``; the
    blocks' columns ``0 1 2 128 129 ... 167``.

    Returns:
        ``(cols int64 [n_blocks], cu int32 [batch + 1], n_cols)``: block row ``r`` of request ``b``
        (``BlockIndex.k_mean`` row) at column ``cu[b] + r - block_ptr[b]``; ``n_cols = cu[-1]``
        (computed on the host from the plan's lengths; ``cu`` on the device from ``block_ptr``: no
        host-to-device copy, no sync). ``cols`` and ``cu`` are made once per plan and device
        (``BatchPlan.derive``).
    """
    n_blocks = [-(-lk // plan.block_size) for lk in plan.kv_lens]          # host: each request's key blocks
    n_cols = sum(request_span(nb) for nb in n_blocks)

    def make():
        bp = plan.block_ptr.to(device)
        padded = (bp[1:] - bp[:-1] + REQUEST_ALIGN - 1) // REQUEST_ALIGN * REQUEST_ALIGN   # each request's blocks, rounded up
        cu_t = torch.zeros(plan.batch + 1, dtype=torch.int32, device=device)
        cu_t[1:] = torch.cumsum(padded, 0)
        req = block_requests(plan, device)
        return torch.arange(plan.n_blocks, device=device) + (cu_t[req] - bp[req]).long(), cu_t

    cols, cu_t = plan.derive("mean_columns", device, make)
    return cols, cu_t, n_cols


def quantize_means(k_mean: torch.Tensor, v_mean: torch.Tensor, kv: Fp8KV, plan: BatchPlan, aligned: bool = False):
    """The block means' codes with their request's K / V scales (``docs/fp8.md`` section 3).

    Args:
        k_mean, v_mean: float32 ``[n_blocks, Hkv, d]`` (``BlockIndex.k_mean`` / ``v_mean``).
        aligned: lay out ``v_mean8t``'s columns by ``mean_columns`` (each request's first column a
            multiple of ``REQUEST_ALIGN``); else column = block row (``plan.block_ptr``). With
            ``kv.v_perm`` (which needs ``aligned``) each 16 columns in the wgmma order (``wgmma_slot``),
            as ``kv.v8t``'s keys.
    Returns:
        ``(k_mean8 e4m3 [n_blocks, Hkv, d], v_mean8t e4m3 [Hkv, d, n_cols], cu_cols int32
        [batch + 1])``: ``v_mean8t`` transposed for the ``P_m v̄`` product, ``n_cols`` a multiple of
        ``TMA_ALIGN``, zero where no block is; request ``b``'s first column ``cu_cols[b]``.
        ``k_mean8`` is int8 (``quant.quantize_int8``) when ``kv.k8`` is (precision "int8qk").
    """
    req = block_requests(plan, k_mean.device)
    if kv.k8.dtype == torch.int8:
        k8 = quant.quantize_int8(k_mean, kv.k_inv_scale[req][:, :, None])
    else:
        k8 = quant.quantize(k_mean, kv.k_inv_scale[req][:, :, None])
    n_blocks, hkv, d = v_mean.shape
    codes = quant.quantize(v_mean, kv.v_inv_scale[req][:, :, None]).permute(1, 2, 0)
    if kv.v_perm and not aligned:
        raise ValueError("quantize_means: kv.v_perm (the Gluon kernel's V order) needs aligned=True columns")
    if aligned:
        cols, cu_cols, n_cols = mean_columns(plan, v_mean.device)
        if kv.v_perm:
            cols = wgmma_slot(cols)            # each request's first column is a multiple of 128
        v8t = torch.zeros(hkv, d, n_cols, dtype=quant.E4M3, device=v_mean.device)
        v8t.view(torch.uint8)[:, :, cols] = codes.view(torch.uint8)   # byte views: float8 index_put
    else:
        v8t = torch.zeros(hkv, d, -(-n_blocks // TMA_ALIGN) * TMA_ALIGN, dtype=quant.E4M3, device=v_mean.device)
        v8t[:, :, :n_blocks] = codes
        cu_cols = plan.block_ptr
    return k8, v8t, cu_cols
