"""The visible text of an HTML page, with the standard library's ``html.parser``.

What a reader sees, not the markup: the contents of ``script``, ``style``, ``template``,
``noscript``, ``head`` and ``svg`` are dropped; block elements (paragraphs, headings, list items,
table rows, ``br`` ...) end a line; table cells on one row are joined by a tab; character
references (``&amp;``, ``&#233;``) are decoded; runs of white space inside a line become one space,
as a browser renders them, except inside ``pre``.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser

HTML_SUFFIXES = (".html", ".htm", ".xhtml")

# elements whose content is never shown
_HIDDEN = frozenset({"script", "style", "template", "noscript", "head", "svg", "math", "iframe", "object"})
# elements that start and end a line of their own (HTML's block-level and table elements)
_BLOCK = frozenset({
    "address", "article", "aside", "blockquote", "body", "caption", "dd", "details", "dialog", "div", "dl",
    "dt", "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header",
    "hr", "html", "li", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "tbody", "tfoot",
    "thead", "tr", "ul",
})
_CELL = frozenset({"td", "th"})
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
                   "source", "track", "wbr"})
_SPACES = re.compile(r"[ \t\r\n\f\v]+")


class _VisibleText(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.lines: list[str] = []
        self.line: list[str] = []  # pieces of the line being built
        self.hidden = 0  # depth inside hidden elements
        self.pre = 0  # depth inside <pre>
        self.cells = 0  # cells seen on the current table row

    def _end_line(self) -> None:
        text = "".join(self.line)
        if not self.pre:
            text = text.strip()
        if text:
            self.lines.append(text)
        self.line = []
        self.cells = 0

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in _HIDDEN:
            if tag not in _VOID:
                self.hidden += 1
            return
        if self.hidden:
            return
        if tag in _BLOCK or tag == "br":
            self._end_line()
        if tag == "pre":
            self.pre += 1
        elif tag in _CELL:
            if self.cells:
                self.line.append("\t")
            self.cells += 1

    def handle_startendtag(self, tag: str, attrs) -> None:  # <br/>: no content, no end tag
        if tag not in _HIDDEN and not self.hidden and (tag in _BLOCK or tag == "br"):
            self._end_line()

    def handle_endtag(self, tag: str) -> None:
        if tag in _HIDDEN:
            self.hidden = max(0, self.hidden - 1)
            return
        if self.hidden:
            return
        if tag in _BLOCK:
            self._end_line()
        if tag == "pre":
            self.pre = max(0, self.pre - 1)

    def handle_data(self, data: str) -> None:
        if self.hidden:
            return
        if self.pre:
            lines = data.split("\n")
            self.line.append(lines[0])
            for more in lines[1:]:
                self.lines.append("".join(self.line))
                self.line = [more]
            return
        text = _SPACES.sub(" ", data)
        if self.line and self.line[-1].endswith((" ", "\t")) and text.startswith(" "):
            text = text[1:]
        if text:
            self.line.append(text)


def html_to_text(markup: str) -> str:
    """The visible text of HTML ``markup``: one line per block element, cells of a table row
    joined by tabs, hidden elements (scripts, styles, ``head``) dropped, entities decoded.
    Never raises on malformed markup (``html.parser`` is lenient): unclosed tags end with the input."""
    parser = _VisibleText()
    parser.feed(markup)
    parser.close()
    parser._end_line()
    return "\n".join(parser.lines)


def looks_like_html(data: bytes) -> bool:
    """Whether ``data`` (the start of a stream with no name, e.g. standard input) is an HTML page:
    after an optional BOM, whitespace, an XML declaration or comments, its first 1 KiB opens with
    ``<!DOCTYPE html`` or ``<html`` (any case).

    >>> looks_like_html(b"  <!doctype html><title>t</title>"), looks_like_html(b"a < b and <html> later")
    (True, False)
    """
    head = data[:1024].lstrip(b"\xef\xbb\xbf").lower()
    head = re.sub(rb"^(\s|<\?xml[^>]*\?>|<!--.*?-->)*", b"", head, flags=re.S)
    return head.startswith((b"<!doctype html", b"<html"))


def is_html_name(name: str) -> bool:
    """Whether a file name has an HTML suffix (``.html``, ``.htm``, ``.xhtml``; any case)."""
    return name.lower().endswith(HTML_SUFFIXES)
