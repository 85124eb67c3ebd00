"""Prompt building and the token budget, with the fake whitespace tokenizer."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from fp_fakes import TEMPLATE_TOKENS, FakeEngine
from fpcli.ingest import Document
from fpcli.prompt import SYSTEM_PROMPT, PromptError, build_prompt, format_user, water_fill


@dataclass
class Doc:
    name: str
    text: str


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def test_format_user_delimits_by_name_question_last():
    user = format_user([("a.pdf", "alpha"), ('we"ird.txt', "beta")], "What?")
    assert user.index('<document name="a.pdf">') < user.index("alpha") < user.index("</document>")
    assert '<document name="we&quot;ird.txt">' in user
    assert user.rstrip().endswith("Question: What?")


def test_fits_without_cut():
    eng = FakeEngine(context_length=1000)
    p = build_prompt([Doc("a.txt", words("w", 100))], "Where?", eng, max_new_tokens=100)
    assert p.cuts == [] and p.tokens <= p.budget == 900
    assert p.system == SYSTEM_PROMPT and "w99" in p.user
    assert p.doc_tokens == {"a.txt": 100}
    assert p.to_dict()["truncated"] is False


def test_longest_document_cut_from_middle():
    eng = FakeEngine(context_length=1000)
    long_doc = Doc("long.txt", words("L", 2000))
    short_doc = Doc("short.txt", words("S", 100))
    p = build_prompt([long_doc, short_doc], "Question here?", eng, max_new_tokens=200)
    assert p.tokens <= 800
    assert len(p.cuts) == 1
    c = p.cuts[0]
    assert c.file == "long.txt" and c.where == "middle"
    assert c.tokens_total == 2000 and c.tokens_kept + c.tokens_dropped == 2000
    assert 400 < c.tokens_kept < 700
    # the beginning and the end survive, the middle is gone, the short document is whole
    assert "L0 " in p.user and "L1999" in p.user and " L1000 " not in p.user
    assert "S0" in p.user and "S99" in p.user
    assert "omitted here by fp" in p.user
    assert "long.txt: dropped" in c.describe() and "from the middle" in c.describe()
    assert p.user.rstrip().endswith("Question: Question here?")


def test_water_filling_cuts_both_long_documents():
    eng = FakeEngine(context_length=2000)
    docs = [Doc("a", words("A", 3000)), Doc("b", words("B", 2000)), Doc("c", words("C", 100))]
    p = build_prompt(docs, "q?", eng, max_new_tokens=100)
    assert p.tokens <= 1900
    assert [c.file for c in p.cuts] == ["a", "b"]
    kept = {c.file: c.tokens_kept for c in p.cuts}
    assert abs(kept["a"] - kept["b"]) <= 30  # both cut to about the same level


def test_cut_end_keeps_beginning():
    eng = FakeEngine(context_length=500)
    p = build_prompt([Doc("d", words("D", 1000))], "q?", eng, max_new_tokens=50, cut="end")
    assert p.cuts[0].where == "end" and "D0 " in p.user and "D999" not in p.user
    assert p.tokens <= 450


def test_profile_context_cap_applies():
    eng = FakeEngine(context_length=10000)
    p = build_prompt([Doc("d", words("D", 1000))], "q?", eng, max_new_tokens=50, context_length=600)
    assert p.context_length == 600 and p.tokens <= 550 and p.cuts


def test_cut_names_pages_for_pdfs():
    pages = [words(f"p{i}w", 100) for i in range(1, 11)]
    text, starts, off = "", [], 0
    for i, page in enumerate(pages, start=1):
        if text:
            text += "\n\n"
        starts.append((i, len(text)))
        text += page
    doc = Document(name="book.pdf", kind="pdf", text=text, pages=10, page_starts=starts)
    eng = FakeEngine(context_length=600)
    p = build_prompt([doc], "q?", eng, max_new_tokens=50)
    c = p.cuts[0]
    assert c.first_page is not None and 1 <= c.first_page <= c.last_page <= 10
    assert c.first_page <= 4 and c.last_page >= 7
    assert "pages" in c.describe()


def test_question_too_long_is_an_error():
    eng = FakeEngine(context_length=100)
    with pytest.raises(PromptError, match="question and chat template alone"):
        build_prompt([Doc("d", "text")], words("q", 200), eng, max_new_tokens=10)
    with pytest.raises(PromptError, match="max-new-tokens"):
        build_prompt([Doc("d", "text")], "q?", eng, max_new_tokens=100)


def test_document_dropped_entirely_when_no_room():
    eng = FakeEngine(context_length=200)
    question = words("q", 60)
    p = build_prompt([Doc("d", words("D", 5000))], question, eng, max_new_tokens=50)
    assert p.tokens <= 150
    assert p.cuts[0].where in ("all", "middle")


def test_empty_documents_left_out():
    eng = FakeEngine()
    p = build_prompt([Doc("scan.pdf", "  "), Doc("b", "hello")], "q?", eng, max_new_tokens=10)
    assert "scan.pdf" not in p.user and "hello" in p.user


def test_water_fill():
    assert water_fill([10, 20], 100) == [10, 20]
    assert water_fill([3000, 1000, 200], 3500) == [2300, 1000, 200]
    assert water_fill([500, 500], 600) == [300, 300]
    assert water_fill([5], 0) == [0]


def test_template_overhead_is_counted():
    eng = FakeEngine(context_length=10_000)
    p = build_prompt([Doc("d", "x y z")], "q?", eng, max_new_tokens=10)
    expected = TEMPLATE_TOKENS + len(SYSTEM_PROMPT.split()) + len(p.user.split())
    assert p.tokens == expected
