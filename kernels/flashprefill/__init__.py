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

# The rest is imported on first use (PEP 562): ``import flashprefill.flops`` / ``flashprefill.config``
# / ``flashprefill.lengths`` cost no torch import, which a client process (the resident engine's
# ``fp ask``) must not pay for.
_LAZY = {
    "BlockIndex": ".index", "SparseStats": ".index", "BatchPlan": ".plan", "make_plan": ".plan",
    "plan": ".plan", "flashprefill_attention": ".api", "build_index": ".api", "dense_attention": ".api",
    "BACKENDS": ".api",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'flashprefill' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(_LAZY[name], __name__)
    from .plan import make_plan

    globals()["plan"] = make_plan  # ``flashprefill.plan`` is the function, not the submodule
    return make_plan if name == "plan" else getattr(module, name)


__all__ = [
    "SparseConfig", "BlockIndex", "SparseStats", "BatchPlan", "make_plan", "plan",
    "flashprefill_attention", "build_index", "dense_attention", "BACKENDS", "PRECISIONS",
]
