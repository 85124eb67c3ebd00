"""The block index: which key blocks each query tile computes exactly (CSR), plus block means.

Layout and worked examples: ``docs/layout.md``. Built by ``flashprefill.build_index``; consumed by
the sparse attention of the same backend. Tensors are fresh allocations owned by this object
(never views of a workspace that the next call overwrites; ``docs/method.md`` section 3.6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockIndex:
    """CSR block index of one batch (``docs/method.md`` section 3.6).

    Segments are ordered KV-head major, then request, then tile:
    ``seg = h * n_tiles + tile_ptr[b] + i`` for KV head ``h``, request ``b``, tile ``i``.

    Attributes:
        row_ptr: int32 ``[n_segments + 1]``; segment ``s`` owns ``col_idx[row_ptr[s]:row_ptr[s+1]]``.
        col_idx: int32 ``[nnz]``; key-block ids local to the request (block ``j`` covers KV
            positions ``[j*B, min((j+1)*B, Lk))``), strictly ascending within a segment, never empty.
        k_mean: float32 ``[n_blocks, Hkv, d]``; mean key of each block over its valid tokens, blocks of
            all requests pooled (request ``b`` owns rows ``block_ptr[b]:block_ptr[b+1]``).
        v_mean: float32 ``[n_blocks, Hkv, d]``; mean value, same layout.
        block_ptr: int32 ``[batch + 1]``; cumulative ``ceil(Lk_b / B)``.
        tile_ptr: int32 ``[batch + 1]``; cumulative ``ceil(Lq_b * g / 128)`` (GQA-packed tiles).
        n_visible: int32 ``[n_segments]``; causally visible blocks of each segment (blocks
            ``0 .. (P + t_last) // B``), the denominator of density.
        block_size: ``B``, tokens.
        group_size: ``g = Hq / Hkv``.
        tile_rows: packed rows per tile (128).
        k_mean_lowp, v_mean_lowp: optional ``[n_blocks, Hkv, d]`` copies of the means rounded to
            q's dtype (bf16/fp16), written by the Triton block-means kernel next to the float32
            sums; the mean correction reads them (half the bytes, no conversion after the ``nnz``
            sync). ``None`` from the reference backend.
        sel_bits: optional int32 ``[n_segments, ceil(max_blocks / 32)]``; the selection as a
            bitmask: for ``j < n_visible[s]``, bit ``j % 32`` of word ``j // 32`` of segment
            ``s`` is set iff block ``j`` is in ``s``'s CSR row (bits past ``n_visible[s]`` are
            not written: read them as garbage). Kept by the Triton index so the mean correction
            can test membership with two word loads per candidate chunk. ``None`` from the
            reference backend (the correction then folds every candidate in and takes the
            selected ones out again). It must describe the same selection as ``row_ptr`` / ``col_idx``: a
            ``BlockIndex`` built with another CSR (``dataclasses.replace``) must set it to
            ``None``.
        kv_amax: optional float32 ``[2, batch, Hkv]``; ``max |K|`` (0) and ``max |V|`` (1) of each
            (request, KV head), NaN ignored: the FP8 pre-pass's scales (``docs/fp8.md`` section 7),
            reduced by the Triton block-means kernels (``IndexConfig.fused_amax``, 16-bit caches).
            ``None`` otherwise (the pre-pass reduces them itself).
        global_pos: optional int64 ``[batch, Hkv, K]``; with ``SparseConfig.global_keys = K``, each
            (request, KV head)'s global keys as KV positions local to the request, ascending,
            ``-1`` where it has fewer (``docs/method.md`` section 4.1). ``None``: no global keys.
        fold_count: optional ``[n_blocks, Hkv]`` (the means' dtype); with ``global_pos``, the
            tokens a pruned block folds back (``n_j`` less its global keys): ``k_mean`` /
            ``v_mean`` are then the means of those tokens (0 where none is left). ``None``: ``n_j``.
        fp8_operands: optional ``impl.triton.host_fp8.Fp8Operands``: the sparse FP8 / int8qk
            attention's K / V codes and mean codes, made by the Triton index before its ``nnz`` sync
            (precision "fp8" / "int8qk"), read by that backend's ``sparse_attention`` when they fit
            its launch and this index's ``sel_bits``. ``None`` otherwise. Not counted by ``nbytes``.
    """

    row_ptr: torch.Tensor
    col_idx: torch.Tensor
    k_mean: torch.Tensor
    v_mean: torch.Tensor
    block_ptr: torch.Tensor
    tile_ptr: torch.Tensor
    n_visible: torch.Tensor
    block_size: int
    group_size: int
    tile_rows: int = 128
    k_mean_lowp: torch.Tensor | None = None
    v_mean_lowp: torch.Tensor | None = None
    sel_bits: torch.Tensor | None = None
    kv_amax: torch.Tensor | None = None
    global_pos: torch.Tensor | None = None
    fold_count: torch.Tensor | None = None
    fp8_operands: object | None = None

    @property
    def n_kv_heads(self) -> int:
        return int(self.k_mean.shape[1])

    @property
    def n_segments(self) -> int:
        return int(self.row_ptr.numel() - 1)

    @property
    def nnz(self) -> int:
        return int(self.col_idx.numel())

    def segment(self, seg: int) -> torch.Tensor:
        """Selected block ids of segment ``seg`` (int32, ascending)."""
        lo, hi = int(self.row_ptr[seg]), int(self.row_ptr[seg + 1])
        return self.col_idx[lo:hi]

    def head_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(selected, visible)``: int64 ``[Hkv]`` on the index's device, the selected and the
        causally visible key blocks of each KV head summed over its segments. No host sync (a
        caller may keep them on the device and read them once after a forward); the density of
        head ``h`` is ``selected[h] / visible[h]``.
        """
        h = self.n_kv_heads
        counts = (self.row_ptr[1:] - self.row_ptr[:-1]).to(torch.int64)
        vis = self.n_visible.to(torch.int64)
        if not counts.numel():
            zeros = torch.zeros(h, dtype=torch.int64, device=self.row_ptr.device)
            return zeros, zeros.clone()
        return counts.view(h, -1).sum(1), vis.view(h, -1).sum(1)

    def nbytes(self) -> int:
        """Bytes held by the index tensors (CSR + block means)."""
        return sum(t.numel() * t.element_size() for t in (
            self.row_ptr, self.col_idx, self.k_mean, self.v_mean, self.block_ptr, self.tile_ptr, self.n_visible,
            self.k_mean_lowp, self.v_mean_lowp, self.sel_bits, self.global_pos, self.fold_count) if t is not None)


@dataclass(frozen=True)
class SparseStats:
    """What ``flashprefill_attention(..., return_stats=True)`` reports.

    Attributes:
        density: selected / causally visible blocks over the whole batch (0..1).
        density_per_kv_head: float ``[Hkv]`` (CPU tensor), same ratio per KV head.
        selected_blocks: total selected (segment, block) pairs, ``nnz``.
        visible_blocks: total causally visible (segment, block) pairs.
        index: the ``BlockIndex`` used.
    """

    density: float
    density_per_kv_head: torch.Tensor
    selected_blocks: int
    visible_blocks: int
    index: BlockIndex

    @staticmethod
    def from_index(index: BlockIndex) -> "SparseStats":
        sel_h, vis_h = (t.cpu() for t in index.head_counts())
        sel, tot = int(sel_h.sum()), int(vis_h.sum())
        return SparseStats(
            density=(sel / tot) if tot else 1.0,
            density_per_kv_head=sel_h.double() / vis_h.clamp_min(1).double(),
            selected_blocks=sel,
            visible_blocks=tot,
            index=index,
        )
