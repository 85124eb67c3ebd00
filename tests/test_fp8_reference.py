"""FP8 (e4m3) semantics of docs/fp8.md in the CPU reference: the quantisation rules
(``flashprefill.quant``) against the format's definition, the reference against the independent
float64 simulation of ``tests/fp_brute.py``, FP8 tracking the float64 attention within a budget
derived from the error of quantising the inputs alone, e4m3 caches with descales, and the API's
errors. Small shapes."""
from __future__ import annotations

import math

import pytest
import torch

import flashprefill
from fp8_reference_cases import (CASES, E4M3, SPARSE64, assert_dense_matches_brute_force,
                                 assert_sparse_matches_brute_force, f64, f64_index_with_selection, rel)
from fp_brute import brute_force, e4m3_round, make_inputs
from flashprefill import SparseConfig, api, make_plan, quant
from flashprefill.impl import reference as R

# FP8 may err by at most this multiple of the error of rounding Q, K, V alone to e4m3 (one scale per
# head), plus a floor of bf16 rounding: measured ratios were 0.96-1.13 (dense cases, d 64/128).
K_BUDGET = 1.5
FLOOR = 2e-3


def rounded_inputs(inp):
    """Q, K, V each rounded to e4m3 with one scale per head (plain torch casts, not flashprefill.quant)."""
    def rt(x, head_dim):
        dims = tuple(i for i in range(x.dim()) if i != head_dim)
        s = x.double().abs().amax(dim=dims, keepdim=True) / 448.0
        return (x.double() / s).to(E4M3).double() * s
    q, k, v, *rest = f64(inp)
    return (rt(q, 1), rt(k, 2), rt(v, 2), *rest)


def scaled(inp, mult):
    q, k, *rest = inp
    return ((q.float() * mult).to(q.dtype), (k.float() * mult).to(k.dtype), *rest)


# --------------------------------------------------------------------------------------------
# quant.py: the rules


def test_cast_is_round_to_nearest_even_and_saturates():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3).double()
    finite = codes[~codes.isnan()]
    assert float(finite.max()) == quant.E4M3_MAX
    mids = (finite.unique()[1:] + finite.unique()[:-1]) / 2           # every tie between neighbours
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-14, 10, (20000,), generator=gen))
    x = torch.cat([mids, wide, torch.tensor([500.0, -1e6, math.inf, 2.0 ** -10, 2.0 ** -10 * 1.01])]).float().double()
    got = quant.quantize(x, torch.tensor(1.0)).double()
    torch.testing.assert_close(got, e4m3_round(x), rtol=0, atol=0)
    assert float(got[-5]) == 448.0 and float(got[-4]) == -448.0 and float(got[-3]) == 448.0
    assert float(got[-2]) == 0.0 and float(got[-1]) == 2.0 ** -9         # the subnormal edge
    assert bool(quant.quantize(torch.tensor([math.nan]), torch.tensor(1.0)).float().isnan().all())


def test_scales_guard_zero_tiny_and_non_finite():
    s, inv = quant.amax_scales(torch.tensor([896.0, 0.0, 2.0 ** -110, 3.0, math.inf]))
    assert s.dtype == inv.dtype == torch.float32
    assert s.tolist()[:3] == [2.0, 1.0, 1.0] and inv.tolist()[:3] == [0.5, 1.0, 1.0]
    assert float(s[3]) == float(torch.tensor(3.0 / 448.0, dtype=torch.float32)) and float(inv[3]) == float(torch.tensor(448.0 / 3.0, dtype=torch.float32))
    assert math.isinf(float(s[4])) and float(inv[4]) == 0.0
    # zeros stay zeros; an inf group dequantises to NaN, never to a finite number
    assert torch.equal(quant.round_trip(torch.zeros(4), s[1], inv[1], torch.float32), torch.zeros(4))
    assert bool(quant.round_trip(torch.tensor([1.0, math.inf]), s[4], inv[4], torch.float32).isnan().all())
    # NaN entries do not set the scale (a GPU fmax reduction ignores them)
    assert float(quant.abs_max(torch.tensor([1.0, math.nan, -3.0]), (0,))) == 3.0


