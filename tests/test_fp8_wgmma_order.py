"""V in the Gluon kernel's wgmma order (``quant_kernels.wgmma_slot``, ``Fp8KV.v_perm``,
``docs/fp8.md`` section 11): the order makes the ``S`` accumulator's registers the ``P V`` A operand's
registers, so ``P8`` needs no layout conversion. Here, on the CPU: the order against the two wgmma
fragment layouts written from the PTX ISA, and every producer of the order (the e4m3 caches'
gather, the block means' columns, ``host_fp8.prepare``) against the token order, byte for byte; the
Triton kernel refuses it. The pre-pass kernel's own permutation runs under the interpreter
(``test_fp8_quant_interpret.py``); the Gluon kernel on it, on the H200 (``tests/gpu/test_fp8_ws.py``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashprefill import make_plan, quant
from flashprefill.impl.triton import host_fp8
from flashprefill.impl.triton import quant_kernels as qk
from flashprefill.impl.triton.tiles import get_config


def _acc_cols(lane: int, chunk: int) -> list[int]:
    """Columns of one row that ``lane`` holds in a wgmma f32 accumulator (m64nNk32, PTX ISA "Matrix
    fragments for wgmma", D: ``col = 8 i + 2 (lane % 4) + {0, 1}``) within 32-column chunk ``chunk``,
    in register order."""
    q = lane % 4
    return [32 * chunk + 8 * i + 2 * q + b for i in range(4) for b in range(2)]


def _a_cols(lane: int, chunk: int) -> list[int]:
    """Columns of one row that ``lane`` holds in an 8-bit wgmma A operand from registers (k32 per
    instruction: ``col = 4 (lane % 4) + {0..3}`` and ``16 + 4 (lane % 4) + {0..3}``), in register order."""
    q = lane % 4
    return [32 * chunk + 16 * half + 4 * q + j for half in range(2) for j in range(4)]


def test_the_wgmma_order_puts_each_accumulator_register_where_the_a_operand_reads_it():
    for chunk in range(4):                          # a key block of 128: four k32 steps of P V
        for lane in range(32):
            got = qk.wgmma_slot(torch.tensor(_acc_cols(lane, chunk))).tolist()
            assert got == _a_cols(lane, chunk), (lane, chunk)
    pos = torch.arange(4096)
    slot = qk.wgmma_slot(pos)
    assert torch.equal(torch.sort(slot).values, pos)                 # a permutation
    assert torch.equal(slot // 16, pos // 16)                        # of each 16
    assert not torch.equal(slot, pos)


def _plan(kv_lens, q_lens, block_size=128):
    sl = torch.tensor(kv_lens, dtype=torch.int32)
    cu = torch.tensor([0] + torch.cumsum(torch.tensor(q_lens), 0).tolist(), dtype=torch.int32)
    return make_plan(sl, cu, 2, block_size), sl, cu


def _e4m3_caches(kv_lens, hkv=2, d=64, page=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pages = [-(-lk // page) for lk in kv_lens]
    n_pages = sum(pages) + 3
    k = (torch.randn(n_pages, page, hkv, d, generator=g) * 40).to(quant.E4M3)
    v = (torch.randn(n_pages, page, hkv, d, generator=g) * 40).to(quant.E4M3)
    perm = torch.randperm(n_pages, generator=g).to(torch.int32)    # pages out of order
    pt = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages):
        pt[b, :n] = perm[at:at + n]
        at += n
    return k, v, pt


KV_LENS = [([300, 37, 1000], [300, 5, 17]), ([129], [129]), ([16], [3])]


@pytest.mark.parametrize("kv_lens,q_lens", KV_LENS)
def test_the_e4m3_caches_gather_v_into_the_wgmma_order(kv_lens, q_lens):
    plan, _, _ = _plan(kv_lens, q_lens)
    k, v, pt = _e4m3_caches(kv_lens)
    ks, vs = torch.tensor(0.5), torch.tensor(0.25)
    tok = qk.gather_e4m3_kv(k, v, pt, plan, ks, vs)
    wg = qk.gather_e4m3_kv(k, v, pt, plan, ks, vs, v_perm=True)
    assert not tok.v_perm and wg.v_perm
    u8 = lambda t: t.view(torch.uint8)
    assert torch.equal(u8(wg.k8), u8(tok.k8)) and torch.equal(wg.cu_seqlens_k, tok.cu_seqlens_k)
    slot = qk.wgmma_slot(torch.arange(tok.v8t.shape[2]))
    assert torch.equal(u8(wg.v8t)[:, :, slot], u8(tok.v8t))
    assert bool(u8(tok.v8t).any()) and not torch.equal(u8(wg.v8t), u8(tok.v8t))


@pytest.mark.parametrize("kv_lens,q_lens", [([300, 37, 1000], [300, 5, 17]), ([5000], [5000]), ([400, 2100], [1, 2])])
def test_the_block_means_columns_follow_v_into_the_wgmma_order(kv_lens, q_lens):
    plan, _, _ = _plan(kv_lens, q_lens)
    k, v, pt = _e4m3_caches(kv_lens)
    tok = qk.gather_e4m3_kv(k, v, pt, plan, torch.tensor(0.5), torch.tensor(0.25))
    wg = dataclasses.replace(tok, v_perm=True)
    g = torch.Generator().manual_seed(3)
    k_mean = torch.randn(plan.n_blocks, 2, 64, generator=g) * 5
    v_mean = torch.randn(plan.n_blocks, 2, 64, generator=g) * 5
    k8a, v8a, cu_a = qk.quantize_means(k_mean, v_mean, tok, plan, aligned=True)
    k8p, v8p, cu_p = qk.quantize_means(k_mean, v_mean, wg, plan, aligned=True)
    u8 = lambda t: t.view(torch.uint8)
    assert torch.equal(u8(k8p), u8(k8a)) and torch.equal(cu_p, cu_a)
    slot = qk.wgmma_slot(torch.arange(v8a.shape[2]))
    assert torch.equal(u8(v8p)[:, :, slot], u8(v8a)) and bool(u8(v8a).any())
    assert not torch.equal(u8(v8p), u8(v8a))           # a request with 3+ blocks: columns move
    with pytest.raises(ValueError, match="needs aligned=True"):
        qk.quantize_means(k_mean, v_mean, wg, plan)


def test_the_triton_kernel_refuses_v_in_the_wgmma_order():
    plan, sl, cu = _plan([300], [300])
    k, v, pt = _e4m3_caches([300])
    kv = qk.gather_e4m3_kv(k, v, pt, plan, torch.tensor(1.0), torch.tensor(1.0), v_perm=True)
    q = torch.randn(300, 4, 64, dtype=torch.bfloat16)
    tiles = get_config(64, torch.bfloat16, 128, precision="fp8").attn
    with pytest.raises(ValueError, match="reads V in token order"):
        host_fp8.launch_attention_fp8(q, kv, sl, cu, 0.125, plan, tiles, sparse=True, mean_correction=True,
                                      block_size=128)


@pytest.mark.parametrize("ws", [True, False])
def test_prepare_lays_v_out_for_the_kernel_that_will_read_it(monkeypatch, ws):
    """``host_fp8.prepare`` asks for the wgmma order exactly where ``runs_ws`` sends the launch to the
    Gluon kernel (answered here as on an H200 or not), for V and for the means' values alike."""
    monkeypatch.setattr(host_fp8, "runs_ws", lambda *a: ws)
    kv_lens, q_lens = [300, 37], [300, 5]
    plan, sl, cu = _plan(kv_lens, q_lens)
    k, v, pt = _e4m3_caches(kv_lens)
    g = torch.Generator().manual_seed(5)
    k_mean = torch.randn(plan.n_blocks, 2, 64, generator=g)
    v_mean = torch.randn(plan.n_blocks, 2, 64, generator=g)
    bits = torch.zeros(plan.n_tiles * 2, 1, dtype=torch.int32)
    q = torch.randn(305, 4, 64, dtype=torch.bfloat16)
    tiles = get_config(64, torch.bfloat16, 128, precision="fp8").attn
    ops = host_fp8.prepare(q, k, v, pt, sl, plan, tiles, k_mean=k_mean, v_mean=v_mean, bits=bits, row_ptr=None,
                           mean_correction=True, block_size=128, k_descale=torch.tensor(0.5),
                           v_descale=torch.tensor(0.25))
    assert ops.ws == ws and ops.kv.v_perm == ws
    tok = qk.gather_e4m3_kv(k, v, pt, plan, torch.tensor(0.5), torch.tensor(0.25))
    _, v8a, _ = qk.quantize_means(k_mean, v_mean, tok, plan, aligned=True)
    u8 = lambda t: t.view(torch.uint8)
    if ws:
        assert torch.equal(u8(ops.kv.v8t)[:, :, qk.wgmma_slot(torch.arange(tok.v8t.shape[2]))], u8(tok.v8t))
        assert torch.equal(u8(ops.means.v_mean8t)[:, :, qk.wgmma_slot(torch.arange(v8a.shape[2]))], u8(v8a))
    else:
        assert torch.equal(u8(ops.kv.v8t), u8(tok.v8t))
    assert ops.means.v_perm == ws


def test_means_in_another_v_order_than_v_are_refused_by_both_launchers(monkeypatch):
    """``MeanOperands.v_perm`` records the V order the means were made for; a launch with V in the
    other order would weigh the wrong mean values, so both launchers refuse it before any work (the
    Gluon launcher with ``ws_unsupported`` answered as on an H200)."""
    plan, sl, cu = _plan([300], [300])
    k, v, pt = _e4m3_caches([300])
    tok = qk.gather_e4m3_kv(k, v, pt, plan, torch.tensor(1.0), torch.tensor(1.0))
    wg = qk.gather_e4m3_kv(k, v, pt, plan, torch.tensor(1.0), torch.tensor(1.0), v_perm=True)
    g = torch.Generator().manual_seed(7)
    k_mean, v_mean = torch.randn(plan.n_blocks, 2, 64, generator=g), torch.randn(plan.n_blocks, 2, 64, generator=g)
    bits = torch.zeros(plan.n_tiles * 2, 1, dtype=torch.int32)
    args = dict(mean_correction=True, block_size=128, ws=True)
    means_tok = host_fp8.correction_operands(k_mean, v_mean, bits, None, tok, plan, **args)
    means_wg = host_fp8.correction_operands(k_mean, v_mean, bits, None, wg, plan, **args)
    assert not means_tok.v_perm and means_wg.v_perm
    q = torch.randn(300, 4, 64, dtype=torch.bfloat16)
    tiles = get_config(64, torch.bfloat16, 128, precision="fp8").attn

    class _Index:
        row_ptr = torch.zeros(plan.n_tiles * 2 + 1, dtype=torch.int32)
        col_idx = torch.zeros(1, dtype=torch.int32)

    with pytest.raises(ValueError, match="means' values are in the wgmma order but V is in token order"):
        host_fp8.launch_attention_fp8(q, tok, sl, cu, 0.125, plan, tiles, sparse=True, mean_correction=True,
                                      block_size=128, index=_Index(), means=means_wg)
    monkeypatch.setattr(host_fp8, "ws_unsupported", lambda *a: None)
    with pytest.raises(ValueError, match="means' values are in token order but V is in the wgmma order"):
        host_fp8.launch_attention_fp8_ws(q, wg, sl, cu, 0.125, plan, tiles, mean_correction=True, block_size=128,
                                         index=_Index(), means=means_tok)
