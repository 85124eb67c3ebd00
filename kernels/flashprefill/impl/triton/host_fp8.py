"""Host side of the Triton FP8 attention (``docs/fp8.md``): the pre-pass operands and the launch of
``attention_fp8_kernels._attn_fwd_fp8``. Called by ``host.py``'s public functions with
``precision="fp8"``; no host sync (the plan carries the lengths).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import quant
from ...index import BlockIndex
from ...plan import BatchPlan
from . import attention_fp8_kernels as fk
from . import quant_kernels as qk
from .attention_kernels import LOG2E
from .tiles import AttnConfig


def kv_operands(k_cache, v_cache, page_table, seq_lens, plan: BatchPlan, k_descale=None, v_descale=None,
                amax: torch.Tensor | None = None, hw_cvt: bool = False, k_int8: bool = False,
                v_perm: bool = False) -> qk.Fp8KV:
    """The e4m3 K / V of a batch: quantised by the pre-pass (bf16 / fp16 caches) or the e4m3 caches'
    codes as they are, with their descales (``docs/fp8.md`` sections 5 and 7). ``amax``: float32
    ``[2, batch, Hkv]`` (``BlockIndex.kv_amax``) or None, ``hw_cvt``: see ``quant_kernels.quantize_kv``.
    ``k_int8`` (precision "int8qk", 16-bit caches only: ``api`` refuses e4m3 ones): K as int8 codes.
    ``v_perm``: V's keys in the Gluon kernel's wgmma order (``qk.wgmma_slot``; ``prepare`` asks for it
    where ``runs_ws``); the Triton kernel reads token order only."""
    if k_cache.dtype == quant.E4M3:
        return qk.gather_e4m3_kv(k_cache, v_cache, page_table, plan, k_descale, v_descale, v_perm=v_perm)
    return qk.quantize_kv(k_cache, v_cache, page_table, seq_lens, plan, amax=amax, hw_cvt=hw_cvt, k_int8=k_int8,
                          v_perm=v_perm)


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


def runs_ws(q: torch.Tensor, k_dtype: torch.dtype, plan: BatchPlan, tiles: AttnConfig, block_size: int) -> bool:
    """Whether a sparse FP8 launch goes to the Gluon kernel (``launch_attention_fp8_ws``): ``tiles.impl``
    "gluon_ws", or "auto" where ``ws_unsupported`` finds nothing against it; never int8 K codes
    (precision "int8qk"). No host sync."""
    if k_dtype == torch.int8:
        return False
    return tiles.impl == "gluon_ws" or (tiles.impl == "auto" and ws_unsupported(q, k_dtype, plan, block_size) is None)


@dataclass(frozen=True)
class MeanOperands:
    """The mean correction's operands of a sparse FP8 launch (``correction_operands``)."""

    k_mean8: torch.Tensor       # e4m3 (int8 for int8qk) [n_blocks, Hkv, d]: the block means' key codes
    v_mean8t: torch.Tensor      # e4m3 [Hkv, d, n_cols]: the value codes, transposed
    mean_cols: torch.Tensor     # int32 [batch + 1]: request b's first v_mean8t column
    bits: torch.Tensor          # int32 [n_segments, n_words]: the selection bitmask
    v_perm: bool                # v_mean8t's columns in the wgmma order: the Fp8KV.v_perm they were made for


def _check_v_order(kv: qk.Fp8KV, means: MeanOperands) -> None:
    if means.v_perm != kv.v_perm:
        order = {True: "the wgmma order", False: "token order"}
        raise ValueError(f"the means' values are in {order[means.v_perm]} but V is in {order[kv.v_perm]}: make the "
                         f"means with correction_operands(..., kv) from this kv")


