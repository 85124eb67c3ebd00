"""FlashPrefill V2 inside inference engines, beside the operator and needing nothing else of ``fp``.

- ``integrations.sglang``: the ``flashprefill`` prefill attention backend of stock SGLang
  (``--prefill-attention-backend flashprefill``), registered by the ``sglang.srt.plugins`` entry
  point of this distribution.
- ``integrations.transformers``: the flashprefill attention function registered into
  transformers' ``AttentionInterface`` (``attn_implementation="fp_sparse_prefill"``).

Both call ``flashprefill_attention(..., return_index=True)`` (the path the operator benchmark
times) and derive their statistics from the index it returns. Neither module imports ``fpcli``.
"""
