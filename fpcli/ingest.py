"""Document ingestion: PDF (PDFium through pypdfium2), HTML (visible text, ``fpcli.htmltext``),
text and Markdown files, and standard input.

PDF text comes from PDFium: it keeps apart the words that TeX places one by one without space
characters (pypdf was seen to glue them on real TeX-made manuals), and it is 9-19x faster than
pypdf (measurements: docs/ingest.md). pypdf reads the rest of a batch only while PDFium is held
by a page whose extraction timed out (PDFium is not thread-safe).

Every input yields one ``Document``; a problem with one file or page is recorded on that
``Document`` (``error``, ``warnings``, ``skipped_pages``) and the rest of the batch goes on.
The same file given twice is read once. The cases handled, each with a test in
``tests/test_ingest.py``:

- encrypted PDF (RC4 or AES) with an empty user password: decrypted, said in ``notes``;
- encrypted PDF with a real password: ``error`` names the file and ``--password``
  (a wrong ``--password`` is said to be wrong);
- a page whose extraction hangs or raises: a per-page time limit (``page_timeout``; a file's
  pages are extracted in order by one daemon worker thread, ``_PageWorker``), the page is
  skipped and its number reported;
- pages with images and no text layer (scans): reported; ``fp`` does no OCR. Blank pages are not;
- a broken cross-reference table or trailer: PDFium's tolerant parser rebuilds it (a note); a
  repeated ``%%EOF`` or bytes after it are harmless and say nothing; a file that still cannot be
  opened is skipped with an ``error`` that says why (``pdf_problem``): not a PDF at all (no
  ``%PDF-`` header), truncated (no ``startxref`` / ``%%EOF`` at the end: re-download it), or
  damaged (repair it with ``qpdf in.pdf out.pdf``, or re-download it);
- text that is mostly U+FFFD or private-use characters: a "looks garbled" warning;
- accented letters that TeX draws as two glyphs ("Br¨oker"): composed ("Bröker", with a
  note), only in a PDF whose Producer or Creator names TeX (``tex_maker``), never a URL's tilde;
- PDF pages whose words still run together (``is_glued``): a warning naming the pages;
- text files that are not valid UTF-8: decoded with replacement characters and a warning;
- a missing runtime dependency (pypdfium2, pypdf): ``error`` names the package and the install
  command.

Paths are checked up front by ``check_paths`` so the CLI can exit with code 2 naming every bad
path before it loads a model.
"""
from __future__ import annotations

import io
import os
import queue
import re
import sys
import threading
import time
import unicodedata
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable

from fpcli.htmltext import html_to_text, is_html_name, looks_like_html

if TYPE_CHECKING:
    from fpcli.doccache import DiskCache

STDIN = "-"
PAGE_TIMEOUT_S = 20.0  # per-page extraction limit
MAX_PAGE_TIMEOUTS = 3  # after this many timed-out pages the rest of the file is skipped
GARBLED_FRACTION = 0.3  # share of U+FFFD / private-use among non-space characters
GLUED_RUN = 25  # letters in one run that count as words glued together (English/German words are shorter)
GLUED_SHARE = 0.3  # share of a page's letters in such runs that makes the page "glued": German prose with a
# 25+ letter compound every 25 words reaches 22%; a page with every fourth line glued 31%, a glued page ~100%
GLUED_MIN_RUNS = 3  # ... and at least this many runs on the page (one long URL or compound is not glue)
# letters of the scripts that separate words with spaces (Latin, Greek, Cyrillic); CJK, Thai etc. do not
_SPACED_LETTERS = re.compile(r"[A-Za-z\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u024F\u0370-\u03FF\u0400-\u04FF\u1E00-\u1EFF]+")


@dataclass
class Document:
    """The text of one input and what happened while reading it.

    Attributes:
        name: the path as the user gave it (``-`` for standard input).
        kind: ``pdf``, ``html`` (visible text only), ``text`` or ``stdin-pdf`` / ``stdin-html`` /
            ``stdin-text`` (standard input: a PDF by its header, HTML by ``htmltext.looks_like_html``).
        text: extracted text; pages joined by blank lines (empty when ``error`` is set).
        pages: page count (PDF only).
        page_starts: character offset in ``text`` where each extracted page begins, as
            ``(page_number, offset)`` pairs, 1-based page numbers (PDF only).
        skipped_pages: 1-based pages skipped because extraction failed or timed out.
        empty_pages: 1-based pages with no text (blank pages and scanned ones).
        scanned_pages: the ``empty_pages`` that draw images: scans without a text layer (no OCR
            is done); only these are warned about, a blank page is not.
        glued_pages: 1-based pages whose text shows words run together (``is_glued``).
        notes: one line each: facts worth knowing that are not problems (e.g. decrypted).
        warnings: one line each, for the user: the text may be incomplete or wrong.
        error: why the file was skipped, or ``None`` (the reason only: the CLI prints it after
            "fp: warning: skipped ").
        from_cache: the text came from fp's document cache (``fpcli.doccache``), not a new read.
        password_protected: a PDF that opens only with a user password (whether or not the one
            given opened it); ``ingest`` says when ``--password`` was given and no input needed it.
    """

    name: str
    kind: str
    text: str = ""
    pages: int | None = None
    page_starts: list[tuple[int, int]] = field(default_factory=list)
    skipped_pages: list[int] = field(default_factory=list)
    empty_pages: list[int] = field(default_factory=list)
    scanned_pages: list[int] = field(default_factory=list)
    glued_pages: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: str | None = None
    from_cache: bool = False
    password_protected: bool = False

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