def correction_operands(k_mean, v_mean, bits, row_ptr, kv: qk.Fp8KV, plan: BatchPlan, *, mean_correction: bool,
                        block_size: int, ws: bool, mean_vec: bool = False) -> MeanOperands:
    """The mean correction's operands of a sparse FP8 launch (``MeanOperands``: ``k_mean8 [n_blocks,
    Hkv, d]``, ``v_mean8t [Hkv, d, n_cols]``, ``mean_cols`` int32 ``[batch + 1]``, ``bits`` int32
    ``[n_segments, n_words]``, and ``kv``'s V order).

    ``k_mean`` / ``v_mean``: float32 ``[n_blocks, Hkv, d]`` (``BlockIndex``), quantised with their
    request's K / V scale (``qk.quantize_means``; ``v_mean8t``'s request columns aligned for the Gluon
    kernel, ``ws``, or with ``AttnConfig.mean_vec``, and in ``kv``'s V order, ``kv.v_perm``); ``bits``:
    the selection bitmask (``mean_bits``).
    Without the correction, placeholders the kernels never read (``row_ptr`` as ``bits``). No host
    sync: ``build_index`` makes them before its ``nnz`` sync (``Fp8Operands``)."""
    if mean_correction:
        k_mean8, v_mean8t, mean_cols = qk.quantize_means(k_mean, v_mean, kv, plan, aligned=ws or mean_vec)
        return MeanOperands(k_mean8, v_mean8t, mean_cols, bits, kv.v_perm)
    hkv, _, d = kv.k8.shape
    dev = kv.k8.device
    if ws:   # whole TMA boxes
        return MeanOperands(torch.zeros(block_size, hkv, d, dtype=quant.E4M3, device=dev),
                            torch.zeros(hkv, d, block_size, dtype=quant.E4M3, device=dev), plan.block_ptr, row_ptr,
                            kv.v_perm)
    return MeanOperands(torch.zeros(1, hkv, d, dtype=kv.k8.dtype, device=dev),
                        torch.zeros(hkv, d, qk.TMA_ALIGN, dtype=quant.E4M3, device=dev), plan.block_ptr, row_ptr,
                        kv.v_perm)


def index_correction_operands(index: BlockIndex, kv: qk.Fp8KV, plan: BatchPlan, *, mean_correction: bool,
                              block_size: int, ws: bool, mean_vec: bool = False) -> MeanOperands:
    """``correction_operands`` of ``index``'s means and selection bitmask (``mean_bits``; none read
    without the correction). The lab times a kernel apart from them with ``ws=True``."""
    k_mean, v_mean, bits = ((index.k_mean, index.v_mean, mean_bits(index, plan)) if mean_correction
                            else (None, None, None))
    return correction_operands(k_mean, v_mean, bits, index.row_ptr, kv, plan, mean_correction=mean_correction,
                               block_size=block_size, ws=ws, mean_vec=mean_vec)


@dataclass(frozen=True)
class Fp8Operands:
    """A sparse FP8 launch's operands besides Q, made by ``prepare`` (``docs/fp8.md`` section 7).

    ``host.build_index`` makes them at precision "fp8" / "int8qk" after the selection's launch and
    before its one host sync (``nnz``), so the GPU runs the K / V pre-pass and the means' codes while
    the host waits (``docs/benchmarks.md``, twentieth session). ``BlockIndex.fp8_operands`` holds
    them (the codes: one byte per K or V element, 256 MiB at 128K with 8 KV heads of d 128, while the
    index lives); ``sparse_attention`` uses them when ``matches`` says they fit its launch and its
    inputs, else makes its own."""

    kv: qk.Fp8KV
    means: MeanOperands         # correction_operands
    mean_correction: bool
    aligned: bool               # v_mean8t's request columns aligned (ws or tiles.mean_vec)
    sources: tuple              # (k_cache, v_cache, k_descale, v_descale, k_mean, v_mean) they were made from

    @property
    def ws(self) -> bool:
        """Laid out for the Gluon kernel (``runs_ws``): ``prepare`` makes V in its wgmma order exactly then."""
        return self.kv.v_perm

    def matches(self, *, ws: bool, mean_correction: bool, tiles: AttnConfig, k_int8: bool, sources: tuple,
                bits) -> bool:
        """Whether a launch can read them: the same kernel layout, correction and K codes, made from the
        same tensors (``sources`` compared by identity: other caches, descales or means, e.g. an index
        reused for another layer or a ``dataclasses.replace`` copy, make them anew) and, with the
        correction, from the index's own selection bitmask ``bits``."""
        return (self.ws == ws and self.mean_correction == mean_correction and self.aligned == (ws or tiles.mean_vec)
                and (self.kv.k8.dtype == torch.int8) == k_int8
                and len(sources) == len(self.sources) and all(a is b for a, b in zip(sources, self.sources))
                and (not mean_correction or self.means.bits is bits))


