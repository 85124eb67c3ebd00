"""PyTorch reference of FlashPrefill V2: the executable spec of ``docs/layout.md``.

Plain PyTorch, any device, no optional dependency. Inputs are trusted (``flashprefill.api``
validates them once). Math runs in float32, or float64 when the inputs are float64.

Section numbers refer to ``docs/method.md``:

- block means over valid tokens, read through the page table (3.1),
- GQA-packed query tiles of 128 rows (3.2),
- tile energy ``E_j = Σ_ρ exp(τ⟨q_ρ, k̄_j⟩ − M)`` over scored blocks (3.3),
- max-based threshold ``E_j >= α · max E`` (3.4),
- sink / local window / dense tail / short requests always kept (3.5),
- CSR output (3.6),
- sparse attention with the ``ln n_j`` mean correction for pruned blocks fully seen by the whole
  tile (4).

Vectorised per request (and per KV head in the attention): no per-row, per-block or per-tile
Python loop. The selection is built as a dense boolean ``[Hkv, n_tiles, n_blocks]`` mask with
tensor ops and turned into CSR. The attention runs batched over chunks of tiles (~4M logits on
the CPU): each tile gathers the keys of its own selected blocks (padded to the chunk's widest
tile, pad slots and ``p > P + t`` masked to -inf), plus one "mean key" column per block
(``τ q·k̄_j + ln n_j``, masked to ``U``), all in one softmax; so its cost scales with density.
Measured on this 2-core CPU, one thread: SmolLM2-135M shapes (9 q / 3 kv heads, d 64), 4K tokens,
~0.57 s per layer at density 1 and ~0.36 s at density 0.6 (index ~0.015 s).

``precision="fp8"`` simulates the e4m3 operands of ``docs/fp8.md`` exactly (``flashprefill.quant``:
quantise -> dequantise round trips through ``torch.float8_e4m3fn``, the math around them as above);
``float8_e4m3fn`` caches are read with their ``k_descale`` / ``v_descale``, one request at a time.
``precision="int8qk"`` (docs/fp8.md section 10) is the same with int8 codes for Q, K and the key means
(``quant.round_trip_int8``: ``amax / 127`` scales, round half to even); V, P and the V means as "fp8".
The default ``precision="bf16"`` path runs the same operations as before FP8 existed.

``python -m flashprefill.impl.reference`` prints the block map of a tiny case.
"""
from __future__ import annotations

import math

import torch

from .. import quant
from ..config import EIGHT_BIT_PRECISIONS, PRECISIONS, SparseConfig
from ..index import BlockIndex
from ..plan import BatchPlan, host_tile_ptr, make_plan

# Logits materialised at once by the chunked attention / selection (elements, not bytes): 4M on
# the CPU (cache-friendly), 16x that on an accelerator (fewer launches; ~256 MiB of float32).
CHUNK_ELEMS = 1 << 22