UNUSED_PASSWORD_NOTE = "--password was given, but no input is password-protected: it was not used"


def ingest(
    paths: list[str],
    password: str | None = None,
    page_timeout: float = PAGE_TIMEOUT_S,
    stdin: BinaryIO | None = None,
    on_file: Callable[[str], None] | None = None,
    cache: "DiskCache | None" = None,
) -> list[Document]:
    """Read every input; never raises for a bad document (see ``Document.error``).

    Returns one ``Document`` per distinct input, in order of first appearance: a file given twice
    (or by two paths) is read once, with a note, so the documents and the prompt's per-document
    token counts (keyed by name) stay one-to-one.

    Args:
        paths: file paths; ``-`` reads standard input (PDF if ``%PDF-`` is in its first KiB, as for files).
        password: user password for encrypted PDFs (the same for all of them). When no input
            needs one, the first document's ``notes`` say it was not used.
        page_timeout: seconds allowed to extract one PDF page.
        stdin: binary stream to use for ``-`` (default ``sys.stdin.buffer``).
        on_file: called with each name before it is read (progress display).
        cache: the document cache (``fpcli.doccache``, kind ``documents``): a file read before
            with the same bytes is taken from it (``Document.from_cache``, with a note);
            ``None`` reads every file.
    """
    docs = []
    seen: dict[tuple[int, int] | str, Document] = {}
    for p in paths:
        key = _file_key(p)
        if key in seen:  # the same file again (maybe by another path): read once, said once
            first = seen[key]
            again = f"{p}: the same file as {first.name}" if p != first.name else f"{p}: given more than once"
            first.notes.append(f"{again}; read once")
            continue
        if on_file:
            on_file(p)
        doc = ingest_one(p, password=password, page_timeout=page_timeout, stdin=stdin, cache=cache)
        seen[key] = doc
        if doc.ok and not doc.text.strip() and not doc.warnings:  # say why a file adds nothing
            doc.warnings.append(f"{STDIN_NAME if p == STDIN else p}: no text extracted")
        docs.append(doc)
    if password is not None and docs and not any(d.password_protected for d in docs):
        docs[0].notes.append(UNUSED_PASSWORD_NOTE)
    return docs


def _file_key(path: str) -> tuple[int, int] | str:
    """Identity of an input: (device, inode) of a file, so two paths to one file match; the path
    itself where it cannot be stat'ed (the error comes when it is read)."""
    if path == STDIN:
        return path
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return path
    return (st.st_dev, st.st_ino)


def ingest_one(
    path: str, password: str | None = None, page_timeout: float = PAGE_TIMEOUT_S, stdin: BinaryIO | None = None,
    cache: "DiskCache | None" = None,
) -> Document:
    """Read one input. See ``ingest``."""
    try:
        if path == STDIN:
            stream = stdin if stdin is not None else getattr(sys.stdin, "buffer", None)
            data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
            if isinstance(data, str):
                data = data.encode("utf-8")
            if _is_pdf(data):
                return _name_stdin(read_pdf(io.BytesIO(data), STDIN, password, page_timeout, kind="stdin-pdf"))
            if looks_like_html(data):  # a page piped in (curl URL | fp ask - ...): its visible text
                return _name_stdin(read_text_bytes(data, STDIN, kind="stdin-html", convert=html_to_text))
            return _name_stdin(read_text_bytes(data, STDIN, kind="stdin-text"))
        if cache is not None:
            return _read_cached(path, Path(path).read_bytes(), password, page_timeout, cache)
        with open(path, "rb") as f:
            head = f.read(1024)
        if _is_pdf(head) or path.lower().endswith(".pdf"):
            return read_pdf(path, path, password, page_timeout)
        if is_html_name(path):
            return read_html_bytes(Path(path).read_bytes(), path)
        return read_text_bytes(Path(path).read_bytes(), path)
    except OSError as exc:
        return Document(name=path, kind="unknown", error=f"{path}: cannot read: {exc.strerror or exc}")


STDIN_NAME = "standard input"  # what messages call ``-``


