"""Attention FLOPs of a prefill: the one formula the benchmarks and the engines' statistics use.

Counting (``docs/method.md`` section 2, notation): query token ``t`` of a chunk of ``Lq`` new
tokens after a prefix of ``P = Lk - Lq`` cached tokens sees the ``P + t + 1`` keys at positions
``<= P + t`` (bottom-right causal alignment). Each (query, key) pair of one query head costs two
multiply-adds per dimension, one in ``q kᵀ`` and one in ``p v``: ``4 d`` FLOPs. Softmax
exponentials, masking and the index stage are not counted.

    causal_pairs(Lq, Lk)     = Σ_{t < Lq} (P + t + 1) = Lq P + Lq (Lq + 1) / 2
    dense_causal_flops(...)  = 4 d Hq causal_pairs(Lq, Lk)
    sparse_flops(..., ρ)     = ρ dense_causal_flops(...), ρ = selected / causally visible blocks

Example: ``Lq = Lk = 2048, d = 64, Hq = 9``: ``4 * 64 * 9 * (2048 * 2049 / 2) = 4.83e9`` FLOPs.
Importing this module imports nothing (no torch).
"""
from __future__ import annotations


def causal_pairs(q_len: int, kv_len: int) -> int:
    """(query token, key) pairs of one head that a causal chunk attends: ``Σ_{t < Lq} (P + t + 1)``.

    Args:
        q_len: ``Lq``, new query tokens (>= 0).
        kv_len: ``Lk``, keys including the prefix (``>= q_len``).

    Raises:
        ValueError: a negative ``q_len`` or ``kv_len < q_len``.
    """
    if q_len < 0 or kv_len < q_len:
        raise ValueError(f"need 0 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    prefix = kv_len - q_len
    return q_len * prefix + q_len * (q_len + 1) // 2


def dense_causal_flops(q_len: int, kv_len: int, head_dim: int, q_heads: int, batch: int = 1) -> float:
    """Dense-equivalent FLOPs of causal prefill attention (``q kᵀ`` and ``p v``), one layer.

    ``4 * head_dim * q_heads * causal_pairs(q_len, kv_len) * batch`` (FLOPs, a float): ``batch``
    requests of the same lengths. Divide by milliseconds x 1e9 for TFLOP/s.

    Raises:
        ValueError: as ``causal_pairs``.
    """
    return 4.0 * head_dim * q_heads * causal_pairs(q_len, kv_len) * batch


def sparse_flops(dense_flops: float, density: float) -> float:
    """FLOPs of the exact (selected) blocks: ``density * dense_flops``, ``density`` the fraction of
    causally visible key blocks selected (``SparseStats.density``, 0..1). The mean correction's
    ``n_U`` mean keys per tile are not counted. ``dense_flops * (1 - density)`` is what was skipped.

    Raises:
        ValueError: ``density`` outside ``[0, 1]``.
    """
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    return dense_flops * density
