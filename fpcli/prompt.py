"""Prompt building with a token budget.

The chat is a system message and one user message holding the documents, each delimited by its
file name (``prompt_names``: the same however the path was typed, so the same file gives the same
prompt tokens and a reusable KV cache), then the question last (so it sits in the dense tail of
the prefill)::

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
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from fpcli.doccache import DiskCache

SYSTEM_PROMPT = (
    "You answer questions about the documents the user gives you. Base your answer on the documents; "
    "if they do not contain the answer, say so. Be concise and quote exact figures and names."
)
MARKER = "[... {dropped} tokens of {name} omitted here by fp to fit the model's context ...]"
MARKER_TOKENS = 40  # first allowance per document for the marker line (corrected by measurement)
FILL_SLACK_TOKENS = 32  # a fitted prompt may leave at most this many budget tokens unused (if it can)
# Cuts leave room for a question of this many tokens (at most 1/32 of the budget) whatever the
# question is, so every question up to that length gets the same cut documents: the same token
# prefix, whose KV cache an engine reuses from one question to the next (fp chat, a resident engine).
QUESTION_ALLOWANCE = 256
CUT_MODES = ("middle", "end")


class PromptError(ValueError):
    """The prompt cannot fit the context at all (the question or template alone is too long)."""


class NoRoomError(PromptError):
    """Not one document token fits: the answer reserve (``--max-new-tokens``) and the question
    take the whole context. A usage error (exit code 2)."""


class Tokenizing(Protocol):
    """The part of ``fpcli.engine.base.Engine`` that prompt building needs."""

    context_length: int

    def encode_chat(self, system: str | None, user: str) -> list[int]: ...

    def count_tokens(self, text: str) -> int: ...

    def token_starts(self, text: str) -> list[int]: ...


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
        doc_tokens: ``{name: tokens}`` of every document before any cut (``name``: as the user
            gave it).
        cuts: one record per cut document (empty when everything fit).
        documents: the ``(label, text)`` pairs in the prompt, after cuts (``label``: the
            document's ``prompt_names`` entry; reused by ``fp chat`` for every question, so that
            the documents stay a shared token prefix).
        question_room: tokens of the budget a cut kept for the question (``question_allowance``):
            the prompt without the question was fitted to ``budget - question_room`` tokens, so
            every question up to that length reuses the same cut documents; 0 when nothing was
            cut or the documents were cut for this (longer) question.
        reserved: tokens of the context the engine keeps from a request beyond its prompt and
            answer (``engine_reserve``; SGLang: at least 2); ``budget`` leaves them free.
    """

    system: str
    user: str
    ids: list[int]
    context_length: int
    max_new_tokens: int
    doc_tokens: dict[str, int] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)
    documents: list[tuple[str, str]] = field(default_factory=list)
    question_room: int = 0
    reserved: int = 0

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def budget(self) -> int:
        return self.context_length - self.max_new_tokens - self.reserved

    @property
    def budget_note(self) -> str | None:
        """One line when documents were cut and the answer reserve took at least as much of the
        context as the prompt got (``-n 8000`` on an 8K model leaves 192 tokens); else ``None``."""
        if not self.cuts or self.max_new_tokens < self.budget:
            return None
        return (
            f"--max-new-tokens {self.max_new_tokens:,} reserves {self.max_new_tokens:,} of the model's "
            f"{self.context_length:,}-token context for the answer, leaving {self.budget:,} for the prompt: "
            f"the documents were cut to fit; lower --max-new-tokens to keep more of them"
        )

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.tokens,
            "context_length": self.context_length,
            "max_new_tokens": self.max_new_tokens,
            "budget": self.budget,
            "budget_note": self.budget_note,
            "question_room": self.question_room,
            "reserved": self.reserved,
            "doc_tokens": dict(self.doc_tokens),
            "truncated": bool(self.cuts),
            "cuts": [c.to_dict() for c in self.cuts],
        }