def test_scales_are_correctly_rounded_quotients():
    """``scale = float32(amax / 448)`` and ``inv_scale = float32(448 / amax)`` rounded once to nearest
    (docs/fp8.md section 2), checked against float64 quotients for amax over 60 binades. A float32
    ``amax / 448.0`` (PyTorch: a multiply by the rounded reciprocal) and ``448.0 / amax``
    (``reciprocal(amax) * 448``) miss the correctly rounded value by one ulp for some amax."""
    g = torch.Generator().manual_seed(0)
    mant = 1.0 + torch.rand(100_000, generator=g, dtype=torch.float64)
    expo = torch.randint(-30, 30, (100_000,), generator=g).double()
    amax = (mant * torch.exp2(expo)).float()
    s, inv = quant.amax_scales(amax)
    exact = amax.double()
    assert torch.equal(s, (exact / 448.0).float())
    assert torch.equal(inv, (448.0 / exact).float())


def test_kv_scales_per_head_over_all_positions():
    x = torch.randn(300, 3, 16, dtype=torch.bfloat16)
    x[0, 1, 5] = 1000.0                                                # an outlier in the prefix, head 1
    s, inv = quant.kv_scales(x)
    assert s.shape == (3,)
    assert float(s[1]) == pytest.approx(1000.0 / 448.0)
    for h in (0, 2):
        assert float(s[h]) == pytest.approx(float(x[:, h].float().abs().max()) / 448.0)
    # the largest magnitude of each head maps onto 448 exactly
    assert float(quant.quantize(x[0, 1, 5], inv[1]).float()) == 448.0


def test_p_factor_and_underflow_bound():
    p = torch.tensor([1.0, 2.0 ** -12, 2.0 ** -14, 2.0 ** -17, 2.0 ** -18, 2.0 ** -19])
    got = quant.p_round_trip(p) / quant.P_SCALE
    assert got.tolist() == [1.0, 2.0 ** -12, 2.0 ** -14, 2.0 ** -17, 0.0, 0.0]
    assert quant.P_SCALE == 2 ** quant.P_SCALE_LOG2 and quant.P_SCALE < quant.E4M3_MAX
    # without the factor everything below 2**-10 is lost
    assert (p[1:].to(E4M3).float() == 0).all()


# --------------------------------------------------------------------------------------------
# Reference against the independent float64 FP8 simulation


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,ps", CASES)
def test_reference_matches_fp8_brute_force(q_lens, kv_lens, hq, hkv, d, ps):
    inp, plan, index, out = assert_sparse_matches_brute_force("fp8", q_lens, kv_lens, hq, hkv, d, ps)
    # the FP8 result really differs from the exact one (the simulation is not a no-op)
    exact, _, _ = brute_force(*inp, SPARSE64)
    assert rel(out, exact) > 1e-3
    if q_lens == [300]:
        assert index.nnz < int(index.n_visible.sum())                     # really sparse


def test_dense_matches_fp8_brute_force_with_prefix():
    assert_dense_matches_brute_force("fp8")


def test_query_scale_is_per_tile():
    """An outlier query in tile 1 changes tile 1's rows only (one scale per 128-row tile)."""
    inp = make_inputs([200], [200], 2, 1, 64, 16, dtype=torch.float32, seed=5)   # rows 0..399: 4 tiles
    plan = make_plan(inp[4], inp[5], 2, 128)
    base, _ = R.dense_attention(*inp, None, plan, precision="fp8")
    q = inp[0].clone()
    q[100, 0] *= 50.0                                                  # packed row 200: tile 1 (rows 128..255)
    moved, _ = R.dense_attention(q, *inp[1:], None, plan, precision="fp8")
    assert torch.equal(moved[:64], base[:64])                          # tile 0 = tokens 0..63: unchanged
    assert torch.equal(moved[128:], base[128:])                        # tiles 2, 3: unchanged
    assert not torch.equal(moved[64:100], base[64:100])                # tile 1's other rows: new scale


