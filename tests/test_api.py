"""Public API of ``flashprefill``: return forms, dispatch, plan reuse without host syncs, and one
test per validation error (type and message naming the argument). CPU only."""
from __future__ import annotations

import dataclasses
import math
import sys
import types

import pytest
import torch

import flashprefill
from flashprefill import SparseConfig, SparseStats, make_plan
from flashprefill import api
from flashprefill.impl import reference as R
from fp_brute import brute_force, make_inputs

CFG = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=32, alpha=0.3)


@pytest.fixture
def inp():
    return make_inputs([60, 200, 1], [60, 450, 64], hq=6, hkv=2, d=32, page_size=16, dtype=torch.float32,
                       seed=0, structured=True)


def test_exports():
    for name in ("SparseConfig", "flashprefill_attention", "build_index", "dense_attention", "make_plan",
                 "plan", "BlockIndex", "SparseStats", "BatchPlan"):
        assert hasattr(flashprefill, name), name
    assert flashprefill.plan is flashprefill.make_plan
    from flashprefill.plan import BatchPlan, make_plan as mp   # the module stays importable
    assert mp is make_plan and BatchPlan is flashprefill.BatchPlan


def test_return_forms(inp):
    out = flashprefill.flashprefill_attention(*inp, CFG)
    assert isinstance(out, torch.Tensor) and out.shape == inp[0].shape and out.dtype == torch.float32
    o, lse = flashprefill.flashprefill_attention(*inp, CFG, return_lse=True)
    assert lse.shape == inp[0].shape[:2] and lse.dtype == torch.float32
    o2, stats = flashprefill.flashprefill_attention(*inp, CFG, return_stats=True)
    o3, lse3, stats3 = flashprefill.flashprefill_attention(*inp, CFG, return_lse=True, return_stats=True)
    for x in (o, o2, o3):
        torch.testing.assert_close(x, out, atol=0, rtol=0)
    torch.testing.assert_close(lse3, lse, atol=0, rtol=0)
    assert isinstance(stats, SparseStats) and isinstance(stats3, SparseStats)
    assert 0 < stats.density < 1
    assert stats.density == stats.selected_blocks / stats.visible_blocks
    assert stats.density_per_kv_head.shape == (2,)
    assert stats.selected_blocks == stats.index.nnz


def test_matches_brute_force_and_dense(inp):
    inp64 = tuple(t.double() if t.is_floating_point() else t for t in inp)
    out, lse = flashprefill.flashprefill_attention(*inp64, CFG, softmax_scale=0.2, return_lse=True)
    want, want_lse, _ = brute_force(*inp64, CFG, 0.2)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=0)
    d, dlse = flashprefill.dense_attention(*inp64, return_lse=True)
    want_d, want_dlse, _ = brute_force(*inp64, CFG, dense=True)
    torch.testing.assert_close(d, want_d, atol=1e-10, rtol=0)
    torch.testing.assert_close(dlse, want_dlse, atol=1e-10, rtol=0)
    assert isinstance(flashprefill.dense_attention(*inp64), torch.Tensor)


def test_default_config_and_scale(inp):
    out = flashprefill.flashprefill_attention(*inp)
    want, _ = R.sparse_attention(*inp, SparseConfig(), 1 / math.sqrt(32))
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("hq,hkv", [(3, 1), (7, 1), (21, 3), (16, 2)])
def test_gqa_groups_accepted(hq, hkv):
    inp = make_inputs([70, 1], [200, 40], hq=hq, hkv=hkv, d=16, page_size=16, seed=hq)
    out, lse = flashprefill.flashprefill_attention(*inp, CFG, return_lse=True)
    want, want_lse, _ = brute_force(*inp, CFG)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-10, rtol=0)