def prepare(q, k_cache, v_cache, page_table, seq_lens, plan: BatchPlan, tiles: AttnConfig, *, k_mean, v_mean,
            bits, row_ptr, mean_correction: bool, block_size: int, k_descale=None, v_descale=None,
            amax: torch.Tensor | None = None, hw_cvt: bool = False, k_int8: bool = False) -> Fp8Operands:
    """``kv_operands`` and ``correction_operands`` of one sparse FP8 launch (arguments as theirs), with
    the tensors they were made from (``Fp8Operands.sources``); for the Gluon kernel (``runs_ws``) V in
    its wgmma order (``Fp8KV.v_perm``). No host sync."""
    ws = runs_ws(q, torch.int8 if k_int8 else quant.E4M3, plan, tiles, block_size)
    kv = kv_operands(k_cache, v_cache, page_table, seq_lens, plan, k_descale, v_descale, amax=amax,
                     hw_cvt=hw_cvt, k_int8=k_int8, v_perm=ws)
    means = correction_operands(k_mean, v_mean, bits, row_ptr, kv, plan, mean_correction=mean_correction,
                                block_size=block_size, ws=ws, mean_vec=tiles.mean_vec)
    return Fp8Operands(kv=kv, means=means, mean_correction=mean_correction, aligned=ws or tiles.mean_vec,
                       sources=(k_cache, v_cache, k_descale, v_descale, k_mean, v_mean))


def launch_attention_fp8(q, kv: qk.Fp8KV, seq_lens, cu_seqlens_q, softmax_scale: float, plan: BatchPlan,
                         tiles: AttnConfig, *, sparse: bool, mean_correction: bool, block_size: int,
                         index: BlockIndex | None = None, means: MeanOperands | None = None):
    """Launch ``_attn_fwd_fp8`` (no host sync); returns ``(out [total_q, Hq, d] q.dtype, lse
    [total_q, Hq] float32, natural log)``.

    ``index``: the batch's ``BlockIndex`` (``sparse``); ``means``: its ``correction_operands`` for
    this launch, made here when None (its float32 means quantised with their request's K / V scale,
    ``qk.quantize_means``; ``tiles.mean_vec``: ``v_mean8t``'s request columns aligned,
    ``qk.mean_columns``). An int8 ``kv.k8`` (precision "int8qk") launches the kernel's ``QK_INT8``
    mode (int8 Q tile and key means, ``docs/fp8.md`` section 10). ``runs_ws``: the sparse e4m3 case
    runs ``launch_attention_fp8_ws`` instead (``tiles.impl`` "gluon_ws", or "auto" where the Gluon
    kernel runs; the dense mode and int8 ``k8`` stay on this kernel).

    Raises:
        ValueError: ``kv.v_perm`` operands on this kernel (it reads V in token order); ``means`` in
            another V order than ``kv`` (``MeanOperands.v_perm``); ``tiles.block_m`` other than the plan's
            tile rows.
    """
    if sparse and runs_ws(q, kv.k8.dtype, plan, tiles, block_size):
        return launch_attention_fp8_ws(q, kv, seq_lens, cu_seqlens_q, softmax_scale, plan, tiles,
                                       mean_correction=mean_correction, block_size=block_size, index=index,
                                       means=means)
    if kv.v_perm:
        raise ValueError("the Triton FP8 attention reads V in token order; these operands hold it in the Gluon "
                         "kernel's wgmma order (kv_operands(..., v_perm=True)): make them with v_perm=False")
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
        if means is None:
            means = index_correction_operands(index, kv, plan, mean_correction=mc, block_size=block_size, ws=False,
                                              mean_vec=tiles.mean_vec)
        _check_v_order(kv, means)
        k_mean8, v_mean8t, mean_cols, bits = means.k_mean8, means.v_mean8t, means.mean_cols, means.bits
    else:
        row_ptr = col_idx = bits = plan.tile_ptr            # unused placeholders (dense mode)
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


