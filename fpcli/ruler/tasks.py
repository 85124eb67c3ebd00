"""RULER-style tasks, generated on the spot and fitted to an exact prompt length in tokens.

Each task draws its content from a ``random.Random`` seeded by ``(seed, task, length, index)``,
so a sample is the same on every run and for every profile, and two seeds give different samples.

| task | what the haystack hides | the question | expected (all must appear) |
|---|---|---|---|
| ``niah_single`` | one needle "special magic number for KEY is: VALUE" | the number for KEY | VALUE |
| ``niah_multikey`` | 4 needles, 4 different keys | the number for one key | its VALUE |
| ``niah_multivalue`` | 4 needles, one key, 4 values | all numbers for KEY | the 4 VALUEs |
| ``vt`` | a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) | every variable equal to 12345 | the 5 names |
| ``cwe`` | (the list is the haystack) 10 words repeated often, others 3 times | the 10 most common words | the 10 words |

Keys are adjective-noun pairs, values 7-digit numbers, variables 5 capital letters, words of the
``cwe`` list 6-letter pseudo-words (3 consonant-vowel syllables; equal length, so no word is
inside another). The prompt is ``fp ask``'s: its system prompt and one document (the haystack,
needles inserted at depths drawn from the seed), then the question last.

Length: a sample's prompt (chat template included) is the largest that fits ``target_tokens``:
at most ``target_tokens`` and short of it by less than one filler unit (a sentence, or for
``cwe`` one word's 3 list entries). ``target_tokens = min(--len, context - answer budget)``.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

from fpcli.prompt import SYSTEM_PROMPT, engine_reserve, format_user
from fpcli.ruler.haystack import Haystack, join_sentences

DOCUMENT_NAME = "haystack.txt"

ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
    "lively", "mellow", "narrow", "olive", "proud", "quiet", "rapid", "silent", "tidy", "upper",
    "vivid", "wild", "young", "zealous", "bitter", "crisp", "distant", "early", "fragile",
)
NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "river", "saddle", "tunnel",
    "umbrella", "valley", "walnut", "yarrow", "zephyr", "beacon", "cobble", "ember", "fjord", "glacier",
)
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class TaskError(ValueError):
    """A sample cannot be built: the length is too short for the task (one line, names the task)."""


class ChatEncoding(Protocol):
    """What sample fitting needs from an engine (``fpcli.engine.base.Engine`` has it)."""

    def encode_chat(self, system: str | None, user: str) -> list[int]: ...


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its expected answer.

    Attributes:
        task, length, index: the task name, the requested ``--len`` in tokens, the sample number.
        target_tokens: the prompt length aimed at (``min(length, context - max_new_tokens)``).
        ids: the prompt's token ids (chat template included); ``len(ids) <= target_tokens``.
        system, user: the two chat messages the ids encode.
        question: the question (the last part of ``user``).
        expected: strings that must all appear in the answer.
        max_new_tokens: the answer budget of the task, in tokens.
        seed: the seed the sample was drawn with.
    """

    task: str
    length: int
    index: int
    target_tokens: int
    ids: list[int] = field(repr=False)
    system: str = field(repr=False)
    user: str = field(repr=False)
    question: str
    expected: tuple[str, ...]
    max_new_tokens: int
    seed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def id(self) -> str:
        return f"{self.task}/{self.length}/{self.index}@{self.seed}"


@dataclass
class Draft:
    """A sample before its length is fixed: ``document(n)`` is the haystack text with ``n`` filler
    units (more units, more tokens), ``question`` and ``expected`` do not depend on ``n``."""

    document: Callable[[int], str]
    question: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    """A task definition.

    Attributes:
        name: the ``--task`` name.
        description: one line for the docs and ``--help``.
        max_new_tokens: the answer budget in tokens.
        min_length: the shortest ``--len`` accepted (needles, question and template need room).
        draft: ``draft(rng, haystack) -> Draft``.
    """

    name: str
    description: str
    max_new_tokens: int
    min_length: int
    draft: Callable[[random.Random, Haystack], Draft] = field(repr=False)


# -- content helpers ------------------------------------------------------------------------------


def _keys(rng: random.Random, n: int) -> list[str]:
    pairs = rng.sample([(a, b) for a in ADJECTIVES for b in NOUNS], n)
    return [f"{a}-{b}" for a, b in pairs]


def _numbers(rng: random.Random, n: int, digits: int = 7) -> list[str]:
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


