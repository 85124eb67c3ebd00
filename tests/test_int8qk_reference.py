"""Precision "int8qk" (docs/fp8.md section 10: Q·Kᵀ on int8, P·V on e4m3) in the CPU reference: the
int8 rules of ``flashprefill.quant`` against their definition (ties, clamp, signs, NaN, scales), the
reference against the independent float64 simulation of ``tests/fp_brute.py``, int8qk beating fp8 on
keys with a per-channel bias (as real activations have), and the API's errors. Small shapes."""
from __future__ import annotations

import math

import pytest
import torch

import flashprefill
from fp8_reference_cases import (CASES, SPARSE64, assert_dense_matches_brute_force,
                                 assert_sparse_matches_brute_force, f64, f64_index_with_selection, rel)
from fp_brute import make_inputs
from flashprefill import api, make_plan, quant
from flashprefill.impl import reference as R


# --------------------------------------------------------------------------------------------
# quant.py: the int8 rules


def test_int8_codes_ties_clamp_signs_nan():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 126.5, 127.4, 200.0, -1000.0, -0.0, float("nan")])
    want = [0, 2, 2, 0, -2, -2, 3, 126, 127, 127, -127, 0, 0]          # round half to even, clamp, NaN -> 0
    got = quant.quantize_int8(x, torch.tensor(1.0))
    assert got.dtype == torch.int8 and got.tolist() == want
    # one float32 multiply first: 2.54 * (127 / 2.54) is the group's amax -> exactly 127
    s, inv = quant.int8_scales(torch.tensor(2.54))
    assert quant.quantize_int8(torch.tensor([2.54, -2.54, 0.01]), inv).tolist() == [127, -127, 0]
    assert quant.round_trip_int8(torch.tensor([2.54]), s, inv, torch.float64).item() == 127 * float(s)


def test_int8_scales_are_correctly_rounded_with_the_fp8_floor():
    amax = torch.tensor([1e-3, 0.37, 2.54, 3.0, 1000.0, 65504.0])
    s, inv = quant.int8_scales(amax)
    for a, si, ii in zip(amax.tolist(), s.tolist(), inv.tolist()):
        assert si == float(torch.tensor(a / 127.0, dtype=torch.float32))     # float64 quotient, rounded once
        assert ii == float(torch.tensor(127.0 / a, dtype=torch.float32))
    s, inv = quant.int8_scales(torch.tensor([0.0, 2.0 ** -101, float("inf")]))
    assert s.tolist()[:2] == [1.0, 1.0] and inv.tolist()[:2] == [1.0, 1.0]   # zero / tiny groups: scale 1
    assert s[2] == math.inf and inv[2] == 0.0                               # inf group: dequantises to NaN
    assert torch.isnan(quant.round_trip_int8(torch.tensor([1.0, float("inf")]), s[2], inv[2], torch.float32)).all()


