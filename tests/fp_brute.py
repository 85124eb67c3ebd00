"""Independent brute-force float64 definition of docs/layout.md, for the CPU tests.

Written from the layout page, not from ``impl/reference.py``: explicit Python loops over
requests, KV heads, tiles, rows and blocks on tiny shapes. Also the input builders shared by
``test_reference.py`` and ``test_api.py``.
"""
from __future__ import annotations

import math

import torch


def make_inputs(q_lens, kv_lens, hq, hkv, d, page_size, dtype=torch.float64, seed=0, structured=False,
                shuffle_pages=True):
    """Random paged batch. Pages are allocated per request (shuffled pool, a few spare pages).

    ``structured``: keys carry a few strong "needle" blocks along a direction shared with the
    queries over a smooth background, so that pruned blocks still carry softmax mass.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(q_lens)
    pages_per = [-(-lk // page_size) for lk in kv_lens]
    max_pages = max(max(pages_per), 1) + 1                 # one spare column
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen) if shuffle_pages else torch.arange(num_pages)
    page_table = torch.full((batch, max_pages), 0, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[used:used + n].to(torch.int32)
        # unused tail entries point at a real page too (as in SGLang), never read
        page_table[b, n:] = perm[-1].to(torch.int32)
        used += n
    total_q = sum(q_lens)
    q = torch.randn(total_q, hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(num_pages, page_size, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(num_pages, page_size, hkv, d, generator=gen, dtype=torch.float64)
    if structured:
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        u = u / u.norm() * math.sqrt(d)
        q = 0.4 * q + u
        # smooth background: keys drift slowly with position
        k = 0.3 * k + 0.3 * torch.randn(1, 1, hkv, d, generator=gen, dtype=torch.float64)
        for b in range(batch):
            for p in range(kv_lens[b]):
                if (p // 32) % 9 == 4:             # needle stretches of 32 tokens
                    pid = int(page_table[b, p // page_size])
                    k[pid, p % page_size] += 6.0 * u / math.sqrt(d)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0).tolist()), dtype=torch.int32)
    return (q.to(dtype), k.to(dtype), v.to(dtype), page_table, seq_lens, cu)


# --------------------------------------------------------------------------------------------
# FP8 (docs/fp8.md), written from the format's definition, not from flashprefill.quant


def e4m3_round(x):
    """Round float64 values to the nearest e4m3fn value: 3 mantissa bits, exponent bias 7 (normals
    from 2**-6, subnormal step 2**-9), ties to even, saturating at +-448, NaN kept. Returns float64."""
    a = x.abs()
    _, e = torch.frexp(a)                                   # a = f * 2**e, f in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(a), torch.clamp(e - 1, min=-6) - 3)
    r = torch.clamp(torch.round(a / ulp) * ulp, max=448.0)   # torch.round: half to even
    return torch.where(torch.isnan(x), x, torch.copysign(r, x))


def fp8_scales(x):
    """``(scale, inv_scale)`` as Python floats holding float32 values, for a group ``x`` (any shape):
    ``amax / 448`` and ``448 / amax`` rounded to float32, ``amax`` of float32(x); 1, 1 below 2**-100."""
    amax = float(x.float().abs().max()) if x.numel() else 0.0
    if amax < 2.0 ** -100:
        return 1.0, 1.0
    a = torch.tensor(amax, dtype=torch.float32)
    return float(a / 448.0), float(torch.tensor(448.0, dtype=torch.float32) / a)


def fp8_value(x, scale, inv):
    """What an e4m3 operand of ``x`` stands for: ``e4m3(float32(x) * inv) * scale`` in float64."""
    y = (x.float() * torch.tensor(inv, dtype=torch.float32)).double()
    return e4m3_round(y) * scale


def int8_scales(x):
    """``(scale, inv_scale)`` of an int8 group (precision "int8qk", docs/fp8.md section 10): ``amax / 127``
    and ``127 / amax``, each a Python float64 quotient rounded once to float32; 1, 1 below 2**-100."""
    amax = float(x.float().abs().max()) if x.numel() else 0.0
    if amax < 2.0 ** -100:
        return 1.0, 1.0
    return float(torch.tensor(amax / 127.0, dtype=torch.float32)), float(torch.tensor(127.0 / amax, dtype=torch.float32))


def int8_value(x, scale, inv):
    """What an int8 operand of ``x`` stands for: ``clamp(round_half_even(float32(x) * inv), -127, 127) *
    scale`` in float64 (NaN -> 0)."""
    y = (x.float() * torch.tensor(inv, dtype=torch.float32)).double()
    y = torch.nan_to_num(y, nan=0.0)
    return torch.clamp(torch.round(y), -127.0, 127.0) * scale


def _gather(cache, page_table, b, lk):
    ps = cache.shape[1]
    return torch.stack([cache[int(page_table[b, p // ps]), p % ps] for p in range(lk)]) if lk else \
        cache.new_zeros(0, cache.shape[2], cache.shape[3])


def brute_force(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, scale=None, dense=False,
                precision="bf16", k_descale=None, v_descale=None, p_scale=256.0):
    """Returns ``(out [total_q, Hq, d] f64, lse [total_q, Hq] f64, segments)``.

    ``segments``: dict ``(h, b, tile) -> sorted list of selected block ids``.
    ``dense=True``: plain causal attention (no selection, no mean keys).
    ``precision="fp8"`` (docs/fp8.md): every GEMM operand replaced by its e4m3 value -- K, V with one
    scale per (request, KV head), the block means with their K / V scale, each query tile with its
    own scale -- and each exact / mean probability ``p`` by ``e4m3(p * p_scale) / p_scale`` in the
    numerator, the denominator summing ``p``. ``float8_e4m3fn`` caches: ``code * descale``
    (``k_descale`` / ``v_descale`` 0-dim or ``[batch, Hkv]``), and the descale is the scale.
    ``precision="int8qk"``: the same with int8 values (``int8_value``) for Q tiles, K and the key means.
    """
    fp8 = precision in ("fp8", "int8qk")
    qk_value, qk_scales = (int8_value, int8_scales) if precision == "int8qk" else (fp8_value, fp8_scales)
    e4m3 = k_cache.dtype == torch.float8_e4m3fn

    def descale(t, b, h):
        return float(t) if t.dim() == 0 else float(t[b, h])

    if not e4m3:
        k_cache, v_cache = k_cache.double(), v_cache.double()
    q = q.double()
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    tau = scale if scale is not None else 1.0 / math.sqrt(d)
    B = config.block_size
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64)
    segments = {}
    for b in range(seq_lens.numel()):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        lq, lk = qe - qs, int(seq_lens[b])
        P = lk - lq
        K = _gather(k_cache, page_table, b, lk)
        V = _gather(v_cache, page_table, b, lk)
        if e4m3:                                                # codes * descale, per KV head
            K, V = K.double().clone(), V.double().clone()
            for h in range(hkv):
                K[:, h] *= descale(k_descale, b, h)
                V[:, h] *= descale(v_descale, b, h)
        nb = -(-lk // B)
        ends = [min((j + 1) * B, lk) for j in range(nb)]
        n = [ends[j] - j * B for j in range(nb)]
        kbar = [K[j * B:ends[j]].mean(0) for j in range(nb)]
        vbar = [V[j * B:ends[j]].mean(0) for j in range(nb)]
        if fp8:                                                 # e4m3 values of K, V and the means
            K8, V8 = K.clone(), V.clone()
            kbar8 = [x.clone() for x in kbar]
            vbar8 = [x.clone() for x in vbar]
            for h in range(hkv):
                if e4m3:
                    sk, sv = descale(k_descale, b, h), descale(v_descale, b, h)
                    ks = (sk, float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(sk, dtype=torch.float32)))
                    vs = (sv, float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(sv, dtype=torch.float32)))
                else:
                    ks, vs = qk_scales(K[:, h]), fp8_scales(V[:, h])
                    K8[:, h], V8[:, h] = qk_value(K[:, h], *ks), fp8_value(V[:, h], *vs)
                for j in range(nb):
                    kbar8[j][h] = qk_value(kbar[j][h], *ks)
                    vbar8[j][h] = fp8_value(vbar[j][h], *vs)
            K, V, kbar, vbar = K8, V8, kbar8, vbar8
        rows = lq * g
        n_tiles = -(-rows // 128)
        for h in range(hkv):
            for i in range(n_tiles):
                rho_list = list(range(128 * i, min(128 * i + 128, rows)))
                t_first, t_last = rho_list[0] // g, rho_list[-1] // g
                q_rows = torch.stack([q[qs + rho // g, h * g + rho % g] for rho in rho_list])
                if fp8:                                         # one scale per query tile
                    q_rows = qk_value(q_rows, *qk_scales(q_rows))
                vis_last = (P + t_last) // B
                if dense:
                    S = list(range(vis_last + 1))
                    U = []
                else:
                    scored = [j for j in range(nb) if ends[j] <= P + t_last + 1]
                    dots = (q_rows @ torch.stack([kb[h] for kb in kbar]).T).tolist() if nb else []
                    ell = {}                                # valid (row, block) pairs only
                    for r, rho in enumerate(rho_list):
                        t = rho // g
                        for j in range(nb):
                            if ends[j] <= P + t + 1:
                                ell[(rho, j)] = tau * dots[r][j]
                    win_lo = max(0, P + t_first - config.window_tokens + 1) // B
                    is_dense = t_last >= lq - config.dense_tail_tokens or lq < config.min_sparse_len
                    # the blocks the threshold decides and measures against (docs/method.md 3.4)
                    decided = scored if config.threshold_max == "scored" else \
                        [j for j in scored if not (j * B < config.sink_tokens or j >= win_lo or is_dense)]
                    kept = set()
                    if ell:
                        M = max(ell.values())
                        E = {j: 0.0 for j in scored}
                        if config.block_score == "mass":       # each row's softmax over its decided blocks
                            for rho in rho_list:
                                w = {j: math.exp(ell[(rho, j)] - M) for j in decided if (rho, j) in ell}
                                z = sum(w.values())
                                for j, x in w.items():
                                    E[j] += x / z if z > 0 else 0.0
                        else:
                            for (rho, j), val in ell.items():
                                if j in E:
                                    E[j] += math.exp(val - M)
                        emax = max((E[j] for j in decided), default=0.0)
                        kept = {j for j in decided if E[j] >= config.alpha * emax}
                    S = []
                    for j in range(vis_last + 1):
                        if (j in kept or j * B < config.sink_tokens or j >= win_lo or is_dense):
                            S.append(j)
                    U = [j for j in range(nb) if ends[j] <= P + t_first + 1 and j not in S] \
                        if config.mean_correction else []
                segments[(h, b, i)] = S
                in_S = torch.zeros(lk, dtype=torch.bool)           # positions of the blocks of S
                for j in S:
                    in_S[j * B:ends[j]] = True
                if U:                                               # mean keys: n_j copies of the mean
                    kU = torch.stack([kbar[j][h] for j in U])
                    vU = torch.stack([vbar[j][h] for j in U])
                    lnU = torch.log(torch.tensor([float(n[j]) for j in U], dtype=torch.float64))
                positions = torch.arange(lk)
                for r, rho in enumerate(rho_list):
                    t, head = rho // g, h * g + rho % g
                    qv = q_rows[r]
                    # exact keys: positions of selected blocks, causally visible (p <= P + t), p < Lk
                    keep = in_S & (positions <= P + t)
                    logits = [tau * (K[keep, h] @ qv)]
                    vals = [V[keep, h]]
                    if U:
                        logits.append(tau * (kU @ qv) + lnU)
                        vals.append(vU)
                    lg = torch.cat(logits)
                    if lg.numel() == 0:
                        continue
                    p = torch.exp(lg - lg.max())
                    if fp8:                                     # numerator: e4m3(p * p_scale) / p_scale
                        out[qs + t, head] = (e4m3_round(p * p_scale) / p_scale) @ torch.cat(vals) / p.sum()
                    else:
                        out[qs + t, head] = torch.softmax(lg, 0) @ torch.cat(vals)
                    lse[qs + t, head] = torch.logsumexp(lg, 0)
    return out, lse, segments


def csr_segments(index, plan):
    """The CSR of a BlockIndex as a dict ``(h, b, tile) -> list`` (same keys as brute_force)."""
    row_ptr = index.row_ptr.tolist()
    col = index.col_idx.tolist()
    tile_ptr = index.tile_ptr.tolist()
    n_tiles = tile_ptr[-1]
    segs = {}
    for h in range(index.n_kv_heads):
        for b in range(len(tile_ptr) - 1):
            for i in range(tile_ptr[b + 1] - tile_ptr[b]):
                s = h * n_tiles + tile_ptr[b] + i
                segs[(h, b, i)] = col[row_ptr[s]:row_ptr[s + 1]]
    return segs


def expected_prepass(k_cache, v_cache, page_table, kv_lens, block_size, k_mean=None, v_mean=None):
    """What the FP8 pre-pass (``impl/triton/quant_kernels.py``) must write, bit for bit, built per
    request with ``flashprefill.quant`` (docs/fp8.md section 7): ``dict`` of ``k8 [Hkv, total_k, d]``,
    ``v8t [Hkv, d, total_k]`` (each request's tokens padded with zero codes to a multiple of 128, the
    pre-pass's ``REQUEST_ALIGN``), ``cu_seqlens_k`` (list), ``k_scale``, ``v_scale`` ``[batch, Hkv]``, and
    with the means ``k_mean8``, ``v_mean8t [Hkv, d, n_blocks]``."""
    from flashprefill import quant

    align = 128                         # written out, not imported: the test states the layout
    ps = k_cache.shape[1]
    ks, vs, k8, v8, kinv, vinv, blocks = [], [], [], [], [], [], []
    for b, lk in enumerate(kv_lens):
        pages = page_table[b, :-(-lk // ps)].long()
        for cache, codes, scales, invs in ((k_cache, k8, ks, kinv), (v_cache, v8, vs, vinv)):
            x = cache[pages].flatten(0, 1)[:lk]
            s, inv = quant.kv_scales(x)
            c = quant.quantize(x, inv[:, None])
            gap = torch.zeros(-lk % align, *c.shape[1:], dtype=c.dtype)
            codes.append(torch.cat([c.view(torch.uint8), gap.view(torch.uint8)]).view(c.dtype))
            scales.append(s)
            invs.append(inv)
        blocks.append(-(-lk // block_size))
    out = {
        "k8": torch.cat(k8).permute(1, 0, 2),
        "v8t": torch.cat(v8).permute(1, 2, 0),
        "cu_seqlens_k": [0] + [sum(-(-n // align) * align for n in kv_lens[:i + 1]) for i in range(len(kv_lens))],
        "k_scale": torch.stack(ks),
        "v_scale": torch.stack(vs),
    }
    if k_mean is not None:
        req = torch.repeat_interleave(torch.arange(len(kv_lens)), torch.tensor(blocks)).to(k_mean.device)
        out["k_mean8"] = quant.quantize(k_mean, torch.stack(kinv).to(k_mean.device)[req][:, :, None])
        out["v_mean8t"] = quant.quantize(v_mean, torch.stack(vinv).to(k_mean.device)[req][:, :, None]).permute(1, 2, 0)
    return out


def edge_cache(page_size, hkv, d, n_pages, seed=0):
    """A float32 K/V pool whose largest magnitude is exactly 448 (scale 1, so ``x * inv_scale = x``)
    and whose values hit every e4m3 rounding tie, both signs, -0, values rounding to -0, subnormals
    and the saturation edge: the cast's rounding is visible in the codes."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = codes[~codes.isnan()].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    special = torch.tensor([448.0, -448.0, -0.0, -2.0 ** -11, 2.0 ** -10, -2.0 ** -10, 447.9, 2.0 ** -9 * 1.5])
    n = n_pages * page_size * hkv * d
    pool = torch.cat([special, ties, -ties, torch.randn(n, generator=gen) * 30])[:n]
    pool = pool[torch.randperm(n, generator=gen)]
    pool[0] = 448.0
    return pool.view(n_pages, page_size, hkv, d)
