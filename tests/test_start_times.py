"""The engine start's duration, remembered to announce the next wait (``fpcli.engine.start_times``)."""
from __future__ import annotations

import json

import pytest

from fpcli.engine.start_times import FILE_NAME, last_start_s, record_start_s, start_key, start_message


def test_record_then_read_back_per_key(tmp_path):
    a = start_key("sglang", tmp_path / "qwen", 131072)
    b = start_key("sglang", tmp_path / "qwen", None)
    assert a != b and b.endswith(" native")
    assert last_start_s(tmp_path, a) is None
    record_start_s(tmp_path, a, 66.04)
    record_start_s(tmp_path, b, 12.0)
    assert last_start_s(tmp_path, a) == 66.0 and last_start_s(tmp_path, b) == 12.0
    record_start_s(tmp_path, a, 71.26)  # the latest wins
    assert last_start_s(tmp_path, a) == 71.3
    assert start_message("starting SGLang with qwen (weights)", 71.3) == \
        "starting SGLang with qwen (weights); ~71 s last time"
    assert start_message("loading smol (transformers engine)", None) == "loading smol (transformers engine)"
    assert start_message("loading smol (transformers engine)", 0.4) == "loading smol (transformers engine)"


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"k": "soon"}', '{"k": -3}'])
def test_a_damaged_file_loses_only_the_hint(tmp_path, content):
    (tmp_path / FILE_NAME).write_text(content, encoding="utf-8")
    assert last_start_s(tmp_path, "k") is None
    record_start_s(tmp_path, "k", 5.0)  # rewritten whole
    assert last_start_s(tmp_path, "k") == 5.0


def test_an_unwritable_cache_is_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    record_start_s(blocker / "cache", "k", 5.0)  # its parent is a file: nothing written, no exception
    assert last_start_s(blocker / "cache", "k") is None


def test_load_engine_records_its_start_for_the_next_spinner(monkeypatch, tmp_path):
    import fpcli.engine as engine_mod
    import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile

    class Recorder:
        def __init__(self, path, profile, **kw):
            self.path = path

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 32768}), encoding="utf-8")
    monkeypatch.setenv("FP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(se, "SGLangEngine", Recorder)
    monkeypatch.setattr(engine_mod, "resolve_request", lambda e, m, p, **_: ("sglang", m, load_profile("bf16")))
    engine_mod.load_engine("sglang", str(model), "bf16", progress=False)
    stored = json.loads((tmp_path / "cache" / FILE_NAME).read_text(encoding="utf-8"))
    assert list(stored) == [start_key("sglang", model, None)] and stored[start_key("sglang", model, None)] >= 0
