"""``flashprefill.integrations.decode_masked``: decode attention over a static-size KV cache under a
key mask (what the captured decode step runs), on the CPU against a float64 reference.

The reference is written out here (scores, softmax over the valid positions only, weighted sum),
not SDPA: it sees only the first ``valid_len`` slots, so garbage in the slots past them (large
keys, huge values) must not leak into the result. Lengths are awkward (prime, not multiples of the
split count), GQA groups 1 / 2 / 7, ``valid_len`` at 1, mid and full; the split count changes the
order of the sums only. bf16 inputs are checked against the same reference within a budget taken
from a bf16 run of the plain formula.
"""
from __future__ import annotations

import pytest
import torch

from flashprefill.integrations.decode_masked import KV_SPLITS, decode_masked, kv_splits

GARBAGE_K, GARBAGE_V = 300.0, -1e4  # unwritten slots: a leak of either dominates the output


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of ``q [B, Hq, Lq, d]`` over the keys ``valid [Lq, Lmax]`` (bool) lets each
    query position see -> ``[B, Lq, Hq, dv]``; query head ``h`` reads KV head ``h // g``."""
    b, hq, lq, _ = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(b, lq, hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // g].double(), v[:, h // g].double()  # [B, Lmax, d]
        for t in range(lq):
            keep = valid[t]
            s = torch.einsum("bd,bld->bl", q[:, h, t].double(), kh[:, keep]) * scale
            out[:, t, h] = torch.einsum("bl,bld->bd", torch.softmax(s, dim=-1), vh[:, keep])
    return out


def inputs(hkv: int, g: int, lmax: int, d: int = 16, lq: int = 1, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hkv * g, lq, d, generator=gen) * 2
    k = torch.randn(1, hkv, lmax, d, generator=gen)
    v = torch.randn(1, hkv, lmax, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def poison(k: torch.Tensor, v: torch.Tensor, valid_len: int) -> None:
    k[:, :, valid_len:] = GARBAGE_K
    v[:, :, valid_len:] = GARBAGE_V


@pytest.mark.parametrize("g", [1, 2, 7])
@pytest.mark.parametrize("lmax, valid_len", [(1, 1), (37, 1), (37, 19), (37, 37), (300, 1), (300, 161), (300, 300),
                                             (1031, 517), (4096, 4095)])
def test_equals_float64_reference_over_the_valid_slots(g, lmax, valid_len):
    q, k, v = inputs(2, g, lmax, seed=lmax + valid_len + g)
    poison(k, v, valid_len)
    valid = (torch.arange(lmax) < valid_len)[None, :]
    mask = valid.view(1, 1, 1, lmax)
    got = decode_masked(q, k, v, mask, scale=0.3)
    assert got.shape == (1, 1, 2 * g, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(q, k, v, valid, 0.3), rtol=2e-5, atol=2e-6)


def test_garbage_would_show_if_the_mask_let_it_in():
    """The checks above can fail: the same inputs with one garbage slot let in differ by far more
    than their tolerance."""
    q, k, v = inputs(2, 7, 300, seed=1)
    poison(k, v, 161)
    valid = torch.arange(300) < 161
    good = decode_masked(q, k, v, valid.view(1, 1, 1, 300), scale=0.3)
    leaky = valid.clone()
    leaky[161] = True
    bad = decode_masked(q, k, v, leaky.view(1, 1, 1, 300), scale=0.3)
    assert (bad - good).abs().max() > 100


@pytest.mark.parametrize("splits", [1, 2, 5, 10, 50, 300])
def test_every_split_count_gives_the_same_attention(splits):
    q, k, v = inputs(3, 2, 300, d=8, seed=splits)
    poison(k, v, 123)
    valid = (torch.arange(300) < 123)[None, :]
    got = decode_masked(q, k, v, valid.view(1, 1, 1, 300), scale=0.5, splits=splits)
    torch.testing.assert_close(got.double(), reference(q, k, v, valid, 0.5), rtol=2e-5, atol=2e-6)


def test_a_few_query_rows_with_their_own_masks():
    """``Lq = 3`` new tokens after 200 cached ones (bottom-right causal), slots past 203 unwritten."""
    lq, lmax, n = 3, 256, 200
    q, k, v = inputs(2, 7, lmax, lq=lq, seed=4)
    poison(k, v, n + lq)
    valid = torch.arange(lmax)[None, :] <= (n + torch.arange(lq))[:, None]  # row t sees 0 .. n + t
    got = decode_masked(q, k, v, valid.view(1, 1, lq, lmax), scale=0.25)
    assert got.shape == (1, lq, 14, 16)
    torch.testing.assert_close(got.double(), reference(q, k, v, valid, 0.25), rtol=2e-5, atol=2e-6)


def test_additive_float_mask_equals_the_bool_mask():
    q, k, v = inputs(2, 7, 300, seed=5)
    poison(k, v, 77)
    keep = torch.arange(300) < 77
    additive = torch.zeros(300).masked_fill(~keep, float("-inf")).view(1, 1, 1, 300)
    torch.testing.assert_close(decode_masked(q, k, v, additive, scale=0.3),
                               decode_masked(q, k, v, keep.view(1, 1, 1, 300), scale=0.3), rtol=1e-6, atol=1e-6)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = inputs(2, 2, 64, d=16, seed=6)
    valid = (torch.arange(64) < 40)[None, :]
    got = decode_masked(q, k, v, valid.view(1, 1, 1, 64))
    torch.testing.assert_close(got.double(), reference(q, k, v, valid, 0.25), rtol=2e-5, atol=2e-6)


def test_bf16_within_the_budget_of_a_plain_bf16_run():
    """bf16 inputs (upcast on the CPU, P rounded to bf16 as on the GPU): the error against the
    float64 reference is at most 2x that of the plain formula computed in bf16 (scores, softmax,
    P @ V) over the valid slots, plus a small atol."""
    lmax, n = 1024, 700
    q, k, v = inputs(2, 7, lmax, d=64, seed=7, dtype=torch.bfloat16)
    poison(k, v, n)
    valid = (torch.arange(lmax) < n)[None, :]
    want = reference(q, k, v, valid, 0.125)
    got = decode_masked(q, k, v, valid.view(1, 1, 1, lmax), scale=0.125)
    assert got.dtype == torch.bfloat16
    s = torch.einsum("hd,hld->hl", q[0, :, 0], k[0].repeat_interleave(7, 0)[:, :n]) * 0.125
    plain = torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), v[0].repeat_interleave(7, 0)[:, :n])
    budget = (plain.double() - want[0, 0]).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 2 * budget + 1e-3


