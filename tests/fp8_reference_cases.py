"""What the 8-bit CPU reference tests share (``test_fp8_reference.py``, ``test_int8qk_reference.py``):
the sparse config, the cases against the float64 brute force of ``tests/fp_brute.py`` and those
checks themselves, and the float64 index that carries an 8-bit run's selection.
(``tests/gpu/fp8_cases.py`` is the GPU tests' counterpart; the names differ so that neither
shadows the other on ``sys.path``.)"""
from __future__ import annotations

import torch

from flashprefill import SparseConfig, make_plan
from flashprefill.impl import reference as R
from fp_brute import brute_force, csr_segments, make_inputs

E4M3 = torch.float8_e4m3fn
SPARSE64 = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)

CASES = [  # (q_lens, kv_lens, hq, hkv, d, page_size)
    ([300], [600], 2, 1, 64, 16),            # P > 0, pruned blocks folded back as means
    ([100, 40], [260, 40], 3, 1, 64, 1),     # GQA 3, page size 1, two requests
    ([129], [129], 2, 2, 64, 64),            # tile / block boundary
]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def f64(inp):
    return tuple(t.double() if t.is_floating_point() else t for t in inp)


def assert_sparse_matches_brute_force(precision: str, q_lens, kv_lens, hq, hkv, d, ps):
    """The reference's selection (CSR segments), output and LSE at ``precision`` against the
    brute force's on a ``CASES`` entry (structured float64 inputs, seed 3), to 1e-10. Returns
    ``(inp, plan, index, out)`` for the caller's own checks."""
    inp = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, structured=True, seed=3)
    plan = make_plan(inp[4], inp[5], hq // hkv, SPARSE64.block_size)
    index = R.build_index(*inp, SPARSE64, None, plan, precision=precision)
    out, lse = R.sparse_attention(*inp, SPARSE64, None, plan, index, precision=precision)
    ref_out, ref_lse, segs = brute_force(*inp, SPARSE64, precision=precision)
    assert csr_segments(index, plan) == segs
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)
    return inp, plan, index, out


def assert_dense_matches_brute_force(precision: str) -> None:
    """The dense reference at ``precision`` against the brute force, with a KV prefix (70 queries
    over 200 keys, GQA 2), output and LSE to 1e-10."""
    inp = make_inputs([70], [200], 4, 2, 64, 16, seed=4)
    plan = make_plan(inp[4], inp[5], 2, 128)
    out, lse = R.dense_attention(*inp, None, plan, precision=precision)
    ref_out, ref_lse, _ = brute_force(*inp, SparseConfig(), dense=True, precision=precision)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=0)


def f64_index_with_selection(inp, cfg, plan, index):
    """The float64 reference index of ``inp`` carrying ``index``'s selection (``row_ptr``,
    ``col_idx``): an 8-bit run against float64 attention over it errs by the quantisation alone."""
    index64 = R.build_index(*f64(inp), cfg, None, plan)
    return type(index64)(**{**index64.__dict__, "row_ptr": index.row_ptr, "col_idx": index.col_idx})

