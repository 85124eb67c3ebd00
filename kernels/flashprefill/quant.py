"""FP8 (e4m3) quantisation of FlashPrefill's operands: the constants and the scale rules.

The one owner of these facts for every implementation (the CPU reference simulates them with
``torch.float8_e4m3fn`` round trips; the Triton kernels use the same constants). Importable without
triton. The full semantics, with the reasoning and the buffers a GPU path builds: ``docs/fp8.md``.

Rules (``docs/fp8.md`` sections 2-4):

- ``scale = amax / E4M3_MAX`` and ``inv_scale = E4M3_MAX / amax``, both float32, round to nearest;
  ``amax`` of ``|x|`` in float32, NaN ignored; ``amax < AMAX_FLOOR`` (zero included) gives
  ``scale = inv_scale = 1``.
- ``code = e4m3(clamp(float32(x) * inv_scale, -E4M3_MAX, E4M3_MAX))``: one float32 multiply, round
  to nearest even, saturating; ``x ≈ float32(code) * scale``.
- K and V: one scale per (request, KV head) over the request's ``Lk`` tokens; the block means use
  the scale of their K / V. Q: one scale per query tile (128 GQA-packed rows, one KV head).
- Probabilities ``p = exp(logit - m)`` in ``(0, 1]`` are cast as ``e4m3(p * P_SCALE)``.

``precision="int8qk"`` (``docs/fp8.md`` section 10): Q and K (and the key means) take int8 codes
instead, ``scale = amax / INT8_MAX``, ``inv_scale = INT8_MAX / amax`` (same float64 rounding, same
floor), ``code = int8(clamp(rne(float32(x) * inv_scale), -127, 127))`` with NaN -> 0
(``int8_scales``, ``quantize_int8``); V and P stay e4m3 as above.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
# Largest finite e4m3fn value (1.75 * 2**8); no infinity in this format.
E4M3_MAX = 448.0
# Below this amax a tensor quantises with scale 1: 448 / amax overflows float32 near 2**-119 (bf16
# subnormals reach 2**-133), and a tensor this small contributes nothing measurable anyway.
AMAX_FLOOR = 2.0 ** -100
# The probability factor (FA3's "max offset" of 8 binades): p in (0, 1] is cast as p * 256, so the
# largest value 256 stays below E4M3_MAX (no saturation) while the smallest normal e4m3 (2**-6)
# now holds p = 2**-14 and p <= 2**-18 (a logit 18 ln 2 = 12.5 below the row max) rounds to zero,
# instead of 2**-10 (6.9 below) without it. A power of two: the multiply and its undoing (a divide of
# the fp32 accumulator) are exact, and a kernel folds it into exp2 as "+ P_SCALE_LOG2".
P_SCALE_LOG2 = 8
P_SCALE = float(2 ** P_SCALE_LOG2)


# Largest int8 code of the "int8qk" Q / K operands (symmetric: -128 is never produced).
INT8_MAX = 127.0


def amax_scales(amax: torch.Tensor, qmax: float = E4M3_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales of tensors with the given ``amax``.

    Args:
        amax: any shape, ``max |x|`` of each quantised group (float; read as float32).
        qmax: the largest code, ``E4M3_MAX`` (448, e4m3) or ``INT8_MAX`` (127, ``int8_scales``).
    Returns:
        ``(scale, inv_scale)``, float32, ``amax``'s shape: ``amax / qmax`` and ``qmax / amax``
        (round to nearest), or ``1, 1`` where ``amax < AMAX_FLOOR``. A non-finite ``amax`` (an inf
        input) gives ``scale = inf``, ``inv_scale = 0``: the group dequantises to NaN, never to a
        silently finite number.
    """
    a = amax.to(torch.float32)
    tiny = a < AMAX_FLOOR
    safe = torch.where(tiny, torch.ones_like(a), a).to(torch.float64)
    # Both quotients in float64, rounded once to float32: correctly rounded (a quotient of 24-bit
    # operands computed with 53 >= 2 * 24 + 2 bits rounds to float32 without a double-rounding
    # error), on every device. A float32 ``x / 448.0`` is not: PyTorch computes a division by a
    # Python scalar as a multiply by its rounded reciprocal (CUDA, and the CPU's vectorised path),
    # and ``448.0 / x`` as ``reciprocal(x) * 448`` -- off by one ulp for some amax.
    scale = torch.where(tiny, torch.ones_like(a), (safe / qmax).to(torch.float32))
    inv = torch.where(tiny, torch.ones_like(a), (qmax / safe).to(torch.float32))
    return scale, inv


