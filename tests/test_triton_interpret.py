"""Triton kernels under ``TRITON_INTERPRET=1`` (CPU) vs the PyTorch reference, on tiny shapes.

The interpreter must be switched on before Triton compiles anything, and other test files may
import Triton normally, so the kernels run in subprocesses (this file with ``--worker K N``, one
per CPU core up to ``WORKERS``, each taking every N-th case) that set ``TRITON_INTERPRET=1``
first, run their cases and print one JSON line per case; the tests below only read those
results. A few minutes on 2 shared cores.

Interpreter limits (Triton 3.6): bf16 values are held as raw uint16 and ``tl.dot`` on them is
wrong, so the dot paths run in fp16 here (the same kernel code; bf16 runs on the GPU tests); the
block-means kernel (no dot) is also checked in bf16. With numpy >= 2.3 the interpreter's
``__index__`` of a scalar breaks ``range(..)`` on runtime values; ``_patch_interpreter`` fixes
that in the subprocess only.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# name: (q_lens, prefixes, Hkv, g, d, page_size, block_size, config overrides, structured)
CASES = {
    "one_token": ([1], [0], 1, 1, 64, 1, 64, {}, False),
    "len129_g8_ps16": ([129], [0], 1, 8, 64, 16, 64, {}, True),
    "len300_prefix_g3_ps16": ([300], [700], 1, 3, 64, 16, 64, {}, True),
    "batch_g3_ps64": ([300, 1, 129], [700, 63, 0], 2, 3, 64, 64, 64, {}, True),
    "ps1_g1": ([700], [0], 1, 1, 64, 1, 64, {}, True),
    "g7_ps16_b128": ([200], [900], 1, 7, 64, 16, 128, {"sink_tokens": 128, "window_tokens": 128}, True),
    "no_mean_correction": ([300], [700], 1, 3, 64, 16, 64, {"mean_correction": False}, True),
    # threshold_max "prunable": the max E over the blocks sink and window do not keep; with a
    # sink whose keys score far above the rest (an attention sink), beside the same inputs scored
    "prunable_batch_g3_ps64": ([300, 1, 129], [700, 63, 0], 2, 3, 64, 64, 64,
                               {"threshold_max": "prunable", "_sink_boost": 2.0}, True),
    "scored_strong_sink_batch_g3_ps64": ([300, 1, 129], [700, 63, 0], 2, 3, 64, 64, 64, {"_sink_boost": 2.0}, True),
    # block_score "mass": each row's softmax over its blocks (a pre-pass of row log-sum-exps), alone
    # and with the prunable max; at d 128 with several BLOCK_J chunks
    "mass_batch_g3_ps64": ([300, 1, 129], [700, 63, 0], 2, 3, 64, 64, 64, {"block_score": "mass", "alpha": 0.5}, True),
    "mass_prunable_long_prefix_d128": ([100], [9000], 1, 2, 128, 64, 64,
                                       {"block_score": "mass", "threshold_max": "prunable", "alpha": 0.1}, True),
    "alpha0_dense_scored": ([300], [700], 1, 2, 64, 16, 64, {"alpha": 0.0}, True),
    "alpha1": ([300], [700], 1, 2, 64, 16, 64, {"alpha": 1.0}, True),
    "short_request_dense": ([300], [100], 1, 2, 64, 16, 64, {"min_sparse_len": 400}, True),
    # ~140 mean-correction candidates: several BLOCK_U chunks of the col_idx pointer walk, and
    # several BLOCK_J chunks of the selection (the d=128 config, BLOCK_U = 128)
    "long_prefix_d64": ([100], [9000], 1, 2, 64, 16, 64, {"window_tokens": 5000}, True),
    "long_prefix_d128": ([100], [9000], 1, 2, 128, 64, 64, {}, True),
    # the correction of an index without its selection bitmask (fold every candidate in, take the
    # selected ones out again): the Triton index with ``sel_bits=None``; every other case also runs
    # it with the reference's index, which has no bitmask
    "nobits_batch_g3_ps64": ([300, 1, 129], [700, 63, 0], 2, 3, 64, 64, 64, {"_no_bits": True}, True),
    "nobits_long_prefix_d128": ([100], [9000], 1, 2, 128, 64, 64, {"_no_bits": True}, True),
    "nobits_b128_g7_ps16": ([200], [2900], 1, 7, 64, 16, 128,
                            {"sink_tokens": 128, "window_tokens": 128, "alpha": 0.5, "_no_bits": True}, True),
    # the last token alone with a partial last block and a prefix: its tile's first row sees every
    # block (the correction's candidates run to the end of the segment)
    "last_token_partial_block_g7": ([1], [1000], 1, 7, 64, 16, 128, {"sink_tokens": 128, "window_tokens": 128,
                                                                     "dense_tail_tokens": 0, "alpha": 0.5}, True),
    # key block 128 with 64-key steps (the d=128 GPU config): two sub-tiles per block, one softmax
    # update per block (pair_softmax)
    "b128_d128": ([100], [3000], 1, 2, 128, 64, 128, {}, True),
    "b128_d128_batch": ([300, 1, 129], [2700, 63, 0], 2, 3, 128, 16, 128,
                        {"sink_tokens": 128, "window_tokens": 128, "alpha": 0.5}, True),
}
# cases that also run ``host.attention``, the one call behind ``flashprefill_attention``
ONE_CALL_CASES = ("batch_g3_ps64", "b128_d128")
# cases that also run the Triton attention on the reference's index (no selection bitmask; the
# "nobits_" cases run that path on the Triton index)
REF_INDEX_CASES = ("batch_g3_ps64", "long_prefix_d128", "b128_d128_batch")

# Shared sparse knobs for tiny shapes (B = 64 gives enough blocks at a few hundred tokens).
BASE_CONFIG = dict(sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)


def _patch_interpreter() -> None:
    """numpy >= 2.3: ``int(array of shape (1,))`` raises; the interpreter's scalars are (1,)."""
    import triton.runtime.interpreter as interp
    if getattr(interp, "_fp_patched", False):
        return
    orig = interp._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._fp_patched = True


