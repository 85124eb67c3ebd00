"""Decode attention over a static-size KV cache under a key mask: what a captured decode step runs.

A CUDA-graph decode step (``fpcli.engine.decode_graph``) cannot let the number of cached tokens
shape a kernel launch: every step reads the whole reserved capacity ``Lmax`` of the KV buffers and
masks the slots not written yet (the mask is computed on the device from the length counter).
``decode_masked`` is that attention in plain PyTorch: static shapes, no host read, capturable::

    query [B, Hq, Lq, d]   key [B, Hkv, Lmax, d]   value [B, Hkv, Lmax, dv]   mask [B|1, 1, Lq|1, Lmax]

with ``Hq = g * Hkv`` (query head ``h`` reads KV head ``h // g``) and ``Lq`` small (1 at decode).

1. **GQA as batched GEMMs, K/V never expanded or copied.** The ``g`` query heads of a KV head
   (and their ``Lq`` rows) are the ``R = g * Lq`` rows of one matrix. The keys are split into
   ``S`` equal splits of ``C = Lmax / S`` keys (``kv_splits``: the largest divisor of ``Lmax`` up
   to ``KV_SPLITS``), each a batch entry of its own: ``B * Hkv * S`` GEMMs
   ``[R, d] x [d, C]`` give the scores ``[B*Hkv*S, R, C]`` in float32 (bf16 operands, float32
   accumulation and output: ``torch.bmm(..., out_dtype=torch.float32)`` on CUDA; on the CPU the
   operands are upcast). Splitting matters for ``P @ V``: unsplit it is ``[R, Lmax] x [Lmax, dv]``,
   a reduction over all keys that cuBLAS gives to a few thread blocks (the float32 math backend
   spent 142.6 ms of a 130K step in such a kernel, ``gemmSN_NN``, on the H200; twelfth session,
   docs/benchmarks.md); split, each batch entry reduces ``C`` keys and the GPU is full.
2. **Mask and softmax in float32.** Masked slots become ``-inf`` (in place); one max over all
   ``Lmax`` keys per row (within the splits, then over them), ``exp((s - max) * scale)`` and its
   row sum ``l``.
3. **``P @ V`` in bf16, accumulated in float32.** The unnormalised ``P`` (in [0, 1]) is cast to
   V's dtype; ``B*Hkv*S`` GEMMs ``[R, C] x [C, dv]`` in float32, summed over the ``S`` splits, then
   divided by ``l``.

Worked example, Qwen2.5-0.5B at a 130,304-token capacity (``Hkv`` 2, ``g`` 7, ``d`` 64, one
query row): ``S = 32`` splits of ``C = 4,072`` keys; 64 GEMMs ``[7, 64] x [64, 4072]`` -> scores
``[64, 7, 4072]`` float32 (7.3 MB); 64 GEMMs ``[7, 4072] x [4072, 64]`` -> ``[2, 32, 7, 64]``
partial outputs, summed over the 32 splits -> ``[2, 7, 64]`` -> ``[1, 1, 14, 64]``.

Cost per decode step (24 layers, 130,304 KV slots): K and V are read once, 2 heads x 130,304 x
64 x 2 bytes = 33.4 MB each per layer, **1.60 GB per step, 0.33 ms at the H200's ~4.8 TB/s**; the
float32 scores (7.3 MB per layer) are written once and passed over by 7 elementwise and reduction
kernels (16 kernels per layer in all). Measured alone (H200, torch 2.11, random bf16 K/V with
garbage past 130,001 valid slots, 24 calls in one CUDA graph, mean of 50 replays; the helper's lab run of
2026-12-03, not in docs/benchmarks.md): **2.16 ms per step** (90 us per layer; at 64 splits the
profiler gave the two GEMMs 30 + 20 us per layer, ~1.1 and ~1.6 TB/s of K and V, the rest to the
elementwise kernels), against 99.7 ms for SDPA's math backend on the same inputs (the twelfth
session's kernel) and 0.60 ms for SDPA's flash kernel without a mask over the 130,001 valid keys
(what the eager decode runs; in a graph its key count would be frozen). Other split counts:
16 -> 2.55 ms, 64 -> 2.65 ms, 1 (unsplit) -> 5.95 ms; an in-place ``masked_fill_`` beat
``torch.where`` by ~1%; single-call reductions over two dims (``amax((1, 3))``) and ``baddbmm``
with an additive bias were slower (3.3-3.5 ms).
A fused split-KV kernel (Triton) that reads the length from the device would close the gap to
flash (~0.6 ms); not built.

Other lengths split by their largest divisor up to ``KV_SPLITS`` (the graph's capacities are
multiples of 256, so 32 splits; a prime ``Lmax`` is one split: correct, slower).

Precision: the scores are float32 from bf16 operands (as SDPA's math backend computed them, without
its float32 copies of K and V); ``P`` is rounded to bf16 (relative error <= 2^-8 per weight, as in
FlashAttention's ``P @ V``); sums in float32. Against a float64 reference on the inputs above the
float32 output erred by 3.2e-4 at most (absolute, outputs of order 1), below the bf16 rounding of
the result.

Imports nothing of ``fp``.
"""
from __future__ import annotations

import torch

KV_SPLITS = 32  # key splits per KV head at most (H200, 130K: 32 -> 2.16 ms a step, 16 -> 2.55, 64 -> 2.65)
# torch.bmm(..., out_dtype=torch.float32) for bf16/fp16 inputs on CUDA (torch >= 2.8); older
# versions upcast the operands (float32 copies of K and V, as SDPA's math backend made)
_BMM_OUT_DTYPE = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 8)


