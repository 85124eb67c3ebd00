"""``fp ask FILE... QUESTION``: answer a question about documents."""
from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from fpcli.commands import (
    MODEL_HELP,
    PROFILE_HELP,
    engine_start_seconds,
    StdoutStream,
    FpCommand,
    check_max_new_tokens_or_exit,
    check_model_or_exit,
    check_output_path_or_exit,
    CONTEXT_HELP,
    context_or_exit,
    context_source,
    fail,
    note,
    is_file,
    load_profile_or_exit,
    looks_like_question,
    obtain_engine,
    render_answered_by,
    say_context,
    server_of,
    stderr_console,
    warn_precision,
    print_bad_paths,
    save_report_or_exit,
)

app = typer.Typer()

USAGE = "usage: fp ask FILE... QUESTION"


class AskCommand(FpCommand):
    # FILE and QUESTION are optional for the parser so that ``fp ask doc.txt`` reaches the
    # command, which then says "missing QUESTION" instead of click's "Missing argument 'FILE'"
    # (click hands a lone argument to the last parameter).
    required_args = ("files", "question")


class EngineChoice(str, Enum):
    auto = "auto"
    sglang = "sglang"
    transformers = "transformers"


class CutChoice(str, Enum):
    middle = "middle"
    end = "end"


@app.command("ask", cls=AskCommand, no_args_is_help=True)
def ask(
    files: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="FILE", help="PDF, HTML (.html, .htm: visible text only), .txt or .md files; '-' reads standard input (text or PDF). Required.", show_default=False),
    ] = None,
    question: Annotated[
        Optional[str], typer.Argument(metavar="QUESTION", help="The question, in quotes, after the files. Required.", show_default=False)
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help=MODEL_HELP),
    ] = None,
    context: Annotated[
        Optional[str],
        typer.Option("--context", "-c", help=CONTEXT_HELP, show_default=False),
    ] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP)] = "bf16",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Longest answer, in tokens.")] = 256,
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: the resident engine (fp start, SGLang or transformers) when one answers with the same model and profile, else the transformers engine for this one question in-process (on the CUDA GPU when there is one).")] = EngineChoice.auto,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy.")] = 0.0,
    password: Annotated[Optional[str], typer.Option("--password", help="Password of encrypted PDFs.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (answer, summary, ingestion) instead of the streamed answer.")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Also save the JSON report to this file.", dir_okay=False)] = None,
    cut: Annotated[CutChoice, typer.Option("--cut", help="When the documents exceed the context: cut the middle (keep start and end) or the end.")] = CutChoice.middle,
    page_timeout: Annotated[float, typer.Option("--page-timeout", min=0.1, help="Seconds allowed to extract one PDF page.")] = 20.0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary or progress on stderr (warnings and errors still shown).")] = False,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the model in this process even when a resident engine (fp start) runs.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show other libraries' log lines, warnings and progress bars.")] = False,
) -> None:
    """Answer QUESTION about the documents FILE... with a local model.

    Uses the resident engine (fp start) when it runs the same model and profile, else loads the model in-process.

    The answer streams to stdout; a summary (prompt tokens, TTFT, decode speed, attention density, FLOPs skipped, engine, model, profile) goes to stderr.

    If the documents exceed the model's context, the longest ones are cut and fp says what was cut and where.
    """
    from fpcli.logs import third_party_output

    with third_party_output(verbose):
        _ask(files, question, model, profile, max_new_tokens, engine, temperature, password, json_out, report, cut,
             page_timeout, quiet, verbose, context, no_server)