def prompt_names(names: Sequence[str]) -> list[str]:
    """The name each document has in the prompt, independent of how its path was typed: the
    file's name (``examples/report.md`` and ``/home/me/examples/report.md`` are both
    ``report.md``), with as many parent folders of its absolute path as keep the names distinct
    (``a/report.md``, ``b/report.md``); ``-`` (standard input) stays ``-``. The same file given
    twice keeps the same name.

    >>> prompt_names(["/x/a/report.md", "/x/b/report.md", "notes.txt"])
    ['a/report.md', 'b/report.md', 'notes.txt']
    """
    import os

    parts = [os.path.abspath(n).split(os.sep) if n != "-" else ["-"] for n in names]
    depth = [1] * len(names)
    while True:
        labels = ["/".join(p[-k:]).lstrip("/") or "/" for p, k in zip(parts, depth)]
        by_label: dict[str, set[tuple[str, ...]]] = {}
        for label, p in zip(labels, parts):
            by_label.setdefault(label, set()).add(tuple(p))
        clash = [i for i, label in enumerate(labels) if len(by_label[label]) > 1 and depth[i] < len(parts[i])]
        if not clash:
            return labels
        for i in clash:
            depth[i] += 1


def format_user(docs: Sequence[tuple[str, str]], question: str, history: Sequence[tuple[str, str]] = ()) -> str:
    """The user message: each ``(name, text)`` delimited by its name, then the earlier
    ``(question, answer)`` turns of a chat, then the question. Nothing before the documents
    depends on the question, so prompts about the same documents share their token prefix."""
    parts = [f'<document name="{_attr(name)}">\n{text.strip()}\n</document>' for name, text in docs]
    parts += [f"Earlier question: {q.strip()}\nYour answer: {a.strip()}" for q, a in history]
    parts.append(f"Question: {question.strip()}")
    return "\n\n".join(parts)


WHOLE_MARGIN_TOKENS = 16  # a question appended after "Question: " can merge at most a few tokens of the
# prompt before it: documents whose prompt without a question exceeds the budget by more never fit whole
JOIN_TOKENS = 8  # tokens that re-tokenizing a document inside the prompt may change at its two joins
# (the markup before and after it); a prompt estimated above the budget by more than this per document
# (plus WHOLE_MARGIN_TOKENS) is not encoded whole to learn that it does not fit


@dataclass(frozen=True)
class FitCache:
    """Where fitted documents are kept between commands (``fpcli.doccache``).

    Attributes:
        store: the ``fpcli.doccache.DiskCache`` of kind ``fits``.
        tokenizer_id: the engine's tokenizer identity (``fpcli.doccache.tokenizer_identity``):
            a fit is only reused with the same tokenizer.
    """

    store: "DiskCache"
    tokenizer_id: str


def engine_reserve(engine, max_new_tokens: int) -> int:
    """Tokens of the context ``engine`` keeps from a request beyond its prompt and its
    ``max_new_tokens`` answer tokens (its ``context_reserve``, e.g. SGLang's; 0 for an engine
    without one, like the transformers engine)."""
    reserve = getattr(engine, "context_reserve", None)
    return int(reserve(max_new_tokens)) if callable(reserve) else 0