def test_plan_and_index_reuse(inp):
    plan = flashprefill.plan(inp[4], inp[5], 3, CFG.block_size)
    index = flashprefill.build_index(*inp, CFG, plan=plan)
    out, stats = flashprefill.flashprefill_attention(*inp, CFG, plan=plan, index=index, return_stats=True)
    assert stats.index is index
    torch.testing.assert_close(out, flashprefill.flashprefill_attention(*inp, CFG), atol=0, rtol=0)
    dense = flashprefill.dense_attention(*inp, plan=plan)
    torch.testing.assert_close(dense, flashprefill.dense_attention(*inp), atol=0, rtol=0)


class _FakeBackend(types.ModuleType):
    """Records calls; returns tensors of the right shapes without touching the host."""

    def __init__(self, name="fake"):
        super().__init__(name)
        self.calls = []

    def build_index(self, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan):
        self.calls.append(("build_index", config, softmax_scale, plan))
        return R.build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan)

    def sparse_attention(self, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale,
                         plan, index):
        self.calls.append(("sparse_attention", config, softmax_scale, plan, index))
        return torch.zeros_like(q), torch.zeros(q.shape[:2])

    def attention(self, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan):
        self.calls.append(("attention", config, softmax_scale, plan))
        index = R.build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan)
        return torch.zeros_like(q), torch.zeros(q.shape[:2]), index

    def dense_attention(self, q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, plan):
        self.calls.append(("dense_attention", softmax_scale, plan))
        return torch.ones_like(q), torch.zeros(q.shape[:2])


@pytest.fixture
def inp64d():
    """bf16, head_dim 64: inputs the Triton backend accepts."""
    return make_inputs([100, 300, 1], [100, 450, 64], hq=6, hkv=2, d=64, page_size=16, dtype=torch.bfloat16,
                       seed=1, structured=True)


@pytest.fixture
def fake_triton(monkeypatch):
    fake = _FakeBackend("flashprefill.impl.triton.host")
    monkeypatch.setitem(sys.modules, "flashprefill.impl.triton.host", fake)
    return fake


def test_auto_on_cpu_is_reference(inp, fake_triton):
    flashprefill.flashprefill_attention(*inp, CFG)
    flashprefill.dense_attention(*inp, backend="auto")
    assert fake_triton.calls == []


