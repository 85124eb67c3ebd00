"""FlashPrefill V2 as a transformers attention function (``AttentionInterface``).

``register_attention()`` registers ``flashprefill_attention_forward`` as
``attn_implementation="fp_sparse_prefill"`` (``ATTN_NAME``); ``install_flashprefill(model, runtime)``
switches a loaded model to it and hangs a ``FlashPrefillRuntime`` (method configuration + per-layer
records) on every attention module. The decoder layers then call it with transformers' own tensors::

    query [1, Hq, Lq, d]   key, value [1, Hkv, Lk, d]   (Lk = cached + new tokens, RoPE applied)

Prefill (``Lq > 1``) in a sparse layer (``layer_idx`` not one of ``runtime.dense_layers``, ``Lq >=
config.min_sparse_len``) is mapped onto the operator's layout (``docs/layout.md``):
``q -> [Lq, Hq, d]``; K/V -> a paged cache of ``PAGE_SIZE``-token pages ``[ceil(Lk/64), 64, Hkv, d]``
(zero padded), page table ``arange``, ``seq_lens = [Lk]``, ``cu_seqlens_q = [0, Lq]``; then
``flashprefill_attention(..., return_index=True)`` (``backend="auto"``: the PyTorch reference on
CPU, Triton on CUDA when it takes the dtype and head dim). Dense layers, a runtime without a config
and decode steps (``Lq == 1``) run ``torch.nn.functional.scaled_dot_product_attention`` with
bottom-right causal alignment (``_sdpa``: one call, GQA unexpanded, no mask at decode); a decode
step given a key mask (a captured step reading a fixed KV capacity) runs ``decode_masked.decode_masked``
(batched GEMMs split over the keys, float32 scores and softmax; no SDPA kernel fits that case).

Statistics come from the index the attention used: per sparse layer, ``BlockIndex.head_counts()``
(selected and causally visible key blocks per KV head) stays on the device until
``FlashPrefillRuntime.summary`` reads every layer once, after the forward. Timing (index and
attention milliseconds per layer) is off unless ``FlashPrefillRuntime.timing``: CUDA events on a
GPU (read in ``summary``, no sync per layer), ``time.perf_counter`` on the CPU. With timing on, the
index is built by ``build_index`` between two events and handed to ``flashprefill_attention``
(timed between the second and a third); both are the kernels the fused call runs. The copies of
q and K/V into the operator's layout and the plan are timed in neither stage. The first call of a
kernel in a process compiles it (or loads it from Triton's cache) while the GPU waits: the first
sparse layer's times carry that one-time cost (``fp profile`` says so).

Precision: ``FlashPrefillRuntime.precision`` is the operator's ``precision=`` in the sparse layers
(``"fp8"``: e4m3 operands; ``"int8qk"``: int8 Q and K, e4m3 P and V; ``docs/fp8.md``; the reference
simulates them on the CPU, the Triton 8-bit kernels run them on SM89+); dense layers and short
prefills run SDPA at the model's dtype. Each ``LayerRecord`` says which precision ran. With
``compare_fp8`` (off by default) every sparse layer that ran an 8-bit precision
(``EIGHT_BIT_PRECISIONS``) also runs the BF16 operator on the same inputs and records the
8-bit-vs-BF16 output error per KV head (``integrations.fp8_error``); the 8-bit output is the one the
model uses.

Imports nothing of ``fp``'s CLI; transformers is imported only by ``register_attention``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..api import build_index, flashprefill_attention
from ..config import EIGHT_BIT_PRECISIONS, SparseConfig
from ..dense_layers import DenseLayers, dense_layer, dense_layers_problem
from ..flops import dense_causal_flops
from ..plan import make_plan
from .decode_masked import decode_masked
from .fp8_error import fp8_error_sums, layer_rel_l2, rel_l2

# Not "flashprefill": transformers 5 treats any implementation name containing "flash" as a
# FlashAttention kernel request (``is_flash_attention_requested``) and tries to import it.
ATTN_NAME = "fp_sparse_prefill"
PAGE_SIZE = 64  # tokens per page of the paged view handed to the operator


@dataclass
class LayerRecord:
    """What one layer's prefill attention did, as recorded during the forward (device values).

    Attributes:
        layer: ``layer_idx``.
        sparse: whether the block-sparse operator ran (else SDPA).
        q_len, kv_len: ``Lq`` and ``Lk`` (tokens).
        kv_heads: ``Hkv``.
        flops_dense: dense-equivalent FLOPs (``flashprefill.flops.dense_causal_flops``).
        selected, visible: int64 ``[Hkv]`` on the attention's device, from
            ``BlockIndex.head_counts()`` of the index the attention used; ``None`` for SDPA layers.
        marks: timing marks ``(start, index done, attention done)``: CUDA events on a GPU, seconds
            (``time.perf_counter``) on the CPU; ``None`` when timing is off. In a sparse layer the
            first two enclose ``build_index`` and the last two ``flashprefill_attention`` given
            that index (the layout copies to pages and the plan come before the start); a dense
            layer has no index stage (its middle mark equals the start) and its marks enclose SDPA.
        precision: the operator's precision in a sparse layer (``"bf16"`` / ``"fp8"`` / ``"int8qk"``); ``None``
            for SDPA layers (the model's dtype).
        fp8_sums: float64 ``[2, 1, Hkv]`` 8-bit-vs-BF16 error sums (``fp8_error.fp8_error_sums``) when
            the runtime compares; ``None`` otherwise.
    """

    layer: int
    sparse: bool
    q_len: int
    kv_len: int
    kv_heads: int
    flops_dense: float
    selected: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    marks: tuple[Any, Any, Any] | None = None
    precision: str | None = None
    fp8_sums: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerSummary:
    """One layer of a prefill, read back on the host (``FlashPrefillRuntime.summary``).

    Attributes:
        density: selected / causally visible key blocks of the layer (1.0 for SDPA layers).
        density_per_kv_head: the same ratio per KV head (``[Hkv]`` floats; ones for SDPA layers).
        selected_blocks, visible_blocks: the sums over KV heads (0 for SDPA layers).
        index_ms, attention_ms: stage times in milliseconds, ``None`` when timing was off
            (``index_ms`` is ``None`` for SDPA layers).
        precision: ``"bf16"`` / ``"fp8"`` / ``"int8qk"`` for sparse layers, ``None`` for SDPA layers.
        fp8_rel_l2: relative L2 error of the layer's 8-bit output (``fp8`` or ``int8qk``) against
            the BF16 operator's on the same inputs (over all heads); ``None`` unless compared
            (sparse 8-bit layers only).
        fp8_rel_l2_per_kv_head: the same per KV head (``[Hkv]`` floats), or ``None``.
    """

    layer: int
    sparse: bool
    q_len: int
    kv_len: int
    flops_dense: float
    density: float
    density_per_kv_head: tuple[float, ...]
    selected_blocks: int = 0
    visible_blocks: int = 0
    index_ms: float | None = None
    attention_ms: float | None = None
    precision: str | None = None
    fp8_rel_l2: float | None = None
    fp8_rel_l2_per_kv_head: tuple[float, ...] | None = None


@dataclass
class FlashPrefillRuntime:
    """Per-model state read by ``flashprefill_attention_forward``.

    Attributes:
        config: ``flashprefill.SparseConfig`` of the sparse layers; ``None`` = dense everywhere.
        dense_layers: the layers that attend densely (``flashprefill.dense_layers``): an int N =
            layers ``< N``; a tuple of layer ids (strictly increasing) = exactly those.
        backend: the operator's ``backend=`` (``"auto"``: Triton on CUDA, reference otherwise).
        min_prefill_len: query lengths below this use SDPA (decode and tiny chunks).
        timing: record index / attention marks per layer (CUDA events; no sync per layer).
        precision: the operator's ``precision=`` in the sparse layers, one of ``PRECISIONS``
            (``"bf16"``, ``"fp8"``, ``"int8qk"``).
        compare_fp8: with an 8-bit ``precision`` (``EIGHT_BIT_PRECISIONS``: ``"fp8"``,
            ``"int8qk"``), also run the BF16 operator in every sparse layer and record the
            8-bit-vs-BF16 output error per KV head (doubles the sparse layers' work; for
            ``fp profile --fp8`` / ``--int8qk``).
        layers: ``layer_idx -> LayerRecord`` of the current prefill (cleared by ``reset``).
        on_layer: called with ``layer_idx`` after each layer's prefill attention (progress of a
            long prefill; set by an engine for one prefill, ``None`` otherwise).

    Raises:
        ValueError: ``dense_layers`` is neither an int >= 0 nor a strictly increasing tuple of
            layer ids >= 0.
    """

    config: SparseConfig | None = None
    dense_layers: DenseLayers = 0
    backend: str = "auto"
    min_prefill_len: int = 2
    timing: bool = False
    precision: str = "bf16"
    compare_fp8: bool = False
    layers: dict[int, LayerRecord] = field(default_factory=dict)
    on_layer: Callable[[int], None] | None = None
    _plans: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        problem = dense_layers_problem(self.dense_layers)
        if problem:
            raise ValueError(f"FlashPrefillRuntime.dense_layers: {problem}")

    def reset(self) -> None:
        self.layers.clear()
        self._plans.clear()

    def mark(self, device: torch.device) -> Any:
        """A timing mark now: a recorded CUDA event on a GPU, ``time.perf_counter()`` on the CPU,
        ``None`` when timing is off."""
        if not self.timing:
            return None
        if device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def summary(self, n_layers: int) -> list[LayerSummary | None]:
        """Per layer ``0 .. n_layers-1`` of the current prefill, ``None`` where the attention was not
        called. Reads the device counters and events (one sync on a GPU): call after the forward."""
        rows = [self.layers.get(i) for i in range(n_layers)]
        cuda = [r for r in rows if r is not None and r.marks is not None and not isinstance(r.marks[0], float)]
        if cuda:
            cuda[-1].marks[2].synchronize()
        return [_summarise(r) if r is not None else None for r in rows]


def _elapsed_ms(a: Any, b: Any) -> float:
    return (b - a) * 1e3 if isinstance(a, float) else float(a.elapsed_time(b))


def _summarise(r: LayerRecord) -> LayerSummary:
    index_ms = attention_ms = None
    if r.marks is not None:
        start, mid, end = r.marks
        attention_ms = _elapsed_ms(mid, end)
        index_ms = _elapsed_ms(start, mid) if r.sparse else None
    if not r.sparse or r.selected is None:
        return LayerSummary(r.layer, r.sparse, r.q_len, r.kv_len, r.flops_dense, 1.0, (1.0,) * r.kv_heads,
                            index_ms=index_ms, attention_ms=attention_ms, precision=r.precision)
    sel, vis = r.selected.cpu(), r.visible.cpu()
    s, v = int(sel.sum()), int(vis.sum())
    per_head = tuple(float(x) for x in (sel.double() / vis.clamp_min(1).double()).tolist())
    err = err_heads = None
    if r.fp8_sums is not None:
        e, ref = r.fp8_sums.cpu()[:, 0].tolist()
        err, err_heads = layer_rel_l2(e, ref), tuple(rel_l2(e, ref))
    return LayerSummary(r.layer, True, r.q_len, r.kv_len, r.flops_dense, (s / v) if v else 1.0, per_head,
                        s, v, index_ms, attention_ms, r.precision, err, err_heads)


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, groups: int) -> torch.Tensor:
    """Dense attention, bottom-right causal, GQA without copying K/V. ``query [B, Hq, Lq, d]``,
    key/value ``[B, Hkv, Lk, d]`` with ``Hq = groups * Hkv`` (query head ``h`` reads KV head
    ``h // groups``; K/V may be views with any head and token strides, ``d`` contiguous)
    -> ``[B, Lq, Hq, d]``.

    One SDPA call with ``enable_gqa`` (K/V never expanded to ``Hq`` heads: ``repeat_interleave``
    copied the whole cache on every decode step, docs/benchmarks.md). A decode step (``Lq == 1``)
    sees every key: no mask (one fused kernel on a GPU, flash with split KV; on the CPU as fast as
    the grouped matmul it replaced). A prefill from scratch is causal; a chunk after a prefix
    attends in bounded row chunks (``_row_chunks``).
    """
    lq, lk = query.shape[2], key.shape[2]
    gqa = groups > 1
    if lq == 1 or lq == lk:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=lq > 1, scale=scaling,
                                                               enable_gqa=gqa)
    else:  # chunk after a prefix: query t sees p <= (Lk - Lq) + t
        out = torch.cat([_sdpa_rows(query, key, value, scaling, gqa, start, min(lq, start + rows))
                         for start, rows in _row_chunks(lq, lk)], dim=2)
    return out.transpose(1, 2).contiguous()


MASK_ELEMENTS = 1 << 24  # at most this many [rows, Lk] mask entries per SDPA call of a chunk after a prefix


def _row_chunks(lq: int, lk: int):
    """``(start, rows)`` pairs covering ``Lq`` query rows, ``rows * Lk <= MASK_ELEMENTS`` (at least one row):
    a masked SDPA call (no flash kernel takes a mask; with GQA the math kernel runs, ``[Hq, rows, Lk]``
    float scores) stays bounded, never ``[Lq, Lk]`` (60K new tokens after a 70K prefix: 8.4 GB of mask)."""
    rows = max(1, MASK_ELEMENTS // max(1, lk))
    return [(s, rows) for s in range(0, lq, rows)]


def _sdpa_rows(query, key, value, scaling, gqa: bool, start: int, end: int) -> torch.Tensor:
    """Query rows ``start:end`` of a chunk after a prefix (bottom-right causal) -> ``[B, Hq, end-start, d]``."""
    lq, lk = query.shape[2], key.shape[2]
    pos = torch.arange(lk, device=query.device)
    mask = pos[None, :] <= (lk - lq + torch.arange(start, end, device=query.device))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(query[:, :, start:end], key, value, attn_mask=mask,
                                                            scale=scaling, enable_gqa=gqa)


def _paged(x: torch.Tensor) -> torch.Tensor:
    """``[1, Hkv, Lk, d]`` -> pages ``[ceil(Lk / PAGE_SIZE), PAGE_SIZE, Hkv, d]`` (zero padded)."""
    _, hkv, lk, d = x.shape
    n_pages = -(-lk // PAGE_SIZE)
    pages = x.new_zeros(n_pages * PAGE_SIZE, hkv, d)
    pages[:lk] = x[0].transpose(0, 1)
    return pages.view(n_pages, PAGE_SIZE, hkv, d)


def flashprefill_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function ``attn_implementation="fp_sparse_prefill"`` (``ATTN_NAME``).

    Args:
        module: the model's attention module (``layer_idx``, and the ``fp_runtime`` set by
            ``install_flashprefill``; without one it attends densely).
        query: ``[B, Hq, Lq, d]``, RoPE applied. key, value: ``[B, Hkv, Lk, d]``, cache included.
        attention_mask: at a decode step (``Lq == 1``), a key mask ``[B or 1, 1, 1, Lk]``
            applied as given by ``decode_masked`` (bool True = attend, or additive; a captured
            decode step passes one);
            otherwise ignored for batch size 1 (this function applies bottom-right causal masking
            itself; transformers builds no mask for this attention implementation).
        scaling: softmax scale ``τ``.

    Returns:
        ``(out [B, Lq, Hq, d], None)`` in query's dtype.

    Raises:
        ValueError: a mask with batch size > 1 (a padded batch); a decode mask of another shape.
    """
    rt: FlashPrefillRuntime = getattr(module, "fp_runtime", None) or _DENSE_RUNTIME
    groups = query.shape[1] // key.shape[1]
    layer = int(getattr(module, "layer_idx", 0) or 0)
    bsz, hq, lq, d = query.shape
    lk = key.shape[2]
    if attention_mask is not None and bsz > 1:  # no .all(): a causal mask is never all True, and it syncs
        raise ValueError(f"flashprefill attention: padded batches are not supported: batch size 1 only, got {bsz}")
    if lq == 1 and attention_mask is not None:  # a decode step reading a fixed capacity (decode graph)
        return decode_masked(query, key, value, attention_mask, scaling), None
    if lq < rt.min_prefill_len:
        return _sdpa(query, key, value, scaling, groups), None
    sparse = (
        rt.config is not None
        and not dense_layer(rt.dense_layers, layer)
        and lq >= rt.config.min_sparse_len  # short prefills dense, as in the SGLang backend
        and bsz == 1
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
    )
    flops = dense_causal_flops(lq, lk, d, hq, batch=bsz)
    dev = query.device
    if not sparse:
        start = rt.mark(dev)
        out = _sdpa(query, key, value, scaling, groups)
        marks = (start, start, rt.mark(dev)) if rt.timing else None
        rt.layers[layer] = LayerRecord(layer, False, lq, lk, key.shape[1], flops, None, None, marks)
        if rt.on_layer is not None:
            rt.on_layer(layer)
        return out, None

    q = query[0].transpose(0, 1).contiguous()  # [Lq, Hq, d]
    k_cache, v_cache = _paged(key), _paged(value)  # [pages, PAGE_SIZE, Hkv, d]
    key_geom = (lq, lk, groups, dev)
    geom = rt._plans.get(key_geom)
    if geom is None:  # plan once per prefill, reuse in every layer
        page_table = torch.arange(k_cache.shape[0], dtype=torch.int32, device=dev)[None, :]
        seq_lens = torch.tensor([lk], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, lq], dtype=torch.int32, device=dev)
        plan = make_plan(seq_lens, cu, groups, rt.config.block_size)
        geom = rt._plans[key_geom] = (page_table, seq_lens, cu, plan)
    page_table, seq_lens, cu, plan = geom
    index = None
    kw = dict(config=rt.config, softmax_scale=scaling, plan=plan, backend=rt.backend)
    # the marks enclose the operator only: the layout copies above and the plan (built, with its
    # host sync, in the first sparse layer) are this integration's, in neither stage
    start = rt.mark(dev)
    if rt.timing:  # the index stage alone, between two marks
        index = build_index(q, k_cache, v_cache, page_table, seq_lens, cu, precision=rt.precision, **kw)
    mid = rt.mark(dev)
    out, index = flashprefill_attention(
        q, k_cache, v_cache, page_table, seq_lens, cu, index=index, return_index=True, precision=rt.precision, **kw,
    )
    marks = (start, mid, rt.mark(dev)) if rt.timing else None
    sums = None
    if rt.compare_fp8 and rt.precision in EIGHT_BIT_PRECISIONS:  # after the last mark: not in the layer's times
        ref = flashprefill_attention(q, k_cache, v_cache, page_table, seq_lens, cu, precision="bf16", **kw)
        sums = fp8_error_sums(out, ref, key.shape[1])
    selected, visible = index.head_counts()
    rt.layers[layer] = LayerRecord(layer, True, lq, lk, key.shape[1], flops, selected, visible, marks,
                                   rt.precision, sums)
    if rt.on_layer is not None:
        rt.on_layer(layer)
    return out.unsqueeze(0), None


_DENSE_RUNTIME = FlashPrefillRuntime(config=None)  # a module of a model that was not installed


def register_attention() -> None:
    """Register ``attn_implementation=ATTN_NAME`` with transformers (idempotent).

    Raises:
        ImportError: transformers is not installed.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, flashprefill_attention_forward)


def install_flashprefill(model: torch.nn.Module, runtime: FlashPrefillRuntime) -> FlashPrefillRuntime:
    """Switch ``model`` to the flashprefill attention function and attach ``runtime`` to every
    attention module (modules with a ``layer_idx`` and ``num_key_value_groups``).

    Raises:
        ValueError: ``model`` has no such attention module.
    """
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and hasattr(mod, "num_key_value_groups"):
            mod.fp_runtime = runtime
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__}: no attention module with layer_idx/num_key_value_groups found")
    return runtime


__all__ = [
    "ATTN_NAME",
    "PAGE_SIZE",
    "FlashPrefillRuntime",
    "LayerRecord",
    "LayerSummary",
    "flashprefill_attention_forward",
    "install_flashprefill",
    "register_attention",
]