WS_HEAD_DIMS = (64, 128)
WS_BLOCK = 128
WS_TILE_ROWS = 128


def ws_unsupported(q: torch.Tensor, k_dtype: torch.dtype, plan: BatchPlan, block_size: int) -> str | None:
    """Why ``launch_attention_fp8_ws`` cannot run these inputs (a sentence), or None when it can:
    a CUDA sm_90 GPU (TMA, e4m3 wgmma, ``setmaxnreg``), e4m3 K codes (``k_dtype``: ``kv.k8``'s; the
    pre-pass makes e4m3 codes for precision "fp8"), d 64 / 128, key blocks of 128 tokens, 128-row
    tiles. No host sync."""
    if not q.is_cuda:
        return f"needs a CUDA GPU with compute capability 9.0 (sm_90), got {q.device.type} tensors"
    cc = torch.cuda.get_device_capability(q.device)
    if cc != (9, 0):
        name = torch.cuda.get_device_name(q.device)
        return f"needs compute capability 9.0 (sm_90: Hopper wgmma and setmaxnreg), {name} is {cc[0]}.{cc[1]}"
    if k_dtype != quant.E4M3:
        return f"runs e4m3 K only (precision 'fp8'), got {k_dtype}"
    if q.shape[2] not in WS_HEAD_DIMS:
        return f"runs head dims {WS_HEAD_DIMS}, got d={q.shape[2]}"
    if block_size != WS_BLOCK:
        return f"runs key blocks of {WS_BLOCK} tokens, got {block_size}"
    if plan.tile_rows != WS_TILE_ROWS:
        return f"runs {WS_TILE_ROWS}-row query tiles, got {plan.tile_rows}"
    return None


def ws_error(why: str) -> str:
    """The ``ValueError`` message for inputs ``impl="gluon_ws"`` cannot run (``why``: ``ws_unsupported``'s)."""
    return (f"the warp-specialised FP8 attention (AttnConfig.impl='gluon_ws') {why}; "
            f"impl='auto' (the default at d 64 / 128: this kernel where it runs) or impl='triton' run these inputs")


