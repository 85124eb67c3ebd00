"""Document ingestion: PDF (pypdf), text and Markdown files, and standard input.

Every input yields one ``Document``; a problem with one file or page is recorded on that
``Document`` (``error``, ``warnings``, ``skipped_pages``) and the rest of the batch goes on.
The cases handled, each with a test in ``tests/test_ingest.py``:

- encrypted PDF with an empty user password: decrypted, said in ``notes`` (not a problem);
- encrypted PDF with a real password: ``error`` names the file and ``--password``
  (a wrong ``--password`` is said to be wrong);
- a page whose extraction hangs or raises: a per-page time limit (``page_timeout``, extraction
  runs in a daemon worker thread), the page is skipped and its number reported;
- pages with no text layer (scanned images): reported; ``fp`` does no OCR;
- a broken cross-reference table or trailer: pypdf's tolerant parser (``strict=False``) rebuilds
  it; a file it still cannot open is skipped with an ``error`` that says why (``pdf_problem``):
  not a PDF at all (no ``%PDF-`` header), truncated (no ``startxref`` / ``%%EOF`` at the end:
  re-download it), or damaged (repair it with ``qpdf in.pdf out.pdf``, or re-download it);
- text that is mostly U+FFFD or private-use characters: a "looks garbled" warning;
- text files that are not valid UTF-8: decoded with replacement characters and a warning.

Paths are checked up front by ``check_paths`` so the CLI can exit with code 2 naming every bad
path before it loads a model.
"""
from __future__ import annotations

import io
import logging
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

STDIN = "-"
PAGE_TIMEOUT_S = 20.0  # per-page extraction limit
MAX_PAGE_TIMEOUTS = 3  # after this many timed-out pages the rest of the file is skipped
GARBLED_FRACTION = 0.3  # share of U+FFFD / private-use among non-space characters


@dataclass
class Document:
    """The text of one input and what happened while reading it.

    Attributes:
        name: the path as the user gave it (``-`` for standard input).
        kind: ``pdf``, ``text`` or ``stdin-pdf`` / ``stdin-text``.
        text: extracted text; pages joined by blank lines (empty when ``error`` is set).
        pages: page count (PDF only).
        page_starts: character offset in ``text`` where each extracted page begins, as
            ``(page_number, offset)`` pairs, 1-based page numbers (PDF only).
        skipped_pages: 1-based pages skipped because extraction failed or timed out.
        empty_pages: 1-based pages with no text layer (scanned images; no OCR is done).
        notes: one line each: facts worth knowing that are not problems (e.g. decrypted).
        warnings: one line each, for the user: the text may be incomplete or wrong.
        error: why the file was skipped, or ``None``.
    """

    name: str
    kind: str
    text: str = ""
    pages: int | None = None
    page_starts: list[tuple[int, int]] = field(default_factory=list)
    skipped_pages: list[int] = field(default_factory=list)
    empty_pages: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def page_of(self, offset: int) -> int | None:
        """1-based page holding character ``offset`` of ``text`` (PDF only)."""
        page = None
        for number, start in self.page_starts:
            if start > offset:
                break
            page = number
        return page

    def to_dict(self) -> dict:
        """Report form: everything but the text itself (its length instead)."""
        d = asdict(self)
        d.pop("text")
        d.pop("page_starts")
        d["chars"] = len(self.text)
        return d


def check_paths(paths: list[str]) -> list[str]:
    """One message per unusable path (missing, a folder, unreadable); empty when all are fine."""
    problems = []
    stdin_seen = False
    for p in paths:
        if p == STDIN:
            if stdin_seen:
                problems.append("'-' (standard input) given more than once")
            stdin_seen = True
            continue
        path = Path(p)
        try:
            if not path.exists():
                problems.append(f"{p}: no such file")
            elif path.is_dir():
                problems.append(f"{p}: is a folder, not a file")
            elif not os.access(path, os.R_OK):
                problems.append(f"{p}: not readable (permission denied)")
        except (OSError, ValueError) as exc:  # e.g. a whole question given as a file name: too long
            problems.append(f"{p}: no such file ({getattr(exc, 'strerror', None) or exc})")
    return problems


