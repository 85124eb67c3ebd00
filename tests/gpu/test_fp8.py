"""The Triton FP8 attention (``impl/triton/attention_fp8_kernels.py``, ``host_fp8.py``) on the GPU
against the FP8 reference (same semantics, docs/fp8.md: a tight budget) and against BF16 dense
(the FP8 error budget of tests/test_fp8_reference.py), at tile and block boundaries.

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_fp8.py -q -x``.

The reference runs on the CPU in float32 from the same bf16 inputs. Sums in another order and the
online max (the kernel casts P against its running max, the reference against the final one) keep
the two from agreeing bit for bit: docs/fp8.md section 8.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import flashprefill
from flashprefill import make_plan, quant
from flashprefill.impl import reference as R
from fp8_cases import (BF16_FLOOR, CASES, SAME_FACTOR, SPARSE, TRACK_FACTOR, assert_selection_agrees,
                       cuda as _cuda, inputs as _inputs, rel)



@pytest.mark.parametrize("name", list(CASES))
def test_fp8_triton_matches_fp8_reference_and_tracks_bf16(name):
    cpu = _inputs(name)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    out, index = flashprefill.flashprefill_attention(*gpu, SPARSE, plan=plan, precision="fp8", return_index=True)
    dense_bf16 = flashprefill.dense_attention(*gpu, plan=plan)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    # the reference under the same selection (the Triton index, on the CPU)
    cidx = dataclasses.replace(index, **{f.name: getattr(index, f.name).cpu() for f in dataclasses.fields(index)
                                         if isinstance(getattr(index, f.name), torch.Tensor)})
    cplan = make_plan(cpu[4], cpu[5], g, SPARSE.block_size)
    want, _ = R.sparse_attention(*cpu, SPARSE, None, cplan, cidx, precision="fp8")
    want16, _ = R.sparse_attention(*cpu, SPARSE, None, cplan, cidx)
    e = rel(want, want16)                        # the FP8 method's own error on these inputs
    assert rel(out.cpu(), want16) <= TRACK_FACTOR * e + BF16_FLOOR
    assert rel(out.cpu(), want) <= SAME_FACTOR * e + BF16_FLOOR
    # dense FP8 vs dense BF16: the same budget against the reference's dense error
    dense8 = flashprefill.dense_attention(*gpu, plan=plan, precision="fp8")
    e_dense = rel(R.dense_attention(*cpu, None, cplan, precision="fp8")[0], R.dense_attention(*cpu, None, cplan)[0])
    assert torch.isfinite(dense8).all() and rel(dense8, dense_bf16) <= TRACK_FACTOR * e_dense + BF16_FLOOR


@pytest.mark.parametrize("name", ["kv4095_g8_ps64", "kv4097_prefix_g3_d64", "kv4096_g1_d256"])
def test_fp8_selection_agrees_with_reference(name):
    """The FP8 selection scores e4m3 Q tiles against e4m3 means on both sides: the same blocks up
    to near-ties of the threshold (tensor-core sum order). Agreement >= 99% of the entries."""
    assert_selection_agrees(name, "fp8")


def test_fp8_e4m3_cache_with_descales_equals_internal_quantisation():
    """e4m3 caches holding the codes the pre-pass would make, with its scales as descales: the
    same output as quantising the bf16 caches inside (docs/fp8.md section 5)."""
    cpu = _inputs("kv4097_prefix_g3_d64")
    q, k, v, pt, sl, cu = _cuda(cpu)
    g = q.shape[1] // k.shape[2]
    plan = make_plan(sl, cu, g, 128)
    from flashprefill.impl.triton import quant_kernels as QK
    scale, inv = QK.kv_amax_scales(k, v, pt, sl, plan)
    codes = []
    for c, i in ((k, inv[0]), (v, inv[1])):
        x = torch.zeros(c.shape, dtype=quant.E4M3, device=c.device)
        for b, lk in enumerate(plan.kv_lens):
            pages = pt[b, :-(-lk // c.shape[1])].long()
            x[pages] = quant.quantize(c[pages], i[b][:, None])
        codes.append(x)
    ref = flashprefill.flashprefill_attention(q, k, v, pt, sl, cu, SPARSE, plan=plan, precision="fp8")
    got = flashprefill.flashprefill_attention(q, codes[0], codes[1], pt, sl, cu, SPARSE, plan=plan, precision="fp8",
                                              k_descale=scale[0], v_descale=scale[1])
    assert torch.isfinite(got).all()
    assert rel(got, ref) < 1e-2
    with pytest.raises(ValueError, match="k_descale"):
        flashprefill.flashprefill_attention(q, codes[0], codes[1], pt, sl, cu, SPARSE, plan=plan, precision="fp8")


# The FP8 kernel's variant fields (``AttnConfig.exp_impl`` / ``fold_scale`` / ``pipeline``): each must meet the
# same budgets as the shipped kernel ("shipped" in these tests: ``get_config(..., variant="plain")``, every
# optional field off; the default at d 128 turns loop_guard, fold_scale and mean_vec on). poly_half's exp2 is off by <= 7.7e-5 relative, f16's by
# fp16 rounding (2^-11): both far inside e4m3's rounding of P (2^-4), so the budgets do not change.
VARIANT_FIELDS = {
    "exp_f16": dict(exp_impl="f16"),
    "poly_half": dict(exp_impl="poly_half"),
    "fold": dict(fold_scale=True),
    "poly_fold": dict(exp_impl="poly_half", fold_scale=True),
    # the hand software-pipelined exact-key loop: the same operations per step as the shipped loop
    "pipe": dict(pipeline=True),
    "pipe_fold": dict(pipeline=True, fold_scale=True),
    # the mean-correction loop's V-mean tile from request-aligned columns (16-byte copies)
    "meanvec": dict(mean_vec=True),
    "pipe_fold_meanvec": dict(pipeline=True, fold_scale=True, mean_vec=True),
    # the exact-key loops inside an explicit trip-count check (no ptxas C7515 serialization)
    "guard": dict(loop_guard=True),
    "guard_fold_meanvec": dict(loop_guard=True, fold_scale=True, mean_vec=True),
}


@pytest.mark.parametrize("variant", list(VARIANT_FIELDS))
@pytest.mark.parametrize("name", ["kv129_g7_ps64", "kv4095_g8_ps64", "kv4097_prefix_g3_d64", "kv4096_g1_d256",
                                  "large_logits_g8"])
def test_fp8_kernel_variants_meet_the_same_budgets(name, variant):
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    cpu = _inputs(name)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    d = cpu[0].shape[2]
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    index = flashprefill.build_index(*gpu, SPARSE, plan=plan, precision="fp8")
    base = get_config(d, torch.bfloat16, SPARSE.block_size, precision="fp8", variant="plain")
    kcfg = dataclasses.replace(base, attn=dataclasses.replace(base.attn, **VARIANT_FIELDS[variant]))
    scale = d ** -0.5
    out = host.sparse_attention(*gpu, SPARSE, scale, plan, index, kernels=kcfg, precision="fp8")[0]
    shipped = host.sparse_attention(*gpu, SPARSE, scale, plan, index, kernels=base, precision="fp8")[0]
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert not torch.equal(out, torch.zeros_like(out))
    cidx = dataclasses.replace(index, **{f.name: getattr(index, f.name).cpu() for f in dataclasses.fields(index)
                                         if isinstance(getattr(index, f.name), torch.Tensor)})
    cplan = make_plan(cpu[4], cpu[5], g, SPARSE.block_size)
    want, _ = R.sparse_attention(*cpu, SPARSE, scale, cplan, cidx, precision="fp8")
    want16, _ = R.sparse_attention(*cpu, SPARSE, scale, cplan, cidx)
    e = rel(want, want16)
    assert rel(out.cpu(), want16) <= TRACK_FACTOR * e + BF16_FLOOR
    assert rel(out.cpu(), want) <= SAME_FACTOR * e + BF16_FLOOR
    assert rel(out, shipped) <= SAME_FACTOR * e + BF16_FLOOR


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name", ["kv127_g1_ps16", "kv129_g7_ps64", "kv4095_g8_ps64", "kv4097_prefix_g3_d64",
                                  "kv4096_g1_d256", "large_logits_g8"])
def test_fp8_pipelined_loop_equals_the_shipped_loop(name, fold):
    """``AttnConfig.pipeline`` reorders the issue of the same products (docs/fp8.md): output and LSE
    as the unpipelined loop's up to fp32 rounding order (bf16 output: a few units of its 2^-8)."""
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    gpu = _cuda(_inputs(name))
    g = gpu[0].shape[1] // gpu[1].shape[2]
    d = gpu[0].shape[2]
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    index = flashprefill.build_index(*gpu, SPARSE, plan=plan, precision="fp8")
    base = get_config(d, torch.bfloat16, SPARSE.block_size, precision="fp8", variant="plain")
    plain = dataclasses.replace(base, attn=dataclasses.replace(base.attn, fold_scale=fold))
    piped = dataclasses.replace(base, attn=dataclasses.replace(base.attn, fold_scale=fold, pipeline=True))
    scale = d ** -0.5
    for sparse in (True, False):
        if sparse:
            o1, l1 = host.sparse_attention(*gpu, SPARSE, scale, plan, index, kernels=piped, precision="fp8")[:2]
            o2, l2 = host.sparse_attention(*gpu, SPARSE, scale, plan, index, kernels=plain, precision="fp8")[:2]
        else:
            o1, l1 = host.dense_attention(*gpu, scale, plan, kernels=piped, precision="fp8")[:2]
            o2, l2 = host.dense_attention(*gpu, scale, plan, kernels=plain, precision="fp8")[:2]
        torch.cuda.synchronize()
        assert torch.isfinite(o1).all() and not torch.equal(o1, torch.zeros_like(o1))
        assert rel(o1, o2) <= 2e-3, (sparse, rel(o1, o2))
        fin = torch.isfinite(l2)
        assert torch.equal(torch.isfinite(l1), fin)
        assert float((l1[fin] - l2[fin]).abs().max()) <= 1e-4