def _ask(files, question, model, profile, max_new_tokens, engine, temperature, password, json_out, report, cut,
         page_timeout, quiet, verbose, context, no_server) -> None:
    import time

    from fpcli.clock import process_age_s
    from fpcli.ingest import check_paths, ingest
    from fpcli.prefill_progress import PrefillDisplay
    from fpcli.doccache import fit_cache_for
    from fpcli.prompt import NoRoomError, PromptError, build_prompt
    from fpcli.report import ask_report, dumps, failed_report, render_cuts, render_ingestion, render_summary

    err = stderr_console(quiet=quiet)
    files = list(files or [])
    if question is None:
        fail(f"missing FILE and QUESTION ({USAGE})", code=2)
    if not files:  # one argument: the parser took it for the question
        if question == "-" or is_file(question):
            fail(f"missing QUESTION after {question} ({USAGE})", code=2)
        fail(f"missing FILE: no document given for the question {question!r} ({USAGE})", code=2)
    if not question.strip():
        fail("the question is empty", code=2)
    problems = check_paths(files)
    if problems:  # before loading anything: name every bad path
        print_bad_paths(err, problems)
        misplaced = [f for f in files if looks_like_question(f) and not is_file(f)]
        if misplaced and question != "-" and is_file(question):
            err.print(
                f"hint: {misplaced[0]!r} looks like the question; the question goes last ({USAGE})",
                highlight=False, soft_wrap=True, markup=False,
            )
        elif question != "-" and is_file(question) and not looks_like_question(question):
            err.print(f"hint: the last argument {question} is a file; is the QUESTION missing? ({USAGE})",
                      highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(2)
    if question != "-" and is_file(question) and not looks_like_question(question):
        fail(f"missing QUESTION: the last argument {question} is a file ({USAGE})", code=2)
    if report is not None:
        check_output_path_or_exit("--report", report)
    prof = load_profile_or_exit(profile)
    check_model_or_exit(model)
    prof = context_or_exit(context, prof, model, engine.value, one_request=True)
    check_max_new_tokens_or_exit(max_new_tokens, model, prof, engine=engine.value, one_request=True)

    from fpcli.doccache import DiskCache, default_config

    cache_config = default_config()
    t_read = time.perf_counter()
    doc_cache = DiskCache(cache_config, "documents")
    if quiet:
        docs = ingest(files, password=password, page_timeout=page_timeout, cache=doc_cache)
    else:
        with err.status("reading documents") as status:
            docs = ingest(files, password=password, page_timeout=page_timeout,
                          on_file=lambda n: status.update(f"reading {n}"), cache=doc_cache)
    read_s = time.perf_counter() - t_read
    render_ingestion(err, docs)
    usable = [d for d in docs if d.ok and d.text.strip()]

    def failed(message: str, code: int = 1, said: str | None = None) -> None:
        """Exit ``code`` saying ``said`` (default ``message``); with --json / --report, first the
        failed report (``failed_report``: each document's row, ``error`` = ``message``)."""
        if json_out or report is not None:  # the report still says what each document gave
            data = failed_report(question, docs, message)
            if json_out:
                sys.stdout.write(dumps(data) + "\n")
                sys.stdout.flush()
            if report is not None:
                save_report_or_exit(report, data)
        fail(said or message, code=code)

    if not usable:  # each file's reason was printed just above, once
        failed("no readable document remains" if len(docs) > 1 else "no readable document",
               said="no readable document remains (see the reasons above)" if len(docs) > 1
               else "no readable document (see the reason above)")

    from fpcli.engine.context import ContextError

    t_load = time.perf_counter()
    try:
        eng = obtain_engine(engine.value, model, prof, False if quiet else err, no_server, err, verbose=verbose,
                            one_request=True)
    except typer.Exit:
        raise
    except ContextError as exc:
        failed(f"{context_source(prof, context)}: {exc}", code=2)
    except Exception as exc:  # noqa: BLE001 - one line for any load failure
        failed(f"cannot load the model: {_one_line(exc)}")
    engine_start_s = engine_start_seconds(eng, t_load)

    context_info = say_context(None if quiet else err, eng)
    warn_precision(err, prof, eng)
    with eng:
        # a GGUF or hub model's context is only known now: the same usage error, exit 2
        check_max_new_tokens_or_exit(max_new_tokens, None, prof, context_length=eng.context_length)
        t_fit = time.perf_counter()
        try:
            prompt = build_prompt(
                usable, question, eng, max_new_tokens, context_length=prof.engine.context_length, cut=cut.value,
                fit_cache=fit_cache_for(cache_config, eng.model_path),
            )
        except PromptError as exc:
            code = 2 if context or isinstance(exc, NoRoomError) else 1
            failed(f"{context_source(prof, context)}: {exc}" if context else str(exc), code=code)
        fit_s = time.perf_counter() - t_fit
        render_cuts(err, prompt)
        if not quiet:
            err.print(f"[dim]{eng.name} engine, model {eng.model_name}, profile {prof.name}: "
                      f"{prefill_phrase(prompt.tokens, server_of(eng) is not None)}[/]", highlight=False)

        stream = StdoutStream()

        try:
            with PrefillDisplay(err, prompt.tokens, enabled=not quiet) as display:
                result = eng.generate(
                    prompt.ids, max_new_tokens=max_new_tokens, temperature=temperature,
                    on_text=None if json_out else display.wrap(stream), on_progress=display.on_progress,
                    on_cached=display.on_cached,
                )
        except KeyboardInterrupt:  # ends the partial answer; fp's one handler says "interrupted"
            sys.stdout.write("\n")
            raise
        except Exception as exc:  # noqa: BLE001
            sys.stdout.write("\n") if not json_out else None
            failed(f"generation failed: {_one_line(exc)}")

    data = ask_report(result, question, docs, prompt, prof, context=context_info,
                      start_phases=getattr(eng, "start_phases", None), wall_s=process_age_s(),
                      engine_start_s=engine_start_s, read_s=read_s, fit_s=fit_s,
                      context_length=eng.context_length)  # min_sparse_len fitted to it, as the engine runs
    data["summary"]["server"] = server_of(eng)  # None: answered in-process
    if json_out:
        sys.stdout.write(dumps(data) + "\n")
    elif not stream.last.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if report is not None:
        save_report_or_exit(report, data)
    if not quiet:
        render_summary(err, data)
        if render_answered_by(err, eng) is None and not json_out:
            render_resident_hint(err, eng, start_args(model, profile, context, engine.value))
        if report is not None:
            err.print(f"[dim]report saved to {report}[/]", highlight=False)


def prefill_phrase(tokens: int, resident: bool) -> str:
    """The static line's count before the request: ``prefilling 1,343 tokens`` for an engine this
    command loaded (its KV cache is empty: the whole prompt is prefilled), ``prompt 1,343 tokens``
    for the resident engine, whose KV cache may serve part of the prompt: it says how much only
    during the request (the live line on a terminal, then the summary's ``cached``)."""
    from fpcli.prefill_progress import tokens_phrase

    return f"{'prompt' if resident else 'prefilling'} {tokens_phrase(tokens)}"


def start_args(model: str | None, profile: str, context: str | None, engine: str) -> list[str]:
    """The ``fp start`` options whose resident engine this ``fp ask`` would use: its ``--model``,
    ``--profile`` (unless ``bf16``, fp start's default too), ``--context`` and a forced ``--engine``
    (``auto`` uses whichever engine runs: ``fpcli.server.client.connect``), as given."""
    args: list[str] = []
    for flag, value, default in (("--model", model, None), ("--profile", profile, "bf16"),
                                 ("--context", context, None), ("--engine", engine, "auto")):
        if value is not None and value != default:
            args += [flag, str(value)]
    return args


def render_resident_hint(console, eng, args: list[str] = ()) -> None:
    """After an answer from an engine this command loaded on a CUDA GPU (a cold start), one
    ``fp: note:`` line: ``fp start`` with ``args`` (``start_args`` of this command) keeps an engine
    resident that the same ``fp ask`` then uses, so follow-up questions skip the start."""
    import shlex

    from fpcli.engine import device_of

    if device_of(eng) == "cuda":
        command = shlex.join(["fp", "start", *args])
        note(console, f"`{command}` keeps an engine resident: follow-up questions with the same options then "
                      "answer in ~2 s, without starting an engine")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
