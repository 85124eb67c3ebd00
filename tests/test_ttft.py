"""``fp bench --e2e``'s measurement (``fpcli.ttft``): the row building (``ttft_rows``, pure) and
``run_ttft_bench`` over several profiles with ``FakeSGLangEngine``, whose interface is checked
against the real ``SGLangEngine`` here."""
from __future__ import annotations

import inspect
import re

import pytest

from fp_fakes import FakeSGLangEngine, fake_sglang
from fpcli.engine.base import FP8_SPARSE
from fpcli.profiles import load_profile, with_precision
from fpcli.ttft import check_profiles, format_ttft_table, run_ttft_bench, ttft_notes, ttft_rows

BF16, FP8, DENSE = load_profile("bf16"), load_profile("fp8"), load_profile("dense")


def _m(ttft: float, density: float = 0.4, needle: bool = True, precision: str = "bf16", tokens: int = 4000) -> dict:
    return {"ttft_s": ttft, "density": density, "needle": needle, "answer": "12345" if needle else "no",
            "prompt_tokens": tokens, "precision": precision}


def test_ttft_rows_one_row_per_length_and_profile_with_speedups():
    measured = {("bf16", 4096): _m(2.0), ("fp8", 4096): _m(1.6, precision=FP8_SPARSE), ("dense", 4096): _m(4.0, 1.0),
                ("bf16", 8192): _m(3.0), ("fp8", 8192): _m(2.5, needle=False, precision=FP8_SPARSE),
                ("dense", 8192): _m(9.0, 1.0)}
    rows = ttft_rows([4096, 8192], [BF16, FP8, DENSE], measured)
    assert [(r["length"], r["profile"]) for r in rows] == [(4096, "bf16"), (4096, "fp8"), (4096, "dense"),
                                                            (8192, "bf16"), (8192, "fp8"), (8192, "dense")]
    by = {(r["length"], r["profile"]): r for r in rows}
    assert by[(4096, "bf16")]["x_dense"] == pytest.approx(2.0) and by[(4096, "fp8")]["x_dense"] == pytest.approx(2.5)
    assert by[(4096, "dense")]["x_dense"] == pytest.approx(1.0)
    assert by[(4096, "fp8")]["x_bf16"] == pytest.approx(2.0 / 1.6) and by[(4096, "bf16")]["x_bf16"] == pytest.approx(1.0)
    assert by[(8192, "dense")]["x_bf16"] == pytest.approx(3.0 / 9.0)
    assert by[(8192, "fp8")]["needle"] is False and by[(8192, "fp8")]["precision"] == FP8_SPARSE
    assert set(rows[0]) == {"length", "prompt_tokens", "profile", "precision", "ttft_s", "density", "needle", "answer",
                            "x_dense", "x_bf16"}


def test_ttft_rows_x_bf16_only_beside_fp8_and_a_missing_measurement_is_an_error():
    rows = ttft_rows([4096], [BF16, DENSE], {("bf16", 4096): _m(2.0), ("dense", 4096): _m(3.0, 1.0)})
    assert [r["x_bf16"] for r in rows] == [None, None] and rows[0]["x_dense"] == pytest.approx(1.5)
    rows = ttft_rows([4096], [BF16], {("bf16", 4096): _m(2.0)})  # no dense profile: no speed-up over it
    assert rows[0]["x_dense"] is None
    with pytest.raises(KeyError):
        ttft_rows([4096, 8192], [BF16], {("bf16", 4096): _m(2.0)})


def test_check_profiles_wants_unique_names():
    check_profiles([BF16, FP8, DENSE])
    with pytest.raises(ValueError, match="no profile"):
        check_profiles([])
    with pytest.raises(ValueError, match="bf16 twice"):
        check_profiles([BF16, BF16, DENSE])


