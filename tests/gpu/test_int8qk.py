"""Precision "int8qk" (docs/fp8.md section 10: Q·Kᵀ on int8, P·V on e4m3) in the Triton kernels on
the GPU: against the int8qk reference (the budgets of ``tests/gpu/test_fp8.py``, same structure), the
selection against the reference's, the pre-pass's int8 K codes bit for bit, and int8qk closer to the
exact attention than fp8 on keys with a per-channel bias (as real activations have, section 9).

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_int8qk.py -q -x``.

The reference runs on the CPU in float32 from the same bf16 inputs. The kernel's int8 logits are the
reference's up to fp32 rounding order (the int32 sums are exact: d <= 256, |code| <= 127); P is
rounded against the running max as in "fp8", hence the same budgets (docs/fp8.md section 8).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashprefill
from flashprefill import make_plan, quant
from flashprefill.impl import reference as R
from fp_brute import make_inputs
from fp8_cases import (BF16_FLOOR, CASES, SAME_FACTOR, SPARSE, TRACK_FACTOR, assert_selection_agrees,
                       cuda as _cuda, inputs as _inputs, rel)

# LSE of the kernel vs the reference (natural log): the same logits up to fp32 order, the same l.
LSE_TOL = 2e-3


def _cpu_index(index):
    return dataclasses.replace(index, **{f.name: getattr(index, f.name).cpu() for f in dataclasses.fields(index)
                                         if isinstance(getattr(index, f.name), torch.Tensor)})


@pytest.mark.parametrize("variant", ["default", "plain"])
@pytest.mark.parametrize("name", list(CASES))
def test_int8qk_triton_matches_reference_and_tracks_bf16(name, variant):
    """``variant``: the int8qk tiles of ``get_config`` (at d 128 ``loop_guard`` / ``fold_scale`` /
    ``mean_vec`` and the index's ``fused_amax``), or every optional field off."""
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    cpu = _inputs(name)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    d = cpu[0].shape[2]
    scale = d ** -0.5
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    kernels = get_config(d, torch.bfloat16, SPARSE.block_size, precision="int8qk",
                         variant=None if variant == "default" else "plain")
    out, lse, index = host.attention(*gpu, SPARSE, scale, plan, kernels=kernels, precision="int8qk")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and not torch.equal(out, torch.zeros_like(out))
    # the reference under the same selection (the Triton index, on the CPU)
    cidx = _cpu_index(index)
    cplan = make_plan(cpu[4], cpu[5], g, SPARSE.block_size)
    want, want_lse = R.sparse_attention(*cpu, SPARSE, scale, cplan, cidx, precision="int8qk")
    want16, _ = R.sparse_attention(*cpu, SPARSE, scale, cplan, cidx)
    e = rel(want, want16)                        # the int8qk method's own error on these inputs
    assert rel(out.cpu(), want16) <= TRACK_FACTOR * e + BF16_FLOOR
    assert rel(out.cpu(), want) <= SAME_FACTOR * e + BF16_FLOOR
    assert (lse.cpu().double() - want_lse.double()).abs().max() < LSE_TOL
    # dense int8qk vs dense BF16: the same budget against the reference's dense error
    dense8, dense_lse = host.dense_attention(*gpu, scale, plan, kernels=kernels, precision="int8qk")
    dense_bf16 = flashprefill.dense_attention(*gpu, scale, plan=plan)
    want_d, want_d_lse = R.dense_attention(*cpu, scale, cplan, precision="int8qk")
    e_dense = rel(want_d, R.dense_attention(*cpu, scale, cplan)[0])
    assert torch.isfinite(dense8).all() and rel(dense8, dense_bf16) <= TRACK_FACTOR * e_dense + BF16_FLOOR
    assert (dense_lse.cpu().double() - want_d_lse.double()).abs().max() < LSE_TOL


@pytest.mark.parametrize("name", ["kv4095_g8_ps64", "kv4097_prefix_g3_d64", "kv4096_g1_d256"])
def test_int8qk_selection_agrees_with_reference(name):
    """int8 Q tiles against int8 means on both sides; the int32 sums are exact, so only the fp32
    scaling order differs: the same blocks up to near-ties of the threshold (>= 99% of the entries)."""
    assert_selection_agrees(name, "int8qk")


@pytest.mark.parametrize("hw_cvt", [False, True])
@pytest.mark.parametrize("name", ["kv4097_prefix_g3_d64", "kv4096_g1_d256", "kv129_g7_ps64"])
def test_int8qk_prepass_codes_exact(name, hw_cvt):
    """``K_INT8``: the int8 K codes and ``amax / 127`` scales of each request bit for bit as
    ``quant.quantize_int8`` / ``quant.int8_scales``; V's e4m3 codes as the "fp8" pre-pass's."""
    from flashprefill.impl.triton import quant_kernels as QK

    q, k, v, pt, sl, cu = _cuda(_inputs(name))
    plan = make_plan(sl, cu, q.shape[1] // k.shape[2], 128)
    kv = QK.quantize_kv(k, v, pt, sl, plan, hw_cvt=hw_cvt, k_int8=True)
    kv8 = QK.quantize_kv(k, v, pt, sl, plan, hw_cvt=hw_cvt)
    assert kv.k8.dtype == torch.int8
    for b, lk in enumerate(plan.kv_lens):
        x = R._gather_kv(k, pt, b, lk)
        s, inv = quant.int8_scales(quant.abs_max(x, (0, 2)))
        assert torch.equal(kv.k_scale[b], s) and torch.equal(kv.k_inv_scale[b], inv)
        start = int(kv.cu_seqlens_k[b])
        assert torch.equal(kv.k8[:, start:start + lk], quant.quantize_int8(x, inv[:, None]).permute(1, 0, 2))
    assert torch.equal(kv.v8t.view(torch.uint8), kv8.v8t.view(torch.uint8))
    assert torch.equal(kv.v_scale, kv8.v_scale)


BIASED = {  # name: (q_lens, kv_lens, Hq, Hkv, d, page_size)
    "d128_g4": ([1024], [3000], 16, 4, 128, 64),
    "d64_g3_two_requests": ([600, 200], [2000, 700], 9, 3, 64, 16),
}


def _biased(name, gain=1.0):
    """K = bias + noise per (KV head, channel), the bias as large as the noise (docs/fp8.md
    section 9's SmolLM2 K), queries with a component along the bias; bf16."""
    q_lens, kv_lens, hq, hkv, d, ps = BIASED[name]
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, hq, hkv, d, ps, dtype=torch.float32, seed=21)
    bias = torch.randn(1, 1, hkv, d, generator=torch.Generator().manual_seed(22))
    k = k + bias
    q = q + 0.5 * bias.view(1, hkv, 1, d).expand(1, hkv, hq // hkv, d).reshape(1, hq, d)
    return ((q * gain).bfloat16(), (k * gain).bfloat16(), v.bfloat16(), pt, sl, cu)


@pytest.mark.parametrize("gain", [1.0, 3.0])
@pytest.mark.parametrize("name", list(BIASED))
def test_int8qk_closer_than_fp8_on_biased_keys(name, gain):
    """The point of int8qk: on biased keys its relative L2 against the float64 exact attention is
    well below fp8's (dense, and sparse under one selection). CPU reference ratios int8qk / fp8 on
    these inputs: 0.58-0.59 at gain 1, 0.33-0.36 at gain 3; 0.8 leaves room for the kernels' P noise
    (TRACK_FACTOR on each)."""
    cpu = _biased(name, gain)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    plan = make_plan(gpu[4], gpu[5], g, 128)
    cplan = make_plan(cpu[4], cpu[5], g, 128)
    exact, _ = R.dense_attention(*(t.double() if t.is_floating_point() else t for t in cpu), None, cplan)
    dense_i8 = flashprefill.dense_attention(*gpu, plan=plan, precision="int8qk")
    dense_f8 = flashprefill.dense_attention(*gpu, plan=plan, precision="fp8")
    torch.cuda.synchronize()
    assert torch.isfinite(dense_i8).all()
    assert rel(dense_i8.cpu(), exact) < 0.8 * rel(dense_f8.cpu(), exact)
    # sparse, the int8qk selection for both
    out_i8, lse_i8, index = flashprefill.flashprefill_attention(*gpu, SPARSE, plan=plan, precision="int8qk",
                                                                return_lse=True, return_index=True)
    out_f8 = flashprefill.flashprefill_attention(*gpu, SPARSE, plan=plan, precision="fp8", index=index)
    out_16 = flashprefill.flashprefill_attention(*gpu, SPARSE, plan=plan, index=index)
    assert torch.isfinite(out_i8).all() and torch.isfinite(lse_i8).all()
    assert rel(out_i8, out_16) < 0.8 * rel(out_f8, out_16)


def test_int8qk_e4m3_cache_raises_on_gpu():
    q, k, v, pt, sl, cu = _cuda(_inputs("kv129_g7_ps64"))
    s, inv = quant.amax_scales(quant.abs_max(k, (0, 1, 2, 3)))
    k8, v8 = quant.quantize(k, inv), quant.quantize(v, inv)
    with pytest.raises(ValueError, match=r"precision='int8qk' cannot read a float8_e4m3fn KV cache.*precision='fp8'"):
        flashprefill.flashprefill_attention(q, k8, v8, pt, sl, cu, SPARSE, precision="int8qk", k_descale=s,
                                            v_descale=s)