def ingest(
    paths: list[str],
    password: str | None = None,
    page_timeout: float = PAGE_TIMEOUT_S,
    stdin: BinaryIO | None = None,
    on_file: Callable[[str], None] | None = None,
) -> list[Document]:
    """Read every input; never raises for a bad document (see ``Document.error``).

    Args:
        paths: file paths; ``-`` reads standard input (PDF if ``%PDF-`` is in its first KiB, as for files).
        password: user password for encrypted PDFs (the same for all of them).
        page_timeout: seconds allowed to extract one PDF page.
        stdin: binary stream to use for ``-`` (default ``sys.stdin.buffer``).
        on_file: called with each name before it is read (progress display).
    """
    docs = []
    for p in paths:
        if on_file:
            on_file(p)
        doc = ingest_one(p, password=password, page_timeout=page_timeout, stdin=stdin)
        if doc.ok and not doc.text.strip() and not doc.warnings:  # say why a file adds nothing
            doc.warnings.append(f"{p}: no text extracted")
        docs.append(doc)
    return docs


def ingest_one(
    path: str, password: str | None = None, page_timeout: float = PAGE_TIMEOUT_S, stdin: BinaryIO | None = None
) -> Document:
    """Read one input. See ``ingest``."""
    try:
        if path == STDIN:
            stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
            data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
            if isinstance(data, str):
                data = data.encode("utf-8")
            if _is_pdf(data):
                return read_pdf(io.BytesIO(data), STDIN, password, page_timeout, kind="stdin-pdf")
            return read_text_bytes(data, STDIN, kind="stdin-text")
        with open(path, "rb") as f:
            head = f.read(1024)
        if _is_pdf(head) or path.lower().endswith(".pdf"):
            return read_pdf(path, path, password, page_timeout)
        return read_text_bytes(Path(path).read_bytes(), path)
    except OSError as exc:
        return Document(name=path, kind="unknown", error=f"{path}: cannot read: {exc.strerror or exc}")


def read_text_bytes(data: bytes, name: str, kind: str = "text") -> Document:
    """UTF-8 text (BOM dropped; UTF-16 with a BOM too). Not UTF-8: a file with some valid
    multi-byte UTF-8 keeps it and its invalid bytes become U+FFFD, one with none is read as
    Windows-1252 / Latin-1; either way with a warning. A file with NUL bytes in its first 8000
    bytes is binary: skipped with an error."""
    doc = Document(name=name, kind=kind)
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        doc.text = data.decode("utf-16", errors="replace")
        _check_garbled(doc)
        return doc
    if b"\x00" in data[:8000]:  # git's test for binary files
        doc.error = f"{name}: looks like a binary file, not text or PDF; skipped"
        return doc
    try:
        doc.text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        as_utf8 = data.decode("utf-8", errors="replace")
        if any(ord(c) > 127 and c != "\ufffd" for c in as_utf8):
            # some valid multi-byte UTF-8: a UTF-8 file with stray bytes
            doc.text = as_utf8
            bad = doc.text.count("\ufffd")
            doc.warnings.append(f"{name}: not valid UTF-8; {bad} undecodable byte sequence(s) replaced by U+FFFD")
        else:
            # no valid multi-byte sequence at all: a single-byte legacy encoding, most often
            # Windows-1252 / Latin-1 (latin-1 maps the five bytes cp1252 leaves undefined)
            try:
                doc.text, codec = data.decode("cp1252"), "Windows-1252"
            except UnicodeDecodeError:
                doc.text, codec = data.decode("latin-1"), "Latin-1"
            doc.warnings.append(f"{name}: not UTF-8; read as {codec} (re-save it as UTF-8 if letters look wrong)")
    _check_garbled(doc)
    if not doc.text.strip():
        doc.warnings.append(f"{name}: empty")
    return doc


def read_pdf(
    source: str | BinaryIO, name: str, password: str | None, page_timeout: float, kind: str = "pdf"
) -> Document:
    """Extract a PDF's text page by page. See the module docstring for the cases handled."""
    doc = Document(name=name, kind=kind)
    with _PypdfLog() as log:
        _read_pdf_pages(doc, source, name, password, page_timeout)
    repaired = [m for m in log.messages if any(w in m.lower() for w in ("xref", "startxref", "trailer", "eof marker"))]
    if repaired and doc.error is None:
        doc.warnings.append(
            f"{name}: damaged cross-reference table or trailer ({repaired[0]}); recovered by tolerant parsing"
        )
    _check_garbled(doc)
    return doc