def test_int8_q_tiles_use_the_whole_tile_amax():
    # GQA 2, 100 tokens -> 200 packed rows = two tiles of 128; the second tile's amax is 10x smaller
    q = torch.randn(100, 2, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q[64:] *= 0.1
    tiles = R._fp8_q_tiles(q, 1, 2, 128, torch.float64, int8=True)            # [1, 2, 128, 64]
    for i in range(2):
        t = tiles[0, i]
        amax = q.view(100, 1, 2, 64).permute(1, 0, 2, 3).reshape(200, 64)[128 * i:128 * i + 128].abs().max()
        s = float(torch.tensor(float(amax) / 127.0, dtype=torch.float32))
        codes = t / s
        assert torch.equal(codes, codes.round()) and codes.abs().max() == 127   # integer codes, amax -> 127


# --------------------------------------------------------------------------------------------
# reference vs the float64 brute force


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,ps", CASES)
def test_reference_matches_int8qk_brute_force(q_lens, kv_lens, hq, hkv, d, ps):
    inp, plan, index, out = assert_sparse_matches_brute_force("int8qk", q_lens, kv_lens, hq, hkv, d, ps)
    fp8_out, _ = R.sparse_attention(*inp, SPARSE64, None, plan, index, precision="fp8")
    assert not torch.allclose(out, fp8_out, atol=1e-6)                    # really another operand type


def test_dense_matches_int8qk_brute_force_with_prefix():
    assert_dense_matches_brute_force("int8qk")


# --------------------------------------------------------------------------------------------
# accuracy: keys with a per-channel bias


def biased_inputs(q_lens, kv_lens, hq, hkv, d, ps, seed, gain=1.0):
    """bf16 inputs whose keys are ``bias + noise`` per (KV head, channel), the bias as large as the
    noise (SmolLM2's K: ``‖mean_t k‖ / ‖std_t k‖`` 0.7-1.3, docs/fp8.md section 9), queries with a
    component along the bias (real queries attend to it) and ``gain`` on both."""
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    bias = torch.randn(1, 1, hkv, d, generator=gen, dtype=torch.float64)
    k = k + bias
    q = q + 0.5 * bias.view(1, hkv, 1, d).expand(1, hkv, hq // hkv, d).reshape(1, hq, d)
    return ((q * gain).to(torch.bfloat16), (k * gain).to(torch.bfloat16), v.to(torch.bfloat16), pt, sl, cu)


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,ps,gain", [
    ([200], [330], 3, 1, 64, 16, 1.0),
    ([128, 60], [500, 60], 4, 2, 128, 64, 1.0),
    ([200], [330], 3, 1, 64, 16, 3.0),       # sharper attention: logits ~ +-20
])
def test_int8qk_closer_to_exact_than_fp8_on_biased_keys(q_lens, kv_lens, hq, hkv, d, ps, gain):
    inp = biased_inputs(q_lens, kv_lens, hq, hkv, d, ps, seed=11, gain=gain)
    plan = make_plan(inp[4], inp[5], hq // hkv, 128)
    exact, _ = R.dense_attention(*f64(inp), None, plan)
    out8, lse8 = R.dense_attention(*inp, None, plan, precision="fp8")
    outi, lsei = R.dense_attention(*inp, None, plan, precision="int8qk")
    assert torch.isfinite(outi).all() and torch.isfinite(lsei).all()
    e_fp8, e_int8 = rel(out8, exact), rel(outi, exact)
    assert e_int8 < 0.7 * e_fp8, (e_int8, e_fp8)


def test_int8qk_sparse_closer_to_exact_than_fp8_same_selection():
    inp = biased_inputs([300], [700], 3, 1, 64, 16, seed=12)
    cfg = SPARSE64.replace(alpha=0.95)                  # biased keys: block energies close together
    plan = make_plan(inp[4], inp[5], 3, cfg.block_size)
    index = R.build_index(*inp, cfg, None, plan, precision="int8qk")
    assert index.nnz < int(index.n_visible.sum())
    index64 = f64_index_with_selection(inp, cfg, plan, index)
    exact, _ = R.sparse_attention(*f64(inp), cfg, None, plan, index64)
    outi, lsei = R.sparse_attention(*inp, cfg, None, plan, index, precision="int8qk")
    out8, _ = R.sparse_attention(*inp, cfg, None, plan, index, precision="fp8")
    assert torch.isfinite(outi).all() and torch.isfinite(lsei).all()
    assert rel(outi, exact) < 0.7 * rel(out8, exact)


# --------------------------------------------------------------------------------------------
# API


@pytest.fixture
def inp():
    return make_inputs([40, 20], [70, 20], 2, 1, 64, 16, dtype=torch.bfloat16)


def test_auto_int8qk_on_cpu_runs_the_reference(inp):
    plan = make_plan(inp[4], inp[5], 2, SPARSE64.block_size)
    got = flashprefill.flashprefill_attention(*inp, SPARSE64, plan=plan, precision="int8qk")
    want, _ = R.sparse_attention(*inp, SPARSE64, None, plan, precision="int8qk")
    assert torch.equal(got, want)
    assert not torch.equal(got, flashprefill.flashprefill_attention(*inp, SPARSE64, plan=plan, precision="fp8"))


def test_backend_choice_for_int8qk():
    assert api._choose_backend("auto", "cuda", torch.bfloat16, 128, "int8qk") == "triton"
    assert api._choose_backend("auto", "cuda", torch.float32, 96, "int8qk") == "triton"   # refused there
    assert api._choose_backend("auto", "cpu", torch.bfloat16, 128, "int8qk") == "reference"


def test_e4m3_cache_with_int8qk_raises(inp):
    q, k, v, pt, sl, cu = inp
    s, inv = quant.amax_scales(quant.abs_max(k, (0, 1, 2, 3)))
    k8, v8 = quant.quantize(k, inv), quant.quantize(v, inv)
    msg = r"precision='int8qk' cannot read a float8_e4m3fn KV cache.*precision='fp8' reads e4m3 caches"
    for fn in (flashprefill.flashprefill_attention, flashprefill.build_index, flashprefill.dense_attention):
        for backend in ("auto", "reference"):
            with pytest.raises(ValueError, match=msg):
                fn(q, k8, v8, pt, sl, cu, precision="int8qk", k_descale=s, v_descale=s, backend=backend)
    with pytest.raises(ValueError, match="precision='fp8' reads e4m3 caches"):
        R.dense_attention(q, k8, v8, pt, sl, cu, precision="int8qk", k_descale=s, v_descale=s)


def test_triton_int8qk_refusals_name_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    odd = make_inputs([10], [10], 2, 1, 48, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"precision='int8qk' on the GPU needs head_dim d in \(64, 128, 256\)"):
        flashprefill.build_index(*odd, precision="int8qk", backend="triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"precision='int8qk' needs e4m3 tensor cores.*'NVIDIA A100-SXM4-80GB'"):
        api._check_fp8_gpu("cuda:0", "int8qk")
    with pytest.raises(ValueError, match=r"precision='int8qk'"):
        api.check_fp8_support("cuda:0", 128, "int8qk")


def test_cpu_bench_times_int8qk_next_to_fp8():
    from flashprefill.bench import format_table, run_operator_bench

    rows = run_operator_bench([512], 4, 2, 64, "bf16", fp8=True, int8qk=True, device="cpu", repeats=1,
                              baselines=False, progress=lambda s: None)
    row = rows[0]
    assert row["int8qk_total_ms"] > 0 and 0 < row["int8qk_density"] <= 1
    assert 0 < row["int8qk_rel_l2"] < 0.2 and row["int8qk_rel_l2"] != row["fp8_rel_l2"]
    assert "int8qk relL2" in format_table(rows)