class _Filler:
    """The first ``n`` sentences of a haystack stream, with extra sentences inserted at depths
    (fractions of ``n``, in order), cached so that fitting re-reads no sentence."""

    def __init__(self, haystack: Haystack, rng: random.Random, inserts: Sequence[str], depths: Sequence[float]):
        self._stream = haystack.stream(random.Random(rng.random()))
        self._cache: list[str] = []
        self._inserts = list(inserts)
        self._depths = list(depths)

    def __call__(self, n: int) -> str:
        if n > len(self._cache):
            self._cache.extend(itertools.islice(self._stream, n - len(self._cache)))
        sentences = list(self._cache[:n])
        # insert from the deepest so earlier positions stay valid; equal positions keep order
        for text, depth in sorted(zip(self._inserts, self._depths), key=lambda p: p[1], reverse=True):
            sentences.insert(round(depth * n), text)
        return join_sentences(sentences)


def _depths(rng: random.Random, k: int) -> list[float]:
    """``k`` needle depths in [0, 1], sorted, drawn from the seed."""
    return sorted(rng.uniform(0.0, 1.0) for _ in range(k))


# -- the tasks ------------------------------------------------------------------------------------


def _niah_single(rng: random.Random, haystack: Haystack) -> Draft:
    (key,), (value,) = _keys(rng, 1), _numbers(rng, 1)
    return Draft(
        _Filler(haystack, rng, [_needle(key, value)], _depths(rng, 1)),
        f"What is the special magic number for {key} mentioned in the document?",
        (value,),
    )


def _niah_multikey(rng: random.Random, haystack: Haystack, n_keys: int = 4) -> Draft:
    keys, values = _keys(rng, n_keys), _numbers(rng, n_keys)
    needles = [_needle(k, v) for k, v in zip(keys, values)]
    rng.shuffle(needles)
    asked = rng.randrange(n_keys)
    return Draft(
        _Filler(haystack, rng, needles, _depths(rng, n_keys)),
        f"What is the special magic number for {keys[asked]} mentioned in the document?",
        (values[asked],),
    )


def _niah_multivalue(rng: random.Random, haystack: Haystack, n_values: int = 4) -> Draft:
    (key,), values = _keys(rng, 1), _numbers(rng, n_values)
    return Draft(
        _Filler(haystack, rng, [_needle(key, v) for v in values], _depths(rng, n_values)),
        f"What are all the special magic numbers for {key} mentioned in the document? List every one.",
        tuple(values),
    )


def _variable_tracking(rng: random.Random, haystack: Haystack, hops: int = 4) -> Draft:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(LETTERS) for _ in range(5))
        if name not in names:
            names.append(name)
    (value,) = _numbers(rng, 1, digits=5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    return Draft(
        _Filler(haystack, rng, chain, _depths(rng, len(chain))),
        f"Which variables are assigned the value {value}, directly or through other variables, in the document? "
        "List every one of them.",
        tuple(names),
    )


CWE_COMMON = 10  # words to find
CWE_UNCOMMON_REPEATS = 3  # occurrences of every other word
CWE_MAX_REPEATS = 30  # occurrences of a common word when the length allows (RULER's setting)
CWE_MIN_REPEATS = 5  # ... and at least this many at short lengths


def _pseudo_words(rng: random.Random) -> Iterator[str]:
    """An endless stream of distinct 6-letter pseudo-words (3 consonant-vowel syllables)."""
    seen: set[str] = set()
    while True:
        w = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(3))
        if w not in seen:
            seen.add(w)
            yield w


class _WordList:
    """The ``cwe`` haystack: a numbered list of ``CWE_COMMON`` words repeated ``repeats`` times each
    and ``n`` other words 3 times each, shuffled by the sample's seed."""

    def __init__(self, rng: random.Random):
        self._words = _pseudo_words(random.Random(rng.random()))
        self._shuffle_seed = rng.random()
        self.common = list(itertools.islice(self._words, CWE_COMMON))
        self._others: list[str] = []
        self.repeats = CWE_MAX_REPEATS

    def __call__(self, n: int) -> str:
        if n > len(self._others):
            self._others.extend(itertools.islice(self._words, n - len(self._others)))
        entries = self.common * self.repeats + self._others[:n] * CWE_UNCOMMON_REPEATS
        random.Random(self._shuffle_seed).shuffle(entries)
        return "\n".join(f"{i}. {w}" for i, w in enumerate(entries, 1))


def _common_words(rng: random.Random, haystack: Haystack) -> Draft:
    words = _WordList(rng)
    return Draft(
        words,
        f"What are the {CWE_COMMON} most common words in the numbered list in the document? List them.",
        tuple(words.common),
    )


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("niah_single", "one needle (a key and its 7-digit number); asked: the number", 32, 512, _niah_single),
        Task("niah_multikey", "4 needles with different keys; asked: one key's number", 32, 512, _niah_multikey),
        Task("niah_multivalue", "4 needles with one key; asked: all 4 numbers", 64, 512, _niah_multivalue),
        Task("vt", "variable tracking: a chain of 4 assignments; asked: every variable equal to a value", 48, 512,
             _variable_tracking),
        Task("cwe", "common-word extraction: a list of words; asked: the 10 most frequent", 128, 1024, _common_words),
    )
}


