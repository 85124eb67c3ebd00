"""FlashPrefill V2 as a prefill (extend) attention backend of stock SGLang 0.5.17.

Usable with the operator library alone: ``--prefill-attention-backend flashprefill`` once this
distribution is installed (the ``sglang.srt.plugins`` entry point); nothing here imports ``fpcli``.

Modules (SGLang is imported lazily, only by ``backend.py`` and ``plugin.py``):

- ``settings.py``: ``BackendSettings``, the frozen settings that cross the process boundary to
  SGLang's scheduler processes (one JSON environment variable, the only transport there is).
- ``metadata.py``: the per-batch metadata dataclass and its builder (page table, plan).
- ``stats_writer.py`` (scheduler process): per-layer density, from the index each sparse layer's
  attention returned, and prefill timing, recorded on the device without a host sync and
  written to a JSONL file.
- ``stats_reader.py`` (the process that started SGLang): reads those lines back per request.
- ``backend.py``: ``FlashPrefillAttnBackend(AttentionBackend)``.
- ``plugin.py``: ``register()`` (the ``sglang.srt.plugins`` entry point) and the scheduler entry
  wrapper that registers inside every scheduler process.
"""
