"""The warp-specialised Gluon FP8 attention (``attention_fp8_ws_kernels``, ``AttnConfig.impl =
"gluon_ws"``, docs/fp8.md section 11) on the H200: against the FP8 reference and BF16 with the budgets
of ``test_fp8.py``, and against the Triton FP8 kernel (the same products in another order) on the same
index, with and without the mean correction, at tile and block boundaries, GQA 1 / 3 / 7 / 8, page
sizes 1 / 16 / 64, a prefix, two requests, and several chunks of mean keys.

Run on the device: ``PYTHONPATH=kernels:.:tests pytest tests/gpu/test_fp8_ws.py -q -x``.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import flashprefill
from flashprefill import make_plan
from flashprefill.impl import reference as R
from fp8_cases import BF16_FLOOR, CASES, SAME_FACTOR, SPARSE, TRACK_FACTOR, cuda as _cuda, inputs as _inputs, rel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU (TMA, e4m3 wgmma, setmaxnreg)")

WS_CASES = [n for n, c in CASES.items() if c[4] in (64, 128)]


def _configs(d: int):
    from flashprefill.impl.triton.tiles import get_config

    return (get_config(d, torch.bfloat16, 128, precision="fp8", variant="triton_fp8"),
            get_config(d, torch.bfloat16, 128, precision="fp8", variant="gluon_ws"))


def _assert_like_triton(out, lse, want, want_lse, lse_tol):
    assert torch.isfinite(out).all() and not torch.equal(out, torch.zeros_like(out))
    assert rel(out, want) <= 2e-3, rel(out, want)
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert float((lse[fin] - want_lse[fin]).abs().max()) <= lse_tol


def _two_requests(d: int, hq: int, hkv: int):
    """Two requests of 20,000 tokens (``flashprefill.bench``'s synthetic inputs, page 64) with the
    default ``SparseConfig``: ``(config, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q,
    scale, plan)``."""
    from flashprefill import SparseConfig
    from flashprefill.bench import synthetic_inputs

    config = SparseConfig()
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(20000, hq, hkv, d, torch.bfloat16, 64, 2)
    return config, q, kc, vc, pt, sl, cu, 1.0 / math.sqrt(d), make_plan(sl, cu, hq // hkv, config.block_size)


@pytest.mark.parametrize("mean_correction", [True, False])
@pytest.mark.parametrize("name", WS_CASES)
def test_gluon_fp8_meets_the_fp8_budgets_and_equals_the_triton_kernel(name, mean_correction):
    from flashprefill.impl.triton import host

    config = dataclasses.replace(SPARSE, mean_correction=mean_correction)
    cpu = _inputs(name)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    d = cpu[0].shape[2]
    scale = d ** -0.5
    plan = make_plan(gpu[4], gpu[5], g, config.block_size)
    index = flashprefill.build_index(*gpu, config, plan=plan, precision="fp8")
    triton_cfg, ws_cfg = _configs(d)
    out, lse = host.sparse_attention(*gpu, config, scale, plan, index, kernels=ws_cfg, precision="fp8")
    want, want_lse = host.sparse_attention(*gpu, config, scale, plan, index, kernels=triton_cfg, precision="fp8")
    torch.cuda.synchronize()
    # the Triton kernel: the same codes and products; the correction's log2 n_j enters in units of
    # the raw sum (one FFMA per logit), a few float32 ulps of the logit
    _assert_like_triton(out, lse, want, want_lse, 1e-3 if mean_correction else 1e-4)
    cidx = dataclasses.replace(index, **{f.name: getattr(index, f.name).cpu() for f in dataclasses.fields(index)
                                         if isinstance(getattr(index, f.name), torch.Tensor)})
    cplan = make_plan(cpu[4], cpu[5], g, config.block_size)
    ref8, _ = R.sparse_attention(*cpu, config, scale, cplan, cidx, precision="fp8")
    ref16, _ = R.sparse_attention(*cpu, config, scale, cplan, cidx)
    e = rel(ref8, ref16)
    assert rel(out.cpu(), ref16) <= TRACK_FACTOR * e + BF16_FLOOR
    assert rel(out.cpu(), ref8) <= SAME_FACTOR * e + BF16_FLOOR


@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (64, 7, 1)])
def test_several_chunks_of_mean_keys_and_two_requests(d, hq, hkv):
    """Two requests of 20,000 tokens (157 key blocks: the last tiles' correction walks two chunks of
    128 candidates, the second one partly past ``n_u``), page 64: the Gluon kernel against the Triton
    one on the same index, with the correction (and the operator total through ``host.attention``)."""
    from flashprefill.impl.triton import host

    config, q, kc, vc, pt, sl, cu, scale, plan = _two_requests(d, hq, hkv)
    triton_cfg, ws_cfg = _configs(d)
    index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=triton_cfg, precision="fp8")
    out, lse = host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index, kernels=ws_cfg,
                                     precision="fp8")
    want, want_lse = host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index, kernels=triton_cfg,
                                           precision="fp8")
    _assert_like_triton(out, lse, want, want_lse, 1e-3)
    total = host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=ws_cfg, precision="fp8")[0]
    assert rel(total, want) <= 2e-3


@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (64, 7, 1)])
def test_the_operands_the_index_prepares_give_the_attention_bit_for_bit(d, hq, hkv):
    """The default tiles on sm_90 (``impl="auto"``: the Gluon kernel): ``host.build_index`` attaches
    the FP8 operands laid out for it (``BlockIndex.fp8_operands``, made before the ``nnz`` sync), and
    ``host.sparse_attention`` on them equals, bit for bit, the attention that makes its own (an index
    without them), on two requests of 20,000 tokens with the correction."""
    from flashprefill.impl.triton import host, host_fp8

    config, q, kc, vc, pt, sl, cu, scale, plan = _two_requests(d, hq, hkv)
    index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, precision="fp8")
    ops = index.fp8_operands
    assert isinstance(ops, host_fp8.Fp8Operands) and ops.ws and ops.mean_correction
    out, lse = host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index, precision="fp8")
    bare = dataclasses.replace(index, fp8_operands=None)
    want, want_lse = host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, bare, precision="fp8")
    assert torch.isfinite(out).all() and torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (64, 7, 1)])
def test_v_in_the_wgmma_order_gives_the_token_orders_attention(d, hq, hkv):
    """``Fp8KV.v_perm`` (what ``host_fp8.prepare`` makes for this kernel: V and the means' values in the
    wgmma order, ``P8`` to the ``P V`` wgmma without a layout conversion) against token order
    (``V_PERM`` off: the codes converted each step), on two requests of 20,000 tokens with the
    correction: the pre-pass's permuted V equals the token order's bytes permuted
    (``quant_kernels.wgmma_slot``, the GPU's compiled permutation), the LSE is bit for bit the same (it
    does not read V) and the output the same products summed in another order."""
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton import quant_kernels as qk

    config, q, kc, vc, pt, sl, cu, scale, plan = _two_requests(d, hq, hkv)
    _, ws_cfg = _configs(d)
    index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=ws_cfg, precision="fp8")
    runs = {}
    for v_perm in (False, True):
        kv = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index.kv_amax, hw_cvt=ws_cfg.index.hw_cvt,
                                  v_perm=v_perm)
        assert kv.v_perm == v_perm
        runs[v_perm] = kv, host_fp8.launch_attention_fp8_ws(q, kv, sl, cu, scale, plan, ws_cfg.attn,
                                                            mean_correction=True, block_size=128, index=index)
    torch.cuda.synchronize()
    (tok, (want, want_lse)), (wg, (out, lse)) = runs[False], runs[True]
    slot = qk.wgmma_slot(torch.arange(tok.v8t.shape[2], device=q.device))
    assert torch.equal(wg.v8t.view(torch.uint8)[:, :, slot], tok.v8t.view(torch.uint8))
    assert torch.equal(wg.k8.view(torch.uint8), tok.k8.view(torch.uint8))
    assert torch.isfinite(out).all() and torch.equal(lse, want_lse)
    assert rel(out, want) <= 1e-5, rel(out, want)
    ops = index.fp8_operands
    assert ops.ws and ops.kv.v_perm


def test_the_timing_stamps_follow_the_steps_and_leave_the_output_alone():
    """``launch_attention_fp8_ws(timing=)`` (the lab's ``gluon_fp8.py phases``): per program the stamps
    ascend (start, consumer, first correction step, loop end, stores end), the exact steps are the
    CSR row's length, some programs have correction steps, the SM ids are the GPU's, and the output
    equals the untimed launch's bit for bit."""
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config

    config, q, kc, vc, pt, sl, cu, _, plan = _two_requests(128, 8, 2)
    kcfg = get_config(128, torch.bfloat16, config.block_size, precision="fp8", variant="gluon_ws")
    index = host.build_index(q, kc, vc, pt, sl, cu, config, 128 ** -0.5, plan, kernels=kcfg, precision="fp8")
    ops = index.fp8_operands
    stamps = torch.zeros(plan.n_tiles * 2, 8, dtype=torch.int64, device="cuda")

    def run(timing=None):
        return host_fp8.launch_attention_fp8_ws(q, ops.kv, sl, cu, 128 ** -0.5, plan, kcfg.attn, mean_correction=True,
                                                block_size=config.block_size, index=index, means=ops.means,
                                                timing=timing)

    want = run()
    got = run(stamps)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    t = stamps.cpu()
    assert bool((t[:, 1:5] >= t[:, 0:4]).all()) and bool((t[:, 0] > 0).all())
    # program pid = KV head + Hkv * (n_tiles - 1 - tile): its segment is h * n_tiles + tile
    pid = torch.arange(t.shape[0])
    seg = (pid % 2) * plan.n_tiles + (plan.n_tiles - 1 - pid // 2)
    counts = (index.row_ptr[1:] - index.row_ptr[:-1]).cpu().long()
    assert torch.equal(t[:, 6], counts[seg]) and int(t[:, 7].sum()) > 0
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    assert bool((t[:, 5] >= 0).all()) and bool((t[:, 5] < n_sm).all())


def test_an_unsupported_head_dim_is_refused_before_any_launch():
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    cpu = _inputs("kv4096_g1_d256")
    gpu = _cuda(cpu)
    plan = make_plan(gpu[4], gpu[5], 1, 128)
    index = flashprefill.build_index(*gpu, SPARSE, plan=plan, precision="fp8")
    ws = get_config(256, torch.bfloat16, 128, precision="fp8", variant="gluon_ws")
    with pytest.raises(ValueError, match=r"d=256.*impl='triton'"):
        host.sparse_attention(*gpu, SPARSE, 256 ** -0.5, plan, index, kernels=ws, precision="fp8")


@pytest.mark.parametrize("name", ["kv4095_g8_ps64", "kv4096_g1_d256"])
def test_auto_runs_the_gluon_kernel_where_it_can_and_triton_elsewhere(name):
    """``AttnConfig.impl = "auto"``: at d 128 the Gluon kernel's output bit for bit; at d 256 (which it
    cannot run) the Triton kernel's, without an error."""
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    cpu = _inputs(name)
    gpu = _cuda(cpu)
    g = cpu[0].shape[1] // cpu[1].shape[2]
    d = cpu[0].shape[2]
    plan = make_plan(gpu[4], gpu[5], g, SPARSE.block_size)
    index = flashprefill.build_index(*gpu, SPARSE, plan=plan, precision="fp8")
    base = get_config(d, torch.bfloat16, 128, precision="fp8")
    auto = dataclasses.replace(base, attn=dataclasses.replace(base.attn, impl="auto"))
    want_cfg = get_config(d, torch.bfloat16, 128, precision="fp8", variant="gluon_ws") if d in (64, 128) else base
    got = host.sparse_attention(*gpu, SPARSE, d ** -0.5, plan, index, kernels=auto, precision="fp8")[0]
    want = host.sparse_attention(*gpu, SPARSE, d ** -0.5, plan, index, kernels=want_cfg, precision="fp8")[0]
    assert torch.isfinite(got).all() and torch.equal(got, want)


def _nan_in_second_request(which):
    """Two requests of 300 tokens (request 1's K / V slots start at 384 in the pre-pass buffers,
    ``quant_kernels.REQUEST_ALIGN``; before the fix at 304, inside request 0's last 128-key box),
    page 16, d 128, GQA 4; request 1's ``which`` ("k" or "v") at its token 10, KV head 0, is NaN
    (so is its first block mean, read by request 0's correction box of 128 candidates)."""
    from fp_brute import make_inputs

    q, k, v, pt, sl, cu = make_inputs([300, 300], [300, 300], 8, 2, 128, 16, dtype=torch.float32, seed=3,
                                      structured=True)
    page, slot = int(pt[1, 10 // 16]), 10 % 16
    (k if which == "k" else v)[page, slot, 0] = float("nan")
    gpu = tuple((t.to(torch.bfloat16) if t.is_floating_point() else t).cuda() for t in (q, k, v, pt, sl, cu))
    return gpu, make_plan(gpu[4], gpu[5], 4, 128)


def _rows_of_each_request(impl_variant, which):
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    gpu, plan = _nan_in_second_request(which)
    index = flashprefill.build_index(*gpu, SPARSE, plan=plan, precision="fp8")
    kernels = get_config(128, torch.bfloat16, 128, precision="fp8", variant=impl_variant)
    out = host.sparse_attention(*gpu, SPARSE, 128 ** -0.5, plan, index, kernels=kernels, precision="fp8")[0]
    return out[:300], out[300:]


@pytest.mark.parametrize("which", ["v", "k"])
@pytest.mark.parametrize("impl_variant", ["triton_fp8", "gluon_ws"])
def test_a_nan_in_one_requests_keys_or_values_stays_in_that_request(impl_variant, which):
    """docs/fp8.md section 2: a NaN poisons the rows that read it, and only those. The Triton kernel
    masks K / V past the request's aligned length; the Gluon kernel's 128-token boxes end in the
    request's own zero gap (``REQUEST_ALIGN``, docs/fp8.md section 11), where a box of the old 16-slot
    layout read request 1's NaN value (0 x NaN = NaN in the P V wgmma). Request 1's rows do read the
    NaN: the test would pass on a kernel that dropped it."""
    if impl_variant == "gluon_ws" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90 only")
    first, second = _rows_of_each_request(impl_variant, which)
    assert torch.isfinite(first).all()
    assert not torch.isfinite(second).all()
