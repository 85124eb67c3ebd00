"""An FP8 attention call makes no host sync (commit 28c1e34): ``quant_kernels.block_requests`` and
``mean_columns`` come from the plan's device ``block_ptr``, ``_cu_seqlens_k`` through pinned memory
(``host_ints``). On the GPU: those tensors equal the CPU ones (dtype, device, values; the CPU ones
are held to their definitions by ``tests/test_fp8_means_layout.py``), and
``host.sparse_attention(precision="fp8")`` runs under ``torch.cuda.set_sync_debug_mode("error")``
with bf16 caches (the pre-pass) and e4m3 caches with descales (``gather_e4m3_kv``), on the Triton
kernel and, on sm_90, the Gluon kernel (``AttnConfig.impl = "gluon_ws"``), which must then equal
the Triton kernel on the e4m3 caches too.

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_fp8_nosync.py -q -x``.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from flashprefill import make_plan, quant
from flashprefill.impl.triton import quant_kernels as qk
from fp8_cases import SPARSE, cuda as _cuda, inputs as _inputs, rel

# (kv_lens, q_lens): two requests; batch 1 of one token; empty requests (Lk = 0) before, between and
# after others (block_ptr repeats a value); one-block, partial-block and many-block requests
BATCHES = [([300, 5000], [300, 33]), ([1], [1]), ([0, 300, 0, 5, 0], [0, 300, 0, 5, 0]),
           ([129, 4096, 70000, 1], [1, 100, 70000, 1])]


@contextlib.contextmanager
def _no_sync():
    """Any synchronising CUDA operation inside raises ``RuntimeError`` (naming it in the traceback)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _plan(kv_lens, q_lens, device):
    sl = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32, device=device)
    return make_plan(sl, cu, 4, 128)


def _same(got: torch.Tensor, want: torch.Tensor):
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want), (got.cpu().tolist(), want.tolist())


@pytest.mark.parametrize("plan_device", ["cuda", "cpu"])
@pytest.mark.parametrize("kv_lens,q_lens", BATCHES)
def test_the_layout_tensors_on_the_gpu_equal_the_cpu_ones_without_a_sync(kv_lens, q_lens, plan_device):
    """A plan on the GPU (the serving case: no sync) or on the CPU (``block_ptr`` on another device
    than the result: copied over, a sync allowed)."""
    want_plan = _plan(kv_lens, q_lens, "cpu")
    plan = _plan(kv_lens, q_lens, plan_device)
    guard = _no_sync() if plan_device == "cuda" else contextlib.nullcontext()
    with guard:
        req = qk.block_requests(plan, "cuda")
        cols, cu_cols, n_cols = qk.mean_columns(plan, "cuda")
        cu_k, total_k = qk._cu_seqlens_k(plan, "cuda")
    _same(req, qk.block_requests(want_plan, "cpu"))
    want_cols, want_cu_cols, want_n_cols = qk.mean_columns(want_plan, "cpu")
    _same(cols, want_cols)
    _same(cu_cols, want_cu_cols)
    want_cu_k, want_total_k = qk._cu_seqlens_k(want_plan, "cpu")
    _same(cu_k, want_cu_k)
    assert (n_cols, total_k) == (want_n_cols, want_total_k)


def _e4m3_caches(k, v, pt, sl, plan):
    """e4m3 caches holding the pre-pass's codes, and its scales as descales (as ``test_fp8.py``)."""
    scale, inv = qk.kv_amax_scales(k, v, pt, sl, plan)
    codes = []
    for c, i in ((k, inv[0]), (v, inv[1])):
        x = torch.zeros(c.shape, dtype=quant.E4M3, device=c.device)
        for b, lk in enumerate(plan.kv_lens):
            pages = pt[b, :-(-lk // c.shape[1])].long()
            x[pages] = quant.quantize(c[pages], i[b][:, None])
        codes.append(x)
    return codes[0], codes[1], dict(k_descale=scale[0], v_descale=scale[1])


@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
@pytest.mark.parametrize("name", ["kv4097_prefix_g3_d64", "kv4095_g8_ps64"])
def test_an_fp8_attention_call_makes_no_host_sync(name, cache):
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    q, k, v, pt, sl, cu = _cuda(_inputs(name))
    d = q.shape[2]
    plan = make_plan(sl, cu, q.shape[1] // k.shape[2], 128)
    extra = {}
    if cache == "e4m3":
        k, v, extra = _e4m3_caches(k, v, pt, sl, plan)
    impls = ["triton"] + (["gluon_ws"] if torch.cuda.get_device_capability() == (9, 0) else [])
    outs = {}
    for impl in impls:
        kernels = get_config(d, q.dtype, 128, precision="fp8", variant="triton_fp8" if impl == "triton" else impl)
        index = host.build_index(q, k, v, pt, sl, cu, SPARSE, d ** -0.5, plan, kernels=kernels, precision="fp8",
                                 **extra)
        args = (q, k, v, pt, sl, cu, SPARSE, d ** -0.5, plan, index)
        host.sparse_attention(*args, kernels=kernels, precision="fp8", **extra)     # compiles outside the check
        with _no_sync():
            out, lse = host.sparse_attention(*args, kernels=kernels, precision="fp8", **extra)
        # an index without the operands the index made (BlockIndex.fp8_operands): the attention makes the
        # pre-pass and the means' codes itself, under the same check
        bare = (*args[:-1], dataclasses.replace(index, fp8_operands=None))
        with _no_sync():
            out2, lse2 = host.sparse_attention(*bare, kernels=kernels, precision="fp8", **extra)
        assert torch.equal(out2, out) and torch.equal(lse2, lse)
        assert torch.isfinite(out).all() and not torch.equal(out, torch.zeros_like(out))
        outs[impl] = (out, lse, index)
    if "gluon_ws" in outs:
        # the Gluon kernel on the Triton kernel's index: the same products (test_fp8_ws.py's bounds)
        kernels = get_config(d, q.dtype, 128, precision="fp8", variant="gluon_ws")
        out, lse = host.sparse_attention(q, k, v, pt, sl, cu, SPARSE, d ** -0.5, plan, outs["triton"][2],
                                         kernels=kernels, precision="fp8", **extra)
        want, want_lse, _ = outs["triton"]
        assert rel(out, want) <= 2e-3
        fin = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert float((lse[fin] - want_lse[fin]).abs().max()) <= 1e-3
