"""What the 8-bit GPU tests share (``test_fp8.py``, ``test_int8qk.py``): the error budgets, the
cases at tile and block boundaries, their inputs, and the selection check against the reference."""
from __future__ import annotations

import torch

import flashprefill
from flashprefill import SparseConfig, make_plan
from flashprefill.impl import reference as R
from fp_brute import make_inputs

# Budgets relative to the FP8 method's own error e = rel(ref8, ref16): the CPU reference in FP8 vs in
# BF16, same inputs, same selection. The kernel differs from the FP8 reference in how it rounds P
# (docs/fp8.md section 4): e4m3(p * 256) against its running row max, the reference against the
# final max. Both roundings are e4m3 rounding of the same probabilities at a power-of-two-shifted
# scale: the same relative error bound (2**-4 for normals), and the running max only makes small p
# better represented (fewer underflow to zero). So the kernel's output error against BF16 is the
# reference's in size (Q / K / V codes identical, P noise of the same size): TRACK_FACTOR allows 10%
# for a different sample of the rounding noise. The two P noises are independent samples, each at
# most the whole FP8 error in size, so rel(kernel, ref8) <= sqrt(2) * e: SAME_FACTOR. BF16_FLOOR:
# bf16 output rounding (2**-8) and tensor-core summation order, which the factors do not scale.
TRACK_FACTOR = 1.1
SAME_FACTOR = 2 ** 0.5
BF16_FLOOR = 0.005
SPARSE = SparseConfig(block_size=128, sink_tokens=128, window_tokens=256, dense_tail_tokens=64, alpha=0.3)

CASES = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size, logit_gain)
    "kv127_g1_ps16": ([127], [127], 2, 2, 128, 16, 1.0),
    "kv128_g3_ps1": ([128], [128], 6, 2, 64, 1, 1.0),
    "kv129_g7_ps64": ([129], [129], 7, 1, 128, 64, 1.0),
    "kv4095_g8_ps64": ([1000], [4095], 16, 2, 128, 64, 1.0),
    "kv4096_g1_d256": ([4096], [4096], 2, 2, 256, 16, 1.0),
    "kv4097_prefix_g3_d64": ([700, 33], [4097, 900], 6, 2, 64, 16, 1.0),
    "large_logits_g8": ([512], [2048], 8, 1, 128, 64, 8.0),
}


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def inputs(name):
    q_lens, kv_lens, hq, hkv, d, ps, gain = CASES[name]
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, dtype=torch.float32, seed=7,
                                      structured=True)
    q = q * gain
    return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in (q, k, v, pt, sl, cu))


def cuda(inp):
    return tuple(t.cuda() for t in inp)


def assert_selection_agrees(name: str, precision: str) -> None:
    """``build_index`` on the GPU against the reference's at ``precision`` on case ``name``: the same
    blocks up to near-ties of the threshold (>= 99% of the CSR entries) and the same key means."""
    cpu = inputs(name)
    gpu = cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    got = flashprefill.build_index(*gpu, SPARSE, plan=make_plan(gpu[4], gpu[5], g, 128), precision=precision)
    want = R.build_index(*cpu, SPARSE, None, make_plan(cpu[4], cpu[5], g, 128), precision=precision)
    a = set()
    b = set()
    rp_g, ci_g = got.row_ptr.cpu().tolist(), got.col_idx.cpu().tolist()
    rp_w, ci_w = want.row_ptr.tolist(), want.col_idx.tolist()
    for s in range(len(rp_w) - 1):
        a |= {(s, j) for j in ci_g[rp_g[s]:rp_g[s + 1]]}
        b |= {(s, j) for j in ci_w[rp_w[s]:rp_w[s + 1]]}
    assert len(a ^ b) <= 0.01 * len(a | b)
    assert torch.allclose(got.k_mean.cpu(), want.k_mean.float(), rtol=1e-5, atol=1e-6)
