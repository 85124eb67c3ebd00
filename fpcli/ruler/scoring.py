"""RULER's string-match metric (``string_match_all``).

A sample's score is the fraction of its expected strings that occur in the answer, compared
case-insensitively as substrings (RULER, section 3 / its ``string_match_all``); a cell's score is
the mean over its samples in points, 0-100.

>>> string_match(["4821937"], "The number is 4821937.")
1.0
>>> string_match(["alpha", "beta"], "ALPHA only")
0.5
"""
from __future__ import annotations

from typing import Sequence


def string_match(expected: Sequence[str], answer: str) -> float:
    """Fraction (0.0-1.0) of ``expected`` strings found in ``answer``, case-insensitively.

    Raises:
        ValueError: ``expected`` is empty (a sample with nothing to find cannot be scored).
    """
    if not expected:
        raise ValueError("expected: at least one string to find, got none")
    text = answer.lower()
    return sum(1.0 for e in expected if e.lower() in text) / len(expected)


def mean_points(scores: Sequence[float]) -> float:
    """Mean of per-sample fractions, in points (0-100).

    Raises:
        ValueError: ``scores`` is empty.
    """
    if not scores:
        raise ValueError("scores: at least one sample score, got none")
    return 100.0 * sum(scores) / len(scores)