def _is_pdf(head: bytes) -> bool:
    """Whether a file or stream whose first bytes are ``head`` is a PDF: ``%PDF-`` in its first
    KiB (readers accept junk before the header), the one test for files and stdin alike."""
    return b"%PDF-" in head[:1024]


def pdf_problem(head: bytes, tail: bytes) -> str | None:
    """What is structurally wrong with a file given as PDF, from its first and last KiB:
    ``"not-pdf"`` (no ``%PDF-`` header), ``"truncated"`` (neither ``startxref`` nor ``%%EOF``
    near the end: an incomplete download or copy), or ``None`` (looks whole; damage, if any, is
    inside)."""
    if not _is_pdf(head):
        return "not-pdf"
    if b"%%EOF" not in tail and b"startxref" not in tail:
        return "truncated"
    return None


def _what_it_is(head: bytes) -> str:
    """A few words on a non-PDF file's content, for the error message."""
    start = head.lstrip()[:64].lower()
    if not head:
        return "the file is empty"
    if start.startswith((b"<!doctype html", b"<html")) or b"<html" in head.lower():
        return "it is an HTML page, perhaps a failed or redirected download"
    if b"\x00" in head:
        return "it is some other binary format"
    return "it looks like text"


def _parse_failure(name: str, problem: str | None, head: bytes, detail: str) -> str:
    if problem == "not-pdf":
        return f"{name}: not a PDF file (no %PDF- header; {_what_it_is(head)}); skipped"
    if problem == "truncated":
        return (f"{name}: truncated PDF (no startxref / %%EOF at the end: an incomplete download or copy); "
                f"re-download it; skipped [{detail}]")
    return (f"{name}: damaged PDF (cross-reference table or objects unreadable: {detail}); repair it with "
            f"`qpdf {name} repaired.pdf` (qpdf rebuilds the table) or re-download it; skipped")


def _needs_crypto(name: str, exc: Exception) -> str:
    return (f"{name}: encrypted with AES, which needs the cryptography package (a dependency of fp: "
            f"pip install cryptography) [{_one_line(exc)}]; skipped")