@pytest.mark.parametrize("name", ["kv127_g1_ps16", "kv129_g7_ps64", "kv4095_g8_ps64", "kv4097_prefix_g3_d64",
                                  "kv4096_g1_d256", "large_logits_g8"])
def test_fp8_fused_amax_and_mean_vec_equal_the_shipped_path(name):
    """``IndexConfig.fused_amax`` reduces the same max |K| / |V| in the block-means kernels (a max is
    exact in any order): the same scales, selection, pre-pass buffers and output bit for bit; with
    ``hw_cvt`` too (the same codes by the hardware cast).
    ``AttnConfig.mean_vec`` loads extra V-mean columns (the request's later blocks or the zero gap)
    whose logits are -inf: P = 0 against finite codes adds exact zeros, so the output and LSE are the
    shipped kernel's bit for bit; alone and with pipeline + fold_scale."""
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton import quant_kernels as qk
    from flashprefill.impl.triton.tiles import get_config

    gpu = _cuda(_inputs(name))
    g = gpu[0].shape[1] // gpu[1].shape[2]
    d = gpu[0].shape[2]
    scale = d ** -0.5
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    base = get_config(d, torch.bfloat16, SPARSE.block_size, precision="fp8", variant="plain")
    fused = dataclasses.replace(base, index=dataclasses.replace(base.index, fused_amax=True))
    i0 = host.build_index(*gpu, SPARSE, scale, plan, kernels=base, precision="fp8")
    i1 = host.build_index(*gpu, SPARSE, scale, plan, kernels=fused, precision="fp8")
    # IndexConfig.hw_cvt: the selection's Q codes and the pre-pass's codes by the hardware cast alone
    hw = dataclasses.replace(base, index=dataclasses.replace(base.index, fused_amax=True, hw_cvt=True))
    i2 = host.build_index(*gpu, SPARSE, scale, plan, kernels=hw, precision="fp8")
    assert torch.equal(i0.row_ptr, i2.row_ptr) and torch.equal(i0.col_idx, i2.col_idx)
    o4, l4 = host.sparse_attention(*gpu, SPARSE, scale, plan, i2, kernels=hw, precision="fp8")
    assert i0.kv_amax is None and i1.kv_amax is not None
    want = qk.kv_amax_scales(gpu[1], gpu[2], gpu[3], gpu[4], plan)
    got = quant.amax_scales(i1.kv_amax)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(i0.row_ptr, i1.row_ptr) and torch.equal(i0.col_idx, i1.col_idx)
    assert torch.equal(i0.k_mean, i1.k_mean) and torch.equal(i0.v_mean, i1.v_mean)
    kv0 = host_fp8.kv_operands(gpu[1], gpu[2], gpu[3], gpu[4], plan)
    kv1 = host_fp8.kv_operands(gpu[1], gpu[2], gpu[3], gpu[4], plan, amax=i1.kv_amax)
    assert torch.equal(kv0.k8.view(torch.uint8), kv1.k8.view(torch.uint8))
    assert torch.equal(kv0.v8t.view(torch.uint8), kv1.v8t.view(torch.uint8))
    o0, l0 = host.sparse_attention(*gpu, SPARSE, scale, plan, i0, kernels=base, precision="fp8")
    o1, l1 = host.sparse_attention(*gpu, SPARSE, scale, plan, i1, kernels=fused, precision="fp8")
    assert torch.isfinite(o1).all() and not torch.equal(o1, torch.zeros_like(o1))
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    assert torch.equal(o0, o4) and torch.equal(l0, l4)
    for fields in (dict(), dict(pipeline=True, fold_scale=True)):
        plain = dataclasses.replace(base, attn=dataclasses.replace(base.attn, **fields))
        vec = dataclasses.replace(base, attn=dataclasses.replace(base.attn, mean_vec=True, **fields))
        o2, l2 = host.sparse_attention(*gpu, SPARSE, scale, plan, i0, kernels=plain, precision="fp8")
        o3, l3 = host.sparse_attention(*gpu, SPARSE, scale, plan, i0, kernels=vec, precision="fp8")
        torch.cuda.synchronize()
        assert torch.equal(o2, o3) and torch.equal(l2, l3), (fields, rel(o3, o2))


