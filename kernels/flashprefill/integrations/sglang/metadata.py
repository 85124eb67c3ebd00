"""Per-batch metadata of the ``flashprefill`` SGLang backend, built once in
``init_forward_metadata`` from SGLang's host-side lengths and reused by every layer. With its
``plan`` the Triton operator syncs exactly once per index build (the ``nnz`` read that sizes
``col_idx``) and nowhere else; the reference backend (CPU) has syncs of its own.

SGLang's KV pool is token-granular: ``k_buffer[layer]`` is ``[pool_rows, Hkv, d]`` with
``pool_rows = size + page_size`` and a request's token ``p`` stored in slot
``req_to_token[req_pool_idx, p]``. With a paged allocator (``page_size = P``) the slots of
positions ``[kP, (k+1)P)`` are one whole page, so the operator's page table (``docs/layout.md``)
is the slot of every P-th position divided by P, and the pool is viewed as
``[pool_rows // P, P, Hkv, d]``.

Worked example, ``P = 4``, one request with ``Lk = 10`` whose pages are 7, 2 and 5::

    position p        : 0  1  2  3 | 4  5  6  7 | 8  9
    req_to_token[r, p]: 28 29 30 31| 8  9 10 11 |20 21
    taken (p % 4 == 0): 28         | 8          |20
    page_table[b]     : 28//4=7      8//4=2       20//4=5   -> [7, 2, 5]
    k_cache view      : k_buffer[:rows//4*4].view(rows//4, 4, Hkv, d); token 9 = k_cache[5, 1]

``P = 1`` is the same rule: the page table is ``req_to_token[r, :Lk]`` itself.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from flashprefill.config import TRITON_DTYPES, TRITON_HEAD_DIMS
from flashprefill.plan import BatchPlan, make_plan


@dataclass(frozen=True)
class FlashPrefillMetadata:
    """What every layer of one extend batch shares. Built by ``build_metadata``."""

    batch_size: int  # requests in the batch (B)
    q_lens: tuple[int, ...]  # host: new query tokens Lq per request (SGLang extend_seq_lens)
    kv_lens: tuple[int, ...]  # host: KV tokens Lk per request, prefix included (SGLang seq_lens)
    prefix_lens: tuple[int, ...]  # host: P = Lk - Lq (chunked prefill / radix-cache hit)
    page_size: int  # SGLang page size in tokens; the operator's page size
    num_pages: int  # pages in the pool view, pool_rows // page_size
    page_table: torch.Tensor | None  # int32 [B, max_pages] device: page ids per request (None if dense)
    seq_lens: torch.Tensor | None  # int32 [B] device: Lk per request (None if dense)
    cu_seqlens_q: torch.Tensor | None  # int32 [B + 1] device: cumulative Lq (None if dense)
    plan: BatchPlan | None  # operator's batch plan, tensors on the device (None if dense)
    dense_reason: str | None  # why the whole batch runs dense; None = sparse layers use the operator
    rids: tuple[str, ...] = ()  # request ids (for stats), when SGLang provides them

    @property
    def sparse(self) -> bool:
        return self.dense_reason is None

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)


def operator_dense_reason(head_dim: int, dtype: torch.dtype | None, operator_backend: str) -> str | None:
    """Why the operator cannot take this model at all (``None`` = it can), decided once at init.

    The Triton kernels take bf16/fp16 and head dims ``TRITON_HEAD_DIMS``; any other model runs
    SGLang's stock dense prefill with this logged reason instead of raising inside
    ``forward_extend``. ``operator_backend="reference"`` takes any float dtype and head dim. An
    unknown ``dtype`` (``None``) is not a reason (the per-layer KV dtype check still runs).
    """
    if operator_backend == "reference":
        return None
    if head_dim not in TRITON_HEAD_DIMS:
        return f"head_dim {head_dim} not in the Triton operator's {TRITON_HEAD_DIMS}"
    if dtype is not None and dtype not in TRITON_DTYPES:
        return f"model dtype {dtype} not bfloat16/float16 (the Triton operator's dtypes)"
    return None


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    max_kv_len: int,
    page_size: int,
) -> torch.Tensor:
    """Operator page table from SGLang's ``req_to_token`` (device ops only, no host sync).

    Args:
        req_to_token: int32 ``[max_reqs, max_context_len]``, token slot of every position.
        req_pool_indices: int ``[B]``, each request's row in ``req_to_token``.
        max_kv_len: longest ``Lk`` of the batch (host int).
        page_size: tokens per page ``P`` (>= 1).

    Returns:
        int32 ``[B, ceil(max_kv_len / P)]``: ``req_to_token[r, k P] // P`` (see module docstring).
        Entries past a request's own ``ceil(Lk / P)`` pages are unspecified (never read).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be [max_reqs, max_context_len], got {list(req_to_token.shape)}")
    if max_kv_len > req_to_token.shape[1]:
        raise ValueError(f"max_kv_len {max_kv_len} > req_to_token width {req_to_token.shape[1]}")
    max_pages = -(-max_kv_len // page_size)
    cols = req_to_token[:, : max_pages * page_size : page_size]  # strided view, [max_reqs, max_pages]
    table = cols.index_select(0, req_pool_indices.to(torch.int64))  # [B, max_pages], new tensor
    if page_size > 1:
        table = torch.div(table, page_size, rounding_mode="floor")
    return table.to(torch.int32)


def check_page_table(
    page_table: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    kv_lens: Sequence[int],
    page_size: int,
) -> None:
    """Debug check (host syncs): every position's slot equals ``page * P + p % P``.

    Raises:
        ValueError: naming the request and the first bad position.
    """
    rows = req_pool_indices.tolist()
    for b, (row, lk) in enumerate(zip(rows, kv_lens)):
        slots = req_to_token[row, :lk].to(torch.int64)
        pos = torch.arange(lk, device=slots.device)
        expect = page_table[b, pos // page_size].to(torch.int64) * page_size + pos % page_size
        bad = (slots != expect).nonzero()
        if bad.numel():
            p = int(bad[0, 0])
            raise ValueError(
                f"request {b}: position {p} is in slot {int(slots[p])}, but page table gives "
                f"{int(expect[p])} (page_size {page_size}); the KV pool is not page-aligned"
            )


def plan_to_device(plan: BatchPlan, device: torch.device | str) -> BatchPlan:
    """Copy a plan built on the host to ``device`` with pinned, non-blocking copies (no sync)."""
    changes = {}
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if isinstance(value, torch.Tensor) and value.device != torch.device(device):
            src = value.pin_memory() if torch.device(device).type == "cuda" else value
            changes[f.name] = src.to(device, non_blocking=True)
    return dataclasses.replace(plan, **changes) if changes else plan


def build_metadata(
    *,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    kv_lens_host: Sequence[int],
    q_lens_host: Sequence[int],
    page_size: int,
    pool_rows: int,
    group_size: int,
    block_size: int,
    min_sparse_len: int = 0,
    dense_reason: str | None = None,
    rids: Sequence[str] | None = None,
) -> FlashPrefillMetadata:
    """Build the metadata of one extend batch.

    Host lengths come from SGLang's ``seq_lens_cpu`` / ``extend_seq_lens_cpu`` (so the plan needs
    no device-to-host copy); device tensors are derived with device ops or pinned copies.

    Args:
        req_to_token: int32 ``[max_reqs, max_context_len]`` (device).
        req_pool_indices: ``[B]`` (device).
        seq_lens: ``[B]`` (device), ``Lk`` per request.
        extend_seq_lens: ``[B]`` (device), ``Lq`` per request.
        kv_lens_host, q_lens_host: the same lengths as host ints.
        page_size: SGLang's page size.
        pool_rows: ``k_buffer[layer].shape[0]``.
        group_size: ``Hq / Hkv``.
        block_size: operator key block size ``B``.
        min_sparse_len: requests with ``Lq`` below it run dense; a batch with only such requests
            runs dense as a whole (``dense_reason = "short"``), without calling the operator.
        dense_reason: set by the caller when the batch must run dense for another reason.
        rids: SGLang request ids, for stats.
    """
    kv = tuple(int(x) for x in kv_lens_host)
    lq = tuple(int(x) for x in q_lens_host)
    if len(kv) != len(lq):
        raise ValueError(f"kv_lens_host has {len(kv)} entries but q_lens_host has {len(lq)}")
    for b, (k, q) in enumerate(zip(kv, lq)):
        if q > k:
            raise ValueError(f"request {b}: extend length {q} > seq_len {k}")
    if dense_reason is None and lq and max(lq) < min_sparse_len:
        dense_reason = f"short (all Lq < min_sparse_len={min_sparse_len})"
    if dense_reason is None and not lq:
        dense_reason = "empty batch"
    common = dict(
        batch_size=len(kv),
        q_lens=lq,
        kv_lens=kv,
        prefix_lens=tuple(k - q for k, q in zip(kv, lq)),
        page_size=page_size,
        num_pages=pool_rows // page_size,
        rids=tuple(rids or ()),
    )
    if dense_reason is not None:
        return FlashPrefillMetadata(
            page_table=None, seq_lens=None, cu_seqlens_q=None, plan=None, dense_reason=dense_reason, **common
        )
    device = seq_lens.device
    page_table = build_page_table(req_to_token, req_pool_indices, max(kv), page_size)
    seq_lens_i32 = seq_lens.to(torch.int32)
    cu = torch.zeros(len(lq) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(extend_seq_lens.to(torch.int32), dim=0)
    # The plan from host lengths: cu_seqlens on the host mirrors cu above exactly.
    cu_host = torch.zeros(len(lq) + 1, dtype=torch.int32)
    cu_host[1:] = torch.cumsum(torch.tensor(lq, dtype=torch.int32), dim=0)
    plan = make_plan(torch.tensor(kv, dtype=torch.int32), cu_host, group_size, block_size)
    plan = plan_to_device(plan, device)
    return FlashPrefillMetadata(
        page_table=page_table, seq_lens=seq_lens_i32, cu_seqlens_q=cu, plan=plan, dense_reason=None, **common
    )


def last_attention_layer_id(model: object, pool: object, num_hidden_layers: int | None = None) -> tuple[int, str]:
    """The ``layer_id`` of the last attention layer a forward calls, and where it was read.

    The backend finishes a batch's statistics (end event, copies to the host, hand-off to the
    writer thread) when that layer's attention returns, so this id must be one a forward really
    reaches. SGLang 0.5.17 is inconsistent about ``KVCache.end_layer``: the pool's own default
    is inclusive (``layer_num - 1``) but the model runner passes the model's *exclusive*
    ``end_layer`` (``range(start_layer, end_layer)``), e.g. 30 for a 30-layer model whose last
    layer id is 29. Trusting it meant the batch was never finished, and no statistics arrived.

    Order: the largest ``layer_id`` of the model's ``RadixAttention`` modules (exact); else
    ``start_layer + layer_num - 1`` of the pool; else ``num_hidden_layers - 1``.
    """
    ids = []
    modules = getattr(model, "modules", None)
    if callable(modules):
        try:
            for m in modules():
                if type(m).__name__ == "RadixAttention" and isinstance(getattr(m, "layer_id", None), int):
                    ids.append(m.layer_id)
        except Exception:  # a model whose module walk fails: fall back to the pool
            ids = []
    if ids:
        return max(ids), "model RadixAttention layers"
    start = int(getattr(pool, "start_layer", 0) or 0)
    layer_num = getattr(pool, "layer_num", None)
    if layer_num:
        return start + int(layer_num) - 1, "KV pool start_layer + layer_num - 1"
    if num_hidden_layers:
        return int(num_hidden_layers) - 1, "model config num_hidden_layers - 1"
    raise ValueError("cannot tell the last attention layer: no RadixAttention modules, pool layer_num or config")
