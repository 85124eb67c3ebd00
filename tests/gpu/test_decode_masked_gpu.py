"""GPU: ``flashprefill.integrations.decode_masked`` (the captured decode step's attention) in bf16
on CUDA, where it runs ``torch.bmm(..., out_dtype=torch.float32)``. Run on the device::

    source .fpdev/bin/env.sh && python -m pytest -q tests/gpu/test_decode_masked_gpu.py -s

(a) Qwen2.5-0.5B's shapes (2 KV heads, 7 query heads each, d 64) over a 130,304-slot capacity and
a Llama-like one (8 KV heads, 4 each, d 128) over 32,768 slots, ``valid_len`` at 1, mid and full,
garbage past it: the error against a float64 reference over the valid slots is at most 2x that of
SDPA (bf16, no mask, the valid keys only: what the eager decode runs) plus a small atol.
(b) Captured in a CUDA graph with the mask computed on the device from a length counter (as
``fpcli.engine.decode_graph`` does): one capture, replayed at several lengths set with ``fill_``,
gives each length's attention (a host sync inside would have failed the capture).
No model needed; skips without CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flashprefill.integrations.decode_masked import decode_masked, kv_splits  # noqa: E402

DEV = "cuda"
SHAPES = [(2, 7, 64, 130_304), (8, 4, 128, 32_768)]  # (Hkv, g, d, Lmax)


def make(hkv: int, g: int, d: int, lmax: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(1, hkv * g, 1, d, device=DEV, generator=gen).mul_(2).bfloat16()
    k = torch.randn(1, hkv, lmax, d, device=DEV, generator=gen).bfloat16()
    v = torch.randn(1, hkv, lmax, d, device=DEV, generator=gen).bfloat16()
    return q, k, v


def poison(k: torch.Tensor, v: torch.Tensor, n: int) -> None:
    k[:, :, n:] = 300.0
    v[:, :, n:] = -1e4


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """float64 attention of ``q [1, Hq, 1, d]`` over the first ``n`` slots -> ``[1, 1, Hq, d]``."""
    hkv, d = k.shape[1], q.shape[-1]
    qq = q.double().view(hkv, -1, d)  # [Hkv, g, d]
    s = torch.einsum("hgd,hld->hgl", qq, k[0, :, :n].double()) * d ** -0.5
    out = torch.einsum("hgl,hld->hgd", torch.softmax(s, dim=-1), v[0, :, :n].double())
    return out.reshape(1, 1, -1, d)


@torch.inference_mode()
@pytest.mark.parametrize("hkv, g, d, lmax", SHAPES)
def test_bf16_error_within_twice_sdpa_over_the_valid_keys(hkv, g, d, lmax):
    assert kv_splits(lmax) == 32
    for n in (1, lmax // 2 + 1, lmax - 303, lmax):
        q, k, v = make(hkv, g, d, lmax, seed=n)
        poison(k, v, n)
        want = reference(q, k, v, n)
        mask = (torch.arange(lmax, device=DEV) < n).view(1, 1, 1, lmax)
        got = decode_masked(q, k, v, mask)
        assert got.shape == (1, 1, hkv * g, d) and got.dtype == torch.bfloat16
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)
        budget = (sdpa.transpose(1, 2).double() - want).abs().max().item()
        err = (got.double() - want).abs().max().item()
        print(f"\nHkv {hkv} g {g} d {d} Lmax {lmax:,} valid {n:,}: error {err:.2e}, SDPA's {budget:.2e}")
        assert err <= 2 * budget + 1e-3, (n, err, budget)


@torch.inference_mode()
@pytest.mark.parametrize("hkv, g, d, lmax", SHAPES)
def test_captured_step_reads_the_length_from_the_device(hkv, g, d, lmax):
    q, k, v = make(hkv, g, d, lmax, seed=11)
    slots = torch.arange(lmax, device=DEV)
    length = torch.full((1,), lmax, dtype=torch.long, device=DEV)
    out = torch.empty(1, 1, hkv * g, d, dtype=torch.bfloat16, device=DEV)

    def step():
        out.copy_(decode_masked(q, k, v, (slots < length).view(1, 1, 1, lmax)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n in (lmax, 7, lmax // 3, lmax - 1):
        k2, v2 = k.clone(), v.clone()
        poison(k, v, n)  # in place: the graph reads these buffers
        length.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = reference(q, k, v, n)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=True)
        budget = (sdpa.transpose(1, 2).double() - want).abs().max().item()
        assert (out.double() - want).abs().max().item() <= 2 * budget + 1e-3, n
        k.copy_(k2)
        v.copy_(v2)
