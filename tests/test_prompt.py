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


def test_a_cut_prompt_says_the_room_it_kept_for_the_question():
    from fpcli.prompt import FILL_SLACK_TOKENS, question_allowance

    eng = FakeEngine(context_length=8192)
    docs = [Doc("long.txt", words("L", 20000))]
    p = build_prompt(docs, "q?", eng, max_new_tokens=8)
    assert p.cuts and p.question_room == question_allowance(p.budget) > 0
    # the prompt used is the fit (budget - room, to within the slack) plus this short question
    question = len(eng.encode_chat(None, format_user([("long.txt", "")], "q?"))) - len(
        eng.encode_chat(None, format_user([("long.txt", "")], "")))
    assert abs(p.tokens - question - (p.budget - p.question_room)) <= FILL_SLACK_TOKENS
    assert p.to_dict()["question_room"] == p.question_room
    whole = build_prompt([Doc("short.txt", words("S", 100))], "q?", eng, max_new_tokens=8)
    assert not whole.cuts and whole.question_room == 0
    # a question longer than the room gets the documents cut for it: no room kept
    long_q = build_prompt(docs, words("Q", 1000) + "?", eng, max_new_tokens=8)
    assert long_q.cuts and long_q.question_room == 0 and long_q.tokens <= long_q.budget


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
    # every number with thousands separators, as in the other messages ("context 1,024")
    with pytest.raises(PromptError, match=r"need \d,\d{3} tokens, more than the 1,004 available "
                                          r"\(context 1,024 - 20 for the answer\)"):
        build_prompt([Doc("d", "text")], words("q", 1500), FakeEngine(context_length=1024), max_new_tokens=20)
    with pytest.raises(PromptError, match="--max-new-tokens 1,024 leaves no room .* context of 1,024 tokens"):
        build_prompt([Doc("d", "text")], "q?", FakeEngine(context_length=1024), max_new_tokens=1024)
    with pytest.raises(PromptError, match="max-new-tokens"):
        build_prompt([Doc("d", "text")], "q?", eng, max_new_tokens=100)


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


# -- fill: a cut keeps >= 90% of the budget, for any token density profile ---------------------


def _section(kind: str, n: int, rng) -> str:
    """``n`` lines of one token-density kind (tokens per character differ by ~10x between kinds)."""
    if kind == "toc":  # a table of contents: short entries, dot leaders, page numbers
        return "\n".join(f"{i}.{rng.randint(1, 9)} Part {rng.randint(1, 99)} {'.' * rng.randint(3, 30)} {rng.randint(1, 400)}"
                         for i in range(n))
    if kind == "numbers":  # a table of figures
        return "\n".join(" ".join(f"{rng.uniform(-1e4, 1e4):.3f}" for _ in range(8)) for _ in range(n))
    if kind == "cjk":
        return "\n".join("".join(chr(rng.randint(0x4E00, 0x62FF)) for _ in range(30)) for _ in range(n))
    if kind == "long_words":  # few tokens per character for a whitespace tokenizer
        return "\n".join(" ".join("x" * rng.randint(15, 40) for _ in range(4)) for _ in range(n))
    if kind == "blank":  # layout whitespace, as PDF extraction leaves it
        return "\n".join(" " * rng.randint(5, 60) + f"w{i}" for i in range(n))
    words = ["the", "harbour", "authority", "approved", "terminal", "budget", "of", "in", "2023", "ferries"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(n))


PROFILES = {
    "toc_first": ["toc", "prose", "prose", "prose"],
    "toc_last": ["prose", "prose", "prose", "toc"],
    "dense_middle": ["long_words", "numbers", "numbers", "long_words"],
    "sparse_start_dense_end": ["long_words", "long_words", "prose", "cjk"],
    "mixed": ["blank", "toc", "cjk", "prose", "numbers", "long_words"],
}


def adversarial_doc(profile: str, seed: int, lines: int) -> str:
    import random

    rng = random.Random(seed)
    return "\n\n".join(_section(kind, lines, rng) for kind in PROFILES[profile])


