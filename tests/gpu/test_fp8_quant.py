"""The FP8 pre-pass kernels (``impl/triton/quant_kernels.py``) on the GPU vs ``flashprefill.quant``,
bit for bit: K8 / V8^T codes, scales, mean codes, through the page table (docs/fp8.md section 7).

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_fp8_quant.py -q -x``.
Here the cast after ``_e4m3_rne`` is the hardware ``cvt.rn.satfinite`` (and with ``hw_cvt`` that cast
alone, ``IndexConfig.hw_cvt``); the ``edge`` cases check
every rounding tie, -0 and the saturation edge; ``nan`` checks that a NaN input stays NaN and does
not set the scale (the interpreter cannot run that case).
"""
from __future__ import annotations

import math

import pytest
import torch

from fp_brute import edge_cache, expected_prepass, make_inputs
from flashprefill import make_plan
from flashprefill.impl import reference as R
from flashprefill.impl.triton import quant_kernels as QK

CASES = {  # name: (q_lens, kv_lens, Hkv, d, page_size, dtype, edge)
    "batch_ps16_bf16": ([300, 1, 129], [1000, 63, 129], 2, 128, 16, torch.bfloat16, False),
    "ps1_fp16_d64": ([64], [4095], 4, 64, 1, torch.float16, False),
    "ps64_d256_4097": ([128], [4097], 2, 256, 64, torch.bfloat16, False),
    "long_32k": ([256], [32768], 8, 128, 64, torch.bfloat16, False),
    "edge_ties": ([10], [1000], 2, 128, 16, torch.float32, True),
}


def bits(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("hw_cvt", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_prepass_bit_exact(name, hw_cvt):
    """``hw_cvt``: the codes by the hardware cast alone (``quant_kernels._to_e4m3``), the same bits."""
    q_lens, kv_lens, hkv, d, ps, dtype, edge = CASES[name]
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, 2 * hkv, hkv, d, ps, dtype=torch.float32, seed=4)
    if edge:
        k = edge_cache(ps, hkv, d, k.shape[0], seed=5)
        v = edge_cache(ps, hkv, d, k.shape[0], seed=6)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    plan = make_plan(sl, cu, 2, 128)
    index = R.build_index(q, k, v, pt, sl, cu, None, None, plan)          # CPU means
    want = expected_prepass(k, v, pt, plan.kv_lens, 128, index.k_mean, index.v_mean)
    dev = "cuda"
    gq, gk, gv, gpt, gsl, gcu = (t.to(dev) for t in (q, k, v, pt, sl, cu))
    gplan = make_plan(gsl, gcu, 2, 128)
    # free allocator memory filled with 0xFF (an e4m3 NaN): the pre-pass buffers are torch.empty, so a
    # zero-gap slot the kernel leaves unwritten shows up in the bit comparison
    total_k = want["cu_seqlens_k"][-1]
    dirt = torch.full((4 * hkv * total_k * d + 4096,), 255, dtype=torch.uint8, device=dev)
    del dirt
    kv = QK.quantize_kv(gk, gv, gpt, gsl, gplan, hw_cvt=hw_cvt)
    k8m, v8mt, _ = QK.quantize_means(index.k_mean.to(dev), index.v_mean.to(dev), kv, gplan)
    torch.cuda.synchronize()
    nb = index.k_mean.shape[0]
    assert torch.equal(kv.k_scale.cpu(), want["k_scale"]) and torch.equal(kv.v_scale.cpu(), want["v_scale"])
    assert torch.equal(bits(kv.k8.cpu()), bits(want["k8"]))
    assert torch.equal(bits(kv.v8t.cpu()), bits(want["v8t"])) and kv.v8t.shape[2] % QK.TMA_ALIGN == 0
    assert kv.cu_seqlens_k.tolist() == want["cu_seqlens_k"]
    assert torch.equal(bits(k8m.cpu()), bits(want["k_mean8"]))
    assert torch.equal(bits(v8mt[:, :, :nb].cpu()), bits(want["v_mean8t"]))


@pytest.mark.parametrize("hw_cvt", [False, True])
def test_prepass_nan_stays_nan_and_does_not_set_the_scale(hw_cvt):
    q, k, v, pt, sl, cu = make_inputs([16], [300], 2, 1, 64, 16, dtype=torch.bfloat16, seed=7)
    p0 = int(pt[0, 0])
    k[p0, 3, 0, 5] = math.nan
    plan = make_plan(sl.cuda(), cu.cuda(), 2, 128)
    kv = QK.quantize_kv(k.cuda(), v.cuda(), pt.cuda(), sl.cuda(), plan, hw_cvt=hw_cvt)
    want = expected_prepass(k, v, pt, plan.kv_lens, 128)
    assert torch.equal(kv.k_scale.cpu(), want["k_scale"]) and math.isfinite(float(kv.k_scale[0, 0]))
    got = kv.k8.cpu().float()
    assert math.isnan(float(got[0, 3, 5]))
    assert int(torch.isnan(got).sum()) == 1
