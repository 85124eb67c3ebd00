"""The FP8 attention kernel's guarded exact-key loops (``AttnConfig.loop_guard``) under
``TRITON_INTERPRET=1``: bit for bit the shipped kernel's output and LSE, in every mode (mean
correction from the bitmask, sparse without correction, dense) and with ``mean_vec``. The guard
only skips a loop that would run zero steps, so the cases include programs whose first exact-key
loop is empty: a request shorter than one key block (no fully seen block, ``split == start``)
beside longer ones that prune blocks (the correction loop runs).

Run in a subprocess (this file with ``--worker``) that switches the interpreter on before Triton
compiles anything, as ``test_triton_interpret.py``."""
from __future__ import annotations

import sys

from interpret_harness import case_result, fp8_case, results_fixture, run_cases

import pytest


CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, block_size)
    "d64_B64_short_and_long": ([9, 300], [9, 1500], 2, 2, 64, 16, 64),
    "d128_B64_three_requests_g4": ([40, 9, 130], [1100, 9, 2200], 4, 1, 128, 16, 64),
}
MODES = {  # name: (sparse, mean_correction)
    "bits": (True, True),
    "nomc": (True, False),
    "dense": (False, False),
}
PAIRS = {  # name: (mode, AttnConfig fields of the variant, of the kernel it must equal bit for bit)
    **{f"loopguard_{m}": (m, dict(loop_guard=True), {}) for m in MODES},
    "loopguard_meanvec": ("bits", dict(loop_guard=True, mean_vec=True), dict(mean_vec=True)),
}


def _run_case(name):
    import dataclasses

    import torch

    from flashprefill.impl.triton import host_fp8

    q_lens, kv_lens, hq, hkv, d, ps, B = CASES[name]
    c = fp8_case(*CASES[name], seed=11)
    index = c.index
    # a request with Lq == Lk < B: its programs see no full block, the first exact-key loop is empty
    res = {"case": name, "pruned": int(index.nnz) < int(index.n_visible.sum()),
           "empty_first_loop": any(lq == lk < B for lq, lk in zip(q_lens, kv_lens))}
    runs = {}

    def launch(mode, fields):
        key = (mode, tuple(sorted(fields.items())))
        if key not in runs:
            sparse, mc = MODES[mode]
            runs[key] = host_fp8.launch_attention_fp8(c.q, c.kv, c.sl, c.cu, c.scale, c.plan,
                                                      dataclasses.replace(c.attn, **fields),
                                                      sparse=sparse, mean_correction=mc, block_size=B, index=index)
        return runs[key]

    for pname, (mode, fields, other) in PAIRS.items():
        o1, l1 = launch(mode, fields)
        o2, l2 = launch(mode, other)
        res[f"{pname}_finite"] = bool(torch.isfinite(o1).all())
        res[f"{pname}_out_equal"] = torch.equal(o1, o2)
        res[f"{pname}_lse_equal"] = torch.equal(l1, l2)
    return res


results = results_fixture(__file__)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_loop_guard_bit_identical(results, name, pair):
    r = case_result(results, name)
    assert r["pruned"], "the case must prune blocks (the correction loop runs)"
    assert r["empty_first_loop"], "the case must have programs whose first exact-key loop is empty"
    assert r[f"{pair}_finite"], r
    assert r[f"{pair}_out_equal"] and r[f"{pair}_lse_equal"], r


if __name__ == "__main__" and "--worker" in sys.argv:
    run_cases(CASES, _run_case)
