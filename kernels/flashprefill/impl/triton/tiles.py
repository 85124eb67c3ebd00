"""Kernel tiles of the Triton backend: frozen ``AttnConfig`` / ``IndexConfig`` from one ``get_config``.

Tiles were measured on an NVIDIA H200 (sm_90, 132 SMs, 227 KiB shared memory per SM) with
Triton 3.6; what each rejected alternative measured is in ``docs/lab/variants.md``. The launchers
in ``host.py`` take these configs as arguments; nothing here is read from a module global or the
environment. ``scripts/lab/compile_sm90.py`` compiles every shipped configuration for sm_90 on a
machine without a GPU (registers, shared memory, spills, SASS).

Importing this module does not import triton.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ...config import EIGHT_BIT_PRECISIONS, PRECISIONS, TRITON_DTYPES, TRITON_HEAD_DIMS


@dataclass(frozen=True)
class AttnConfig:
    """Tiles of the attention kernel ``attention_kernels._attn_fwd``.

    Attributes:
        block_m: packed query rows per program (divides the 128-row tile).
        block_n: keys per inner step (divides the key block ``B``).
        block_u: mean-key candidates per step of the mean-correction loop (64: one selection
            bitmask chunk of two int32 words).
        num_warps, num_stages: Triton launch parameters; ``num_stages`` is also the software
            pipeline depth of the exact-key loops (``tl.range(..., num_stages=)``).
        mc_stages: pipeline depth of the mean-correction loop (0: ``num_stages``). Capped at 2
            by the launcher when the means are float32 (twice the bytes per stage).
        pair_softmax: with two sub-tiles per key block (``block_n = B / 2``), one online-softmax
            update per key block instead of one per sub-tile.
        exp_impl: FP8 kernel only (``attention_fp8_kernels.EXP_IMPLS``): the softmax's ``exp2``.
            ``"mufu"``: fp32 ``exp2`` (one MUFU op per element); ``"f16"``: ``ex2.approx.f16x2``
            (``P`` cast to e4m3 from fp16); ``"poly_half"``: half the elements by a degree-3
            polynomial on the FMA pipes (relative error 7.7e-5). The row sum stays fp32. Ignored
            by the 16-bit kernels.
        fold_scale: FP8 kernel only: the exact-key loops apply the logit scale to the row max
            and, fused with the max subtraction, in one FFMA per logit (instead of a separate
            FMUL per logit). Ignored by the 16-bit kernels.
        pipeline: FP8 kernel only: the hand software-pipelined exact-key loop
            (``attention_fp8_kernels._fp8_inner_pipe``). Ignored by the 16-bit kernels.
        mean_vec: FP8 kernel only: each request's columns of the transposed V-mean codes
            ``v_mean8t`` start at a multiple of ``quant_kernels.TMA_ALIGN`` (zero gaps between
            requests, ``quant_kernels.mean_columns``), so the mean-correction loop loads its
            ``[d, block_u]`` tile with 16-byte copies instead of one-byte loads. Ignored by the
            16-bit kernels.
        impl: the e4m3 sparse attention's kernel (precision "fp8", sparse mode): ``"triton"``
            (``attention_fp8_kernels._attn_fwd_fp8``), ``"gluon_ws"`` (the warp-specialised Gluon
            kernel ``attention_fp8_ws_kernels``: sm_90, d 64 / 128, key blocks 128, 128-row tiles;
            ``host_fp8.launch_attention_fp8_ws`` raises ``ValueError`` elsewhere) or ``"auto"`` (the
            Gluon kernel where it runs, the Triton one elsewhere: ``host_fp8.ws_unsupported``). The
            dense mode, precision "int8qk" and the 16-bit kernels ignore it.
        ws_stages: ``"gluon_ws"`` only: depth of its K / V ring (``B d`` bytes each for K and V
            per stage: 32 KiB at d 128).
        ws_pingpong: ``"gluon_ws"`` only: order the two consumer warpgroups' wgmma issues (FA3's
            ping-pong; measured slower, lab).
        loop_guard: FP8 kernel only: each exact-key loop runs inside an explicit ``if hi > lo``
            (same steps, same output), so ptxas no longer serializes the sparse kernel's
            ``wgmma`` (warning C7515: the loop's zero-trip path set the accumulator registers
            between a ``wgmma`` and its wait). Ignored by the 16-bit kernels.
    """

    block_m: int
    block_n: int
    block_u: int
    num_warps: int
    num_stages: int
    mc_stages: int = 0
    pair_softmax: bool = False
    exp_impl: str = "mufu"
    fold_scale: bool = False
    pipeline: bool = False
    mean_vec: bool = False
    loop_guard: bool = False
    impl: str = "triton"
    ws_stages: int = 4
    ws_pingpong: bool = False

    def __post_init__(self):
        if self.impl not in ATTN_IMPLS:
            raise ValueError(f"AttnConfig.impl must be one of {ATTN_IMPLS}, got {self.impl!r}")
        if self.ws_stages < 2:
            raise ValueError(f"AttnConfig.ws_stages must be >= 2 (a stage loads while one is read), "
                             f"got {self.ws_stages}")


# AttnConfig.impl values
ATTN_IMPLS = ("triton", "gluon_ws", "auto")


@dataclass(frozen=True)
class IndexConfig:
    """Tiles of the index kernels (``index_kernels``).

    Attributes:
        select_block_j: mean keys scored per dot of the selection (the M side of the transposed
            product ``k̄ qᵀ``: 64 = one warpgroup's wgmma M). A multiple of 32.
        select_programs_per_sm: resident selection programs per SM assumed before the first
            launch (its compiled occupancy is used afterwards: 4 warps, 195 registers, 48 KiB
            shared memory -> 2 on the H200).
        select_num_warps, select_num_stages: Triton launch parameters of the selection.
        means_tokens: tokens summed per step of the block-means kernel (divides ``B``; capped at
            ``B``).
        means_warps: warps of the block-means kernel.
        expand_words: int32 bitmask words turned into CSR entries per step of the expand kernel
            (8 = 256 key blocks).
        fused_amax: FP8 index of 16-bit caches only: the block-means kernels also reduce
            ``max |K|`` / ``max |V|`` per (request, KV head) (``BlockIndex.kv_amax``), so neither the
            selection's K scale nor the attention's pre-pass reads K and V in a launch of their own
            (``quant_kernels._kv_amax_kernel``). Same scales. Ignored by the 16-bit index.
        hw_cvt: FP8 only: the selection's Q-tile codes and the pre-pass's K / V codes by the
            hardware's ``cvt.rn.satfinite`` (``quant_kernels._to_e4m3``) instead of the fp32
            rounding emulation (kept for the interpreter, CPU tensors: there it is ignored). The
            same codes. Ignored by the 16-bit index.
    """

    select_block_j: int = 64
    select_programs_per_sm: int = 2
    select_num_warps: int = 4
    select_num_stages: int = 2
    means_tokens: int = 64
    means_warps: int = 4
    expand_words: int = 8
    fused_amax: bool = False
    hw_cvt: bool = False


@dataclass(frozen=True)
class KernelConfig:
    """The tiles of one launch family: ``attn`` for ``_attn_fwd``, ``index`` for the index kernels."""

    attn: AttnConfig
    index: IndexConfig


def _plain(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with every optional kernel field off: no ``loop_guard`` / ``fold_scale`` / ``mean_vec`` /
    ``pipeline``, the fp32 ``exp2``, no ``fused_amax`` / ``hw_cvt``, the Triton FP8 kernel
    (``impl="triton"``). The FP8 kernel as first shipped (before the tenth session): what the tests
    and the lab compare each optional field against. The 16-bit kernels ignore these fields (their
    tiles are unchanged)."""
    return KernelConfig(
        attn=dataclasses.replace(cfg.attn, loop_guard=False, fold_scale=False, mean_vec=False, pipeline=False,
                                 exp_impl="mufu", impl="triton"),
        index=dataclasses.replace(cfg.index, fused_amax=False, hw_cvt=False))


def _gluon_ws(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with the FP8 sparse attention on the warp-specialised Gluon kernel only
    (``AttnConfig.impl = "gluon_ws"``, 4 ring stages: a ``ValueError`` where it cannot run, where the
    default ``"auto"`` takes the Triton kernel). H200, 32 / 8 heads, d 128, 128K: its attention
    14.47 ms against the Triton FP8 kernel's 16.15 and BF16's 18.30 (docs/benchmarks.md, nineteenth
    session)."""
    return dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, impl="gluon_ws", ws_stages=4))


def _triton_fp8(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with the FP8 sparse attention on the Triton kernel everywhere (``AttnConfig.impl =
    "triton"``, the default before the twentieth session): ``fp bench --fp8``'s second FP8 column."""
    return dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, impl="triton"))