def _chunk_elems(device: torch.device) -> int:
    return CHUNK_ELEMS if device.type == "cpu" else CHUNK_ELEMS * 16


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _resolve(q, seq_lens, cu_seqlens_q, k_cache, block_size, softmax_scale, plan):
    """Fill the defaults a direct caller may leave out (the API always passes them)."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    g = hq // hkv
    if plan is None:
        plan = make_plan(seq_lens, cu_seqlens_q, g, block_size)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    return plan, float(softmax_scale), hkv, g


def _gather_kv(cache: torch.Tensor, page_table: torch.Tensor, b: int, lk: int) -> torch.Tensor:
    """KV of request ``b`` through the page table: ``[Lk, Hkv, d]`` (cache dtype).

    Position ``p`` lives at ``cache[page_table[b, p // page_size], p % page_size]``.
    """
    page_size = cache.shape[1]
    pos = torch.arange(lk, device=cache.device)
    pages = page_table[b].to(torch.long)[pos // page_size]
    return cache[pages, pos % page_size]


def _is_fp8(precision: str) -> bool:
    """Whether ``precision`` runs 8-bit operands ("fp8" or "int8qk"); raises on an unknown one."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision in EIGHT_BIT_PRECISIONS


def _check_int8qk_cache(precision: str, k_cache: torch.Tensor) -> bool:
    """Whether ``precision`` is "int8qk" (Q, K on int8); raises ``ValueError`` for an e4m3 cache with it."""
    if precision == "int8qk" and k_cache.dtype == quant.E4M3:
        raise ValueError("precision='int8qk' quantises bf16 / fp16 K to int8 and cannot read a float8_e4m3fn "
                         "KV cache; precision='fp8' reads e4m3 caches as they are")
    return precision == "int8qk"


def _round_trip_k(x: torch.Tensor, s: torch.Tensor, inv: torch.Tensor, dt: torch.dtype, int8: bool) -> torch.Tensor:
    """K-side operand (K, its block means) as it stands for: int8 (``int8``) or e4m3 round trip."""
    return quant.round_trip_int8(x, s, inv, dt) if int8 else quant.round_trip(x, s, inv, dt)


def _operands(cache, descale, page_table, b: int, lk: int, dt: torch.dtype, fp8: bool, int8: bool = False):
    """K (or V) of request ``b`` for the means and for the GEMMs (docs/fp8.md section 2; ``int8``:
    K of "int8qk", int8 codes with ``amax / 127`` scales, section 10; 16-bit caches only).

    Args:
        cache: ``[num_pages, page_size, Hkv, d]``, a float dtype or ``float8_e4m3fn``.
        descale: for an e4m3 cache, float32 0-dim or ``[batch, Hkv]``; else None.
    Returns:
        ``(raw [Lk, Hkv, d], gemm [Lk, Hkv, d], scale [Hkv] | None, inv_scale [Hkv] | None)`` in ``dt``:
        ``raw`` feeds the block means (the unquantised values; an e4m3 cache's ``codes * descale``),
        ``gemm`` is what the FP8 operand stands for (``raw`` itself without ``fp8``). Only this
        request's pages are read and dequantised, never the whole cache.
    """
    x = _gather_kv(cache, page_table, b, lk)
    hkv = cache.shape[2]
    if cache.dtype == quant.E4M3:
        s = (descale.expand(hkv) if descale.dim() == 0 else descale[b]).to(torch.float32)
        raw = quant.dequantize(x, s[:, None], dt)
        if not fp8:
            return raw, raw, None, None
        return raw, raw, s, 1.0 / s
    if not fp8:
        return x.to(dt), x.to(dt), None, None
    if int8:
        s, inv = quant.int8_scales(quant.abs_max(x, (0, 2)))
    else:
        s, inv = quant.kv_scales(x)
    return x.to(dt), _round_trip_k(x, s[:, None], inv[:, None], dt, int8), s, inv


def _fp8_q_tiles(qb: torch.Tensor, hkv: int, g: int, tile_rows: int, dt: torch.dtype, int8: bool = False) -> torch.Tensor:
    """GQA-packed query tiles as their FP8 operand stands for them (docs/fp8.md section 2).

    Args:
        qb: ``[Lq, Hq, d]`` queries of one request (unscaled by ``τ``).
    Returns:
        ``[Hkv, n_tiles, tile_rows, d]`` in ``dt``: each tile (rows past ``Lq * g`` zero) quantised
        with its own ``amax / 448`` scale and dequantised (``int8``: int8 codes, ``amax / 127``).
    """
    lq, _, d = qb.shape
    rows = lq * g
    n_tiles = -(-rows // tile_rows)
    qp = qb.new_zeros(hkv, n_tiles * tile_rows, d)
    qp[:, :rows] = qb.view(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
    qp = qp.view(hkv, n_tiles, tile_rows, d)
    if int8:
        s, inv = quant.int8_scales(quant.abs_max(qp, (-2, -1)))
    else:
        s, inv = quant.tile_scales(qp)
    return _round_trip_k(qp, s[..., None, None], inv[..., None, None], dt, int8)


def _block_means(x: torch.Tensor, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Means of each key block over its valid tokens only (section 3.1).

    Args:
        x: ``[Lk, Hkv, d]`` keys or values of one request.
    Returns:
        ``(mean [n_blocks, Hkv, d] in dtype, n [n_blocks] valid-token counts, int64)``.
    """
    lk, hkv, d = x.shape
    nb = -(-lk // block_size)
    pad = nb * block_size - lk
    xs = x.to(dtype)
    if pad:
        # Zero padding only feeds the sum; the divisor is the valid count n_j, never B.
        xs = torch.cat([xs, xs.new_zeros(pad, hkv, d)])
    sums = xs.view(nb, block_size, hkv, d).sum(1)
    starts = torch.arange(nb, device=x.device) * block_size
    n = (torch.clamp(starts + block_size, max=lk) - starts).to(torch.int64)
    return sums / n.to(dtype)[:, None, None], n


def _tile_geometry(lq: int, g: int, tile_rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_first, t_last)`` tokens of each tile of a request, int64 ``[n_tiles]`` (section 3.2).

    Example, ``g = 3``, ``Lq = 50``: 150 rows, tile 0 = rows 0..127 = tokens 0..42, tile 1 = rows
    128..149 = tokens 42..49, so ``t_first = [0, 42]``, ``t_last = [42, 49]``.
    """
    rows = lq * g
    n_tiles = -(-rows // tile_rows)
    r0 = torch.arange(n_tiles, device=device, dtype=torch.int64) * tile_rows
    r1 = torch.clamp(r0 + tile_rows, max=rows)
    return r0 // g, (r1 - 1) // g


def _select_request(
    qb: torch.Tensor,
    k_mean: torch.Tensor,
    lq: int,
    lk: int,
    g: int,
    tile_rows: int,
    config: SparseConfig,
    scale: float,
    fp8: bool = False,
    int8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected blocks of every tile of one request (docs/layout.md "Selection").

    Args:
        qb: ``[Lq, Hq, d]`` queries of the request (any float dtype).
        k_mean: ``[n_blocks, Hkv, d]`` block means (compute dtype; with ``fp8`` already the
            e4m3 round trip with K's scales).
        fp8: score with e4m3 query tiles (docs/fp8.md); ``int8`` too: int8 query tiles ("int8qk").
    Returns:
        ``(S [Hkv, n_tiles, n_blocks] bool, n_visible [n_tiles] int64)``.
    """
    B = config.block_size
    P = lk - lq
    nb, hkv, d = k_mean.shape
    dev = k_mean.device
    dt = k_mean.dtype
    rows = lq * g
    t_first, t_last = _tile_geometry(lq, g, tile_rows, dev)
    n_tiles = t_first.numel()
    j = torch.arange(nb, device=dev, dtype=torch.int64)
    e = torch.clamp((j + 1) * B, max=lk)                                   # block ends e_j
    vis_last = (P + t_last) // B                                           # last causally visible block
    visible = j[None, :] <= vis_last[:, None]                              # [T, nb]
    scored = e[None, :] <= (P + t_last + 1)[:, None]                       # fully seen by the last row

    # Always kept (3.5): sink, local window, dense tail, short request.
    sink = (j * B < config.sink_tokens)[None, :]
    win_lo = torch.clamp(P + t_first - config.window_tokens + 1, min=0) // B
    window = j[None, :] >= win_lo[:, None]
    dense = (t_last >= lq - config.dense_tail_tokens) | (lq < config.min_sparse_len)
    always = sink | window | dense[:, None]                                # [T, nb]
    # The blocks the threshold decides and measures against (3.4): every scored block, or only
    # those not kept anyway (threshold_max "prunable").
    cand = scored & ~always if config.threshold_max == "prunable" else scored

    # Energies (3.3) in chunks of tiles: ℓ is [Hkv, rows_chunk, nb]; with block_score "mass" each
    # valid row's softmax over the blocks it sees (those the threshold decides), summed over rows.
    if fp8:
        qp = _fp8_q_tiles(qb, hkv, g, tile_rows, dt, int8).view(hkv, -1, d)[:, :rows] * scale
    else:
        qp = qb.to(dt).view(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, rows, d) * scale
    kT = k_mean.permute(1, 2, 0)                                           # [Hkv, d, nb]
    tiles_per_chunk = max(1, _chunk_elems(dev) // max(1, hkv * tile_rows * nb))
    energies = []
    for c0 in range(0, n_tiles, tiles_per_chunk):
        c1 = min(n_tiles, c0 + tiles_per_chunk)
        r0, r1 = c0 * tile_rows, min(rows, c1 * tile_rows)
        ell = torch.bmm(qp[:, r0:r1], kT)                                  # [Hkv, r, nb]
        pad = (c1 - c0) * tile_rows - (r1 - r0)
        if pad:
            ell = torch.cat([ell, ell.new_full((hkv, pad, nb), -math.inf)], 1)
        rho = torch.arange(r0, r0 + (c1 - c0) * tile_rows, device=dev)
        tok = rho // g
        valid = (rho < rows)[:, None] & (e[None, :] <= (P + tok + 1)[:, None])   # [r, nb]
        valid = valid & cand[c0:c1].repeat_interleave(tile_rows, 0)           # M over the decided blocks
        ell = ell.masked_fill(~valid, -math.inf).view(hkv, c1 - c0, tile_rows, nb)
        if config.block_score == "mass":                                   # each row's softmax over its
            m = ell.amax(dim=3, keepdim=True)                              # decided blocks, summed
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))     # row without valid pair
            p = torch.exp(ell - m)
            energies.append((p / p.sum(3, keepdim=True).clamp_min(1e-30)).sum(2))
            continue
        m = ell.amax(dim=(2, 3), keepdim=True)                             # M per (head, tile)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))         # tile without valid pair
        energies.append(torch.exp(ell - m).sum(2))                         # exp(-inf) = 0 off-valid
    E = torch.cat(energies, 1) if energies else k_mean.new_zeros(hkv, 0, nb)    # [Hkv, T, nb]

    # Max-based threshold (3.4): keep scored j iff E_j >= α max_j' E_j'.
    e_max = torch.where(cand, E, torch.zeros_like(E)).amax(-1, keepdim=True) if nb else E
    keep = cand & (E >= config.alpha * e_max)

    S = visible & (keep | always)
    return S, vis_last + 1


def _global_keys(qb: torch.Tensor, kb: torch.Tensor, lq: int, lk: int, g: int, scale: float,
                 config: SparseConfig, dt: torch.dtype) -> torch.Tensor:
    """Global ("vertical") keys of one request (section 4.1): for each KV head, the
    ``config.global_keys`` KV positions with the largest attention mass from ``global_queries``
    query tokens spread evenly over the body (past sink + local window, before the dense tail),
    every query head of the group, causal, softmax over all visible keys; positions in the sink's
    blocks (always kept) never count.

    Args:
        qb: ``[Lq, Hq, d]``; kb: ``[Lk, Hkv, d]`` (compute dtype ``dt``).
    Returns:
        int64 ``[Hkv, K]``, ``K = config.global_keys``: ascending positions, ``-1`` after them when
        fewer than ``K`` keys have positive mass.
    """
    B, K = config.block_size, config.global_keys
    P = lk - lq
    hkv, d = kb.shape[1], kb.shape[2]
    dev = kb.device
    lo = min(max(0, config.sink_tokens + config.window_tokens - P), lq - 1)
    hi = max(lo, lq - 1 - config.dense_tail_tokens)
    m = min(config.global_queries, hi - lo + 1)
    toks = torch.linspace(lo, hi, m, device=dev).round().to(torch.int64)                 # [m]
    qs = qb[toks].to(dt).view(m, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m * g, d) * scale
    s = torch.bmm(qs, kb.to(dt).permute(1, 2, 0))                                          # [Hkv, m*g, Lk]
    pos = torch.arange(lk, device=dev)
    s.masked_fill_(pos[None, None, :] > (P + toks.repeat_interleave(g))[None, :, None], -math.inf)
    mass = torch.softmax(s, -1).sum(1)                                                     # [Hkv, Lk]
    sink_end = -(-config.sink_tokens // B) * B
    mass[:, :min(sink_end, lk)] = 0
    top = mass.topk(min(K, lk), dim=-1)
    far = lk + 1                                                                           # sorts last
    ids = torch.where(top.values > 0, top.indices, torch.full_like(top.indices, far)).sort(-1).values
    out = torch.full((hkv, K), -1, dtype=torch.int64, device=dev)
    out[:, :ids.shape[1]] = ids.masked_fill(ids == far, -1)
    return out


def _fold_without(kx: torch.Tensor, vx: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor, n: torch.Tensor,
                  gpos: torch.Tensor, block_size: int, dt: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block means and counts of the tokens a pruned block folds back: its tokens less its global
    keys (section 4.1).

    Args:
        kx, vx: ``[Lk, Hkv, d]`` the keys and values the means were taken of; k_mean, v_mean:
        ``[nb, Hkv, d]`` their block means; n: int64 ``[nb]`` valid tokens per block; gpos: int64
        ``[Hkv, K]`` (``-1`` = none).
    Returns:
        ``(k_mean, v_mean [nb, Hkv, d] dt, 0 where no token is left; count [nb, Hkv] dt)``.
    """
    hkv = k_mean.shape[1]
    count = n.to(dt)[:, None].repeat(1, hkv)                                               # [nb, Hkv]
    k_sums = k_mean.to(dt) * n.to(dt)[:, None, None]
    v_sums = v_mean.to(dt) * n.to(dt)[:, None, None]
    for h in range(hkv):
        gp = gpos[h][gpos[h] >= 0]
        if gp.numel():
            blk = gp // block_size
            count[:, h].index_add_(0, blk, -torch.ones(blk.numel(), dtype=dt, device=blk.device))
            k_sums[:, h].index_add_(0, blk, -kx[gp, h].to(dt))
            v_sums[:, h].index_add_(0, blk, -vx[gp, h].to(dt))
    left = (count > 0)[..., None]
    per = count.clamp_min(1)[..., None]
    zero = torch.zeros_like(k_sums)
    return torch.where(left, k_sums / per, zero), torch.where(left, v_sums / per, zero), count


def build_index(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    config: SparseConfig | None = None,
    softmax_scale: float | None = None,
    plan: BatchPlan | None = None,
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> BlockIndex:
    """Block index of a batch: block means + CSR of selected blocks (sections 3.1-3.6).

    Args:
        q: ``[total_q, Hq, d]`` packed new queries.
        k_cache, v_cache: ``[num_pages, page_size, Hkv, d]`` paged KV pool.
        page_table: int32 ``[batch, max_pages]``.
        seq_lens: int32 ``[batch]``, ``Lk`` per request (new tokens included).
        cu_seqlens_q: int32 ``[batch + 1]``.
        config: method knobs (``SparseConfig()`` when None).
        softmax_scale: ``τ`` (``1/sqrt(d)`` when None).
        plan: the batch plan (built when None; must use ``config.block_size``).
        precision: ``"bf16"``, ``"fp8"`` (the block scoring ``q·k̄`` with e4m3 operands,
            docs/fp8.md) or ``"int8qk"`` (int8 operands, section 10); the means themselves are never
            quantised in the index.
        k_descale, v_descale: float32 0-dim or ``[batch, Hkv]``, required with ``float8_e4m3fn``
            caches (the value of a code is ``code * descale``), else None.

    Returns:
        ``BlockIndex`` with ``k_mean``/``v_mean`` in float32 (float64 for float64 inputs).
    """
    config = config or SparseConfig()
    fp8 = _is_fp8(precision)
    int8 = _check_int8qk_cache(precision, k_cache)
    e4m3 = k_cache.dtype == quant.E4M3
    plan, scale, hkv, g = _resolve(q, seq_lens, cu_seqlens_q, k_cache, config.block_size, softmax_scale, plan)
    B = config.block_size
    dt = _compute_dtype(q)
    dev = q.device
    d = q.shape[2]
    tile_ptr = host_tile_ptr(plan)
    max_nb = plan.max_blocks(B)
    n_tiles = tile_ptr[-1]

    sel = torch.zeros(hkv, n_tiles, max_nb, dtype=torch.bool, device=dev)
    n_visible = torch.zeros(n_tiles, dtype=torch.int64, device=dev)
    k_means, v_means = [], []
    glob = config.global_keys > 0
    global_pos = torch.full((len(plan.kv_lens), hkv, config.global_keys), -1, dtype=torch.int64, device=dev)
    counts_g = []
    for b, (lq, lk, qs) in enumerate(zip(plan.q_lens, plan.kv_lens, plan.q_starts)):
        if lk == 0:
            continue
        if fp8 or e4m3:
            kraw, kop, ks, kinv = _operands(k_cache, k_descale, page_table, b, lk, dt, fp8, int8)
            vraw = _operands(v_cache, v_descale, page_table, b, lk, dt, False)[0]
            km, n = _block_means(kraw, B, dt)
            vm, _ = _block_means(vraw, B, dt)
            km_score = _round_trip_k(km, ks[:, None], kinv[:, None], dt, int8) if fp8 else km
        else:
            kraw = kop = _gather_kv(k_cache, page_table, b, lk)
            vraw = _gather_kv(v_cache, page_table, b, lk)
            km, n = _block_means(kraw, B, dt)
            vm, _ = _block_means(vraw, B, dt)
            km_score = km
        if glob:                                                           # section 4.1
            if lq:                                                         # (none without queries: -1)
                global_pos[b] = _global_keys(q[qs:qs + lq], kop.to(dt), lq, lk, g, scale, config, dt)
            km_fold, vm, cnt = _fold_without(kraw, vraw, km, vm, n, global_pos[b], B, dt)
            counts_g.append(cnt)
        k_means.append(km_fold if glob else km)
        v_means.append(vm)
        if lq == 0:
            continue
        S, nv = _select_request(q[qs:qs + lq], km_score, lq, lk, g, plan.tile_rows, config, scale, fp8, int8)
        sel[:, tile_ptr[b]:tile_ptr[b + 1], :S.shape[2]] = S
        n_visible[tile_ptr[b]:tile_ptr[b + 1]] = nv

    counts = sel.sum(-1).reshape(-1)                                       # segment h*n_tiles + tile
    row_ptr = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=dev)
    row_ptr[1:] = torch.cumsum(counts, 0).to(torch.int32)
    # nonzero is row-major over (h, tile, block): exactly the segment order, ids ascending.
    col_idx = torch.nonzero(sel)[:, 2].to(torch.int32).contiguous()
    empty = q.new_zeros(0, hkv, d, dtype=dt)
    return BlockIndex(
        row_ptr=row_ptr,
        col_idx=col_idx,
        k_mean=torch.cat(k_means) if k_means else empty,
        v_mean=torch.cat(v_means) if v_means else empty.clone(),
        block_ptr=plan.block_ptr.clone(),
        tile_ptr=plan.tile_ptr.clone(),
        n_visible=n_visible.repeat(hkv).to(torch.int32),
        block_size=B,
        group_size=g,
        tile_rows=plan.tile_rows,
        global_pos=global_pos if glob else None,
        fold_count=(torch.cat(counts_g) if counts_g else q.new_zeros(0, hkv, dtype=dt)) if glob else None,
    )


def _csr_to_mask(index: BlockIndex, hkv: int, n_tiles: int, max_nb: int) -> torch.Tensor:
    """The CSR back to a dense ``[Hkv, n_tiles, max_nb]`` bool mask."""
    mask = torch.zeros(hkv * n_tiles, max(max_nb, 1), dtype=torch.bool, device=index.col_idx.device)
    counts = (index.row_ptr[1:] - index.row_ptr[:-1]).to(torch.int64)
    seg = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    mask[seg, index.col_idx.to(torch.int64)] = True
    return mask[:, :max_nb].view(hkv, n_tiles, max_nb)


def _attend_request(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    lq: int,
    lk: int,
    g: int,
    scale: float,
    dt: torch.dtype,
    block_size: int,
    tile_rows: int,
    sel: torch.Tensor | None,
    k_mean: torch.Tensor | None,
    v_mean: torch.Tensor | None,
    mean_correction: bool,
    fp8: bool = False,
    gpos: torch.Tensor | None = None,
    fold_count: torch.Tensor | None = None,
    int8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one request (section 4), one KV head at a time, tiles in batched chunks.

    For packed row ``ρ`` (token ``t``, tile ``i``) the logits are the exact keys
    ``{τ q·k_p : block(p) ∈ S_i, p <= P + t}`` plus, with ``mean_correction``, the mean keys
    ``{τ q·k̄_j + ln n_j : j ∈ U_i}``, ``U_i = {j ∉ S_i : e_j <= P + t_first(i) + 1}``; one softmax.
    ``sel = None`` means dense causal attention: ``S_i`` = every causally visible block, no mean keys.

    Each tile gathers the keys of its own selected blocks (padded to the chunk's largest ``|S_i|``),
    so the work scales with the number of selected blocks, as in the kernels.

    Global keys (section 4.1, ``gpos`` int64 ``[Hkv, K]``, ``-1`` = none): a global key ``p`` whose
    block ``j`` is in ``U_i`` adds the exact logit ``τ q·k_p`` (value ``v_p``) to the rows of tile
    ``i``; ``k_mean`` / ``v_mean`` are then the means of the blocks' other tokens and ``ln n_j``
    becomes ``ln fold_count[j]`` (``[n_blocks, Hkv]``; ``-inf`` where none is left).

    With ``fp8`` (docs/fp8.md): ``kb``, ``vb``, ``k_mean``, ``v_mean`` are already the e4m3 round
    trips; the query tiles are quantised here (one scale per tile); both products with V take the
    probabilities as ``e4m3(p * P_SCALE)`` and divide the factor out of the fp32 sum, while the
    denominator sums the unquantised ``p``. ``int8`` ("int8qk", with ``fp8``): ``kb`` and ``k_mean``
    are int8 round trips and the query tiles are quantised to int8 (docs/fp8.md section 10).

    Args:
        qb: ``[Lq, Hq, d]``; kb, vb: ``[Lk, Hkv, d]``; sel: ``[Hkv, n_tiles, n_blocks]`` bool;
        k_mean, v_mean: ``[n_blocks, Hkv, d]`` (dt).
    Returns:
        ``(out [Lq, Hq, d] dt, lse [Lq, Hq] dt)``.
    """
    B, TR = block_size, tile_rows
    P = lk - lq
    hkv, d = kb.shape[1], kb.shape[2]
    dev = qb.device
    rows = lq * g
    nb = -(-lk // B)
    n_tiles = -(-rows // TR)
    use_means = sel is not None and mean_correction
    use_global = sel is not None and gpos is not None and gpos.numel() > 0
    t_first, t_last = _tile_geometry(lq, g, TR, dev)
    j = torch.arange(nb, device=dev)
    e = torch.clamp((j + 1) * B, max=lk)
    if sel is None:                                                        # dense: all visible blocks
        sel = (j[None, :] <= ((P + t_last) // B)[:, None]).expand(hkv, n_tiles, nb)
    if use_means or use_global:
        U = (~sel) & (e[None, None, :] <= (P + t_first + 1)[None, :, None])   # [Hkv, T, nb]
    if use_means:
        ln_n = torch.log((e - j * B).to(dt))[:, None].expand(nb, hkv)       # [nb, Hkv]
        if fold_count is not None:                                         # section 4.1: the other tokens
            ln_n = torch.log(fold_count.to(dt))                            # log 0 = -inf: nothing to fold
    # Packed rows, padded to whole tiles (pad rows are computed and dropped).
    if fp8:
        qp = _fp8_q_tiles(qb, hkv, g, TR, dt, int8) * scale
    else:
        qp = torch.zeros(hkv, n_tiles * TR, d, dtype=dt, device=dev)
        qp[:, :rows] = qb.to(dt).view(lq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, rows, d) * scale
        qp = qp.view(hkv, n_tiles, TR, d)
    tok = (torch.arange(n_tiles * TR, device=dev) // g).view(n_tiles, TR)       # token of each row
    out = torch.empty(hkv, n_tiles, TR, d, dtype=dt, device=dev)
    lse = torch.empty(hkv, n_tiles, TR, dtype=dt, device=dev)
    # Keys padded to whole blocks; the pad (positions >= Lk) is always causally masked to -inf.
    kpad = torch.zeros(nb, B, hkv, d, dtype=dt, device=dev)
    vpad = torch.zeros(nb, B, hkv, d, dtype=dt, device=dev)
    kpad.view(nb * B, hkv, d)[:lk] = kb
    vpad.view(nb * B, hkv, d)[:lk] = vb
    offs = torch.arange(B, device=dev)
    counts = sel.sum(-1)                                                   # |S_i|, [Hkv, T]
    chunk = _chunk_elems(dev)
    # Selected whole blocks (no padded slot) fully seen by the tile's first row need no causal
    # mask; they come first among a tile's columns. A partial last block always gets the mask.
    full = (sel & (((j + 1) * B)[None, None, :] <= (P + t_first + 1)[None, :, None])).sum(-1)   # [Hkv, T]
    for h in range(hkv):
        kh, vh = kpad[:, :, h].contiguous(), vpad[:, :, h].contiguous()   # [nb, B, d]
        if use_global:
            gp = gpos[h][gpos[h] >= 0]
            kg, vg, gblk = kb[gp, h].to(dt), vb[gp, h].to(dt), gp // B       # [G, d], [G, d], [G]
        widest = max(1, int(counts[h].max()))
        tiles_per_chunk = max(1, chunk // (TR * (widest * B + nb)))
        for c0 in range(0, n_tiles, tiles_per_chunk):
            c1 = min(n_tiles, c0 + tiles_per_chunk)
            s_c = sel[h, c0:c1]                                            # [T, nb]
            n_sel = counts[h, c0:c1]
            n_max = max(1, int(n_sel.max()))
            # Selected block ids of each tile first, ascending; slots past |S_i| are padding.
            ids = torch.argsort((~s_c).to(torch.uint8), dim=1, stable=True)[:, :n_max]    # [T, n_max]
            slot_ok = torch.arange(n_max, device=dev)[None, :] < n_sel[:, None]
            keys = kh[ids].flatten(1, 2)                                   # [T, n_max * B, d]
            vals = vh[ids].flatten(1, 2)
            q_c = qp[h, c0:c1]                                             # [T, TR, d]
            s = torch.bmm(q_c, keys.transpose(1, 2))                       # [T, TR, n_max * B]
            # Exact keys: S_i of the row's tile, bottom-right causal p <= P + t (pad slots never
            # pass). Columns before k0 * B hold blocks every row of its tile fully sees.
            k0 = int(full[h, c0:c1].min())
            pos = (ids[:, k0:, None] * B + offs).flatten(1)                # KV position of each column
            pos = torch.where(slot_ok[:, k0:].repeat_interleave(B, dim=1), pos, lk + P + n_tiles * TR)
            s[:, :, k0 * B:].masked_fill_(pos[:, None, :] > (P + tok[c0:c1])[:, :, None], -math.inf)
            m = s.amax(-1)
            if use_global and gp.numel():
                # Global keys (section 4.1): exact where their block is in U_i; same softmax.
                sg = q_c @ kg.T                                            # [T, TR, G]
                sg.masked_fill_(~U[h, c0:c1][:, gblk][:, None, :], -math.inf)
                m = torch.maximum(m, sg.amax(-1))
            if use_means:
                # Mean keys (section 4): τ q·k̄_j + ln n_j for j in U_i; same softmax.
                sm = q_c @ k_mean[:, h].T + ln_n[:, h]                     # [T, TR, nb]
                sm.masked_fill_(~U[h, c0:c1, None, :], -math.inf)
                m = torch.maximum(m, sm.amax(-1))
            m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # row with no logit
            p = s.sub_(m_safe[..., None]).exp_()                           # exp(-inf) = 0
            denom = p.sum(-1)
            if fp8:
                o = torch.bmm(quant.p_round_trip(p), vals) / quant.P_SCALE
            else:
                o = torch.bmm(p, vals)
            if use_global and gp.numel():
                pg = sg.sub_(m_safe[..., None]).exp_()
                denom = denom + pg.sum(-1)
                o = o + ((quant.p_round_trip(pg) @ vg) / quant.P_SCALE if fp8 else pg @ vg)
            if use_means:
                pm = sm.sub_(m_safe[..., None]).exp_()
                denom = denom + pm.sum(-1)
                if fp8:
                    o = o + (quant.p_round_trip(pm) @ v_mean[:, h]) / quant.P_SCALE
                else:
                    o = o + pm @ v_mean[:, h]
            out[h, c0:c1] = o / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
            lse[h, c0:c1] = m_safe + torch.log(denom)                      # -inf on an empty row: out 0
    out = out.view(hkv, n_tiles * TR, d)[:, :rows]
    lse = lse.view(hkv, n_tiles * TR)[:, :rows]
    out = out.view(hkv, lq, g, d).permute(1, 0, 2, 3).reshape(lq, hkv * g, d)
    lse = lse.view(hkv, lq, g).permute(1, 0, 2).reshape(lq, hkv * g)
    return out, lse


def _attention(q, k_cache, v_cache, page_table, plan, scale, block_size, sel_all, tile_ptr, index, mean_correction,
               fp8=False, k_descale=None, v_descale=None, int8=False):
    dt = _compute_dtype(q)
    e4m3 = k_cache.dtype == quant.E4M3
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=dt, device=q.device)
    for b, (lq, lk, qs) in enumerate(zip(plan.q_lens, plan.kv_lens, plan.q_starts)):
        if lq == 0:
            continue
        if fp8 or e4m3:
            _, kb, ks, kinv = _operands(k_cache, k_descale, page_table, b, lk, dt, fp8, int8)
            _, vb, vs, vinv = _operands(v_cache, v_descale, page_table, b, lk, dt, fp8)
        else:
            kb = _gather_kv(k_cache, page_table, b, lk)
            vb = _gather_kv(v_cache, page_table, b, lk)
        sel = km = vm = None
        if sel_all is not None:
            nb = -(-lk // block_size)
            sel = sel_all[:, tile_ptr[b]:tile_ptr[b + 1], :nb]
            bp = sum(-(-x // block_size) for x in plan.kv_lens[:b])
            km, vm = index.k_mean[bp:bp + nb].to(dt), index.v_mean[bp:bp + nb].to(dt)
            if fp8:                                                        # means take their K / V scale
                km = _round_trip_k(km, ks[:, None], kinv[:, None], dt, int8)
                vm = quant.round_trip(vm, vs[:, None], vinv[:, None], dt)
        gpos = fold = None
        if sel is not None and index.global_pos is not None:              # section 4.1
            gpos, fold = index.global_pos[b], index.fold_count[bp:bp + nb]
        o, l = _attend_request(q[qs:qs + lq], kb, vb, lq, lk, plan.group_size, scale, dt, block_size,
                               plan.tile_rows, sel, km, vm, mean_correction, fp8, gpos, fold, int8)
        out[qs:qs + lq] = o.to(q.dtype)
        lse[qs:qs + lq] = l
    return out, lse


def sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    config: SparseConfig | None = None,
    softmax_scale: float | None = None,
    plan: BatchPlan | None = None,
    index: BlockIndex | None = None,
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention with mean correction (section 4, docs/layout.md).

    Args: as ``build_index``, plus ``index`` (built when None, with the same ``precision``).
        ``precision="fp8"``: e4m3 operands in ``Q K^T``, ``P V`` and both mean-correction
        products (docs/fp8.md); ``"int8qk"``: int8 operands in ``Q K^T`` and the scoring / mean logits,
        e4m3 in the products with V (section 10; raises ``ValueError`` with an e4m3 cache).

    Returns:
        ``(out [total_q, Hq, d] in q's dtype, lse [total_q, Hq] float32 (float64 for float64 q))``;
        ``lse`` is the natural-log corrected denominator.
    """
    config = config or SparseConfig()
    fp8 = _is_fp8(precision)
    int8 = _check_int8qk_cache(precision, k_cache)
    plan, scale, hkv, g = _resolve(q, seq_lens, cu_seqlens_q, k_cache, config.block_size, softmax_scale, plan)
    if index is None:
        index = build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, scale, plan,
                            precision, k_descale, v_descale)
    B = index.block_size
    tile_ptr = host_tile_ptr(plan)
    max_nb = plan.max_blocks(B)
    sel_all = _csr_to_mask(index, hkv, tile_ptr[-1], max_nb)
    return _attention(q, k_cache, v_cache, page_table, plan, scale, B, sel_all, tile_ptr, index,
                      config.mean_correction, fp8, k_descale, v_descale, int8)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    config: SparseConfig | None = None,
    softmax_scale: float | None = None,
    plan: BatchPlan | None = None,
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, BlockIndex]:
    """``build_index`` then ``sparse_attention`` (arguments as theirs): ``(out, lse, index)``, the
    reference's form of the Triton backend's ``host.attention`` (``flashprefill_attention`` without
    an index calls it)."""
    index = build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan,
                        precision, k_descale, v_descale)
    out, lse = sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale,
                                plan, index, precision, k_descale, v_descale)
    return out, lse, index


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float | None = None,
    plan: BatchPlan | None = None,
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention (bottom-right aligned) over the paged KV.

    ``precision``, ``k_descale``, ``v_descale``: as ``sparse_attention`` (FP8: e4m3 ``Q K^T`` and
    ``P V`` over the same 128-row query tiles).

    Returns:
        ``(out [total_q, Hq, d] in q's dtype, lse [total_q, Hq] float32 (float64 for float64 q))``.
    """
    fp8 = _is_fp8(precision)
    int8 = _check_int8qk_cache(precision, k_cache)
    block_size = plan.block_size if plan is not None else 128
    plan, scale, _, _ = _resolve(q, seq_lens, cu_seqlens_q, k_cache, block_size, softmax_scale, plan)
    return _attention(q, k_cache, v_cache, page_table, plan, scale, plan.block_size, None, None, None, False,
                      fp8, k_descale, v_descale, int8)


# --------------------------------------------------------------------------------------------
# Block map of a tiny case.

LEGEND = {"selected": "#", "mean": "m", "dropped": ".", "invisible": " "}


def block_map(index: BlockIndex, plan: BatchPlan, b: int = 0, kv_head: int = 0,
              mean_correction: bool = True) -> str:
    """Text block map of request ``b``, KV head ``kv_head``: one line per tile, one char per block.

    ``#`` selected (exact), ``m`` pruned but folded back as a mean key (``U``), ``.`` pruned and
    dropped (visible, not in ``U``, or any pruned block without ``mean_correction``), blank:
    causally invisible.
    """
    B, g, tr = index.block_size, plan.group_size, plan.tile_rows
    lq, lk = plan.q_lens[b], plan.kv_lens[b]
    P = lk - lq
    tile_ptr = host_tile_ptr(plan)
    hkv = index.n_kv_heads
    max_nb = max((-(-x // B) for x in plan.kv_lens), default=0)
    sel = _csr_to_mask(index, hkv, tile_ptr[-1], max_nb)[kv_head, tile_ptr[b]:tile_ptr[b + 1]]
    nb = -(-lk // B)
    t_first, t_last = _tile_geometry(lq, g, tr, sel.device)
    lines = [f"request {b}: Lq={lq} Lk={lk} P={P} g={g} B={B}; kv head {kv_head}; "
             f"'#' selected, 'm' mean-corrected, '.' dropped, ' ' invisible"]
    lines.append("tile  tokens      |" + "".join(str(j % 10) for j in range(nb)) + "|")
    for i in range(sel.shape[0]):
        tf, tl = int(t_first[i]), int(t_last[i])
        chars = []
        for j in range(nb):
            e = min((j + 1) * B, lk)
            if j > (P + tl) // B:
                chars.append(LEGEND["invisible"])
            elif bool(sel[i, j]):
                chars.append(LEGEND["selected"])
            elif mean_correction and e <= P + tf + 1:
                chars.append(LEGEND["mean"])
            else:
                chars.append(LEGEND["dropped"])
        lines.append(f"{i:4d}  {tf:5d}-{tl:<5d}|{''.join(chars)}|")
    return "\n".join(lines)


def main() -> None:
    """Print the block map of a tiny case (Lq = Lk = 2000, g = 2, B = 64)."""
    torch.manual_seed(0)
    lq, hkv, g, d, B, ps = 2000, 1, 2, 32, 64, 16
    lk = lq
    u = torch.randn(d)                                # a shared "needle" direction
    q = torch.randn(lq, hkv * g, d) + 0.5 * u
    n_pages = -(-lk // ps)
    k = torch.randn(n_pages, ps, hkv, d)
    k[torch.arange(n_pages) % 23 == 5] += 2.0 * u      # a few needle pages
    v = torch.randn(n_pages, ps, hkv, d)
    page_table = torch.arange(n_pages, dtype=torch.int32)[None]
    seq_lens = torch.tensor([lk], dtype=torch.int32)
    cu = torch.tensor([0, lq], dtype=torch.int32)
    config = SparseConfig(block_size=B, sink_tokens=64, window_tokens=128, dense_tail_tokens=64, alpha=0.3)
    plan = make_plan(seq_lens, cu, g, B)
    index = build_index(q, k, v, page_table, seq_lens, cu, config, None, plan)
    print(block_map(index, plan, mean_correction=config.mean_correction))
    density = index.nnz / int(index.n_visible.sum())
    print(f"density {density:.3f} ({index.nnz} of {int(index.n_visible.sum())} visible blocks)")


if __name__ == "__main__":
    main()
