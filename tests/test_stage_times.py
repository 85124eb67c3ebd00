"""``fpcli.stage_times``: the per-sparse-layer index / attention times and the one-time cost of a first layer."""
from __future__ import annotations

import pytest

from fpcli.stage_times import ONE_TIME_FACTOR, stage_times


def test_the_module_docstring_example():
    t = stage_times([2, 3, 4], [400.0, 0.1, 0.12], [90.0, 0.3, 0.28])
    assert t.one_time_layer == 2 and t.median_ms == pytest.approx(0.4)
    assert t.index_share == pytest.approx(0.22 / 0.80) and t.all_layers_share == pytest.approx(400.22 / 490.8)
    assert t.share_over == "layers 3-4 (warm: layer 2 left out)"
    assert (t.index_ms, t.attention_ms) == (pytest.approx(400.22), pytest.approx(90.58))   # totals keep layer 2
    assert t.notes == ("layer 2: 490.00 ms against a median of 0.40 ms: likely one-time kernel compilation (or a "
                       "load from Triton's cache) in this process; the share is taken over the other layers",)


def test_no_one_time_cost_at_or_below_the_factor():
    """A first layer at exactly ONE_TIME_FACTOR x the others' median is not flagged; the share is
    over every sparse layer."""
    t = stage_times([5, 6, 7], [ONE_TIME_FACTOR * 0.25, 0.25, 0.25], [ONE_TIME_FACTOR * 0.75, 0.75, 0.75])
    assert t.one_time_layer is None and t.notes == () and t.share_over == "layers 5-7"
    assert t.index_share == pytest.approx(0.25) and t.share_index_ms == t.index_ms


def test_one_sparse_layer_has_no_median_and_no_note():
    t = stage_times([9], [50.0], [1.0])
    assert t.median_ms is None and t.one_time_layer is None and t.share_over == "layer 9"
    assert [r.layer for r in t.layers] == [9] and t.layers[0].index_share == pytest.approx(50 / 51)


def test_not_measured_and_mismatched_lists():
    assert stage_times([2, 3], [], []) is None
    with pytest.raises(ValueError, match=r"one entry per sparse layer \(2: \[2, 3\]\), got 3 and 2"):
        stage_times([2, 3], [0.1, 0.1, 0.1], [0.2, 0.2])