def kv_splits(lmax: int, cap: int = KV_SPLITS) -> int:
    """The number of key splits for ``lmax`` keys: the largest divisor of ``lmax`` that is at most
    ``cap`` (equal splits, no tail).

    >>> kv_splits(130304), kv_splits(6144), kv_splits(300), kv_splits(37), kv_splits(1)
    (32, 32, 30, 1, 1)
    """
    for s in range(min(cap, lmax), 1, -1):
        if lmax % s == 0:
            return s
    return 1


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched) accumulated and returned in float32, without float32 copies of 16-bit
    operands on CUDA (torch >= 2.8); upcast elsewhere."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _BMM_OUT_DTYPE:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _mergeable(t: torch.Tensor) -> bool:
    """Whether ``t [B, Hkv, Lmax, x]`` views as ``[B*Hkv*S, Lmax/S, x]`` (its heads ``Lmax`` tokens apart)."""
    b, h, lmax, _ = t.shape
    return (h == 1 or t.stride(1) == lmax * t.stride(2)) and (b == 1 or t.stride(0) == h * lmax * t.stride(2))


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"decode_masked: expected 4D query, key, value, got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    b, hq, lq, d = query.shape
    _, hkv, lmax, _ = key.shape
    if key.shape != (b, hkv, lmax, d) or value.shape[:3] != (b, hkv, lmax) or hkv == 0 or hq % hkv:
        raise ValueError(f"decode_masked: expected key [B, Hkv, Lmax, d] and value [B, Hkv, Lmax, dv] with Hq a "
                         f"multiple of Hkv for query {tuple(query.shape)}, got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    if (mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1 or mask.shape[2] not in (1, lq)
            or mask.shape[3] != lmax):
        raise ValueError(f"decode_masked: expected a mask [{b} or 1, 1, {lq} or 1, {lmax}], got {tuple(mask.shape)}")


def decode_masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """Attention of a few query rows over a static-size KV cache under a key mask (module docstring).

    Args:
        query: ``[B, Hq, Lq, d]`` (bf16/fp16 on a GPU, any float dtype on the CPU), RoPE applied.
        key: ``[B, Hkv, Lmax, d]``, value ``[B, Hkv, Lmax, dv]``, the query's dtype and device; the
            whole reserved capacity, unwritten slots holding anything (masked). Splitting needs the
            ``B * Hkv`` heads mergeable into one batch dimension (``B == 1``, or head stride
            ``Lmax`` tokens); otherwise one split runs (correct, slower).
        mask: ``[B or 1, 1, Lq or 1, Lmax]``, bool (True = attend) or additive float; every
            query row must see at least one key (a row with none gives NaN).
        scale: softmax scale (default ``d ** -0.5``).
        splits: key splits per KV head (default ``kv_splits(Lmax)``); must divide ``Lmax``.

    Returns:
        ``[B, Lq, Hq, dv]`` in the query's dtype.

    Raises:
        ValueError: shapes that do not fit the above, or ``splits`` not dividing ``Lmax``.
    """
    _check(query, key, value, mask)
    b, hq, lq, d = query.shape
    hkv, lmax, dv = key.shape[1], key.shape[2], value.shape[3]
    g, heads = hq // hkv, b * hkv
    rows = g * lq  # query rows per KV head: head-major, then position
    s_count = kv_splits(lmax) if splits is None else int(splits)
    if s_count < 1 or lmax % s_count:
        raise ValueError(f"decode_masked: expected splits dividing Lmax = {lmax}, got {splits}")
    if not (_mergeable(key) and _mergeable(value)):
        s_count = 1  # the heads and the splits cannot share one batch dimension without a copy of K/V
    c = lmax // s_count
    scale = d ** -0.5 if scale is None else float(scale)

    # [B*Hkv*S, R, d]: each split's batch entry gets its KV head's query rows (a copy of q only)
    q = query.reshape(heads, 1, rows, d).expand(heads, s_count, rows, d).reshape(heads * s_count, rows, d)
    k = key.reshape(heads * s_count, c, d)  # views: split j of head h holds keys j*C .. (j+1)*C - 1
    v = value.reshape(heads * s_count, c, dv)
    s = _bmm_f32(q, k.transpose(1, 2)).view(b, hkv, s_count, g, lq, c)  # float32 scores

    m = mask.reshape(mask.shape[0], mask.shape[2], s_count, c).permute(0, 2, 1, 3)  # [B|1, S, Lq|1, C]
    m = m[:, None, :, None]  # -> [B|1, 1, S, 1, Lq|1, C] against s [B, Hkv, S, g, Lq, C]
    if m.dtype == torch.bool:
        s.masked_fill_(~m, float("-inf"))
    else:
        s.add_(m)
    s = s.view(heads, s_count, rows, c)
    top = s.amax(dim=3, keepdim=True).amax(dim=1, keepdim=True)  # [B*Hkv, 1, R, 1]: max over all Lmax keys
    p = s.sub_(top).mul_(scale).exp_()  # unnormalised, in [0, 1], float32
    total = p.sum(dim=3, keepdim=True).sum(dim=1)  # [B*Hkv, R, 1]
    part = _bmm_f32(p.to(value.dtype).view(heads * s_count, rows, c), v)  # [B*Hkv*S, R, dv] float32
    out = part.view(heads, s_count, rows, dv).sum(dim=1).div_(total)  # [B*Hkv, R, dv]
    out = out.view(b, hq, lq, dv).transpose(1, 2)
    return out.to(query.dtype) if lq == 1 else out.contiguous().to(query.dtype)


__all__ = ["KV_SPLITS", "decode_masked", "kv_splits"]
