"""Index vs attention time of one prefill, per sparse layer, and the share that ``fp profile`` heads with.

The engines time the two stages of every sparse layer (``PrefillStats.index_ms_per_layer``,
``attention_ms_per_layer``: CUDA events on a GPU). The first call of a kernel in a process compiles
it, or loads it from Triton's cache, while the GPU waits between the layer's events, so the first
sparse layer of a cold process can take far longer than the others (the xcolor.pdf run of
docs/benchmarks.md: "index 77%", against 13% at 128K in ``fp bench``).
``stage_times`` recognises that one-time cost (the first sparse layer above ``ONE_TIME_FACTOR``
times the median of the others) and then takes the headline share without that layer.

Worked example: sparse layers 2, 3, 4 with index ``[400.0, 0.1, 0.12]`` and attention
``[90.0, 0.3, 0.28]`` ms: layer 2 takes 490 ms against a median of 0.4 ms for layers 3-4, so the
share is over layers 3-4: ``0.22 / (0.22 + 0.58) = 27.5%`` (with layer 2: 82%).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from fpcli.report import layer_ranges

ONE_TIME_FACTOR = 3.0  # a first sparse layer slower than this x the others' median carries a one-time cost


@dataclass(frozen=True)
class LayerTimes:
    """One sparse layer: ``layer`` (decoder layer index), its stages' milliseconds."""

    layer: int
    index_ms: float
    attention_ms: float

    @property
    def total_ms(self) -> float:
        return self.index_ms + self.attention_ms

    @property
    def index_share(self) -> float | None:
        """index / (index + attention); ``None`` when both are 0."""
        return self.index_ms / self.total_ms if self.total_ms > 0 else None


@dataclass(frozen=True)
class StageTimes:
    """The stage times of one prefill's sparse layers.

    Attributes:
        layers: one ``LayerTimes`` per sparse layer, in layer order.
        index_ms, attention_ms: sums over all of ``layers`` (ms).
        one_time_layer: the first sparse layer when its time exceeds ``ONE_TIME_FACTOR`` x the
            median of the others (a one-time cost: kernel compilation); ``None`` otherwise.
        median_ms: the median time (index + attention, ms) of the sparse layers after the first;
            ``None`` with fewer than two sparse layers.
        share_index_ms, share_attention_ms: the sums the headline share is taken over (ms):
            without ``one_time_layer`` when there is one, else ``index_ms`` / ``attention_ms``.
        share_over: which layers those are, e.g. ``"layers 3-23 (warm: layer 2 left out)"`` or
            ``"layers 2-23"``.
        notes: sentences for the reader (the one-time cost, when recognised).
    """

    layers: tuple[LayerTimes, ...]
    index_ms: float
    attention_ms: float
    one_time_layer: int | None
    median_ms: float | None
    share_index_ms: float
    share_attention_ms: float
    share_over: str
    notes: tuple[str, ...] = ()

    @property
    def index_share(self) -> float | None:
        """The headline share: ``share_index_ms / (share_index_ms + share_attention_ms)``; ``None``
        when both are 0."""
        total = self.share_index_ms + self.share_attention_ms
        return self.share_index_ms / total if total > 0 else None

    @property
    def all_layers_share(self) -> float | None:
        """index / (index + attention) over every sparse layer, the one-time cost included."""
        total = self.index_ms + self.attention_ms
        return self.index_ms / total if total > 0 else None


def stage_times(sparse_layers: Sequence[int], index_ms_per_layer: Sequence[float],
                attention_ms_per_layer: Sequence[float]) -> StageTimes | None:
    """``StageTimes`` of one prefill from ``PrefillStats`` (``sparse_layers`` and the two per-layer
    lists, ms, one entry per sparse layer in that order); ``None`` when the lists are empty (not
    measured).

    Raises:
        ValueError: the lists' lengths differ from each other or from ``sparse_layers``.
    """
    if not index_ms_per_layer and not attention_ms_per_layer:
        return None
    n = len(sparse_layers)
    if len(index_ms_per_layer) != n or len(attention_ms_per_layer) != n:
        raise ValueError(
            f"index_ms_per_layer and attention_ms_per_layer must have one entry per sparse layer ({n}: "
            f"{list(sparse_layers)}), got {len(index_ms_per_layer)} and {len(attention_ms_per_layer)}")
    rows = tuple(sorted((LayerTimes(int(layer), float(a), float(b))
                         for layer, a, b in zip(sparse_layers, index_ms_per_layer, attention_ms_per_layer)),
                        key=lambda r: r.layer))
    index_ms = sum(r.index_ms for r in rows)
    attention_ms = sum(r.attention_ms for r in rows)
    rest = rows[1:]
    median = statistics.median(r.total_ms for r in rest) if rest else None
    first = rows[0]
    if median is not None and first.total_ms > ONE_TIME_FACTOR * median:
        return StageTimes(
            layers=rows, index_ms=index_ms, attention_ms=attention_ms, one_time_layer=first.layer,
            median_ms=median,
            share_index_ms=sum(r.index_ms for r in rest), share_attention_ms=sum(r.attention_ms for r in rest),
            share_over=f"{layer_ranges([r.layer for r in rest])} (warm: layer {first.layer} left out)",
            notes=(f"layer {first.layer}: {first.total_ms:.2f} ms against a median of {median:.2f} ms: likely "
                   f"one-time kernel compilation (or a load from Triton's cache) in this process; the share is taken "
                   f"over the other layers",),
        )
    return StageTimes(layers=rows, index_ms=index_ms, attention_ms=attention_ms, one_time_layer=None,
                      median_ms=median, share_index_ms=index_ms, share_attention_ms=attention_ms,
                      share_over=layer_ranges([r.layer for r in rows]))
