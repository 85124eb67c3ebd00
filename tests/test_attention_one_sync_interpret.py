"""``host.attention`` (index + attention in one call, what ``flashprefill_attention`` without an
index runs on the Triton backend) launches the attention before the index's one host sync
(``nnz``): the expand writes the CSR into a buffer sized from the plan's host lengths, the attention
reads it, then the host waits. Under ``TRITON_INTERPRET=1``: the order of the attention's launch and
the ``nnz`` wait (the two calls ``build_index`` + ``sparse_attention`` wait first), the same output,
LSE and index as those two calls, bit for bit (``col_idx`` exactly ``nnz`` long), the buffer bound
``Hkv x plan.visible_blocks`` at least ``nnz``, and the public API on the same path.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

import pytest

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size, precision)
    "bf16_two_requests_g4_d64": ([70, 300], [900, 1500], 4, 1, 64, 16, 64, "bf16"),
    "fp8_one_request_g2_d128": ([260], [1300], 4, 2, 128, 16, 64, "fp8"),
}


def _run_case(name):
    import torch

    import flashprefill
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config
    from flashprefill.plan import visible_blocks

    *shape, precision = CASES[name]
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
    host._queue_nnz_copy, host.launch_attention, host_fp8.launch_attention_fp8 = real_queue, real_launch, real_launch8
    res = {"case": name, "one_call": one_call, "two_calls": two_calls,
           "pruned": int(idx_a.nnz) < int(idx_a.n_visible.sum()),
           "out_same": torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b),
           "finite": bool(torch.isfinite(out_a).all())}
    res["index_same"] = all(torch.equal(getattr(idx_a, f), getattr(idx_b, f))
                            for f in ("row_ptr", "col_idx", "n_visible", "k_mean", "v_mean", "sel_bits"))
    res["col_idx_is_nnz_long"] = idx_a.col_idx.numel() == int(idx_a.row_ptr[-1]) == idx_b.nnz
    res["bound_holds"] = c.k.shape[2] * sum(visible_blocks(c.plan)) >= idx_a.nnz
    api_out, api_index = flashprefill.flashprefill_attention(
        c.q, c.k, c.v, c.pt, c.sl, c.cu, c.cfg, c.scale, plan=c.plan, backend="triton", precision=precision,
        return_index=True)
    res["api_same"] = torch.equal(api_out, out_a) and torch.equal(api_index.col_idx, idx_a.col_idx)
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_the_attention_is_launched_before_the_nnz_wait(results, name):
    r = case_result(results, name)
    assert r["one_call"] == ["attention launch", "nnz wait"], r
    assert r["two_calls"] == ["nnz wait", "attention launch"], r


@pytest.mark.parametrize("name", list(CASES))
def test_one_call_equals_index_then_attention_bit_for_bit(results, name):
    r = case_result(results, name)
    assert r["pruned"] and r["finite"], r
    assert r["out_same"] and r["index_same"] and r["col_idx_is_nnz_long"], r
    assert r["bound_holds"] and r["api_same"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
