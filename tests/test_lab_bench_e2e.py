"""The lab's end-to-end benchmark (``scripts/lab/bench_e2e.py``: YaRN regimes, variants, needle
depths) with a fake engine, on the CPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import bench_e2e  # noqa: E402  (scripts/lab is not a package)


class _FakeBenchEngine:
    """Stands in for ``SGLangEngine`` in ``run_e2e_bench`` tests: a context manager whose prompt
    ids carry the planted secret in their first id, and whose answer is that secret."""

    warmup_s = 0.0
    density = 0.4

    def __init__(self, model_path, profile, rope_scaling_factor=None, **kw):
        self.profile, self.factor, self.kw = profile, rope_scaling_factor, kw

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def count_tokens(self, text):
        return len(text.split())

    def encode_chat(self, system, text):   # the secret rides in the first id
        secret = [w.rstrip(".") for w in text.split() if w.rstrip(".").isdigit()][0]
        return [int(secret)] + list(range(len(text.split())))

    def answer(self, ids) -> str:
        return str(ids[0])

    def ttft(self) -> float:
        return 0.01

    def generate(self, ids, max_new_tokens=16):
        from fpcli.engine.base import GenerationResult, PrefillStats

        t = self.ttft()
        return GenerationResult(text=self.answer(ids), prompt_tokens=len(ids), output_tokens=1, ttft_s=t,
                                prefill_s=t, total_s=t, engine="fake", model="m", profile="p",
                                stats=PrefillStats(density=self.density, density_per_layer=[1.0, self.density]))



def test_e2e_bench_one_invocation_native_and_yarn(monkeypatch, tmp_path):
    """``run_e2e_bench`` with a fake engine: native lengths on one engine pair, YaRN lengths on a
    second, prompts built once per length, one warm-up + one measurement each, rows reported
    after every length."""
    import fpcli.engine.sglang_engine as se

    started, calls = [], []

    class FakeEngine(_FakeBenchEngine):
        def __init__(self, model_path, profile, rope_scaling_factor=None, **kw):
            super().__init__(model_path, profile, rope_scaling_factor, **kw)
            started.append((profile, rope_scaling_factor, kw.get("server_overrides", {}).get("disable_radix_cache")))

        def generate(self, ids, max_new_tokens=16):
            calls.append(len(ids))
            return super().generate(ids, max_new_tokens)

    monkeypatch.setattr(se, "SGLangEngine", FakeEngine)
    monkeypatch.setattr(se, "native_context_length", lambda path: 32768)
    seen = []
    rows = bench_e2e.run_e2e_bench([4096, 131072 // 2, 8192], "m", "sparse", "dense", repeats=1,
                                   progress=lambda m: None, on_rows=lambda r: seen.append(len(r)))
    assert [(p, f) for p, f, _ in started] == [("dense", None), ("sparse", None), ("dense", 4.0), ("sparse", 4.0)]
    assert all(radix_off for _, _, radix_off in started)
    assert [r["target_len"] for r in rows] == [4096, 8192, 65536]
    assert [r["yarn"] for r in rows] == [None, None, 4.0]
    assert all(r["needle_sparse"] and r["needle_dense"] and r["density"] == 0.4 for r in rows)
    assert len(calls) == 3 * 2 * 2  # per length and engine: one warm-up, one measurement
    assert seen == [1, 2, 2, 2, 3, 3]  # dense 4k, 8k; sparse 4k, 8k; dense 64k; sparse 64k
    assert "65536" in bench_e2e.format_table(rows)


def test_e2e_bench_variants_and_depths(monkeypatch):
    """Extra sparse engines (``--variant``) run like ``sparse`` with their own profile; extra
    needle depths are answered once per engine and length; a variant whose engine misses the
    needle shows it."""
    import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile

    base = load_profile("bf16")
    label, prof, eng = bench_e2e.parse_variant("dl4:dense_layers=4,alpha=0.05", base)
    assert label == "dl4" and prof.dense_layers == 4 and prof.sparse.alpha == 0.05 and eng == {}
    assert bench_e2e.parse_variant("t:timing=true", base)[2] == {"timing": True}
    assert prof.sparse.window_tokens == base.sparse.window_tokens and base.dense_layers == 2
    for bad, what in (("x", "LABEL"), ("v:nope=1", "nope"), ("v:alpha=abc", "alpha"), ("v:alpha=-1", "alpha"),
                      ("dense:alpha=0.2", "LABEL"), ("all_x:alpha=0.2", "LABEL"), ("k:kernel=m64", "kernel")):
        with pytest.raises(ValueError, match=what):
            bench_e2e.parse_variant(bad, base)

    started, engine_kwargs = [], []

    class FakeEngine(_FakeBenchEngine):
        density = 0.2

        def __init__(self, model_path, profile, rope_scaling_factor=None, **kw):
            super().__init__(model_path, profile, rope_scaling_factor, **kw)
            started.append(getattr(profile, "name", profile))
            engine_kwargs.append(kw.get("timing"))

        def answer(self, ids):
            return "0" if getattr(self.profile, "name", "").endswith("+bad") else str(ids[0])

        def ttft(self):
            return {"dense": 0.4}.get(getattr(self.profile, "name", ""), 0.1)

    monkeypatch.setattr(se, "SGLangEngine", FakeEngine)
    monkeypatch.setattr(se, "native_context_length", lambda path: 32768)
    variants = [bench_e2e.parse_variant("good:alpha=0.05,timing=true", base),
                bench_e2e.parse_variant("bad:alpha=0.2", base)]
    rows = bench_e2e.run_e2e_bench([8192], "m", base, base.replace(name="dense", attention="dense"), repeats=1,
                                   progress=lambda m: None, variants=variants, depths=[0.1, 0.9])
    assert started == ["dense", "bf16", "bf16+good", "bf16+bad"]
    assert engine_kwargs == [None, None, True, None]   # timing reaches only its engine
    r = rows[0]
    assert r["needles_good"] == [True, True, True] and r["needles_bad"] == [False, False, False]
    assert r["speedup_good"] == pytest.approx(4.0)
    assert r["density_good"] == 0.2
    assert r["density_bad"] == 0.2
    text = bench_e2e.format_variants(rows)
    assert "good" in text and "3/3" in text and "0/3" in text


def test_e2e_bench_server_override_variant_and_a_failing_engine(monkeypatch):
    """``sgl.<field>`` reaches SGLang's arguments of that engine only (merged over the run's
    overrides), ``attention=dense`` makes a dense variant, and a variant whose engine fails
    records the error instead of losing the run."""
    import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile

    base = load_profile("bf16")
    label, prof, eng = bench_e2e.parse_variant("hyb:attention=dense,sgl.decode_attention_backend=fa3", base)
    assert label == "hyb" and prof.is_dense and eng == {"server_overrides": {"decode_attention_backend": "fa3"}}
    assert bench_e2e.parse_variant("c:sgl.chunked_prefill_size=4096", base)[2] == {
        "server_overrides": {"chunked_prefill_size": 4096}}
    for bad, what in (("v:attention=sparse", "attention"), ("v:sgl.a-b=1", "ServerArgs")):
        with pytest.raises(ValueError, match=what):
            bench_e2e.parse_variant(bad, base)

    seen = []

    class FakeEngine(_FakeBenchEngine):
        def __init__(self, model_path, profile, rope_scaling_factor=None, **kw):
            super().__init__(model_path, profile, rope_scaling_factor, **kw)
            seen.append((getattr(profile, "name", profile), kw.get("server_overrides")))
            if getattr(profile, "name", "").endswith("+broken"):
                raise RuntimeError("backend fa9 is not installed")

    monkeypatch.setattr(se, "SGLangEngine", FakeEngine)
    monkeypatch.setattr(se, "native_context_length", lambda path: 32768)
    variants = [bench_e2e.parse_variant("broken:sgl.decode_attention_backend=fa9", base),
                bench_e2e.parse_variant("hyb:attention=dense,sgl.decode_attention_backend=fa3", base)]
    rows = bench_e2e.run_e2e_bench([4096], "m", base, base.replace(name="dense", attention="dense"), repeats=1,
                                   progress=lambda m: None, variants=variants, server_overrides={"page_size": 16})
    off = {"disable_radix_cache": True, "page_size": 16}  # every request prefills its whole prompt
    assert seen == [("dense", off), ("bf16", off),
                    ("bf16+broken", {**off, "decode_attention_backend": "fa9"}),
                    ("bf16+hyb", {**off, "decode_attention_backend": "fa3"})]
    r = rows[0]
    assert "fa9 is not installed" in r["error_broken"] and "ttft_broken_s" not in r
    assert r["needle_hyb"] and r["speedup_hyb"] == pytest.approx(1.0)


def test_e2e_bench_variant_failing_partway_keeps_its_measured_lengths(monkeypatch):
    """A variant engine that fails at its second length keeps the first length's result and
    gets the error only where it measured nothing; ``sgl.x=none`` passes ``None``."""
    import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile

    base = load_profile("bf16")
    assert bench_e2e.parse_variant("n:sgl.tp_size=null", base)[2] == {"server_overrides": {"tp_size": None}}

    class FakeEngine(_FakeBenchEngine):
        def generate(self, ids, max_new_tokens=16):
            if getattr(self.profile, "name", "").endswith("+late") and len(ids) > 6000:
                raise RuntimeError("out of memory")
            return super().generate(ids, max_new_tokens)

    monkeypatch.setattr(se, "SGLangEngine", FakeEngine)
    monkeypatch.setattr(se, "native_context_length", lambda path: 32768)
    rows = bench_e2e.run_e2e_bench([4096, 8192], "m", base, base.replace(name="dense", attention="dense"),
                                   repeats=1, progress=lambda m: None,
                                   variants=[bench_e2e.parse_variant("late:alpha=0.2", base)])
    r4, r8 = rows
    assert "ttft_late_s" in r4 and "error_late" not in r4
    assert "ttft_late_s" not in r8 and "out of memory" in r8["error_late"]
    text = bench_e2e.format_variants(rows)
    assert text.count("FAILED") == 1


