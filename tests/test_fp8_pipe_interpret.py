"""The FP8 attention kernel's hand-pipelined exact-key loop (``AttnConfig.pipeline``,
``attention_fp8_kernels._fp8_inner_pipe``) under ``TRITON_INTERPRET=1`` on small shapes: against the
shipped loop (same operations on the same values per step: equal up to fp32 rounding order), alone
and with ``fold_scale``, and against the FP8 CPU reference (``docs/fp8.md``: the budget of
``tests/gpu/test_fp8.py``). Cases cover one and two sub-steps per key block, the masked (diagonal /
partial) blocks, a request shorter than one block, the mean correction and the dense mode.

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

import pytest


CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size, block_n)
    "d64_B64_two_requests_ps16": ([80, 9], [900, 9], 4, 2, 64, 16, 64, 64),
    "d64_B64_two_substeps_ps1": ([70], [705], 2, 1, 64, 1, 64, 32),
    "d128_B64_g4_prefix": ([40], [800], 4, 1, 128, 16, 64, 64),
}
VARIANTS = {  # name: AttnConfig fields replaced in the case's tiles
    "shipped": {},
    "fold": dict(fold_scale=True),
    "pipe": dict(pipeline=True),
    "pipe_fold": dict(pipeline=True, fold_scale=True),
}
# The kernel against the FP8 reference, relative to the FP8 method's own error e on the same inputs:
# tests/gpu/test_fp8.py's SAME_FACTOR * e + BF16_FLOOR, doubled because Triton 3.6's interpreter casts
# P to e4m3 by truncation (relative error up to 2^-3, twice rounding's 2^-4; test_fp8_quant_interpret.py).
SAME_FACTOR = 2 ** 0.5
INTERP_FACTOR = 2.0
FLOOR = 0.005


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run_case(name):
    import dataclasses

    import torch

    from flashprefill.impl import reference as R
    from flashprefill.impl.triton import host_fp8

    *shape, bn = CASES[name]
    B = shape[-1]
    c = fp8_case(*shape, seed=5)
    index = c.index
    base = dataclasses.replace(c.attn, block_n=bn)
    operands = (c.q, c.k, c.v, c.pt, c.sl, c.cu, c.cfg, c.scale, c.plan, index)
    want8, _ = R.sparse_attention(*operands, precision="fp8")
    want16, _ = R.sparse_attention(*operands)
    res = {"case": name, "e": _rel(want8, want16), "pruned": int(index.nnz) < int(index.n_visible.sum())}
    outs = {}
    for mode in ("sparse", "dense"):
        for vname, fields in VARIANTS.items():
            tiles = dataclasses.replace(base, **fields)
            o, lse = host_fp8.launch_attention_fp8(c.q, c.kv, c.sl, c.cu, c.scale, c.plan, tiles,
                                                   sparse=mode == "sparse", mean_correction=True, block_size=B,
                                                   index=index)
            outs[mode, vname] = (o, lse)
            res[f"{mode}_{vname}_finite"] = bool(torch.isfinite(o).all() and not torch.isnan(lse).any())
            if mode == "sparse":
                res[f"{vname}_vs_ref8"] = _rel(o, want8)
        for vname, other in (("pipe", "shipped"), ("pipe_fold", "fold")):
            (o1, l1), (o2, l2) = outs[mode, vname], outs[mode, other]
            res[f"{mode}_{vname}_vs_{other}"] = _rel(o1, o2)
            fin = torch.isfinite(l2)
            res[f"{mode}_{vname}_lse_max"] = float((l1[fin] - l2[fin]).abs().max())
            res[f"{mode}_{vname}_lse_inf_same"] = bool(torch.equal(torch.isfinite(l1), fin))
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_pipelined_loop_matches_shipped_loop_and_fp8_reference(results, name):
    r = case_result(results, name)
    assert r["pruned"], "the case must prune blocks (the mean correction runs)"
    for key, value in r.items():
        if key.endswith("_finite"):
            assert value, key
    for mode in ("sparse", "dense"):
        for vname in ("pipe", "pipe_fold"):
            other = "shipped" if vname == "pipe" else "fold"
            # the same operations on the same values (fp32 sums in the same order under the interpreter)
            assert r[f"{mode}_{vname}_vs_{other}"] <= 1e-6, (mode, vname, r)
            assert r[f"{mode}_{vname}_lse_max"] <= 1e-6, (mode, vname, r)
            assert r[f"{mode}_{vname}_lse_inf_same"], (mode, vname)
    for vname in VARIANTS:
        assert r[f"{vname}_vs_ref8"] <= INTERP_FACTOR * SAME_FACTOR * r["e"] + FLOOR, (vname, r)


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
