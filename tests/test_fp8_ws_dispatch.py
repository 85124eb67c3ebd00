"""The warp-specialised Gluon FP8 attention (``AttnConfig.impl = "gluon_ws"``, ``docs/fp8.md`` section 11)
on a machine without a GPU: its configuration, where ``host_fp8.launch_attention_fp8`` sends a launch,
the refusal of inputs it cannot run, and the kernel compiled for sm_90 by Triton's bundled ptxas.
Gluon has no interpreter: the kernel's numbers are checked on the device (``tests/gpu/test_fp8_ws.py``).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from flashprefill import make_plan, quant
from flashprefill.impl.triton import host_fp8
from flashprefill.impl.triton import quant_kernels as qk
from flashprefill.impl.triton.tiles import ATTN_IMPLS, AttnConfig, get_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))


def _kv(batch=1, hkv=2, d=128, L=300, k_dtype=quant.E4M3) -> qk.Fp8KV:
    """An ``Fp8KV`` of the pre-pass's shapes (random codes; the dispatch never reads them)."""
    total_k = batch * -(-L // qk.TMA_ALIGN) * qk.TMA_ALIGN
    gen = torch.Generator().manual_seed(0)
    k8 = torch.randn(hkv, total_k, d, generator=gen).to(k_dtype) if k_dtype != torch.int8 else \
        torch.randint(-127, 128, (hkv, total_k, d), generator=gen, dtype=torch.int8)
    v8t = torch.randn(hkv, d, total_k, generator=gen).to(quant.E4M3)
    ones = torch.ones(batch, hkv)
    cu = torch.arange(batch + 1, dtype=torch.int32) * (total_k // batch)
    return qk.Fp8KV(k8, v8t, ones, ones, ones * 448.0, ones * 448.0, cu)


def _plan(batch=1, L=300, g=4):
    seq_lens = torch.full((batch,), L, dtype=torch.int32)
    cu_q = torch.arange(batch + 1, dtype=torch.int32) * L
    return seq_lens, cu_q, make_plan(seq_lens, cu_q, g, 128)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_default_and_the_kernel_variants_differ_in_the_impl_only(d):
    """FP8 tiles: "auto" at d 64 / 128 (the Gluon kernel where it runs), "triton" at d 256 (the
    Gluon kernel has no d 256); ``gluon_ws`` / ``triton_fp8`` pin one kernel and change nothing
    else; ``plain`` is the Triton kernel; the 16-bit tiles keep "triton" (their kernels ignore it)."""
    base = get_config(d, torch.bfloat16, 128, precision="fp8")
    ws = get_config(d, torch.bfloat16, 128, precision="fp8", variant="gluon_ws")
    tri = get_config(d, torch.bfloat16, 128, precision="fp8", variant="triton_fp8")
    assert base.attn.impl == ("triton" if d == 256 else "auto")
    assert ws.attn.impl == "gluon_ws" and ws.attn.ws_stages == 4 and tri.attn.impl == "triton"
    assert dataclasses.replace(ws.attn, impl=base.attn.impl, ws_stages=base.attn.ws_stages) == base.attn
    assert dataclasses.replace(tri.attn, impl=base.attn.impl) == base.attn
    assert ws.index == base.index == tri.index
    assert get_config(d, torch.bfloat16, 128, precision="fp8", variant="plain").attn.impl == "triton"
    assert get_config(d, torch.bfloat16, 128).attn.impl == "triton"
    assert ATTN_IMPLS == ("triton", "gluon_ws", "auto")


@pytest.mark.parametrize("kwargs,word", [({"impl": "cuda"}, "impl"), ({"ws_stages": 1}, "ws_stages")])
def test_attn_config_refuses_an_unknown_impl_or_a_one_stage_ring(kwargs, word):
    with pytest.raises(ValueError, match=word):
        AttnConfig(block_m=128, block_n=128, block_u=64, num_warps=8, num_stages=2, **kwargs)


def test_cpu_tensors_get_a_clear_error_naming_the_gpu_it_needs():
    seq_lens, cu_q, plan = _plan()
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    kv = _kv()
    assert "CUDA" in host_fp8.ws_unsupported(q, kv.k8.dtype, plan, 128)
    tiles = get_config(128, torch.bfloat16, 128, precision="fp8", variant="gluon_ws").attn
    with pytest.raises(ValueError, match=r"impl='gluon_ws'.*sm_90.*cpu tensors.*impl='triton'"):
        host_fp8.launch_attention_fp8_ws(q, kv, seq_lens, cu_q, 0.088, plan, tiles, mean_correction=True,
                                         block_size=128, index=None)


def test_each_shape_it_cannot_run_is_named(monkeypatch):
    """On an sm_90 device (the capability query answered as the H200's), d 256, int8 K, key blocks
    of 64 and 64-row tiles each get their own reason; d 64 / 128 with e4m3 K get none."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    seq_lens, cu_q, plan = _plan()

    class CudaQ:  # q's attributes the check reads, as a CUDA tensor has them
        is_cuda = True
        device = torch.device("cuda", 0)

        def __init__(self, d):
            self.shape = (300, 8, d)

    assert host_fp8.ws_unsupported(CudaQ(128), quant.E4M3, plan, 128) is None
    assert host_fp8.ws_unsupported(CudaQ(64), quant.E4M3, plan, 128) is None
    assert "d=256" in host_fp8.ws_unsupported(CudaQ(256), quant.E4M3, plan, 128)
    assert "int8" in host_fp8.ws_unsupported(CudaQ(128), torch.int8, plan, 128)
    assert "64" in host_fp8.ws_unsupported(CudaQ(128), quant.E4M3, plan, 64)
    plan64 = make_plan(seq_lens, cu_q, 4, 128, tile_rows=64)
    assert "tiles, got 64" in host_fp8.ws_unsupported(CudaQ(128), quant.E4M3, plan64, 128)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA B200")
    assert "B200 is 10.0" in host_fp8.ws_unsupported(CudaQ(128), quant.E4M3, plan, 128)


@pytest.mark.parametrize("impl,sparse,k_dtype,runs_here,to_ws", [
    ("gluon_ws", True, quant.E4M3, False, True), ("gluon_ws", False, quant.E4M3, False, False),
    ("gluon_ws", True, torch.int8, False, False), ("auto", True, quant.E4M3, True, True),
    ("auto", True, quant.E4M3, False, False), ("auto", False, quant.E4M3, True, False),
    ("auto", True, torch.int8, True, False), ("triton", True, quant.E4M3, True, False)])
def test_only_the_sparse_e4m3_launch_goes_to_the_gluon_kernel(monkeypatch, impl, sparse, k_dtype, runs_here, to_ws):
    """``launch_attention_fp8`` by ``impl``: ``"gluon_ws"`` sends the sparse e4m3 case to
    ``launch_attention_fp8_ws`` (which refuses what it cannot run); ``"auto"`` only where
    ``ws_unsupported`` finds nothing (``runs_here``: answered as on an H200, else as on these CPU
    tensors); the dense mode and int8 K (precision "int8qk") always launch the Triton kernel (both
    launchers replaced by recorders: the dispatch is what is tested here)."""
    if runs_here:
        monkeypatch.setattr(host_fp8, "ws_unsupported", lambda *a: None)
    calls = []
    monkeypatch.setattr(host_fp8, "launch_attention_fp8_ws", lambda *a, **k: calls.append("ws") or ("ws", None))

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append("triton")

    monkeypatch.setattr(host_fp8.fk, "_attn_fwd_fp8", Recorder())
    seq_lens, cu_q, plan = _plan()
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    tiles = dataclasses.replace(get_config(128, torch.bfloat16, 128, precision="fp8").attn, impl=impl)
    host_fp8.launch_attention_fp8(q, _kv(k_dtype=k_dtype), seq_lens, cu_q, 0.088, plan, tiles, sparse=sparse,
                                  mean_correction=False, block_size=128, index=None if not sparse else _Index(plan))
    assert calls == (["ws"] if to_ws else ["triton"])


class _Index:
    """The CSR fields of a ``BlockIndex`` the Triton launch reads without the mean correction."""

    block_size = 128

    def __init__(self, plan):
        self.row_ptr = torch.zeros(plan.n_tiles * 2 + 1, dtype=torch.int32)
        self.col_idx = torch.zeros(1, dtype=torch.int32)


@pytest.mark.parametrize("d", [128, 64])
def test_the_kernel_compiles_for_sm90_warp_specialised(d):
    """Compiled for sm_90 here (Triton's bundled ptxas): no spills, the producer's warpgroup gives its
    registers back to 24 and the consumers take 240 (``setmaxnreg``), the products are e4m3 wgmma
    (``QGMMA``: per consumer, Q Kᵀ over d / 32 and P V over 128 / 32 k-steps, twice for the loop
    and its tail), the ring uses ``4 (B d + d B)`` bytes beside the Q tile."""
    import gluon_fp8

    res = gluon_fp8.compile_config(gluon_fp8.GluonConfig(4), mean_correction=True, head_dim=d)
    assert "error" not in res, res.get("error")
    assert res["spill_bytes"] == 0
    assert {"dealloc 24", "try_alloc 240"} <= set(res["setmaxnreg"])
    assert res["qgmma"] == 2 * (d // 32 + 2 * (128 // 32))
    ring_kib = 4 * 2 * 128 * d / 1024
    q_kib = 128 * d / 1024
    assert ring_kib + q_kib <= res["smem_kib"] < ring_kib + q_kib + 1


@pytest.mark.parametrize("d", [128, 64])
def test_v_in_the_wgmma_order_takes_the_byte_moves_out_of_the_loop(d):
    """``V_PERM`` (``Fp8KV.v_perm``, the shipped operands): ``P8`` reaches the ``P V`` wgmma as the
    registers the softmax left (``assert_trivial`` holds at compile time), so the SASS has less than
    half the byte permutes and shuffles of token order (the codes' layout conversion, ~110 per step
    and consumer), with the same e4m3 wgmma, no spills."""
    import gluon_fp8

    wg = gluon_fp8.compile_config(gluon_fp8.GluonConfig(4), head_dim=d)
    tok = gluon_fp8.compile_config(gluon_fp8.GluonConfig(4), head_dim=d, v_perm=False)
    assert "error" not in wg and "error" not in tok, (wg.get("error"), tok.get("error"))
    assert wg["spill_bytes"] == 0 and wg["qgmma"] == tok["qgmma"]
    assert 2 * wg["byte_moves"] < tok["byte_moves"], (wg["byte_moves"], tok["byte_moves"])


def test_the_timing_stamps_compile_away_in_the_shipped_launch(tmp_path):
    """``TIMING`` (the lab's ``phases``): compiled for sm_90 here, the stamped kernel reads
    ``%globaltimer`` and ``%smid`` with the same e4m3 wgmma count, registers and no spills, and the
    shipped kernel (``t_ptr=None``) reads neither."""
    import gluon_fp8

    shipped = gluon_fp8.compile_config(gluon_fp8.GluonConfig(4), str(tmp_path), head_dim=128)
    stamped = gluon_fp8.compile_config(gluon_fp8.GluonConfig(4), str(tmp_path), head_dim=128, timing=True)
    assert "error" not in shipped and "error" not in stamped, (shipped.get("error"), stamped.get("error"))
    assert stamped["spill_bytes"] == 0 and stamped["qgmma"] == shipped["qgmma"]
    assert stamped["setmaxnreg"] == shipped["setmaxnreg"]
    sass = {tag: (tmp_path / f"ws_s4_d128{tag}.sass").read_text() for tag in ("", "_timing")}
    assert "GLOBALTIMER" in sass["_timing"] and "SMID" in sass["_timing"]
    assert "GLOBALTIMER" not in sass[""] and "SMID" not in sass[""]


def test_a_timing_buffer_of_another_shape_is_refused_before_the_launch(monkeypatch):
    """``launch_attention_fp8_ws(timing=)`` takes int64 ``[n_tiles * Hkv, 8]``, contiguous; anything else
    is a ``ValueError`` naming the expected shape (``ws_unsupported`` answered as on an H200, so the
    check is what stops the call)."""
    monkeypatch.setattr(host_fp8, "ws_unsupported", lambda *a: None)
    seq_lens, cu_q, plan = _plan()
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    tiles = get_config(128, torch.bfloat16, 128, precision="fp8", variant="gluon_ws").attn
    rows = plan.n_tiles * 2
    for bad in (torch.zeros(rows, 7, dtype=torch.int64), torch.zeros(rows, 8, dtype=torch.int32),
                torch.zeros(8, rows, dtype=torch.int64).t()):
        with pytest.raises(ValueError, match=rf"timing must be a contiguous int64 \[{rows}, 8\]"):
            host_fp8.launch_attention_fp8_ws(q, _kv(), seq_lens, cu_q, 0.088, plan, tiles, mean_correction=True,
                                             block_size=128, index=_Index(plan), timing=bad)


def test_phase_summary_adds_the_stamps_up():
    """``gluon_fp8.phase_summary`` on hand-made stamps: three programs on SMs 0, 0 and 2 (ns): per
    phase the summed time over the SM count, the time per step of each kind, the span and the SMs'
    busy time."""
    import gluon_fp8

    stamps = torch.tensor([
        # start, consumer, first corr., loop end, stores end, SM, exact, corr
        [0, 1000, 9000, 13000, 14000, 0, 4, 2],
        [14000, 14500, 20500, 20500, 21000, 0, 3, 0],
        [500, 1500, 5500, 9500, 10500, 2, 2, 1],
    ], dtype=torch.int64)
    r = gluon_fp8.phase_summary(stamps, n_sm=4)
    assert r["setup"] == (1000 + 500 + 1000) / 4 / 1e6
    assert r["exact"] == (8000 + 6000 + 4000) / 4 / 1e6
    assert r["correction"] == (4000 + 0 + 4000) / 4 / 1e6
    assert r["epilogue"] == (1000 + 500 + 1000) / 4 / 1e6
    assert r["exact_us_per_step"] == 18000 / 9 / 1e3 and r["correction_us_per_step"] == 8000 / 3 / 1e3
    assert (r["steps_exact"], r["steps_correction"]) == (9, 3)
    assert r["span_ms"] == 21000 / 1e6 and r["n_sm_used"] == 2
    assert (r["sm_busy_min_ms"], r["sm_busy_max_ms"]) == (10000 / 1e6, 21000 / 1e6)


def test_bench_triton_columns_are_filled_or_say_why_not(monkeypatch):
    """``fp bench --fp8``'s ``fp8 triton`` columns (``bench._fp8_triton_columns``): absent with a note
    where the default FP8 columns already ran the Triton kernel (off sm_90, d 256); the kernel's
    error as the note (the run goes on); else total, speed-up against the row's BF16 total and the
    output's relative L2 against BF16 (``total_fn`` stands in for the operator and records the
    kernels it was asked for: the column logic is what is tested here)."""
    from flashprefill import bench

    base = torch.linspace(1.0, 2.0, 64, dtype=torch.float64)
    asked = []

    def total_fn(precision="bf16", kernels=None):
        asked.append(None if kernels is None else kernels.attn.impl)
        return base if precision == "bf16" else base * 1.01

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    row = {"total_ms": 3.0}
    assert "sm_89" in bench._fp8_triton_columns(row, total_fn, lambda fn: 1.5, 128, 128)["fp8_triton"]
    assert "fp8tri_total_ms" not in row and not asked
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert "d 256" in bench._fp8_triton_columns(row, total_fn, lambda fn: 1.5, 256, 128)["fp8_triton"]

    def failing(precision="bf16", kernels=None):
        if kernels is not None:
            raise RuntimeError("no TMA here")
        return base

    note = bench._fp8_triton_columns(row, failing, lambda fn: 1.5, 128, 128)["fp8_triton"]
    assert "failed" in note and "no TMA here" in note and "fp8tri_total_ms" not in row
    assert bench._fp8_triton_columns(row, total_fn, lambda fn: 1.5, 128, 128)["fp8_triton"] == bench.FP8_TRITON_NOTE
    assert row["fp8tri_total_ms"] == 1.5 and row["fp8tri_speedup"] == 2.0
    assert abs(row["fp8tri_rel_l2"] - 0.01) < 1e-12
    assert "triton" in asked


def test_the_refusal_comes_before_the_index_and_the_pre_pass(monkeypatch):
    """``host.attention`` / ``host.sparse_attention`` with ``impl="gluon_ws"`` at precision "fp8" on
    inputs it cannot run (CPU tensors here) raise before any kernel work (the index and the pre-pass
    replaced by tripwires); precision "int8qk" and the default tiles are not refused (int8qk runs the
    Triton kernel)."""
    from flashprefill import SparseConfig
    from flashprefill.impl.triton import host

    def tripwire(*a, **k):
        raise AssertionError("work started before the refusal")

    monkeypatch.setattr(host, "build_index", tripwire)
    monkeypatch.setattr(host, "_launch_index", tripwire)        # host.attention's index launches
    monkeypatch.setattr(host_fp8, "kv_operands", tripwire)
    seq_lens, cu_q, plan = _plan()
    q = torch.randn(300, 8, 128, dtype=torch.bfloat16)
    kc = torch.randn(5, 64, 2, 128, dtype=torch.bfloat16)
    pt = torch.arange(5, dtype=torch.int32)[None, :]
    ws = get_config(128, torch.bfloat16, 128, precision="fp8", variant="gluon_ws")
    args = (q, kc, kc, pt, seq_lens, cu_q, SparseConfig(), 0.088, plan)
    with pytest.raises(ValueError, match=r"impl='gluon_ws'.*CUDA"):
        host.attention(*args, kernels=ws, precision="fp8")
    with pytest.raises(ValueError, match=r"impl='gluon_ws'.*CUDA"):
        host.sparse_attention(*args, _Index(plan), kernels=ws, precision="fp8")
    with pytest.raises(AssertionError, match="work started"):
        host.attention(*args, kernels=ws, precision="int8qk")
