"""What the Triton backend's host side launches before the index's one host sync (``nnz``), under
``TRITON_INTERPRET=1``.

``host.attention`` (index + attention in one call, what ``flashprefill_attention`` without an
index runs): the expand writes the CSR into a buffer sized from the plan's host lengths, the
attention reads it, then the host waits. Checked: the order of the attention's launch and the
``nnz`` wait (the two calls ``build_index`` + ``sparse_attention`` wait first), the same output, LSE
and index as those two calls, bit for bit (``col_idx`` exactly ``nnz`` long), the buffer bound
``Hkv x plan.visible_blocks`` at least ``nnz``, and the public API on the same path.

The FP8 attention's operands (``host_fp8.Fp8Operands``, ``BlockIndex.fp8_operands``; docs/fp8.md
section 11): ``host.build_index`` at precision "fp8" / "int8qk" makes them before its sync,
``host.sparse_attention`` reads them instead of making its own (``host_fp8.prepare`` is not called
again) with the same output and LSE, bit for bit, as with an index that carries none, and makes its
own when they do not fit the launch (another ``mean_correction``, a selection bitmask replaced,
another kernel layout), then equal to an index built for that launch. Their K / V codes are
``host_fp8.kv_operands``' bit for bit. Without the means' fused amax (d 64) one K / V amax pass
serves the selection's K scale and the pre-pass.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

import pytest

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

ONE_CALL = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size, precision)
    "bf16_two_requests_g4_d64": ([70, 300], [900, 1500], 4, 1, 64, 16, 64, "bf16"),
    "fp8_one_request_g2_d128": ([260], [1300], 4, 2, 128, 16, 64, "fp8"),
}
PREPARED = {  # the same fields
    "fp8_two_requests_g4_d64": ([70, 300], [900, 1500], 4, 1, 64, 16, 64, "fp8"),
    "int8qk_one_request_g2_d128": ([260], [1300], 4, 2, 128, 16, 64, "int8qk"),
}


def _one_call_case(name):
    import dataclasses

    import torch

    import flashprefill
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config
    from flashprefill.plan import visible_blocks

    *shape, precision = ONE_CALL[name]
    c = fp8_case(*shape, seed=5, with_index=False)
    kernels = get_config(shape[4], torch.float16, shape[6], precision=precision)
    events = []
    real_queue, real_launch, real_launch8 = host._queue_nnz_copy, host.launch_attention, host_fp8.launch_attention_fp8

    def queue(row_ptr):
        wait = real_queue(row_ptr)

        def recorded():
            events.append("nnz wait")
            return wait()
        return recorded

    def launch(*a, **k):
        events.append("attention launch")
        return real_launch(*a, **k)

    def launch8(*a, **k):
        events.append("attention launch")
        return real_launch8(*a, **k)

    host._queue_nnz_copy, host.launch_attention, host_fp8.launch_attention_fp8 = queue, launch, launch8
    args = (c.q, c.k, c.v, c.pt, c.sl, c.cu, c.cfg, c.scale, c.plan)
    out_a, lse_a, idx_a = host.attention(*args, kernels=kernels, precision=precision)
    one_call = list(events)
    events.clear()
    idx_b = host.build_index(*args, kernels=kernels, precision=precision)
    out_b, lse_b = host.sparse_attention(*args, idx_b, kernels=kernels, precision=precision)
    two_calls = list(events)
    # a CSR bound above ONE_CALL_CSR_MAX_BYTES: the wait first, the same results
    events.clear()
    real_cap, host.ONE_CALL_CSR_MAX_BYTES = host.ONE_CALL_CSR_MAX_BYTES, 0
    out_c, lse_c, idx_c = host.attention(*args, kernels=kernels, precision=precision)
    host.ONE_CALL_CSR_MAX_BYTES = real_cap
    capped = list(events)
    host._queue_nnz_copy, host.launch_attention, host_fp8.launch_attention_fp8 = real_queue, real_launch, real_launch8
    # every tile dense: nnz reaches the bound exactly (an off-by-one in it would show)
    dense_cfg = dataclasses.replace(c.cfg, min_sparse_len=10**9)
    idx_d = host.attention(c.q, c.k, c.v, c.pt, c.sl, c.cu, dense_cfg, c.scale, c.plan, kernels=kernels,
                           precision=precision)[2]
    bound = c.k.shape[2] * sum(visible_blocks(c.plan))
    res = {"case": name, "one_call": one_call, "two_calls": two_calls,
           "pruned": int(idx_a.nnz) < int(idx_a.n_visible.sum()),
           "out_same": torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b),
           "finite": bool(torch.isfinite(out_a).all())}
    res["index_same"] = all(torch.equal(getattr(idx_a, f), getattr(idx_b, f))
                            for f in ("row_ptr", "col_idx", "n_visible", "k_mean", "v_mean", "sel_bits"))
    res["col_idx_is_nnz_long"] = idx_a.col_idx.numel() == int(idx_a.row_ptr[-1]) == idx_b.nnz
    res["bound_holds"] = bound >= idx_a.nnz and idx_d.nnz == bound
    res["capped_waits_first"] = capped == ["nnz wait", "attention launch"]
    res["capped_same"] = (torch.equal(out_c, out_a) and torch.equal(lse_c, lse_a)
                          and torch.equal(idx_c.col_idx, idx_a.col_idx))
    res["returned_without_operands"] = idx_a.fp8_operands is None and idx_c.fp8_operands is None
    api_out, api_index = flashprefill.flashprefill_attention(
        c.q, c.k, c.v, c.pt, c.sl, c.cu, c.cfg, c.scale, plan=c.plan, backend="triton", precision=precision,
        return_index=True)
    res["api_same"] = torch.equal(api_out, out_a) and torch.equal(api_index.col_idx, idx_a.col_idx)
    return res


def _prepared_case(name):
    import dataclasses

    import torch

    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton import quant_kernels as qk

    *shape, precision = PREPARED[name]
    c = fp8_case(*shape, seed=11, with_index=False)
    calls = []
    real_prepare = host_fp8.prepare

    def counting_prepare(*a, **k):
        calls.append(k.get("mean_correction"))
        return real_prepare(*a, **k)

    host_fp8.prepare = counting_prepare
    amax_calls = []
    real_amax = qk.kv_amax

    def counting_amax(*a, **k):
        amax_calls.append(1)
        return real_amax(*a, **k)

    qk.kv_amax = counting_amax
    args = (c.q, c.k, c.v, c.pt, c.sl, c.cu)
    kw = dict(kernels=c.kernels, precision=precision)
    index = host.build_index(*args, c.cfg, c.scale, c.plan, **kw)
    qk.kv_amax = real_amax
    ops = index.fp8_operands
    res = {"case": name, "attached": isinstance(ops, host_fp8.Fp8Operands), "made_by_index": list(calls),
           "pruned": int(index.nnz) < int(index.n_visible.sum()),
           # K / V amax passes over the caches: none with the means' fused amax, else one for the
           # selection's K scale that the pre-pass reuses (it ran a second one before)
           "fused_amax": bool(c.kernels.index.fused_amax), "amax_launches": len(amax_calls)}
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
    # other caches than the index was built on (an index reused for another layer): made again from
    # them, equal to an index without operands on those caches, and unlike the first caches' output
    k2, v2 = (c.k.float() * 0.5).half(), c.v.flip(0)
    calls.clear()
    other = host.sparse_attention(c.q, k2, v2, c.pt, c.sl, c.cu, c.cfg, c.scale, c.plan, index, **kw)
    res["other_caches_made_again"] = len(calls) == 1
    bare = host.sparse_attention(c.q, k2, v2, c.pt, c.sl, c.cu, c.cfg, c.scale, c.plan,
                                 dataclasses.replace(index, fp8_operands=None), **kw)
    res["other_caches_same"] = same(other, bare) and not torch.equal(other[0], used[0])
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


@pytest.mark.parametrize("name", list(ONE_CALL))
def test_the_attention_is_launched_before_the_nnz_wait(results, name):
    r = case_result(results, name)
    assert r["one_call"] == ["attention launch", "nnz wait"], r
    assert r["two_calls"] == ["nnz wait", "attention launch"], r


@pytest.mark.parametrize("name", list(ONE_CALL))
def test_one_call_equals_index_then_attention_bit_for_bit(results, name):
    r = case_result(results, name)
    assert r["pruned"] and r["finite"], r
    assert r["out_same"] and r["index_same"] and r["col_idx_is_nnz_long"], r
    assert r["bound_holds"] and r["api_same"], r
    assert r["returned_without_operands"], r


@pytest.mark.parametrize("name", list(ONE_CALL))
def test_a_csr_bound_above_the_cap_waits_first_with_the_same_results(results, name):
    r = case_result(results, name)
    assert r["capped_waits_first"] and r["capped_same"], r



@pytest.mark.parametrize("name", list(PREPARED))
def test_the_index_prepares_the_fp8_operands_the_attention_reads(results, name):
    r = case_result(results, name)
    assert r["pruned"], r                   # a selection with pruned blocks: the correction's codes matter
    assert r["attached"] and r["made_by_index"] == [True], r
    assert r["amax_launches"] == (0 if r["fused_amax"] else 1), r
    assert r["kv_codes_same"] and r["kv_scales_same"], r
    assert r["used_without_prepare"] and r["own_prepared_once"], r
    assert r["same_as_own"] and r["finite"], r


@pytest.mark.parametrize("name", list(PREPARED))
def test_operands_that_do_not_fit_the_launch_are_made_again(results, name):
    r = case_result(results, name)
    assert r["nomc_made_again"] and r["nomc_same"] and r["nomc_differs_from_mc"], r
    assert r["no_bits_made_again"], r
    assert r["other_caches_made_again"] and r["other_caches_same"], r
    assert r["layout_made_again"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases([*ONE_CALL, *PREPARED], lambda name: (_one_call_case if name in ONE_CALL else _prepared_case)(name))