def _name_stdin(doc: Document) -> Document:
    """``doc`` (read from ``-``) with its notes, warnings and error naming "standard input", not "-"."""
    def named(m: str) -> str:
        return STDIN_NAME + m[len(STDIN):] if m.startswith(STDIN + ":") else m

    doc.notes = [named(m) for m in doc.notes]
    doc.warnings = [named(m) for m in doc.warnings]
    doc.error = named(doc.error) if doc.error else doc.error
    return doc


_CACHED_FIELDS = ("kind", "text", "pages", "page_starts", "skipped_pages", "empty_pages", "scanned_pages",
                  "glued_pages", "notes", "warnings")


def _read_cached(path: str, data: bytes, password: str | None, page_timeout: float, cache: "DiskCache") -> Document:
    """Read a file's ``data`` through the document cache (see ``fpcli.doccache`` for what is
    cached and the key). Notes and warnings are stored without the file's name, so a hit under
    another path names that path."""
    import hashlib

    from fpcli import __version__
    from fpcli.doccache import digest

    pdf = _is_pdf(data[:1024]) or path.lower().endswith(".pdf")
    html = not pdf and is_html_name(path)
    if pdf and password is not None:  # protected text never goes to disk
        return read_pdf(io.BytesIO(data), path, password, page_timeout)
    key = digest("document", hashlib.sha256(data).hexdigest(), __version__,
                 _extractor("pdf" if pdf else "html" if html else "text"))
    entry = cache.get(key)
    if entry is not None:
        try:
            doc = Document(name=path, **{f: entry[f] for f in _CACHED_FIELDS}, from_cache=True)
            doc.page_starts = [(int(n), int(o)) for n, o in doc.page_starts]
            doc.notes = [_named(path, m) for m in doc.notes] + [f"{path}: text from fp's document cache"]
            doc.warnings = [_named(path, m) for m in doc.warnings]
            return doc
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry: read again, and the store below replaces it
    if pdf:
        doc = read_pdf(io.BytesIO(data), path, None, page_timeout)
    else:
        doc = read_html_bytes(data, path) if html else read_text_bytes(data, path)
    if doc.ok and not doc.skipped_pages and doc.text.strip():  # an empty file is not worth a cache note
        value = {f: getattr(doc, f) for f in _CACHED_FIELDS}
        value["notes"] = [_unnamed(path, m) for m in doc.notes]
        value["warnings"] = [_unnamed(path, m) for m in doc.warnings]
        cache.put(key, value)
    return doc


def _extractor(kind: str) -> str:
    """What reads a file of ``kind`` (``pdf``, ``html`` or ``text``), with versions: part of a
    document cache key."""
    if kind == "html":
        return "html: html.parser, fpcli.htmltext"
    if kind != "pdf":
        return "text"
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("pypdfium2", "pypdf"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"{package} absent")
    # the accent rule (and its note, cached) is part of the key: a text cached under an older rule is read again
    return ("pdf: " + ", ".join(found) + ", TeX accents joined in TeX-made PDFs, never a URL's tilde"
            + ", the note names the first")


_NAME = "\0name"  # stands for the file's name in cached notes and warnings


def _unnamed(name: str, message: str) -> str:
    return _NAME + message[len(name):] if message.startswith(name + ":") else message


def _named(name: str, message: str) -> str:
    return name + message[len(_NAME):] if message.startswith(_NAME) else message


def read_html_bytes(data: bytes, name: str) -> Document:
    """An HTML page (kind ``html``): decoded as ``read_text_bytes`` decodes text, then reduced to
    its visible text by ``fpcli.htmltext.html_to_text`` (no markup, scripts or styles)."""
    return read_text_bytes(data, name, kind="html", convert=html_to_text)


def read_text_bytes(data: bytes, name: str, kind: str = "text", convert: Callable[[str], str] | None = None) -> Document:
    """UTF-8 text (BOM dropped; UTF-16 with a BOM too). Not UTF-8: a file with some valid
    multi-byte UTF-8 keeps it and its invalid bytes become U+FFFD, one with none is read as
    Windows-1252 / Latin-1; either way with a warning. A file with NUL bytes in its first 8000
    bytes is binary: skipped with an error. ``convert``, if given, maps the decoded text to the
    text kept (e.g. HTML to its visible text) before the checks for garbled or empty text."""
    doc = Document(name=name, kind=kind)
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        doc.text = data.decode("utf-16", errors="replace")
        if convert is not None:
            doc.text = convert(doc.text)
        _check_garbled(doc)
        return doc
    if b"\x00" in data[:8000]:  # git's test for binary files
        doc.error = f"{name}: looks like a binary file, not text or PDF"
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
    if convert is not None:
        doc.text = convert(doc.text)
    _check_garbled(doc)
    if not doc.text.strip():
        doc.warnings.append(f"{name}: empty")
    return doc