def test_triton_on_cpu_rejected_without_interpreter(inp, fake_triton, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for fn in (flashprefill.flashprefill_attention, flashprefill.build_index):
        with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors.*cpu"):
            fn(*inp, CFG, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flashprefill.dense_attention(*inp, backend="triton")
    assert fake_triton.calls == []


def test_triton_on_cpu_under_interpreter(inp, inp64d, fake_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bf = inp64d
    out = flashprefill.flashprefill_attention(*bf, CFG, softmax_scale=0.5, backend="triton")
    assert (out == 0).all()                                  # the fake's answer: it was called
    assert [c[0] for c in fake_triton.calls] == ["attention"]      # index and attention in one backend call
    _, config, scale, plan = fake_triton.calls[0]
    assert config is CFG and scale == 0.5 and plan.block_size == 64 and plan.group_size == 3
    assert (flashprefill.dense_attention(*bf, backend="triton") == 1).all()
    # Triton-only limits: bf16/fp16 and head_dim 64/128/256
    f32 = tuple(t.float() if t.is_floating_point() else t for t in bf)
    with pytest.raises(TypeError, match=r"q must be bfloat16 or float16.*float32"):
        flashprefill.flashprefill_attention(*f32, CFG, backend="triton")
    odd = make_inputs([10], [10], hq=2, hkv=1, d=48, page_size=16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"head_dim d must be one of \(64, 128, 256\).*48"):
        flashprefill.flashprefill_attention(*odd, CFG, backend="triton")


@pytest.mark.parametrize("device, dtype, d, want", [
    ("cuda", torch.bfloat16, 128, "triton"),
    ("cuda", torch.float16, 64, "triton"),
    ("cuda", torch.bfloat16, 256, "triton"),
    ("cuda", torch.float32, 128, "reference"),   # a float32 model on GPU
    ("cuda", torch.bfloat16, 96, "reference"),   # a head dim the kernels do not take
    ("cuda", torch.float16, 80, "reference"),
    ("cpu", torch.bfloat16, 128, "reference"),
])
def test_auto_backend_choice(device, dtype, d, want):
    assert api._choose_backend("auto", device, dtype, d) == want


def test_explicit_backend_choice_never_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # explicit triton on CUDA is kept even where auto would not take it; _validate then says why
    assert api._choose_backend("triton", "cuda", torch.float32, 96) == "triton"
    assert api._choose_backend("reference", "cuda", torch.bfloat16, 128) == "reference"
    with pytest.raises(ValueError, match=r"backend='triton' needs CUDA tensors, got q on cpu"):
        api._choose_backend("triton", "cpu", torch.bfloat16, 128)
    with pytest.raises(ValueError, match=r"backend must be one of"):
        api._choose_backend("cute", "cuda", torch.bfloat16, 128)


@pytest.mark.parametrize("name, value", [
    ("group_size", 0), ("group_size", 2.0), ("group_size", True), ("block_size", 0), ("block_size", -64),
    ("block_size", "128"), ("tile_rows", 0), ("tile_rows", None),
])
def test_make_plan_rejects_bad_sizes(name, value):
    sl = torch.tensor([70, 5], dtype=torch.int32)
    cu = torch.tensor([0, 40, 43], dtype=torch.int32)
    kwargs = {"group_size": 3, "block_size": 64, "tile_rows": 128, name: value}
    with pytest.raises(ValueError, match=rf"make_plan: {name} must be an int >= 1, got {value!r}"):
        make_plan(sl, cu, **kwargs)


def test_explicit_reference_backend(inp, fake_triton):
    out = flashprefill.flashprefill_attention(*inp, CFG, backend="reference")
    assert fake_triton.calls == [] and torch.isfinite(out).all()


def test_unknown_backend(inp):
    with pytest.raises(ValueError, match=r"backend must be one of.*'cute'"):
        flashprefill.flashprefill_attention(*inp, CFG, backend="cute")


def test_no_host_sync_with_plan(inp64d, fake_triton, monkeypatch):
    """With ``plan=`` (and ``index=``) the API layer itself never syncs: no tolist/item/bool/int."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bf = inp64d
    plan = make_plan(bf[4], bf[5], 3, CFG.block_size)
    index = R.build_index(*bf, CFG, None, plan)

    def boom(*_a, **_k):
        raise AssertionError("host sync in the API layer")

    for meth in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, meth, boom)
    out, lse = flashprefill.flashprefill_attention(*bf, CFG, return_lse=True, plan=plan, index=index,
                                                   backend="triton")
    flashprefill.dense_attention(*bf, plan=plan, backend="triton")
    monkeypatch.undo()
    assert out.shape == bf[0].shape and [c[0] for c in fake_triton.calls] == ["sparse_attention", "dense_attention"]


def test_validation_skipped_while_compiling(inp, fake_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, v, pt, sl, cu = inp
    plan = make_plan(sl, cu, 3, CFG.block_size)
    # float32 would be rejected for triton; page_table int64 too - not checked while tracing
    flashprefill.dense_attention(q, k, v, pt.long(), sl, cu, plan=plan, backend="triton")
    assert [c[0] for c in fake_triton.calls] == ["dense_attention"]


# --------------------------------------------------------------------------------------------
# Validation errors: type and message naming the argument


def _with(inp, **repl):
    names = ("q", "k_cache", "v_cache", "page_table", "seq_lens", "cu_seqlens_q")
    return tuple(repl.get(n, t) for n, t in zip(names, inp))


def _bad(inp):
    q, k, v, pt, sl, cu = inp
    nc = torch.empty(q.shape[0], q.shape[1], q.shape[2] * 2)[:, :, ::2]
    return [
        # (args, exception, substrings)
        (_with(inp, q=q[0]), ValueError, ["q must be 3-D", "[total_q, Hq, d]", "[6, 32]"]),
        (_with(inp, q=q.numpy()), TypeError, ["q must be a torch.Tensor"]),
        (_with(inp, k_cache=k[0]), ValueError, ["k_cache must be 4-D", "[num_pages, page_size, Hkv, d]"]),
        (_with(inp, v_cache=v[:, :8]), ValueError, ["v_cache must have k_cache's shape", str(list(k.shape)).replace("[", "").split(",")[0]]),
        (_with(inp, q=torch.randn(q.shape[0], 5, 32)), ValueError, ["Hq=5", "Hkv=2", "multiple"]),
        (_with(inp, q=torch.randn(q.shape[0], 6, 16)), ValueError, ["k_cache head_dim", "d = 16"]),
        (_with(inp, q=q.double()), TypeError, ["k_cache must have q's dtype torch.float64", "torch.float32"]),
        (_with(inp, q=q.int(), k_cache=k.int(), v_cache=v.int()), TypeError, ["q must be one of", "torch.int32"]),
        (_with(inp, v_cache=v.half()), TypeError, ["v_cache must have q's dtype"]),
        (_with(inp, page_table=pt.long()), TypeError, ["page_table must be int32", "torch.int64"]),
        (_with(inp, page_table=pt[0]), ValueError, ["page_table must be 2-D", "[batch, max_pages]"]),
        (_with(inp, page_table=pt[:2]), ValueError, ["page_table must be [batch, max_pages] with batch = 3"]),
        (_with(inp, seq_lens=sl.long()), TypeError, ["seq_lens must be int32"]),
        (_with(inp, cu_seqlens_q=cu.long()), TypeError, ["cu_seqlens_q must be int32"]),
        (_with(inp, cu_seqlens_q=cu[:3]), ValueError, ["cu_seqlens_q must be [batch + 1] = [4]", "[3]"]),
        (_with(inp, q=q[:-1]), ValueError, ["q must have total_q = sum of the plan's q_lens = 261", "[260, 6, 32]"]),
        (_with(inp, q=nc), ValueError, ["q must be contiguous in its last dim", "q.contiguous()"]),
        (_with(inp, k_cache=torch.empty(*k.shape[:3], 64)[..., ::2]), ValueError,
         ["k_cache must be contiguous in its last dim"]),
        (_with(inp, seq_lens=torch.tensor([100, 450, 64], dtype=torch.int32).to("meta")), ValueError,
         ["seq_lens must be on q's device cpu", "meta"]),
        (_with(inp, seq_lens=torch.tensor([100, 450, 0], dtype=torch.int32)), ValueError,
         ["request 2", "q_len 1 > seq_len 0"]),
        (_with(inp, page_table=pt[:, :7]), ValueError,
         ["page_table too short for seq_lens", "request 1", "seq_len 450", "7 * 16 = 112"]),
        (_with(inp, page_table=torch.where(pt == pt[1, 3], 10_000, pt).to(torch.int32)), ValueError,
         ["page_table[1, 3] = 10000", "num_pages"]),
        (_with(inp, page_table=torch.where(pt == pt[0, 0], -1, pt).to(torch.int32)), ValueError,
         ["page_table[0, 0] = -1"]),
    ]


def test_validation_errors(inp):
    for args, exc, subs in _bad(inp):
        for call in (lambda a: flashprefill.flashprefill_attention(*a, CFG),
                     lambda a: flashprefill.build_index(*a, CFG),
                     lambda a: flashprefill.dense_attention(*a)):
            with pytest.raises(exc) as info:
                call(args)
            msg = str(info.value)
            for s in subs:
                assert s in msg, (s, msg)


def test_unused_page_table_entries_not_checked(inp):
    q, k, v, pt, sl, cu = inp
    pt = pt.clone()
    pt[2, 5:] = 99_999                      # request 2 uses 4 pages of 16 tokens; the rest is junk
    flashprefill.flashprefill_attention(q, k, v, pt, sl, cu, CFG)


def test_argument_errors(inp):
    plan = make_plan(inp[4], inp[5], 3, CFG.block_size)
    cases = [
        (dict(config={"alpha": 0.1}), TypeError, "config must be a flashprefill.SparseConfig"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a finite float > 0"),
        (dict(softmax_scale=math.nan), ValueError, "softmax_scale"),
        (dict(plan=object()), TypeError, "plan must be a flashprefill.BatchPlan"),
        (dict(plan=make_plan(inp[4], inp[5], 1, 64)), ValueError, "plan was built for group_size 1"),
        (dict(plan=make_plan(inp[4], inp[5], 3, 128)), ValueError, "plan was built for block_size 128"),
        (dict(plan=make_plan(inp[4][:2], inp[5][:3], 3, 64)), ValueError, "plan was built for batch 2"),
        (dict(plan=plan, index="x"), TypeError, "index must be a flashprefill.BlockIndex"),
        (dict(plan=plan, index=R.build_index(*inp, CFG.replace(block_size=128))), ValueError,
         "index was built with block_size 128"),
        (dict(plan=plan, index=R.build_index(inp[0][:100], *inp[1:3], inp[3][:1], inp[4][:1], inp[5][:2], CFG)),
         ValueError, "index has"),
        # a selection bitmask that cannot belong to this index's segments
        (dict(plan=plan, index=dataclasses.replace(R.build_index(*inp, CFG, plan=plan),
                                                   sel_bits=torch.zeros(3, 1, dtype=torch.int32))),
         ValueError, "index.sel_bits must be a contiguous int32"),
    ]
    kw = {k: v for k, v in (("config", CFG),)}
    for extra, exc, sub in cases:
        kwargs = dict(kw, **extra)
        with pytest.raises(exc, match=sub.replace("[", r"\[").replace(".", r"\.")):
            flashprefill.flashprefill_attention(*inp, **kwargs)
    # dense attention accepts a plan of any block size
    other = make_plan(inp[4], inp[5], 3, 128)
    flashprefill.dense_attention(*inp, plan=other)


def test_sparse_config_errors():
    with pytest.raises(ValueError, match="SparseConfig.block_size"):
        SparseConfig(block_size=96)
    with pytest.raises(ValueError, match="SparseConfig.alpha"):
        SparseConfig(alpha=1.5)


def test_sparse_config_differences_and_setting_text():
    from flashprefill.config import setting_text

    assert SparseConfig().differences() == {} and setting_text({}) == ""
    cfg = SparseConfig(block_score="mass", alpha=0.05, window_tokens=1024, mean_correction=False)
    diff = cfg.differences()
    assert diff == {"window_tokens": 1024, "alpha": 0.05, "mean_correction": False, "block_score": "mass"}
    assert list(diff) == [n for n in SparseConfig.field_names() if n in diff]  # field order
    assert setting_text(diff) == "window_tokens 1,024, alpha 0.05, mean_correction false, block_score mass"
    other = SparseConfig(alpha=0.05)
    assert cfg.differences(other) == {"window_tokens": 1024, "mean_correction": False, "block_score": "mass"}
    assert other.differences(cfg) == {"window_tokens": 512, "mean_correction": True, "block_score": "energy"}
    with pytest.raises(TypeError, match="other must be a SparseConfig"):
        cfg.differences({"alpha": 0.05})


def test_return_index_is_the_index_the_attention_used(inp):
    """``return_index=True`` appends the ``BlockIndex`` last, ``(out[, lse][, stats][, index])``:
    the one built inside the call equals ``build_index``'s; a given index comes back as is."""
    plan = make_plan(inp[4], inp[5], 3, CFG.block_size)
    want = flashprefill.build_index(*inp, CFG, plan=plan)
    out, index = flashprefill.flashprefill_attention(*inp, CFG, plan=plan, return_index=True)
    assert isinstance(index, flashprefill.BlockIndex)
    for f in ("row_ptr", "col_idx", "k_mean", "v_mean", "block_ptr", "tile_ptr", "n_visible"):
        torch.testing.assert_close(getattr(index, f), getattr(want, f), atol=0, rtol=0, msg=f)
    assert 0 < index.nnz < int(index.n_visible.sum())              # it pruned: the comparison can fail
    o, lse, stats, idx = flashprefill.flashprefill_attention(*inp, CFG, plan=plan, return_lse=True,
                                                             return_stats=True, return_index=True)
    torch.testing.assert_close(o, out, atol=0, rtol=0)
    assert lse.shape == inp[0].shape[:2] and isinstance(stats, SparseStats)
    assert stats.index is idx and stats.selected_blocks == idx.nnz
    o2, given = flashprefill.flashprefill_attention(*inp, CFG, plan=plan, index=want, return_index=True)
    assert given is want
    torch.testing.assert_close(o2, out, atol=0, rtol=0)


def test_return_index_does_not_sync(inp64d, fake_triton, monkeypatch):
    """The index built inside the call comes back without a host read at the API layer (unlike
    ``return_stats``): the backend's own index, the one its attention used."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = make_plan(inp64d[4], inp64d[5], 3, CFG.block_size)
    built = R.build_index(*inp64d, CFG, None, plan)

    def attention(*args):
        fake_triton.calls.append(("attention",))
        return torch.zeros_like(args[0]), torch.zeros(args[0].shape[:2]), built
    monkeypatch.setattr(fake_triton, "attention", attention)

    def boom(*_a, **_k):
        raise AssertionError("host sync in the API layer")
    for meth in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, meth, boom)
    out, index = flashprefill.flashprefill_attention(*inp64d, CFG, plan=plan, backend="triton", return_index=True)
    monkeypatch.undo()
    assert [c[0] for c in fake_triton.calls] == ["attention"]
    assert index is built


def test_kernel_configs_are_frozen_and_explicit():
    """``tiles.get_config`` returns frozen dataclasses; nothing in the environment changes them;
    bad arguments are ValueErrors naming the argument."""
    from flashprefill.impl.triton import tiles

    cfg = tiles.get_config(128, torch.bfloat16, 128)
    assert isinstance(cfg.attn, tiles.AttnConfig) and isinstance(cfg.index, tiles.IndexConfig)
    for obj, field in ((cfg, "attn"), (cfg.attn, "block_m"), (cfg.index, "select_block_j")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, getattr(obj, field))
    assert tiles.get_config(128, torch.bfloat16, 64).attn.block_n <= 64
    assert tiles.get_config(64, torch.float16, 64).attn.block_n == 64        # clamped to the key block
    assert tiles.get_config(64, torch.float16, 128).attn.block_n == 128
    with pytest.raises(ValueError, match="head_dim"):
        tiles.get_config(96, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="dtype"):
        tiles.get_config(128, torch.float32, 128)
    with pytest.raises(ValueError, match="variant"):
        tiles.get_config(128, torch.bfloat16, 128, variant="no-such-preset")
    assert not any(isinstance(v, (dict, list, set)) for k, v in vars(tiles).items()
                   if k.isupper() and k != "VARIANTS"), "a mutable module-level setting"


def test_plain_variant_turns_every_optional_kernel_field_off():
    """``get_config(..., variant="plain")`` is the baseline the variant tests compare against: every
    optional field of the FP8 kernels off and the Triton FP8 kernel (impl "triton"), the tiles themselves
    unchanged; the 16-bit configs are the same with or without it (they ignore those fields)."""
    from flashprefill.impl.triton import tiles

    optional_attn = dict(loop_guard=False, fold_scale=False, mean_vec=False, pipeline=False, exp_impl="mufu",
                         impl="triton")
    for d in (64, 128, 256):
        for B in (64, 128):
            shipped = tiles.get_config(d, torch.bfloat16, B, precision="fp8")
            plain = tiles.get_config(d, torch.bfloat16, B, precision="fp8", variant="plain")
            assert plain.attn == dataclasses.replace(shipped.attn, **optional_attn)
            assert plain.index == dataclasses.replace(shipped.index, fused_amax=False, hw_cvt=False)
            assert not plain.index.fused_amax and not plain.index.hw_cvt
            bf16 = tiles.get_config(d, torch.bfloat16, B)
            assert tiles.get_config(d, torch.bfloat16, B, variant="plain") == bf16