@pytest.mark.parametrize("name", ["kv127_g1_ps16", "kv129_g7_ps64", "kv4095_g8_ps64", "kv4097_prefix_g3_d64",
                                  "kv4096_g1_d256", "large_logits_g8"])
def test_fp8_loop_guard_equals_the_shipped_kernel(name):
    """``AttnConfig.loop_guard`` runs the same steps on the same values (it only skips a loop of zero
    steps); what changes is ptxas' wgmma scheduling (no C7515: the products are no longer each
    waited for right after issue), not an operation: output and LSE bit for bit the shipped
    kernel's, sparse with and without the mean correction and dense, alone and with mean_vec +
    fold_scale."""
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    gpu = _cuda(_inputs(name))
    g = gpu[0].shape[1] // gpu[1].shape[2]
    d = gpu[0].shape[2]
    scale = d ** -0.5
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    base = get_config(d, torch.bfloat16, SPARSE.block_size, precision="fp8", variant="plain")
    index = host.build_index(*gpu, SPARSE, scale, plan, kernels=base, precision="fp8")
    no_mc = dataclasses.replace(SPARSE, mean_correction=False)
    for fields in (dict(), dict(mean_vec=True, fold_scale=True)):
        plain = dataclasses.replace(base, attn=dataclasses.replace(base.attn, **fields))
        guarded = dataclasses.replace(base, attn=dataclasses.replace(base.attn, loop_guard=True, **fields))
        for mode in ("bits", "nomc", "dense"):
            runs = []
            for kcfg in (plain, guarded):
                if mode == "dense":
                    runs.append(host.dense_attention(*gpu, scale, plan, kernels=kcfg, precision="fp8")[:2])
                else:
                    cfg = SPARSE if mode == "bits" else no_mc
                    runs.append(host.sparse_attention(*gpu, cfg, scale, plan, index, kernels=kcfg,
                                                      precision="fp8")[:2])
            torch.cuda.synchronize()
            (o0, l0), (o1, l1) = runs
            assert torch.isfinite(o1).all() and not torch.equal(o1, torch.zeros_like(o1)), (fields, mode)
            assert torch.equal(o0, o1) and torch.equal(l0, l1), (fields, mode, rel(o1, o0))