def read_pdf(
    source: str | BinaryIO, name: str, password: str | None, page_timeout: float, kind: str = "pdf"
) -> Document:
    """Extract a PDF's text page by page. See the module docstring for the cases handled."""
    doc = Document(name=name, kind=kind)
    _read_pdf_pages(doc, source, name, password, page_timeout)
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
    inside). A repeated ``%%EOF`` or bytes after it are harmless and not a problem."""
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
    """``Document.error`` for a file that cannot be opened as a PDF (the CLI prefixes "skipped: ")."""
    if problem == "not-pdf":
        return f"{name}: not a PDF file (no %PDF- header; {_what_it_is(head)})"
    if problem == "truncated":
        return (f"{name}: truncated PDF (no startxref / %%EOF at the end: an incomplete download or copy); "
                f"re-download it [{detail}]")
    return (f"{name}: damaged PDF (cross-reference table or objects unreadable: {detail}); repair it with "
            f"`qpdf {name} repaired.pdf` (qpdf rebuilds the table) or re-download it")


def missing_package(name: str, package: str, install: str) -> str:
    """``Document.error`` when a runtime dependency of fp is not installed: one line naming the
    package and the command that installs it."""
    return f"{name}: reading it needs the Python package {package}, which is not installed (a dependency of fp): {install}"


def _needs_crypto(name: str, exc: Exception) -> str:
    return (f"{name}: encrypted with AES, which needs the cryptography package (a dependency of fp: "
            f"pip install cryptography) [{_one_line(exc)}]")


def _read_all(source) -> tuple[bytes, bytes, bytes]:
    """The whole content of a path or seekable binary stream, its first and its last KiB."""
    if isinstance(source, (str, os.PathLike)):
        data = Path(source).read_bytes()
    else:
        pos = source.tell()
        data = source.read()
        source.seek(pos)
    return data, data[:1024], data[-1024:]


# -- PDFium (pypdfium2): text, encryption, repair --------------------------------------------------
# PDFium is not thread-safe: no two PDFium calls may run at once in a process, even on different
# documents. Every call below holds this lock, taken without waiting. A page whose extraction timed
# out keeps it while it runs on; the pages and files after it are then read with pypdf instead
# (``_PypdfPage``), as is a file read while another thread holds it.
_PDFIUM_LOCK = threading.Lock()
# Documents whose page timed out: kept referenced for the life of the process, so that their
# finalizer (which calls PDFium without the lock) never runs while PDFium is in use elsewhere.
_ABANDONED_PDFS: list = []


class PdfiumBusy(RuntimeError):
    """PDFium is still running an abandoned (timed-out) page extraction."""


class _PdfiumPage:
    """One page of an open PDFium document, for ``extract_page_text``."""

    def __init__(self, pdf, index: int) -> None:
        self.pdf, self.index, self.has_images = pdf, index, False

    def text(self) -> str:
        if not _PDFIUM_LOCK.acquire(blocking=False):
            raise PdfiumBusy("PDFium is busy with a timed-out page")
        try:
            text, self.has_images = _pdfium_page_text(self.pdf, self.index)
            return text
        finally:
            _PDFIUM_LOCK.release()


def _pdfium_page_text(pdf, index: int) -> tuple[str, bool]:
    """Text of page ``index`` (0-based) and whether a page without text draws any image (caller
    holds the lock; a page with text reports ``False``: only empty pages are checked for scans)."""
    import pypdfium2.raw as pdfium_c

    page = pdf[index]
    try:
        textpage = page.get_textpage()
        try:
            text = pdfium_plain_text(textpage.get_text_bounded())
        finally:
            textpage.close()
        if text.strip():  # images matter only on a page without text (a scan); the walk over the
            return text, False  # page's objects costs more than its text on a dense page
        has_images = next(iter(page.get_objects(filter=[pdfium_c.FPDF_PAGEOBJ_IMAGE])), None) is not None
        return text, has_images
    finally:
        page.close()


# TeX draws an accented letter as two glyphs, the spacing accent, then the letter under it, which
# text extraction gives as "Br¨oker": each spacing accent (never an ASCII one: ^ ~ ` are code and
# markup far more often) and the combining mark it stands for. Joined only in a PDF made by TeX
# (``tex_maker``): elsewhere a spacing accent before a letter is no accent ("Peter´s", "rock´n´roll").
_SPACING_ACCENTS = {
    "\u00a8": "\u0308",  # ¨ diaeresis
    "\u00b4": "\u0301",  # ´ acute
    "\u02cb": "\u0300",  # ˋ grave (the modifier letter; the ASCII ` is left alone)
    "\u02c6": "\u0302",  # ˆ circumflex
    "\u02dc": "\u0303",  # ˜ tilde
    "\u00b8": "\u0327",  # ¸ cedilla
    "\u02d8": "\u0306",  # ˘ breve
    "\u02c7": "\u030c",  # ˇ caron
    "\u02dd": "\u030b",  # ˝ double acute
    "\u02da": "\u030a",  # ˚ ring above
    "\u00af": "\u0304",  # ¯ macron
    "\u02d9": "\u0307",  # ˙ dot above
}
_ACCENT_LETTER = re.compile(f"([{''.join(_SPACING_ACCENTS)}])([^\\W\\d_])")
_EXAMPLE_CHARS = 12  # the note's example word is cut to this many characters either side of the accent
_DOTLESS = {"\u0131": "i", "\u0237": "j"}  # TeX's \\i and \\j carry an accent above: í, not ı + ´
# the tilde TeX draws for \~{} in a URL ("edu/˜alice"): after "/", "~", "." (or "˜"), or starting a
# path segment broken onto the next line ("edu/" + line end + "˜alice"): never a letter's accent
_URL_TILDE_BEFORE = re.compile(r"(?:[/~.\u02dc]|/[ \t]*\n\s*)$")
# a TeX engine or driver in the PDF's Producer / Creator: a word ending in "TeX" (TeX, LaTeX, pdfTeX,
# LuaTeX, XeTeX, MiKTeX: not TeXmacs, not "tex" in a file name), or a driver (dvipdfm(x), xdvipdfmx, dvips)
_TEX_MAKER = re.compile(r"(?<![A-Za-z])[A-Za-z]{0,6}TeX(?![A-Za-z])"
                        r"|(?i:(?<![a-z])(?:pdftex|luatex|luahbtex|xetex|x?dvipdfmx?|dvips)(?![a-z]))")


def tex_maker(info: dict) -> str | None:
    """The TeX engine or driver that made a PDF, from its document information ``info`` (keys
    ``Producer`` and ``Creator``, values ``str``; other keys and non-string values are ignored), or
    ``None`` when neither names one. "pdfTeX-1.40.25", "LaTeX with hyperref", "xdvipdfmx (20220710)",
    "dvips(k) 2021.1" are TeX; "Microsoft® Word for Microsoft 365", "ReportLab PDF Library" are not.
    The one place that decides whether a PDF's spacing accents are TeX's (``join_tex_accents``)."""
    for key in ("Producer", "Creator"):
        value = info.get(key)
        if isinstance(value, str) and _TEX_MAKER.search(value):
            return value.strip()
    return None


def join_tex_accents(text: str) -> str:
    """``text`` (a page of a PDF made by TeX: ``tex_maker``) with each spacing accent that directly
    precedes a letter composed with it, as TeX places them ("Br¨oker" -> "Bröker", "J´erˆome" ->
    "Jérôme"; a dotless i or j under an accent above becomes i or j: "Mikul´ık" -> "Mikulík").
    The pair is kept as it is when Unicode has no single character for it (NFC); so are an accent
    not before a letter ("the ¨ sign"), a tilde in a URL (after "/", "~" or ".", or at the start of
    a path segment broken onto the next line: "edu/˜alice"), and the ASCII circumflex, tilde and
    backquote."""
    return _join_tex_accents(text)[0]


def _join_tex_accents(text: str) -> tuple[str, int, tuple[str, str] | None]:
    """``join_tex_accents(text)``, the number of accents it composed, and the first word it changed,
    before and after (``("Br¨oker", "Bröker")``; at most ``_EXAMPLE_CHARS`` letters either side of the
    pair), or
    ``None`` when it composed none."""
    joined = 0
    first: tuple[int, int] | None = None

    def compose(m: re.Match) -> str:
        nonlocal joined, first
        composed = _composed(m, text)
        if composed is None:
            return m.group(0)
        joined += 1
        first = first or m.span()
        return composed

    result = _ACCENT_LETTER.sub(compose, text)
    if first is None:
        return result, 0, None
    def in_word(i: int) -> bool:
        return text[i].isalpha() or text[i] in _SPACING_ACCENTS

    start, end = first  # the word around the first joined pair, at most _EXAMPLE_CHARS either side
    while start > max(0, first[0] - _EXAMPLE_CHARS) and in_word(start - 1):
        start -= 1
    while end < min(len(text), first[1] + _EXAMPLE_CHARS) and in_word(end):
        end += 1
    before = text[start:end]
    after = _ACCENT_LETTER.sub(lambda m: _composed(m, before) or m.group(0), before)
    return result, joined, (before, after)


def _composed(m: re.Match, text: str) -> str | None:
    """The one character for ``_ACCENT_LETTER``'s match ``m`` in ``text`` (accent, then letter),
    or ``None`` where it stays as it is (a URL's tilde, no single character in Unicode)."""
    accent, letter = m.group(1), m.group(2)
    if accent == "\u02dc" and _URL_TILDE_BEFORE.search(text, max(0, m.start() - 80), m.start()):
        return None
    mark = _SPACING_ACCENTS[accent]
    base = _DOTLESS.get(letter, letter) if mark != "\u0327" else letter
    composed = unicodedata.normalize("NFC", base + mark)
    return composed if len(composed) == 1 else None


def pdfium_plain_text(text: str) -> str:
    """PDFium's page text as plain text: its ``\r\n`` line ends become ``\n``, and the ``\x02``
    it puts where a word was hyphenated across a line end (the line break already removed) is
    dropped, so the word is whole again ("extra\x02ordinary" -> "extraordinary")."""
    return text.replace("\r\n", "\n").replace("\r", "\n").replace("\x02", "")


class _PypdfPage:
    """One page of a pypdf reader, for ``extract_page_text`` (the fallback while PDFium is busy)."""

    def __init__(self, page) -> None:
        self.page, self.has_images = page, False

    def text(self) -> str:
        text = self.page.extract_text() or ""
        if not text.strip():
            xobjects = (self.page.get("/Resources") or {}).get("/XObject") or {}
            self.has_images = any(x.get_object().get("/Subtype") == "/Image" for x in xobjects.values())
        return text


def _open_pdfium(doc: Document, data: bytes, name: str, password: str | None, problem, head: bytes):
    """An open ``pypdfium2.PdfDocument`` (caller holds the lock), or ``None`` with ``doc.error`` set."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    pdf = opened_with = None
    for attempt in (None, password) if password is not None else (None,):
        try:
            pdf, opened_with = pdfium.PdfDocument(data, password=attempt), attempt
            break
        except pdfium.PdfiumError as exc:
            code = getattr(exc, "err_code", None)
            if code == pdfium_c.FPDF_ERR_PASSWORD:
                doc.password_protected = True
                if attempt is None and password is None:
                    doc.error = f"{name}: the PDF is password-protected; pass its password with --password"
                elif attempt is not None:
                    doc.error = f"{name}: wrong password given with --password"
                continue
            if code == pdfium_c.FPDF_ERR_SECURITY:
                doc.error = f"{name}: encrypted with a security handler PDFium does not support"
            else:
                doc.error = _parse_failure(name, problem, head, _one_line(exc))
            return None
    if pdf is None:
        return None
    doc.error = None
    if pdfium_c.FPDF_GetSecurityHandlerRevision(pdf) != -1 and opened_with is None:
        doc.notes.append(f"{name}: encrypted with an empty password; decrypted")
    if not pdfium_c.FPDF_DocumentHasValidCrossReferenceTable(pdf):
        doc.notes.append(f"{name}: damaged cross-reference table; rebuilt by PDFium's tolerant parser")
    return pdf


def _pdfium_info(pdf) -> dict:
    """The document information (``Producer``, ``Creator``, ...) of an open PDFium document (caller
    holds the lock); empty when it cannot be read (damaged metadata loses only the accent joining)."""
    try:
        return pdf.get_metadata_dict(skip_empty=True)
    except Exception:  # pypdfium2 raises PdfiumError or a decoding error on odd metadata
        return {}


def _pypdf_info(reader) -> dict:
    """The ``Producer`` and ``Creator`` of a pypdf reader's document information, as ``str``;
    empty when there is none or it cannot be read."""
    try:
        meta = reader.metadata
        found = {"Producer": meta.producer, "Creator": meta.creator} if meta is not None else {}
    except Exception:  # pypdf raises a wide range on damaged files
        return {}
    return {k: str(v) for k, v in found.items() if v}


def _open_pypdf(
    doc: Document, data: bytes, name: str, password: str | None, problem, head: bytes
) -> tuple[list, dict] | None:
    """Pages of a pypdf reader as ``_PypdfPage`` and its document information (``_pypdf_info``),
    or ``None`` with ``doc.error`` set."""
    try:
        from pypdf import PdfReader
        from pypdf.errors import DependencyError
    except ImportError:
        doc.error = missing_package(name, "pypdf", "pip install 'pypdf[crypto]'")
        return None
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and reader.decrypt(""):
            note = f"{name}: encrypted with an empty password; decrypted"
            doc.notes += [] if note in doc.notes else [note]
        elif reader.is_encrypted:
            doc.password_protected = True
            if password is None:
                doc.error = f"{name}: the PDF is password-protected; pass its password with --password"
                return None
            if not reader.decrypt(password):
                doc.error = f"{name}: wrong password given with --password"
                return None
        return [_PypdfPage(p) for p in reader.pages], _pypdf_info(reader)
    except DependencyError as exc:  # AES without the cryptography package: not damage
        doc.error = _needs_crypto(name, exc)
    except Exception as exc:  # pypdf raises a wide range on damaged files
        doc.error = _parse_failure(name, problem, head, f"{type(exc).__name__}: {_one_line(exc)}")
    return None


def _read_pdf_pages(doc: Document, source, name: str, password: str | None, page_timeout: float) -> None:
    try:
        data, head, tail = _read_all(source)
    except OSError as exc:
        doc.error = f"{name}: cannot read: {exc.strerror or exc}"
        return
    problem = pdf_problem(head, tail)
    if problem == "not-pdf":  # a parser's "format error" would say nothing useful
        doc.error = _parse_failure(name, problem, head, "")
        return
    try:
        import pypdfium2  # noqa: F401
    except ImportError:
        doc.error = missing_package(name, "pypdfium2", "pip install pypdfium2")
        return

    pdf = None
    if _PDFIUM_LOCK.acquire(blocking=False):
        try:
            pdf = _open_pdfium(doc, data, name, password, problem, head)
            if pdf is None:
                return
            pages: list = [_PdfiumPage(pdf, i) for i in range(len(pdf))]
            info = _pdfium_info(pdf)
        finally:
            _PDFIUM_LOCK.release()
    else:
        doc.warnings.append(f"{name}: PDFium is still busy with a timed-out page; read with pypdf instead "
                            "(slower, and words may run together)")
        opened = _open_pypdf(doc, data, name, password, problem, head)
        if opened is None:
            return
        pages, info = opened
    doc.pages = len(pages)
    tex = tex_maker(info)  # the spacing accents are TeX's only in a PDF TeX made
    accents = 0
    accent_example: tuple[str, str] | None = None  # the document's first joined word, before and after

    parts: list[str] = []
    offset = 0
    timeouts = 0
    glued: list[int] = []
    example = ""  # the longest glued run of the first glued page, quoted in the warning
    number = 0
    worker: _PageWorker | None = None  # extracts the pages from ``number`` on; a new one after a switch
    while number < len(pages):
        page = pages[number]
        if worker is None:
            worker = _PageWorker(pages, number)
        number += 1
        status, value = worker.result(number - 1, page_timeout)
        if status in ("busy", "timeout"):  # the pages after this one: another worker (a timed-out one is stuck)
            worker.close()
            worker = None
        if status == "busy" and isinstance(page, _PdfiumPage):
            fallback = _open_pypdf(doc, data, name, password, problem, head)
            if fallback is None:  # keep what was read; say what is missing
                why, doc.error = doc.error, None
                rest = list(range(number, len(pages) + 1))
                doc.skipped_pages.extend(rest)
                doc.warnings.append(f"{name}: PDFium is busy with a timed-out page and pypdf cannot read the "
                                    f"file ({why}); page(s) {_ranges(rest)} skipped")
                break
            doc.warnings.append(f"{name}: PDFium is still busy with a timed-out page; page(s) "
                                f"{_ranges(list(range(number, len(pages) + 1)))} read with pypdf instead "
                                "(words may run together)")
            pages[number - 1:] = fallback[0][number - 1:]
            number -= 1
            continue
        if status == "timeout":
            if isinstance(page, _PdfiumPage):
                _ABANDONED_PDFS.append(page.pdf)
            timeouts += 1
            doc.skipped_pages.append(number)
            doc.warnings.append(f"{name}: page {number}: text extraction took over {page_timeout:g} s; page skipped")
            if timeouts >= MAX_PAGE_TIMEOUTS and number < len(pages):
                rest = list(range(number + 1, len(pages) + 1))
                doc.skipped_pages.extend(rest)
                doc.warnings.append(
                    f"{name}: {timeouts} pages timed out; the remaining pages {_ranges(rest)} were not read"
                )
                break
            continue
        if status in ("error", "busy"):
            doc.skipped_pages.append(number)
            doc.warnings.append(f"{name}: page {number}: text extraction failed ({value}); page skipped")
            continue
        text = value.strip()
        if tex is not None:
            text, joined, found = _join_tex_accents(text)
            accents += joined
            accent_example = accent_example or found
        if not text:
            doc.empty_pages.append(number)
            if page.has_images:
                doc.scanned_pages.append(number)
            continue
        if is_glued(text):
            glued.append(number)
            example = example or max(glued_runs(text), key=len)
        if parts:
            offset += 2  # the "\n\n" joining pages
        doc.page_starts.append((number, offset))
        parts.append(text)
        offset += len(text)
    if worker is not None:  # the loop ended early (too many timeouts, no fallback): stop at the next page
        worker.close()
    doc.text = "\n\n".join(parts)
    doc.glued_pages = glued
    if accents:
        doc.notes.append(f"{name}: made by TeX ({tex[:60]}): {accents} accent(s) that TeX draws apart from "
                         f"their letter joined with it (first: {accent_example[0]} -> {accent_example[1]})")
    if pdf is not None and _PDFIUM_LOCK.acquire(blocking=False):  # else a timed-out page still uses it
        try:
            pdf.close()
        finally:
            _PDFIUM_LOCK.release()

    if doc.scanned_pages:
        if len(doc.scanned_pages) == doc.pages:
            doc.warnings.append(
                f"{name}: no text layer on any page, only images (a scanned document?); fp does no OCR: run it "
                "through an OCR tool (e.g. ocrmypdf) first"
            )
        else:
            doc.warnings.append(
                f"{name}: page(s) {_ranges(doc.scanned_pages)} have images but no text layer (scanned?); "
                "fp does no OCR, their content is missing (run the file through ocrmypdf first)"
            )
    if glued:
        doc.warnings.append(
            f"{name}: page(s) {_ranges(glued)}: words seem to run together (at least {GLUED_SHARE:.0%} of the "
            f"letters in runs of {GLUED_RUN}+ letters, e.g. {example[:40]!r}); where the PDF places words without "
            "spaces, answers may misquote these pages"
        )
    # the garbled-text check runs once, in read_pdf


def extract_page_text(page) -> str:
    """Text of one page (``page.text()``). A module-level function so tests can make it hang or raise."""
    return page.text()


def _extract(page) -> tuple[str, str]:
    """``("ok", text)``, ``("error", message)`` or ``("busy", message)`` (PDFium is held by an
    abandoned page) for one page; never raises."""
    try:
        return "ok", str(extract_page_text(page))
    except PdfiumBusy as exc:
        return "busy", str(exc)
    except BaseException as exc:  # noqa: BLE001 - anything a broken page throws
        return "error", f"{type(exc).__name__}: {_one_line(exc)}"


class _PageWorker:
    """Extracts ``pages[first:]`` in order on one daemon thread that runs ahead of the reader: a
    file costs one thread start, not one per page (a thread start and join per page cost ~0.1 s
    over a 234-page manual on a loaded 2-core CPU).

    ``result(i, timeout)`` gives page ``i``'s ``_extract`` outcome, or ``("timeout", "")`` when
    the worker spent over ``timeout`` seconds on it (counted from when it began that page). A
    hung extraction cannot be killed: the worker is then abandoned, a daemon that never keeps the
    process alive, and the reader starts another for the pages after it. ``close`` makes the
    worker stop before its next page. The worker holds its own copy of the page list, so a
    reader that replaces pages (the pypdf fallback) never has them read twice.
    """

    def __init__(self, pages: list, first: int) -> None:
        self._results: queue.Queue = queue.Queue()
        self._started: dict[int, float] = {}  # page index -> time.monotonic() when the worker began it
        self._closed = threading.Event()
        threading.Thread(target=self._run, args=(list(pages), first), name="fp-page-extract", daemon=True).start()

    def _run(self, pages: list, first: int) -> None:
        for index in range(first, len(pages)):
            if self._closed.is_set():
                return
            self._started[index] = time.monotonic()
            self._results.put((index, _extract(pages[index])))

    def result(self, index: int, timeout: float) -> tuple[str, str]:
        """The outcome of page ``index`` (0-based; asked in order, from ``first`` on)."""
        while True:
            started = self._started.get(index)
            left = timeout if started is None else started + timeout - time.monotonic()
            try:
                got, outcome = self._results.get(timeout=max(left, 0.0))
            except queue.Empty:
                started = self._started.get(index)  # begun after the wait did: its time is not up yet
                if started is not None and time.monotonic() < started + timeout:
                    continue
                return "timeout", ""
            if got == index:
                return outcome

    def close(self) -> None:
        self._closed.set()

_WHITESPACE = re.compile(r"\s+")  # str patterns: the characters str.isspace() accepts
_GARBLED = re.compile("[\ufffd\ue000-\uf8ff\U000f0000-\U0010ffff]")  # U+FFFD and private use


def garbled_fraction(text: str) -> float:
    """Share of U+FFFD and private-use characters among the non-whitespace characters."""
    total = len(_WHITESPACE.sub("", text))
    return len(_GARBLED.findall(text)) / total if total else 0.0


def glued_runs(text: str) -> list[str]:
    """Runs of ``GLUED_RUN`` or more letters (Latin, Greek, Cyrillic only) in ``text``: words that
    a PDF extractor joined because the PDF placed them without space characters, as TeX does.
    Digits, punctuation and other scripts (CJK, which uses no spaces) end a run."""
    return [m for m in _SPACED_LETTERS.findall(text) if len(m) >= GLUED_RUN]


def glued_share(text: str) -> float:
    """Share of the letters counted by ``glued_runs`` (Latin, Greek, Cyrillic) that lie in runs of
    ``GLUED_RUN`` or more; 0.0 when there are none. English prose has none; German prose with a
    long compound every 25 words reaches 0.22, under ``GLUED_SHARE``; glued pages are far above."""
    runs = _SPACED_LETTERS.findall(text)
    total = sum(map(len, runs))
    return sum(len(r) for r in runs if len(r) >= GLUED_RUN) / total if total else 0.0


def is_glued(text: str) -> bool:
    """Whether one page's text shows words glued together: at least ``GLUED_MIN_RUNS`` runs of
    ``GLUED_RUN``+ letters holding at least ``GLUED_SHARE`` of its letters."""
    return len(glued_runs(text)) >= GLUED_MIN_RUNS and glued_share(text) >= GLUED_SHARE


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