def test_run_ttft_bench_three_engines_on_the_same_prompts():
    """bf16, fp8 and dense: one engine each, in that order, with a context that fits the longest
    length; every engine gets the same token ids; each timed request follows a cache flush (else
    the fake's radix cache would serve it and its TTFT would fall). At 4K (below the profiles'
    min_sparse_len 8192) the FP8 engine reports bf16 and density 1, as the real engine does."""
    eng = fake_sglang(ttft_per_1k={"bf16": 0.2, "fp8": 0.16, "dense": 0.5}, miss=("fp8",))
    said = []
    rows = run_ttft_bench([4096, 16384], "/models/m", [BF16, FP8, DENSE], progress=lambda *a: said.append(a),
                          repeats=2, start_engine=eng)
    assert [p.name for _, p in eng._started] == ["bf16", "fp8", "dense"]
    assert all(p.engine.context_length == 16384 + 256 for _, p in eng._started)
    prompts = {}
    for call in eng._calls:
        if call[0] == "generate":
            prompts.setdefault(call[1], []).append(call[2])
    assert prompts["bf16"] == prompts["fp8"] == prompts["dense"] and len(prompts["bf16"]) == 2 * 3  # 1 untimed + 2
    kinds = [c[0] for c in eng._calls]
    assert all(kinds[i - 1] == "flush" for i, k in enumerate(kinds) if k == "generate")
    by = {(r["length"], r["profile"]): r for r in rows}
    for n in (4096, 16384):
        assert by[(n, "bf16")]["needle"] and by[(n, "dense")]["needle"] and not by[(n, "fp8")]["needle"]
        assert abs(by[(n, "bf16")]["prompt_tokens"] - n) < 64
        assert by[(n, "dense")]["density"] == 1.0 and by[(n, "dense")]["precision"] == "bf16"
        assert by[(n, "dense")]["x_dense"] == pytest.approx(1.0)
        assert by[(n, "bf16")]["x_dense"] == pytest.approx(0.5 / 0.2)
        assert by[(n, "fp8")]["x_bf16"] == pytest.approx(0.2 / 0.16)
    assert by[(16384, "fp8")]["precision"] == FP8_SPARSE and by[(16384, "fp8")]["density"] == pytest.approx(0.4)
    assert by[(16384, "bf16")]["precision"] == "bf16" and by[(16384, "bf16")]["density"] == pytest.approx(0.4)
    assert by[(4096, "fp8")]["precision"] == "bf16" and by[(4096, "fp8")]["density"] == 1.0
    assert ("starting the fp8 engine",) in said and sum(1 for a in said if a == ()) == 6
    text = format_ttft_table(rows, {"model": "/models/m", "gpu": "H200", "repeats": 2})
    assert "median of 2 requests" in text and "x bf16" in text and "missed" in text and "40.0%" in text
    assert ttft_notes(rows, [BF16, FP8, DENSE]) == ["at 4096 tokens bf16, fp8 ran dense: prompts below min_sparse_len 8,192"]