def test_probability_factor_keeps_small_probabilities():
    """One dominant key with zero value and many keys 9 below it: their probabilities (~1.2e-4) are
    below e4m3's 2**-10 rounding edge, so without the factor the output collapses to zero."""
    lq, d = 256, 64
    gen = torch.Generator().manual_seed(6)
    q = torch.ones(lq, 1, d, dtype=torch.float64)
    k = 0.375 + 0.05 * torch.randn(lq, 1, 1, d, generator=gen, dtype=torch.float64)
    k[0] = 1.5                                                         # logit 8 * 1.5 = 12 vs ~3
    v = torch.randn(lq, 1, 1, d, generator=gen, dtype=torch.float64)
    v[0] = 0.0
    k, v = k.view(lq, 1, 1, d), v.view(lq, 1, 1, d)
    pt = torch.arange(lq, dtype=torch.int32)[None]
    sl, cu = torch.tensor([lq], dtype=torch.int32), torch.tensor([0, lq], dtype=torch.int32)
    inp = (q, k, v, pt, sl, cu)
    exact, _ = R.dense_attention(*inp)
    out, _ = R.dense_attention(*inp, precision="fp8")
    budget = K_BUDGET * rel(R.dense_attention(*rounded_inputs(inp))[0], exact) + FLOOR
    assert rel(out, exact) < budget
    with_factor, _, _ = brute_force(*inp, SparseConfig(), dense=True, precision="fp8")
    without, _, _ = brute_force(*inp, SparseConfig(), dense=True, precision="fp8", p_scale=1.0)
    torch.testing.assert_close(out, with_factor, atol=1e-10, rtol=0)
    assert rel(without, exact) > 0.9                                   # the small mass is gone


# --------------------------------------------------------------------------------------------
# FP8 tracks the exact attention (budget from the data)


