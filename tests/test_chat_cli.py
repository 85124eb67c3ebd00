"""``fp chat``, the timing fields and the quiet terminal, with the fake engine (fast).

The real embedded model runs the same paths in ``tests/test_sessions_cpu.py``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from fp_fakes import invoke
from test_cli import TESTS, _fp


def test_chat_answers_each_line_until_exit(runner, fake_engine, doc):
    r = invoke(runner, ["chat", str(doc)], input="What is the code?\n\nAnd the revenue?\n/exit\nnever asked\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "The answer is 42.\n\nThe answer is 42.\n"  # a blank line between answers
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("prompt tokens")]
    assert len(lines) == 2 and all("TTFT" in ln and "tokens/s" in ln and "density" in ln for ln in lines)
    eng = fake_engine()
    users = [u for _, u in eng.prompts if "Question: " in u and not u.endswith(("Question: ", "Question: x"))]
    assert len(users) == 2 and len(eng.generated) == 2
    docs_part = users[0].split("Question: ")[0]
    assert users[1].startswith(docs_part.rstrip())  # the documents are the shared prefix
    assert "Earlier question: What is the code?\nYour answer: The answer is 42." in users[1]
    assert eng.closed
    assert "> " not in r.stderr  # no prompt when stdin is not a terminal


def test_chat_header_counts_what_the_summary_lines_count(runner, fake_engine, doc, monkeypatch):
    monkeypatch.setenv("FP_FAKE_ANSWER", "cut short because the answer ran out of")
    r = invoke(runner, ["chat", str(doc), "-n", "4"], input="What is the code?\nAnd the revenue?\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "cut short because the \n\ncut short because the \n"  # cut answers stay apart
    err = " ".join(r.stderr.split())
    assert "prompt tokens before the question" not in err
    header = int(re.search(r"system message and documents: ([\d,]+) tokens", err).group(1).replace(",", ""))
    first = int(re.search(r"prompt tokens ([\d,]+)", err).group(1).replace(",", ""))
    # the fake counts a word a token; with --history the second prompt has "Earlier question: ..."
    # where the first has "Question:": the shared part ends with the documents
    assert first == header + len("Question: What is the code?".split())
    assert "adds the question and the earlier turns" in err and "reuses from the KV cache" in err
    assert "1 document; " in err and "document(s)" not in err


def test_chat_no_history_sends_the_same_prefix_and_only_the_question(runner, fake_engine, doc):
    r = invoke(runner, ["chat", str(doc), "--no-history"], input="first?\nsecond?\n")
    assert r.exit_code == 0, r.stderr
    users = [u for _, u in fake_engine().prompts if u.endswith(("first?", "second?"))]
    assert [u.rsplit("Question: ", 1)[0] for u in users] == [users[0].rsplit("Question: ", 1)[0]] * 2
    assert "Earlier question" not in users[1]


def test_chat_takes_context_as_ask_does(runner, fake_engine, doc):
    r = invoke(runner, ["chat", str(doc), "--context", "2k", "--no-server"], input="What is the code?\n")
    assert r.exit_code == 0, r.stderr
    assert fake_engine().requested["profile"].engine.context_length == 2048
    bad = invoke(runner, ["chat", str(doc), "--context", "lots"], input="")
    assert bad.exit_code == 2 and "--context" in bad.stderr


def test_chat_json_is_one_report_per_line(runner, fake_engine, doc):
    """One report per answer; the first counts the chat's set-up (reading the documents, the
    engine start: both were 0.0), the later ones only their question."""
    r = invoke(runner, ["chat", str(doc), "--json"], input="a?\nb?\n")
    assert r.exit_code == 0, r.stderr
    rows = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [row["question"] for row in rows] == ["a?", "b?"]
    for row in rows:
        s = row["summary"]
        assert row["schema"] == "fp.ask/1" and s["cached_tokens"] == 0
        assert s["wall_s"] > 0 and s["total_s"] > 0
    first, second = rows[0]["summary"], rows[1]["summary"]
    assert first["engine_start_s"] > 0 and first["stages_s"]["engine_start"] == first["engine_start_s"]
    assert first["stages_s"]["read"] > 0
    assert first["wall_s"] >= first["engine_start_s"] + first["stages_s"]["read"]  # the set-up is in it
    assert second["engine_start_s"] == 0.0 and second["stages_s"]["read"] == 0.0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("prompt tokens")]
    assert len(lines) == 2 and all(re.search(r", wall time \d+\.\d{3} s$", ln) for ln in lines), lines


def test_chat_answers_slash_commands_itself(runner, fake_engine, doc):
    """/help lists the commands; an unknown one is an error naming them; neither reaches the model,
    and the session goes on."""
    r = invoke(runner, ["chat", str(doc)], input="/help\n/frobnicate\nWhat is the code?\n/quit\nnever asked\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout == "The answer is 42.\n"
    err = " ".join(r.stderr.split())
    assert "commands: /exit, /quit end the chat" in err and "/help shows this" in err
    assert "fp: error: unknown command /frobnicate; commands: /exit, /quit" in err
    asked = [u for _, u in fake_engine().prompts if "Question: " in u and not u.endswith(("Question: ", "Question: x"))]
    assert len(asked) == 1 and asked[0].endswith("What is the code?")


def test_chat_exit_with_trailing_words_ends_the_chat(runner, fake_engine, doc):
    """``/exit now`` and ``/QUIT please`` are the command, never a question sent to the model."""
    for word in ("/exit now", "/QUIT please"):
        r = invoke(runner, ["chat", str(doc)], input=f"What is the code?\n{word}\nnever asked\n")
        assert r.exit_code == 0, r.stderr
        asked = [u for _, u in fake_engine().prompts if "Question: " in u]
        assert not any(word in u or "never asked" in u for u in asked), asked


def test_chat_cut_note_names_the_answer_and_the_turns_reserve_apart(runner, fake_engine, tmp_path):
    """The prompt budget of a chat whose documents are cut: the answer's tokens (-n) and the
    reserve for the later turns are named apart (they were summed as "for the answer")."""
    from fpcli.commands.chat import HISTORY_RESERVE

    long_doc = tmp_path / "long.txt"
    long_doc.write_text(" ".join(f"word{i}" for i in range(9000)) + "\n")
    r = invoke(runner, ["chat", str(long_doc), "-n", "15"], input="Who wrote it?\n", env={"FP_FAKE_CONTEXT": "8192"})
    assert r.exit_code == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert f"(context 8,192 - 15 for the answer - {HISTORY_RESERVE:,} kept for the later turns" in err, err
    assert f"{15 + HISTORY_RESERVE:,} for the answer" not in err
    plain = invoke(runner, ["chat", str(long_doc), "-n", "15", "--no-history"], input="Who wrote it?\n",
                   env={"FP_FAKE_CONTEXT": "8192"})
    assert "(context 8,192 - 15 for the answer" in " ".join(plain.stderr.split()) and "later turns" not in plain.stderr


def test_chat_bad_input(runner, fake_engine, tmp_path):
    r = invoke(runner, ["chat", str(tmp_path / "missing.txt")])
    assert r.exit_code == 2 and "missing.txt" in r.stderr
    r = invoke(runner, ["chat", str(tmp_path / "missing.txt"), "-n", "0"])
    assert r.exit_code == 2


def test_chat_too_long_question_is_refused_and_the_session_goes_on(runner, fake_engine, doc):
    long_q = " ".join(["word"] * 5000) + "?"
    r = invoke(runner, ["chat", str(doc)], input=f"{long_q}\nshort?\n", env={"FP_FAKE_CONTEXT": "4096"})
    assert r.exit_code == 0, r.stderr
    assert "ask a shorter one" in r.stderr
    assert r.stdout == "The answer is 42.\n"


def test_ask_json_has_cached_tokens_and_honest_times(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "q?", "--json"])
    assert r.exit_code == 0, r.stderr
    s = json.loads(r.stdout)["summary"]
    assert s["cached_tokens"] == 0
    assert s["wall_s"] >= s["engine_start_s"] + s["total_s"] - 1e-6 and s["engine_start_s"] > 0


def test_summary_rows(runner):
    from fpcli.report import prompt_tokens_text, time_row

    s = {"prompt_tokens": 813, "cached_tokens": 780, "total_s": 2.0, "ttft_s": 0.5, "wall_s": 9.0, "engine_start_s": 5.0}
    assert prompt_tokens_text(s) == "813 (780 cached)"
    label, value = time_row(s)
    assert label == "total time" and value.startswith("9.000 s (engine start 5.000 s, TTFT 0.500 s, decode 1.500 s, other 2.000 s)")
    assert time_row({**s, "wall_s": None})[0] == "generation time"  # never a 'total' that is not one
    assert prompt_tokens_text({**s, "cached_tokens": 0}) == "813"


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "COLUMNS": "200", **extra}
    return env


def test_total_time_covers_a_slow_engine_load(doc):
    """The total is the command's wall time: with a 1.5 s engine load it is at least that."""
    env = _env(FP_ENGINE_FACTORY="fp_fakes:fake_load_engine", FP_FAKE_LOAD_S="1.5")
    r = subprocess.run(_fp() + ["ask", str(doc), "q?"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    m = re.search(r"^total time +([\d.]+) s \((?:read [\d.]+ s, )?(?:fit [\d.]+ s, )?engine start ([\d.]+) s, TTFT",
                  r.stderr, re.M)
    assert m, r.stderr
    total, start = float(m.group(1)), float(m.group(2))
    assert start >= 1.5 and total >= start
    r = subprocess.run(_fp() + ["ask", str(doc), "q?", "--json"], capture_output=True, text=True, env=env, timeout=120)
    s = json.loads(r.stdout)["summary"]
    assert s["wall_s"] >= s["engine_start_s"] >= 1.5


@pytest.mark.parametrize("command", ["ask", "chat"])
def test_third_party_lines_only_with_verbose(doc, command):
    env = _env(FP_ENGINE_FACTORY="fp_fakes:noisy_load_engine")
    args = _fp() + [command, str(doc)] + (["q?"] if command == "ask" else [])
    quiet = subprocess.run(args, input="q?\n", capture_output=True, text=True, env=env, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "THIRD-PARTY" not in quiet.stderr and "TTFT" in quiet.stderr
    loud = subprocess.run(args + ["-v"], input="q?\n", capture_output=True, text=True, env=env, timeout=120)
    assert loud.returncode == 0, loud.stderr
    for what in ("transformers warning", "sglang warning", "python warning"):
        assert f"THIRD-PARTY {what}" in loud.stderr
    assert quiet.stdout == loud.stdout == "The answer is 42.\n"


def test_quiet_keeps_fp_engine_warnings_and_restores_levels(caplog):
    import logging

    from fpcli.logs import third_party_output

    before = [logging.getLogger(n).level for n in ("", "sglang", "fpcli.engine")]
    with third_party_output(verbose=False):
        logging.getLogger("sglang.srt.scheduler").warning("hidden third-party")
        logging.getLogger("fpcli.engine.sglang_engine").warning("kept fp engine warning")
    logging.getLogger("sglang.srt.scheduler").warning("shown again")
    messages = [r.getMessage() for r in caplog.records]
    assert "kept fp engine warning" in messages and "shown again" in messages
    assert "hidden third-party" not in messages
    assert [logging.getLogger(n).level for n in ("", "sglang", "fpcli.engine")] == before


def test_prefill_display_on_a_terminal_only_and_gone_before_the_answer():
    import io

    from rich.console import Console

    from fpcli.prefill_progress import PrefillDisplay

    buf = io.StringIO()
    term = Console(file=buf, force_terminal=True, width=120)
    got: list[str] = []
    with PrefillDisplay(term, 12345) as display:
        assert display.active
        display.on_progress(15, 30)
        display.wrap(got.append)("Answer")
        assert display.active is False  # stopped by the first answer piece
        display.on_progress(30, 30)  # late calls are harmless
    assert got == ["Answer"] and "prefilling 12,345 tokens" in buf.getvalue()

    pipe = io.StringIO()
    with PrefillDisplay(Console(file=pipe, force_terminal=False), 99) as display:
        display.on_progress(1, 2)
    assert pipe.getvalue() == ""  # a log or a pipe: nothing drawn


def test_prefill_label_counts_one_token_in_the_singular():
    import io

    from rich.console import Console

    from fpcli.prefill_progress import PrefillDisplay

    display = PrefillDisplay(Console(file=io.StringIO(), force_terminal=False), 1343)
    assert display.label(1342) == "prefilling 1 token (1,342 cached)"
    assert display.label(1341) == "prefilling 2 tokens (1,341 cached)"
    assert display.label() == "prefilling 1,343 tokens"


def test_chat_reports_the_set_up_with_the_next_answer_after_ctrl_c(runner, fake_engine, doc, monkeypatch):
    """Ctrl-C during the first answer gives no report; the set-up (reading, engine start) is then
    counted in the next answer's report, once."""
    from fp_fakes import FakeEngine

    real = FakeEngine.generate
    calls = []

    def interrupted_first(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(FakeEngine, "generate", interrupted_first)
    r = invoke(runner, ["chat", str(doc), "--json"], input="a?\nb?\nc?\n")
    assert r.exit_code == 0, r.stderr
    assert "interrupted; ask the next question" in r.stderr
    rows = [json.loads(ln)["summary"] for ln in r.stdout.splitlines() if ln.strip()]
    assert len(rows) == 2 and len(calls) == 3
    assert rows[0]["engine_start_s"] > 0 and rows[0]["stages_s"]["read"] > 0
    assert rows[1]["engine_start_s"] == 0.0 and rows[1]["stages_s"]["read"] == 0.0