def test_run_ttft_bench_with_a_user_profile_and_its_fp8_twin(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nsparse:\n  alpha: 0.2\n  min_sparse_len: 1024\n")
    mine = load_profile(path)
    eng = fake_sglang()
    rows = run_ttft_bench([2048], "/models/m", [mine, with_precision(mine, "fp8"), DENSE], repeats=1, start_engine=eng)
    assert [r["profile"] for r in rows] == ["mine", "mine+fp8", "dense"]
    assert [r["precision"] for r in rows] == ["bf16", FP8_SPARSE, "bf16"]
    assert eng._started[1][1].sparse.alpha == 0.2 and eng._started[1][1].precision == "fp8"


def _public(names) -> set[str]:
    return {n for n in names if not n.startswith("_")}


def test_the_fake_sglang_engine_has_the_real_ones_interface_and_nothing_more():
    """Whatever ``run_ttft_bench`` calls exists on the real ``SGLangEngine``; the fake has no public
    method or attribute the real class lacks, and its constructor takes what the real one takes."""
    from fpcli.engine.sglang_engine import SGLangEngine

    real_methods = _public(n for n, v in vars(SGLangEngine).items() if callable(v) or isinstance(v, staticmethod))
    fake_methods = _public(n for n, v in vars(FakeSGLangEngine).items() if callable(v))
    assert fake_methods <= real_methods, fake_methods - real_methods
    used = {"encode_chat", "count_tokens", "flush_cache", "generate"}
    assert used <= fake_methods and {"__enter__", "__exit__"} <= set(vars(SGLangEngine))

    real_attrs = set(re.findall(r"self\.(\w+)(?:: [^=]+)? = ", inspect.getsource(SGLangEngine.__init__)))
    real_attrs |= _public(n for n, v in vars(SGLangEngine).items() if not callable(v))
    fake = FakeSGLangEngine("/models/m", BF16)
    assert _public(vars(fake)) | _public(n for n, v in vars(FakeSGLangEngine).items() if not callable(v)) <= real_attrs
    inspect.signature(SGLangEngine).bind("/models/m", BF16)
    inspect.signature(SGLangEngine.generate).bind(None, [1, 2], max_new_tokens=2)
    result = fake.generate([1, 2, 3], max_new_tokens=2)
    assert result.device == "cuda" and result.engine == "sglang"


def test_short_runs_fit_min_sparse_len_to_their_context_and_the_note_says_the_fitted_value():
    """The engines run at the longest length + ANSWER_MARGIN; min_sparse_len is fitted to that
    context (at most half of it: Profile.fit_to_context), as fp's other engines are, and the note
    names the value that ran. At --len 1k,8k (context 8,448): 4,224, not bf16's 8,192, so 8K runs
    sparse and only 1K is noted; at --len 4k (context 4,352: 2,176) nothing runs dense."""
    from fpcli.ttft import engine_profile

    assert engine_profile(BF16, [1024, 8192]).sparse.min_sparse_len == 4224
    assert engine_profile(BF16, [1024, 8192]).engine.context_length == 8448
    assert engine_profile(BF16, [16384]).sparse.min_sparse_len == 8192      # a context of 16,640: as is
    assert engine_profile(BF16, [16384], native_context=8192).sparse.min_sparse_len == 4096  # YaRN on an 8K model
    eng = fake_sglang()
    rows = run_ttft_bench([1024, 8192], "/models/m", [BF16, FP8, DENSE], repeats=1, start_engine=eng)
    assert [p.sparse.min_sparse_len for _, p in eng._started][:2] == [4224, 4224]  # bf16, fp8 (dense: none)
    by = {(r["length"], r["profile"]): r for r in rows}
    assert by[(8192, "bf16")]["density"] < 1.0 and by[(1024, "bf16")]["density"] == 1.0
    assert ttft_notes(rows, [BF16, FP8, DENSE]) == ["at 1024 tokens bf16, fp8 ran dense: prompts below min_sparse_len 4,224"]
    eng = fake_sglang()
    rows = run_ttft_bench([4096], "/models/m", [BF16, DENSE], repeats=1, start_engine=eng)
    assert rows[0]["density"] < 1.0 and ttft_notes(rows, [BF16, DENSE]) == []


def test_the_native_context_of_the_model_folder_caps_the_threshold(tmp_path):
    """An 8K model run at 16K with YaRN: min_sparse_len 4,096 (half the model's own context, as
    fpcli.engine.load_engine fits it), read from the folder's config.json; the note says so."""
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 8192}')
    eng = fake_sglang()
    rows = run_ttft_bench([2048, 16384], str(tmp_path), [BF16, DENSE], repeats=1, start_engine=eng)
    assert eng._started[0][1].sparse.min_sparse_len == 4096 and eng._started[0][1].engine.context_length == 16640
    assert ttft_notes(rows, [BF16, DENSE], 8192) == ["at 2048 tokens bf16 ran dense: prompts below min_sparse_len 4,096"]
