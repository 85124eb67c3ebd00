"""Sequence lengths written the way people write them: ``"4k"``, ``"131072"``, ``"128k"``, lists.

The one parser of the project (the operator benchmark, ``fp bench``). ``k`` = 1024 tokens,
``m`` = 1024², case-insensitive; ``_`` separators are ignored (``131_072``).
"""
from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_length(text: str) -> int:
    """``"4k"`` -> 4096, ``"128K"`` -> 131072, ``"131072"`` -> 131072, ``"0.5k"`` -> 512.

    Raises:
        ValueError: naming the text, when it is not a whole number of tokens >= 1.
    """
    item = text.strip().lower().replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", item)
    if not m:
        raise ValueError(f"{text.strip()!r} is not a length (examples: 4k, 131072, 128k)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value < 1 or value != int(value):
        raise ValueError(f"{text.strip()!r} is not a whole number of tokens >= 1")
    return int(value)


def parse_lengths(text: str) -> list[int]:
    """A comma list: ``"4k, 32K,1000"`` -> ``[4096, 32768, 1000]``.

    Raises:
        ValueError: naming the first bad item (an empty item included).
    """
    return [parse_length(item) for item in text.split(",")]
