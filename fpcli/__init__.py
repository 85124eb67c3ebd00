"""fp: ask questions about long documents with a local LLM, fast (FlashPrefill V2 prefill)."""

__version__ = "0.1.0"