# -- fitting to a length --------------------------------------------------------------------------


def target_tokens(task: Task, length: int, context_length: int, reserve: int = 0) -> int:
    """The prompt length a sample of ``task`` aims at: ``--len``, or less when the answer budget
    and the ``reserve`` the engine keeps free (``fpcli.prompt.engine_reserve``) would not fit the
    context (e.g. ``--len 32k`` on a 32,768-token model)."""
    return min(length, context_length - task.max_new_tokens - reserve)


def fit_units(measure: Callable[[int], int], target: int, first_guess: int = 64) -> tuple[int, int]:
    """The largest ``n >= 0`` with ``measure(n) <= target``, assuming ``measure`` grows with ``n``
    (secant steps, then bisection). Returns ``(n, measure(n))``.

    Raises:
        TaskError: even ``measure(0)`` exceeds ``target``.
    """
    base = measure(0)
    if base > target:
        raise TaskError(f"needs {base} tokens without any haystack, more than the {target} available")
    lo, lo_tokens, hi = 0, base, None
    n = max(1, first_guess)
    for _ in range(64):
        m = measure(n)
        if m <= target:
            lo, lo_tokens = n, m
        else:
            hi = n
        if lo_tokens == target or (hi is not None and hi - lo <= 1):
            break
        per_unit = max((m - base) / n, 1e-3)
        guess = lo + max(1, int((target - lo_tokens) / per_unit))
        if hi is not None and not lo < guess < hi:
            guess = (lo + hi) // 2
        n = guess
    return lo, lo_tokens


def make_sample(task: Task, length: int, index: int, seed: int, haystack: Haystack, tokenizer: ChatEncoding,
                context_length: int) -> Sample:
    """One sample of ``task`` fitted to ``target_tokens`` (with the reserve ``tokenizer``, the
    engine, keeps free).

    Raises:
        TaskError: the length is too short for the task's fixed content (names the task and length).
    """
    rng = random.Random(f"fp.eval:{seed}:{task.name}:{length}:{index}")
    draft = task.draft(rng, haystack)
    target = target_tokens(task, length, context_length, engine_reserve(tokenizer, task.max_new_tokens))
    if isinstance(draft.document, _WordList):  # common-word repeats: as many as the length allows
        draft.document.repeats = _cwe_repeats(draft, tokenizer, target)

    def user(n: int) -> str:
        return format_user([(DOCUMENT_NAME, draft.document(n))], draft.question)

    def measure(n: int) -> int:
        return len(tokenizer.encode_chat(SYSTEM_PROMPT, user(n)))

    try:
        n, _ = fit_units(measure, target, first_guess=max(1, target // 16))
    except TaskError as exc:
        raise TaskError(f"--len {length}: too short for task {task.name}: it {exc}") from None
    text = user(n)
    ids = list(tokenizer.encode_chat(SYSTEM_PROMPT, text))
    return Sample(task.name, length, index, target, ids, SYSTEM_PROMPT, text, draft.question, draft.expected,
                  task.max_new_tokens, seed)


def _cwe_repeats(draft: Draft, tokenizer: ChatEncoding, target: int) -> int:
    """Repeats of each common word: ``CWE_MAX_REPEATS`` when the list can hold them in half its
    entries, else fewer, down to ``CWE_MIN_REPEATS``."""
    words: _WordList = draft.document  # type: ignore[assignment]
    words.repeats = 0
    probe = 64

    def tokens(n: int) -> int:
        return len(tokenizer.encode_chat(SYSTEM_PROMPT, format_user([(DOCUMENT_NAME, words(n))], draft.question)))

    base = tokens(0)
    per_entry = (tokens(probe) - base) / (probe * CWE_UNCOMMON_REPEATS)
    entries = max(0.0, (target - base) / max(per_entry, 1e-3))
    return int(min(CWE_MAX_REPEATS, max(CWE_MIN_REPEATS, entries / (2 * CWE_COMMON))))


def make_samples(tasks: Sequence[Task], lengths: Sequence[int], samples: int, seeds: Sequence[int],
                 haystack: Haystack, tokenizer: ChatEncoding, context_length: int,
                 on_sample: Callable[[Sample], None] | None = None) -> list[Sample]:
    """``samples`` samples per (task, length) and seed, in task, length, seed, index order (each
    seed gives its own ``samples`` samples per cell).

    Raises:
        TaskError: a length too short for a task.
    """
    out = []
    for task in tasks:
        for length in lengths:
            for sd in seeds:
                for i in range(samples):
                    s = make_sample(task, length, i, sd, haystack, tokenizer, context_length)
                    out.append(s)
                    if on_sample is not None:
                        on_sample(s)
    return out
