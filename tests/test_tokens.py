"""``fpcli.engine.tokens.token_starts``: offsets from a fast tokenizer's offset mapping."""
from __future__ import annotations

import pytest

from fpcli.engine.tokens import token_starts


class OffsetsTokenizer:
    """A fast tokenizer stand-in that reports a fixed offset mapping."""

    is_fast = True

    def __init__(self, offsets):
        self.offsets = offsets

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        assert add_special_tokens is False and return_offsets_mapping is True
        return {"input_ids": list(range(len(self.offsets))), "offset_mapping": self.offsets}


def test_starts_are_clipped_and_non_decreasing():
    # a byte token reporting a start before its predecessor's, and one past the end of the text
    tok = OffsetsTokenizer([(0, 3), (3, 4), (2, 4), (5, 6), (9, 12)])
    assert token_starts(tok, "abcdefg") == [0, 3, 3, 5, 7]


def test_empty_text_has_no_starts():
    assert token_starts(OffsetsTokenizer([]), "") == []


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(ValueError, match="fast tokenizer"):
        token_starts(Slow(), "abc")
