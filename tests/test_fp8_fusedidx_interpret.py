"""The FP8 index with the K / V amax fused into the block-means kernels (``IndexConfig.fused_amax``)
under ``TRITON_INTERPRET=1``, against the shipped FP8 index (the separate ``_kv_amax_kernel`` launch
in the selection and again in the pre-pass): the same scales bit for bit (``BlockIndex.kv_amax``
through ``quant.amax_scales`` vs ``quant_kernels.kv_amax_scales``), the same selection and means,
the same pre-pass buffers and the same attention output and LSE. Cases: two requests of unequal
lengths (one shorter than a block), page sizes 1 and 16, ``g`` 1 and 4, K and V of different
ranges (the two amax slots must not mix).

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

import pytest


CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size)
    "d64_B64_two_requests_ps16": ([300, 9], [1500, 40], 2, 2, 64, 16, 64),
    "d128_B64_g4_ps1": ([40], [500], 4, 1, 128, 1, 64),
}


def _run_case(name):
    import dataclasses

    import torch

    from flashprefill import quant
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton import host_fp8
    from flashprefill.impl.triton import quant_kernels as QK

    hkv = CASES[name][3]
    c = fp8_case(*CASES[name], seed=11, v_factor=3.0, with_index=False)  # V's amax well above K's
    q, k, v, pt, sl, cu, cfg, scale, plan = c.q, c.k, c.v, c.pt, c.sl, c.cu, c.cfg, c.scale, c.plan
    base = c.kernels
    fused = dataclasses.replace(base, index=dataclasses.replace(base.index, fused_amax=True))
    i0 = host.build_index(q, k, v, pt, sl, cu, cfg, scale, plan, kernels=base, precision="fp8")
    i1 = host.build_index(q, k, v, pt, sl, cu, cfg, scale, plan, kernels=fused, precision="fp8")
    bits = lambda t: t.contiguous().view(torch.uint8)
    want_scale, want_inv = QK.kv_amax_scales(k, v, pt, sl, plan)
    got_scale, got_inv = quant.amax_scales(i1.kv_amax)
    res = {"case": name, "unfused_no_amax": i0.kv_amax is None,
           "amax_shape": list(i1.kv_amax.shape) == [2, plan.batch, hkv],
           "k_v_amax_differ": bool((i1.kv_amax[0] != i1.kv_amax[1]).all()),
           "scales_equal": torch.equal(got_scale, want_scale) and torch.equal(got_inv, want_inv),
           "selection_equal": torch.equal(i0.row_ptr, i1.row_ptr) and torch.equal(i0.col_idx, i1.col_idx),
           "pruned": int(i1.nnz) < int(i1.n_visible.sum()),
           "means_equal": torch.equal(i0.k_mean, i1.k_mean) and torch.equal(i0.v_mean, i1.v_mean)}
    kv0 = host_fp8.kv_operands(k, v, pt, sl, plan)
    kv1 = host_fp8.kv_operands(k, v, pt, sl, plan, amax=i1.kv_amax)
    res["prepass_equal"] = (torch.equal(bits(kv0.k8), bits(kv1.k8)) and torch.equal(bits(kv0.v8t), bits(kv1.v8t))
                            and torch.equal(kv0.k_scale, kv1.k_scale) and torch.equal(kv0.v_scale, kv1.v_scale))
    o0, l0 = host.sparse_attention(q, k, v, pt, sl, cu, cfg, scale, plan, i0, kernels=base, precision="fp8")
    o1, l1 = host.sparse_attention(q, k, v, pt, sl, cu, cfg, scale, plan, i1, kernels=fused, precision="fp8")
    res["finite"] = bool(torch.isfinite(o1).all())
    res["out_equal"] = torch.equal(o0, o1) and torch.equal(l0, l1)
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_amax_same_scales_and_index(results, name):
    r = case_result(results, name)
    assert r["unfused_no_amax"] and r["amax_shape"] and r["k_v_amax_differ"], r
    assert r["scales_equal"], r
    assert r["selection_equal"] and r["pruned"] and r["means_equal"], r


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_amax_same_prepass_and_output(results, name):
    r = case_result(results, name)
    assert r["prepass_equal"], r
    assert r["finite"] and r["out_equal"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
