"""Token offsets from a Hugging Face tokenizer: where each token of a text begins; and the common
prefix of two prompts' token ids (what a KV cache can reuse).

Prompt building (``fpcli.prompt``) cuts documents on token boundaries with these offsets, so a
cut keeps exactly the tokens it counts, whatever the text's token density.
"""
from __future__ import annotations


def token_starts(tokenizer, text: str) -> list[int]:
    """Character offset in ``text`` where each of its tokens begins (no special tokens added).

    Args:
        tokenizer: a fast Hugging Face tokenizer (``PreTrainedTokenizerFast``; offsets need one).
        text: any string.

    Returns:
        ``n`` non-decreasing offsets in ``[0, len(text)]``, ``n`` = the text's token count
        (``len(tokenizer(text, add_special_tokens=False).input_ids)``). Tokens that share a
        character (a multi-byte character split over byte tokens) share its offset.

    Raises:
        ValueError: ``tokenizer`` is a slow (Python) tokenizer, which has no offsets.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"token offsets need a fast tokenizer (tokenizer.json); got {type(tokenizer).__name__}")
    import numpy as np

    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    # clip to the text, then a running maximum: non-decreasing even where a tokenizer reports a
    # byte token's start before its predecessor's (e.g. [0, 3, 2, 5] -> [0, 3, 3, 5])
    starts = np.maximum.accumulate(np.clip(offsets[:, 0], 0, len(text)))
    return starts.tolist()


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of token id lists ``a`` and ``b``, at most ``limit``.

    >>> common_prefix_len([1, 2, 3, 4], [1, 2, 5], limit=10)
    2
    """
    n = min(len(a), len(b), len(a) + len(b) if limit is None else max(0, limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
