"""Per-layer density and prefill timing of the ``flashprefill`` backend: the scheduler-side writer.

Runs in SGLang's scheduler process only; the reading side (the process that started SGLang) is
``stats_reader.py``. The two share nothing but the line schema below.

Hot path (scheduler process, per extend batch): no host sync, and as few launches as possible
(a 4K prefill of a 0.5B model is bound by the host's kernel launches; the statistics first cost
1.4 ms there and 5 ms at 8K, measured on the H200 on 2026-11-30, docs/benchmarks.md).

- ``BatchStats`` is created in ``init_forward_metadata``: one start CUDA event. A dense batch adds
  nothing else until its end event.
- Selected blocks come from the ``BlockIndex`` that ``flashprefill_attention(..., return_index=True)``
  returned for the layer (the index the attention used): the CSR ``row_ptr`` is a running sum over segments ordered (KV head, request,
  tile), so the blocks selected for request ``b`` and KV head ``h`` are
  ``row_ptr[h*T + tile_ptr[b+1]] - row_ptr[h*T + tile_ptr[b]]``. Each sparse layer gathers those
  ``2 x B x Hkv`` entries into its row of one ``[layers, 2*B*Hkv]`` int32 buffer: a single
  ``index_select`` launch per layer. The gather positions come from host lengths (the plan).
- Visible blocks (the density's denominator) depend only on the lengths: computed on the host by
  the writer thread (``flashprefill.plan.visible_blocks``), never read from the device.
- The last layer records an end event, enqueues one non-blocking copy of the buffer into pinned
  host memory (sparse batches only) and hands the batch to ``StatsWriter``.

Off the hot path: ``StatsWriter`` is a daemon thread in the scheduler process. It polls the
batch's last event with ``Event.query()`` and sleeps between polls (a blocking
``Event.synchronize()`` would do as well: PyTorch releases the GIL in it; polling was chosen
while the 4K cost was unexplained and is kept, it delays a line by at most ``WRITER_POLL_S``),
then reads the pinned counters and event times and appends one JSON line per request to
``<stats_dir>/stats-<pid>.jsonl``.

Across the process boundary (the choice, documented): SGLang's scheduler runs in a spawned
process and its output path to the tokenizer manager carries only SGLang's own fields, so the
parent passes ``stats_dir`` (a temp folder it owns) in the backend settings environment variable,
and reads the JSONL lines of its request ids back after the answer
(``stats_reader.read_prefill_stats``).
Requests are matched by SGLang's ``rid``, which the engine wrapper chooses. A request prefilled
in several chunks has one line per chunk; they are summed.

Line schema (one per request per extend batch)::

    {"rid": str, "pid": int, "batch": int, "batch_size": int, "q_len": int, "kv_len": int,
     "num_q_heads": int, "num_kv_heads": int, "head_dim": int,
     "prefill_ms": float | null,      # batch: init_forward_metadata -> end of the last layer's attention
     "index_ms": float | null, "attention_ms": float | null,   # sparse layers, when layer_timing
     "index_ms_per_layer": [float | null, ...] | null,         # per layer (null: dense), when
     "attention_ms_per_layer": [float | null, ...] | null,     # layer_timing; they sum to the two above
     "layers": [str, ...],            # per layer: "sparse" or "dense:<reason>"
     "selected": [[int] * Hkv] | null per layer,   # null for dense layers
     "visible":  [[int] * Hkv] | null per layer,
     "precision": [str | null, ...],  # per layer: the operator's "bf16" / "fp8" / "int8qk" (null: dense)
     "fp8_err_sq": [[float] * Hkv] | null per layer, or null,   # with compare_fp8 only:
     "fp8_ref_sq": [[float] * Hkv] | null per layer, or null}   # integrations.fp8_error sums
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

_batch_counter = itertools.count()
WRITER_POLL_S = 0.002  # how often the writer thread asks whether a batch's copies are done


def _event(device: torch.device) -> Any:
    """A timing CUDA event recorded now on the current stream; ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class BatchStats:
    """Device-side statistics of one extend batch. All methods but ``records`` are sync-free.

    Args:
        num_layers, layer_offset: the pool's attention layers (``layer_id - layer_offset`` is
            the slot).
        num_q_heads, num_kv_heads, head_dim: this rank's attention geometry.
        q_lens, kv_lens, rids: per request, host values.
        device: where the forward runs (CUDA events only there).
        layer_timing: also record index / attention events per sparse layer.
        plan: the batch's ``flashprefill.BatchPlan`` (``None`` for a dense batch): tile counts for
            the ``row_ptr`` gather and the lengths for the visible blocks.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        layer_offset: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_lens: Sequence[int],
        kv_lens: Sequence[int],
        rids: Sequence[str],
        device: torch.device | str,
        layer_timing: bool = False,
        plan: Any = None,
    ):
        self.device = torch.device(device)
        self.batch_id = next(_batch_counter)
        self.num_layers = num_layers
        self.layer_offset = layer_offset
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_lens = tuple(int(x) for x in q_lens)
        self.kv_lens = tuple(int(x) for x in kv_lens)
        self.rids = tuple(rids) if rids else tuple(f"batch{self.batch_id}-req{b}" for b in range(len(self.q_lens)))
        self.layer_timing = layer_timing and self.device.type == "cuda"
        self.plan = plan
        self.layer_modes: list[str | None] = [None] * num_layers
        self.layer_precision: list[str | None] = [None] * num_layers
        self.fp8_sums: torch.Tensor | None = None  # float64 [layers, 2, B, Hkv] (compare_fp8)
        self._fp8_layers: set[int] = set()
        self._token_request: torch.Tensor | None = None
        self.host_fp8: torch.Tensor | None = None
        self.stage_events: dict[int, tuple[Any, Any, Any]] = {}  # slot -> (start, index done, attention done)
        self._gather: torch.Tensor | None = None   # int64 [2*B*Hkv] row_ptr positions (device)
        self._gathered: set[int] = set()           # layer slots whose row of ``ends`` was written
        self.ends: torch.Tensor | None = None      # int32 [layers, 2*B*Hkv] gathered row_ptr entries
        self.start = _event(self.device)
        self.end = None
        self.copied = None
        self.host_ends: torch.Tensor | None = None
        self.finished = False

    # -- per layer -----------------------------------------------------------------------------
    def _slot(self, layer_id: int) -> int | None:
        i = layer_id - self.layer_offset
        return i if 0 <= i < self.num_layers else None

    def mark_dense(self, layer_id: int, reason: str) -> None:
        i = self._slot(layer_id)
        if i is not None:
            self.layer_modes[i] = f"dense:{reason}"

    def stage_event(self) -> Any:
        """A timing event for the per-layer stage timing (``None`` unless ``layer_timing``)."""
        return _event(self.device) if self.layer_timing else None

    def _gather_positions(self) -> torch.Tensor:
        """``row_ptr`` positions ``[starts (b, h) ..., ends (b, h) ...]`` of every (request, KV
        head) range, built on the host once per batch and copied without a sync."""
        from flashprefill.plan import host_tile_ptr

        tile_ptr = host_tile_ptr(self.plan)
        n_tiles, h = tile_ptr[-1], self.num_kv_heads
        starts = [hh * n_tiles + tile_ptr[b] for b in range(len(self.q_lens)) for hh in range(h)]
        ends = [hh * n_tiles + tile_ptr[b + 1] for b in range(len(self.q_lens)) for hh in range(h)]
        pos = torch.tensor(starts + ends, dtype=torch.int64)
        if self.device.type == "cuda":
            return pos.pin_memory().to(self.device, non_blocking=True)
        return pos.to(self.device)

    def token_request(self) -> torch.Tensor:
        """int64 ``[total_q]`` on the device: the request of each query token (from host lengths,
        built once per batch, copied without a sync)."""
        if self._token_request is None:
            ids = torch.repeat_interleave(torch.arange(len(self.q_lens)), torch.tensor(self.q_lens, dtype=torch.int64))
            if self.device.type == "cuda":
                ids = ids.pin_memory().to(self.device, non_blocking=True)
            self._token_request = ids.to(self.device)
        return self._token_request

    def add_fp8_error(self, layer_id: int, sums: torch.Tensor) -> None:
        """Record one sparse layer's FP8-vs-BF16 error sums, float64 ``[2, B, Hkv]``
        (``integrations.fp8_error.fp8_error_sums``; device tensor, no sync)."""
        i = self._slot(layer_id)
        if i is None:
            return
        if self.fp8_sums is None:
            self.fp8_sums = torch.zeros(self.num_layers, *sums.shape, dtype=torch.float64, device=self.device)
        self.fp8_sums[i].copy_(sums)
        self._fp8_layers.add(i)

    def add_index(self, layer_id: int, index: Any, events: tuple[Any, Any, Any] | None = None,
                  precision: str | None = None) -> None:
        """Record one sparse layer: its ``BlockIndex.row_ptr`` range ends (one gather launch).

        A layer without an index, or whose ``row_ptr`` does not have the ``Hkv * tiles + 1``
        entries this batch's plan gives (a layer with another KV-head count), is reported sparse
        with unknown counts (``None``), never with unwritten ones."""
        i = self._slot(layer_id)
        if i is None:
            return
        self.layer_modes[i] = "sparse"
        self.layer_precision[i] = precision
        if events is not None and all(e is not None for e in events):
            self.stage_events[i] = events
        if index is None or self.plan is None or not self.q_lens:
            return
        if self.ends is None:
            self._gather = self._gather_positions()
            self.ends = torch.empty(self.num_layers, self._gather.numel(), dtype=torch.int32, device=self.device)
        if index.row_ptr.numel() != self.num_kv_heads * self.plan.n_tiles + 1:   # host metadata: no sync
            return
        torch.index_select(index.row_ptr, 0, self._gather, out=self.ends[i])
        self._gathered.add(i)

    # -- end of the batch ----------------------------------------------------------------------
    def finish(self) -> None:
        """Record the end event and start the copy to pinned host memory (no sync)."""
        if self.finished:
            return
        self.finished = True
        self.end = _event(self.device)
        pin = self.device.type == "cuda"
        if self.ends is not None:
            self.host_ends = torch.empty(self.ends.shape, dtype=self.ends.dtype, pin_memory=pin)
            self.host_ends.copy_(self.ends, non_blocking=pin)
        if self.fp8_sums is not None:
            self.host_fp8 = torch.empty(self.fp8_sums.shape, dtype=self.fp8_sums.dtype, pin_memory=pin)
            self.host_fp8.copy_(self.fp8_sums, non_blocking=pin)
        if self.ends is not None or self.fp8_sums is not None:
            self.copied = _event(self.device)

    def ready(self) -> bool:
        """Whether the end event and the copies are done (never blocks)."""
        last = self.copied if self.copied is not None else self.end
        return last is None or bool(last.query())

    def wait(self, poll_s: float = WRITER_POLL_S) -> None:
        """Wait until ``ready`` by polling and sleeping (writer thread only)."""
        while not self.ready():
            time.sleep(poll_s)

    def _visible(self) -> list[int]:
        from flashprefill.plan import visible_blocks

        return visible_blocks(self.plan) if self.plan is not None else [0] * len(self.q_lens)

    def _stage_ms(self) -> tuple[list[float | None], list[float | None]]:
        """Per layer slot, the index and the attention stage's milliseconds between the layer's
        events (``None`` for slots without: dense or not timed). Call after ``wait``."""
        index = [None] * self.num_layers
        attention = [None] * self.num_layers
        for i, (a, b, c) in self.stage_events.items():
            index[i], attention[i] = float(a.elapsed_time(b)), float(b.elapsed_time(c))
        return index, attention

    def records(self) -> list[dict]:
        """One JSON-ready dict per request. Call after ``wait``."""
        prefill_ms = None
        if self.start is not None and self.end is not None:
            prefill_ms = float(self.start.elapsed_time(self.end))
        index_ms = attention_ms = index_per_layer = attention_per_layer = None
        if self.stage_events:
            index_per_layer, attention_per_layer = self._stage_ms()
            index_ms = sum(x for x in index_per_layer if x is not None)
            attention_ms = sum(x for x in attention_per_layer if x is not None)
        modes = [m or "dense:not-called" for m in self.layer_modes]
        n_req, h = len(self.q_lens), self.num_kv_heads
        sel = vis = None
        if self.host_ends is not None:
            ends = self.host_ends.to(torch.int64).view(self.num_layers, 2, n_req, h)
            sel = (ends[:, 1] - ends[:, 0]).tolist()                  # [layers][b][h]
            vis = self._visible()
        counted = [modes[i] == "sparse" and i in self._gathered for i in range(self.num_layers)]
        fp8 = self.host_fp8.tolist() if self.host_fp8 is not None else None   # [layers][2][b][h]
        has_fp8 = [i in self._fp8_layers for i in range(self.num_layers)]
        out = []
        for b, rid in enumerate(self.rids):
            out.append({
                "rid": rid,
                "pid": os.getpid(),
                "batch": self.batch_id,
                "batch_size": len(self.rids),
                "q_len": self.q_lens[b],
                "kv_len": self.kv_lens[b],
                "num_q_heads": self.num_q_heads,
                "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "prefill_ms": prefill_ms,
                "index_ms": index_ms,
                "attention_ms": attention_ms,
                "index_ms_per_layer": index_per_layer,
                "attention_ms_per_layer": attention_per_layer,
                "layers": modes,
                "selected": [sel[i][b] if counted[i] else None for i in range(self.num_layers)] if sel else None,
                "visible": [[vis[b]] * h if counted[i] else None for i in range(self.num_layers)] if sel else None,
                "precision": list(self.layer_precision),
                "fp8_err_sq": [fp8[i][0][b] if has_fp8[i] else None for i in range(self.num_layers)] if fp8 else None,
                "fp8_ref_sq": [fp8[i][1][b] if has_fp8[i] else None for i in range(self.num_layers)] if fp8 else None,
            })
        return out


class StatsWriter:
    """Daemon thread that turns finished ``BatchStats`` into JSON lines (scheduler process)."""

    def __init__(self, stats_dir: str | os.PathLike | None, device: torch.device | str | None = None):
        self.path = Path(stats_dir) / f"stats-{os.getpid()}.jsonl" if stats_dir else None
        self.device = torch.device(device) if device is not None else None
        self._queue: queue.Queue[BatchStats | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="fp-stats-writer", daemon=True)
        self._thread.start()
        self.written = 0

    def submit(self, batch: BatchStats) -> None:
        self._queue.put(batch)

    def close(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                batch.wait()
                lines = batch.records()
                if self.path is not None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    with open(self.path, "a", encoding="utf-8") as fh:
                        for rec in lines:
                            fh.write(json.dumps(rec) + "\n")
                self.written += len(lines)
                for rec in lines:
                    logger.debug("flashprefill stats %s", rec)
            except Exception:  # never kill the scheduler over statistics
                logger.exception("flashprefill: could not write prefill statistics")
