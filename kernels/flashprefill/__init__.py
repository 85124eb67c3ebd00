"""FlashPrefill V2: training-free block-sparse prefill attention with mean correction.

Public API (``api.py``; layouts in ``docs/layout.md``)::

    flashprefill_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config=None,
                           softmax_scale=None, return_lse=False, return_stats=False, *,
                           plan=None, index=None, backend="auto", return_index=False, precision="bf16",
                           k_descale=None, v_descale=None)
        -> out, or (out[, lse][, stats][, index])
    build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config=None,
                softmax_scale=None, *, plan=None, backend="auto", precision="bf16",
                k_descale=None, v_descale=None) -> BlockIndex
    dense_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale=None,
                    return_lse=False, *, plan=None, backend="auto", precision="bf16",
                    k_descale=None, v_descale=None)
    make_plan(seq_lens, cu_seqlens_q, group_size, block_size=128) -> BatchPlan   (alias: plan)

Note: ``flashprefill.plan`` is the ``make_plan`` function; import the module's names with
``from flashprefill.plan import BatchPlan, make_plan``.
"""
from .config import PRECISIONS, SparseConfig
from .index import BlockIndex, SparseStats
from .plan import BatchPlan, make_plan
from .api import BACKENDS, build_index, dense_attention, flashprefill_attention

plan = make_plan

__all__ = [
    "SparseConfig", "BlockIndex", "SparseStats", "BatchPlan", "make_plan", "plan",
    "flashprefill_attention", "build_index", "dense_attention", "BACKENDS", "PRECISIONS",
]
