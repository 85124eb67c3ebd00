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
        engine: provides ``encode_chat``, ``token_starts`` and ``context_length``.
        max_new_tokens: tokens reserved for the answer.
        context_length: overrides ``engine.context_length`` when smaller (a profile's cap).
        cut: ``middle`` (keep beginning and end) or ``end`` (keep the beginning).

    The documents are cut on token boundaries (``engine.token_starts``) to their water-filling
    targets, and the targets are corrected by the measured prompt length until the prompt fills
    the budget to within ``FILL_SLACK_TOKENS`` (whatever the documents' token density), less the
    room a question of ``question_allowance(budget)`` tokens would need (so that the cut documents,
    the prompt's reusable prefix, are the same for every question up to that length).

    Raises:
        PromptError: when even the question without any document does not fit.
        NoRoomError: when the question fits but not one document token does.
    """
    if cut not in CUT_MODES:
        raise ValueError(f"cut must be one of {CUT_MODES}, got {cut!r}")
    ctx = min(engine.context_length, context_length) if context_length else engine.context_length
    budget = ctx - max_new_tokens
    if max_new_tokens < 1 or budget <= 0:
        raise NoRoomError(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of {ctx} tokens"
        )
    docs = [d for d in docs if d.text.strip()]
    pairs = [(d.name, d.text) for d in docs]
    starts = [engine.token_starts(d.text) for d in docs]  # one tokenization per document
    doc_tokens = {d.name: len(s) for d, s in zip(docs, starts)}

    def make(pairs_: Sequence[tuple[str, str]], cuts_: list[Cut]) -> Prompt:
        user = format_user(pairs_, question)
        return Prompt(system or "", user, engine.encode_chat(system, user), ctx, max_new_tokens, doc_tokens, cuts_,
                      list(pairs_))

    prompt = make(pairs, [])
    if prompt.tokens <= budget:
        return prompt

    overhead = len(engine.encode_chat(system, format_user([(n, "") for n, _ in pairs], question)))
    # the documents fill ``target``: the budget less what a question of ``question_allowance``
    # tokens would take beyond this one, so the cut does not depend on the question's length
    allowance = max(0, question_allowance(budget) - engine.count_tokens(question))
    target = budget - allowance if overhead + allowance <= budget else budget
    if overhead > budget:
        raise NoRoomError(
            f"the question and chat template alone need {overhead} tokens, more than the {budget} available "
            f"(context {ctx} - {max_new_tokens} for the answer); shorten the question or lower --max-new-tokens"
        )
    sizes = [len(s) for s in starts]
    # Each cut document costs its kept tokens plus a marker line; ``reserve`` starts as an
    # allowance for the markers and is corrected by the measured slack of each attempt. Cuts fall
    # on token boundaries, so an attempt misses its target only by the few tokens that
    # re-tokenizing at the joins changes: two or three attempts land within a few tokens.
    reserve = MARKER_TOKENS * len(docs)
    best: Prompt | None = None
    for _ in range(6):
        targets = water_fill(sizes, max(0, target - overhead - reserve))
        if not any(targets) and best is not None:
            break
        if not any(targets):
            raise NoRoomError(
                f"no document token fits: the prompt budget is {budget:,} tokens (context {ctx:,} - "
                f"{max_new_tokens:,} for the answer) and the question and chat template take {overhead:,}; "
                f"lower --max-new-tokens (e.g. -n 512) or shorten the question"
            )
        new_pairs, cuts = [], []
        for d, s, k in zip(docs, starts, targets):
            if k >= len(s):
                new_pairs.append((d.name, d.text))
                continue
            text, record = cut_text(d, s, k, cut)
            new_pairs.append((d.name, text))
            cuts.append(record)
        prompt = make(new_pairs, cuts)
        slack = target - prompt.tokens
        if slack >= 0 and (best is None or prompt.tokens > best.tokens):
            best = prompt
        if 0 <= slack <= FILL_SLACK_TOKENS:
            break
        reserve -= slack  # over budget: reserve the excess too; under: give the slack back
    if best is None:  # pragma: no cover - the correction converges within the attempts
        raise PromptError(f"could not fit the documents into {budget} tokens")
    return best


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


def cut_text(doc: DocLike, starts: Sequence[int], keep_tokens: int, mode: str = "middle") -> tuple[str, Cut]:
    """Cut ``doc.text`` down to ``keep_tokens`` of its tokens, on token boundaries.

    Args:
        doc: the document (``name``, ``text``; ``page_of`` names pages).
        starts: the character offset where each token of ``doc.text`` begins
            (``Engine.token_starts``; its length is the document's token count ``n``).
        keep_tokens: tokens to keep, ``0 <= keep_tokens < n``; ``middle`` keeps the first
            ``keep_tokens // 2`` and the last ``keep_tokens - keep_tokens // 2``, ``end`` the first
            ``keep_tokens``.
        mode: ``middle`` or ``end``.

    Returns:
        The new text (with a marker line where text was removed) and the ``Cut`` record.

    Example: tokens starting at characters ``[0, 4, 9, 15, 20]`` of a 26-character text, keep 2,
    ``middle``: the head is ``text[:4]`` (token 0), the tail ``text[20:]`` (token 4), and
    characters ``[4, 20)`` (tokens 1-3) are dropped.
    """
    text = doc.text
    n_tokens = len(starts)
    if keep_tokens <= 0:
        marker = MARKER.format(dropped=f"{n_tokens:,}", name=doc.name)
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
    marker = MARKER.format(dropped=f"{n_tokens - keep_tokens:,}", name=doc.name)
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