def build_prompt(
    docs: Sequence[DocLike],
    question: str,
    engine: Tokenizing,
    max_new_tokens: int,
    context_length: int | None = None,
    system: str | None = SYSTEM_PROMPT,
    cut: str = "middle",
    fit_cache: FitCache | None = None,
) -> Prompt:
    """Build the chat prompt and fit it to ``context_length - max_new_tokens`` tokens, less what
    the engine keeps free (``engine_reserve``).

    Args:
        docs: documents with ``name`` and ``text`` (``fpcli.ingest.Document``; a ``page_of`` method
            lets cuts name pages). Documents with empty text are left out.
        question: the user's question, placed last.
        engine: provides ``encode_chat``, ``token_starts`` and ``context_length``.
        max_new_tokens: tokens reserved for the answer.
        context_length: overrides ``engine.context_length`` when smaller (a profile's cap).
        cut: ``middle`` (keep beginning and end) or ``end`` (keep the beginning).
        fit_cache: where the question-independent part (documents' token counts, the prompt's
            length without a question, the cut documents) is looked up and stored; a hit makes
            the prompt with one ``encode_chat``. The result is the same with or without it.

    The documents are kept whole when the prompt with the question fits. Else they are cut on
    token boundaries (``engine.token_starts``) to their water-filling targets, and the targets are
    corrected by the measured prompt length (built with the question, measured less what the
    question adds over an empty one, so the fit does not depend on it) until it fills the
    budget less ``question_allowance(budget)`` to within ``FILL_SLACK_TOKENS``: this fit does not
    depend on the question, so the cut documents, the prompt's reusable prefix, are the same for
    every question up to the allowance (and can be cached). A longer question that then overflows
    the budget gets the documents cut for it.

    Raises:
        PromptError: when even the question without any document does not fit.
        NoRoomError: when the question fits but not one document token does.
    """
    if cut not in CUT_MODES:
        raise ValueError(f"cut must be one of {CUT_MODES}, got {cut!r}")
    ctx = min(engine.context_length, context_length) if context_length else engine.context_length
    reserved = engine_reserve(engine, max_new_tokens)
    budget = ctx - max_new_tokens - reserved
    if max_new_tokens < 1 or budget <= 0:
        raise NoRoomError(
            f"--max-new-tokens {max_new_tokens:,} leaves no room for a prompt in the model's context of {ctx:,} tokens"
        )
    docs = [d for d in docs if d.text.strip()]
    labels = prompt_names([d.name for d in docs])  # the prompt's names; the user's names in doc_tokens and cuts
    name_of = dict(zip(labels, (d.name for d in docs)))
    label_of = {d.name: label for d, label in zip(docs, labels)}
    pairs = [(label, d.text) for label, d in zip(labels, docs)]
    key = _fit_key(fit_cache, pairs, budget, cut, system)
    entry = fit_cache.store.get(key) if fit_cache is not None else None
    fresh = entry is None or not _valid_entry(entry, labels)
    starts: list[list[int]] | None = None

    def starts_of() -> list[list[int]]:
        nonlocal starts
        if starts is None:
            starts = [engine.token_starts(d.text) for d in docs]  # one tokenization per document
        return starts

    empty_overhead: int | None = None  # the prompt with empty documents and an empty question

    def overhead_empty() -> int:
        nonlocal empty_overhead
        if empty_overhead is None:
            empty_overhead = len(engine.encode_chat(system, format_user([(n, "") for n, _ in pairs], "")))
        return empty_overhead

    question_overhead: int | None = None  # the prompt with empty documents and this question

    def overhead_question() -> int:
        nonlocal question_overhead
        if question_overhead is None:
            question_overhead = len(engine.encode_chat(system, format_user([(n, "") for n, _ in pairs], question)))
        return question_overhead

    if fresh:
        # the whole prompt is encoded only when the documents' stripped tokens leave it a chance
        # to fit: a document far over the budget is tokenized once (the template adds to that)
        estimate = sum(_stripped_tokens(d.text, s) for d, s in zip(docs, starts_of()))
        whole = (None if estimate > budget + WHOLE_MARGIN_TOKENS + JOIN_TOKENS * len(docs)
                 else len(engine.encode_chat(system, format_user(pairs, ""))))
        entry = {"doc_tokens": {label: len(s) for label, s in zip(labels, starts_of())}, "whole_tokens": whole,
                 "fit": None}
    doc_tokens = {name_of[label]: n for label, n in entry["doc_tokens"].items()}

    def make(pairs_: Sequence[tuple[str, str]], cuts_: list[Cut], question_: str = question) -> Prompt:
        user = format_user(pairs_, question_)
        return Prompt(system or "", user, engine.encode_chat(system, user), ctx, max_new_tokens, doc_tokens, cuts_,
                      list(pairs_), reserved=reserved)

    if entry["whole_tokens"] is not None and entry["whole_tokens"] <= budget + WHOLE_MARGIN_TOKENS:
        prompt = make(pairs, [])
        if prompt.tokens <= budget:
            _store(fit_cache, key, entry, fresh)
            return prompt
    fitted: Prompt | None = None  # the fit made now (with this question), if one is
    if entry["fit"] is None:  # the question-independent fit, measured with an empty question
        overhead = overhead_empty()
        allowance = question_allowance(budget)
        target = budget - allowance if overhead + allowance <= budget else budget
        # Each attempt is built with this question and measured without it: the question follows
        # fixed markup ("</document>\n\nQuestion: "), so it adds as many tokens to a cut prompt as to
        # the prompt of empty documents. One encode per attempt, and the last one is the answer's prompt.
        fitted = _fit(docs, labels, starts_of(), engine, make, question, target, overhead, cut,
                      question_tokens=overhead_question() - overhead)
        entry["fit"] = None if fitted is None else {"documents": [list(p) for p in fitted.documents],
                                                     "cuts": [dict(c.to_dict(), file=label_of[c.file])
                                                              for c in fitted.cuts],
                                                     "question_room": budget - target}
        fresh = True
    _store(fit_cache, key, entry, fresh)
    if entry["fit"] is not None:
        prompt = fitted if fitted is not None else make([(n, t) for n, t in entry["fit"]["documents"]],
                                                        [Cut(**dict(c, file=name_of.get(c["file"], c["file"])))
                                                         for c in entry["fit"]["cuts"]])
        if prompt.tokens <= budget:
            prompt.question_room = entry["fit"]["question_room"] if prompt.cuts else 0
            return prompt
    # a question longer than the allowance: cut the documents for this question
    overhead = overhead_question()
    if overhead > budget:
        raise NoRoomError(
            f"the question and chat template alone need {overhead:,} tokens, more than the {budget:,} available "
            f"(context {ctx:,} - {max_new_tokens:,} for the answer); shorten the question or lower --max-new-tokens"
        )
    best = _fit(docs, labels, starts_of(), engine, make, question, budget, overhead, cut)
    if best is None:
        raise NoRoomError(
            f"no document token fits: the prompt budget is {budget:,} tokens (context {ctx:,} - "
            f"{max_new_tokens:,} for the answer) and the question and chat template take {overhead:,}; "
            f"lower --max-new-tokens (e.g. -n 512) or shorten the question"
        )
    return best


