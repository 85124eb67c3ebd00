"""The lab's Jensen-gap measurement (``scripts/lab/jensen_gap.py``) on synthetic keys: its ``mean``
variant is the operator's sparse attention, its block statistics are the blocks' own, and on keys
that are Gaussian inside each block the variance term recovers the folded mass that the mean logit
misses (where the model's keys showed it does not). CPU, no model."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import jensen_gap  # noqa: E402  (scripts/lab is not a package)

from flashprefill import SparseConfig  # noqa: E402


def _layer(seed: int = 0):
    """q ``[4, 3000, 32]``, k / v ``[2, 3000, 32]``: Gaussian keys, every 7th 64-token block shifted
    along a direction the queries share (so the threshold prunes the others), values correlated
    with the keys."""
    g = torch.Generator().manual_seed(seed)
    L, hq, hkv, d = 3000, 4, 2, 32
    u = torch.randn(d, generator=g)
    q = torch.randn(hq, L, d, generator=g) + 0.5 * u
    k = torch.randn(hkv, L, d, generator=g)
    k[:, (torch.arange(L) // 64) % 7 == 3] += 1.5 * u
    v = torch.randn(hkv, L, d, generator=g) + 0.5 * k
    return q, k, v


CFG = SparseConfig(block_size=64, sink_tokens=64, window_tokens=256, dense_tail_tokens=64, alpha=0.3)
TOKENS = torch.tensor([500, 1200, 1999, 2100, 2900])


def test_block_stats_are_each_blocks_own():
    q, k, v = _layer()
    L = k.shape[1] - 37                          # a partial last block
    km, vm, var, cov, cvk, n = jensen_gap.block_stats(k[:, :L], v[:, :L], 64)
    last = k[:, (n.numel() - 1) * 64:L].double()
    assert int(n[-1]) == L - (n.numel() - 1) * 64
    torch.testing.assert_close(km[:, -1], last.mean(1))
    torch.testing.assert_close(var[:, -1], last.var(1, unbiased=False))
    torch.testing.assert_close(cov[:, 3], torch.stack([torch.cov(k[h, 192:256].double().T, correction=0) for h in range(2)]))
    x = torch.cat([v[0, 192:256], k[0, 192:256]], 1).double().T
    torch.testing.assert_close(cvk[0, 3], torch.cov(x, correction=0)[:32, 32:])


def test_mean_variant_is_the_operator_and_oracles_hold():
    q, k, v = _layer()
    r = jensen_gap.analyse_layer(q, k, v, 0.3, CFG, TOKENS, [1.0])
    assert r["ref_err"] < 1e-5                  # the script's softmax is the reference's section 4
    assert 0.2 < r["density"] < 0.8
    var = r["variants"]
    has = r["true"] > 0
    assert int(has.sum()) >= 8
    torch.testing.assert_close(var["exact*"]["ratio"][has], torch.ones(int(has.sum()), dtype=torch.float64))
    assert float(var["drop"]["est"].abs().max()) == 0.0
    assert bool(torch.isnan(var["mean"]["ratio"][~has]).all())


def test_variance_term_recovers_gaussian_blocks_mass():
    q, k, v = _layer()
    r = jensen_gap.analyse_layer(q, k, v, 0.3, CFG, TOKENS, [1.0])
    has = r["true"] > 1e-3
    gap = {name: float(r["variants"][name]["ratio"][has].log().abs().median()) for name in ("mean", "diag", "iso")}
    assert gap["mean"] > math.log(3)            # the mean logit keeps < 1/3 of the mass
    assert gap["diag"] < math.log(1.5) and gap["iso"] < math.log(1.5)
    err = {name: jensen_gap.nr.rel(r["variants"][name]["out"], r["dense"]) for name in ("mean", "diag")}
    assert err["diag"] < 0.6 * err["mean"]