TRACK = [  # (q_lens, kv_lens, hq, hkv, d, page_size)
    ([127], [127], 1, 1, 64, 1),
    ([128], [128], 3, 1, 128, 16),
    ([129], [129], 8, 1, 64, 64),
    ([96], [4095], 2, 1, 64, 16),
    ([96], [4096], 2, 1, 128, 64),
    ([96], [4097], 2, 1, 64, 1),
    ([100, 60], [300, 60], 6, 2, 64, 16),    # prefix, two requests
]


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,ps", TRACK)
def test_fp8_dense_tracks_exact(q_lens, kv_lens, hq, hkv, d, ps):
    inp = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, dtype=torch.bfloat16, seed=7)
    plan = make_plan(inp[4], inp[5], hq // hkv, 128)
    exact, exact_lse = R.dense_attention(*f64(inp), None, plan)
    out, lse = R.dense_attention(*inp, None, plan, precision="fp8")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    inputs_only = rel(R.dense_attention(*rounded_inputs(inp), None, plan)[0], exact)
    assert rel(out, exact) <= K_BUDGET * inputs_only + FLOOR
    assert (lse.double() - exact_lse).abs().max() < 0.5                # lse free of the P factor


def test_fp8_large_logits_stay_finite_and_track():
    inp = scaled(make_inputs([200], [330], 3, 1, 64, 16, dtype=torch.bfloat16, seed=8), 8.0)   # logits ~ +-64
    plan = make_plan(inp[4], inp[5], 3, 128)
    exact, _ = R.dense_attention(*f64(inp), None, plan)
    out, lse = R.dense_attention(*inp, None, plan, precision="fp8")
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    inputs_only = rel(R.dense_attention(*rounded_inputs(inp), None, plan)[0], exact)
    assert rel(out, exact) <= K_BUDGET * inputs_only + FLOOR


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,ps", [([300], [700], 3, 1, 64, 16), ([256], [600], 1, 1, 128, 1)])
def test_fp8_sparse_tracks_exact_same_selection(q_lens, kv_lens, hq, hkv, d, ps):
    inp = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, dtype=torch.bfloat16, structured=True, seed=9)
    plan = make_plan(inp[4], inp[5], hq // hkv, SPARSE64.block_size)
    index = R.build_index(*inp, SPARSE64, None, plan, precision="fp8")
    assert index.nnz < int(index.n_visible.sum())
    out, _ = R.sparse_attention(*inp, SPARSE64, None, plan, index, precision="fp8")
    # the same selection in float64: the error is the quantisation's alone
    index64 = f64_index_with_selection(inp, SPARSE64, plan, index)
    exact, _ = R.sparse_attention(*f64(inp), SPARSE64, None, plan, index64)
    rounded, _ = R.sparse_attention(*rounded_inputs(inp), SPARSE64, None, plan, index64)
    assert torch.isfinite(out).all()
    assert rel(out, exact) <= K_BUDGET * rel(rounded, exact) + FLOOR


# --------------------------------------------------------------------------------------------
# e4m3 caches with descales


def e4m3_pool(inp, per_request: bool):
    """The K / V pools as e4m3 codes: per (request, KV head) scales from flashprefill.quant, or one
    scalar scale. Returns (k8, v8, k_descale, v_descale)."""
    q, k, v, pt, sl, cu = inp
    ps = k.shape[1]
    out = []
    for cache in (k, v):
        codes = torch.zeros(cache.shape, dtype=E4M3)
        if not per_request:
            s, inv = quant.amax_scales(quant.abs_max(cache, (0, 1, 2, 3)))
            out.append((quant.quantize(cache, inv), s))
            continue
        scales = torch.zeros(sl.numel(), cache.shape[2])
        for b, lk in enumerate(sl.tolist()):
            pages = pt[b, :-(-lk // ps)].long()
            x = cache[pages].flatten(0, 1)[:lk]
            s, inv = quant.kv_scales(x)
            codes[pages] = quant.quantize(cache[pages], inv[:, None])
            scales[b] = s
        out.append((codes, scales))
    (k8, ks), (v8, vs) = out
    return k8, v8, ks, vs


def test_e4m3_cache_equals_internal_quantisation():
    inp = make_inputs([150, 90], [330, 90], 4, 2, 64, 16, dtype=torch.bfloat16, structured=True, seed=10)
    q, k, v, pt, sl, cu = inp
    k8, v8, ks, vs = e4m3_pool(inp, per_request=True)
    assert ks.shape == (2, 2) and ks.dtype == torch.float32
    plan = make_plan(sl, cu, 2, SPARSE64.block_size)
    out, lse, st = flashprefill.flashprefill_attention(*inp, SPARSE64, precision="fp8", plan=plan,
                                                       return_lse=True, return_stats=True)
    out8, lse8, st8 = flashprefill.flashprefill_attention(q, k8, v8, pt, sl, cu, SPARSE64, precision="fp8", plan=plan,
                                                          k_descale=ks, v_descale=vs, return_lse=True, return_stats=True)
    assert torch.equal(st.index.col_idx, st8.index.col_idx)
    # same codes and scales; the means differ only by K's own rounding (raw vs dequantised K)
    torch.testing.assert_close(out8.float(), out.float(), atol=0.03, rtol=0)
    dense, dlse = flashprefill.dense_attention(*inp, precision="fp8", return_lse=True)
    dense8, dlse8 = flashprefill.dense_attention(q, k8, v8, pt, sl, cu, precision="fp8", k_descale=ks, v_descale=vs,
                                                 return_lse=True)
    assert torch.equal(dense8, dense) and torch.equal(dlse8, dlse)    # no means: bit for bit


def test_e4m3_cache_fp8_matches_brute_force():
    inp = make_inputs([120], [260], 2, 1, 64, 16, seed=11)
    q, _, _, pt, sl, cu = inp
    k8, v8, ks, vs = e4m3_pool(inp, per_request=True)
    plan = make_plan(sl, cu, 2, SPARSE64.block_size)
    out, lse = R.sparse_attention(q, k8, v8, pt, sl, cu, SPARSE64, None, plan, precision="fp8",
                                  k_descale=ks, v_descale=vs)
    ref, ref_lse, _ = brute_force(q, k8, v8, pt, sl, cu, SPARSE64, precision="fp8", k_descale=ks, v_descale=vs)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)


def test_e4m3_cache_bf16_precision_is_the_dequantised_bf16_path():
    inp = make_inputs([100], [230], 3, 1, 64, 16, dtype=torch.float32, structured=True, seed=12)
    q, k, v, pt, sl, cu = inp
    k8, v8, ks, vs = e4m3_pool(inp, per_request=False)
    assert ks.dim() == 0
    got = flashprefill.flashprefill_attention(q, k8, v8, pt, sl, cu, SPARSE64, k_descale=ks, v_descale=vs)
    want = flashprefill.flashprefill_attention(q, k8.float() * ks, v8.float() * vs, pt, sl, cu, SPARSE64)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------------------------
# API: dispatch and bad input


@pytest.fixture
def inp():
    return make_inputs([40, 20], [70, 20], 2, 1, 64, 16, dtype=torch.bfloat16)


def test_auto_fp8_on_cpu_runs_the_reference(inp):
    plan = make_plan(inp[4], inp[5], 2, SPARSE64.block_size)
    got = flashprefill.flashprefill_attention(*inp, SPARSE64, plan=plan, precision="fp8")
    want, _ = R.sparse_attention(*inp, SPARSE64, None, plan, precision="fp8")
    assert torch.equal(got, want)
    assert not torch.equal(got, flashprefill.flashprefill_attention(*inp, SPARSE64, plan=plan))


def test_backend_choice_for_fp8():
    assert api._choose_backend("auto", "cuda", torch.bfloat16, 128, "fp8") == "triton"
    assert api._choose_backend("auto", "cuda", torch.float32, 96, "fp8") == "triton"   # refused there, never silent
    assert api._choose_backend("auto", "cpu", torch.bfloat16, 128, "fp8") == "reference"
    assert api._choose_backend("reference", "cuda", torch.bfloat16, 128, "fp8") == "reference"


def test_unknown_precision(inp):
    for fn in (flashprefill.flashprefill_attention, flashprefill.build_index, flashprefill.dense_attention):
        with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'fp8', 'int8qk'\), got 'fp16'"):
            fn(*inp, precision="fp16")


def test_triton_fp8_refusals(inp, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = make_inputs([10], [10], 2, 1, 48, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim d in \(64, 128, 256\), got q \[10, 2, 48\].*precision='bf16'"):
        flashprefill.build_index(*odd, precision="fp8", backend="triton")
    k8, v8, ks, vs = e4m3_pool(inp, per_request=False)
    with pytest.raises(ValueError, match="16-bit kernels do not read e4m3 caches; use precision='fp8'"):
        flashprefill.dense_attention(inp[0], k8, v8, *inp[3:], k_descale=ks, v_descale=vs, backend="triton")


def test_fp8_gpu_capability_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"'NVIDIA A100-SXM4-80GB'.*compute capability 8\.0; precision='bf16' runs"):
        api._check_fp8_gpu("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    api._check_fp8_gpu("cuda:0")                                         # Ada and newer: accepted


def test_e4m3_cache_errors(inp):
    q, k, v, pt, sl, cu = inp
    k8, v8, ks, vs = e4m3_pool(inp, per_request=True)
    with pytest.raises(ValueError, match=r"k_descale is required with float8_e4m3fn caches.*\[2, 1\]"):
        flashprefill.flashprefill_attention(q, k8, v8, pt, sl, cu, precision="fp8")
    with pytest.raises(ValueError, match=r"v_descale is required"):
        flashprefill.dense_attention(q, k8, v8, pt, sl, cu, k_descale=ks)
    with pytest.raises(ValueError, match=r"k_descale must be \(a float32 0-dim tensor or \[batch, Hkv\] = \[2, 1\]\), got shape \[3\]"):
        flashprefill.build_index(q, k8, v8, pt, sl, cu, k_descale=torch.ones(3), v_descale=vs)
    with pytest.raises(TypeError, match=r"v_descale must be float32.*float64"):
        flashprefill.build_index(q, k8, v8, pt, sl, cu, k_descale=ks, v_descale=vs.double())
    with pytest.raises(ValueError, match=r"k_descale applies to float8_e4m3fn caches only, got k_cache torch.bfloat16"):
        flashprefill.dense_attention(q, k, v, pt, sl, cu, k_descale=ks, v_descale=vs)
    with pytest.raises(TypeError, match=r"must have q's dtype .*float8_e4m3fn, both caches.*v_cache torch.bfloat16"):
        flashprefill.dense_attention(q, k8, v, pt, sl, cu, k_descale=ks, v_descale=vs)
