"""The document and prompt-fit cache (``fpcli.doccache``): a hit gives what a fresh read gives, a
changed file misses, a corrupt entry is ignored and replaced, protected text never reaches disk,
the folder is private and bounded; the summary's stage timings."""
from __future__ import annotations

import dataclasses
import os
import stat

import pytest

from fp_fakes import encrypt_pdf, make_pdf
from fpcli.doccache import CacheConfig, DiskCache, digest
from fpcli.ingest import ingest


def _cache(tmp_path, **kw) -> DiskCache:
    return DiskCache(CacheConfig(root=tmp_path / "cache", **kw), "documents")


def _same(a, b) -> None:
    fields = {f.name for f in dataclasses.fields(a)} - {"from_cache", "notes"}
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}


def test_a_hit_returns_the_same_document_as_a_fresh_read(tmp_path, pdf_factory):
    pdf = pdf_factory("report.pdf", ["Revenue rose to 12 million.", None, "Outlook: stable."])
    cache = _cache(tmp_path)
    fresh = ingest([str(pdf)])[0]
    first = ingest([str(pdf)], cache=cache)[0]
    second = ingest([str(pdf)], cache=cache)[0]
    assert not first.from_cache and second.from_cache
    assert fresh.text.count("Revenue") == 1 and fresh.page_starts and fresh.scanned_pages == [2]
    _same(fresh, first)
    _same(fresh, second)
    assert second.notes == fresh.notes + [f"{pdf}: text from fp's document cache"]
    assert second.to_dict()["from_cache"] is True


def test_a_hit_under_another_name_names_that_file(tmp_path):
    data = b"caf\xe9 au lait, " * 20  # not UTF-8: a warning that names the file
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(data)
    b.write_bytes(data)
    cache = _cache(tmp_path)
    ingest([str(a)], cache=cache)
    doc = ingest([str(b)], cache=cache)[0]
    assert doc.from_cache and doc.warnings and all(w.startswith(f"{b}:") for w in doc.warnings)


