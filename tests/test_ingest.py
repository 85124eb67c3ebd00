"""Ingestion must survive real documents: every case builds its PDF inside the test."""
from __future__ import annotations

import io
import os
import sys
import threading
import time

import pytest

from fp_fakes import encrypt_pdf, garble_pdf, make_pdf
from fpcli import ingest
from fpcli.ingest import check_paths, garbled_fraction, ingest as ingest_all


def test_plain_pdf_pages_and_offsets(pdf_factory):
    path = pdf_factory("plain.pdf", ["First page alpha", "Second page beta", "Third page gamma"])
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.kind == "pdf" and doc.pages == 3
    assert "alpha" in doc.text and "gamma" in doc.text
    assert doc.warnings == [] and doc.skipped_pages == []
    assert doc.page_of(doc.text.index("beta")) == 2
    assert doc.page_of(doc.text.index("gamma")) == 3


def test_encrypted_empty_user_password_is_decrypted(tmp_path):
    path = tmp_path / "empty-pw.pdf"
    encrypt_pdf(make_pdf(["Opens without a prompt"]), "", path)
    (doc,) = ingest_all([str(path)])
    assert doc.ok
    assert "without a prompt" in doc.text
    assert any("empty password" in n for n in doc.notes)  # a note: nothing is wrong
    assert not any("empty password" in w for w in doc.warnings)


def test_encrypted_real_password_names_file_and_option(tmp_path, pdf_factory):
    locked = tmp_path / "locked.pdf"
    encrypt_pdf(make_pdf(["The vault code is 1234"]), "hunter2", locked)
    other = pdf_factory("other.pdf", ["Still read"])
    docs = ingest_all([str(locked), str(other)])
    assert not docs[0].ok
    assert str(locked) in docs[0].error and "--password" in docs[0].error
    assert docs[1].ok and "Still read" in docs[1].text  # the rest of the batch is not lost

    (good,) = ingest_all([str(locked)], password="hunter2")
    assert good.ok and "vault code is 1234" in good.text

    (bad,) = ingest_all([str(locked)], password="wrong")
    assert not bad.ok and "wrong password" in bad.error and "--password" in bad.error


def test_password_not_needed_is_said_once_and_a_needed_one_is_not(tmp_path, pdf_factory):
    """--password with no protected input: a note on the first document (nothing is wrong, the
    text is read); with a protected input in the batch, opened or not, no such note."""
    plain = pdf_factory("plain.pdf", ["Nothing to unlock here"])
    note = ingest.UNUSED_PASSWORD_NOTE
    docs = ingest_all([str(plain), str(plain.with_name("x.txt"))], password="hunter2")
    assert docs[0].ok and "Nothing to unlock" in docs[0].text
    assert [n for d in docs for n in d.notes].count(note) == 1 and note in docs[0].notes
    assert not any(note in w for d in docs for w in d.warnings)
    (no_pw,) = ingest_all([str(plain)])
    assert note not in no_pw.notes and not no_pw.password_protected

    locked = tmp_path / "locked.pdf"
    encrypt_pdf(make_pdf(["The vault code is 1234"]), "hunter2", locked)
    for pw in ("hunter2", "wrong"):
        docs = ingest_all([str(plain), str(locked)], password=pw)
        assert docs[1].password_protected and not docs[0].password_protected
        assert not any(note in n for d in docs for n in d.notes), pw
    empty = tmp_path / "empty-pw.pdf"
    encrypt_pdf(make_pdf(["Opens without a prompt"]), "", empty)
    (doc,) = ingest_all([str(empty)], password="hunter2")  # encrypted, but no user password needed
    assert doc.ok and not doc.password_protected and note in doc.notes


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256"])
def test_aes_encrypted_pdfs_are_read(tmp_path, algorithm):
    """AES (what most PDF writers use today) with an empty and with a real user password."""
    opened = tmp_path / "aes-empty.pdf"
    encrypt_pdf(make_pdf(["The treasurer is Ada Lovelace"]), "", opened, algorithm)
    (doc,) = ingest_all([str(opened)])
    assert doc.ok and "Ada Lovelace" in doc.text and doc.warnings == []
    locked = tmp_path / "aes-locked.pdf"
    encrypt_pdf(make_pdf(["Budget line 7 is 42,000"]), "s3cret", locked, algorithm)
    (no_pw,) = ingest_all([str(locked)])
    assert not no_pw.ok and "--password" in no_pw.error
    (good,) = ingest_all([str(locked)], password="s3cret")
    assert good.ok and "Budget line 7" in good.text and good.warnings == []


def test_missing_crypto_package_is_named_not_called_damage(tmp_path, monkeypatch):
    """Where pypdf reads (while PDFium is busy), an AES file without the cryptography package must
    say what to install, never "damaged PDF"."""
    from pypdf.errors import DependencyError

    path = tmp_path / "aes.pdf"
    encrypt_pdf(make_pdf(["x"]), "", path, "AES-128")
    import pypdf

    def no_crypto(*args, **kwargs):
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf, "PdfReader", no_crypto)
    with ingest._PDFIUM_LOCK:  # PDFium held (as by a timed-out page): pypdf reads
        (doc,) = ingest_all([str(path)])
    assert not doc.ok and "pip install cryptography" in doc.error and "damaged" not in doc.error


@pytest.mark.parametrize("package", ["pypdfium2", "pypdf"])
def test_missing_pdf_package_is_one_line_naming_it(tmp_path, monkeypatch, package):
    """A runtime dependency that is not installed: the file is skipped with one line naming the
    package and the install command (no traceback), and the other files are still read."""
    pdf = tmp_path / "a.pdf"
    make_pdf(["text"], pdf)
    txt = tmp_path / "b.txt"
    txt.write_text("still read")
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    import contextlib

    with ingest._PDFIUM_LOCK if package == "pypdf" else contextlib.nullcontext():
        a, b = ingest_all([str(pdf), str(txt)])
    assert not a.ok and "\n" not in a.error and a.error.startswith(str(pdf))
    assert f"needs the Python package {package}, which is not installed" in a.error and "pip install" in a.error
    assert b.ok and b.text == "still read"


