"""Global ("vertical") keys, ``SparseConfig.global_keys`` (docs/method.md section 4.1), on the
PyTorch reference: the semantics against an independent float64 computation per row, the ranking,
and what they are for (a key every row attends to, in a pruned block). CPU, tiny shapes."""
from __future__ import annotations

import math

import pytest
import torch

from fp_brute import _gather, csr_segments, make_inputs
from flashprefill import SparseConfig, make_plan
from flashprefill.impl import reference as R

CFG = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)


def run(inp, config):
    q, k, v, pt, sl, cu = inp
    plan = make_plan(sl, cu, q.shape[1] // k.shape[2], config.block_size)
    index = R.build_index(q, k, v, pt, sl, cu, config, None, plan)
    out, lse = R.sparse_attention(q, k, v, pt, sl, cu, config, None, plan, index)
    return out, lse, index, plan


def by_rows(inp, index, plan, config, mean_correction=True):
    """Section 4.1 row by row in float64, from the CSR and ``global_pos`` only: exact keys = the
    selected blocks (causal) and the global keys of the blocks in ``U_i``; each block of ``U_i``
    folds back the mean of its other tokens with logit ``τ q·k̄ + ln count`` (none left: nothing)."""
    q, k_cache, v_cache, pt, sl, cu = inp
    q = q.double()
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    g, B, tau = hq // hkv, config.block_size, 1.0 / math.sqrt(d)
    segs = csr_segments(index, plan)
    out = torch.zeros_like(q)
    for b in range(sl.numel()):
        qs, lq, lk = int(cu[b]), int(cu[b + 1] - cu[b]), int(sl[b])
        P = lk - lq
        K, V = _gather(k_cache.double(), pt, b, lk), _gather(v_cache.double(), pt, b, lk)
        nb = -(-lk // B)
        for h in range(hkv):
            glob = [int(p) for p in index.global_pos[b, h] if p >= 0]
            for i in range(-(-(lq * g) // 128)):
                S = segs[(h, b, i)]
                t_first = 128 * i // g
                U = [j for j in range(nb) if min((j + 1) * B, lk) <= P + t_first + 1 and j not in S]
                for rho in range(128 * i, min(128 * i + 128, lq * g)):
                    t, hh = rho // g, h * g + rho % g
                    qv = q[qs + t, hh]
                    keys = [p for j in S for p in range(j * B, min((j + 1) * B, lk)) if p <= P + t]
                    keys += [p for p in glob if p // B in U]
                    logits = [tau * float(qv @ K[p, h]) for p in keys]
                    vals = [V[p, h] for p in keys]
                    if mean_correction:
                        for j in U:
                            other = [p for p in range(j * B, min((j + 1) * B, lk)) if p not in glob]
                            if other:
                                logits.append(tau * float(qv @ K[other, h].mean(0)) + math.log(len(other)))
                                vals.append(V[other, h].mean(0))
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[qs + t, hh] = (w[:, None] * torch.stack(vals)).sum(0)
    return out


@pytest.mark.parametrize("q_len,kv_len", [(300, 300), (200, 500), (129, 257)])
def test_global_keys_follow_section_4_1_row_by_row(q_len, kv_len):
    inp = make_inputs([q_len], [kv_len], hq=6, hkv=2, d=32, page_size=16, seed=kv_len, structured=True)
    cfg = CFG.replace(global_keys=8, global_queries=16)
    out, lse, index, plan = run(inp, cfg)
    assert index.global_pos.shape == (1, 2, 8) and (index.global_pos >= 0).any()
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), by_rows(inp, index, plan, cfg), atol=1e-10, rtol=0)


def test_global_keys_without_mean_correction_and_in_a_batch():
    inp = make_inputs([100, 400], [100, 700], hq=4, hkv=2, d=32, page_size=16, seed=3, structured=True)
    cfg = CFG.replace(global_keys=5, mean_correction=False)
    out, _, index, plan = run(inp, cfg)
    torch.testing.assert_close(out.double(), by_rows(inp, index, plan, cfg, mean_correction=False), atol=1e-10, rtol=0)


def test_zero_global_keys_is_the_published_method_bit_for_bit():
    inp = make_inputs([300], [420], hq=6, hkv=2, d=32, page_size=16, seed=11, structured=True)
    out0, lse0, index0, _ = run(inp, CFG)
    assert index0.global_pos is None and index0.fold_count is None
    out1, lse1, index1, _ = run(inp, CFG.replace(global_keys=0, global_queries=7))
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


def test_ranking_takes_the_keys_with_the_most_mass_outside_the_sink():
    """The global keys are the top-K of the strided queries' summed attention mass (recomputed
    here), ascending, never in the sink's blocks."""
    inp = make_inputs([500], [500], hq=4, hkv=2, d=16, page_size=16, seed=5, structured=True)
    q, k_cache, *_ = inp
    cfg = CFG.replace(global_keys=6, global_queries=10)
    _, _, index, _ = run(inp, cfg)
    K = _gather(k_cache, inp[3], 0, 500)
    lo, hi = cfg.sink_tokens + cfg.window_tokens, 500 - 1 - cfg.dense_tail_tokens
    toks = torch.linspace(lo, hi, 10).round().long()
    for h in range(2):
        qs = q[toks][:, 2 * h:2 * h + 2].reshape(-1, 16).double() / 4.0       # tau = 1/sqrt(16)
        s = qs @ K[:, h].double().T
        s = s.masked_fill(torch.arange(500)[None] > toks.repeat_interleave(2)[:, None], -math.inf)
        mass = torch.softmax(s, -1).sum(0)
        mass[:64] = 0
        got = index.global_pos[0, h].tolist()
        assert got == sorted(got) and min(got) >= 64
        assert set(got) == set(mass.topk(6).indices.tolist())


def test_a_key_every_row_attends_to_is_kept_exactly_and_the_error_falls():
    """What global keys are for: one key in a block the threshold prunes that every query attends to
    (a secondary attention sink). The mean of its block cannot carry it; a global key can."""
    torch.manual_seed(0)
    L, d = 640, 32
    inp = make_inputs([L], [L], hq=2, hkv=1, d=d, page_size=16, seed=1, structured=False)
    q, k_cache, v_cache, pt, sl, cu = inp
    hot = 300                                                               # block 4, mid-document
    direction = torch.randn(d, dtype=q.dtype)
    q += 0.8 * direction                                                    # every query leans one way
    for p in range(L):                                                      # other blocks' means lean it too,
        if p // 64 != hot // 64:                                            # so the hot block's mean scores
            k_cache[pt[0, p // 16], p % 16, 0] += 0.3 * direction          # lowest and the threshold prunes it
    page, slot = pt[0, hot // 16], hot % 16
    k_cache[page, slot, 0] = 3.0 * direction                                # the key they all find
    v_cache[page, slot, 0] = 5.0
    cfg = CFG.replace(alpha=0.5)
    dense, _ = R.dense_attention(q, k_cache, v_cache, pt, sl, cu)
    out0, _, index0, plan = run(inp, cfg)
    out1, _, index1, _ = run(inp, cfg.replace(global_keys=4))
    assert hot in index1.global_pos[0, 0].tolist()
    rows = slice(hot + 200, L - 64)                                         # its block pruned, beyond the window
    pruned = [i for (_, _, i), S in csr_segments(index0, plan).items() if hot // 64 not in S]
    assert len(pruned) >= 3, "the hot key's block must be pruned for the rows tested"
    err0 = (out0[rows] - dense[rows]).norm() / dense[rows].norm()
    err1 = (out1[rows] - dense[rows]).norm() / dense[rows].norm()
    assert err0 > 0.05 and err1 < 0.5 * err0, (float(err0), float(err1))


def test_bad_values_and_the_triton_backend_refuse():
    with pytest.raises(ValueError, match="global_queries"):
        SparseConfig(global_keys=4, global_queries=0)
    with pytest.raises(ValueError, match="global_keys"):
        SparseConfig(global_keys=-1)
    from flashprefill import flashprefill_attention

    q, k, v, pt, sl, cu = make_inputs([64], [64], hq=2, hkv=1, d=32, page_size=16, seed=2, structured=True)
    with pytest.raises(NotImplementedError, match="global_keys=4 .*no Triton kernel"):
        flashprefill_attention(q.float(), k.float(), v.float(), pt, sl, cu, SparseConfig(global_keys=4), backend="triton")
