"""Global keys (``SparseConfig.global_keys``, docs/method.md section 4.1) on a GPU: ``backend="auto"``
runs them on the reference (no Triton kernel yet), in bf16, and matches the float64 CPU run."""
from __future__ import annotations

import pytest
import torch

from fp_brute import make_inputs
from flashprefill import SparseConfig, flashprefill_attention

CFG = SparseConfig(block_size=64, sink_tokens=64, window_tokens=128, dense_tail_tokens=64, alpha=0.2, global_keys=32)


@pytest.mark.parametrize("q_len,kv_len,hq,hkv,d", [(2048, 2048, 14, 2, 64), (1500, 3000, 32, 8, 128)])
def test_global_keys_on_cuda_match_the_float64_cpu_reference(q_len, kv_len, hq, hkv, d):
    q, k, v, pt, sl, cu = make_inputs([q_len], [kv_len], hq=hq, hkv=hkv, d=d, page_size=64, seed=q_len,
                                      structured=True)
    want, stats64 = flashprefill_attention(q, k, v, pt, sl, cu, CFG, return_stats=True)
    dev = torch.device("cuda")
    got, stats = flashprefill_attention(q.to(dev, torch.bfloat16), k.to(dev, torch.bfloat16),
                                        v.to(dev, torch.bfloat16), pt.to(dev), sl.to(dev), cu.to(dev), CFG,
                                        return_stats=True)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert stats.index.global_pos is not None and (stats.index.global_pos >= 0).sum() > 0
    assert stats.density < 1.0
    err = ((got.double().cpu() - want).norm() / want.norm()).item()
    assert err < 2e-2, err