@pytest.fixture(autouse=True)
def _pdfium_free_after_test():
    """A test that hangs a page inside PDFium releases it in ``finally``; the abandoned worker then
    finishes that page, holding PDFium's lock a moment longer (long enough on a loaded 2-core CI
    machine). The next test starts once the lock is free, else it reads with the pypdf fallback."""
    yield
    assert ingest._PDFIUM_LOCK.acquire(timeout=30), "a test left PDFium held for 30 s"
    ingest._PDFIUM_LOCK.release()


def test_hanging_page_is_skipped_after_time_limit(pdf_factory, monkeypatch):
    path = pdf_factory("hang.pdf", ["page one ok", "page two hangs", "page three ok"])
    release = threading.Event()
    real = ingest.extract_page_text

    def hang_on_two(page):
        text = real(page)
        if "two hangs" in text:
            release.wait(30)  # simulates a pathological content stream
        return text

    monkeypatch.setattr(ingest, "extract_page_text", hang_on_two)
    t0 = time.perf_counter()
    try:
        (doc,) = ingest_all([str(path)], page_timeout=0.3)
    finally:
        release.set()
    assert time.perf_counter() - t0 < 5
    assert doc.ok and doc.skipped_pages == [2]
    assert "page one ok" in doc.text and "page three ok" in doc.text and "two hangs" not in doc.text
    assert any("page 2" in w and "skipped" in w for w in doc.warnings)


def test_exploding_page_is_skipped(pdf_factory, monkeypatch):
    path = pdf_factory("boom.pdf", ["fine", "explodes", "fine again"])
    real = ingest.extract_page_text

    def explode_on_two(page):
        text = real(page)
        if "explodes" in text:
            raise RecursionError("maximum recursion depth exceeded in content stream")
        return text

    monkeypatch.setattr(ingest, "extract_page_text", explode_on_two)
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.skipped_pages == [2]
    assert "fine again" in doc.text
    assert any("page 2" in w and "RecursionError" in w for w in doc.warnings)


def test_many_timeouts_skip_rest_of_file(pdf_factory, monkeypatch):
    path = pdf_factory("slow.pdf", [f"p{i}" for i in range(1, 7)])
    release = threading.Event()
    monkeypatch.setattr(ingest, "extract_page_text", lambda page: release.wait(30) and "")
    try:
        (doc,) = ingest_all([str(path)], page_timeout=0.05)
    finally:
        release.set()
    assert doc.skipped_pages == [1, 2, 3, 4, 5, 6]
    assert any("remaining pages 4-6" in w for w in doc.warnings)


def test_pdf_pages_are_extracted_in_order_by_one_worker_thread(pdf_factory, monkeypatch):
    """A file's pages are read by one extraction thread (one thread start per file, not per
    page), never by the caller's thread, and in page order."""
    path = pdf_factory("manual.pdf", [f"Section {i}: the overlay command uncovers item {i}." for i in range(1, 9)])
    real = ingest.extract_page_text
    seen: list[tuple[threading.Thread, str]] = []  # the Thread objects stay referenced: distinct ids

    def record(page):
        text = real(page)
        seen.append((threading.current_thread(), text))
        return text

    monkeypatch.setattr(ingest, "extract_page_text", record)
    (doc,) = ingest_all([str(path)])
    threads = {id(t) for t, _ in seen}
    assert doc.ok and doc.pages == 8 and len(seen) == 8
    assert len(threads) == 1 and seen[0][0] is not threading.current_thread()
    assert [int(text.split(":")[0].split()[-1]) for _, text in seen] == list(range(1, 9))


def test_worker_read_gives_the_same_text_and_fitted_prompt_as_a_read_in_the_caller(pdf_factory, tmp_path,
                                                                                   monkeypatch):
    """The extraction thread changes nothing but the time: a real PDF (TeX-style word placement,
    a blank and a scanned page) read through ``_PageWorker`` and read page by page in the
    caller's thread give the same text, pages and warnings, and the same fitted prompt ids."""
    from fp_fakes import FakeEngine, make_tex_pdf
    from fpcli.prompt import build_prompt

    words = "the beamer class places every overlay specification on its own frame".split()
    pages = [" ".join(words[(i + j) % len(words)] for j in range(120)) for i in range(6)]
    tex = tmp_path / "tex.pdf"
    make_tex_pdf(pages, tex, style="tj")
    mixed = pdf_factory("mixed.pdf", ["typed text " * 40, "", None, "more typed text " * 40])

    class InCaller:  # the reading order before the worker: each page extracted when it is asked for
        def __init__(self, pages, first):
            self.pages = list(pages)

        def result(self, index, timeout):
            return ingest._extract(self.pages[index])

        def close(self):
            pass

    worker_docs = ingest_all([str(tex), str(mixed)])
    monkeypatch.setattr(ingest, "_PageWorker", InCaller)
    caller_docs = ingest_all([str(tex), str(mixed)])
    for a, b in zip(worker_docs, caller_docs):
        assert a.ok and a.text.strip() and a.to_dict() == b.to_dict()
        assert a.text == b.text and a.page_starts == b.page_starts
    assert worker_docs[1].empty_pages == [2, 3] and worker_docs[1].scanned_pages == [3]
    prompts = [build_prompt(docs, "Where is the overlay?", FakeEngine(context_length=900), 100)
               for docs in (worker_docs, caller_docs)]
    assert prompts[0].cuts and prompts[0].ids == prompts[1].ids and prompts[0].tokens <= 800


