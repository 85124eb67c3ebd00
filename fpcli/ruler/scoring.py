"""RULER's string-match metric (``string_match_all``), and the sign test of a paired comparison.

A sample's score is the fraction of its expected strings that occur in the answer, compared
case-insensitively as substrings (RULER, section 3 / its ``string_match_all``); a cell's score is
the mean over its samples in points, 0-100.

>>> string_match(["4821937"], "The number is 4821937.")
1.0
>>> string_match(["alpha", "beta"], "ALPHA only")
0.5
"""
from __future__ import annotations

from math import comb
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


def sign_test_p(lost: int, won: int) -> float:
    """Two-sided exact sign test of a paired comparison: the probability, were each changed
    sample equally likely to be lost or won (no effect), of a split at least as uneven as
    ``lost`` / ``won`` (samples scored the same by both profiles do not count). ``min(1, 2 *
    P(X <= min(lost, won)))`` for ``X ~ Binomial(lost + won, 1/2)``; 1.0 when nothing changed.
    ``docs/eval.md``, "Reading the table".

    >>> sign_test_p(1, 0)
    1.0
    >>> sign_test_p(6, 0)
    0.03125

    Raises:
        ValueError: ``lost`` or ``won`` negative.
    """
    if lost < 0 or won < 0:
        raise ValueError(f"lost and won must be >= 0, got {lost} and {won}")
    n = lost + won
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(lost, won) + 1)) / 2 ** n
    return min(1.0, 2.0 * tail)
