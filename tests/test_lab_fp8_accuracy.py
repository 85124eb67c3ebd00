"""The lab's FP8 accuracy measurement (``scripts/lab/fp8_accuracy.py``): its ``shipped`` scheme is the
product's FP8 rules (the reference operator's output), and the schemes it compares do what they say on
inputs with a per-channel K bias. CPU, small shapes, no model."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import fp8_accuracy  # noqa: E402  (scripts/lab is not a package)

from flashprefill import dense_attention  # noqa: E402


def _biased(L=200, hq=6, hkv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, L, d, generator=gen)
    k = torch.randn(hkv, L, d, generator=gen) + 6.0 * torch.randn(hkv, 1, d, generator=gen)  # channel bias
    v = torch.randn(hkv, L, d, generator=gen)
    return q, k, v


def test_shipped_scheme_matches_the_reference_fp8_operator():
    q, k, v = _biased()
    hq, L, d = q.shape
    hkv = k.shape[0]
    tau = d ** -0.5
    q8, k8, v8, vm = fp8_accuracy.operands(q, k, v, "shipped")
    lab = fp8_accuracy.attend(q8, k8, v8, tau, torch.float32, True, vm)          # [Hq, L, d]
    page = 64
    n_pages = -(-L // page)
    kc = torch.zeros(n_pages * page, hkv, d)
    vc = torch.zeros(n_pages * page, hkv, d)
    kc[:L], vc[:L] = k.transpose(0, 1), v.transpose(0, 1)
    ref = dense_attention(q.transpose(0, 1).contiguous(), kc.view(n_pages, page, hkv, d), vc.view(n_pages, page, hkv, d),
                          torch.arange(n_pages, dtype=torch.int32)[None], torch.tensor([L], dtype=torch.int32),
                          torch.tensor([0, L], dtype=torch.int32), tau, backend="reference", precision="fp8")
    exact = fp8_accuracy.attend(q.double(), k.double(), v.double(), tau, torch.float64, False)
    gap = float(fp8_accuracy.rel(lab, ref.transpose(0, 1)))
    err = float(fp8_accuracy.rel(ref.transpose(0, 1), exact))
    assert err > 0.01                      # FP8 really ran: a visible error against exact
    assert gap < 0.1 * err, (gap, err)     # same rules: only summation order differs


def test_k_smoothing_reduces_the_error_on_biased_keys():
    q, k, v = _biased(seed=1)
    tau = q.shape[-1] ** -0.5
    exact = fp8_accuracy.attend(q.double(), k.double(), v.double(), tau, torch.float64, False)

    def err(scheme):
        q8, k8, v8, vm = fp8_accuracy.operands(q, k, v, scheme)
        return float(fp8_accuracy.rel(fp8_accuracy.attend(q8, k8, v8, tau, torch.float32, True, vm), exact))

    assert err("ksmooth") < 0.8 * err("shipped")
    assert err("int8qk_ksmooth") < err("ksmooth")
