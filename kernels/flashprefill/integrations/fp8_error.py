"""8-bit-vs-BF16 output error of the sparse prefill, per request and KV head (both integrations).

When an engine is asked to compare (``FlashPrefillRuntime.compare_fp8``,
``BackendSettings.compare_fp8``), each sparse layer that ran an 8-bit precision
(``EIGHT_BIT_PRECISIONS``: ``"fp8"``, ``"int8qk"``; ``out_fp8`` below is its output) also runs the
BF16 operator on the same inputs (its own index, as ``flashprefill.bench`` does) and keeps two
sums per (request, KV head) over the request's query tokens, the ``g`` query heads of the KV head
and ``d``::

    err_sq = sum (out_fp8 - out_bf16)**2        ref_sq = sum out_bf16**2      (float64)

The relative L2 error is ``sqrt(err_sq / ref_sq)`` (``rel_l2``). Sums, not ratios, are recorded so
that the chunks of one request add up before the ratio is taken.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def fp8_error_sums(out_fp8: torch.Tensor, out_bf16: torch.Tensor, kv_heads: int,
                   token_request: torch.Tensor | None = None, batch: int = 1) -> torch.Tensor:
    """Squared-error and squared-reference sums per (request, KV head).

    Args:
        out_fp8, out_bf16: ``[total_q, Hq, d]`` (any float dtype, same shape and device).
        kv_heads: ``Hkv``; ``Hq`` must be a multiple of it (query head ``h`` reads KV head
            ``h // (Hq / Hkv)``).
        token_request: int64 ``[total_q]`` on the outputs' device, the request of each query token
            (``None``: every token belongs to request 0).
        batch: the number of requests ``B``.

    Returns:
        float64 ``[2, B, Hkv]``: ``[0]`` = ``err_sq``, ``[1]`` = ``ref_sq``, on the outputs' device
        (no host sync).

    Raises:
        ValueError: the shapes differ or ``Hq`` is not a multiple of ``kv_heads``.
    """
    if out_fp8.shape != out_bf16.shape or out_fp8.dim() != 3:
        raise ValueError(f"fp8_error_sums: outputs must both be [total_q, Hq, d], got "
                         f"{tuple(out_fp8.shape)} and {tuple(out_bf16.shape)}")
    tq, hq, d = out_fp8.shape
    if kv_heads < 1 or hq % kv_heads:
        raise ValueError(f"fp8_error_sums: Hq = {hq} is not a multiple of kv_heads = {kv_heads}")
    ref = out_bf16.double().view(tq, kv_heads, hq // kv_heads, d)
    err = (out_fp8.double().view_as(ref) - ref).square().sum(dim=(2, 3))  # [total_q, Hkv]
    den = ref.square().sum(dim=(2, 3))
    both = torch.stack([err, den])  # [2, total_q, Hkv]
    out = both.new_zeros(2, batch, kv_heads)
    if token_request is None:
        out[:, 0] = both.sum(dim=1)
    else:
        out.index_add_(1, token_request, both)
    return out


def rel_l2(err_sq: Sequence[float], ref_sq: Sequence[float]) -> list[float]:
    """``sqrt(err_sq / ref_sq)`` element-wise (``0.0`` where both are 0, ``inf`` where only the
    reference is 0)."""
    return [math.sqrt(e / r) if r > 0 else (0.0 if e == 0 else math.inf) for e, r in zip(err_sq, ref_sq)]


def layer_rel_l2(err_sq: Sequence[float], ref_sq: Sequence[float]) -> float:
    """The relative L2 error over all KV heads of a layer."""
    return rel_l2([sum(err_sq)], [sum(ref_sq)])[0]


__all__ = ["fp8_error_sums", "layer_rel_l2", "rel_l2"]