def test_a_changed_file_misses(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("The budget is 4 million.")
    cache = _cache(tmp_path)
    ingest([str(path)], cache=cache)
    path.write_text("The budget is 5 million.")
    doc = ingest([str(path)], cache=cache)[0]
    assert not doc.from_cache and "5 million" in doc.text


def test_a_corrupt_entry_is_ignored_and_replaced(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("The harbor opens in May.")
    cache = _cache(tmp_path)
    ingest([str(path)], cache=cache)
    (entry,) = list(cache.folder.glob("*.json"))
    for damage in (b"{not json", b'{"format": 1, "key": "other", "value": {}}', b""):
        entry.write_bytes(damage)
        doc = ingest([str(path)], cache=cache)[0]
        assert not doc.from_cache and doc.text == "The harbor opens in May." and doc.ok
        assert ingest([str(path)], cache=cache)[0].from_cache  # replaced by the re-read
    # an entry with the right key but a damaged value is a miss too
    key = entry.stem
    cache.put(key, {"text": 3})
    doc = ingest([str(path)], cache=cache)[0]
    assert not doc.from_cache and doc.text == "The harbor opens in May."


def test_a_password_protected_pdf_is_never_cached(tmp_path):
    path = tmp_path / "secret.pdf"
    encrypt_pdf(make_pdf(["The code word is heron."]), "pw", path)
    cache = _cache(tmp_path)
    for _ in range(2):
        doc = ingest([str(path)], password="pw", cache=cache)[0]
        assert doc.ok and "heron" in doc.text and not doc.from_cache
    assert not list(cache.folder.glob("*.json")) if cache.folder.exists() else True
    # an empty user password protects nothing: cached
    open_pdf = tmp_path / "open.pdf"
    encrypt_pdf(make_pdf(["Public text."]), "", open_pdf)
    ingest([str(open_pdf)], cache=cache)
    assert ingest([str(open_pdf)], cache=cache)[0].from_cache


def test_the_folder_is_private_and_files_are_0600(tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    cache = DiskCache(CacheConfig(root=root), "documents")
    assert cache.put(digest("k"), {"x": 1})
    for folder in (root, cache.folder):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    (f,) = cache.folder.glob("*.json")
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert not list(cache.folder.glob(".tmp-*"))  # written atomically: no temporary left


def test_the_size_is_bounded_oldest_evicted(tmp_path):
    big = DiskCache(CacheConfig(root=tmp_path / "c"), "fits")
    keys = [digest(i) for i in range(6)]
    for i, k in enumerate(keys):
        assert big.put(k, {"blob": "x" * 900})
        os.utime(big._path(k), (1000 + i, 1000 + i))  # a distinct age for each
    cache = DiskCache(CacheConfig(root=tmp_path / "c", max_bytes=3000), "fits")
    cache.get(keys[3])  # used recently: kept
    cache.put(digest("new"), {"blob": "y" * 900})
    left = {p.stem for p in cache.folder.glob("*.json")}
    assert sum(p.stat().st_size for p in cache.folder.glob("*.json")) <= 3000
    assert digest("new") in left and keys[3] in left and keys[0] not in left


def test_a_disabled_cache_stores_nothing(tmp_path):
    cache = _cache(tmp_path, enabled=False)
    path = tmp_path / "a.txt"
    path.write_text("text")
    ingest([str(path)], cache=cache)
    assert not ingest([str(path)], cache=cache)[0].from_cache and not (tmp_path / "cache").exists()


def test_stages_split_the_wall_time():
    from fpcli.report import stages, time_row

    st = stages(9.0, 0.5, 2.0, read_s=1.0, fit_s=0.5, engine_start_s=5.0)
    assert st == pytest.approx({"read": 1.0, "fit": 0.5, "engine_start": 5.0, "queued": 0.0, "ttft": 0.5,
                                "decode": 1.5, "other": 0.5})
    assert stages(None, 0.5, 2.0) is None
    assert stages(1.0, 0.5, 2.0)["other"] == 0.0  # never negative
    s = {"total_s": 2.0, "ttft_s": 0.5, "wall_s": 9.0, "engine_start_s": 5.0, "stages_s": st}
    assert time_row(s)[1] == ("9.000 s (read 1.000 s, fit 0.500 s, engine start 5.000 s, TTFT 0.500 s, "
                              "decode 1.500 s, other 0.500 s)")
    waited = stages(9.0, 0.5, 2.0, engine_start_s=0.0, queued_s=6.0)  # behind another request
    assert waited["queued"] == 6.0 and waited["other"] == pytest.approx(1.0)
    row = time_row({"total_s": 2.0, "ttft_s": 0.5, "wall_s": 9.0, "engine_start_s": 0.0, "stages_s": waited})[1]
    assert row == "9.000 s (engine start 0.000 s, queued 6.000 s, TTFT 0.500 s, decode 1.500 s, other 1.000 s)"


def test_fp_ask_reports_stages_and_reads_a_repeat_from_the_cache(runner, fake_engine, tmp_path):
    import json

    from fpcli.cli import app

    doc = tmp_path / "doc.txt"
    doc.write_text("The ferry terminal opens in June 2026.")
    out = []
    for _ in range(2):
        r = runner.invoke(app, ["ask", str(doc), "When does it open?", "--json"])
        assert r.exit_code == 0, r.output
        out.append(json.loads(r.stdout))
    s = out[0]["summary"]
    assert set(s["stages_s"]) == {"read", "fit", "engine_start", "queued", "ttft", "decode", "other"}
    assert s["stages_s"]["read"] > 0 and s["stages_s"]["fit"] > 0
    assert sum(s["stages_s"].values()) == pytest.approx(s["wall_s"], abs=1e-6)
    docs = [o["ingestion"]["documents"][0] for o in out]
    assert docs[0]["from_cache"] is False and docs[1]["from_cache"] is True
    assert any("document cache" in n for n in docs[1]["notes"])


@pytest.mark.parametrize("command", ["profile", "chat"])
def test_profile_and_chat_repeats_read_the_pdf_and_the_fit_from_the_cache(runner, fake_engine, pdf_factory, tmp_path,
                                                                         monkeypatch, command):
    """Like ``fp ask``, a repeat of ``fp profile`` / ``fp chat`` about the same PDF parses it no more
    and fits it from the cache: one ``encode_chat`` less, no new fit entry."""
    import fpcli.engine
    from fp_fakes import fake_load_engine
    from fpcli.cli import app
    from fpcli.doccache import default_config

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "whitespace"}')  # identifies the fake engine's tokenizer

    def load(*args, **kw):
        eng = fake_load_engine(*args, **kw)
        eng.model_path = str(tok)
        return eng

    monkeypatch.setattr(fpcli.engine, "load_engine", load)
    pdf = pdf_factory("report.pdf", ["The ferry terminal opens in June 2026.", "Revenue was 4.2 million."])
    args = {"profile": ["profile", str(pdf), "--json", "--png", str(tmp_path / "d.png")],
            "chat": ["chat", str(pdf)]}[command]
    calls, fits = [], default_config().root / "fits"
    for _ in range(2):
        r = runner.invoke(app, args, input="When does it open?\n" if command == "chat" else None)
        assert r.exit_code == 0, r.output
        calls.append(len(fake_engine().prompts))
        assert len(list(fits.glob("*.json"))) == 1
    assert calls[1] == calls[0] - 1  # the fit came from the cache
    assert "text from fp's document cache" in r.stderr


def test_a_text_cached_under_the_old_accent_rule_is_read_again(tmp_path):
    """Before accents were joined only in TeX-made PDFs, a Word PDF's "Peter´s" was cached as
    "Peterś" under the key that named the old rule: that entry must never be returned."""
    import hashlib
    from importlib.metadata import version

    from fp_fakes import make_tex_accent_pdf
    from fpcli import __version__

    pdf = tmp_path / "letter.pdf"
    data = make_tex_accent_pdf(["Peter", ("\u00b4", "s"), " letter"], pdf, producer="Microsoft Word", creator=None)
    cache = _cache(tmp_path)
    old_rule = f"pdf: pypdfium2 {version('pypdfium2')}, pypdf {version('pypdf')}, TeX accents joined"
    old = digest("document", hashlib.sha256(data).hexdigest(), __version__, old_rule)
    assert cache.put(old, {"kind": "pdf", "text": "Peter\u015b letter", "pages": 1, "page_starts": [[1, 0]],
                           "skipped_pages": [], "empty_pages": [], "scanned_pages": [], "glued_pages": [],
                           "notes": [], "warnings": []})
    doc = ingest([str(pdf)], cache=cache)[0]
    assert not doc.from_cache and "Peter\u00b4s letter" in doc.text, doc.text
    again = ingest([str(pdf)], cache=cache)[0]  # the new entry is used
    assert again.from_cache and again.text == doc.text


def test_a_tex_pdf_from_the_cache_keeps_its_joined_accents_and_note(tmp_path):
    from fp_fakes import make_tex_accent_pdf

    pdf = tmp_path / "paper.pdf"
    make_tex_accent_pdf(["Br", ("\u00a8", "o"), "ker"], pdf)
    cache = _cache(tmp_path)
    first = ingest([str(pdf)], cache=cache)[0]
    second = ingest([str(pdf)], cache=cache)[0]
    assert second.from_cache and second.text == first.text and "Br\u00f6ker" in second.text
    assert any(n.startswith(f"{pdf}: made by TeX") for n in second.notes), second.notes
