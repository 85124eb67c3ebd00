"""CPU tests of the SGLang integration: everything that runs without SGLang and CUDA.

Page table from a fake ``req_to_token`` (shuffled pages, page sizes 1/4/16), the metadata builder,
settings serialisation (profile -> env -> scheduler), the stats path (device counters -> JSONL ->
PrefillStats), the server arguments and ``fp serve`` argv, the needle prompts, and the clear
error when SGLang is missing. ``register()`` runs only where SGLang is installed.
"""
from __future__ import annotations

import os

import itertools
import json
import types
import random
from types import SimpleNamespace

import pytest
import torch

from flashprefill.config import SparseConfig
from flashprefill.plan import make_plan
from flashprefill.integrations.sglang.metadata import (
    build_metadata, build_page_table, check_page_table, last_attention_layer_id, operator_dense_reason,
)
from flashprefill.integrations.sglang.settings import ENV_VAR, BackendSettings
from flashprefill.integrations.sglang.stats_reader import aggregate, iter_records, read_prefill_stats
from flashprefill.integrations.sglang.stats_writer import BatchStats, StatsWriter
from fp_fakes import invoke
from fpcli.engine.sglang_engine import backend_settings, prefill_stats_of


def fake_pool(kv_lens, page_size, max_ctx=512, seed=0):
    """A ``req_to_token`` whose requests own whole pages in shuffled order (like SGLang's paged
    allocator), with the rows of the batch at non-trivial pool indices."""
    rng = random.Random(seed)
    n_req_rows = len(kv_lens) + 3
    req_to_token = torch.zeros(n_req_rows, max_ctx, dtype=torch.int32)
    pages_needed = sum(-(-lk // page_size) for lk in kv_lens)
    free_pages = list(range(1, pages_needed + 8))  # page 0 is SGLang's padding page
    rng.shuffle(free_pages)
    rows = [2, 0, 4, 1, 3][: len(kv_lens)]
    for row, lk in zip(rows, kv_lens):
        for k in range(-(-lk // page_size)):
            page = free_pages.pop()
            for off in range(page_size):
                p = k * page_size + off
                if p < lk:
                    req_to_token[row, p] = page * page_size + off
    pool_rows = (pages_needed + 9) * page_size
    return req_to_token, torch.tensor(rows), pool_rows


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_table_matches_req_to_token(page_size):
    kv = [37, 100, 1, 64]
    r2t, rpi, _ = fake_pool(kv, page_size)
    table = build_page_table(r2t, rpi, max(kv), page_size)
    assert table.dtype == torch.int32 and table.shape == (4, -(-max(kv) // page_size))
    check_page_table(table, r2t, rpi, kv, page_size)  # raises on any mismatch
    for b, (row, lk) in enumerate(zip(rpi.tolist(), kv)):
        for p in range(lk):
            assert int(table[b, p // page_size]) * page_size + p % page_size == int(r2t[row, p])


def test_page_table_check_catches_misaligned_pool():
    r2t, rpi, _ = fake_pool([40], 8)
    r2t[rpi[0], 9] += 1  # one token outside its page
    table = build_page_table(r2t, rpi, 40, 8)
    with pytest.raises(ValueError, match="position 9"):
        check_page_table(table, r2t, rpi, [40], 8)


def test_build_metadata_plan_and_cu_seqlens():
    kv, q = [300, 129, 50], [300, 1, 20]  # request 1 is a decode-like token in a mixed batch
    r2t, rpi, rows = fake_pool(kv, 16)
    meta = build_metadata(
        req_to_token=r2t, req_pool_indices=rpi, seq_lens=torch.tensor(kv), extend_seq_lens=torch.tensor(q),
        kv_lens_host=kv, q_lens_host=q, page_size=16, pool_rows=rows, group_size=3, block_size=128,
        rids=["a", "b", "c"],
    )
    assert meta.sparse and meta.rids == ("a", "b", "c")
    assert meta.prefix_lens == (0, 128, 30) and meta.total_q == 321
    assert meta.cu_seqlens_q.tolist() == [0, 300, 301, 321] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seq_lens.dtype == torch.int32 and meta.num_pages == rows // 16
    ref = make_plan(torch.tensor(kv, dtype=torch.int32), meta.cu_seqlens_q, 3, 128)
    assert meta.plan.q_lens == ref.q_lens and meta.plan.kv_lens == ref.kv_lens
    assert torch.equal(meta.plan.tile_ptr, ref.tile_ptr) and torch.equal(meta.plan.tile_request, ref.tile_request)


def test_build_metadata_short_batch_is_dense():
    kv = [30, 40]
    r2t, rpi, rows = fake_pool(kv, 1)
    meta = build_metadata(
        req_to_token=r2t, req_pool_indices=rpi, seq_lens=torch.tensor(kv), extend_seq_lens=torch.tensor(kv),
        kv_lens_host=kv, q_lens_host=kv, page_size=1, pool_rows=rows, group_size=1, block_size=64, min_sparse_len=1024,
    )
    assert not meta.sparse and meta.dense_reason.startswith("short") and meta.plan is None and meta.page_table is None


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_feeds_operator_layout(page_size):
    """The pool view + page table give the operator exactly each request's K/V (dense reference)."""
    from flashprefill.impl import reference as ref
    torch.manual_seed(0)
    kv, q, hq, hkv, d = [70, 33], [70, 5], 4, 2, 16
    r2t, rpi, rows = fake_pool(kv, page_size)
    k_buf = torch.randn(rows, hkv, d, dtype=torch.float64)
    v_buf = torch.randn(rows, hkv, d, dtype=torch.float64)
    meta = build_metadata(
        req_to_token=r2t, req_pool_indices=rpi, seq_lens=torch.tensor(kv), extend_seq_lens=torch.tensor(q),
        kv_lens_host=kv, q_lens_host=q, page_size=page_size, pool_rows=rows, group_size=hq // hkv, block_size=64,
    )
    n = meta.num_pages * page_size
    k_cache = k_buf[:n].view(meta.num_pages, page_size, hkv, d)
    v_cache = v_buf[:n].view(meta.num_pages, page_size, hkv, d)
    qt = torch.randn(sum(q), hq, d, dtype=torch.float64)
    out, _ = ref.dense_attention(qt, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q,
                                 d ** -0.5, meta.plan)
    start = 0
    for b, (row, lk, lq) in enumerate(zip(rpi.tolist(), kv, q)):
        slots = r2t[row, :lk].long()
        kk = k_buf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, Lk, d]
        vv = v_buf[slots].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qq = qt[start:start + lq].transpose(0, 1)  # [Hq, Lq, d]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        expect = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=d ** -0.5)
        torch.testing.assert_close(out[start:start + lq], expect.transpose(0, 1), rtol=1e-9, atol=1e-9)
        start += lq


# ------------------------------------------------------------------------------------------------
# settings: profile -> env -> scheduler
# ------------------------------------------------------------------------------------------------


def test_settings_env_round_trip(tmp_path):
    from fpcli.profiles import load_profile

    prof = load_profile("bf16")
    s = backend_settings(prof, str(tmp_path), timing=True)
    assert s.sparse == prof.sparse_config() and s.dense_layers == prof.dense_layers and s.precision == prof.precision
    assert s.layer_timing and not backend_settings(prof, None).layer_timing  # timing only when asked for
    env = s.to_env()
    assert set(env) == {ENV_VAR}
    assert BackendSettings.from_env(env) == s
    path = tmp_path / "s.json"
    path.write_text(s.to_json())
    assert BackendSettings.from_env({ENV_VAR: f"@{path}"}) == s
    assert BackendSettings.from_env({}) == BackendSettings()


def test_a_set_of_dense_layers_travels_to_the_scheduler(tmp_path):
    """A profile's set of dense layers (``[0, 1, 8-11]``) reaches the scheduler's settings through
    the JSON in the environment as the same tuple, and the per-layer rule the backend's
    ``_layer_dense_reason`` asks (``BackendSettings.dense_layer``) is membership, not "< N"."""
    from fpcli.profiles import profile_from_dict

    prof = profile_from_dict({"name": "dl", "dense_layers": [0, 1, "8-11"]})
    s = backend_settings(prof, str(tmp_path))
    assert s.dense_layers == (0, 1, 8, 9, 10, 11)
    assert json.loads(s.to_json())["dense_layers"] == [0, 1, 8, 9, 10, 11]
    back = BackendSettings.from_env(s.to_env())
    assert back == s and back.dense_layers == (0, 1, 8, 9, 10, 11)
    assert [i for i in range(24) if back.dense_layer(i)] == [0, 1, 8, 9, 10, 11]
    first = BackendSettings.from_json(BackendSettings(dense_layers=2).to_json())  # the first N, as before
    assert first.dense_layers == 2 and [i for i in range(24) if first.dense_layer(i)] == [0, 1]


@pytest.mark.parametrize("value, problem", [
    (-1, "an int must be >= 0"), (True, "must be an int >= 0 or a tuple"), ([0, 1], "must be an int >= 0 or a tuple"),
    ((1, 0), "strictly increasing"), ((0, 0), "strictly increasing"), ((0, -2), "ints >= 0"), ((0, 1.0), "ints >= 0"),
])
def test_settings_refuse_a_bad_set_of_dense_layers(value, problem):
    with pytest.raises(ValueError, match=f"BackendSettings.dense_layers: .*{problem}"):
        BackendSettings(dense_layers=value)
    from flashprefill.integrations.transformers import FlashPrefillRuntime

    with pytest.raises(ValueError, match=f"FlashPrefillRuntime.dense_layers: .*{problem}"):
        FlashPrefillRuntime(dense_layers=value)


def test_settings_carry_fp8_compare_and_the_log_level_to_the_scheduler(tmp_path):
    from fpcli.engine.sglang_engine import quiet_children_env
    from fpcli.profiles import load_profile

    prof = load_profile("fp8")
    quiet = backend_settings(prof, str(tmp_path))
    loud = backend_settings(prof, str(tmp_path), compare_fp8=True, verbose=True)
    assert quiet.precision == "fp8" and not quiet.compare_fp8 and quiet.log_level == "warning"
    assert loud.compare_fp8 and loud.log_level == "info"
    assert BackendSettings.from_env(loud.to_env()) == loud  # reaches the spawned scheduler whole
    assert BackendSettings().log_level is None and not BackendSettings().compare_fp8  # a plain SGLang user
    with pytest.raises(ValueError, match=r"log_level must be None or one of .*got 'loud'"):
        BackendSettings(log_level="loud")
    assert quiet_children_env(False) == {"TQDM_DISABLE": "1"} and quiet_children_env(True) == {}


@pytest.mark.parametrize("level, printed", [("warning", False), ("info", True), (None, False)])
def test_plugin_prints_its_registration_only_when_verbose(monkeypatch, capsys, level, printed):
    import logging

    from flashprefill.integrations.sglang import plugin

    env = BackendSettings(log_level=level).to_env()
    monkeypatch.setenv(ENV_VAR, env[ENV_VAR])
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a fresh scheduler: logging not set up yet
    before = logging.getLogger("flashprefill").level
    try:
        plugin._say("flashprefill: attention backend registered in SGLang by the test path")
        err = capsys.readouterr().err
        assert ("[fp] flashprefill: attention backend registered" in err) == printed
        if level is not None:
            assert logging.getLogger("flashprefill").level == getattr(logging, level.upper())
    finally:
        logging.getLogger("flashprefill").setLevel(before)


def test_quiet_settings_send_the_scheduler_output_to_a_file(tmp_path):
    from fpcli.engine.sglang_engine import scheduler_log_path
    from fpcli.profiles import load_profile

    prof = load_profile("bf16")
    quiet = backend_settings(prof, str(tmp_path))
    assert quiet.scheduler_output == scheduler_log_path(str(tmp_path)) and quiet.scheduler_output.startswith(str(tmp_path))
    assert backend_settings(prof, str(tmp_path), verbose=True).scheduler_output is None  # -v: the terminal
    assert BackendSettings.from_env(quiet.to_env()) == quiet
    assert BackendSettings().scheduler_output is None  # a plain SGLang user keeps the scheduler's output


SCHEDULER_STUB = """
import subprocess, sys, types
# SGLang's scheduler entry as it behaves at start-up: log lines, a tqdm bar written with an
# explicit disable= (TQDM_DISABLE cannot stop it), output of a process it starts
sched = types.ModuleType("sglang.srt.managers.scheduler")
def run_scheduler_process(*args, **kwargs):
    print("[2026-12-01 10:00:00] Load weight begin.")
    sys.stderr.write("\\rMulti-thread loading shards:   0% |\\rMulti-thread loading shards: 100% |\\n")
    sys.stderr.flush()
    subprocess.run(["sh", "-c", "echo a grandchild line >&2"], check=True)
    return args
sched.run_scheduler_process = run_scheduler_process
for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["sglang.srt.managers.scheduler"] = sched
from flashprefill.integrations.sglang import plugin
plugin.register = lambda source="": None  # the registry is SGLang's; this test is about the output
assert plugin.run_scheduler_process(1, 2) == (1, 2)
"""


@pytest.mark.parametrize("quiet", [True, False])
def test_scheduler_entry_redirects_its_output_before_sglang_runs(tmp_path, quiet):
    import subprocess
    import sys

    from fpcli.engine.sglang_engine import log_tail

    log = tmp_path / "scheduler.log"
    settings = BackendSettings(scheduler_output=str(log) if quiet else None)
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", SCHEDULER_STUB], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    shown = r.stdout + r.stderr
    if quiet:
        assert "Load weight" not in shown and "loading shards" not in shown and "grandchild" not in shown
        text = log.read_text()
        assert "Load weight begin" in text and "loading shards: 100%" in text and "grandchild" in text
        assert (log.stat().st_mode & 0o777) == 0o600
        tail = log_tail(str(log))
        assert "Multi-thread loading shards: 100% |" in tail and "shards:   0%" not in tail  # bars collapse to their end
    else:
        assert "Load weight begin" in shown and "loading shards" in shown and "grandchild" in shown
        assert not log.exists()


def test_fp8_error_sums_travel_from_the_scheduler_to_the_report(tmp_path):
    """BatchStats (scheduler) -> JSON line -> aggregate over chunks -> PrefillStats per layer/head."""
    from flashprefill.integrations.sglang.stats_writer import BatchStats
    from fpcli.engine.base import FP8_SPARSE
    from fpcli.engine.sglang_engine import ran_precision_of

    def batch(err, ref):
        plan = make_plan(torch.tensor([300], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32), 2, 128)
        st = BatchStats(num_layers=2, layer_offset=0, num_q_heads=4, num_kv_heads=2, head_dim=64, q_lens=[300],
                        kv_lens=[300], rids=["r1"], device="cpu", plan=plan)
        st.mark_dense(0, "dense_layers")
        st.add_index(1, None, precision="fp8")
        st.add_fp8_error(1, torch.tensor([[err], [ref]], dtype=torch.float64))
        assert st.token_request().tolist() == [0] * 300
        st.finish()
        return st.records()[0]

    recs = [batch([1.0, 4.0], [100.0, 100.0]), batch([3.0, 5.0], [300.0, 300.0])]  # two chunks of one request
    assert recs[0]["precision"] == [None, "fp8"] and recs[0]["fp8_err_sq"] == [None, [1.0, 4.0]]
    req = aggregate(recs, "r1")
    assert req.fp8_err_sq == [None, [4.0, 9.0]] and req.fp8_ref_sq == [None, [400.0, 400.0]]
    assert ran_precision_of(req, "bf16") == FP8_SPARSE and ran_precision_of(None, "bf16") == "bf16"
    stats = prefill_stats_of(req)
    assert stats.fp8_rel_l2_per_layer[0] is None and stats.fp8_rel_l2_per_layer_head[0] == []
    assert stats.fp8_rel_l2_per_layer_head[1] == pytest.approx([0.1, 0.15])
    assert stats.fp8_rel_l2_per_layer[1] == pytest.approx((13.0 / 800.0) ** 0.5)
    plain = aggregate([{**r, "fp8_err_sq": None, "fp8_ref_sq": None} for r in recs], "r1")
    assert prefill_stats_of(plain).fp8_rel_l2_per_layer == []  # not compared: no FP8 errors at all


def test_settings_errors_name_the_key():
    with pytest.raises(ValueError, match="unknown keys"):
        BackendSettings.from_dict({"nope": 1})
    with pytest.raises(ValueError, match=ENV_VAR):
        BackendSettings.from_env({ENV_VAR: "{not json"})
    with pytest.raises(ValueError, match="precision"):
        BackendSettings(precision="fp4")
    with pytest.raises(ValueError, match="block_size"):
        BackendSettings.from_dict({"sparse": {"block_size": 96}})
    with pytest.raises(ValueError, match=r"operator_backend must be one of \('auto', 'reference', 'triton'\), got 'cute'"):
        BackendSettings(operator_backend="cute")
    with pytest.raises(ValueError, match="operator_backend"):
        BackendSettings.from_json('{"operator_backend": "Triton"}')
    for name in ("auto", "reference", "triton"):
        assert BackendSettings(operator_backend=name).operator_backend == name


@pytest.mark.parametrize("d, dtype, backend, reason", [
    (128, torch.bfloat16, "auto", None),
    (64, torch.float16, "triton", None),
    (256, torch.bfloat16, "auto", None),
    (128, None, "auto", None),                       # dtype unknown: the per-layer KV check decides
    (96, torch.bfloat16, "auto", "head_dim 96"),
    (80, torch.float16, "triton", "head_dim 80"),
    (128, torch.float32, "auto", "model dtype torch.float32"),
    (128, torch.float32, "triton", "model dtype torch.float32"),
    (96, torch.float32, "reference", None),          # the reference takes any float model
])
def test_operator_dense_reason(d, dtype, backend, reason):
    got = operator_dense_reason(d, dtype, backend)
    assert (got is None) if reason is None else (got is not None and got.startswith(reason))


# ------------------------------------------------------------------------------------------------
# stats: device counters -> JSONL -> PrefillStats
# ------------------------------------------------------------------------------------------------


def _fake_index(counts):
    """A BlockIndex stand-in: per segment ``counts`` selected blocks (only ``row_ptr`` is read)."""
    row_ptr = torch.zeros(len(counts) + 1, dtype=torch.int32)
    row_ptr[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0)
    return SimpleNamespace(row_ptr=row_ptr)


def _plan(q_lens, kv_lens, group_size, block_size=128):
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return make_plan(torch.tensor(kv_lens, dtype=torch.int32), cu, group_size, block_size)


def test_stats_end_to_end_on_cpu(tmp_path):
    # 2 requests, g = 2: 400 and 20 packed rows -> tiles [4, 1]; 2 KV heads -> 10 segments
    # (head-major). Visible blocks per tile: request 0 (P 0) t_last 63, 127, 191, 199 -> 1+1+2+2;
    # request 1 (P 290) t_last 9 -> (290 + 9) // 128 + 1 = 3.
    plan = _plan([200, 10], [200, 300], group_size=2)
    st = BatchStats(num_layers=3, layer_offset=0, num_q_heads=4, num_kv_heads=2, head_dim=8, q_lens=[200, 10],
                    kv_lens=[200, 300], rids=["r0", "r1"], device="cpu", plan=plan)
    st.mark_dense(0, "dense_layers")
    st.add_index(1, _fake_index([1, 1, 2, 1, 2, 1, 1, 1, 2, 3]))
    st.add_index(2, _fake_index([1, 1, 2, 2, 3, 1, 1, 2, 2, 3]))
    assert st.ends.shape == (3, 2 * 2 * 2)   # one row per layer: starts and ends of (request, head)
    writer = StatsWriter(tmp_path)
    st.finish()
    writer.submit(st)
    writer.close()
    recs = list(iter_records(tmp_path))
    assert [r["rid"] for r in recs] == ["r0", "r1"]
    assert recs[0]["layers"] == ["dense:dense_layers", "sparse", "sparse"]
    # layer 1: request 0 -> head 0 tiles 1+1+2+1, head 1 tiles 1+1+1+2; request 1 -> 2 and 3
    assert recs[0]["selected"][1] == [5, 5] and recs[0]["visible"][1] == [6, 6]
    assert recs[1]["selected"][1] == [2, 3] and recs[1]["visible"][1] == [3, 3]
    assert recs[0]["selected"][2] == [6, 6] and recs[1]["selected"][2] == [3, 3]
    assert recs[0]["selected"][0] is None and recs[0]["visible"][0] is None
    agg = aggregate(recs, "r0")
    ps = prefill_stats_of(agg)
    assert ps.density_per_layer[0] == 1.0 and ps.density_per_layer[2] == 1.0
    assert ps.density_per_layer[1] == pytest.approx(10 / 12)
    assert ps.density == pytest.approx((10 + 12) / (12 + 12))
    assert ps.attention_flops_dense == pytest.approx(3 * 4.0 * 4 * 8 * (200 * 201 // 2))
    assert 0 < ps.attention_flops_skipped < ps.attention_flops_dense
    assert ps.sparse_layers == [1, 2]  # layer 0 ran dense: not in the density, skips no FLOPs
    got = read_prefill_stats(tmp_path, "r1", timeout_s=0.1, expect_tokens=300)
    assert got is not None and got.prompt_tokens == 300
    assert read_prefill_stats(tmp_path, "missing", timeout_s=0.05) is None


class _Mark:
    """A stand-in for a recorded CUDA event at ``t`` ms (``elapsed_time`` is all ``records`` reads);
    the real events are checked on the GPU (tests/gpu/test_stats_cuda.py)."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, other: "_Mark") -> float:
        return other.t - self.t


def _timed_chunk(q_len, kv_len, times):
    """One extend batch of request ``r0`` over 3 layers as the backend writes its line: layer 0
    dense, then per layer ``times[i] = (index_ms, attention_ms)`` or ``None`` (dense in this chunk)."""
    plan = _plan([q_len], [kv_len], group_size=2)
    st = BatchStats(num_layers=3, layer_offset=0, num_q_heads=4, num_kv_heads=2, head_dim=8, q_lens=[q_len],
                    kv_lens=[kv_len], rids=["r0"], device="cpu", plan=plan)
    st.mark_dense(0, "dense_layers")
    t = 0.0
    for layer, got in enumerate(times):
        if got is None:
            if layer:
                st.mark_dense(layer, "short")
            continue
        marks = (_Mark(t), _Mark(t + got[0]), _Mark(t + got[0] + got[1]))
        t += got[0] + got[1]
        st.add_index(layer, _fake_index([1] * (2 * plan.n_tiles)), marks)
    st.finish()
    return st.records()[0]


def test_stage_times_per_layer_travel_from_the_lines_to_the_stats():
    """The writer's line has per-layer stage times (null for dense layers) summing to its totals;
    the reader sums the chunks of a request per layer (a layer dense in one chunk adds nothing
    there); ``prefill_stats_of`` gives one entry per sparse layer, summing to its totals."""
    first = _timed_chunk(300, 300, [None, (40.0, 10.0), (0.5, 1.5)])   # layer 1: a one-time cost
    assert first["index_ms_per_layer"] == [None, 40.0, 0.5] and first["attention_ms_per_layer"] == [None, 10.0, 1.5]
    assert first["index_ms"] == 40.5 and first["attention_ms"] == 11.5
    second = _timed_chunk(200, 500, [None, (0.25, 1.0), None])         # layer 2 dense in this chunk
    assert second["index_ms_per_layer"] == [None, 0.25, None]
    req = aggregate([first, second], "r0")
    assert req.index_ms_per_layer == [None, 40.25, 0.5] and req.attention_ms_per_layer == [None, 11.0, 1.5]
    assert (req.index_ms, req.attention_ms) == (40.75, 12.5)
    stats = prefill_stats_of(req)
    assert stats.sparse_layers == [1, 2]
    assert stats.index_ms_per_layer == [40.25, 0.5] and stats.attention_ms_per_layer == [11.0, 1.5]
    assert (stats.index_ms, stats.attention_ms) == (40.75, 12.5)
    # untimed lines (layer_timing off, or a writer without per-layer times): no lists, totals as read
    untimed = [{**r, "index_ms_per_layer": None, "attention_ms_per_layer": None} for r in (first, second)]
    plain = prefill_stats_of(aggregate(untimed, "r0"))
    assert plain.index_ms_per_layer == [] and plain.attention_ms_per_layer == [] and plain.index_ms == 40.75
    off = [{**r, "index_ms": None, "attention_ms": None, "index_ms_per_layer": None, "attention_ms_per_layer": None}
           for r in (first, second)]
    none = prefill_stats_of(aggregate(off, "r0"))
    assert none.index_ms is None and none.index_ms_per_layer == []


def test_stats_layers_without_counts_report_none_not_garbage():
    """A sparse layer with no index, or with an index whose ``row_ptr`` does not fit the plan
    (another KV-head count), reports unknown counts (``None``): its row of the gather buffer is
    never written, and must not be read as counts; the other layers are unaffected."""
    plan = _plan([200, 10], [200, 300], group_size=2)
    st = BatchStats(num_layers=4, layer_offset=0, num_q_heads=4, num_kv_heads=2, head_dim=8, q_lens=[200, 10],
                    kv_lens=[200, 300], rids=["r0", "r1"], device="cpu", plan=plan)
    st.add_index(0, _fake_index([1, 1, 2, 1, 2, 1, 1, 1, 2, 3]))
    st.add_index(1, None)
    st.add_index(2, None)
    st.add_index(3, _fake_index([1] * 7))              # 7 segments: not 2 heads x 5 tiles
    st.ends[1:].fill_(-12345)                           # what unwritten rows could hold
    st.finish()
    rec = st.records()
    assert rec[0]["layers"] == ["sparse"] * 4
    assert rec[0]["selected"] == [[5, 5], None, None, None] and rec[0]["visible"][1:] == [None] * 3
    ps = prefill_stats_of(aggregate(rec, "r0"))
    assert ps.sparse_layers == [0] and ps.density == pytest.approx(10 / 12)


def test_stats_of_a_dense_batch_touch_no_tensors(tmp_path):
    """A dense batch (no plan, every layer dense) allocates and copies nothing; its lines still
    arrive, with null counters."""
    st = BatchStats(num_layers=2, layer_offset=0, num_q_heads=2, num_kv_heads=1, head_dim=8, q_lens=[50],
                    kv_lens=[50], rids=["d"], device="cpu", plan=None)
    st.mark_dense(0, "short")
    st.mark_dense(1, "short")
    st.finish()
    assert st.ends is None and st.host_ends is None and st.ready()
    rec = st.records()[0]
    assert rec["layers"] == ["dense:short", "dense:short"] and rec["selected"] is None
    assert prefill_stats_of(aggregate([rec], "d")).density == 1.0


def test_stats_writer_polls_instead_of_blocking(tmp_path, monkeypatch):
    """The writer thread waits for a batch by polling ``ready`` with sleeps, never in a blocking
    CUDA call that holds the GIL while the scheduler thread launches the next kernels."""
    st = BatchStats(num_layers=1, layer_offset=0, num_q_heads=2, num_kv_heads=1, head_dim=8, q_lens=[5],
                    kv_lens=[5], rids=["p"], device="cpu", plan=None)
    st.mark_dense(0, "short")
    st.finish()
    answers = iter([False, False, True])
    monkeypatch.setattr(st, "ready", lambda: next(answers))
    sleeps = []
    monkeypatch.setattr("flashprefill.integrations.sglang.stats_writer.time.sleep", lambda s: sleeps.append(s))
    st.wait()
    assert len(sleeps) == 2 and all(0 < s <= 0.01 for s in sleeps)


class RadixAttention(torch.nn.Module):  # stands in for sglang's (matched by class name)
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id = layer_id


class _FakeModel(torch.nn.Module):
    def __init__(self, ids):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in ids])
        for layer, i in zip(self.layers, ids):
            layer.attn = RadixAttention(i)


def test_last_attention_layer_id_ignores_exclusive_end_layer():
    """The first H200 run: SGLang's model runner builds the KV pool with the model's *exclusive*
    ``end_layer`` (30 for SmolLM2's 30 layers); the backend took it as the last layer id, so
    ``_finish_batch`` never ran on a forward and no statistics line was ever written."""
    pool = SimpleNamespace(start_layer=0, end_layer=30, layer_num=30)  # as ModelRunner passes them
    assert last_attention_layer_id(_FakeModel(range(30)), pool) == (29, "model RadixAttention layers")
    assert last_attention_layer_id(None, pool)[0] == 29
    assert last_attention_layer_id(SimpleNamespace(), SimpleNamespace(start_layer=12, layer_num=12))[0] == 23
    assert last_attention_layer_id(None, SimpleNamespace(), num_hidden_layers=24)[0] == 23
    with pytest.raises(ValueError):
        last_attention_layer_id(None, SimpleNamespace())


def test_stats_reach_the_reader_after_the_last_layer(tmp_path):
    """The backend's per-batch flow (``forward_extend`` per layer, finish on the last layer id,
    writer thread) against a reader that polls: the line arrives although it is written after the
    reader started waiting (the writer is delayed)."""
    import threading
    import time

    layers, pool = 30, SimpleNamespace(start_layer=0, end_layer=30, layer_num=30)
    last, _ = last_attention_layer_id(_FakeModel(range(layers)), pool)
    # g = 2, B = 6040: one block; 12080 packed rows -> 95 tiles, each sees block 0 only
    plan = _plan([6040], [6040], group_size=2, block_size=6040)
    st = BatchStats(num_layers=layers, layer_offset=0, num_q_heads=2, num_kv_heads=1, head_dim=8, q_lens=[6040],
                    kv_lens=[6040], rids=["fp-abc"], device="cpu", plan=plan)
    writer = StatsWriter(tmp_path)
    submitted = []

    def forward():
        time.sleep(0.3)  # the forward (and the writer) finish after the reader started polling
        for layer_id in range(layers):
            if layer_id < 2:
                st.mark_dense(layer_id, "dense_layers")
            else:
                st.add_index(layer_id, _fake_index([1] * 47 + [0] * 48))
            if layer_id == last:
                st.finish()
                writer.submit(st)
                submitted.append(layer_id)

    t = threading.Thread(target=forward)
    t.start()
    got = read_prefill_stats(tmp_path, "fp-abc", timeout_s=5.0, expect_tokens=6040)
    t.join()
    writer.close()
    assert submitted == [29]
    assert got is not None and got.chunks == 1
    ps = prefill_stats_of(got)
    assert len(ps.density_per_layer) == 30 and ps.density_per_layer[:2] == [1.0, 1.0]
    assert ps.density == pytest.approx(47 / 95)
    # the old rule (pool.end_layer as the last layer id) never finishes the batch
    assert pool.end_layer not in range(layers)


def test_stats_chunks_are_summed():
    base = {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 4, "layers": ["sparse"], "prefill_ms": 1.5}
    recs = [dict(base, rid="x", q_len=8, kv_len=8, selected=[[1]], visible=[[2]]),
            dict(base, rid="x", q_len=8, kv_len=16, selected=[[3]], visible=[[4]]),
            dict(base, rid="y", q_len=8, kv_len=8, selected=[[4]], visible=[[4]])]
    agg = aggregate(recs, "x")
    assert agg.chunks == 2 and agg.prompt_tokens == 16 and agg.prefill_ms == pytest.approx(3.0)
    assert prefill_stats_of(agg).density == pytest.approx(4 / 6)


# ------------------------------------------------------------------------------------------------
# engine wrapper pieces that need no GPU
# ------------------------------------------------------------------------------------------------


def _model_dir(tmp_path, **cfg):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "rope_theta": 1000000.0, **cfg}))
    return d


def test_server_kwargs_from_profile(tmp_path):
    from fpcli.engine.sglang_engine import build_server_kwargs
    from fpcli.profiles import load_profile

    prof = load_profile("bf16")
    kw = build_server_kwargs(_model_dir(tmp_path), prof)
    assert kw["prefill_attention_backend"] == "flashprefill" and kw["decode_attention_backend"] == "triton"
    assert kw["attention_backend"] == "triton" and kw["sampling_backend"] == "pytorch"
    assert kw["chunked_prefill_size"] >= 8192 and kw["page_size"] == prof.engine.page_size
    assert kw["disable_prefill_cuda_graph"] is True and kw["disable_decode_cuda_graph"] is (not prof.engine.cuda_graph_decode)
    assert "json_model_override_args" not in kw
    dense = build_server_kwargs(tmp_path / "model", load_profile("dense"))
    assert dense["prefill_attention_backend"] == "triton"
    over = build_server_kwargs(tmp_path / "model", prof, overrides={"chunked_prefill_size": 2048})
    assert over["chunked_prefill_size"] == 2048


def test_triton_decode_may_split_a_long_context_into_many_kv_splits(tmp_path):
    """SGLang's default (8 KV splits) leaves a GQA model's batch-1 decode at 2 x 8 programs on a
    132-SM GPU; fp allows DECODE_KV_SPLITS, in the embedded engine and in fp serve's argv; the
    user's own setting wins."""
    from fpcli.engine.sglang_engine import DECODE_KV_SPLITS, build_server_kwargs, serve_argv
    from fpcli.profiles import load_profile

    prof = load_profile("bf16")
    assert DECODE_KV_SPLITS > 8
    assert build_server_kwargs(_model_dir(tmp_path), prof)["triton_attention_num_kv_splits"] == DECODE_KV_SPLITS
    user = build_server_kwargs(tmp_path / "model", prof, overrides={"triton_attention_num_kv_splits": 16})
    assert user["triton_attention_num_kv_splits"] == 16
    argv = serve_argv(["--model-path", "/m"], prof)
    assert argv[argv.index("--triton-attention-num-kv-splits") + 1] == str(DECODE_KV_SPLITS)
    mine = serve_argv(["--model-path", "/m", "--triton-attention-num-kv-splits", "32"], prof)
    assert mine.count("--triton-attention-num-kv-splits") == 1 and "32" in mine


def test_yarn_override_has_rope_theta_inside(tmp_path):
    from fpcli.engine.sglang_engine import build_server_kwargs
    from fpcli.profiles import load_profile

    kw = build_server_kwargs(_model_dir(tmp_path), load_profile("bf16"), rope_scaling_factor=4.0)
    over = json.loads(kw["json_model_override_args"])
    assert over["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                    "rope_theta": 1000000.0}
    assert over["max_position_embeddings"] == 131072 and kw["context_length"] == 131072


def test_serve_argv_passes_tp_dp_and_keeps_user_options():
    from fpcli.engine.sglang_engine import serve_argv
    from fpcli.profiles import load_profile

    argv = serve_argv(["--model-path", "/m", "--tp", "2", "--dp=2", "--page-size", "16", "--port", "9000"],
                      load_profile("bf16"))
    assert argv[:8] == ["--model-path", "/m", "--tp-size", "2", "--dp-size=2", "--page-size", "16", "--port"]
    assert argv.count("--page-size") == 1
    i = argv.index("--prefill-attention-backend")
    assert argv[i + 1] == "flashprefill" and "--disable-prefill-cuda-graph" in argv


def test_engine_unavailable_names_the_fix():
    from fpcli.engine import sglang_engine

    try:
        import sglang  # noqa: F401

        have = torch.cuda.is_available()
    except Exception:
        have = False
    if have:
        pytest.skip("SGLang and CUDA are present")
    with pytest.raises(sglang_engine.EngineUnavailable) as info:
        sglang_engine.check_available()
    msg = str(info.value)
    assert "pip install -e .[gpu]" in msg and "--engine transformers" in msg


def test_needle_document_plants_the_secret():
    from fpcli.ttft import answered, needle_document

    count = lambda s: len(s.split())  # noqa: E731 - a whitespace "tokenizer"
    text, secret = needle_document(count, 600, depth=0.3, seed=1)
    assert secret in text and 550 <= count(text) <= 700
    assert answered(f"The secret number is {secret}.", secret) and not answered("12345x", "99999")


def test_register_into_installed_sglang():
    pytest.importorskip("sglang")
    from flashprefill.integrations.sglang import plugin
    from sglang.srt import server_args
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    plugin.register()
    plugin.register()
    assert ATTENTION_BACKENDS["flashprefill"] is plugin.create_flashprefill_backend
    assert server_args.ATTENTION_BACKEND_CHOICES.count("flashprefill") == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_call_sequence_on_reference(page_size):
    """What ``FlashPrefillAttnBackend._sparse_extend`` does per layer, on the CPU reference: the
    metadata's plan and page table, ``flashprefill_attention(..., return_index=True)``; alpha 0
    equals dense attention, and the stats counters equal ``SparseStats.from_index`` of the index
    the attention returned."""
    import flashprefill as fp
    from flashprefill.index import SparseStats

    torch.manual_seed(1)
    kv, q, hq, hkv, d = [300, 200], [300, 72], 6, 2, 32
    r2t, rpi, rows = fake_pool(kv, page_size)
    k_buf = torch.randn(rows, hkv, d)
    v_buf = torch.randn(rows, hkv, d)
    meta = build_metadata(
        req_to_token=r2t, req_pool_indices=rpi, seq_lens=torch.tensor(kv), extend_seq_lens=torch.tensor(q),
        kv_lens_host=kv, q_lens_host=q, page_size=page_size, pool_rows=rows, group_size=hq // hkv, block_size=64,
    )
    n = meta.num_pages * page_size
    k_cache, v_cache = k_buf[:n].view(-1, page_size, hkv, d), v_buf[:n].view(-1, page_size, hkv, d)
    qt = torch.randn(sum(q), hq, d)
    args = (qt, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q)
    for alpha in (0.0, 1.0):
        cfg = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=alpha)
        out, index = fp.flashprefill_attention(*args, config=cfg, softmax_scale=d ** -0.5, plan=meta.plan,
                                               backend="reference", return_index=True)
        dense = fp.dense_attention(*args, softmax_scale=d ** -0.5, plan=meta.plan, backend="reference")
        st = BatchStats(num_layers=1, layer_offset=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, q_lens=q,
                        kv_lens=kv, rids=["a", "b"], device="cpu", plan=meta.plan)
        st.add_index(0, index)
        st.finish()
        rec = st.records()
        sel = sum(sum(r["selected"][0]) for r in rec)
        vis = sum(sum(r["visible"][0]) for r in rec)
        ref_stats = SparseStats.from_index(index)
        assert (sel, vis) == (ref_stats.selected_blocks, ref_stats.visible_blocks)
        if alpha == 0.0:
            torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-4)
        else:
            assert 0 < sel <= vis


# KV-length thresholds of the Triton launchers (TAIL_SPLIT_MIN_KV, MEANS_DIRECT_MAX_KV + 1) as
# ``kernel_kv_thresholds`` returns them on a GPU (the import needs Triton; checked in tests/gpu).
KV_THRESHOLDS = (16384, 32769)


def _chunk_kv_lengths(n: int, chunk: int) -> list[int]:
    """KV length after each prefill chunk of an ``n``-token prompt."""
    return [min(k, n) for k in range(chunk, n + chunk, chunk)]


def test_warmup_plan_covers_every_kv_range_up_to_the_context():
    from fpcli.engine.sglang_engine import warmup_plan

    plan = warmup_plan(131072, 16384, 8192, KV_THRESHOLDS)
    assert plan == [131005, 12285, 64] and len(set(plan)) == len(plan)  # one warm-up per length
    assert all(n % 16 for n in plan[:2])  # not multiples of 16, as real prompts mostly are
    # every range of KV lengths a sparse chunk can have is reached by some warm-up chunk
    ranges = [(8192, 16384), (16384, 32769), (32769, 131072 - 64)]
    kvs = [kv for n in plan if n >= 8192 for kv in _chunk_kv_lengths(n, 16384)]
    for lo, hi in ranges:
        assert any(lo <= kv < hi or kv == hi for kv in kvs), (lo, hi, kvs)
    assert max(kvs) == 131005  # the longest request compiles its last-chunk variant too


def test_kernel_thresholds_come_from_the_triton_backend():
    from flashprefill.impl.triton.host import MEANS_DIRECT_MAX_KV

    from fpcli.engine.sglang_engine import kernel_kv_thresholds, warmup_plan

    thresholds = kernel_kv_thresholds()
    assert thresholds == (MEANS_DIRECT_MAX_KV + 1,)
    for ctx, chunk in ((131072, 16384), (65536, 8192), (32768, 32768)):  # every side of every threshold
        plan = warmup_plan(ctx, chunk, 8192, thresholds)
        kvs = [kv for n in plan if n >= 8192 for kv in _chunk_kv_lengths(n, chunk)]
        for t in thresholds:
            if t <= ctx - 64:
                assert any(kv < t for kv in kvs) and any(kv >= t for kv in kvs), (ctx, chunk, t, kvs)


def test_warmup_plan_short_contexts_and_dense():
    from fpcli.engine.sglang_engine import warmup_plan

    assert warmup_plan(32768, 16384, 8192, KV_THRESHOLDS) == [32701, 12285, 64]
    assert warmup_plan(32768, 8192, 4096, KV_THRESHOLDS) == [32701, 6141, 64]  # first chunk 8192 < 16384
    assert warmup_plan(8192, 16384, 8192, KV_THRESHOLDS) == [64]  # no sparse prompt fits: a short one
    assert warmup_plan(32768, 16384, None) == [16384 + 1024 - 3, 64]  # dense: a chunk and a prefix chunk
    assert warmup_plan(200, 16384, 8192) == [64] and warmup_plan(100, 16384, 8192) == []  # 64 must fit


def test_server_kwargs_capture_few_decode_graphs(tmp_path):
    import dataclasses

    from fpcli.engine.sglang_engine import build_server_kwargs, decode_graph_batch_sizes
    from fpcli.profiles import load_profile

    assert decode_graph_batch_sizes(8) == [1, 2, 4, 8]
    assert decode_graph_batch_sizes(6) == [1, 2, 4, 6] and decode_graph_batch_sizes(1) == [1]
    prof = load_profile("bf16")
    kw = build_server_kwargs(_model_dir(tmp_path), prof)
    assert kw["cuda_graph_bs_decode"] == [1, 2, 4, 8] and kw["cuda_graph_max_bs_decode"] == 8
    four = prof.replace(engine=dataclasses.replace(prof.engine, cuda_graph_max_bs=4))
    assert build_server_kwargs(tmp_path / "model", four)["cuda_graph_bs_decode"] == [1, 2, 4]
    off = prof.replace(engine=dataclasses.replace(prof.engine, cuda_graph_decode=False))
    kw = build_server_kwargs(tmp_path / "model", off)
    assert kw["disable_decode_cuda_graph"] is True and "cuda_graph_bs_decode" not in kw


def test_decode_mode_follows_the_captured_batch_sizes(tmp_path):
    """What the SGLang engine reports as ``decode_mode``: a CUDA graph up to the largest captured
    batch, eager beyond it or when graphs are off (the profile's or the user's SGLang options);
    SGLang's resolved ``server_args`` win over the arguments it was given."""
    import dataclasses
    import types

    from fpcli.engine.base import decode_mode
    from fpcli.engine.sglang_engine import build_server_kwargs, decode_graph_max_bs
    from fpcli.profiles import load_profile

    prof = load_profile("bf16")
    kw = build_server_kwargs(_model_dir(tmp_path), prof)
    assert decode_graph_max_bs(None, kw) == 8
    assert decode_graph_max_bs(None, build_server_kwargs(tmp_path / "model", prof, max_requests=1)) == 1
    off = build_server_kwargs(tmp_path / "model", prof.replace(engine=dataclasses.replace(prof.engine, cuda_graph_decode=False)))
    assert decode_graph_max_bs(None, off) == 0
    user_off = build_server_kwargs(tmp_path / "model", prof, overrides={"disable_cuda_graph": True})
    assert decode_graph_max_bs(None, user_off) == 0
    resolved = types.SimpleNamespace(disable_cuda_graph=False, disable_decode_cuda_graph=False, cuda_graph_max_bs_decode=4)
    assert decode_graph_max_bs(resolved, kw) == 4
    assert decode_mode(20, decode_graph_max_bs(None, kw) >= 1) == "cuda graph"
    assert decode_mode(20, decode_graph_max_bs(None, off) >= 1) == "eager"


def test_kv_pool_is_sized_from_the_context_and_the_requests():
    from fpcli.engine.sglang_engine import kv_pool_tokens

    assert kv_pool_tokens(131072, 1, 64) == 131072 + 2 * 64  # one request at the full context, two spare pages
    assert kv_pool_tokens(131072, 8, 64) == 8 * 131072 + 2 * 64
    assert kv_pool_tokens(1000, 1, 64) == 1024 + 2 * 64  # whole pages
    assert kv_pool_tokens(131072, 8, 64, override=300000) == 300000  # the profile's kv_cache_tokens wins
    with pytest.raises(ValueError, match="max_requests"):
        kv_pool_tokens(131072, 0, 64)


def sglang_answer_cap(pool: int, context: int, page: int, prompt: int, asked: int) -> int:
    """SGLang 0.5.17's cap on a request's new tokens (``Scheduler.init_req_max_new_tokens``, one
    rank): ``min(asked, max_req_len - prompt - 1, pool - ceil_page(prompt) - page - 1)``, at least 0,
    where ``max_req_len = min(context - 1, pool - 1)``."""
    max_req_len = min(context - 1, pool - 1)
    paged = -(-prompt // page) * page
    return max(0, min(asked, max_req_len - prompt - 1, pool - paged - page - 1))


@pytest.mark.parametrize("context,page,requests", [(131072, 64, 1), (131072, 64, 8), (32768, 16, 1), (8192, 1, 1),
                                                   (4000, 64, 2)])
def test_kv_pool_leaves_every_prompt_its_answer(context, page, requests):
    """Every prompt that leaves ``n`` tokens of its context free (plus SGLang's own 2: its
    ``max_req_len`` is context - 1, minus one more) gets its ``n`` answer tokens from SGLang's cap.
    With one spare page (the pool before) a 131,038-token prompt asking 32 got 0 (seen on the H200)."""
    from fpcli.engine.sglang_engine import kv_pool_tokens

    pool = kv_pool_tokens(context, requests, page)
    for n in (1, 2, 32, 256):
        for prompt in range(context - n - 2 - 3 * page, context - n - 1):  # every page phase at the edge
            assert sglang_answer_cap(pool, context, page, prompt, n) == n, (prompt, n)
    one_spare = -(-context // page) * page + page
    if context == 131072 and page == 64:
        assert sglang_answer_cap(one_spare, context, page, 131038, 32) == 0  # the failure seen


def test_server_kwargs_for_one_request_capture_one_graph_and_one_context(tmp_path):
    import dataclasses

    from fpcli.engine.sglang_engine import build_server_kwargs
    from fpcli.profiles import load_profile, with_context_length

    prof = with_context_length(load_profile("bf16"), 131072)
    one = build_server_kwargs(_model_dir(tmp_path), prof, max_requests=1)
    assert one["max_running_requests"] == 1 and one["cuda_graph_bs_decode"] == [1]
    assert one["max_total_tokens"] == 131072 + 2 * 64 and one["skip_tokenizer_init"] is True
    resident = build_server_kwargs(tmp_path / "model", prof)  # the profile's max_requests: 8
    assert resident["max_running_requests"] == 8 and resident["cuda_graph_bs_decode"] == [1, 2, 4, 8]
    assert resident["max_total_tokens"] == 8 * 131072 + 2 * 64
    fixed = prof.replace(engine=dataclasses.replace(prof.engine, kv_cache_tokens=200000, max_requests=3))
    kw = build_server_kwargs(tmp_path / "model", fixed)
    assert kw["max_total_tokens"] == 200000 and kw["cuda_graph_bs_decode"] == [1, 2, 3]
    user = build_server_kwargs(tmp_path / "model", prof, max_requests=1,
                               overrides={"max_total_tokens": 500000, "mem_fraction_static": 0.5})
    assert user["max_total_tokens"] == 500000 and user["mem_fraction_static"] == 0.5  # SGLang options win
    with pytest.raises(ValueError, match="max_requests"):
        build_server_kwargs(tmp_path / "model", prof, max_requests=-1)


def test_sampling_params_carry_the_tokenizer_eos():
    """SGLang runs without a tokenizer (skip_tokenizer_init): the chat EOS comes from ours."""
    from fpcli.engine.sglang_engine import SGLangEngine

    eng = object.__new__(SGLangEngine)
    eng.tokenizer = types.SimpleNamespace(eos_token_id=151645)
    params = eng._sampling_params(16, 0.0, 1.0, -1)
    assert params["stop_token_ids"] == [151645] and params["max_new_tokens"] == 16
    eng.tokenizer = types.SimpleNamespace(eos_token_id=None)
    assert "stop_token_ids" not in eng._sampling_params(16, 0.0, 1.0, -1)


def test_in_process_commands_load_a_one_request_engine(monkeypatch):
    import fpcli.commands as commands
    from fpcli.console import stderr_console

    seen = {}

    def loader(engine, model, profile, **kw):
        seen.update(kw)
        return "engine"

    monkeypatch.setattr(commands, "engine_loader", lambda: loader)
    assert commands.obtain_engine("sglang", None, "bf16", False, True, stderr_console()) == "engine"
    assert seen["max_requests"] == 1
    assert "warmup" not in seen  # the loader's default: the engine warms up


@pytest.mark.parametrize("command,one_prompt", [
    (["ask", "{doc}", "What is the code?", "--no-server"], True),
    (["profile", "{doc}", "What is the code?", "--no-server"], True),
])
def test_one_prompt_commands_skip_the_engine_warmup(runner, fake_engine, doc, tmp_path, monkeypatch, command,
                                                    one_prompt):
    """fp ask / fp profile send one prompt: their in-process engine skips the start-up warm-up
    (the request is its own warm-up)."""
    monkeypatch.chdir(tmp_path)  # fp profile writes its heatmap PNG into the working directory
    r = invoke(runner, [a.format(doc=doc) for a in command])
    assert r.exit_code == 0, r.output
    assert fake_engine().load_kwargs.get("warmup", True) is not one_prompt


def test_chat_keeps_the_engine_warmup(runner, fake_engine, doc):
    r = invoke(runner, ["chat", str(doc), "--no-server"], input="What is the code?\n")
    assert r.exit_code == 0, r.output
    assert fake_engine().load_kwargs.get("warmup", True) is True


@pytest.mark.parametrize("warmup", [False, True])
def test_load_engine_passes_warmup_to_the_sglang_engine(monkeypatch, tmp_path, warmup):
    import fpcli.engine as engine_mod
    import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile

    seen = {}

    class Recorder:
        def __init__(self, path, profile, **kw):
            seen.update(kw)

    monkeypatch.setattr(se, "SGLangEngine", Recorder)
    monkeypatch.setattr(engine_mod, "resolve_request", lambda e, m, p, **_: ("sglang", m, load_profile("bf16")))
    engine_mod.load_engine("sglang", str(_model_dir(tmp_path)), "bf16", progress=False, warmup=warmup)
    assert seen["warmup"] is warmup and seen["max_requests"] is None


def test_engine_warmup_lengths_use_the_plan(monkeypatch):
    import fpcli.engine.sglang_engine as se
    from fpcli.engine.sglang_engine import SGLangEngine

    eng = object.__new__(SGLangEngine)  # no SGLang: only the plan inputs
    eng.sparse = True
    eng.settings = BackendSettings(sparse=SparseConfig(min_sparse_len=4096))
    eng.server_kwargs = {"chunked_prefill_size": 8192}
    eng.context_length = 32768
    monkeypatch.setattr(se, "kernel_kv_thresholds", lambda: KV_THRESHOLDS)
    assert eng.warmup_lengths() == se.warmup_plan(32768, 8192, 4096, KV_THRESHOLDS) == [32701, 6141, 64]
    eng._engine = types.SimpleNamespace(scheduler_info={"max_req_input_len": 20000})  # a smaller KV pool
    assert eng.warmup_lengths() == se.warmup_plan(20064, 8192, 4096, KV_THRESHOLDS) == [20000 - 3, 6141, 64]
    eng.sparse = False
    assert eng.warmup_lengths() == se.warmup_plan(20064, 8192, None)


def test_gpu_worker_script_with_a_fake_engine(monkeypatch, tmp_path):
    """``tests/gpu/sglang_worker.py`` (one engine per process on the device) end to end on CPU."""
    import importlib.util
    from pathlib import Path

    import fpcli.engine.sglang_engine as se
    from fpcli.engine.base import GenerationResult, PrefillStats

    made = []

    class FakeEngine:
        warmup_s = 0.25

        def __init__(self, model_path, profile, **kw):
            made.append((profile, kw))
            self._engine = SimpleNamespace(server_args=SimpleNamespace(
                cuda_graph_config=SimpleNamespace(decode=SimpleNamespace(backend="full")), disable_cuda_graph=False))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            made.append("closed")

        def count_tokens(self, text):
            return len(text.split())

        def encode_chat(self, system, text):
            FakeEngine.secret = [w.rstrip(".") for w in text.split() if w.rstrip(".").isdigit()][0]
            return list(range(len(text.split())))

        def generate(self, ids, max_new_tokens=16):
            return GenerationResult(text=f"It is {FakeEngine.secret}.", prompt_tokens=len(ids), output_tokens=3,
                                    ttft_s=0.01, prefill_s=0.008, total_s=0.02, engine="fake", model="m", profile="p",
                                    stats=PrefillStats(density=0.5, density_per_layer=[1.0, 0.5]))

        def first_token_logprobs(self, ids, k=20):
            return [(-0.1, 7), (-2.5, 9)][:k]

        def flush_cache(self):
            made.append("flush")

    monkeypatch.setattr(se, "SGLangEngine", FakeEngine)
    spec_path = Path(__file__).resolve().parent / "gpu" / "sglang_worker.py"
    mod_spec = importlib.util.spec_from_file_location("sglang_worker", spec_path)
    worker = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(worker)
    spec = {"name": "w", "model": "m", "profile": "bf16", "min_sparse_len": 4096, "overrides": {"page_size": 16},
            "requests": [{"key": "needle", "needle_tokens": 400, "seed": 5, "max_new_tokens": 8, "flush": True},
                         {"key": "lp", "ids": [1, 2, 3], "logprobs": 1}]}
    out_path = tmp_path / "w.json"
    assert worker.run(spec, str(out_path)) == 0
    out = json.loads(out_path.read_text())
    assert out["error"] is None and out["closed_t"] and out["decode_graph"] == "full"
    assert out["results"]["needle"]["answered"] is True and out["results"]["needle"]["density"] == 0.5
    assert out["results"]["lp"]["top"] == [[-0.1, 7]]
    profile, kw = made[0]
    assert kw["server_overrides"] == {"page_size": 16}
    assert profile.sparse.min_sparse_len == 4096
    assert made[1:] == ["flush", "closed"]


def test_sglang_engine_reports_the_precision_that_runs():
    from fpcli.engine.sglang_engine import attention_precision
    from fpcli.profiles import load_profile

    # the operator has no FP8 path (no `precision` argument): fp8 profiles run, and say, bf16
    assert attention_precision(load_profile("fp8")) == "bf16"
    assert attention_precision(load_profile("bf16")) == "bf16"
    fp16 = load_profile("bf16")
    fp16 = fp16.replace(engine=__import__("dataclasses").replace(fp16.engine, dtype="float16"))
    assert attention_precision(fp16) == "fp16"


@pytest.mark.parametrize("n", [1, 2, 4, 5, 6, 32, 256])
def test_a_fitted_prompt_gets_its_whole_answer_from_sglang(n):
    """A document that fills the budget: SGLang (0.5.17) must accept the fitted prompt
    (``validate_input_length``: prompt < max_req_len - 5, max_req_len = context - 1) and leave it
    all ``n`` answer tokens (``sglang_answer_cap``); before, the budget was context - n, so the
    answer got n - 2 tokens and a prompt for n <= 6 was refused."""
    from fp_fakes import FakeEngine

    from fpcli.engine.sglang_engine import SGLangEngine, kv_pool_tokens
    from fpcli.prompt import SYSTEM_PROMPT, build_prompt, format_user

    class SGLangSized(FakeEngine):  # the fake's tokenizer, the real SGLang engine's reserve
        context_reserve = staticmethod(SGLangEngine.context_reserve)

    context, page = 2048, 64
    eng = SGLangSized(context_length=context)
    doc = type("Doc", (), {"name": "a.txt", "text": ""})()
    empty = len(eng.encode_chat(SYSTEM_PROMPT, format_user([("a.txt", "")], "Where?")))
    doc.text = " ".join(f"w{i}" for i in range(context - n - empty))  # whole: exactly context - n tokens
    assert len(eng.encode_chat(SYSTEM_PROMPT, format_user([("a.txt", doc.text)], "Where?"))) == context - n
    prompt = build_prompt([doc], "Where?", eng, max_new_tokens=n)
    max_req_len = context - 1
    assert prompt.tokens < max_req_len - 5, prompt.tokens
    pool = kv_pool_tokens(context, 1, page)
    assert sglang_answer_cap(pool, context, page, prompt.tokens, n) == n
    assert prompt.to_dict()["reserved"] == prompt.reserved >= 2