def make_inputs(q_lens, prefixes, hkv, g, d, page_size, dtype, structured, seed=0, sink_boost=0.0):
    """Paged varlen inputs, pages shuffled; ``structured`` adds a sink and needle pages;
    ``sink_boost`` adds ``sink_boost * u`` more to the sink tokens' keys (an attention sink)."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [lq + p for lq, p in zip(q_lens, prefixes)]
    hq = hkv * g
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    pages = [-(-lk // page_size) for lk in kv_lens]
    n_pages = sum(pages) + 2
    k = torch.randn(n_pages, page_size, hkv, d, generator=gen)
    v = torch.randn(n_pages, page_size, hkv, d, generator=gen)
    perm = torch.randperm(n_pages, generator=gen)
    page_table = torch.zeros(len(q_lens), max(pages), dtype=torch.int32)
    c = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = perm[c:c + n].to(torch.int32)
        c += n
    if structured:
        u = torch.randn(d, generator=gen)
        u = u / u.norm() * math.sqrt(d)
        q += 0.6 * u
        for b, lk in enumerate(kv_lens):
            pos = torch.arange(lk)
            pick = (pos < 8) | ((pos // 40) % 7 == 3)           # sink + needle runs
            idx = page_table[b].long()[pos[pick] // page_size]
            k[idx, pos[pick] % page_size] += 0.5 * u
            sink = pos[:8]
            k[page_table[b].long()[sink // page_size], sink % page_size] += sink_boost * u
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(q_lens), 0)), dtype=torch.int32)
    return q.to(dtype), k.to(dtype), v.to(dtype), page_table, seq_lens, cu


def _run_case(name):
    q_lens, prefixes, hkv, g, d, ps, B, over, structured = CASES[name]
    over = dict(over)
    no_bits = over.pop("_no_bits", False)
    sink_boost = over.pop("_sink_boost", 0.0)
    return _run_case_body(name, q_lens, prefixes, hkv, g, d, ps, B, over, structured, no_bits, sink_boost)


def _run_case_body(name, q_lens, prefixes, hkv, g, d, ps, B, over, structured, no_bits, sink_boost=0.0):
    import dataclasses

    import torch
    from flashprefill import SparseConfig, make_plan
    from flashprefill.impl import reference as ref
    from flashprefill.impl.triton import host as tb

    cfg = SparseConfig(block_size=B, **{**BASE_CONFIG, **over})
    q, k, v, pt, sl, cu = make_inputs(q_lens, prefixes, hkv, g, d, ps, torch.float16, structured,
                                      sink_boost=sink_boost)
    plan = make_plan(sl, cu, g, B)
    idx = tb.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    ridx = ref.build_index(q, k, v, pt, sl, cu, cfg, None, plan)
    max_nb = max(-(-int(x) // B) for x in sl)
    mine = ref._csr_to_mask(idx, hkv, plan.n_tiles, max_nb)
    theirs = ref._csr_to_mask(ridx, hkv, plan.n_tiles, max_nb)
    counts = (idx.row_ptr[1:] - idx.row_ptr[:-1])
    # the kept selection bitmask says the same as the CSR (bits of visible blocks only)
    words = idx.sel_bits.to(torch.int64) & 0xFFFFFFFF
    decoded = ((words[:, :, None] >> torch.arange(32)) & 1).reshape(words.shape[0], -1)[:, :max_nb].bool()
    decoded &= torch.arange(max_nb)[None, :] < idx.n_visible[:, None]
    res = {
        "case": name,
        "mean_err": float(max((idx.k_mean - ridx.k_mean).abs().max(), (idx.v_mean - ridx.v_mean).abs().max())),
        # the 16-bit copies the correction reads: the float32 means rounded once (same as .to())
        "lowp_equal": (idx.k_mean_lowp is None and idx.v_mean_lowp is None) or bool(
            torch.equal(idx.k_mean_lowp, idx.k_mean.to(q.dtype)) and torch.equal(idx.v_mean_lowp, idx.v_mean.to(q.dtype))),
        "lowp_made": idx.k_mean_lowp is not None,
        "csr_mismatch": int((mine != theirs).sum()),
        "visible": int(ridx.n_visible.sum()),
        "n_visible_equal": bool(torch.equal(idx.n_visible, ridx.n_visible)),
        "row_ptr_ok": bool(int(idx.row_ptr[0]) == 0 and int(idx.row_ptr[-1]) == idx.col_idx.numel()),
        "ascending": bool(all((idx.segment(s)[1:] > idx.segment(s)[:-1]).all() for s in range(idx.n_segments))),
        "empty_segments": int((counts == 0).sum()),
        "density": idx.nnz / max(1, int(idx.n_visible.sum())),
        "sel_bits_match_csr": bool(torch.equal(decoded.reshape(mine.shape), mine.bool())),
    }
    if name in ONE_CALL_CASES:
        # ``attention`` (index, then attention, one KernelConfig): the same index and output
        fo, fl, fidx = tb.attention(q, k, v, pt, sl, cu, cfg, None, plan)
        o1, l1 = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
        res["one_call_same"] = bool(torch.equal(fidx.col_idx, idx.col_idx) and torch.equal(fo, o1)
                                    and torch.equal(fl, l1))
    # Attention with the Triton selection in both implementations.
    if no_bits:
        idx = dataclasses.replace(idx, sel_bits=None)
    out = torch.full_like(q, float("nan"))
    o, l = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
    out.copy_(o)
    ro, rl = ref.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, idx)
    res["out_rel"] = float((out.float() - ro.float()).norm() / ro.float().norm())
    res["out_max"] = float((out.float() - ro.float()).abs().max())
    res["lse_max"] = float((l - rl.float()).abs().max())
    res["nan"] = bool(torch.isnan(out).any() or torch.isnan(l).any())
    if name in REF_INDEX_CASES:
        # the reference's index has no bitmask: the kernel folds every candidate in and subtracts
        assert ridx.sel_bits is None
        o2, l2 = tb.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, ridx)
        ro2, _ = ref.sparse_attention(q, k, v, pt, sl, cu, cfg, None, plan, ridx)
        res["ref_index_out_rel"] = float((o2.float() - ro2.float()).norm() / ro2.float().norm())
    do, dl = tb.dense_attention(q, k, v, pt, sl, cu, None, plan)
    rdo, rdl = ref.dense_attention(q, k, v, pt, sl, cu, None, plan)
    res["dense_rel"] = float((do.float() - rdo.float()).norm() / rdo.float().norm())
    res["dense_lse_max"] = float((dl - rdl.float()).abs().max())
    res["dense_nan"] = bool(torch.isnan(do).any())
    if name == "batch_g3_ps64":
        # block means in bf16 (no dot: exact in the interpreter too)
        qb, kb, vb = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        km, vm = tb.block_means(kb, vb, pt, sl, plan, B)
        rb = ref.build_index(qb, kb, vb, pt, sl, cu, cfg, None, plan)
        res["bf16_mean_err"] = float(max((km - rb.k_mean).abs().max(), (vm - rb.v_mean).abs().max()))
    return res


WORKERS = 2


def worker(k: int, n: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT / "kernels"))
    _patch_interpreter()
    for name in list(CASES)[k::n]:
        try:
            res = _run_case(name)
        except Exception as e:  # report, the test names the case
            import traceback
            res = {"case": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(res), flush=True)


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "kernels"), str(ROOT), env.get("PYTHONPATH", "")])
    n = max(1, min(WORKERS, os.cpu_count() or 1))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(k), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(n)]
    out, errors = {}, []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=1800)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("interpreter workers still running after 1800 s")
        for line in stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                out[r["case"]] = r
        if proc.returncode:
            errors.append(f"rc {proc.returncode}: {stderr[-4000:]}")
    if not out:
        pytest.fail("interpreter workers produced no results:\n" + "\n".join(errors))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_reference(results, name):
    r = results.get(name)
    assert r is not None, f"case {name} missing from the worker output"
    assert "error" not in r, f"{name}: {r.get('error')}\n{r.get('trace')}"
    assert r["mean_err"] < 1e-5, r
    assert r["lowp_equal"], r
    # selection: equal to the reference, at most 1% of visible blocks differ (threshold ties)
    assert r["csr_mismatch"] <= 0.01 * r["visible"], r
    assert r["n_visible_equal"] and r["row_ptr_ok"] and r["ascending"], r
    assert r["empty_segments"] == 0, r
    assert r["sel_bits_match_csr"], r
    assert not r["nan"] and not r["dense_nan"], r
    # fp16 operands, fp32 accumulation: well inside the 1e-3..1e-2 band of 16-bit attention
    assert r["out_rel"] < 3e-3, r
    assert r["lse_max"] < 2e-3, r
    assert r["dense_rel"] < 3e-3, r
    assert r["dense_lse_max"] < 2e-3, r
    if "bf16_mean_err" in r:
        assert r["bf16_mean_err"] < 1e-5, r
    if name in ONE_CALL_CASES:
        assert r["one_call_same"], r
    if name in REF_INDEX_CASES:
        assert r["ref_index_out_rel"] < 3e-3, r


def test_selection_is_sparse_and_rules_hold(results):
    """The structured cases must actually prune (else the CSR test proves little)."""
    assert results["len300_prefix_g3_ps16"]["density"] < 0.9, results["len300_prefix_g3_ps16"]
    assert results["alpha0_dense_scored"]["density"] >= results["len300_prefix_g3_ps16"]["density"]
    assert results["short_request_dense"]["density"] == 1.0, results["short_request_dense"]
    # a lower bar (the max over fewer blocks) keeps a superset: here strictly more
    assert results["prunable_batch_g3_ps64"]["density"] > results["scored_strong_sink_batch_g3_ps64"]["density"]
    # the selection options' cases prune (a too generous score would otherwise pass)
    for name in ("prunable_batch_g3_ps64", "mass_batch_g3_ps64", "mass_prunable_long_prefix_d128"):
        assert results[name]["density"] < 0.95, results[name]
    # the default (one-dot scores) writes the 16-bit means the correction reads
    assert all(r.get("lowp_made") for r in results.values()), results


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    worker(int(sys.argv[i + 1]), int(sys.argv[i + 2]))


def test_correction_without_bitmask_refuses_32bit_overflowing_offsets():
    """Without a selection bitmask the correction addresses a selected block's means as a 32-bit
    block id times the means' row stride: a batch where that overflows is refused before any
    launch."""
    import dataclasses

    import torch
    from flashprefill import make_plan
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config
    hkv, g, d = 2, 2, 64
    q = torch.randn(8, hkv * g, d, dtype=torch.float16)
    cache = torch.randn(1, 64, hkv, d, dtype=torch.float16)
    sl = torch.tensor([8], dtype=torch.int32)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    means = torch.randn(1, hkv, d, dtype=torch.float16)            # row stride hkv * d = 128
    plan = make_plan(sl, cu, g, 64)
    huge = dataclasses.replace(plan, kv_lens=(64 * (2**31 // 128 + 1),))   # fake length: never launched
    tiles = get_config(d, torch.float16, 64).attn
    with pytest.raises(ValueError, match="overflows 32-bit offsets"):
        host.launch_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), sl, cu, 0.125, huge, tiles,
                              sparse=True, mean_correction=True, block_size=64, row_ptr=plan.tile_ptr,
                              col_idx=plan.tile_ptr, k_mean=means, v_mean=means)
    with pytest.raises(ValueError, match="timing must be a contiguous int64"):
        host.launch_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), sl, cu, 0.125, plan, tiles,
                              sparse=False, mean_correction=False, block_size=64,
                              timing=torch.zeros(2, 3, dtype=torch.int64))
