"""The lab's vertical-blocks measurement (``scripts/lab/vertical_blocks.py``) on synthetic keys: its
sparse output is the operator's, its densities are the operator's head counts, global blocks reach
only tiles that see them completely and never the sink / last window, and on keys with a few
"vertical" columns the last queries find them and the global blocks cut the error. CPU, no model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import vertical_blocks as vb  # noqa: E402  (scripts/lab is not a package)

from flashprefill import SparseConfig, flashprefill_attention  # noqa: E402
from flashprefill.integrations import transformers as fpt  # noqa: E402

CFG = SparseConfig(block_size=64, sink_tokens=64, window_tokens=256, dense_tail_tokens=64, alpha=0.3,
                    min_sparse_len=1024)
TOKENS = torch.tensor([700, 1200, 1999, 2100, 2500])
F64 = {"rtol": 1e-12, "atol": 1e-15}  # float64 rounding of O(1) values


def _layer(seed: int = 0):
    """q ``[4, 3000, 32]``, k / v ``[2, 3000, 32]``: random keys, every 7th 64-token block shifted along
    a direction the queries share (so the threshold prunes the others), and one key in each of six
    other blocks ("vertical" keys) that every query attends to strongly."""
    g = torch.Generator().manual_seed(seed)
    L, hq, hkv, d = 3000, 4, 2, 32
    u = torch.randn(d, generator=g)
    u = u / u.norm()
    q = torch.randn(hq, L, d, generator=g) + 2.0 * u
    k = torch.randn(hkv, L, d, generator=g)
    k[:, (torch.arange(L) // 64) % 7 == 3] += 3.0 * u
    vert = torch.tensor([300, 600, 1010, 1400, 1700, 1900])
    k[:, vert] += 10.0 * u
    v = torch.randn(hkv, L, d, generator=g)
    return q, k, v, vert


def test_output_and_density_are_the_operators():
    q, k, v, _ = _layer()
    L = q.shape[1]
    rows = vb.Rows(q, k, v, 0.3, 64, TOKENS)
    mask = vb.selection(q, k, v, 0.3, CFG)
    kc, vc = fpt._paged(k[None]), fpt._paged(v[None])
    pt = torch.arange(kc.shape[0], dtype=torch.int32)[None]
    o, index = flashprefill_attention(q.transpose(0, 1).contiguous(), kc, vc, pt, torch.tensor([L], dtype=torch.int32),
                                      torch.tensor([0, L], dtype=torch.int32), config=CFG, softmax_scale=0.3,
                                      return_index=True, backend="reference")
    assert vb.nr.rel(rows.out(mask), o.double()[TOKENS].transpose(0, 1)) < 1e-5
    visible, _, _ = vb.geometry(L, 2, CFG)
    hs, hv = index.head_counts()
    assert vb.density(mask, visible) == (int(hs.sum()), int(hv.sum()))
    assert 0.1 < int(hs.sum()) / int(hv.sum()) < 0.9


def test_global_blocks_respect_causality_and_exclusions():
    L, B = 3000, 64
    visible, seen, excluded = vb.geometry(L, 2, CFG)
    assert bool(excluded[0]) and not bool(excluded[1])            # sink = block 0
    assert bool(excluded[-1]) and not bool(excluded[30])          # last sparse tile's window
    score = torch.rand(2, L, generator=torch.Generator().manual_seed(1))
    score[:, :B] = 10.0                                           # the sink would win: excluded
    glob = vb.global_blocks(score, B, 5, excluded, "sum")
    assert glob.sum(1).tolist() == [5, 5] and not bool(glob[:, excluded].any())
    mask = torch.zeros(2, visible.shape[0], visible.shape[1], dtype=torch.bool)
    added = vb.add_global(mask, glob, seen)
    assert bool((added <= (seen & glob[:, None, :])).all()) and bool(added.any())
    assert not bool((added & ~visible).any())
    # a block with one huge key: "max" picks it, "sum" need not
    s2 = torch.full((2, L), 0.01)
    s2[:, 10 * B + 3] = 5.0
    assert bool(vb.global_blocks(s2, B, 1, excluded, "max")[:, 10].all())


def test_last_queries_find_vertical_keys_and_global_blocks_help():
    q, k, v, vert = _layer()
    L = q.shape[1]
    r = vb.analyse_layer(q, k, v, 0.3, CFG, TOKENS, [0.3, 0.1], [8], [0.3], [8], 64)
    visible, _, excluded = vb.geometry(L, 2, CFG)
    col = vb.column_mass(q, k, 0.3, torch.arange(L - 64, L))
    top = vb.top_keys(col, 8, excluded.repeat_interleave(64)[:L])
    assert bool(top[:, vert].all())                               # the last queries see the columns
    pk = r["peak"]
    share = float(pk["lastq top8"].sum() / pk["pruned"].sum())
    assert float(pk["pruned"].sum()) > 0 and share > 0.3        # 8 keys of ~2000 pruned ones
    assert float(pk["top1/block"].sum()) <= float(pk["top4/block"].sum()) <= float(pk["pruned"].sum()) + 1e-9
    c = r["configs"]
    err = {n: vb.nr.rel(x["out"], r["dense"]) for n, x in c.items()}
    assert err["alpha 0.3 + lastq-sum G8"] < 0.5 * err["alpha 0.3"]
    assert c["alpha 0.3 + lastq-sum G8"]["selected"] > c["alpha 0.3"]["selected"]
    assert float(c["alpha 0.3 + lastq-sum G8"]["recovered"].sum()) > 0.3 * float(pk["pruned"].sum())


def test_frontier_interpolates_between_bracketing_alphas():
    pts = [(0.5, 0.2), (0.7, 0.1), (0.9, 0.02)]
    assert abs(vb.frontier_at(pts, 0.6) - 0.15) < 1e-12
    assert vb.frontier_at(pts, 0.95) != vb.frontier_at(pts, 0.95)  # nan outside


def test_global_keys_are_exact_and_leave_the_fold_to_the_other_keys():
    q, k, v, vert = _layer()
    L = q.shape[1]
    rows = vb.Rows(q, k, v, 0.3, 64, TOKENS)
    mask = vb.selection(q, k, v, 0.3, CFG)
    none = torch.zeros(2, L, dtype=torch.bool)
    torch.testing.assert_close(rows.out(mask, none), rows.out(mask))
    every = torch.ones(2, L, dtype=torch.bool)                    # every key exact: dense attention
    torch.testing.assert_close(rows.out(mask, every), rows.dense)
    ks = torch.zeros(2, L, dtype=torch.bool)
    ks[:, vert] = True
    assert vb.nr.rel(rows.out(mask, ks), rows.dense) < 0.5 * vb.nr.rel(rows.out(mask), rows.dense)
    r = vb.analyse_layer(q, k, v, 0.3, CFG, TOKENS, [0.3], [], [0.3], [8], 64, global_keys=[8])
    c = r["configs"]
    assert c["alpha 0.3"]["selected"] < c["alpha 0.3 + lastq keys K8"]["selected"] < c["alpha 0.3"]["selected"] + 8 * 2 * 47 / 64


def test_device_and_model_options_parse_and_bad_ones_exit_2():
    a = vb.parse_args(["--device", "cuda", "--model", "qwen2.5-coder-0.5b-instruct", "--context", "32k",
                       "--dtype", "bfloat16", "--len", "32k", "--layers", "2-23", "--json", "out.json"])
    assert (a.device, a.model, a.context, a.dtype, a.length) == ("cuda", "qwen2.5-coder-0.5b-instruct", 32768,
                                                                  "bfloat16", 32768)
    assert a.layers == "2-23" and a.row_chunk == 0 and a.global_keys == [64, 256]
    d = vb.parse_args([])                                          # the CPU default run: SmolLM2, its own context
    assert (d.device, d.model, d.context, d.dtype, d.length) == ("cpu", None, None, "auto", 7168)
    for bad in (["--len", "32q"], ["--context", "lots"], ["--device", "tpu"], ["--row-chunk", "-1"],
                ["--alphas", "0.05,x"]):
        with pytest.raises(SystemExit) as exc:
            vb.parse_args(bad)
        assert exc.value.code == 2, bad


def test_row_chunks_give_the_same_float64_numbers():
    """The per-row analysis ``row_chunk`` tokens at a time (the bounded-memory path for long prompts)
    gives the numbers of the one-shot path: same configurations, block counts, outputs, shares (to
    float64 rounding: the row-count changes the matmuls' blocking)."""
    q, k, v, _ = _layer()
    args = (q, k, v, 0.3, CFG, TOKENS, [0.3, 0.1], [4], [0.3], [8], 64)
    whole = vb.analyse_layer(*args, check=True, global_keys=[8])
    for chunk in (1, 2, 4):
        part = vb.analyse_layer(*args, check=True, global_keys=[8], row_chunk=chunk)
        assert list(part["configs"]) == list(whole["configs"]) and len(whole["configs"]) == 2 + 4 + 3
        assert part["picked"] == whole["picked"] and part["top_keys"] == whole["top_keys"]
        assert part["ref_err"] == pytest.approx(whole["ref_err"], rel=1e-9, abs=1e-15)
        torch.testing.assert_close(part["dense"], whole["dense"], **F64)
        for name, c in whole["configs"].items():
            p = part["configs"][name]
            assert (p["selected"], p["visible"]) == (c["selected"], c["visible"]), name
            assert p["out"].dtype == torch.float64 and p["out"].shape == (4, TOKENS.numel(), 32)
            torch.testing.assert_close(p["out"], c["out"], **F64)
            torch.testing.assert_close(p["recovered"], c["recovered"], **F64)
        for name, x in whole["peak"].items():
            torch.testing.assert_close(part["peak"][name], x, **F64)
    with pytest.raises(ValueError, match="tokens"):
        vb.analyse_layer(q, k, v, 0.3, CFG, TOKENS[:0], [0.3], [], [0.3], [8], 64)
