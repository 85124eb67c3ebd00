"""Which decoder layers attend densely: the one rule of both integrations (SGLang's
``BackendSettings.dense_layers``, transformers' ``FlashPrefillRuntime.dense_layers``) and of
``fp``'s profiles.

A ``dense_layers`` value is one of two forms (``DenseLayers``):

- an ``int`` N >= 0: the first N decoder layers (ids ``0 .. N-1``) are dense; ``0`` = none;
- a ``tuple`` of layer ids (0-based ints >= 0, strictly increasing, not ``0 .. N-1``): exactly
  those layers are dense, e.g. ``(0, 1, 8, 9, 10, 11)``.

``fpcli.profiles`` parses a profile's YAML (``[0, 1, 8-11]``) into this form and keeps an int for
the first-N case, so a set that is a prefix is written as its int. JSON carries the tuple as a
list (``to_data``; ``from_data`` turns it back). Layer ids past the model's last layer are allowed and match
no layer.

Example::

    >>> [dense_layer((0, 1, 8, 9), i) for i in range(4)], dense_layer(2, 1), dense_layer(2, 2)
    ([True, True, False, False], True, False)
    >>> dense_layers_text((0, 1, 8, 9, 10, 11)), dense_layers_text(12)
    ('[0-1, 8-11]', '12')
"""
from __future__ import annotations

from typing import Any, Union

DenseLayers = Union[int, tuple[int, ...]]


def dense_layers_problem(value: Any) -> str | None:
    """What is wrong with ``value`` as a ``DenseLayers`` (``None`` if it is valid): an int >= 0
    (not a bool), or a tuple of ints >= 0 in strictly increasing order."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value >= 0 else f"an int must be >= 0, got {value}"
    if not isinstance(value, tuple):
        return f"must be an int >= 0 or a tuple of layer ids, got {type(value).__name__} {value!r}"
    for i, layer in enumerate(value):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            return f"layer ids must be ints >= 0, got {layer!r} in {value!r}"
        if i and layer <= value[i - 1]:
            return f"layer ids must be strictly increasing (sorted, no repeats), got {value!r}"
    return None


def to_data(dense_layers: DenseLayers) -> int | list[int]:
    """``dense_layers`` as plain data for JSON: an int as it is, a tuple as a list."""
    return dense_layers if isinstance(dense_layers, int) else list(dense_layers)


def from_data(value: Any) -> Any:
    """``value`` read back from JSON: a list becomes a tuple (JSON has no tuples); anything else
    as it is (validate with ``dense_layers_problem``)."""
    return tuple(value) if isinstance(value, list) else value


def dense_layer(dense_layers: DenseLayers, layer: int) -> bool:
    """Whether decoder layer ``layer`` (0-based id) attends densely under ``dense_layers``: an int
    N: ``layer < N``; a tuple: ``layer`` is in it. A list (from JSON) counts as its tuple."""
    if isinstance(dense_layers, int):
        return layer < dense_layers
    return layer in dense_layers


def dense_layer_ids(dense_layers: DenseLayers, num_layers: int) -> list[int]:
    """The ids of the dense layers of a model of ``num_layers`` layers, ascending."""
    return [i for i in range(num_layers) if dense_layer(dense_layers, i)]


def dense_layers_text(dense_layers: DenseLayers) -> str:
    """The short text of ``dense_layers`` for messages: an int as it is (``"12"``, as profiles and
    reports have always printed it); a set as bracketed ranges of consecutive ids, the form a
    profile's YAML accepts (``"[0-1, 8-11]"``, ``"[5]"``). A list (from JSON) counts as its tuple."""
    if isinstance(dense_layers, int):
        return str(dense_layers)
    runs: list[list[int]] = []
    for layer in sorted(dense_layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]"
