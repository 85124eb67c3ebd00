"""The FP8 pre-pass kernels (``impl/triton/quant_kernels.py``) under ``TRITON_INTERPRET=1`` vs
``flashprefill.quant``, bit for bit (codes and scales), through the page table.

As in ``test_triton_interpret.py`` the kernels run in one subprocess (this file with ``--worker``)
that switches the interpreter on before Triton compiles anything. Triton 3.6's interpreter casts to
float8 without rounding to nearest or saturating; the kernel rounds in fp32 first (``_e4m3_rne``),
so only exactly representable values reach the cast, and this test checks the rounding itself
(``edge`` cases: every tie, -0, the saturation edge). fp16 caches (the interpreter holds bf16 as raw
bits); NaN inputs are not run here (the interpreter's cast maps NaN to a finite code)."""
from __future__ import annotations

import sys

from interpret_harness import case_result, results_fixture, run_cases

import pytest


CASES = {  # name: (q_lens, kv_lens, Hkv, d, page_size, edge values)
    "two_requests_ps16": ([50, 7], [200, 70], 2, 64, 16, False),
    "ps1_d128_len129": ([3], [129], 1, 128, 1, False),
    "ps64_len4097": ([1], [4097], 1, 64, 64, False),
    "edge_ties_ps16": ([10], [160], 2, 64, 16, True),
}


def _run_case(name):
    import torch

    from fp_brute import edge_cache, expected_prepass, make_inputs
    from flashprefill import make_plan
    from flashprefill.impl import reference as R
    from flashprefill.impl.triton import quant_kernels as QK

    q_lens, kv_lens, hkv, d, ps, edge = CASES[name]
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, 2 * hkv, hkv, d, ps, dtype=torch.float16, seed=1)
    if edge:
        k = edge_cache(ps, hkv, d, k.shape[0], seed=2)
        v = edge_cache(ps, hkv, d, k.shape[0], seed=3)
        q = q.float()
    plan = make_plan(sl, cu, 2, 128)
    index = R.build_index(q, k, v, pt, sl, cu, None, None, plan)
    # the pre-pass buffers are torch.empty: filled with 0xFF bytes (an e4m3 NaN) here, so a slot the
    # kernel leaves unwritten (a zero gap) differs from the expected zero code
    empty = torch.empty

    def dirty_empty(*a, **kw):
        t = empty(*a, **kw)
        t.view(torch.uint8).fill_(255)
        return t

    QK.torch.empty = dirty_empty
    try:
        kv = QK.quantize_kv(k, v, pt, sl, plan)
        kvp = QK.quantize_kv(k, v, pt, sl, plan, v_perm=True)      # V in the Gluon kernel's wgmma order
    finally:
        QK.torch.empty = empty
    k8m, v8mt, _ = QK.quantize_means(index.k_mean, index.v_mean, kv, plan)
    want = expected_prepass(k, v, pt, plan.kv_lens, 128, index.k_mean, index.v_mean)
    nb = index.k_mean.shape[0]
    bits = lambda t: t.contiguous().view(torch.uint8)
    return {
        "case": name,
        "k8": torch.equal(bits(kv.k8), bits(want["k8"])),
        "v8t": torch.equal(bits(kv.v8t), bits(want["v8t"])) and kv.v8t.shape[2] % QK.TMA_ALIGN == 0,
        "scales": torch.equal(kv.k_scale, want["k_scale"]) and torch.equal(kv.v_scale, want["v_scale"]),
        "means": torch.equal(bits(k8m), bits(want["k_mean8"])) and torch.equal(bits(v8mt[:, :, :nb]), bits(want["v_mean8t"])),
        "cu": kv.cu_seqlens_k.tolist() == want["cu_seqlens_k"],
        "saturated": bool((kv.k8.float().abs() == 448).any()),
        # slot wgmma_slot(p) of the permuted V holds what slot p of the token-ordered one does
        "v8t_wgmma_order": kvp.v_perm and torch.equal(bits(kvp.k8), bits(kv.k8))
        and torch.equal(bits(kvp.v8t)[:, :, QK.wgmma_slot(torch.arange(kv.v8t.shape[2]))], bits(want["v8t"])),
    }


results = results_fixture(__file__, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
def test_prepass_matches_quant_bit_for_bit(results, name):
    r = case_result(results, name)
    for key in ("k8", "v8t", "scales", "means", "cu", "saturated", "v8t_wgmma_order"):
        assert r[key], f"{name}: {key}"


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case, patch_range=False)
