"""The FP8 path's small layout tensors (``quant_kernels.block_requests``, ``mean_columns``,
``_cu_seqlens_k``) are made from the plan without a host-to-device copy from a Python list (such a
copy drained the GPU three times per FP8 attention call); these tests hold them to their definitions,
written here from the plan's host lengths, on batches with one-block, partial-block and
many-block requests, and empty ones (``Lk = 0``: ``block_ptr`` repeats a value) before, between
and after others."""
from __future__ import annotations

import pytest
import torch

from flashprefill import make_plan
from flashprefill.impl.triton import quant_kernels as qk

BATCHES = [([300, 5000], [300, 33]), ([1], [1]), ([128], [128]), ([129, 4096, 70000, 1], [1, 100, 70000, 1]),
           ([2048] * 5, [10] * 5), ([0, 300, 0, 5, 0], [0, 300, 0, 5, 0])]


def _plan(kv_lens, q_lens, block_size):
    sl = torch.tensor(kv_lens, dtype=torch.int32)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)
    return make_plan(sl, cu, 4, block_size)


@pytest.mark.parametrize("block_size", [128, 64])
@pytest.mark.parametrize("kv_lens,q_lens", BATCHES)
def test_block_requests_and_mean_columns_follow_their_definitions(kv_lens, q_lens, block_size):
    plan = _plan(kv_lens, q_lens, block_size)
    blocks = [-(-lk // block_size) for lk in kv_lens]
    want_req = [b for b, n in enumerate(blocks) for _ in range(n)]
    got_req = qk.block_requests(plan, "cpu")
    assert got_req.dtype == torch.int64 and got_req.tolist() == want_req
    starts = [0]
    for n in blocks:
        starts.append(starts[-1] + -(-n // 128) * 128)
    want_cols = [starts[b] + r for b, n in enumerate(blocks) for r in range(n)]
    cols, cu_cols, n_cols = qk.mean_columns(plan, "cpu")
    assert cols.dtype == torch.int64 and cols.tolist() == want_cols
    assert cu_cols.dtype == torch.int32 and cu_cols.tolist() == starts and n_cols == starts[-1]
    assert qk.REQUEST_ALIGN == 128 and all(c % qk.TMA_ALIGN == 0 for c in starts)


@pytest.mark.parametrize("kv_lens,q_lens", BATCHES)
def test_cu_seqlens_k_starts_each_request_at_an_aligned_slot(kv_lens, q_lens):
    plan = _plan(kv_lens, q_lens, 128)
    cu, total = qk._cu_seqlens_k(plan, "cpu")
    want = [0]
    for lk in kv_lens:
        want.append(want[-1] + -(-lk // 128) * 128)
    assert cu.dtype == torch.int32 and cu.tolist() == want and total == want[-1]
    assert qk.host_ints([3, -1, 2**31 - 1], "cpu").tolist() == [3, -1, 2**31 - 1]


@pytest.mark.parametrize("kv_lens,q_lens", BATCHES)
def test_every_128_token_box_of_a_request_ends_before_the_next_request(kv_lens, q_lens):
    """The Gluon FP8 kernel reads K / V in boxes of 128 token slots from each block start, and block
    means in boxes of 128 columns from the request's first column, without masks (docs/fp8.md
    section 11): each box must end inside its own request's slots or zero gap, so a NaN in the next
    request cannot reach the request's rows through 0 x NaN in the P V product."""
    plan = _plan(kv_lens, q_lens, 128)
    cu = qk._cu_seqlens_k(plan, "cpu")[0].tolist()
    cols, cu_cols, n_cols = qk.mean_columns(plan, "cpu")
    cu_cols = cu_cols.tolist()
    for b, lk in enumerate(kv_lens):
        for j0 in range(0, lk, 128):                   # exact-key boxes: one per key block
            assert cu[b] + j0 + 128 <= cu[b + 1]
        n_blocks = -(-lk // 128)
        for u0 in range(0, n_blocks, 128):             # correction boxes: 128 candidates each
            assert cu_cols[b] + u0 + 128 <= cu_cols[b + 1]
    assert n_cols == cu_cols[-1]


def test_the_layout_tensors_are_made_once_per_plan_and_shared_by_every_layer():
    """The plan is shared by every layer of a forward (``BatchPlan.derive``): the FP8 path's layout
    tensors are made on the first call and the later calls get the same tensors, while a plan from
    ``dataclasses.replace`` (other lengths or pointers) makes its own."""
    import dataclasses

    plan = _plan([300, 5000], [300, 33], 128)
    made = []
    real = torch.searchsorted

    def counting(*a, **k):
        made.append(1)
        return real(*a, **k)

    torch.searchsorted = counting
    try:
        first = (qk.block_requests(plan, "cpu"), qk.mean_columns(plan, "cpu"), qk._cu_seqlens_k(plan, "cpu"))
        again = (qk.block_requests(plan, "cpu"), qk.mean_columns(plan, "cpu"), qk._cu_seqlens_k(plan, "cpu"))
    finally:
        torch.searchsorted = real
    assert len(made) == 1                                   # block_requests once, mean_columns reuses it
    assert again[0] is first[0] and again[1][0] is first[1][0] and again[1][1] is first[1][1]
    assert again[2][0] is first[2][0] and again[2][1] == first[2][1] and again[1][2] == first[1][2]
    other = dataclasses.replace(plan, block_ptr=plan.block_ptr.clone())
    assert other.derived == {} and qk.block_requests(other, "cpu") is not first[0]
    assert torch.equal(qk.block_requests(other, "cpu"), first[0])
