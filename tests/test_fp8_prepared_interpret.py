"""The FP8 attention's operands made by the Triton index before its ``nnz`` sync
(``host_fp8.Fp8Operands``, ``BlockIndex.fp8_operands``; docs/fp8.md section 7) under
``TRITON_INTERPRET=1``: ``host.build_index`` at precision "fp8" / "int8qk" attaches them,
``host.sparse_attention`` reads them instead of making its own (``host_fp8.prepare`` is not called
again) and gives the same output and LSE, bit for bit, as with an index that carries none; it makes
its own when they do not fit the launch (another ``mean_correction``, a selection bitmask replaced,
another kernel layout) and then equals an index built for that launch. The operands' K / V codes are
``host_fp8.kv_operands``' bit for bit.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

import pytest

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size, precision)
    "fp8_two_requests_g4_d64": ([70, 300], [900, 1500], 4, 1, 64, 16, 64, "fp8"),
    "int8qk_one_request_g2_d128": ([260], [1300], 4, 2, 128, 16, 64, "int8qk"),
}


def _run_case(name):
    import dataclasses

    import torch

    from flashprefill.impl.triton import host, host_fp8

    *shape, precision = CASES[name]
    c = fp8_case(*shape, seed=11, with_index=False)
    calls = []
    real_prepare = host_fp8.prepare

    def counting_prepare(*a, **k):
        calls.append(k.get("mean_correction"))
        return real_prepare(*a, **k)

    host_fp8.prepare = counting_prepare
    args = (c.q, c.k, c.v, c.pt, c.sl, c.cu)
    kw = dict(kernels=c.kernels, precision=precision)
    index = host.build_index(*args, c.cfg, c.scale, c.plan, **kw)
    ops = index.fp8_operands
    res = {"case": name, "attached": isinstance(ops, host_fp8.Fp8Operands), "made_by_index": list(calls),
           "pruned": int(index.nnz) < int(index.n_visible.sum())}
    kv = host_fp8.kv_operands(c.k, c.v, c.pt, c.sl, c.plan, amax=index.kv_amax, k_int8=precision == "int8qk")
    res["kv_codes_same"] = all(torch.equal(getattr(ops.kv, f).view(torch.uint8), getattr(kv, f).view(torch.uint8))
                               for f in ("k8", "v8t"))
    res["kv_scales_same"] = torch.equal(ops.kv.k_scale, kv.k_scale) and torch.equal(ops.kv.v_scale, kv.v_scale)

    def attend(idx, cfg=c.cfg):
        calls.clear()
        out, lse = host.sparse_attention(*args, cfg, c.scale, c.plan, idx, **kw)
        return out, lse, len(calls)

    def same(a, b):
        return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    used = attend(index)
    own = attend(dataclasses.replace(index, fp8_operands=None))
    res["used_without_prepare"] = used[2] == 0
    res["own_prepared_once"] = own[2] == 1
    res["same_as_own"] = same(used, own)
    res["finite"] = bool(torch.isfinite(used[0]).all())
    # another mean_correction than the index was built for: made again, equal to a matching index's
    nomc = dataclasses.replace(c.cfg, mean_correction=False)
    mismatched = attend(index, nomc)
    matching = attend(host.build_index(*args, nomc, c.scale, c.plan, **kw), nomc)
    res["nomc_made_again"] = mismatched[2] == 1 and matching[2] == 0
    res["nomc_same"] = same(mismatched, matching)
    res["nomc_differs_from_mc"] = not torch.equal(mismatched[0], used[0])
    # the selection bitmask replaced (a BlockIndex with another CSR sets sel_bits None): made again
    rebuilt = attend(dataclasses.replace(index, sel_bits=None))
    res["no_bits_made_again"] = rebuilt[2] == 1 and same(rebuilt, used)
    # another kernel layout (mean_vec: aligned V-mean columns): made again, the same numbers
    aligned = dataclasses.replace(c.kernels, attn=dataclasses.replace(c.kernels.attn, mean_vec=True))
    calls.clear()
    out_al, lse_al = host.sparse_attention(*args, c.cfg, c.scale, c.plan, index, kernels=aligned, precision=precision)
    res["layout_made_again"] = len(calls) == 1 and torch.equal(out_al, used[0]) and torch.equal(lse_al, used[1])
    host_fp8.prepare = real_prepare
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_the_index_prepares_the_fp8_operands_the_attention_reads(results, name):
    r = case_result(results, name)
    assert r["pruned"], r                   # a selection with pruned blocks: the correction's codes matter
    assert r["attached"] and r["made_by_index"] == [True], r
    assert r["kv_codes_same"] and r["kv_scales_same"], r
    assert r["used_without_prepare"] and r["own_prepared_once"], r
    assert r["same_as_own"] and r["finite"], r


@pytest.mark.parametrize("name", list(CASES))
def test_operands_that_do_not_fit_the_launch_are_made_again(results, name):
    r = case_result(results, name)
    assert r["nomc_made_again"] and r["nomc_same"] and r["nomc_differs_from_mc"], r
    assert r["no_bits_made_again"], r
    assert r["layout_made_again"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