# Named presets of the same dataclasses, chosen by ``get_config(..., variant=name)``: a function of
# the default ``KernelConfig`` returning another. ``plain``: every optional field off (the baseline
# of the variant tests); ``gluon_ws`` / ``triton_fp8``: the FP8 sparse attention on one kernel. The
# lab passes its own ``KernelConfig`` to the launchers instead (``docs/lab/variants.md``).
VARIANTS: dict[str, object] = {"plain": _plain, "gluon_ws": _gluon_ws, "triton_fp8": _triton_fp8}


def _attn_tiles(head_dim: int, block_size: int) -> AttnConfig:
    if head_dim == 256:
        # 128 rows x 64 keys, 8 warps, 1 stage (96 KiB smem; ~470 B of spills: the float32
        # accumulator is 128 x 256)
        cfg = AttnConfig(block_m=128, block_n=64, block_u=64, num_warps=8, num_stages=1)
    elif head_dim == 128:
        # 128 rows x 64 keys, 3 stages (with page 64 a 64-key step is one page; 3 stages keep a
        # load in flight), correction loop 4 deep, one softmax update per 128-key block
        # (161 KiB smem, 0 spills)
        cfg = AttnConfig(block_m=128, block_n=64, block_u=64, num_warps=8, num_stages=3, mc_stages=4,
                         pair_softmax=True)
    else:
        # d = 64: 128 rows x 128 keys, two warpgroups of wgmma, 3 stages (81 KiB smem)
        cfg = AttnConfig(block_m=128, block_n=128, block_u=64, num_warps=8, num_stages=3)
    if cfg.block_n > block_size:
        cfg = dataclasses.replace(cfg, block_n=block_size)
    return cfg