def _head_tail(source) -> tuple[bytes, bytes]:
    """First and last KiB of a path or seekable binary stream (the position is restored)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            head = f.read(1024)
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 1024))
            return head, f.read()
    pos = source.tell()
    head = source.read(1024)
    source.seek(0, os.SEEK_END)
    source.seek(max(0, source.tell() - 1024))
    tail = source.read()
    source.seek(pos)
    return head, tail


def _read_pdf_pages(doc: Document, source, name: str, password: str | None, page_timeout: float) -> None:
    from pypdf import PdfReader
    from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

    try:
        head, tail = _head_tail(source)
    except OSError as exc:
        doc.error = f"{name}: cannot read: {exc.strerror or exc}"
        return
    problem = pdf_problem(head, tail)
    if problem == "not-pdf":  # pypdf's "Stream has ended unexpectedly" would say nothing useful
        doc.error = _parse_failure(name, problem, head, "")
        return
    try:
        reader = PdfReader(source, strict=False)
    except DependencyError as exc:  # AES without the cryptography package: not damage
        doc.error = _needs_crypto(name, exc)
        return
    except Exception as exc:  # pypdf raises a wide range on damaged files (PdfReadError, ValueError, KeyError ...)
        doc.error = _parse_failure(name, problem, head, f"{type(exc).__name__}: {_one_line(exc)}")
        return

    if reader.is_encrypted:
        try:
            if reader.decrypt(""):
                doc.notes.append(f"{name}: encrypted with an empty password; decrypted")
            elif password is None:
                doc.error = f"{name}: the PDF is password-protected; pass its password with --password"
                return
            elif not reader.decrypt(password):
                doc.error = f"{name}: wrong password given with --password"
                return
        except DependencyError as exc:
            doc.error = _needs_crypto(name, exc)
            return
        except Exception as exc:
            doc.error = f"{name}: cannot decrypt the PDF ({_one_line(exc)}); skipped"
            return

    try:
        pages = list(reader.pages)
    except FileNotDecryptedError as exc:
        doc.error = f"{name}: cannot read the page tree ({_one_line(exc)}); skipped"
        return
    except PdfReadError as exc:
        doc.error = _parse_failure(name, problem, head, f"page tree: {_one_line(exc)}")
        return
    except Exception as exc:
        doc.error = _parse_failure(name, problem, head, f"page tree: {type(exc).__name__}: {_one_line(exc)}")
        return
    doc.pages = len(pages)

    parts: list[str] = []
    offset = 0
    timeouts = 0
    for number, page in enumerate(pages, start=1):
        status, value = _extract_with_timeout(page, page_timeout)
        if status == "timeout":
            timeouts += 1
            doc.skipped_pages.append(number)
            doc.warnings.append(f"{name}: page {number}: text extraction took over {page_timeout:g} s; page skipped")
            if timeouts >= MAX_PAGE_TIMEOUTS and number < len(pages):
                rest = list(range(number + 1, len(pages) + 1))
                doc.skipped_pages.extend(rest)
                doc.warnings.append(
                    f"{name}: {timeouts} pages timed out; skipped the remaining pages {_ranges(rest)}"
                )
                break
            continue
        if status == "error":
            doc.skipped_pages.append(number)
            doc.warnings.append(f"{name}: page {number}: text extraction failed ({value}); page skipped")
            continue
        text = value.strip()
        if not text:
            doc.empty_pages.append(number)
            continue
        if parts:
            offset += 2  # the "\n\n" joining pages
        doc.page_starts.append((number, offset))
        parts.append(text)
        offset += len(text)
    doc.text = "\n\n".join(parts)

    if doc.empty_pages:
        if len(doc.empty_pages) == doc.pages:
            doc.warnings.append(
                f"{name}: no text layer on any page (a scanned document?); fp does no OCR: run it through "
                "an OCR tool (e.g. ocrmypdf) first"
            )
        else:
            doc.warnings.append(
                f"{name}: page(s) {_ranges(doc.empty_pages)} have no text layer (scanned images?); "
                "fp does no OCR, their content is missing (run the file through ocrmypdf first)"
            )
    # the garbled-text check runs once, in read_pdf


def extract_page_text(page) -> str:
    """Text of one pypdf page. A module-level function so tests can make it hang or raise."""
    return page.extract_text() or ""


def _extract_with_timeout(page, timeout: float) -> tuple[str, str]:
    """``("ok", text)``, ``("error", message)`` or ``("timeout", "")``.

    Runs in a daemon thread: a hung extraction cannot be killed, but it is abandoned and never
    keeps the process alive.
    """
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["text"] = extract_page_text(page)
        except BaseException as exc:  # noqa: BLE001 - anything a broken page throws
            box["error"] = f"{type(exc).__name__}: {_one_line(exc)}"

    worker = threading.Thread(target=work, name="fp-page-extract", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return "timeout", ""
    if "error" in box:
        return "error", str(box["error"])
    return "ok", str(box.get("text", ""))


class _PypdfLog(logging.Handler):
    """Collects pypdf's log warnings (e.g. a repaired xref) instead of printing them."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []
        self._logger = logging.getLogger("pypdf")

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().strip())

    def __enter__(self) -> "_PypdfLog":
        self._propagate = self._logger.propagate
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate


def garbled_fraction(text: str) -> float:
    """Share of U+FFFD and private-use characters among the non-whitespace characters."""
    total = bad = 0
    for ch in text:
        if ch.isspace():
            continue
        total += 1
        o = ord(ch)
        if o == 0xFFFD or 0xE000 <= o <= 0xF8FF or o >= 0xF0000:
            bad += 1
    return bad / total if total else 0.0


def _check_garbled(doc: Document) -> None:
    frac = garbled_fraction(doc.text)
    if frac >= GARBLED_FRACTION and len(doc.text.strip()) >= 20:
        doc.warnings.append(
            f"{doc.name}: the text looks garbled ({frac:.0%} replacement or private-use characters; "
            "the PDF's fonts may lack a Unicode map); answers may be wrong"
        )


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out = []
    start = prev = None
    for n in numbers:
        if start is None:
            start = prev = n
        elif n == prev + 1:
            prev = n
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = n
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
