"""Triton kernels of ``flashprefill`` on the GPU vs the PyTorch reference (same selection).

Run on the device: ``PYTHONPATH=kernels:. pytest tests/gpu/test_kernels.py -q -x``.

- Selection: the Triton CSR equals the reference's (threshold ties at most 1% of visible blocks).
- Attention: the Triton sparse output, given the Triton index, vs an fp32 ground truth: the
  reference's sparse attention given the SAME index on the float32-upcast inputs. Budget: max
  error <= K_LOWP x the error of a 16-bit PyTorch run (the reference on the bf16/fp16 inputs, whose
  result is rounded to q's dtype) against that truth, plus ATOL; relative norm error < REL_TOL.
  Output buffers are poisoned with NaN before each launch (the caching allocator hands the same
  memory back).
- 130000 tokens: CSR vs the reference, and a sample of rows vs an independent fp32 evaluation of
  ``docs/layout.md`` "Attention with mean correction" restricted to those rows.
- Mean correction lowers the error vs dense attention on structured inputs.
- ``dense_attention`` vs torch SDPA (fp32).
- The correction of an index without its selection bitmask (the reference's, or ``sel_bits=None``).
- ``flashprefill_attention(..., return_index=True)``: the index the attention used, equal to
  ``build_index``'s, and the same output as the two calls.
"""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

import flashprefill
from flashprefill import SparseConfig, make_plan
from flashprefill.impl import reference as ref
from flashprefill.impl.triton import host as tb

K_LOWP = 4.0       # x the error of rounding the fp32 reference to 16 bits
ATOL = 4e-3
REL_TOL = 1.5e-2
TIE_FRACTION = 0.01
DEV = os.environ.get("FP_TEST_DEVICE", "cuda")  # "cpu" only for an interpreter smoke run

# Sparse knobs small enough that lengths of a few thousand tokens actually prune.
SMALL = SparseConfig(sink_tokens=128, window_tokens=256, dense_tail_tokens=128, alpha=0.1)


def make_inputs(q_lens, prefixes, hkv, g, d, page_size, dtype, structured=True, seed=0):
    """Paged varlen inputs on the GPU, pages shuffled. ``structured``: sink, local and needle
    structure (a shared direction ``u`` in q; sink tokens and needle runs of keys along ``u``;
    a slowly varying positional component shared by q_t and k_t)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    kv_lens = [lq + p for lq, p in zip(q_lens, prefixes)]
    q = torch.randn(sum(q_lens), hkv * g, d, generator=gen, device=DEV)
    pages = [max(1, -(-lk // page_size)) for lk in kv_lens]
    n_pages = sum(pages) + 3
    k = torch.randn(n_pages, page_size, hkv, d, generator=gen, device=DEV)
    v = torch.randn(n_pages, page_size, hkv, d, generator=gen, device=DEV)
    perm = torch.randperm(n_pages, generator=gen, device=DEV).to(torch.int32)
    page_table = torch.zeros(len(q_lens), max(pages), dtype=torch.int32, device=DEV)
    c = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = perm[c:c + n]
        c += n
    if structured:
        u = torch.randn(d, generator=gen, device=DEV)
        u = u / u.norm() * math.sqrt(d)
        q += 0.5 * u
        qs = 0
        for b, (lq, lk) in enumerate(zip(q_lens, kv_lens)):
            pos = torch.arange(lk, device=DEV)
            slow = torch.randn(lk // 256 + 2, d, generator=gen, device=DEV)
            drift = slow[pos // 256] * 0.5
            rows = page_table[b].long()[pos // page_size]
            k[rows, pos % page_size] += drift[:, None, :]
            pick = (pos < 4) | ((pos // 128) % 37 == 5)            # sink + needle blocks
            k[rows[pick], (pos % page_size)[pick]] += 0.7 * u
            q[qs:qs + lq] += drift[lk - lq:][:, None, :]
            qs += lq
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32, device=DEV)
    return q.to(dtype), k.to(dtype), v.to(dtype), page_table, seq_lens, cu


def poison(nbytes: int) -> None:
    """Fill free allocator memory with NaN so an unwritten output element shows up as NaN."""
    if DEV == "cpu":
        return
    torch.cuda.synchronize()
    t = torch.full((nbytes // 4 + 1024,), float("nan"), dtype=torch.float32, device=DEV)
    del t


def csr_mismatch(a, b, hkv, n_tiles, max_nb):
    ma = ref._csr_to_mask(a, hkv, n_tiles, max_nb)
    mb = ref._csr_to_mask(b, hkv, n_tiles, max_nb)
    return int((ma != mb).sum())


def check_outputs(name, out, lse, truth_out, truth_lse, dtype, lowp_out=None):
    """``truth_out``: fp32 (or fp64) ground truth. ``lowp_out``: a 16-bit PyTorch computation of
    the same thing (default: the truth rounded to ``dtype``, what the reference returns on 16-bit
    inputs). The fast path may err by at most K_LOWP x that run's error, plus ATOL."""
    assert truth_out.dtype in (torch.float32, torch.float64), f"{name}: ground truth must be fp32, got {truth_out.dtype}"
    assert torch.isfinite(out).all(), f"{name}: NaN/Inf in out"
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse"
    r = truth_out.float()
    if lowp_out is None:
        lowp_out = r.to(dtype)
    assert lowp_out.dtype == dtype, f"{name}: baseline must be a {dtype} run, got {lowp_out.dtype}"
    lowp = (lowp_out.float() - r).abs().max().item()
    err = (out.float() - r).abs().max().item()
    rel = ((out.float() - r).norm() / r.norm().clamp_min(1e-12)).item()
    assert err <= K_LOWP * lowp + ATOL, f"{name}: max err {err:.3e} > {K_LOWP} x {lowp:.3e} + {ATOL}"
    assert rel < REL_TOL, f"{name}: rel err {rel:.3e}"
    fin = torch.isfinite(truth_lse)
    assert torch.equal(fin, torch.isfinite(lse)), f"{name}: lse finiteness differs"
    lerr = (lse[fin] - truth_lse[fin].float()).abs().max().item() if fin.any() else 0.0
    assert lerr < 2e-2, f"{name}: lse err {lerr:.3e}"