@pytest.mark.parametrize("cut", ["middle", "end"])
@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cut_fills_the_budget_whatever_the_density_fake_tokenizer(profile, seed, cut):
    eng = FakeEngine(context_length=2048)
    docs = [Doc("a.txt", adversarial_doc(profile, seed, 150)), Doc("b.txt", adversarial_doc(profile, seed + 7, 40))]
    p = build_prompt(docs, "What is the budget?", eng, max_new_tokens=128, cut=cut)
    assert p.cuts, "the documents must exceed the budget for this test"
    assert 0.9 * p.budget <= p.tokens <= p.budget, (p.tokens, p.budget)
    for c in p.cuts:
        assert c.where == cut and c.tokens_kept + c.tokens_dropped == c.tokens_total


def test_cut_keeps_exactly_the_tokens_it_reports():
    """Cuts fall on token boundaries: the kept head and tail are exactly ``tokens_kept`` tokens."""
    eng = FakeEngine(context_length=1000)
    doc = Doc("d", adversarial_doc("toc_first", 3, 100))
    p = build_prompt([doc], "q?", eng, max_new_tokens=100)
    c = p.cuts[0]
    kept = eng.count_tokens(doc.text[: c.char_start]) + eng.count_tokens(doc.text[c.char_end:])
    assert kept == c.tokens_kept and c.tokens_total == eng.count_tokens(doc.text)


def test_answer_budget_that_eats_the_context_is_reported():
    eng = FakeEngine(context_length=8192)
    p = build_prompt([Doc("d", words("D", 20000))], "q?", eng, max_new_tokens=8000)
    assert p.cuts and p.budget == 192
    note = p.to_dict()["budget_note"]
    assert note and "--max-new-tokens 8,000" in note and "leaving 192" in note
    # an ordinary cut has no such note
    assert build_prompt([Doc("d", words("D", 20000))], "q?", eng, max_new_tokens=256).to_dict()["budget_note"] is None


def test_no_document_token_fits_is_a_usage_error():
    from fpcli.prompt import NoRoomError

    eng = FakeEngine(context_length=200)
    with pytest.raises(NoRoomError, match="no document token fits.*--max-new-tokens"):
        build_prompt([Doc("d", words("D", 5000))], words("q", 85), eng, max_new_tokens=50)


# -- the same with the embedded model's real tokenizer (byte-level BPE) --------------------------


@pytest.fixture(scope="module")
def real_engine(smollm2):
    from fpcli.engine.transformers_engine import TransformersEngine

    with TransformersEngine(smollm2, device="cpu", timing=False) as eng:
        yield eng


@pytest.mark.parametrize("cut", ["middle", "end"])
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cut_fills_the_budget_whatever_the_density_real_tokenizer(real_engine, profile, cut):
    for seed in (0, 1):
        doc = Doc("manual.pdf", adversarial_doc(profile, seed, 120))
        p = build_prompt([doc], "What is the budget?", real_engine, max_new_tokens=256, context_length=2048, cut=cut)
        assert p.cuts and p.doc_tokens["manual.pdf"] >= 2 * p.budget
        assert 0.9 * p.budget <= p.tokens <= p.budget, (profile, seed, p.tokens, p.budget)
        assert len(real_engine.encode_chat(SYSTEM_PROMPT, p.user)) == p.tokens


def test_real_token_starts_count_the_tokens(real_engine):
    text = adversarial_doc("mixed", 5, 20)
    starts = real_engine.token_starts(text)
    assert len(starts) == real_engine.count_tokens(text)
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] < len(text)


# -- a first fit tokenizes a long document once --------------------------------------------------


def test_document_far_over_the_budget_is_not_encoded_whole():
    """A document whose estimate (template + its tokens) is far over the budget goes straight to
    the cut: no ``encode_chat`` of the whole text (a 165K-token PDF in a 131K context was encoded
    whole once only to learn that it did not fit)."""
    eng = FakeEngine(context_length=1000)
    text = words("w", 5000)
    p = build_prompt([Doc("big.txt", text)], "Where?", eng, max_new_tokens=100)
    assert p.cuts and 0.9 * p.budget <= p.tokens <= p.budget
    assert all("w2500 " not in user for _, user in eng.prompts), "the whole document was encoded"


def test_document_near_the_budget_is_still_tried_whole():
    """Within the join margin of the budget the estimate cannot decide: the whole prompt is
    measured, and a document that fits stays whole."""
    eng = FakeEngine(context_length=1000)
    overhead = len(eng.encode_chat(SYSTEM_PROMPT, format_user([("a.txt", "")], "")))
    n = 900 - overhead - 2  # fits with the two words of "Where?" ... after "Question:"
    p = build_prompt([Doc("a.txt", "\n\n" + words("w", n) + "   \n")], "Where?", eng, max_new_tokens=100)
    assert p.cuts == [] and p.tokens <= p.budget and f"w{n - 1}" in p.user