def test_strided_cache_views_fall_back_to_one_split_and_stay_right():
    """K/V as views of a longer buffer (head stride ``capacity * d``, what a kept reserved cache
    hands over) cannot merge heads and splits without a copy: one split, same result."""
    q, k_buf, v_buf = inputs(2, 7, 320, seed=8)
    k, v = k_buf[:, :, :300], v_buf[:, :, :300]
    assert not k.is_contiguous()
    poison(k, v, 150)
    valid = (torch.arange(300) < 150)[None, :]
    got = decode_masked(q, k, v, valid.view(1, 1, 1, 300), scale=0.3)
    torch.testing.assert_close(got.double(), reference(q, k, v, valid, 0.3), rtol=2e-5, atol=2e-6)


def test_kv_splits_divide_the_capacity():
    assert kv_splits(130_304) == KV_SPLITS == 32  # the graph's capacities are multiples of 256
    for lmax in (1, 2, 37, 256, 300, 1031, 6000, 130_304):
        s = kv_splits(lmax)
        assert 1 <= s <= KV_SPLITS and lmax % s == 0
        assert all(lmax % t for t in range(s + 1, min(KV_SPLITS, lmax) + 1))  # the largest such divisor


def test_bad_shapes_are_refused_with_the_shapes_named():
    q, k, v = inputs(2, 7, 64)
    mask = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"expected a mask \[1 or 1, 1, 1 or 1, 64\], got \(1, 1, 1, 63\)"):
        decode_masked(q, k, v, mask[..., :63])
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        decode_masked(q[:, :13], k, v, mask)
    with pytest.raises(ValueError, match="expected 4D"):
        decode_masked(q[0], k, v, mask)
    with pytest.raises(ValueError, match="expected splits dividing Lmax = 64, got 7"):
        decode_masked(q, k, v, mask, splits=7)