def test_scanned_pages_are_reported_no_ocr(pdf_factory):
    scanned = pdf_factory("scan.pdf", [None, None])
    mixed = pdf_factory("mixed.pdf", ["typed text", None, "more typed text"])
    s, m = ingest_all([str(scanned), str(mixed)])
    assert s.ok and s.text == "" and s.empty_pages == [1, 2]
    assert s.scanned_pages == [1, 2]
    assert any("no text layer on any page" in w and "no OCR" in w for w in s.warnings)
    assert m.empty_pages == [2] and m.scanned_pages == [2]
    assert any("page(s) 2 have images but no text layer" in w for w in m.warnings)
    assert "more typed text" in m.text


def _corrupt_startxref(data: bytes) -> bytes:
    i = data.rfind(b"startxref")
    return data[:i] + b"startxref\n999999\n%%EOF\n"


def _corrupt_xref_and_trailer(data: bytes) -> bytes:
    j = data.rfind(b"xref")
    return data[:j] + b"xref\ngarbage entries\ntrailer\n<< /Size 3 >>\nstartxref\n12\n%%EOF\n"


@pytest.mark.parametrize("corrupt", [_corrupt_startxref, _corrupt_xref_and_trailer])
def test_broken_xref_or_trailer_is_recovered(tmp_path, corrupt):
    """A rebuilt cross-reference table lost nothing here: a note, not a warning."""
    path = tmp_path / "broken.pdf"
    path.write_bytes(corrupt(make_pdf(["recoverable text", "page two"])))
    (doc,) = ingest_all([str(path)])
    assert doc.ok and "recoverable text" in doc.text and "page two" in doc.text and doc.pages == 2
    assert any("damaged cross-reference table; rebuilt" in n for n in doc.notes)
    assert doc.warnings == []


@pytest.mark.parametrize("tail", [b"%%EOF\n", b"%%EOF\n%%EOF\n", b"\x00\x1a trailing bytes after the end\n" * 4])
def test_duplicated_eof_or_trailing_bytes_are_no_alarm(tmp_path, tail):
    """A repeated %%EOF (or bytes after it) loses nothing: no warning, no "damaged" note."""
    path = tmp_path / "eof.pdf"
    path.write_bytes(make_pdf(["whole text", "page two"]) + tail)
    (doc,) = ingest_all([str(path)])
    assert doc.ok and "whole text" in doc.text and "page two" in doc.text
    assert doc.warnings == [] and doc.notes == []


def test_blank_page_is_not_called_scanned(pdf_factory):
    """A blank page (TeX books have them) is no scan; an image-only page is."""
    path = pdf_factory("book.pdf", ["chapter one", "", "chapter two", None])
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.empty_pages == [2, 4] and doc.scanned_pages == [4]
    scanned = [w for w in doc.warnings if "no text layer" in w]
    assert len(scanned) == 1 and "page(s) 4 have images" in scanned[0]
    (blank,) = ingest_all([str(pdf_factory("blank.pdf", ["", ""]))])
    assert blank.scanned_pages == [] and not any("scanned" in w or "OCR" in w for w in blank.warnings)
    assert blank.warnings == [f"{blank.name}: no text extracted"]


def test_unrecoverable_pdf_is_skipped_rest_continues(tmp_path, pdf_factory):
    junk = tmp_path / "junk.pdf"
    junk.write_bytes(b"%PDF-1.4\n1 0 obj garbage endobj\n" + b"\x00\xff" * 100)
    truncated = tmp_path / "truncated.pdf"
    truncated.write_bytes(make_pdf(["x" * 50])[:300])
    good = pdf_factory("good.pdf", ["survivor"])
    docs = ingest_all([str(junk), str(truncated), str(good)])
    assert [d.ok for d in docs] == [False, False, True]
    assert str(junk) in docs[0].error and "skipped" not in docs[0].error  # the CLI says "skipped: " once
    assert "survivor" in docs[2].text


def test_garbled_pdf_text_warns(tmp_path):
    path = tmp_path / "garbled.pdf"
    path.write_bytes(garble_pdf(make_pdf(["This text has a font whose Unicode map is broken"])))
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.text  # kept: the user decides, but is warned
    assert any("looks garbled" in w and "100%" in w for w in doc.warnings)
    assert sum("looks garbled" in w for w in doc.warnings) == 1  # checked once, not per stage


def test_pdf_detection_same_for_stdin_and_files(tmp_path):
    """``%PDF-`` anywhere in the first KiB makes a PDF, on stdin as in a file (junk before it is allowed)."""
    data = b"junk before the header\n" + make_pdf(["header after junk"])
    path = tmp_path / "noext"
    path.write_bytes(data)
    (f,) = ingest_all([str(path)])
    (p,) = ingest_all(["-"], stdin=io.BytesIO(data))
    assert f.ok and f.kind == "pdf" and "header after junk" in f.text
    assert p.ok and p.kind == "stdin-pdf" and "header after junk" in p.text
    assert ingest._is_pdf(b"x" * 1000 + b"%PDF-1.7") and not ingest._is_pdf(b"x" * 1024 + b"%PDF-1.7")


def test_garbled_replacement_chars_warn(pdf_factory, monkeypatch):
    path = pdf_factory("garbled.pdf", ["anything"])
    monkeypatch.setattr(ingest, "extract_page_text", lambda page: "\ue001\ue002\ue003 \ufffd\ufffd ok " * 20)
    (doc,) = ingest_all([str(path)])
    assert doc.ok and any("looks garbled" in w for w in doc.warnings)


def test_garbled_fraction():
    assert garbled_fraction("hello world") == 0.0
    assert garbled_fraction("\ufffd\ufffdab") == 0.5
    assert garbled_fraction("\ue000 \U000f0000") == 1.0
    assert garbled_fraction("") == 0.0