def _fit(docs, labels, starts, engine, make, question: str, target: int, overhead: int, cut: str,
         question_tokens: int = 0) -> "Prompt | None":
    """Cut ``docs`` (named ``labels`` in the prompt) so that the prompt with ``question``, less ``question_tokens`` (what the
    question adds over an empty one; 0: measured with it), fills ``target`` tokens to within
    ``FILL_SLACK_TOKENS``; ``overhead``: the prompt's tokens with empty documents, measured the
    same way. ``None`` when not one document token fits."""
    sizes = [len(s) for s in starts]
    # Each cut document costs its kept tokens plus a marker line; ``reserve`` starts as an
    # allowance for the markers and is corrected by the measured slack of each attempt. Cuts fall
    # on token boundaries, so an attempt misses its target only by the few tokens that
    # re-tokenizing at the joins changes: two or three attempts land within a few tokens.
    reserve = MARKER_TOKENS * len(docs)
    best: Prompt | None = None
    for _ in range(6):
        targets = water_fill(sizes, max(0, target - overhead - reserve))
        if not any(targets):
            break
        new_pairs, cuts = [], []
        for d, label, s, k in zip(docs, labels, starts, targets):
            if k >= len(s):
                new_pairs.append((label, d.text))
                continue
            text, record = cut_text(d, s, k, cut, label=label)
            new_pairs.append((label, text))
            cuts.append(record)
        prompt = make(new_pairs, cuts, question)
        slack = target - (prompt.tokens - question_tokens)
        if slack >= 0 and (best is None or prompt.tokens > best.tokens):
            best = prompt
        if 0 <= slack <= FILL_SLACK_TOKENS:
            break
        reserve -= slack  # over budget: reserve the excess too; under: give the slack back
    return best


def _fit_key(fit_cache: FitCache | None, pairs, budget: int, cut: str, system: str | None) -> str | None:
    if fit_cache is None:
        return None
    import hashlib

    from fpcli import __version__
    from fpcli.doccache import digest

    texts = [[name, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()] for name, text in pairs]
    return digest("fit", __version__, fit_cache.tokenizer_id, texts, budget, cut, system, QUESTION_ALLOWANCE,
                  MARKER, FILL_SLACK_TOKENS)


