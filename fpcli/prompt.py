"""Prompt building with a token budget.

The chat is a system message and one user message holding the documents, each delimited by its
file name, then the question last (so it sits in the dense tail of the prefill)::

    <document name="report.pdf">
    ...text...
    </document>

    Question: What was the revenue in 2023?

Budget: the prompt may use ``context_length - max_new_tokens`` tokens, template included. When the
documents do not fit, fp cuts the *longest* document(s) first ("water filling": every document
longer than a level L is cut down to L tokens, shorter ones are kept whole) and, by default, cuts
from the **middle** of each: the beginning (title, abstract, introduction) and the end
(conclusions, appendices) survive, and a marker line tells the model how much is missing
(``--cut end`` keeps the beginning only). Every cut is returned as a ``Cut`` record and shown to
the user; nothing is dropped silently.

Example: a 4,096-token context, 256 new tokens, 3,500 tokens available for document text, and
documents of 3,000, 1,000 and 200 tokens: the level is L = 2,300, so the first document keeps
2,300 tokens (1,150 from its start, 1,150 from its end), the other two are whole.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol, Sequence

SYSTEM_PROMPT = (
    "You answer questions about the documents the user gives you. Base your answer on the documents; "
    "if they do not contain the answer, say so. Be concise and quote exact figures and names."
)
MARKER = "[... {dropped} tokens of {name} omitted here by fp to fit the model's context ...]"
MARKER_TOKENS = 40  # allowance per cut document for the marker line
# Cuts leave room for a question of this many tokens (at most 1/32 of the budget) whatever the
# question is, so every question up to that length gets the same cut documents: the same token
# prefix, whose KV cache an engine reuses from one question to the next (fp chat, a resident engine).
QUESTION_ALLOWANCE = 256
CUT_MODES = ("middle", "end")


class PromptError(ValueError):
    """The prompt cannot fit the context at all (the question or template alone is too long)."""


class Tokenizing(Protocol):
    """The part of ``fpcli.engine.base.Engine`` that prompt building needs."""

    context_length: int

    def encode_chat(self, system: str | None, user: str) -> list[int]: ...

    def count_tokens(self, text: str) -> int: ...


class DocLike(Protocol):
    name: str
    text: str


@dataclass
class Cut:
    """What was removed from one document to fit the budget.

    Attributes:
        file: the document's name.
        tokens_total: its tokens before the cut.
        tokens_kept: tokens left (head + tail for ``middle``).
        tokens_dropped: ``tokens_total - tokens_kept``.
        where: ``middle``, ``end`` or ``all`` (the whole document was dropped).
        char_start, char_end: the dropped character range ``[char_start, char_end)`` of the text.
        first_page, last_page: pages of the dropped range (PDF only, else ``None``).
    """

    file: str
    tokens_total: int
    tokens_kept: int
    tokens_dropped: int
    where: str
    char_start: int
    char_end: int
    first_page: int | None = None
    last_page: int | None = None

    def describe(self) -> str:
        """One line for the user."""
        if self.where == "all":
            what = "dropped entirely"
        else:
            place = "from the middle" if self.where == "middle" else "from the end"
            what = f"dropped {self.tokens_dropped:,} of {self.tokens_total:,} tokens {place}"
        span = f"characters {self.char_start:,}-{self.char_end:,}"
        if self.first_page is not None:
            pages = f"page {self.first_page}" if self.first_page == self.last_page else f"pages {self.first_page}-{self.last_page}"
            span = f"{pages}, {span}"
        return f"{self.file}: {what} ({span})"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Prompt:
    """A chat prompt fitted to the budget.

    Attributes:
        system, user: the two messages.
        ids: token ids from the model's chat template (what the engine prefills).
        context_length, max_new_tokens: the budget's inputs; ``budget`` = their difference.
        doc_tokens: ``{name: tokens}`` of every document before any cut.
        cuts: one record per cut document (empty when everything fit).
        documents: the ``(name, text)`` pairs in the prompt, after cuts (reused by ``fp chat``
            for every question, so that the documents stay a shared token prefix).
    """

    system: str
    user: str
    ids: list[int]
    context_length: int
    max_new_tokens: int
    doc_tokens: dict[str, int] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)
    documents: list[tuple[str, str]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def budget(self) -> int:
        return self.context_length - self.max_new_tokens

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.tokens,
            "context_length": self.context_length,
            "max_new_tokens": self.max_new_tokens,
            "budget": self.budget,
            "doc_tokens": dict(self.doc_tokens),
            "truncated": bool(self.cuts),
            "cuts": [c.to_dict() for c in self.cuts],
        }


def format_user(docs: Sequence[tuple[str, str]], question: str, history: Sequence[tuple[str, str]] = ()) -> str:
    """The user message: each ``(name, text)`` delimited by its name, then the earlier
    ``(question, answer)`` turns of a chat, then the question. Nothing before the documents
    depends on the question, so prompts about the same documents share their token prefix."""
    parts = [f'<document name="{_attr(name)}">\n{text.strip()}\n</document>' for name, text in docs]
    parts += [f"Earlier question: {q.strip()}\nYour answer: {a.strip()}" for q, a in history]
    parts.append(f"Question: {question.strip()}")
    return "\n\n".join(parts)


def build_prompt(
    docs: Sequence[DocLike],
    question: str,
    engine: Tokenizing,
    max_new_tokens: int,
    context_length: int | None = None,
    system: str | None = SYSTEM_PROMPT,
    cut: str = "middle",
) -> Prompt:
    """Build the chat prompt and fit it to ``context_length - max_new_tokens`` tokens.

    Args:
        docs: documents with ``name`` and ``text`` (``fpcli.ingest.Document``; a ``page_of`` method
            lets cuts name pages). Documents with empty text are left out.
        question: the user's question, placed last.
        engine: provides ``encode_chat``, ``count_tokens`` and ``context_length``.
        max_new_tokens: tokens reserved for the answer.
        context_length: overrides ``engine.context_length`` when smaller (a profile's cap).
        cut: ``middle`` (keep beginning and end) or ``end`` (keep the beginning).

    Raises:
        PromptError: when even the question without any document does not fit.
    """
    if cut not in CUT_MODES:
        raise ValueError(f"cut must be one of {CUT_MODES}, got {cut!r}")
    ctx = min(engine.context_length, context_length) if context_length else engine.context_length
    budget = ctx - max_new_tokens
    if max_new_tokens < 1 or budget <= 0:
        raise PromptError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of {ctx} tokens"
        )
    docs = [d for d in docs if d.text.strip()]
    pairs = [(d.name, d.text) for d in docs]
    doc_tokens = {d.name: engine.count_tokens(d.text) for d in docs}

    def make(pairs_: Sequence[tuple[str, str]], cuts_: list[Cut]) -> Prompt:
        user = format_user(pairs_, question)
        return Prompt(system or "", user, engine.encode_chat(system, user), ctx, max_new_tokens, doc_tokens, cuts_,
                      list(pairs_))

    prompt = make(pairs, [])
    if prompt.tokens <= budget:
        return prompt

    overhead = len(engine.encode_chat(system, format_user([(n, "") for n, _ in pairs], question)))
    allowance = max(0, question_allowance(budget) - engine.count_tokens(question))
    if overhead + allowance <= budget:
        overhead += allowance
    if overhead > budget:
        raise PromptError(
            f"the question and chat template alone need {overhead} tokens, more than the {budget} available "
            f"(context {ctx} - {max_new_tokens} for the answer); shorten the question or lower --max-new-tokens"
        )
    sizes = [doc_tokens[d.name] for d in docs]
    available = budget - overhead - MARKER_TOKENS * len(docs)
    for _ in range(8):  # tokenization is not additive: shrink until the whole prompt fits
        targets = water_fill(sizes, max(0, available))
        new_pairs, cuts = [], []
        for d, n, k in zip(docs, sizes, targets):
            if k >= n:
                new_pairs.append((d.name, d.text))
                continue
            text, record = cut_text(d, n, k, engine, cut)
            new_pairs.append((d.name, text))
            cuts.append(record)
        prompt = make(new_pairs, cuts)
        excess = prompt.tokens - budget
        if excess <= 0:
            return prompt
        available -= excess + max(8, excess // 4)
    raise PromptError(f"could not fit the documents into {budget} tokens")  # pragma: no cover


def question_allowance(budget: int) -> int:
    """Tokens a cut leaves for the question whatever it is: ``min(QUESTION_ALLOWANCE, budget // 32)``."""
    return min(QUESTION_ALLOWANCE, max(0, budget) // 32)


def water_fill(sizes: Sequence[int], available: int) -> list[int]:
    """Per-document token targets: cap the longest first so the sum is at most ``available``.

    >>> water_fill([3000, 1000, 200], 3500)
    [2300, 1000, 200]
    """
    if sum(sizes) <= available:
        return list(sizes)
    order = sorted(sizes)
    remaining, left = available, len(order)
    level = 0
    for s in order:
        share = remaining // left
        if s <= share:
            remaining -= s
            left -= 1
        else:
            level = share
            break
    return [min(s, level) for s in sizes]


def cut_text(doc: DocLike, n_tokens: int, keep_tokens: int, engine: Tokenizing, mode: str = "middle") -> tuple[str, Cut]:
    """Cut ``doc.text`` (``n_tokens`` long) down to about ``keep_tokens`` tokens.

    Characters are cut in proportion to tokens, at whitespace, and the kept parts re-counted.
    Returns the new text (with a marker line where text was removed) and the ``Cut`` record.
    """
    text = doc.text
    if keep_tokens <= 0:
        marker = MARKER.format(dropped=f"{n_tokens:,}", name=doc.name)
        record = Cut(doc.name, n_tokens, 0, n_tokens, "all", 0, len(text), *_pages(doc, 0, len(text)))
        return marker, record
    keep_chars = int(len(text) * keep_tokens / n_tokens)
    if mode == "middle":
        head_end = _snap(text, keep_chars // 2)
        tail_start = _snap(text, len(text) - (keep_chars - head_end))
        tail_start = max(tail_start, head_end)
    else:
        head_end = _snap(text, keep_chars)
        tail_start = len(text)
    head, tail = text[:head_end], text[tail_start:]
    kept = engine.count_tokens(head) + (engine.count_tokens(tail) if tail else 0)
    kept = min(kept, n_tokens)
    marker = MARKER.format(dropped=f"{n_tokens - kept:,}", name=doc.name)
    new_text = f"{head.rstrip()}\n\n{marker}\n\n{tail.lstrip()}" if tail else f"{head.rstrip()}\n\n{marker}"
    record = Cut(doc.name, n_tokens, kept, n_tokens - kept, mode, head_end, tail_start, *_pages(doc, head_end, tail_start))
    return new_text, record


def _snap(text: str, i: int, reach: int = 200) -> int:
    """Move ``i`` back to just after the nearest newline or space within ``reach`` characters."""
    i = max(0, min(len(text), i))
    window = text[max(0, i - reach) : i]
    for sep in ("\n\n", "\n", " "):
        j = window.rfind(sep)
        if j >= 0:
            return i - len(window) + j + len(sep)
    return i


def _pages(doc: DocLike, start: int, end: int) -> tuple[int | None, int | None]:
    page_of = getattr(doc, "page_of", None)
    if page_of is None or not getattr(doc, "page_starts", None):
        return None, None
    return page_of(start), page_of(max(start, end - 1))


def _attr(name: str) -> str:
    return name.replace("&", "&amp;").replace('"', "&quot;")
