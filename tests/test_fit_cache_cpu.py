"""A cached prompt fit builds exactly the prompt the uncached path builds, with the REAL embedded
model's tokenizer and chat template (SmolLM2-135M-Instruct, 8K context), and a repeat question
needs one ``encode_chat`` and no document tokenization. Marked ``slow`` (the model is pulled once)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from fpcli.doccache import CacheConfig, fit_cache_for
from fpcli.engine.transformers_engine import TransformersEngine
from fpcli.profiles import load_profile
from fpcli.prompt import build_prompt

pytestmark = pytest.mark.slow

QUESTIONS = ("When will the new ferry terminal open?", "Who pays for the breakwater, and how much does it cost?")


@dataclass
class Doc:
    name: str
    text: str


def _text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["harbor", "ferry", "budget", "council", "2026", "million", "breakwater", "dredging", "tide", "pier",
             "über", "café", "—", "(see p. 4)", "\n\n", "§12", "naïve"]
    return " ".join(rng.choice(vocab) for _ in range(words))


class Counting:
    """The real engine, with its tokenization calls counted."""

    def __init__(self, eng) -> None:
        self.eng, self.calls = eng, {"encode_chat": 0, "token_starts": 0}
        self.context_length = eng.context_length

    def encode_chat(self, system, user):
        self.calls["encode_chat"] += 1
        return self.eng.encode_chat(system, user)

    def count_tokens(self, text):
        return self.eng.count_tokens(text)

    def token_starts(self, text):
        self.calls["token_starts"] += 1
        return self.eng.token_starts(text)


@pytest.fixture(scope="module")
def engine(smollm2):
    with TransformersEngine(smollm2, load_profile("bf16"), model_name="smollm2-135m-instruct") as eng:
        yield eng


@pytest.mark.parametrize("cut", ["middle", "end"])
def test_cached_and_uncached_prompts_are_identical(engine, tmp_path, cut):
    docs = [Doc("manual.txt", _text(9000, 1)), Doc("notes.md", _text(2500, 2)), Doc("short.txt", "The pier is 40 m long.")]
    fits = fit_cache_for(CacheConfig(root=tmp_path / "cache"), engine.model_path)
    assert fits is not None
    long_q = " ".join(["Please answer carefully:"] * 60) + " who pays?"  # beyond the question allowance
    for question in (*QUESTIONS, long_q):
        plain = build_prompt(docs, question, engine, 256, cut=cut)
        first = build_prompt(docs, question, engine, 256, cut=cut, fit_cache=fits)
        counting = Counting(engine)
        again = build_prompt(docs, question, counting, 256, cut=cut, fit_cache=fits)
        assert plain.cuts, "the documents must exceed the 8K context for this test"
        for p in (first, again):
            assert p.ids == plain.ids and p.documents == plain.documents and p.doc_tokens == plain.doc_tokens
            assert [c.to_dict() for c in p.cuts] == [c.to_dict() for c in plain.cuts]
        assert plain.tokens <= plain.budget
        if question != long_q:  # a repeat: one encode_chat, the documents are not tokenized again
            assert counting.calls == {"encode_chat": 1, "token_starts": 0}
    # the two ordinary questions share the cut documents (the reusable prefix)
    a, b = (build_prompt(docs, q, engine, 256, cut=cut, fit_cache=fits) for q in QUESTIONS)
    assert a.documents == b.documents


def test_documents_that_fit_whole_are_identical_and_cheap(engine, tmp_path):
    docs = [Doc("short.txt", _text(400, 3))]
    fits = fit_cache_for(CacheConfig(root=tmp_path / "cache"), engine.model_path)
    plain = build_prompt(docs, QUESTIONS[0], engine, 256)
    build_prompt(docs, QUESTIONS[0], engine, 256, fit_cache=fits)
    counting = Counting(engine)
    again = build_prompt(docs, QUESTIONS[1], counting, 256, fit_cache=fits)
    assert not plain.cuts and again.ids == build_prompt(docs, QUESTIONS[1], engine, 256).ids
    assert counting.calls == {"encode_chat": 1, "token_starts": 0}


def test_another_tokenizer_or_budget_misses(engine, tmp_path):
    from fpcli.prompt import FitCache

    docs = [Doc("manual.txt", _text(9000, 4))]
    fits = fit_cache_for(CacheConfig(root=tmp_path / "cache"), engine.model_path)
    build_prompt(docs, QUESTIONS[0], engine, 256, fit_cache=fits)
    for other, n in ((FitCache(fits.store, "another tokenizer"), 256), (fits, 512)):
        counting = Counting(engine)
        p = build_prompt(docs, QUESTIONS[0], counting, n, fit_cache=other)
        assert counting.calls["token_starts"] == 1 and p.ids == build_prompt(docs, QUESTIONS[0], engine, n).ids