def _valid_entry(entry: dict, labels) -> bool:
    """A cached fit's shape is what ``build_prompt`` stores (a damaged entry is recomputed)."""
    try:
        fit = entry["fit"]
        whole = entry["whole_tokens"]
        return (set(entry["doc_tokens"]) == set(labels) and (whole is None or isinstance(whole, int))
                and (fit is None or (isinstance(fit["documents"], list) and isinstance(fit["cuts"], list)
                                     and isinstance(fit["question_room"], int))))
    except (KeyError, TypeError):
        return False


def _store(fit_cache: FitCache | None, key: str | None, entry: dict, fresh: bool) -> None:
    if fit_cache is not None and key is not None and fresh:
        fit_cache.store.put(key, entry)


def _stripped_tokens(text: str, starts: Sequence[int]) -> int:
    """Tokens of ``text`` that begin inside ``text.strip()`` (the part ``format_user`` keeps), from
    its token ``starts``: ``"  ab cd  "`` with starts ``[0, 2, 4, 7]`` -> 2 (the tokens at 2 and 4)."""
    from bisect import bisect_left

    lo = len(text) - len(text.lstrip())
    hi = len(text.rstrip())
    return max(0, bisect_left(starts, hi) - bisect_left(starts, lo))


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


def cut_text(doc: DocLike, starts: Sequence[int], keep_tokens: int, mode: str = "middle",
             label: str | None = None) -> tuple[str, Cut]:
    """Cut ``doc.text`` down to ``keep_tokens`` of its tokens, on token boundaries.

    Args:
        doc: the document (``name``, ``text``; ``page_of`` names pages).
        starts: the character offset where each token of ``doc.text`` begins
            (``Engine.token_starts``; its length is the document's token count ``n``).
        keep_tokens: tokens to keep, ``0 <= keep_tokens < n``; ``middle`` keeps the first
            ``keep_tokens // 2`` and the last ``keep_tokens - keep_tokens // 2``, ``end`` the first
            ``keep_tokens``.
        mode: ``middle`` or ``end``.
        label: the document's name in the prompt, in the marker line (default ``doc.name``);
            the ``Cut`` record keeps ``doc.name``.

    Returns:
        The new text (with a marker line where text was removed) and the ``Cut`` record.

    Example: tokens starting at characters ``[0, 4, 9, 15, 20]`` of a 26-character text, keep 2,
    ``middle``: the head is ``text[:4]`` (token 0), the tail ``text[20:]`` (token 4), and
    characters ``[4, 20)`` (tokens 1-3) are dropped.
    """
    text = doc.text
    n_tokens = len(starts)
    label = doc.name if label is None else label
    if keep_tokens <= 0:
        marker = MARKER.format(dropped=f"{n_tokens:,}", name=label)
        record = Cut(doc.name, n_tokens, 0, n_tokens, "all", 0, len(text), *_pages(doc, 0, len(text)))
        return marker, record
    if mode == "middle":
        head_tokens = keep_tokens // 2
        head_end = starts[head_tokens] if head_tokens < n_tokens else len(text)
        tail_start = starts[n_tokens - (keep_tokens - head_tokens)]
    else:
        head_end = starts[keep_tokens]
        tail_start = len(text)
    head, tail = text[:head_end], text[tail_start:]
    marker = MARKER.format(dropped=f"{n_tokens - keep_tokens:,}", name=label)
    new_text = f"{head.rstrip()}\n\n{marker}\n\n{tail.lstrip()}" if tail else f"{head.rstrip()}\n\n{marker}"
    record = Cut(doc.name, n_tokens, keep_tokens, n_tokens - keep_tokens, mode, head_end, tail_start,
                 *_pages(doc, head_end, tail_start))
    return new_text, record


def _pages(doc: DocLike, start: int, end: int) -> tuple[int | None, int | None]:
    page_of = getattr(doc, "page_of", None)
    if page_of is None or not getattr(doc, "page_starts", None):
        return None, None
    return page_of(start), page_of(max(start, end - 1))


def _attr(name: str) -> str:
    return name.replace("&", "&amp;").replace('"', "&quot;")