def abs_max(x: torch.Tensor, dims) -> torch.Tensor:
    """``max |x|`` over ``dims`` in float32, NaN entries ignored (as a GPU ``fmax`` reduction)."""
    a = x.to(torch.float32).abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a).amax(dim=dims)


def quantize(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``x``: ``e4m3(clamp(float32(x) * inv_scale, -448, 448))``.

    Args:
        x: any float tensor.
        inv_scale: float32, broadcastable to ``x``.
    Returns:
        ``torch.float8_e4m3fn`` tensor of ``x``'s broadcast shape (round to nearest even; NaN stays NaN).
    """
    y = x.to(torch.float32) * inv_scale.to(torch.float32)
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` in ``dtype`` (float32 or float64; exact in float64)."""
    return codes.to(dtype) * scale.to(dtype)


def round_trip(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(quantize(x, inv_scale), scale, dtype)``: the value an FP8 GEMM operand stands for."""
    return dequantize(quantize(x, inv_scale), scale, dtype)


def kv_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head scales of one request's keys or values.

    Args:
        x: ``[Lk, Hkv, d]`` the request's K (or V), all ``Lk`` positions (cached prefix included).
    Returns:
        ``(scale, inv_scale)`` float32 ``[Hkv]``.
    """
    return amax_scales(abs_max(x, (0, 2)))


def tile_scales(q_tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile scales of GQA-packed query tiles.

    Args:
        q_tiles: ``[..., tile_rows, d]`` the unscaled queries of each tile (rows past ``Lq * g``
            zero), one KV head per tile.
    Returns:
        ``(scale, inv_scale)`` float32 ``[...]``.
    """
    return amax_scales(abs_max(q_tiles, (-2, -1)))


def p_round_trip(p: torch.Tensor) -> torch.Tensor:
    """``e4m3(p * P_SCALE)`` read back in ``p``'s dtype: the FP8 P operand, still times ``P_SCALE``.

    Args:
        p: probabilities ``exp(logit - m)`` in ``[0, 1]``, float32 or float64.
    Returns:
        same shape and dtype; divide the product with V by ``P_SCALE`` (exact) to undo the factor.
    """
    return (p * P_SCALE).to(E4M3).to(p.dtype)


# --------------------------------------------------------------------------------------------
# int8 Q / K operands of precision "int8qk" (docs/fp8.md section 10)


def int8_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``amax_scales(amax, INT8_MAX)``: ``(amax / 127, 127 / amax)`` float32, ``1, 1`` below
    ``AMAX_FLOOR``."""
    return amax_scales(amax, INT8_MAX)


def quantize_int8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of ``x``: ``clamp(rne(float32(x) * inv_scale), -127, 127)``.

    One float32 multiply, then round half to even (``torch.round``) and the clamp; a NaN product
    (a NaN input, or ``inf * 0`` from an inf group) gives code 0, as the kernels do (int8 has no
    NaN code).

    Args:
        x: any float tensor.
        inv_scale: float32, broadcastable to ``x``.
    Returns:
        ``torch.int8`` tensor of the broadcast shape, values in ``[-127, 127]``.
    """
    y = x.to(torch.float32) * inv_scale.to(torch.float32)
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    return torch.round(y.clamp(-INT8_MAX, INT8_MAX)).to(torch.int8)


def round_trip_int8(x: torch.Tensor, scale: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(quantize_int8(x, inv_scale), scale, dtype)``: the value an int8 operand stands for."""
    return dequantize(quantize_int8(x, inv_scale), scale, dtype)
