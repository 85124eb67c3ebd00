"""Haystacks: the text that pads a sample to its token length, as a list of sentences.

Two sources, both deterministic given a ``random.Random``:

- ``GeneratedHaystack``: essay-like sentences drawn from fixed word lists (no network, no data
  files); varied enough that no two paragraphs repeat, and free of digits, so a needle's number
  is the only number in the text;
- ``DocumentHaystack``: the user's own documents (``fp eval --haystack FILE...``), cut into
  sentences; a sample starts at a random sentence and wraps around when it needs more text than
  the documents hold (RULER repeats its essay the same way).

Tasks take the first ``n`` sentences of a haystack's ``stream`` (so a longer sample extends a
shorter one) and join them with ``join_sentences``.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

SUBJECTS = (
    "The committee", "A local farmer", "The museum curator", "Our survey team", "The city council",
    "A visiting historian", "The river authority", "The baker on the corner", "The harbor master",
    "A young botanist", "The train conductor", "The school principal", "An amateur astronomer",
    "The library board", "The village doctor", "A retired sailor", "The orchestra", "Two carpenters",
    "The park ranger", "A group of students", "The lighthouse keeper", "The weaving guild",
)
VERBS = (
    "reviewed", "painted", "repaired", "discussed", "measured", "photographed", "cataloged",
    "inspected", "planned", "described", "rebuilt", "studied", "recorded", "organized", "cleaned",
    "questioned", "mapped", "restored", "praised", "visited",
)
OBJECTS = (
    "the old stone bridge", "a collection of maps", "the northern greenhouse", "the annual budget",
    "several wooden boats", "the weather station", "a row of apple trees", "the clock tower",
    "the public gardens", "a set of brass instruments", "the community kitchen", "the fishing nets",
    "the mountain trail", "the town archives", "a herd of goats", "the copper roof", "the ferry schedule",
    "an abandoned mill", "the winter market", "the salt marsh",
)
TAILS = (
    "before the spring festival", "after a long winter", "during the summer market", "with great care",
    "on a rainy afternoon", "for the first time in years", "despite the strong wind",
    "at the request of the mayor", "while the tourists watched", "as part of a regional project",
    "in less than a week", "early in the morning", "without telling anyone", "under a grey sky",
    "with help from the neighbors", "to everyone's surprise",
)
PARAGRAPH = 6  # sentences per paragraph in the joined text

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class Haystack(Protocol):
    """A source of filler sentences."""

    name: str  # "generated" or the documents' names, for the report

    def stream(self, rng: random.Random) -> Iterator[str]:
        """An endless stream of sentences, deterministic given ``rng``'s state."""


@dataclass(frozen=True)
class GeneratedHaystack:
    """Essay-like filler from the word lists above (subject, verb, object, circumstance)."""

    name: str = "generated"

    def stream(self, rng: random.Random) -> Iterator[str]:
        while True:
            yield f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."


@dataclass(frozen=True)
class DocumentHaystack:
    """The user's documents as filler, cut into sentences at ``.``, ``!`` or ``?`` and whitespace.

    Attributes:
        name: the documents' names, comma-separated (for the report).
        pieces: the sentences of all documents, in order (at least one).
    """

    name: str
    pieces: tuple[str, ...]

    @classmethod
    def from_texts(cls, named_texts: Sequence[tuple[str, str]]) -> "DocumentHaystack":
        """From ``(name, text)`` pairs (``fpcli.ingest.Document`` name and text).

        Raises:
            ValueError: no pair holds any text.
        """
        pieces = tuple(s for _, text in named_texts for s in (p.strip() for p in _SENTENCE_END.split(text)) if s)
        if not pieces:
            raise ValueError("--haystack: the documents hold no text to use as a haystack")
        return cls(", ".join(name for name, _ in named_texts), pieces)

    def stream(self, rng: random.Random) -> Iterator[str]:
        start = rng.randrange(len(self.pieces))
        return itertools.islice(itertools.cycle(self.pieces), start, None)


def join_sentences(sentences: Sequence[str]) -> str:
    """Sentences joined with spaces, ``PARAGRAPH`` to a paragraph, paragraphs by blank lines."""
    return "\n\n".join(" ".join(sentences[i : i + PARAGRAPH]) for i in range(0, len(sentences), PARAGRAPH))
