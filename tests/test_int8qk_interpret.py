"""Precision "int8qk" in the Triton kernels (``QK_INT8`` of the selection and of the FP8 attention,
``K_INT8`` of the pre-pass: docs/fp8.md section 10) under ``TRITON_INTERPRET=1``, against the CPU
reference's int8qk:

- the pre-pass: K codes int8 and their ``amax / 127`` scales bit for bit as ``quant.quantize_int8`` /
  ``quant.int8_scales`` over each request's K (ties included: K built on a half-step grid), V's e4m3
  codes and scales bit for bit the "fp8" pre-pass's;
- the selection (both the separate amax launch and ``fused_amax``): the reference int8qk index's
  CSR exactly, the same means;
- the attention (mean correction from the bitmask, sparse without it, dense; the plain kernel and
  the d-128 default fields): LSE within 1e-4 of the int8qk reference's (the logits and ``l`` are the
  same function of the same int8 codes; fp32 order only) and clearly off the fp8 reference's; the
  output as close to the int8qk reference as the "fp8" kernel's to its own reference (within
  ``OUT_FACTOR``). The interpreter's e4m3 cast of P truncates (Triton 3.6, docs/fp8.md section 7),
  so both kernels' outputs sit ~1.5x the method's error off their references here, the P V path
  being the same code for both; ``tests/gpu/test_int8qk.py`` holds the device budgets;
- the API path ``flashprefill_attention(..., backend="triton", precision="int8qk")`` end to end.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, results_fixture, run_cases

import pytest

CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size)
    "d64_B64_two_requests_g2_ps16": ([150, 9], [600, 40], 4, 2, 64, 16, 64),
    "d128_B64_g3_ps1": ([70], [330], 3, 1, 128, 1, 64),
}
MODES = {"bits": (True, True), "nomc": (True, False), "dense": (False, False)}   # (sparse, mean_correction)
# rel(int8qk kernel, int8qk reference) <= OUT_FACTOR * rel(fp8 kernel, fp8 reference) + FLOOR: two samples
# of the interpreter's truncated P (measured ratios 1.00-1.10)
OUT_FACTOR = 1.3
FLOOR = 0.005
LSE_TOL = 1e-4


def _run_case(name):
    import dataclasses

    import torch

    import flashprefill
    from fp_brute import make_inputs
    from flashprefill import SparseConfig, make_plan, quant
    from flashprefill.impl import reference as R
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    q_lens, kv_lens, hq, hkv, d, ps, B = CASES[name]
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, dtype=torch.float32, seed=5, structured=True)
    gen = torch.Generator().manual_seed(6)
    k = k + 0.5 * torch.randn(1, 1, hkv, d, generator=gen)              # a per-channel K bias
    # K on a 1/32 grid with amax 127/16 per (request, KV head): scale 1/16, 127/amax = 16 exactly,
    # so every odd multiple of 1/32 is an exact .5 tie of the int8 rounding
    k = torch.clamp(torch.round(k * 32) / 32, -127 / 16, 127 / 16)
    k[:, 0, :, 0] = 127 / 16
    q, k, v = q.half(), k.half(), v.half()
    cfg = SparseConfig(block_size=B, sink_tokens=B, window_tokens=B, dense_tail_tokens=1, alpha=0.3)
    scale = d ** -0.5
    plan = make_plan(sl, cu, hq // hkv, B)
    plain = get_config(d, torch.float16, B, precision="int8qk", variant="plain")
    default = get_config(d, torch.float16, B, precision="int8qk")
    res = {"case": name}

    # --- pre-pass
    kv = host_fp8.kv_operands(k, v, pt, sl, plan, k_int8=True)
    kv8 = host_fp8.kv_operands(k, v, pt, sl, plan)
    ok_codes = kv.k8.dtype == torch.int8
    ties = 0
    for b, lk in enumerate(plan.kv_lens):
        x = R._gather_kv(k, pt, b, lk)                                   # [Lk, Hkv, d]
        s, inv = quant.int8_scales(quant.abs_max(x, (0, 2)))
        ok_codes &= torch.equal(kv.k_scale[b], s) and torch.equal(kv.k_inv_scale[b], inv)
        want = quant.quantize_int8(x, inv[:, None]).permute(1, 0, 2)
        start = int(kv.cu_seqlens_k[b])
        ok_codes &= torch.equal(kv.k8[:, start:start + lk], want)
        y = x.float() * inv[:, None]
        ties += int(((y - y.floor()) == 0.5).sum())
    res["k_codes_exact"] = bool(ok_codes)
    res["ties"] = ties
    res["v_as_fp8"] = (torch.equal(kv.v8t.view(torch.uint8), kv8.v8t.view(torch.uint8))
                       and torch.equal(kv.v_scale, kv8.v_scale))

    # --- selection
    want_index = R.build_index(q, k, v, pt, sl, cu, cfg, scale, plan, precision="int8qk")
    fp8_index = R.build_index(q, k, v, pt, sl, cu, cfg, scale, plan, precision="fp8")
    res["pruned"] = int(want_index.nnz) < int(want_index.n_visible.sum())
    for label, kcfg in (("separate", plain), ("fused", dataclasses.replace(
            plain, index=dataclasses.replace(plain.index, fused_amax=True)))):
        got = host.build_index(q, k, v, pt, sl, cu, cfg, scale, plan, kernels=kcfg, precision="int8qk")
        res[f"selection_{label}"] = (torch.equal(got.row_ptr, want_index.row_ptr)
                                     and torch.equal(got.col_idx, want_index.col_idx))
        res[f"means_{label}"] = bool(torch.allclose(got.k_mean, want_index.k_mean, rtol=1e-5, atol=1e-6))
        if label == "fused":
            kv_f = host_fp8.kv_operands(k, v, pt, sl, plan, amax=got.kv_amax, k_int8=True)
            res["fused_prepass_equal"] = (torch.equal(kv_f.k8, kv.k8) and torch.equal(kv_f.k_scale, kv.k_scale)
                                          and torch.equal(kv_f.v8t.view(torch.uint8), kv.v8t.view(torch.uint8)))
    res["differs_from_fp8_selection"] = not (torch.equal(fp8_index.row_ptr, want_index.row_ptr)
                                             and torch.equal(fp8_index.col_idx, want_index.col_idx))

    # --- attention, under the reference's int8qk selection
    for mode, (sparse, mc) in MODES.items():
        c = dataclasses.replace(cfg, mean_correction=mc)
        if sparse:
            want, want_lse = R.sparse_attention(q, k, v, pt, sl, cu, c, scale, plan, want_index, precision="int8qk")
            want16, _ = R.sparse_attention(q, k, v, pt, sl, cu, c, scale, plan, want_index)
        else:
            want, want_lse = R.dense_attention(q, k, v, pt, sl, cu, scale, plan, precision="int8qk")
            want16, _ = R.dense_attention(q, k, v, pt, sl, cu, scale, plan)
        if sparse:
            want8, want8_lse = R.sparse_attention(q, k, v, pt, sl, cu, c, scale, plan, want_index, precision="fp8")
        else:
            want8, want8_lse = R.dense_attention(q, k, v, pt, sl, cu, scale, plan, precision="fp8")
        out8, _ = host_fp8.launch_attention_fp8(q, kv8, sl, cu, scale, plan, plain.attn, sparse=sparse,
                                                mean_correction=mc, block_size=B, index=want_index)
        fp8_gap = rel(out8, want8)
        for label, kcfg in (("plain", plain), ("default", default)):
            out, lse = host_fp8.launch_attention_fp8(q, kv, sl, cu, scale, plan, kcfg.attn, sparse=sparse,
                                                     mean_correction=mc, block_size=B, index=want_index)
            key = f"{mode}_{label}"
            res[f"{key}_finite"] = bool(torch.isfinite(out).all() and torch.isfinite(lse).all())
            res[f"{key}_out"] = [rel(out, want), OUT_FACTOR * fp8_gap + FLOOR, rel(want, want16)]
            res[f"{key}_lse"] = float((lse.double() - want_lse.double()).abs().max())
            res[f"{key}_lse_vs_fp8"] = float((lse.double() - want8_lse.double()).abs().max())

    # --- the API, end to end (Triton index and attention)
    out, index = flashprefill.flashprefill_attention(q, k, v, pt, sl, cu, cfg, scale, plan=plan, backend="triton",
                                                     precision="int8qk", return_index=True)
    want, _ = R.sparse_attention(q, k, v, pt, sl, cu, cfg, scale, plan, index, precision="int8qk")
    out8 = flashprefill.flashprefill_attention(q, k, v, pt, sl, cu, cfg, scale, plan=plan, backend="triton",
                                               precision="fp8", index=index)
    want8, _ = R.sparse_attention(q, k, v, pt, sl, cu, cfg, scale, plan, index, precision="fp8")
    res["api"] = [rel(out, want), OUT_FACTOR * rel(out8, want8) + FLOOR]
    return res


results = results_fixture(__file__, timeout_s=1200)


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8qk_prepass_codes_exact(results, name):
    r = case_result(results, name)
    assert r["ties"] > 0, "the case must contain exact rounding ties"
    assert r["k_codes_exact"] and r["v_as_fp8"], r
    assert r["fused_prepass_equal"], r


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8qk_selection_equals_reference(results, name):
    r = case_result(results, name)
    assert r["pruned"], "the case must prune blocks"
    assert r["selection_separate"] and r["selection_fused"], r
    assert r["means_separate"] and r["means_fused"], r


@pytest.mark.parametrize("label", ["plain", "default"])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(CASES))
def test_int8qk_attention_tracks_reference(results, name, mode, label):
    r = case_result(results, name)
    key = f"{mode}_{label}"
    assert r[f"{key}_finite"], r
    got, budget, _ = r[f"{key}_out"]
    assert got <= budget, (key, got, budget)
    assert r[f"{key}_lse"] < LSE_TOL, (key, r[f"{key}_lse"])
    assert r[f"{key}_lse_vs_fp8"] > 10 * LSE_TOL, (key, r[f"{key}_lse_vs_fp8"])   # really the int8 logits


@pytest.mark.parametrize("name", sorted(CASES))
def test_int8qk_api_end_to_end(results, name):
    r = case_result(results, name)
    got, budget = r["api"]
    assert got <= budget, (got, budget)


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