def launch_attention_fp8_ws(q, kv: qk.Fp8KV, seq_lens, cu_seqlens_q, softmax_scale: float, plan: BatchPlan,
                            tiles: AttnConfig, *, mean_correction: bool, block_size: int, index: BlockIndex,
                            means: MeanOperands | None = None, timing: torch.Tensor | None = None):
    """Launch the warp-specialised Gluon kernel ``attention_fp8_ws_kernels._attn_fwd_fp8_ws`` (sparse
    e4m3, ``docs/fp8.md`` section 11); no host sync. Same inputs and result as
    ``launch_attention_fp8(..., sparse=True)``: ``(out [total_q, Hq, d] q.dtype, lse [total_q, Hq]
    float32, natural log)``.

    TMA boxes (e4m3, 128-byte swizzle where the row is 128 bytes): ``k8`` as ``[Hkv·total_k, d]``
    box ``[B, d]``; ``v8t`` as ``[Hkv·d, total_k]`` box ``[d, B]``; ``k_mean8`` as ``[n_blocks, Hkv·d]``
    box ``[B, d]``; ``v_mean8t`` (aligned columns, ``qk.quantize_means(..., aligned=True)``) as
    ``[Hkv·d, n_cols]`` box ``[d, B]``. A box past a buffer's end reads zeros; keys past ``Lk`` have
    ``-inf`` logits and mean-key columns past ``n_u`` have ``-inf`` biases, so what they read gets
    ``p = 0``. Each request's first slot and first mean column are multiples of 128
    (``qk.REQUEST_ALIGN``), so a request's last boxes end in its own zero gap: ``0 · NaN = NaN`` in the
    ``P V`` product never brings the next request's NaN into this request's rows
    (``tests/gpu/test_fp8_ws.py``). ``means``: its ``correction_operands`` (``ws=True``), made here
    when None. ``timing`` (lab only, ``scripts/lab/gluon_fp8.py phases``): int64 ``[n_tiles * Hkv, 8]``,
    one row per program, written by consumer 0: ``%globaltimer`` (ns) at the program's start, the
    consumer's start, the first correction step (the loop's end without one), the loop's end and
    the stores' end, then the SM id, the exact steps and the correction steps (``TIMING``; every
    shipped launch compiles without it). ``kv.v_perm`` (V and the means' values in the wgmma order,
    ``qk.wgmma_slot``) hands ``P8`` to the ``P V`` product without a layout conversion (``V_PERM``); both
    orders give the same result.

    Raises:
        ValueError: ``ws_unsupported`` gives a reason (not sm_90, not e4m3, d, block size, tile rows);
            ``timing`` of another shape, dtype or layout; ``means`` in another V order than ``kv``.
    """
    n_rows = plan.n_tiles * kv.k8.shape[0]
    if timing is not None and (timing.shape != (n_rows, 8) or timing.dtype != torch.int64
                               or not timing.is_contiguous()):
        raise ValueError(f"timing must be a contiguous int64 [{n_rows}, 8] (one row per program), got "
                         f"{timing.dtype} {list(timing.shape)} with strides {timing.stride()}")
    why = ws_unsupported(q, kv.k8.dtype, plan, block_size)
    if why:
        raise ValueError(ws_error(why))
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import attention_fp8_ws_kernels as wk

    total_q, hq, d = q.shape
    hkv, total_k, _ = kv.k8.shape
    out = torch.empty_like(q)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if plan.n_tiles == 0 or total_q == 0:
        return out, lse
    if means is None:
        means = index_correction_operands(index, kv, plan, mean_correction=mean_correction, block_size=block_size,
                                          ws=True)
    _check_v_order(kv, means)
    k_mean8, v_mean8t, mean_cols, bits = means.k_mean8, means.v_mean8t, means.mean_cols, means.bits

    def desc(t2: torch.Tensor, box: list[int]):
        return TensorDescriptor.from_tensor(t2, box, gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))

    n_prog = plan.n_tiles
    wk._attn_fwd_fp8_ws[(n_prog * hkv, )](
        q, desc(kv.k8.view(hkv * total_k, d), [block_size, d]), desc(kv.v8t.view(hkv * d, total_k), [d, block_size]),
        desc(k_mean8.view(k_mean8.shape[0], hkv * d), [block_size, d]),
        desc(v_mean8t.view(hkv * d, v_mean8t.shape[2]), [d, block_size]),
        kv.k_scale.contiguous(), kv.v_scale.contiguous(), kv.cu_seqlens_k, seq_lens, cu_seqlens_q,
        plan.tile_request, plan.tile_local, plan.block_ptr, mean_cols, index.row_ptr, index.col_idx, bits, out, lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        bits.shape[1] if mean_correction else 0, total_k, plan.n_tiles, n_prog, hkv, float(softmax_scale) * LOG2E,
        GROUP=plan.group_size, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_SIZE=block_size, STAGES=tiles.ws_stages,
        PINGPONG=tiles.ws_pingpong, MEAN_CORR=mean_correction, CONSUMER_REGS=WS_CONSUMER_REGS,
        PRODUCER_REGS=WS_PRODUCER_REGS, V_PERM=kv.v_perm, t_ptr=timing, TIMING=timing is not None, num_warps=4,
        maxnreg=WS_MAXNREG)
    return out, lse


# Registers of the Gluon kernel: 12 resident warps (4 default + 4 consumer + 1 producer, rounded up to
# warpgroups) at 168 each = 64,512 of the SM's 65,536 registers: one program per SM; the producer's
# warpgroup gives back to 24, the two consumer warpgroups take 240 (Triton sets the default
# partition's from what is left).
WS_MAXNREG = 168
WS_CONSUMER_REGS = 240
WS_PRODUCER_REGS = 24