def test_garbled_fraction_counts_as_defined():
    """The regular expressions count what the definition says: every character that
    ``str.isspace`` accepts is left out (the Unicode spaces and the ASCII separators too), and
    U+FFFD, the BMP private-use area and planes 15-16 count as garbled."""
    import random

    rng = random.Random(7)
    alphabet = ["a", "Z", "7", ".", " ", "\n", "\t", "\x1c", "\x1f", "\x85", "\xa0", "\u2003", "\u3000",
                "\ufffd", "\ue000", "\uf8ff", "\uf900", "\U000f0000", "\U0010fffd", "\U000effff", "\u00e9"]
    text = "".join(rng.choice(alphabet) for _ in range(5000))
    kept = [c for c in text if not c.isspace()]
    bad = [c for c in kept if c == "\ufffd" or "\ue000" <= c <= "\uf8ff" or c >= "\U000f0000"]
    assert 0 < len(bad) < len(kept)
    assert garbled_fraction(text) == len(bad) / len(kept)


def test_text_and_markdown_utf8_with_bad_bytes(tmp_path):
    good = tmp_path / "notes.md"
    good.write_text("# Title\n\nCafé ünïcode", encoding="utf-8")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("René Dubois, café crème, 5 €".encode("cp1252"))
    mixed = tmp_path / "mixed.txt"
    mixed.write_bytes("Ünïcode café ".encode("utf-8") + b"stray \xff byte")
    g, lat, mix = ingest_all([str(good), str(latin), str(mixed)])
    assert g.ok and g.kind == "text" and "Café" in g.text and g.warnings == []
    # no valid UTF-8 at all: a legacy single-byte file, read as Windows-1252
    assert lat.ok and lat.text == "René Dubois, café crème, 5 €"
    assert any("not UTF-8; read as Windows-1252" in w for w in lat.warnings)
    # mostly UTF-8 with a stray byte: the UTF-8 text stays, the byte is replaced
    assert mix.ok and "Ünïcode café" in mix.text and "\ufffd" in mix.text
    assert any("not valid UTF-8" in w and "1 undecodable" in w for w in mix.warnings)


def test_utf8_bom_dropped_and_binary_rejected(tmp_path):
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 40)
    a, b = ingest_all([str(bom), str(binary)])
    assert a.text == "hello"
    assert not b.ok and "binary" in b.error


def test_stdin_html_is_read_as_its_visible_text_as_a_file_named_html_is(tmp_path):
    page = ("\ufeff<?xml version='1.0'?>\n<!-- saved page -->\n<!DOCTYPE html><html><head><title>textwrap</title>"
            "<style>p {color: red}</style><script>var width = 1200;</script></head><body><p>The default "
            "<code>width</code> is 70 characters.</p></body></html>").encode("utf-8")
    (piped,) = ingest_all(["-"], stdin=io.BytesIO(page))
    f = tmp_path / "textwrap.html"
    f.write_bytes(page)
    (named,) = ingest_all([str(f)])
    assert piped.ok and piped.kind == "stdin-html" and named.kind == "html"
    assert piped.text == named.text and "default width is 70" in " ".join(piped.text.split())
    assert "<" not in piped.text and "1200" not in piped.text and "color" not in piped.text
    # text that merely mentions a tag stays text
    (t,) = ingest_all(["-"], stdin=io.BytesIO(b"Use <html> tags in a page; a < b."))
    assert t.kind == "stdin-text" and "<html>" in t.text


def test_stdin_text_and_pdf():
    (t,) = ingest_all(["-"], stdin=io.BytesIO("from stdin".encode()))
    assert t.ok and t.kind == "stdin-text" and t.text == "from stdin"
    (p,) = ingest_all(["-"], stdin=io.BytesIO(make_pdf(["piped pdf"])))
    assert p.ok and p.kind == "stdin-pdf" and "piped pdf" in p.text


def test_pdf_detected_by_content_not_extension(tmp_path):
    path = tmp_path / "paper.dat"
    path.write_bytes(make_pdf(["sniffed"]))
    (doc,) = ingest_all([str(path)])
    assert doc.kind == "pdf" and "sniffed" in doc.text


def test_check_paths_lists_every_problem(tmp_path):
    ok = tmp_path / "ok.txt"
    ok.write_text("x")
    unreadable = tmp_path / "secret.txt"
    unreadable.write_text("x")
    unreadable.chmod(0)
    problems = check_paths([str(ok), str(tmp_path / "missing.pdf"), str(tmp_path), "-", "-", str(unreadable)])
    joined = "\n".join(problems)
    assert "missing.pdf: no such file" in joined
    assert "is a folder" in joined
    assert "more than once" in joined
    if not os.access(unreadable, os.R_OK):  # root reads anything
        assert "secret.txt: not readable" in joined
    assert str(ok) not in joined
    assert check_paths([str(ok), "-"]) == []


def test_to_dict_has_no_text(pdf_factory):
    (doc,) = ingest_all([str(pdf_factory("d.pdf", ["abc"]))])
    d = doc.to_dict()
    assert "text" not in d and d["chars"] == 3 and d["pages"] == 1


# -- why a PDF cannot be read: each failure says what it is and what to do ------------------------


def test_pdf_failures_are_classified(tmp_path, pdf_factory):
    html = tmp_path / "download.pdf"
    html.write_bytes(b"<!DOCTYPE html><html><body>404 Not Found</body></html>\n")
    text = tmp_path / "notes.pdf"
    text.write_bytes(b"just some text saved with the wrong name\n")
    truncated = tmp_path / "cut.pdf"
    truncated.write_bytes(make_pdf(["x" * 50, "page two"])[:300])
    damaged = tmp_path / "damaged.pdf"  # header and trailer intact, the objects destroyed
    data = make_pdf(["hello"])
    damaged.write_bytes(data[:9] + b"#" * (len(data) - 209) + data[-200:])
    h, t, c, d = ingest_all([str(html), str(text), str(truncated), str(damaged)])
    assert not h.ok and "not a PDF file" in h.error and "HTML page" in h.error
    assert not t.ok and "not a PDF file" in t.error and "%PDF-" in t.error and "text" in t.error
    assert not c.ok and "truncated" in c.error and "re-download" in c.error
    assert not d.ok and "damaged PDF" in d.error and f"qpdf {damaged}" in d.error and "re-download" in d.error
    for doc in (h, t, c, d):
        assert "\n" not in doc.error and doc.error.startswith(doc.name)


