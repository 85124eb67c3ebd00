"""The SGLang backend's per-batch statistics on CUDA (``flashprefill.integrations.sglang.stats_writer``), without
SGLang: the one-gather-per-layer counts, the pinned copy, the events and the writer's polling,
on a side stream the way the scheduler may run a forward. The statistics come from the index the
attention used (``flashprefill_attention(..., return_index=True)``, no host sync) and are
compared with that index itself."""
from __future__ import annotations

import itertools

import pytest
import torch

from flashprefill import SparseConfig, flashprefill_attention, make_plan
from flashprefill.integrations.sglang.metadata import plan_to_device
from flashprefill.integrations.sglang.stats_writer import BatchStats


def _inputs(q_lens, kv_lens, hq, hkv, d=128, page_size=16, seed=0):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    pages = [-(-k // page_size) for k in kv_lens]
    page_table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32, device=dev)
    start = 0
    for b, n in enumerate(pages):
        page_table[b, :n] = torch.arange(start, start + n, dtype=torch.int32, device=dev)
        start += n
    k = torch.randn(start + 1, page_size, hkv, d, generator=gen, device=dev)
    k[..., :8] += 3 * torch.randn(start + 1, 1, hkv, 8, generator=gen, device=dev)   # uneven blocks
    v = torch.randn(start + 1, page_size, hkv, d, generator=gen, device=dev)
    q = torch.randn(sum(q_lens), hq, d, generator=gen, device=dev)
    q[..., :8] *= 4
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    seq = torch.tensor(kv_lens, dtype=torch.int32)
    bf = torch.bfloat16
    return q.to(bf), k.to(bf), v.to(bf), page_table, seq.to(dev), cu.to(dev), seq, cu


def test_batch_stats_on_a_side_stream_match_the_index():
    q_lens, kv_lens, hq, hkv = [3000, 0, 700, 1, 4000], [5000, 30, 2000, 64, 4000], 8, 2
    q, k, v, pt, seq, cu, seq_host, cu_host = _inputs(q_lens, kv_lens, hq, hkv)
    cfg = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3,
                       min_sparse_len=500)
    plan = plan_to_device(make_plan(seq_host, cu_host, hq // hkv, 64), q.device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        busy = torch.randn(4096, 4096, device=q.device)
        busy = busy @ busy                                   # the stream is busy when stats start
        st = BatchStats(num_layers=4, layer_offset=2, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                        q_lens=q_lens, kv_lens=kv_lens, rids=list("abcde"), device=q.device,
                        layer_timing=True, plan=plan)
        st.mark_dense(2, "dense_layers")
        indexes = {}
        for layer in (3, 4, 5):
            ev0 = st.stage_event()
            _, indexes[layer] = flashprefill_attention(q, k, v, pt, seq, cu, config=cfg, plan=plan, backend="triton",
                                                       return_index=True)
            st.add_index(layer, indexes[layer], (ev0, st.stage_event(), st.stage_event()))
        st.finish()
    st.wait()
    assert st.ready()
    recs = st.records()
    tile_ptr = plan.tile_ptr.tolist()
    n_tiles = tile_ptr[-1]
    for layer, index in indexes.items():
        counts = (index.row_ptr[1:] - index.row_ptr[:-1]).cpu().view(hkv, n_tiles)
        vis = index.n_visible.cpu().view(hkv, n_tiles)
        for b, rec in enumerate(recs):
            want_sel = [int(counts[h, tile_ptr[b]:tile_ptr[b + 1]].sum()) for h in range(hkv)]
            want_vis = [int(vis[h, tile_ptr[b]:tile_ptr[b + 1]].sum()) for h in range(hkv)]
            assert rec["selected"][layer - 2] == want_sel, (layer, b)
            assert rec["visible"][layer - 2] == want_vis, (layer, b)
    assert recs[0]["layers"] == ["dense:dense_layers", "sparse", "sparse", "sparse"]
    assert recs[0]["selected"][0] is None
    # request 3 (1 new token) is below min_sparse_len: dense inside the operator, all kept;
    # request 4 (4000 new tokens) is pruned
    assert recs[3]["selected"][1] == recs[3]["visible"][1] and recs[3]["visible"][1][0] > 0
    assert sum(recs[4]["selected"][1]) < sum(recs[4]["visible"][1])
    assert recs[1]["visible"][1] == [0, 0]                           # no new tokens, no tiles
    assert recs[0]["prefill_ms"] > 0 and recs[0]["index_ms"] > 0 and recs[0]["attention_ms"] >= 0
    # per layer slot: null for the dense layer, the events' times for the sparse ones, summing to the totals
    idx, att = recs[0]["index_ms_per_layer"], recs[0]["attention_ms_per_layer"]
    assert idx[0] is None and att[0] is None and all(x > 0 for x in idx[1:]) and all(x >= 0 for x in att[1:])
    assert sum(idx[1:]) == pytest.approx(recs[0]["index_ms"]) and sum(att[1:]) == pytest.approx(recs[0]["attention_ms"])


def test_dense_batch_stats_on_cuda_copy_nothing():
    st = BatchStats(num_layers=2, layer_offset=0, num_q_heads=2, num_kv_heads=1, head_dim=64, q_lens=[100],
                    kv_lens=[100], rids=["x"], device="cuda", plan=None)
    st.mark_dense(0, "short")
    st.mark_dense(1, "short")
    st.finish()
    st.wait()
    rec = st.records()[0]
    assert st.host_ends is None and rec["selected"] is None and rec["prefill_ms"] >= 0
