"""Prefill statistics of the ``flashprefill`` backend: the reading side (the process that started SGLang).

The scheduler's ``stats_writer.StatsWriter`` appends one JSON line per request per extend batch to
``<stats_dir>/stats-<pid>.jsonl`` (schema in ``stats_writer``'s docstring). This module reads
those lines back and sums the chunks of one request (``read_prefill_stats``). It imports no
SGLang.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ...flops import dense_causal_flops


def iter_records(stats_dir: str | os.PathLike) -> Iterable[dict]:
    """Every complete JSON line under ``stats_dir`` (half-written last lines are skipped)."""
    for path in sorted(Path(stats_dir).glob("stats-*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


@dataclass
class RequestPrefill:
    """A request's prefill as the scheduler saw it, summed over its chunks.

    Attributes:
        rid: SGLang's request id.
        chunks: extend batches (prefill chunks) the request took part in.
        prompt_tokens: the largest ``kv_len`` seen (tokens).
        prefill_ms, index_ms, attention_ms: sums over its batches (a batch's time counts fully for
            each request in it); ``None`` when never measured.
        index_ms_per_layer, attention_ms_per_layer: per layer, the stage's milliseconds summed over
            the chunks in which the layer was timed (``None``: never timed, e.g. dense); ``[]``
            when no line had per-layer times. Their sums are ``index_ms`` / ``attention_ms``.
        layers: per layer ``"sparse"`` (in any chunk) or the first chunk's ``"dense:<reason>"``.
        selected, visible: per layer, ``[Hkv]`` selected / causally visible key blocks summed over
            the chunks; ``None`` for a layer without counts.
        dense_flops: per layer, dense-equivalent FLOPs (``flashprefill.flops.dense_causal_flops``).
        precision: per layer, the operator's precision of its sparse chunks (``"bf16"`` /
            ``"fp8"`` / ``"int8qk"``; ``None``: dense in every chunk).
        fp8_err_sq, fp8_ref_sq: per layer, ``[Hkv]`` 8-bit-vs-BF16 error sums over the chunks
            (``integrations.fp8_error``); ``None`` for a layer without (all ``[]`` when the
            backend did not compare).
    """

    rid: str
    chunks: int = 0
    prompt_tokens: int = 0
    prefill_ms: float | None = None
    index_ms: float | None = None
    attention_ms: float | None = None
    index_ms_per_layer: list[float | None] = field(default_factory=list)
    attention_ms_per_layer: list[float | None] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    selected: list[list[int] | None] = field(default_factory=list)
    visible: list[list[int] | None] = field(default_factory=list)
    dense_flops: list[float] = field(default_factory=list)
    precision: list[str | None] = field(default_factory=list)
    fp8_err_sq: list[list[float] | None] = field(default_factory=list)
    fp8_ref_sq: list[list[float] | None] = field(default_factory=list)


def _add(a: float | None, b: float | None) -> float | None:
    if b is None:
        return a
    return (a or 0.0) + b


def _add_per_layer(acc: list[float | None], values: list | None, n: int) -> list[float | None]:
    """``acc`` (per layer, ``[]`` = nothing yet) plus one line's per-layer ``values`` (``None``
    entries and a missing list add nothing), element by element over ``n`` layers.

    Example: ``[]`` + ``[None, 2.0, 3.0]`` -> ``[None, 2.0, 3.0]``; + ``[None, 1.0, None]`` ->
    ``[None, 3.0, 3.0]`` (layer 2 dense in the second chunk)."""
    if not values:
        return acc
    out = list(acc) if acc else [None] * n
    for i in range(min(n, len(values))):
        out[i] = _add(out[i], values[i])
    return out


def aggregate(records: Iterable[dict], rid: str) -> RequestPrefill | None:
    """Sum the lines of ``rid`` (one per prefill chunk), per layer where the line is per layer;
    ``None`` if there are none."""
    out = RequestPrefill(rid=rid)
    for rec in records:
        if rec.get("rid") != rid:
            continue
        out.chunks += 1
        out.prompt_tokens = max(out.prompt_tokens, int(rec.get("kv_len", 0)))
        out.prefill_ms = _add(out.prefill_ms, rec.get("prefill_ms"))
        out.index_ms = _add(out.index_ms, rec.get("index_ms"))
        out.attention_ms = _add(out.attention_ms, rec.get("attention_ms"))
        layers = rec.get("layers") or []
        n = len(layers)
        if not out.layers:
            out.layers = list(layers)
            out.selected = [None] * n
            out.visible = [None] * n
            out.dense_flops = [0.0] * n
            out.precision = [None] * n
            out.fp8_err_sq = [None] * n
            out.fp8_ref_sq = [None] * n
        out.index_ms_per_layer = _add_per_layer(out.index_ms_per_layer, rec.get("index_ms_per_layer"), len(out.layers))
        out.attention_ms_per_layer = _add_per_layer(out.attention_ms_per_layer, rec.get("attention_ms_per_layer"),
                                                    len(out.layers))
        flops = dense_causal_flops(rec.get("q_len", 0), rec.get("kv_len", 0), rec.get("head_dim", 0),
                                   rec.get("num_q_heads", 0))
        sel = rec.get("selected") or [None] * n
        vis = rec.get("visible") or [None] * n
        prec = rec.get("precision") or [None] * n
        err = rec.get("fp8_err_sq") or [None] * n
        ref = rec.get("fp8_ref_sq") or [None] * n
        for i in range(min(n, len(out.layers))):
            out.dense_flops[i] += flops
            if layers[i] == "sparse":
                out.layers[i] = "sparse"
                out.precision[i] = out.precision[i] or prec[i]
                if err[i] is not None and ref[i] is not None:
                    out.fp8_err_sq[i] = [a + b for a, b in zip(out.fp8_err_sq[i] or [0.0] * len(err[i]), err[i])]
                    out.fp8_ref_sq[i] = [a + b for a, b in zip(out.fp8_ref_sq[i] or [0.0] * len(ref[i]), ref[i])]
                if sel[i] is not None and vis[i] is not None:
                    out.selected[i] = [a + b for a, b in zip(out.selected[i] or [0] * len(sel[i]), sel[i])]
                    out.visible[i] = [a + b for a, b in zip(out.visible[i] or [0] * len(vis[i]), vis[i])]
    return out if out.chunks else None


def read_prefill_stats(stats_dir: str | os.PathLike | None, rid: str, timeout_s: float = 2.0,
                       expect_tokens: int | None = None) -> RequestPrefill | None:
    """Wait up to ``timeout_s`` seconds for ``rid``'s lines (and, with ``expect_tokens``, until the
    chunks cover that many prompt tokens), then aggregate them. ``None`` when nothing arrives."""
    if not stats_dir:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        got = aggregate(iter_records(stats_dir), rid)
        done = got is not None and (expect_tokens is None or got.prompt_tokens >= expect_tokens)
        if done or time.monotonic() >= deadline:
            return got
        time.sleep(0.02)