def test_pdf_problem_from_head_and_tail():
    assert ingest.pdf_problem(b"<html>", b"</html>") == "not-pdf"
    assert ingest.pdf_problem(b"%PDF-1.7\n...", b"... 4 0 obj") == "truncated"
    assert ingest.pdf_problem(b"%PDF-1.7\n...", b"startxref\n123\n%%EOF\n") is None


def test_partly_scanned_pdf_mentions_ocr(pdf_factory):
    (doc,) = ingest_all([str(pdf_factory("mixed.pdf", ["typed", None]))])
    assert any("no text layer" in w and "ocrmypdf" in w for w in doc.warnings)


def test_empty_document_says_so(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("   \n")
    (doc,) = ingest_all([str(blank)])
    assert doc.ok and doc.warnings and "empty" in doc.warnings[0]


# -- words placed one by one, as TeX does: the extractor keeps them apart; glue is warned about --

PROSE = ("The quick brown fox jumps over the lazy dog while the committee discusses the annual budget "
         "and everyone waits patiently for the decision that will shape the coming year. ")


@pytest.mark.parametrize("style", ["td", "tm", "tj"])
def test_tex_placed_words_stay_apart(tmp_path, style):
    """No space glyphs between words (each placed by Td, by Tm or by TJ kerning offsets): the
    text keeps its spaces, and no glue warning."""
    from fp_fakes import make_tex_pdf

    path = tmp_path / f"tex-{style}.pdf"
    make_tex_pdf([PROSE * 6, PROSE * 3], path, style=style)
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.pages == 2
    assert "the committee discusses the annual budget" in " ".join(doc.text.split())
    assert ingest.glued_runs(doc.text) == [] and doc.glued_pages == []
    assert doc.warnings == []


def test_glued_words_in_a_pdf_are_warned_about(pdf_factory):
    """A page whose text has words run together is named in one warning; the others are not."""
    glued = "\n".join(line.replace(" ", "") for line in [PROSE[:90], PROSE[90:]] * 4)
    path = pdf_factory("glued.pdf", [PROSE, glued, PROSE])
    (doc,) = ingest_all([str(path)])
    assert doc.ok and doc.glued_pages == [2]
    (w,) = [w for w in doc.warnings if "words seem to run together" in w]
    assert "page(s) 2:" in w and "\n" not in w and w.startswith(str(path))
    assert "'Thequickbrownfoxjumpsoverthelazydogwhile'" in w  # quoted from page 2, its longest run


# pdfTeX's structure behind the glue reported on real manuals (measured on the beamer user guide,
# docs/ingest.md): one TJ per line, words apart by kerning offsets only, shrunk to 235/1000 em on a
# tight line, in a font whose /Widths gives code 32 (never drawn) half an em. pypdf adds a space
# only for an offset of at least 0.95 x half that width (237.5): it glues such lines.
def _pypdf_text(data: bytes) -> str:
    from pypdf import PdfReader

    return "\n".join(p.extract_text() for p in PdfReader(io.BytesIO(data)).pages)


def test_pdftex_tight_lines_glued_by_pypdf_stay_apart(tmp_path):
    """The words pypdf glues on pdfTeX's tight lines stay apart in fp's text, with no warning."""
    from fp_fakes import make_tex_pdf

    pages = [PROSE * 6, PROSE * 3]
    tight = make_tex_pdf(pages, tmp_path / "tight.pdf", style="tj", gap=235, space_width=500)
    assert ingest.is_glued(_pypdf_text(tight))  # the defect the switch to PDFium removed
    assert not ingest.glued_runs(_pypdf_text(make_tex_pdf(pages, style="tj", gap=260, space_width=500)))
    assert not ingest.glued_runs(_pypdf_text(make_tex_pdf(pages, style="tj", gap=235)))  # Times' space: 250
    (doc,) = ingest_all([str(tmp_path / "tight.pdf")])
    assert doc.ok and doc.pages == 2
    assert " ".join(doc.text.split()) == " ".join((PROSE * 9).split())
    assert doc.glued_pages == [] and doc.warnings == []


def test_pdftex_words_that_touch_are_warned_about(tmp_path):
    """The same structure with words that really touch (no offset between them): glue, warned."""
    from fp_fakes import make_tex_pdf

    make_tex_pdf([PROSE * 6, PROSE * 6], tmp_path / "touch.pdf", style="tj", gap=0, space_width=500)
    (doc,) = ingest_all([str(tmp_path / "touch.pdf")])
    assert doc.ok and doc.glued_pages == [1, 2]
    (w,) = [w for w in doc.warnings if "words seem to run together" in w]
    quoted = w.split("'")[1]  # the longest run (shortened), a line without its spaces
    assert "page(s) 1-2:" in w and len(quoted) >= ingest.GLUED_RUN and quoted in (PROSE * 2).replace(" ", "")


GERMAN = ("Die Rechtsschutzversicherungsgesellschaften haben am Montag mitgeteilt, dass die neue Regelung zur "
          "Kraftfahrzeughaftpflichtversicherung erst im kommenden Jahr gilt. Bis dahin bleibt alles, wie es war: "
          "Wer einen Schaden meldet, schickt die Unterlagen wie bisher an die zuständige Stelle und wartet auf "
          "eine Antwort. Die Verbraucherzentrale rät, Fristen genau zu beachten und Belege aufzubewahren. ")


@pytest.mark.parametrize("text", [
    PROSE * 20,
    GERMAN * 10,  # two 25+ letter compounds in every 60 words
    "Siehe https://www.example.org/documentation/installationinstructionsforadministrators.html und "
    "https://thequickbrownfoxjumpsoverthelazydog.example.com/ für Details. " + PROSE * 3,
    "sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 " * 10 + PROSE,
    "base64 U29tZSBsb25nIGJhc2U2NCBlbmNvZGVkIHRleHQgZm9yIHRoZSB0ZXN0IG9mIGdsdWVk " * 5 + PROSE,
    "大規模言語モデルは長い文書を読むことができます。注意機構の計算量は文脈の長さの二乗に比例します。" * 30,
    "Большие языковые модели читают длинные документы быстро, если внимание разрежено. " * 20,
])
def test_real_prose_is_not_called_glued(text):
    """English, German with long compounds, URLs, hashes, CJK and Cyrillic stay under the rule."""
    assert not ingest.is_glued(text)


def test_glued_rule_trips_on_glued_lines():
    glued = " ".join(PROSE.replace(" ", "")[i:i + 60] for i in range(0, len(PROSE) - 60, 60)) * 5
    assert ingest.is_glued(glued) and ingest.glued_share(glued) > 0.5
    assert ingest.glued_runs("a" * 24 + " " + "b" * 25) == ["b" * 25]
    assert ingest.glued_share("") == 0.0


# -- the same file given twice ---------------------------------------------------------------------


def test_same_file_twice_is_read_once(pdf_factory, tmp_path, monkeypatch):
    path = pdf_factory("twice.pdf", ["only once"])
    other = tmp_path / "other.txt"
    other.write_text("another file")
    monkeypatch.chdir(tmp_path)
    read = []
    docs = ingest_all([str(path), str(other), str(path), "./twice.pdf"], on_file=read.append)
    assert [d.name for d in docs] == [str(path), str(other)]
    assert read == [str(path), str(other)]  # read once each
    notes = docs[0].notes
    assert any("given more than once; read once" in n for n in notes)
    assert any(n.startswith("./twice.pdf: the same file as") for n in notes)


def test_page_hung_inside_pdfium_loses_no_other_page_or_file(pdf_factory, monkeypatch):
    """PDFium is not thread-safe: while a timed-out page still runs in it, the pages and files
    after it are read with pypdf, and nothing else is lost."""
    path = pdf_factory("hang.pdf", ["page one ok", "page two hangs", "page three ok"])
    other = pdf_factory("next.pdf", ["the next file"])
    release = threading.Event()
    real = ingest._pdfium_page_text

    def hang_on_second_page(pdf, index):  # runs holding the PDFium lock, as a real hang would
        if index == 1:
            release.wait(30)
        return real(pdf, index)

    monkeypatch.setattr(ingest, "_pdfium_page_text", hang_on_second_page)
    try:
        a, b = ingest_all([str(path), str(other)], page_timeout=0.3)
    finally:
        release.set()
    assert a.ok and a.skipped_pages == [2]
    assert "page one ok" in a.text and "page three ok" in a.text and "two hangs" not in a.text
    assert any("page(s) 3 read with pypdf" in w for w in a.warnings)
    assert b.ok and "the next file" in b.text and any("read with pypdf" in w for w in b.warnings)


def test_pdfium_line_ends_and_hyphenation_are_plain_text(pdf_factory):
    """PDFium writes \\r\\n line ends and a \\x02 where a word is hyphenated across lines: the
    text has plain \\n and the whole word."""
    path = pdf_factory("hyphen.pdf", ["The committee discussed the extra-\nordinary budget of the year\nand left."])
    (doc,) = ingest_all([str(path)])
    assert doc.ok and "\r" not in doc.text and "\x02" not in doc.text
    assert "extraordinary budget of the year\nand left." in doc.text


def test_pypdf_fallback_reports_like_pdfium(pdf_factory, tmp_path):
    """While PDFium is held by a timed-out page, pypdf reads: the same text, blank and scanned
    pages, and decryption, with a warning that says so."""
    path = pdf_factory("book.pdf", ["chapter one", "", "chapter two", None])
    locked = tmp_path / "locked.pdf"
    encrypt_pdf(make_pdf(["The vault code is 1234"]), "hunter2", locked, "AES-128")
    with ingest._PDFIUM_LOCK:
        doc, no_pw = ingest_all([str(path), str(locked)])
        (good,) = ingest_all([str(locked)], password="hunter2")
    assert doc.ok and "chapter one" in doc.text and "chapter two" in doc.text
    assert doc.empty_pages == [2, 4] and doc.scanned_pages == [4]
    assert any("read with pypdf" in w for w in doc.warnings)
    assert not no_pw.ok and "--password" in no_pw.error
    assert good.ok and "vault code is 1234" in good.text


# -- HTML: the visible text, not the markup --

HTML_PAGE = """<!DOCTYPE html>
<html lang="en"><head><title>Maintenance manual</title>
<meta charset="utf-8"><style>body { font-family: serif; } .hidden { display: none }</style>
<script>var secretToken = "do-not-read"; if (a < b && c > d) { alert("x"); }</script>
</head>
<body>
  <h1>Pump&nbsp;P-7 maintenance</h1>
  <div class="intro"><p>Check the <b>seal</b> &amp; the <a href="#b">bearing</a>
     every   <em>500&#160;hours</em>.</p>
  <p>Caf&eacute; &lt;test&gt; &#233;t&#xE9;</p></div>
  <table><tr><th>Part</th><th>Interval</th></tr>
    <tr><td>Seal</td><td>500 h</td></tr>
    <tr><td>Bearing <span>(front)</span></td><td>2000 h</td></tr></table>
  <ul><li>First item</li><li>Second<br>line</li></ul>
  <pre>  indented
    code</pre>
  <script type="module">console.log("also hidden")</script>
</body></html>
"""


def test_html_file_is_read_as_visible_text(tmp_path):
    page = tmp_path / "manual.html"
    page.write_text(HTML_PAGE, encoding="utf-8")
    also = tmp_path / "same.HTM"
    also.write_text(HTML_PAGE, encoding="utf-8")
    doc, other = ingest_all([str(page), str(tmp_path / "same.HTM")])
    assert doc.ok and doc.kind == "html" and other.kind == "html" and doc.warnings == []
    lines = doc.text.split("\n")
    assert lines[0] == "Pump\u00a0P-7 maintenance"  # the title in <head> is not body text
    assert "Check the seal & the bearing every 500\u00a0hours." in lines  # inline tags joined, spaces collapsed
    assert "Café <test> été" in lines  # named, decimal and hex entities decoded
    assert "Part\tInterval" in lines and "Seal\t500 h" in lines and "Bearing (front)\t2000 h" in lines
    assert "First item" in lines and lines[lines.index("Second") + 1] == "line"
    assert "  indented" in lines and "    code" in lines  # <pre> keeps its spacing
    for markup in ("<", "secretToken", "font-family", "also hidden", "Maintenance manual", "href"):
        assert markup not in doc.text.replace("<test>", "")
    assert doc.to_dict()["kind"] == "html"


def test_html_through_the_document_cache_keeps_its_kind(tmp_path):
    from fpcli.doccache import CacheConfig, DiskCache

    page = tmp_path / "manual.html"
    page.write_text(HTML_PAGE, encoding="utf-8")
    cache = DiskCache(CacheConfig(root=tmp_path / "cache"), "documents")
    (first,) = ingest_all([str(page)], cache=cache)
    (again,) = ingest_all([str(page)], cache=cache)
    assert first.kind == again.kind == "html" and again.from_cache
    assert again.text == first.text and "<" not in first.text.replace("<test>", "")


def test_html_with_only_markup_is_empty(tmp_path):
    page = tmp_path / "blank.html"
    page.write_text("<html><head><script>x = 1</script></head><body> <div></div> </body></html>")
    (doc,) = ingest_all([str(page)])
    assert doc.ok and doc.text == "" and any("empty" in w for w in doc.warnings)


def test_empty_standard_input_is_named_not_dash():
    (doc,) = ingest_all([ingest.STDIN], stdin=io.BytesIO(b""))
    assert doc.ok and doc.warnings == ["standard input: empty"]
    (spaces,) = ingest_all([ingest.STDIN], stdin=io.BytesIO(b"  \n"))
    assert all(w.startswith("standard input:") for w in spaces.warnings) and spaces.warnings


def test_empty_file_gets_no_document_cache_note(tmp_path):
    from fpcli.doccache import CacheConfig, DiskCache

    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    cache = DiskCache(CacheConfig(root=tmp_path / "cache"), "documents")
    for _ in range(2):
        (doc,) = ingest_all([str(empty)], cache=cache)
        assert not doc.from_cache and doc.notes == [] and doc.warnings == [f"{empty}: empty"]
    full = tmp_path / "full.txt"
    full.write_text("some text")
    ingest_all([str(full)], cache=cache)
    (again,) = ingest_all([str(full)], cache=cache)
    assert again.from_cache and any("document cache" in n for n in again.notes)  # the cache still works


@pytest.mark.parametrize("package", ["pypdfium2", "pypdf"])
def test_tex_accents_drawn_over_their_letters_are_composed(tmp_path, package):
    """TeX draws "ö" as the spacing accent "¨", then "o" under it: both extractors gave "Br¨oker".
    The accent before a letter is composed with it; one not before a letter, and ASCII ^ ~, stay."""
    from fp_fakes import make_tex_accent_pdf

    pdf = tmp_path / "authors.pdf"
    make_tex_accent_pdf(["Bernhard Br", ("\u00a8", "o"), "ker, J", ("\u00b4", "e"), "r", ("\u02c6", "o"),
                         "me, Timoth", ("\u00b4", "e"), "e, Fran", ("\u00b8", "c"), "ois; the ", "\u00a8",
                         " sign, ", "\u00b4", " alone, x^2 and ~a"], pdf)
    import contextlib

    with ingest._PDFIUM_LOCK if package == "pypdf" else contextlib.nullcontext():  # held: the pypdf fallback
        doc = ingest.read_pdf(str(pdf), str(pdf), None, 30.0)
    assert any("read with pypdf" in w for w in doc.warnings) == (package == "pypdf")
    assert doc.ok, doc.error
    assert "Bernhard Bröker, Jérôme, Timothée" in doc.text, doc.text
    assert "the \u00a8 sign, \u00b4 alone, x^2 and ~a" in doc.text
    assert "\u00a8o" not in doc.text and "\u00b4e" not in doc.text
    assert any(n.startswith(f"{pdf}: made by TeX (pdfTeX-1.40.25): 5 accent(s)") for n in doc.notes), doc.notes
    assert any(n.endswith("(first: Br\u00a8oker -> Br\u00f6ker)") for n in doc.notes), doc.notes


def _read_pdf_with(package: str, pdf) -> "ingest.Document":
    """``read_pdf`` through PDFium, or through pypdf (PDFium held, as after a timed-out page)."""
    import contextlib

    with ingest._PDFIUM_LOCK if package == "pypdf" else contextlib.nullcontext():
        doc = ingest.read_pdf(str(pdf), str(pdf), None, 30.0)
    assert any("read with pypdf" in w for w in doc.warnings) == (package == "pypdf")
    assert doc.ok, doc.error
    return doc


@pytest.mark.parametrize("package", ["pypdfium2", "pypdf"])
@pytest.mark.parametrize("producer", ["Microsoft\u00ae Word for Microsoft 365", None])  # None: ReportLab's
def test_spacing_accents_outside_tex_pdfs_are_left_alone(tmp_path, package, producer):
    """Word uses "´" as an apostrophe: "Peter´s" is no accented s. Only a PDF whose Producer or
    Creator names TeX gets its accents joined; the same pieces drawn the same way stay as they are."""
    from fp_fakes import make_tex_accent_pdf

    pieces = ["Br", ("\u00a8", "o"), "ker met Peter", ("\u00b4", "s"), " friend; it", ("\u00b4", "s"),
              " rock", ("\u00b4", "n"), ("\u00b4", "r"), "oll"]
    make_tex_accent_pdf(pieces, tmp_path / "word.pdf", producer=producer, creator=None)
    doc = _read_pdf_with(package, tmp_path / "word.pdf")
    assert "Br\u00a8oker met Peter\u00b4s friend; it\u00b4s rock\u00b4n\u00b4roll" in doc.text, doc.text
    assert not any("made by TeX" in n for n in doc.notes)
    # the very same drawing with pdfTeX as its Producer: joined (the Producer alone decides)
    tex = tmp_path / "tex.pdf"
    make_tex_accent_pdf(pieces, tex, producer="pdfTeX-1.40.25", creator=None)
    assert "Br\u00f6ker" in _read_pdf_with(package, tex).text


@pytest.mark.parametrize("package", ["pypdfium2", "pypdf"])
def test_a_url_tilde_in_a_tex_pdf_is_not_an_accent(tmp_path, package):
    """TeX's \\~{} in an older paper's URL draws "˜" before the name: "edu/˜alice" is no "ãlice".
    A tilde after "/", "~" or "." stays; one before a letter in a word ("Se˜nor") is still joined."""
    from fp_fakes import make_tex_accent_pdf

    pdf = tmp_path / "paper.pdf"
    make_tex_accent_pdf(["See http://www.example.edu/", ("\u02dc", "a"), "lice and cs.example.org/", ("\u02dc", "n"),
                         "lp/.", ("\u02dc", "x"), ", Se", ("\u02dc", "n"), "or"], pdf, producer="xdvipdfmx (20220710)")
    doc = _read_pdf_with(package, pdf)
    assert "http://www.example.edu/\u02dcalice and cs.example.org/\u02dcnlp/.\u02dcx, Se\u00f1or" in doc.text, doc.text
    assert any("made by TeX (xdvipdfmx (20220710)): 1 accent(s)" in n for n in doc.notes), doc.notes
    # the note's example is this document's own first join, never another document's word
    assert any(n.endswith("(first: Se\u02dcnor -> Se\u00f1or)") for n in doc.notes), doc.notes
    assert not any("Br" in n for n in doc.notes), doc.notes


def test_tex_maker_reads_producer_and_creator():
    from fpcli.ingest import tex_maker

    for tex in ("pdfTeX-1.40.25", "LuaHBTeX, Version 1.17.0", "XeTeX 0.999994", "dvipdfmx (20200315)",
                "xdvipdfmx (20220710)", "dvips(k) 2021.1", "MiKTeX pdfTeX-1.40.22", "TeX"):
        assert tex_maker({"Producer": tex}) == tex
    assert tex_maker({"Producer": "GPL Ghostscript 9.55", "Creator": "LaTeX with hyperref"}) == "LaTeX with hyperref"
    for other in ("Microsoft\u00ae Word for Microsoft 365", "ReportLab PDF Library - www.reportlab.com",
                  "GNU TeXmacs 2.1", "Microsoft Word - latex_notes.docx", "Acrobat Distiller 9.0 (Windows)"):
        assert tex_maker({"Producer": other, "Creator": other}) is None
    assert tex_maker({}) is None and tex_maker({"Producer": None, "Title": "TeX"}) is None


def test_join_tex_accents_leaves_a_url_tilde():
    from fpcli.ingest import join_tex_accents

    text = "a/\u02dcb, a.\u02dcb, a~\u02dcb, edu/\n\u02dcbob, Espa\u02dcna"
    assert join_tex_accents(text) == "a/\u02dcb, a.\u02dcb, a~\u02dcb, edu/\n\u02dcbob, Espa\u00f1a"


def test_the_accent_note_example_is_the_first_joined_word_cut_short():
    from fpcli.ingest import _join_tex_accents

    text = "see edu/\u02dcalice; na\u00a8\u0131ve caf\u00b4e and Sch\u00a8onheit"
    joined, count, example = _join_tex_accents(text)
    assert count == 3 and joined == "see edu/\u02dcalice; na\u00efve caf\u00e9 and Sch\u00f6nheit"
    assert example == ("na\u00a8\u0131ve", "na\u00efve")  # the URL's tilde is skipped: not joined
    long_word = "x" * 40 + "\u00b4e" + "y" * 40
    _, _, (before, after) = _join_tex_accents(long_word)
    assert before == "x" * 12 + "\u00b4e" + "y" * 12 and after == "x" * 12 + "\u00e9" + "y" * 12
    assert _join_tex_accents("no accent, x^2 and ~a") == ("no accent, x^2 and ~a", 0, None)


def test_join_tex_accents_keeps_what_unicode_cannot_compose():
    from fpcli.ingest import join_tex_accents

    assert join_tex_accents("Mikul\u00b4\u0131k") == "Mikul\u00edk"  # TeX's \\'\\i: a dotless i under the acute
    assert join_tex_accents("\u00afq and \u02c7s") == "\u00afq and \u0161"  # no q with macron in Unicode
    assert join_tex_accents("a\u02dc b, 5\u00b4 3, \u00a8") == "a\u02dc b, 5\u00b4 3, \u00a8"  # not before a letter
