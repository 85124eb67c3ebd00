"""FlashPrefill V2 as a prefill (extend) attention backend of stock SGLang 0.5.17.

Modules (SGLang is imported lazily, only by ``backend.py`` and ``plugin.py``):

- ``settings.py``: ``BackendSettings``, the profile knobs that cross the process boundary to
  SGLang's scheduler processes (one JSON environment variable).
- ``metadata.py``: the per-batch metadata dataclass and its builder (page table, plan).
- ``stats.py``: per-layer density and prefill timing recorded on the device without a host
  sync, written by the scheduler to a JSONL file that the CLI reads back.
- ``backend.py``: ``FlashPrefillAttnBackend(AttentionBackend)``.
- ``plugin.py``: ``register()`` (the ``sglang.srt.plugins`` entry point) and the scheduler entry
  wrapper that registers inside every scheduler process.
"""