def truth_and_lowp(fn, q, k, v, *args):
    """``fn`` (a reference attention) on the float32-upcast inputs (the ground truth) and on the
    16-bit inputs (the low-precision baseline, rounded to q's dtype)."""
    t_out, t_lse = fn(q.float(), k.float(), v.float(), *args)
    l_out, _ = fn(q, k, v, *args)
    return t_out, t_lse, l_out


def run_case(name, q_lens, prefixes, hkv, g, d, ps, dtype, config=SMALL):
    q, k, v, pt, sl, cu = make_inputs(q_lens, prefixes, hkv, g, d, ps, dtype)
    plan = make_plan(sl, cu, g, config.block_size)
    idx = tb.build_index(q, k, v, pt, sl, cu, config, None, plan)
    ridx = ref.build_index(q, k, v, pt, sl, cu, config, None, plan)
    max_nb = max(-(-int(x) // config.block_size) for x in plan.kv_lens)
    visible = int(ridx.n_visible.sum())
    mism = csr_mismatch(idx, ridx, hkv, plan.n_tiles, max_nb)
    assert mism <= TIE_FRACTION * visible, f"{name}: CSR differs on {mism} of {visible} visible blocks"
    assert torch.equal(idx.n_visible, ridx.n_visible), f"{name}: n_visible differs"
    counts = idx.row_ptr[1:] - idx.row_ptr[:-1]
    assert bool((counts > 0).all()), f"{name}: empty segment"
    # the kept selection bitmask (the "bits" correction's membership test) says what the CSR says
    words = idx.sel_bits.to(torch.int64) & 0xFFFFFFFF
    bits = ((words[:, :, None] >> torch.arange(32, device=words.device)) & 1).reshape(words.shape[0], -1)
    bits = bits[:, :max_nb].bool() & (torch.arange(max_nb, device=words.device)[None, :] < idx.n_visible[:, None])
    csr = ref._csr_to_mask(idx, hkv, plan.n_tiles, max_nb).reshape(bits.shape)
    assert torch.equal(bits, csr), f"{name}: sel_bits differs from the CSR"
    km_err = (idx.k_mean - ridx.k_mean).abs().max().item()
    vm_err = (idx.v_mean - ridx.v_mean).abs().max().item()
    assert km_err < 1e-4 and vm_err < 1e-4, f"{name}: k_mean err {km_err}, v_mean err {vm_err}"
    for mean, lowp in ((idx.k_mean, idx.k_mean_lowp), (idx.v_mean, idx.v_mean_lowp)):
        # the means kernel writes the 16-bit copies the scores and the correction read
        assert lowp is not None and torch.equal(lowp, mean.to(lowp.dtype)), f"{name}: 16-bit means"
    poison(q.numel() * q.element_size() * 2)
    out, lse = tb.sparse_attention(q, k, v, pt, sl, cu, config, None, plan, idx)
    r_out, r_lse, l_out = truth_and_lowp(ref.sparse_attention, q, k, v, pt, sl, cu, config, None, plan, idx)
    check_outputs(name + "/sparse", out, lse, r_out, r_lse, dtype, l_out)
    return idx


# Lengths {1, 127, 128, 129, 1000, 4097}; g, d, page size rotate so each value is covered.
GS = (1, 3, 7, 8)
DS = (64, 128, 256)
PSS = (1, 16, 64)
CASES = []
for i, L in enumerate((1, 127, 128, 129, 1000, 4097)):
    for j, dtype in enumerate((torch.bfloat16, torch.float16)):
        n = 2 * i + j
        CASES.append((L, GS[n % 4], DS[n % 3], PSS[(n // 3) % 3], dtype))


@pytest.mark.parametrize("L,g,d,ps,dtype", CASES, ids=[f"L{c[0]}-g{c[1]}-d{c[2]}-ps{c[3]}-{str(c[4])[6:]}" for c in CASES])
def test_single_request(L, g, d, ps, dtype):
    run_case(f"L{L}", [L], [0], 2, g, d, ps, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g,d,ps", [(3, 128, 16), (8, 64, 64), (7, 256, 1)])
def test_batch_with_prefixes(g, d, ps, dtype):
    run_case("batch", [100, 8192, 1], [0, 4096, 63], 2, g, d, ps, dtype)


def test_prefix_default_config():
    run_case("default-config", [3000], [5000], 2, 4, 128, 64, torch.bfloat16, SparseConfig())


@pytest.mark.parametrize("g,d,ps", [(3, 128, 16), (7, 64, 64)])
def test_threshold_over_prunable_blocks(g, d, ps):
    """``threshold_max="prunable"`` (docs/method.md 3.4): the compiled selection equals the
    reference's, and keeps at least the blocks of ``"scored"`` at the same alpha."""
    cfg = SMALL.replace(threshold_max="prunable")
    idx = run_case("prunable", [100, 8192, 1], [0, 4096, 63], 2, g, d, ps, torch.bfloat16, cfg)
    scored = run_case("scored", [100, 8192, 1], [0, 4096, 63], 2, g, d, ps, torch.bfloat16, SMALL)
    assert idx.nnz >= scored.nnz


@pytest.mark.parametrize("threshold_max", ["scored", "prunable"])
@pytest.mark.parametrize("g,d,ps", [(3, 128, 16), (7, 64, 64), (8, 256, 1)])
def test_block_score_mass(g, d, ps, threshold_max):
    """``block_score="mass"`` (docs/method.md 3.3): the compiled selection (a row log-sum-exp
    pre-pass, then the scores) equals the reference's, and still prunes."""
    cfg = SMALL.replace(block_score="mass", threshold_max=threshold_max)
    idx = run_case("mass", [100, 8192, 1], [0, 4096, 63], 2, g, d, ps, torch.bfloat16, cfg)
    assert idx.nnz < int(idx.n_visible.sum())


@pytest.mark.parametrize("g,d,ps", [(3, 128, 16), (8, 64, 64), (7, 256, 1)])
def test_correction_without_bitmask(g, d, ps):
    """An index without ``sel_bits`` (the reference's, or one with another CSR): the correction
    folds every candidate in and takes the selected ones out again."""
    for name, q_lens, prefixes, cfg in (("batch", [100, 8192, 1], [0, 4096, 63], SMALL),
                                        ("default-config", [3000], [5000], SparseConfig())):
        q, k, v, pt, sl, cu = make_inputs(q_lens, prefixes, 2, g, d, ps, torch.bfloat16)
        plan = make_plan(sl, cu, g, cfg.block_size)
        for label, idx in (("triton index, sel_bits=None",
                            dataclasses.replace(tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan), sel_bits=None)),
                           ("reference index", ref.build_index(q, k, v, pt, sl, cu, cfg, None, plan))):
            assert idx.sel_bits is None
            poison(q.numel() * q.element_size() * 2)
            out, lse = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
            r_out, r_lse, l_out = truth_and_lowp(ref.sparse_attention, q, k, v, pt, sl, cu, cfg, None, plan, idx)
            check_outputs(f"{name}/{label}", out, lse, r_out, r_lse, torch.bfloat16, l_out)


@pytest.mark.parametrize("ps", [1, 16, 64, 128])
def test_dense_attention_and_no_mc_paths(ps):
    q, k, v, pt, sl, cu = make_inputs([1000], [300], 2, 4, 128, ps, torch.bfloat16)
    plan = make_plan(sl, cu, 4, 128)
    poison(q.numel() * 4)
    out, lse = tb.dense_attention(q, k, v, pt, sl, cu, None, plan)
    r_out, r_lse, l_out = truth_and_lowp(ref.dense_attention, q, k, v, pt, sl, cu, None, plan)
    check_outputs(f"dense ps{ps}", out, lse, r_out, r_lse, torch.bfloat16, l_out)
    cfg = SMALL.replace(mean_correction=False)
    idx = tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    out, lse = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
    r_out, r_lse, l_out = truth_and_lowp(ref.sparse_attention, q, k, v, pt, sl, cu, cfg, None, plan, idx)
    check_outputs(f"sparse-no-mc ps{ps}", out, lse, r_out, r_lse, torch.bfloat16, l_out)


@pytest.mark.parametrize("L", [128, 1000, 4097])
def test_dense_vs_sdpa(L):
    g, hkv, d = 4, 2, 128
    q, k, v, pt, sl, cu = make_inputs([L], [0], hkv, g, d, 64, torch.bfloat16, structured=False)
    plan = make_plan(sl, cu, g, 128)
    out, _ = tb.dense_attention(q, k, v, pt, sl, cu, None, plan)
    kk = k[pt[0].long()].reshape(-1, hkv, d)[:L]
    vv = v[pt[0].long()].reshape(-1, hkv, d)[:L]
    qf = q.float().permute(1, 0, 2)[None]
    kf = kk.float().repeat_interleave(g, 1).permute(1, 0, 2)[None]
    vf = vv.float().repeat_interleave(g, 1).permute(1, 0, 2)[None]
    r = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, is_causal=True)[0].permute(1, 0, 2)
    check_outputs(f"dense-vs-sdpa L{L}", out, torch.zeros(out.shape[:2], device=DEV), r,
                  torch.zeros(out.shape[:2], device=DEV), torch.bfloat16)


def test_mean_correction_reduces_error():
    cfg = SparseConfig(sink_tokens=128, window_tokens=256, dense_tail_tokens=128, alpha=0.2)
    q, k, v, pt, sl, cu = make_inputs([4097], [0], 2, 4, 128, 64, torch.bfloat16)
    plan = make_plan(sl, cu, 4, 128)
    idx = tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    dense, _ = ref.dense_attention(q, k, v, pt, sl, cu, None, plan)
    with_mc, _ = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
    no_mc, _ = tb.sparse_attention(q, k, v, pt, sl, cu, cfg.replace(mean_correction=False), None, plan, idx)
    e_mc = (with_mc.float() - dense.float()).norm().item()
    e_no = (no_mc.float() - dense.float()).norm().item()
    density = idx.nnz / int(idx.n_visible.sum())
    assert density < 0.9, f"selection did not prune (density {density:.3f})"
    assert e_mc < e_no, f"mean correction did not help: {e_mc:.4e} vs {e_no:.4e} (density {density:.3f})"


def _rows_reference(q, k_full, v_full, index, plan, cfg, scale, h, rows):
    """fp32 evaluation of docs/layout.md "Attention with mean correction" for packed rows
    ``rows`` of KV head ``h`` of request 0 (single-request batch). Returns (out [n, d], lse [n])."""
    g, B = plan.group_size, cfg.block_size
    lq, lk = plan.q_lens[0], plan.kv_lens[0]
    P = lk - lq
    outs, lses = [], []
    for rho in rows:
        t, hq, tile = rho // g, h * g + rho % g, rho // 128
        t_first = (tile * 128) // g
        S = index.segment(h * plan.n_tiles + tile).long()
        pos = (S[:, None] * B + torch.arange(B, device=DEV)[None, :]).reshape(-1)
        pos = pos[(pos <= P + t) & (pos < lk)]
        qv = q[t, hq].float()
        logits = [scale * (k_full[pos, h].float() @ qv)]
        vals = [v_full[pos, h].float()]
        if cfg.mean_correction:
            nb = -(-lk // B)
            j = torch.arange(nb, device=DEV)
            e = torch.clamp((j + 1) * B, max=lk)
            inU = (e <= P + t_first + 1)
            inU[S] = False
            ju = j[inU]
            n = (e[ju] - ju * B).float()
            logits.append(scale * (index.k_mean[ju, h] @ qv) + torch.log(n))
            vals.append(index.v_mean[ju, h])
        s = torch.cat(logits)
        lse = torch.logsumexp(s, 0)
        outs.append(torch.softmax(s, 0) @ torch.cat(vals))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def test_130k_tokens():
    """130000 tokens: CSR vs reference, sampled rows vs the fp32 formula, no NaN anywhere."""
    L, hkv, g, d, ps = 130000, 1, 4, 128, 64
    cfg = SparseConfig()
    q, k, v, pt, sl, cu = make_inputs([L], [0], hkv, g, d, ps, torch.bfloat16)
    plan = make_plan(sl, cu, g, 128)
    idx = tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    ridx = ref.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    max_nb = -(-L // 128)
    visible = int(ridx.n_visible.sum())
    mism = csr_mismatch(idx, ridx, hkv, plan.n_tiles, max_nb)
    assert mism <= TIE_FRACTION * visible, f"130k: CSR differs on {mism} of {visible}"
    poison(q.numel() * 4)
    out, lse = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), "130k: NaN/Inf"
    k_full = k[pt[0].long()].reshape(-1, hkv, d)[:L]
    v_full = v[pt[0].long()].reshape(-1, hkv, d)[:L]
    n_rows = L * g
    gen = torch.Generator().manual_seed(1)
    rows = sorted(set([0, 1, 127, 128, n_rows - 1, n_rows - 200, n_rows // 2]
                      + torch.randint(0, n_rows, (57,), generator=gen).tolist()))
    r_out, r_lse = _rows_reference(q, k_full, v_full, idx, plan, cfg, 1 / math.sqrt(d), 0, rows)
    rt = torch.tensor(rows, device=DEV)
    got = out[rt // g, rt % g].float()
    got_lse = lse[rt // g, rt % g]
    check_outputs("130k rows", got, got_lse, r_out, r_lse, torch.bfloat16)


@pytest.mark.parametrize("q_lens,prefixes,g,d,ps", [
    ([12000], [0], 4, 128, 64),
    ([100, 8192, 300], [0, 4096, 63], 3, 64, 16),
    ([3000], [9000], 7, 128, 1),
])
def test_return_index_is_the_index_the_attention_used(q_lens, prefixes, g, d, ps):
    """``flashprefill_attention(..., return_index=True)`` (no index given): the index it built
    equals ``build_index``'s, and its output equals the two calls' and matches the reference."""
    cfg = SparseConfig(sink_tokens=128, window_tokens=256, dense_tail_tokens=256, alpha=0.1)
    q, k, v, pt, sl, cu = make_inputs(q_lens, prefixes, 2, g, d, ps, torch.bfloat16)
    plan = make_plan(sl, cu, g, 128)
    poison(q.numel() * q.element_size() * 4)
    out, lse, idx = flashprefill.flashprefill_attention(q, k, v, pt, sl, cu, cfg, return_lse=True, plan=plan,
                                                        return_index=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), "unwritten or NaN rows"
    want = tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    for f in ("row_ptr", "col_idx", "n_visible", "k_mean", "v_mean", "k_mean_lowp", "v_mean_lowp"):
        assert torch.equal(getattr(idx, f), getattr(want, f)), f
    assert 0 < idx.nnz < int(idx.n_visible.sum())
    two_out, two_lse = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, want)
    assert torch.equal(out, two_out) and torch.equal(lse, two_lse)
    r_out, r_lse, l_out = truth_and_lowp(ref.sparse_attention, q, k, v, pt, sl, cu, cfg, None, plan, idx)
    check_outputs("return_index", out, lse, r_out, r_lse, torch.bfloat16, l_out)


def test_bad_head_dim_and_dtype():
    q = torch.zeros(4, 2, 96, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="d = 96"):
        tb._check(q)
    with pytest.raises(ValueError, match="float32"):
        tb._check(torch.zeros(4, 2, 128, device=DEV))