def test_stripped_tokens_counts_tokens_inside_the_stripped_text():
    from fpcli.prompt import _stripped_tokens

    assert _stripped_tokens("  ab cd  ", [0, 2, 4, 7]) == 2
    assert _stripped_tokens("ab", [0, 1]) == 2
    assert _stripped_tokens("   ", [0]) == 0


def test_first_fit_encodes_the_cut_prompt_once():
    """The fit's attempt is built with the question and measured without it: when it lands, it is
    the answer's prompt (no second encode of the cut documents), and it is the prompt that a
    cached fit then builds for the same question."""
    from fpcli.doccache import CacheConfig, DiskCache
    from fpcli.prompt import FitCache

    import tempfile
    from pathlib import Path

    eng = FakeEngine(context_length=1000)
    docs = [Doc("big.txt", words("w", 5000))]
    with tempfile.TemporaryDirectory() as tmp:
        cache = FitCache(DiskCache(CacheConfig(root=Path(tmp)), "fits"), "tok")
        first = build_prompt(docs, "Where is it?", eng, max_new_tokens=100, fit_cache=cache)
        with_docs = [user for _, user in eng.prompts if "w0 " in user]
        assert len(with_docs) == 1, f"{len(with_docs)} encodes of the cut documents"
        again = build_prompt(docs, "Where is it?", FakeEngine(context_length=1000), max_new_tokens=100,
                             fit_cache=cache)
    assert first.cuts and first.ids == again.ids and first.user == again.user
    assert 0.9 * first.budget <= first.tokens <= first.budget


# -- the prompt names a document the same however its path was typed --------------------------


def test_same_file_by_relative_and_absolute_path_gives_the_same_prompt(tmp_path, monkeypatch):
    """The document header held the path as typed: ``examples/report.md`` and its absolute path
    gave different prompt tokens, so a resident engine could not reuse the KV cache. Now the same
    ids, whole or cut, with or without the fit cache; cut records keep the user's name."""
    from fpcli.doccache import CacheConfig, fit_cache_for
    from fpcli.ingest import ingest

    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "report.md").write_text(words("w", 3000))
    monkeypatch.chdir(tmp_path)
    rel, absolute = "examples/report.md", str(tmp_path / "examples" / "report.md")
    eng = FakeEngine(context_length=8000)
    for context in (8000, 1000):  # whole, then cut
        a = build_prompt(ingest([rel]), "Where?", eng, max_new_tokens=100, context_length=context)
        b = build_prompt(ingest([absolute]), "Where?", eng, max_new_tokens=100, context_length=context)
        assert a.ids == b.ids and a.user == b.user, context
        assert '<document name="report.md">' in a.user and rel not in a.user and absolute not in a.user
        assert a.doc_tokens == {rel: 3000} and b.doc_tokens == {absolute: 3000}
        assert bool(a.cuts) == (context == 1000)
    assert [c.file for c in a.cuts] == [rel] and [c.file for c in b.cuts] == [absolute]
    fits = fit_cache_for(CacheConfig(root=tmp_path / "cache"), "fake-model")
    first = build_prompt(ingest([absolute]), "Where?", eng, max_new_tokens=100, context_length=1000, fit_cache=fits)
    again = build_prompt(ingest([rel]), "Where?", eng, max_new_tokens=100, context_length=1000,
                         fit_cache=fits)  # from the cache
    assert again.ids == first.ids and [c.file for c in again.cuts] == [rel] and again.doc_tokens == {rel: 3000}


def test_prompt_names_keep_two_files_of_one_name_apart(tmp_path, monkeypatch):
    from fpcli.prompt import prompt_names

    monkeypatch.chdir(tmp_path)
    assert prompt_names(["a/report.md", "b/report.md", "notes.txt", "-"]) == ["a/report.md", "b/report.md",
                                                                               "notes.txt", "-"]
    assert prompt_names(["x/a/r.md", str(tmp_path / "y/a/r.md")]) == ["x/a/r.md", "y/a/r.md"]
    assert prompt_names(["report.md"]) == prompt_names([str(tmp_path / "report.md")]) == ["report.md"]
