"""The lab probe ``scripts/lab/ws_probe.py`` (TMA descriptors, Triton's warp specialisation on
sm_90) against the shipped FP8 and BF16 kernels with ``SparseConfig(mean_correction=False)`` on
the same inputs and the same index (docs/lab/kernel-notes.md "Version 6 probe").

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_ws_probe.py -q -x``.

Budgets as ``test_fp8.py``'s pipelined-loop test (the same products in another order): relative L2
of the output <= 2e-3 (a few units of bf16's 2^-8 on a few elements), LSE within 1e-4 where finite,
the same rows finite. The probe's TMA reads past ``Lk`` are masked keys (-inf logits), as the shipped
kernels' masked loads.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "lab"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sm_90: TMA, FP8 wgmma)")

HQ, HKV, D = 8, 2, 128


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _run(L: int, batch: int, name: str):
    import ws_probe as W

    from flashprefill import SparseConfig, make_plan
    from flashprefill.bench import synthetic_inputs
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config

    cfg = W.probe_configs()[name]
    config = SparseConfig(mean_correction=False)
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, HQ, HKV, D, torch.bfloat16, 64, batch)
    scale = 1.0 / math.sqrt(D)
    plan = make_plan(sl, cu, HQ // HKV, config.block_size)
    kcfg = get_config(D, torch.bfloat16, config.block_size, precision="fp8", variant="plain")  # what the probe mirrors
    index8 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
    kv = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax)
    qp = W.pack_q(q, HKV)
    if cfg.fp8:
        want, want_lse = host_fp8.launch_attention_fp8(q, kv, sl, cu, scale, plan, kcfg.attn, sparse=True,
                                                       mean_correction=False, block_size=config.block_size,
                                                       index=index8)
        got, lse = W.launch_probe(qp, kv.k8, kv.v8t, kv.k_scale.contiguous(), kv.v_scale.contiguous(),
                                  kv.cu_seqlens_k, sl, cu, plan, index8, scale, cfg, config.block_size, HQ)
    else:
        index16 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
        want, want_lse = host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index16)[:2]
        k16, v16 = W.bf16_operands(kc, vc, pt, sl, kv.cu_seqlens_k, kv.k8.shape[1])
        got, lse = W.launch_probe(qp, k16, v16, kv.k_scale, kv.v_scale, kv.cu_seqlens_k, sl, cu, plan, index16,
                                  scale, cfg, config.block_size, HQ)
    torch.cuda.synchronize()
    return got, lse, want, want_lse


CONFIGS = ["fp8_ws_n128_w4_s2", "fp8_ws_n64_w4_s2", "fp8_nows_n128_w8_s2", "fp8_nows_n128_w8_s2_2loops",
           "bf16_ws_n128_w4_s2", "bf16_ws_n64_w4_s2", "bf16_nows_n64_w8_s2", "bf16_nows_n64_w8_s2_2loops"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("L,batch", [(1000, 1), (4097, 1), (4097, 2), (8192, 1)])
def test_probe_matches_the_shipped_kernel(L, batch, name):
    got, lse, want, want_lse = _run(L, batch, name)
    assert torch.isfinite(got).all() and not torch.equal(got, torch.zeros_like(got))
    assert rel(got, want) <= 2e-3, rel(got, want)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert float((lse[fin] - want_lse[fin]).abs().max()) <= 1e-4


def test_bf16_operands_hold_each_request_at_its_slot():
    """``bf16_operands`` gathers request b's token p to slot ``cu_seqlens_k[b] + p`` (the FP8
    buffers' layout); the zero gaps stay zero."""
    import ws_probe as W

    from flashprefill import make_plan
    from flashprefill.bench import synthetic_inputs
    from flashprefill.impl.triton import host_fp8

    q, kc, vc, pt, sl, cu, k_lin, v_lin = synthetic_inputs(1000, HQ, HKV, D, torch.bfloat16, 64, 2)
    plan = make_plan(sl, cu, HQ // HKV, 128)
    kv = host_fp8.kv_operands(kc, vc, pt, sl, plan)
    k16, v16 = W.bf16_operands(kc, vc, pt, sl, kv.cu_seqlens_k, kv.k8.shape[1])
    pages = -(-1000 // 64) * 64
    for b in range(2):
        c0 = int(kv.cu_seqlens_k[b])
        assert torch.equal(k16[:, c0:c0 + 1000], k_lin[b * pages:b * pages + 1000].transpose(0, 1))
        assert torch.equal(v16[:, c0:c0 + 1000], v_lin[b * pages:b * pages + 1000].transpose(0, 1))
    c1 = int(kv.cu_seqlens_k[1])
    assert not k16[:, 1000:c1].any()
