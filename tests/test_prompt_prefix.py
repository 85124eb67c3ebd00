"""Prompts about the same documents share their token prefix, cut documents included: the cut
does not depend on the question (up to ``question_allowance(budget)`` tokens), so an engine can reuse the
documents' KV cache for the next question. (The real chat template: ``test_sessions_cpu``.)"""
from __future__ import annotations

from dataclasses import dataclass

from fp_fakes import FakeEngine
from fpcli.engine.transformers_engine import common_prefix_len
from fpcli.prompt import build_prompt, question_allowance


@dataclass
class Doc:
    name: str
    text: str


def test_questions_of_different_lengths_get_the_same_cut_documents():
    eng = FakeEngine(context_length=4096)
    docs = [Doc("long.txt", " ".join(f"word{i}" for i in range(10_000))), Doc("short.txt", "alpha beta gamma")]
    short_q = "Why?"
    # 60 of the 120 allowed tokens: the character-proportional cut overshoots its target by ~80
    # tokens here, and a question that then overflows the budget re-cuts; a cut that hits its
    # target makes this hold up to the whole allowance
    long_q = " ".join(f"q{i}" for i in range(60)) + "?"
    a = build_prompt(docs, short_q, eng, 256)
    b = build_prompt(docs, long_q, eng, 256)
    assert a.cuts and [c.to_dict() for c in a.cuts] == [c.to_dict() for c in b.cuts]
    assert a.documents == b.documents
    assert a.tokens <= a.budget and b.tokens <= b.budget
    assert a.tokens >= 0.9 * a.budget  # the allowance costs little of the context
    assert question_allowance(4096 - 256) == 120 and question_allowance(800) == 25 and question_allowance(200_000) == 256
    shared = common_prefix_len(a.ids, b.ids)
    assert shared >= a.tokens - 2  # everything but the question itself
