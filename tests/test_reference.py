"""The PyTorch reference (``flashprefill.impl.reference``) against an independent brute-force
float64 definition of docs/layout.md (``tests/fp_brute.py``), plus the failure modes of
issue 2 and the CSR invariants. CPU only, tiny shapes."""
from __future__ import annotations

import math

import pytest
import torch

from fp_brute import brute_force, csr_segments, make_inputs
from flashprefill import SparseConfig, make_plan
from flashprefill.impl import reference as R

# Small sink / window so that the sparse path is really exercised (density < 1, U non-empty).
SPARSE64 = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)
SPARSE128 = SparseConfig(block_size=128, sink_tokens=100, window_tokens=130, dense_tail_tokens=20, alpha=0.3)


def run_ref(inp, config, scale=None):
    q, k, v, pt, sl, cu = inp
    plan = make_plan(sl, cu, q.shape[1] // k.shape[2], config.block_size)
    index = R.build_index(q, k, v, pt, sl, cu, config, scale, plan)
    out, lse = R.sparse_attention(q, k, v, pt, sl, cu, config, scale, plan, index)
    return out, lse, index, plan


def density(index):
    return index.nnz / int(index.n_visible.sum())


def n_mean_keys(index, plan, config):
    """Number of (segment, block) pairs in U (pruned and fully seen by the whole tile)."""
    B, g = index.block_size, plan.group_size
    total = 0
    segs = csr_segments(index, plan)
    for (h, b, i), S in segs.items():
        lq, lk = plan.q_lens[b], plan.kv_lens[b]
        t_first = 128 * i // g
        total += sum(1 for j in range(-(-lk // B)) if min((j + 1) * B, lk) <= lk - lq + t_first + 1 and j not in S)
    return total


def check_vs_brute(inp, config, scale=None, atol=1e-10):
    out, lse, index, plan = run_ref(inp, config, scale)
    ref_out, ref_lse, segs = brute_force(*inp, config, scale)
    assert csr_segments(index, plan) == segs
    assert out.dtype == inp[0].dtype
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=atol, rtol=0)
    return out, lse, index, plan


# --------------------------------------------------------------------------------------------
# Reference vs brute force


@pytest.mark.parametrize("length", [1, 127, 128, 129, 300])
def test_lengths(length):
    inp = make_inputs([length], [length], hq=6, hkv=2, d=32, page_size=16, seed=length, structured=True)
    check_vs_brute(inp, SPARSE64)


def test_sparse_path_is_exercised():
    inp = make_inputs([300], [300], hq=6, hkv=2, d=32, page_size=16, seed=300, structured=True)
    _, _, index, plan = run_ref(inp, SPARSE64)
    assert density(index) < 1.0
    assert n_mean_keys(index, plan, SPARSE64) > 0


@pytest.mark.parametrize("q_len,kv_len", [(200, 500), (1, 300), (129, 257)])
def test_prefix(q_len, kv_len):
    inp = make_inputs([q_len], [kv_len], hq=2, hkv=2, d=32, page_size=16, seed=kv_len, structured=True)
    check_vs_brute(inp, SPARSE64)


def test_mixed_batch():
    # lengths [100, 700, 1] with prefixes [0, 300, 63]
    inp = make_inputs([100, 700, 1], [100, 1000, 64], hq=6, hkv=2, d=32, page_size=16, seed=7, structured=True)
    out, lse, index, plan = check_vs_brute(inp, SPARSE64)
    assert density(index) < 1.0
    # batching changes nothing: each request alone gives the same rows
    q, k, v, pt, sl, cu = inp
    for b in range(3):
        qs, qe = int(cu[b]), int(cu[b + 1])
        alone = (q[qs:qe], k, v, pt[b:b + 1], sl[b:b + 1], torch.tensor([0, qe - qs], dtype=torch.int32))
        o, l, _, _ = run_ref(alone, SPARSE64)
        torch.testing.assert_close(o, out[qs:qe], atol=1e-12, rtol=0)
        torch.testing.assert_close(l, lse[qs:qe], atol=1e-12, rtol=0)


@pytest.mark.parametrize("g,block_size", [(1, 64), (3, 64), (7, 128), (8, 128)])
def test_host_visible_blocks_equal_the_index(g, block_size):
    """``flashprefill.plan.visible_blocks`` (lengths only, what the SGLang statistics use) equals
    the index's ``n_visible`` summed over each request's segments of one KV head, across tile
    boundaries, prefixes, a 1-token request and an empty one."""
    from flashprefill.plan import host_tile_ptr, visible_blocks

    q_lens, kv_lens = [100, 700, 1, 0, 129], [100, 1000, 64, 30, 129]
    inp = make_inputs(q_lens, kv_lens, hq=2 * g, hkv=2, d=16, page_size=16, seed=3)
    cfg = SparseConfig(block_size=block_size, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)
    _, _, index, plan = run_ref(inp, cfg)
    ptr = host_tile_ptr(plan)
    assert ptr == plan.tile_ptr.tolist()
    per_head = index.n_visible.view(2, -1).to(torch.int64)
    want = [int(per_head[0, ptr[b]:ptr[b + 1]].sum()) for b in range(len(q_lens))]
    assert torch.equal(per_head[0], per_head[1])
    assert visible_blocks(plan) == want
    assert want[3] == 0 and want[2] == 1 and min(want[:3]) > 0


@pytest.mark.parametrize("g", [1, 3, 7, 8])
def test_gqa_groups(g):
    inp = make_inputs([150], [250], hq=g, hkv=1, d=32, page_size=16, seed=g, structured=True)
    check_vs_brute(inp, SPARSE64)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_sizes(page_size):
    inp = make_inputs([90, 200], [150, 200], hq=4, hkv=2, d=32, page_size=page_size, seed=page_size,
                      structured=True)
    check_vs_brute(inp, SPARSE64)


@pytest.mark.parametrize("config", [SPARSE64, SPARSE128], ids=["B64", "B128"])
@pytest.mark.parametrize("mean_correction", [True, False])
def test_block_sizes_and_mean_correction(config, mean_correction):
    config = config.replace(mean_correction=mean_correction)
    inp = make_inputs([600], [700], hq=2, hkv=1, d=32, page_size=16, seed=11, structured=True)
    _, _, index, plan = check_vs_brute(inp, config)
    assert density(index) < 1.0
    assert n_mean_keys(index, plan, config) > 0


def test_custom_scale_and_min_sparse_len():
    inp = make_inputs([40, 300], [40, 300], hq=3, hkv=1, d=32, page_size=16, seed=5, structured=True)
    check_vs_brute(inp, SPARSE64.replace(min_sparse_len=50), scale=0.3)


def test_alpha_zero_is_dense():
    """α = 0 keeps every scored block; the window holds the partial diagonal: all visible blocks."""
    inp = make_inputs([300, 77], [400, 77], hq=3, hkv=1, d=32, page_size=16, seed=3, structured=True)
    config = SPARSE64.replace(alpha=0.0)
    out, lse, index, plan = check_vs_brute(inp, config)
    assert density(index) == 1.0
    q, k, v, pt, sl, cu = inp
    dout, dlse = R.dense_attention(q, k, v, pt, sl, cu, None, plan)
    torch.testing.assert_close(out, dout, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, dlse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("g,page_size", [(1, 16), (3, 1), (7, 64)])
def test_threshold_over_prunable_blocks_vs_brute(g, page_size):
    """``threshold_max="prunable"`` (docs/method.md 3.4): the reference equals the brute-force
    definition (max E over the scored blocks that sink, window and dense tail do not keep)."""
    inp = make_inputs([700, 130], [1000, 300], hq=g, hkv=1, d=32, page_size=page_size, seed=41, structured=True)
    check_vs_brute(inp, SPARSE64.replace(threshold_max="prunable"))


def test_a_strong_sink_sets_the_bar_only_when_the_max_is_over_every_scored_block():
    """Every query along ``u``; the sink block's keys give logits ~8, block 7's ~4, the others ~0.
    With the max over every scored block, block 7's energy is e^-4 = 1.8% of the sink's, under
    alpha 0.1: pruned. With the max over the prunable blocks it sets the bar and is kept, and the
    other blocks (e^-4 of it) stay pruned. Tiles 5 and 6 (tokens 640-895) see block 7 fully,
    outside their window; tile 7 holds the dense tail."""
    d, L, B = 64, 1024, 64
    gen = torch.Generator().manual_seed(5)
    u = torch.randn(d, generator=gen, dtype=torch.float64)
    u = u / u.norm()
    q = (math.sqrt(d) * u + 0.05 * torch.randn(L, 1, d, generator=gen, dtype=torch.float64))
    k = 0.05 * torch.randn(L, 1, 1, d, generator=gen, dtype=torch.float64)     # page size 1
    v = torch.randn(L, 1, 1, d, generator=gen, dtype=torch.float64)
    k[:B] += 8.0 * u                                                            # tau q.k = u.k = 8
    k[7 * B:8 * B] += 4.0 * u
    pt = torch.arange(L, dtype=torch.int32)[None, :]
    sl, cu = torch.tensor([L], dtype=torch.int32), torch.tensor([0, L], dtype=torch.int32)
    inp = (q, k, v, pt, sl, cu)
    base = SparseConfig(block_size=B, sink_tokens=B, window_tokens=B, dense_tail_tokens=32, alpha=0.1)
    selected = {}
    for mode in ("scored", "prunable"):
        _, _, index, plan = check_vs_brute(inp, base.replace(threshold_max=mode))
        selected[mode] = csr_segments(index, plan)
    for tile in (5, 6):
        window = set(range((tile * 128 - B + 1) // B, 2 * tile + 2))
        assert set(selected["scored"][(0, 0, tile)]) == {0} | window
        assert set(selected["prunable"][(0, 0, tile)]) == {0, 7} | window


@pytest.mark.parametrize("g,page_size,threshold_max", [(1, 16, "scored"), (3, 1, "prunable"), (7, 64, "scored")])
def test_block_score_mass_vs_brute(g, page_size, threshold_max):
    """``block_score="mass"`` (docs/method.md 3.3): each row's softmax over the blocks it scores,
    summed over the tile; the reference equals the brute-force definition."""
    inp = make_inputs([700, 130], [1000, 300], hq=g, hkv=1, d=32, page_size=page_size, seed=43, structured=True)
    config = SPARSE64.replace(block_score="mass", threshold_max=threshold_max, alpha=0.1)
    _, _, index, _ = check_vs_brute(inp, config)
    assert density(index) < 0.9


def test_mass_weighs_every_row_the_same():
    """Two query heads share a KV head: head 0's rows have logits ~12 on block 2 and ~0 elsewhere,
    head 1's rows logits ~6 on block 5 (a flatter head). By energy (one shared max) head 1's
    block has e^-6 of block 2's: pruned at alpha 0.1. By mass each row counts once: block 5
    holds ~98% of head 1's attention, about as much of the tile's mass as block 2: kept."""
    d, L, B = 64, 1024, 64
    gen = torch.Generator().manual_seed(9)
    u, w = torch.linalg.qr(torch.randn(d, 2, generator=gen, dtype=torch.float64))[0].T
    q = torch.empty(L, 2, d, dtype=torch.float64)
    q[:, 0], q[:, 1] = math.sqrt(d) * u, math.sqrt(d) * w
    q += 0.05 * torch.randn(L, 2, d, generator=gen, dtype=torch.float64)
    k = 0.05 * torch.randn(L, 1, 1, d, generator=gen, dtype=torch.float64)
    v = torch.randn(L, 1, 1, d, generator=gen, dtype=torch.float64)
    k[2 * B:3 * B] += 12.0 * u
    k[5 * B:6 * B] += 6.0 * w
    pt = torch.arange(L, dtype=torch.int32)[None, :]
    inp = (q, k, v, pt, torch.tensor([L], dtype=torch.int32), torch.tensor([0, L], dtype=torch.int32))
    base = SparseConfig(block_size=B, sink_tokens=B, window_tokens=B, dense_tail_tokens=32, alpha=0.1)
    kept = {}
    for score in ("energy", "mass"):
        _, _, index, plan = check_vs_brute(inp, base.replace(block_score=score))
        kept[score] = csr_segments(index, plan)
    for tile in (8, 9):           # tokens 512-639 (g 2: 64 tokens a tile): blocks 2 and 5 outside the window
        assert 2 in kept["energy"][(0, 0, tile)] and 5 not in kept["energy"][(0, 0, tile)]
        assert {2, 5} <= set(kept["mass"][(0, 0, tile)])


def test_threshold_max_is_checked():
    with pytest.raises(ValueError, match="threshold_max must be one of"):
        SparseConfig(threshold_max="all")


def test_dense_vs_brute():
    inp = make_inputs([100, 700, 1], [100, 1000, 64], hq=6, hkv=2, d=32, page_size=16, seed=8)
    q, k, v, pt, sl, cu = inp
    out, lse = R.dense_attention(q, k, v, pt, sl, cu)
    ref_out, ref_lse, _ = brute_force(*inp, SPARSE64, dense=True)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    """Math in float32: output in q's dtype, lse float32, close to the float64 definition."""
    inp64 = make_inputs([129], [200], hq=4, hkv=2, d=32, page_size=16, seed=2, structured=True)
    inp = tuple(t.to(dtype) if t.is_floating_point() else t for t in inp64)
    out, lse, index, plan = run_ref(inp, SPARSE64)
    assert out.dtype == dtype and lse.dtype == torch.float32
    # same selection as float64 on the same (rounded) inputs
    rounded = tuple(t.double() if t.is_floating_point() else t for t in inp)
    ref_out, ref_lse, segs = brute_force(*rounded, SPARSE64)
    assert csr_segments(index, plan) == segs
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=0)
    assert index.k_mean.dtype == torch.float32


def test_float64_stays_float64():
    inp = make_inputs([50], [60], hq=2, hkv=1, d=16, page_size=16, seed=1)
    out, lse, index, _ = run_ref(inp, SPARSE64)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64 and index.k_mean.dtype == torch.float64


# --------------------------------------------------------------------------------------------
# Block means


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_block_means_valid_tokens_only(page_size):
    kv = [130, 64, 5]
    q, k, v, pt, sl, cu = make_inputs([10, 64, 5], kv, hq=2, hkv=2, d=16, page_size=page_size, seed=4)
    index = R.build_index(q, k, v, pt, sl, cu, SPARSE64)
    B = 64
    row = 0
    for b, lk in enumerate(kv):
        pos = torch.arange(lk)
        K = k[pt[b].long()[pos // page_size], pos % page_size]
        V = v[pt[b].long()[pos // page_size], pos % page_size]
        for j in range(-(-lk // B)):
            torch.testing.assert_close(index.k_mean[row], K[j * B:(j + 1) * B].mean(0).float().to(index.k_mean.dtype))
            torch.testing.assert_close(index.v_mean[row], V[j * B:(j + 1) * B].mean(0).to(index.v_mean.dtype))
            row += 1
    assert row == index.k_mean.shape[0] == int(index.block_ptr[-1])


# --------------------------------------------------------------------------------------------
# Failure modes of similar projects (issue 2)


def _poison_padding(inp, kv_lens, value_k, value_v):
    """Write ``value_k``/``value_v`` into every pool slot that is not a valid KV position."""
    q, k, v, pt, sl, cu = inp
    ps = k.shape[1]
    valid = torch.zeros(k.shape[0], ps, dtype=torch.bool)
    for b, lk in enumerate(kv_lens):
        pos = torch.arange(lk)
        valid[pt[b].long()[pos // ps], pos % ps] = True
    k, v = k.clone(), v.clone()
    k[~valid] = value_k
    v[~valid] = value_v
    return (q, k, v, pt, sl, cu)


@pytest.mark.parametrize("value_k", [0.0, 30.0], ids=["logit0", "huge"])
def test_partial_last_block_padding_masked(value_k):
    """Lk = 130, B = 64, page_size 64: the last block has 2 valid keys and 62 pool slots of garbage.

    Valid keys have logits around -20, so a padded key given logit 0 (zero keys) or a large one
    would dominate the softmax; padded values are 1000 to make that visible.
    """
    q, k, v, pt, sl, cu = make_inputs([130], [130], hq=2, hkv=1, d=16, page_size=64, seed=9)
    q = q.abs() + 1.0
    k = -k.abs() * 1.5 - 1.0                               # τ q·k strongly negative for valid keys
    inp = _poison_padding((q, k, v, pt, sl, cu), [130], value_k, 1000.0)
    for config in (SPARSE64, SPARSE64.replace(alpha=0.0), SPARSE128):
        out, lse, index, _ = check_vs_brute(inp, config)
        assert out.abs().max() < 10.0                      # no 1000s leaked in
        # the mean of the partial block averages its 2 valid tokens only
        if config.block_size == 64:
            torch.testing.assert_close(index.v_mean[2, 0], inp[2][pt[0, 2].long(), :2, 0].mean(0))
    dout, dlse = R.dense_attention(*inp)
    ref_out, ref_lse, _ = brute_force(*inp, SPARSE64, dense=True)
    torch.testing.assert_close(dout, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(dlse, ref_lse, atol=1e-10, rtol=0)


def test_no_nan_tiny_and_empty_requests():
    """1-token requests, a 1-key request and a 0-token request: finite everywhere."""
    inp = make_inputs([1, 0, 3, 1], [1, 5, 3, 200], hq=7, hkv=1, d=16, page_size=16, seed=12)
    out, lse, index, plan = check_vs_brute(inp, SPARSE64)
    assert out.shape == (5, 7, 16)
    assert index.n_segments == plan.n_tiles == 3


def test_empty_segment_gives_zero_not_nan():
    """A row with no logit (only possible with a doctored index) gives out = 0, lse = -inf."""
    q, k, v, pt, sl, cu = make_inputs([300], [300], hq=1, hkv=1, d=16, page_size=16, seed=13)
    config = SPARSE64.replace(mean_correction=False)
    plan = make_plan(sl, cu, 1, 64)
    index = R.build_index(q, k, v, pt, sl, cu, config, None, plan)
    # empty segment 1 (rows 128..255)
    lo, hi = int(index.row_ptr[1]), int(index.row_ptr[2])
    col = torch.cat([index.col_idx[:lo], index.col_idx[hi:]])
    row_ptr = index.row_ptr.clone()
    row_ptr[2:] -= hi - lo
    from dataclasses import replace
    doctored = replace(index, row_ptr=row_ptr, col_idx=col)
    out, lse = R.sparse_attention(q, k, v, pt, sl, cu, config, None, plan, doctored)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[128:256] == 0).all() and torch.isneginf(lse[128:256]).all()
    assert torch.isfinite(lse[:128]).all() and torch.isfinite(lse[256:]).all()


def _explicit_causal(q, K, V, P, tau):
    """Dense attention with explicit positions: token t sees KV positions p <= P + t."""
    lq = q.shape[0]
    t = torch.arange(lq)[:, None]
    p = torch.arange(K.shape[0])[None, :]
    s = torch.einsum("thd,phd->htp", q, K) * tau
    s = s.masked_fill(~(p <= P + t), -math.inf)
    return torch.einsum("htp,phd->thd", torch.softmax(s, -1), V), torch.logsumexp(s, -1).T


def test_causal_bottom_right_alignment():
    lq, lk = 40, 170
    q, k, v, pt, sl, cu = make_inputs([lq], [lk], hq=3, hkv=3, d=16, page_size=16, seed=14)
    pos = torch.arange(lk)
    K = k[pt[0].long()[pos // 16], pos % 16]
    V = v[pt[0].long()[pos // 16], pos % 16]
    tau = 1 / 4
    want, want_lse = _explicit_causal(q, K, V, lk - lq, tau)
    top_left, _ = _explicit_causal(q, K, V, 0, tau)
    assert (want - top_left).abs().max() > 1e-2            # the test can tell the two apart
    out, lse = R.dense_attention(q, k, v, pt, sl, cu)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=0)
    # sparse with everything kept (α = 0) is the same
    sout, slse, _, _ = run_ref((q, k, v, pt, sl, cu), SPARSE64.replace(alpha=0.0))
    torch.testing.assert_close(sout, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(slse, want_lse, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------------------------
# Mean correction helps; CSR invariants


def test_mean_correction_reduces_error():
    """Structured keys (needles over a smooth background): pruned blocks carry mass; folding them
    back as mean keys brings the output and lse closer to dense attention."""
    inp = make_inputs([1500], [1500], hq=4, hkv=2, d=32, page_size=16, seed=21, structured=True)
    q, k, v, pt, sl, cu = inp
    dense, dense_lse = R.dense_attention(q, k, v, pt, sl, cu)
    errs = {}
    for mc in (True, False):
        config = SPARSE64.replace(mean_correction=mc)
        out, lse, index, plan = run_ref(inp, config)
        assert density(index) < 0.7
        errs[mc] = ((out - dense).norm() / dense.norm()).item(), (lse - dense_lse).abs().mean().item()
    assert errs[True][0] < errs[False][0]
    assert errs[True][1] < errs[False][1]


def test_csr_invariants_long_sparse():
    lq = lk = 2000
    g, hkv = 3, 2
    inp = make_inputs([lq, 130], [lk, 300], hq=g * hkv, hkv=hkv, d=32, page_size=16, seed=31, structured=True)
    config = SPARSE64
    _, _, index, plan = run_ref(inp, config)
    B = config.block_size
    row_ptr, col = index.row_ptr, index.col_idx
    assert row_ptr.dtype == col.dtype == index.n_visible.dtype == torch.int32
    assert row_ptr[0] == 0 and row_ptr[-1] == col.numel()
    counts = row_ptr[1:] - row_ptr[:-1]
    assert (counts >= 1).all()                                   # monotone, no empty segment
    assert index.n_segments == hkv * plan.n_tiles
    segs = csr_segments(index, plan)
    tile_ptr = index.tile_ptr.tolist()
    for (h, b, i), S in segs.items():
        seg = h * plan.n_tiles + tile_ptr[b] + i
        nvis = int(index.n_visible[seg])
        lq_b, lk_b = plan.q_lens[b], plan.kv_lens[b]
        P = lk_b - lq_b
        t_first = 128 * i // g
        t_last = (min(128 * i + 128, lq_b * g) - 1) // g
        assert nvis == (P + t_last) // B + 1
        assert all(x < y for x, y in zip(S, S[1:])) and S[-1] < nvis
        assert {j for j in range(nvis) if j * B < config.sink_tokens} <= set(S)             # sink
        win = range(max(0, P + t_first - config.window_tokens + 1) // B, nvis)
        assert set(win) <= set(S)                                                      # window
        if t_last >= lq_b - config.dense_tail_tokens:
            assert S == list(range(nvis))                                              # dense tail
    d = density(index)
    assert 0 < d < 0.6
    assert index.k_mean.shape == (int(index.block_ptr[-1]), hkv, 32)


def test_block_map_prints(capsys):
    R.main()
    text = capsys.readouterr().out
    assert "#" in text and "m" in text and "density" in text
