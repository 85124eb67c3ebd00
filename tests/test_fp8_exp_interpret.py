"""The FP8 attention's softmax exp2 (``attention_fp8_kernels._exp2_p``: ``AttnConfig.exp_impl``)
under ``TRITON_INTERPRET=1`` against float64 ``2^x``: ``poly_half`` (half the columns by the
degree-3 polynomial) within its 7.7e-5 relative bound, ``f16`` (the pure-Triton form the launcher
uses without a GPU) within fp16 rounding of argument and result, masked ``-inf`` logits giving 0.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, results_fixture, run_cases

CASES = ("exp2",)


def _run_case(name):
    global fk                  # the jitted kernel below resolves it among this module's globals
    import torch
    import triton
    import triton.language as tl

    from flashprefill.impl.triton import attention_fp8_kernels as fk

    @triton.jit
    def _exp_kernel(x_ptr, out_ptr, EXP: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
        p = fk._exp2_p(tl.load(x_ptr + offs), EXP, False)
        tl.store(out_ptr + offs, p.to(tl.float32))

    g = torch.Generator().manual_seed(3)
    x = torch.rand(16, 64, generator=g, dtype=torch.float64) * 68.0 - 60.0     # [-60, 8]: p * 256's range
    x[3, :7] = float("-inf")                                                   # masked logits
    x[5, 10:20] = torch.tensor([8.0, 0.0, -0.5, 0.5, -1.0, 2.49, -2.51, -24.0, -99.0, -126.5], dtype=torch.float64)
    x32 = x.float().contiguous()
    res = {"case": name}
    for impl in ("poly_half", "f16", "mufu"):
        out = torch.empty_like(x32)
        _exp_kernel[(1,)](x32, out, EXP=fk.EXP_IMPLS.index(impl), M=16, N=64)
        want = torch.exp2(x32.double())
        rel = ((out.double() - want).abs() / want.clamp_min(1e-300))
        normal = x32 >= -14.0                  # fp16 normal results
        res[impl] = {
            "rel_max_odd": float(rel[:, 1::2][torch.isfinite(x32[:, 1::2]) & (x32[:, 1::2] >= -99)].max()),
            "rel_max_normal": float(rel[normal].max()),
            "abs_max_small": float((out.double() - want).abs()[~normal].max()),
            "masked": out[3, :7].tolist(),
            "finite": bool(torch.isfinite(out).all()),
        }
    return res


results = results_fixture(__file__, timeout_s=600)


def test_exp2_variants_stay_inside_their_error_bounds(results):
    r = case_result(results, "exp2")
    for name in ("poly_half", "f16", "mufu"):
        assert r[name]["finite"], name
        assert all(v <= 2.0 ** -99 for v in r[name]["masked"]), (name, r[name]["masked"])
    assert r["poly_half"]["rel_max_odd"] <= 7.8e-5          # the polynomial columns
    assert r["poly_half"]["rel_max_normal"] <= 7.8e-5
    assert r["mufu"]["rel_max_normal"] <= 1e-6
    # fp16 argument (|x| <= 64: spacing 2^-5 -> 2^(2^-6) - 1 ~ 1.1%) and fp16 result (2^-11)
    assert r["f16"]["rel_max_normal"] <= 0.0112
    assert r["f16"]["abs_max_small"] <= 2.0 ** -14


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case, patch_range=False)
