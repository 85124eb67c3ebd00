"""``flashprefill.flops`` (the one attention FLOP formula) and ``flashprefill.lengths`` (the one
length parser): against brute-force counts and written-out examples. CPU only, no torch needed."""
from __future__ import annotations

import itertools

import pytest

from flashprefill.flops import causal_pairs, dense_causal_flops, sparse_flops
from flashprefill.lengths import parse_length, parse_lengths


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (7, 7), (5, 12), (1, 4096), (300, 1000), (0, 10)])
def test_causal_pairs_counts_every_visible_pair(q_len, kv_len):
    prefix = kv_len - q_len
    brute = sum(1 for t, p in itertools.product(range(q_len), range(kv_len)) if p <= prefix + t)
    assert causal_pairs(q_len, kv_len) == brute


def test_dense_and_sparse_flops():
    # the worked example of the module docstring: Lq = Lk = 2048, d = 64, Hq = 9
    assert dense_causal_flops(2048, 2048, 64, 9) == 4 * 64 * 9 * (2048 * 2049 // 2)
    assert dense_causal_flops(100, 300, 128, 32, batch=3) == 3 * dense_causal_flops(100, 300, 128, 32)
    dense = dense_causal_flops(4096, 8192, 128, 32)
    assert sparse_flops(dense, 0.25) == dense / 4 and sparse_flops(dense, 1.0) == dense
    with pytest.raises(ValueError, match="q_len"):
        causal_pairs(10, 5)
    with pytest.raises(ValueError, match="density"):
        sparse_flops(dense, 1.5)


def test_parse_lengths():
    assert parse_length("4k") == 4096 and parse_length("128K") == 131072 and parse_length("131072") == 131072
    assert parse_length("0.5k") == 512 and parse_length("1m") == 1024 * 1024 and parse_length("131_072") == 131072
    assert parse_lengths("4k, 32K,1000") == [4096, 32768, 1000]
    for bad in ("", "4x", "-4k", "0", "0.3k", "4k,,8k"):
        with pytest.raises(ValueError, match="length|whole number"):
            parse_lengths(bad)