def _attn_tiles_fp8(head_dim: int, block_size: int) -> AttnConfig:
    # The FP8 kernel (attention_fp8_kernels._attn_fwd_fp8) needs block_m = the 128-row tile (one Q
    # scale per tile). e4m3 K / V tiles are half the bytes of bf16 ones, so 128 keys per step fit
    # 2 stages at d <= 128 (K 16 KiB + V^T 16 KiB per stage at d 128); d 256 keeps 64 keys (the
    # 128 x 256 float32 accumulator already takes 128 registers per thread).
    cfg = AttnConfig(block_m=128, block_n=64 if head_dim == 256 else 128, block_u=64, num_warps=8, num_stages=2,
                     mc_stages=2)
    if head_dim == 128:
        # loop_guard + fold_scale + mean_vec (with the fused amax / hardware cast of _index_tiles):
        # H200, 32/8 heads, FP8 total 20.12 ms against 22.54 without them at 128K (BF16 21.50), 3.96
        # against 4.09 at 32K (docs/benchmarks.md, tenth session). At d 64 they lost at 32K: off there.
        cfg = dataclasses.replace(cfg, loop_guard=True, fold_scale=True, mean_vec=True)
    if head_dim in (64, 128):
        # the sparse e4m3 attention on the warp-specialised Gluon kernel where it runs (sm_90, key blocks
        # of 128), the Triton kernel elsewhere: H200, FP8 totals 19.41 against 19.90 ms at 128K and
        # 3.81 against 4.26 at 32K (32 / 8 heads, d 128), 8.68 / 9.63 and 2.20 / 2.39 (14 / 2 heads,
        # d 64) (docs/benchmarks.md, twentieth session)
        cfg = dataclasses.replace(cfg, impl="auto")
    if cfg.block_n > block_size:
        cfg = dataclasses.replace(cfg, block_n=block_size)
    return cfg


def _index_tiles(head_dim: int, precision: str) -> IndexConfig:
    # the FP8 index at d 128: the K / V amax from the block-means kernels, codes by the hardware cast
    # (measured with the d-128 attention fields above; at d 64 the FP8 index was slower with them);
    # int8qk takes the same (its Q-tile codes are int8 either way; hw_cvt then serves V's codes)
    if precision in EIGHT_BIT_PRECISIONS and head_dim == 128:
        return IndexConfig(fused_amax=True, hw_cvt=True)
    return IndexConfig()


def get_config(head_dim: int, dtype: torch.dtype, block_size: int, variant: str | None = None,
               precision: str = "bf16") -> KernelConfig:
    """Kernel tiles for ``head_dim`` / ``dtype`` / key block size ``block_size`` (tokens).

    Never keyed on sequence lengths. ``variant``: the name of a preset in ``VARIANTS`` (None: the
    measured defaults). ``precision``: ``"bf16"`` (the 16-bit kernels, measured) or ``"fp8"``
    (the e4m3 attention kernel's tiles; at d 128 with ``loop_guard`` / ``fold_scale`` /
    ``mean_vec`` and the index's ``fused_amax`` / ``hw_cvt``, measured on the H200); ``"int8qk"``
    runs the same kernels with int8 ``Q K^T`` and takes fp8's tiles (not measured separately).

    Raises:
        ValueError: ``head_dim`` not in ``TRITON_HEAD_DIMS``, ``dtype`` not in ``TRITON_DTYPES``,
            ``block_size`` not a multiple of the chosen ``block_n``, an unknown ``variant`` or
            ``precision``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if head_dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {TRITON_HEAD_DIMS}, got {head_dim}")
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"dtype must be one of {TRITON_DTYPES}, got {dtype}")
    attn = (_attn_tiles_fp8(head_dim, block_size) if precision in EIGHT_BIT_PRECISIONS
            else _attn_tiles(head_dim, block_size))
    cfg = KernelConfig(attn=attn, index=_index_tiles(head_dim, precision))
    if variant is not None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be None or one of {sorted(VARIANTS)}, got {variant!r}")
        cfg = VARIANTS[variant](cfg)
    if block_size % cfg.attn.block_n:
        raise ValueError(f"block_size {block_size} must be a multiple of the attention tile's block_n "
                         f"{cfg.attn.block_n}")
    return cfg
