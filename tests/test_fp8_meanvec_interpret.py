"""The FP8 attention kernel's aligned V-mean columns (``AttnConfig.mean_vec``,
``quant_kernels.mean_columns``) under ``TRITON_INTERPRET=1``: the layout itself (each request's
first column a multiple of ``TMA_ALIGN``, the codes those of the unaligned layout, zero gaps), and
the kernel with ``mean_vec`` against the shipped kernel: bit for bit (the extra columns it loads
carry ``p = 0`` against finite codes, adding exact zeros), alone and with ``pipeline`` +
``fold_scale``. Cases: two and three requests whose block counts are not multiples of 16, candidate
chunks that straddle a request's 16-column group, ``g`` 1 and 4, d 64 and 128.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

import pytest


CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size)
    "d64_B64_two_requests": ([70, 300], [900, 1500], 2, 2, 64, 16, 64),
    "d128_B64_three_requests_g4": ([40, 9, 130], [1100, 9, 2200], 4, 1, 128, 16, 64),
}
PAIRS = {  # name: (AttnConfig fields of the variant, of the kernel it must equal bit for bit)
    "meanvec": (dict(mean_vec=True), {}),
    "pipe_fold_meanvec": (dict(mean_vec=True, pipeline=True, fold_scale=True), dict(pipeline=True, fold_scale=True)),
}


def _run_case(name):
    import dataclasses

    import torch

    from flashprefill.impl.triton import host_fp8
    from flashprefill.impl.triton import quant_kernels as QK

    B = CASES[name][-1]
    c = fp8_case(*CASES[name], seed=7)
    index, kv, plan = c.index, c.kv, c.plan
    res = {"case": name, "pruned": int(index.nnz) < int(index.n_visible.sum())}
    # the layout
    k8a, v8a, cu_a = QK.quantize_means(index.k_mean, index.v_mean, kv, plan, aligned=True)
    k8u, v8u, cu_u = QK.quantize_means(index.k_mean, index.v_mean, kv, plan)
    cols, cu_cols, n_cols = QK.mean_columns(plan, "cpu")
    bp = plan.block_ptr.tolist()
    res["starts_aligned"] = all(c % QK.TMA_ALIGN == 0 for c in cu_a.tolist()) and n_cols == v8a.shape[2]
    res["some_start_moved"] = cu_a.tolist() != bp
    res["unaligned_cols_are_block_ptr"] = cu_u.tolist() == bp
    res["k_codes_same"] = torch.equal(k8a.view(torch.uint8), k8u.view(torch.uint8))
    res["v_codes_same"] = all(
        torch.equal(v8a.view(torch.uint8)[:, :, cu_a[b]:cu_a[b] + bp[b + 1] - bp[b]],
                    v8u.view(torch.uint8)[:, :, bp[b]:bp[b + 1]]) for b in range(plan.batch))
    gap = torch.ones(n_cols, dtype=torch.bool)
    gap[cols] = False
    res["gaps_zero"] = bool((v8a.view(torch.uint8)[:, :, gap] == 0).all())
    res["gap_count"] = int(gap.sum())
    # the kernel
    for pname, (fields, other) in PAIRS.items():
        o1, l1 = host_fp8.launch_attention_fp8(c.q, kv, c.sl, c.cu, c.scale, plan,
                                               dataclasses.replace(c.attn, **fields),
                                               sparse=True, mean_correction=True, block_size=B, index=index)
        o2, l2 = host_fp8.launch_attention_fp8(c.q, kv, c.sl, c.cu, c.scale, plan,
                                               dataclasses.replace(c.attn, **other),
                                               sparse=True, mean_correction=True, block_size=B, index=index)
        res[f"{pname}_finite"] = bool(torch.isfinite(o1).all())
        res[f"{pname}_out_equal"] = torch.equal(o1, o2)
        res[f"{pname}_lse_equal"] = torch.equal(l1, l2)
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("name", sorted(CASES))
def test_aligned_mean_columns(results, name):
    r = case_result(results, name)
    assert r["starts_aligned"] and r["some_start_moved"] and r["unaligned_cols_are_block_ptr"], r
    assert r["k_codes_same"] and r["v_codes_same"], r
    assert r["gaps_zero"] and r["gap_count"] > 0, r


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_mean_vec_bit_identical(results, name, pair):
    r = case_result(results, name)
    assert r["pruned"], "the case must prune blocks (the correction loop runs)"
    assert r[f"{pair}_finite"], r
    assert r[f"{pair}_out_equal"] and r[f"{pair}_lse_equal"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
