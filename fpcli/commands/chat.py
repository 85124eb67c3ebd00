"""``fp chat FILE...``: read and fit the documents once, then answer questions in a loop.

Every prompt is the same system message, the same (fitted) documents, then the earlier turns
(``--history``) and the question, so each question after the first reuses the documents' KV
cache (the engines keep it: ``GenerationResult.cached_tokens``). Questions come from stdin, one
per line (a ``> `` prompt on stderr when stdin is a terminal); answers stream to stdout, separated
by a blank line, one summary line per answer goes to stderr; EOF, ``/exit`` or ``/quit`` ends the session; ``/help`` lists the commands.
The header counts the shared tokens (``shared_prefix_tokens``): the documents' part up to where
the prompts of different questions begin to differ.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from fpcli.commands import (
    MODEL_HELP,
    PROFILE_HELP,
    engine_start_seconds,
    CONTEXT_HELP,
    StdoutStream,
    FpCommand,
    check_max_new_tokens_or_exit,
    check_model_or_exit,
    context_or_exit,
    context_source,
    obtain_engine,
    fail,
    load_profile_or_exit,
    error,
    note,
    stderr_console,
    warn_precision,
    print_bad_paths,
)
from fpcli.commands.ask import CutChoice, EngineChoice, _one_line

app = typer.Typer()

EXIT_COMMANDS = ("/exit", "/quit")
HELP_COMMAND = "/help"
COMMAND = re.compile(r"/[A-Za-z][\w-]*")  # a whole line like this is a command, never a question
HISTORY_RESERVE = 1024  # tokens kept free for the earlier turns with --history when the documents
# must be cut (never over a quarter of the budget); the question's room is fpcli.prompt.QUESTION_ALLOWANCE


class ChatCommand(FpCommand):
    required_args = ("files",)


@app.command("chat", cls=ChatCommand, no_args_is_help=True)
def chat(
    files: Annotated[
        Optional[list[str]],
        typer.Argument(metavar="FILE", help="PDF, HTML (.html, .htm: visible text only), .txt or .md files (read once). Required.", show_default=False),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help=MODEL_HELP),
    ] = None,
    context: Annotated[Optional[str], typer.Option("--context", "-c", help=CONTEXT_HELP, show_default=False)] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP)] = "bf16",
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: SGLang when CUDA and sglang are present, else transformers.")] = EngineChoice.auto,
    history: Annotated[bool, typer.Option("--history/--no-history", help="Put earlier questions and answers after the documents (the oldest are dropped when they no longer fit).")] = True,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", min=1, help="Longest answer, in tokens.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0, help="0 = greedy.")] = 0.0,
    password: Annotated[Optional[str], typer.Option("--password", help="Password of encrypted PDFs.")] = None,
    cut: Annotated[CutChoice, typer.Option("--cut", help="When the documents exceed the context: cut the middle (keep start and end) or the end.")] = CutChoice.middle,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object per answer, one per line (fp.ask/1), instead of streaming.")] = False,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the model in this process even when a resident engine (fp start) runs.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show other libraries' log lines, warnings and progress bars.")] = False,
) -> None:
    """Answer questions about the documents FILE... in a loop, reusing their KV cache.

    Questions are read from standard input, one per line, until end of input, /exit or /quit (/help lists the commands). Each answer streams to stdout; a summary line (prompt and cached tokens, TTFT, decode speed, density, wall time) goes to stderr.
    """
    from fpcli.logs import third_party_output

    with third_party_output(verbose):
        _chat(list(files or []), model, profile, engine, history, max_new_tokens, temperature, password, cut, json_out,
              verbose, no_server, context)


def _chat(files, model, profile, engine, history, max_new_tokens, temperature, password, cut, json_out, verbose,
          no_server, context=None) -> None:
    from fpcli.ingest import check_paths, ingest
    from fpcli.prompt import PromptError, build_prompt
    from fpcli.report import render_cuts, render_ingestion

    err = stderr_console()
    if not files:
        fail("missing FILE (usage: fp chat FILE...)", code=2)
    problems = check_paths(files)
    if problems:
        print_bad_paths(err, problems)
        raise typer.Exit(2)
    prof = load_profile_or_exit(profile)
    check_model_or_exit(model)
    prof = context_or_exit(context, prof, model, engine.value)
    check_max_new_tokens_or_exit(max_new_tokens, model, prof)

    from fpcli.doccache import DiskCache, default_config, fit_cache_for

    cache_config = default_config()  # a repeat reads neither the PDFs nor the tokens again
    t_setup = time.perf_counter()
    with err.status("reading documents") as status:
        docs = ingest(files, password=password, on_file=lambda n: status.update(f"reading {n}"),
                      cache=DiskCache(cache_config, "documents"))
    read_s = time.perf_counter() - t_setup
    render_ingestion(err, docs)
    usable = [d for d in docs if d.ok and d.text.strip()]
    if not usable:
        fail("no readable document remains (see the reasons above)" if len(docs) > 1 else "no readable document (see the reason above)")

    from fpcli.engine.context import ContextError

    t_load = time.perf_counter()
    try:
        eng = obtain_engine(engine.value, model, prof, err, no_server, err, verbose=verbose)
    except typer.Exit:
        raise
    except ContextError as exc:
        fail(f"{context_source(prof, context)}: {exc}", code=2)
    except Exception as exc:  # noqa: BLE001 - one line for any load failure
        fail(f"cannot load the model: {_one_line(exc)}")
    engine_start_s = engine_start_seconds(eng, t_load)
    warn_precision(err, prof, eng)
    with eng:
        check_max_new_tokens_or_exit(max_new_tokens, None, prof, context_length=eng.context_length)
        ctx = min(eng.context_length, prof.engine.context_length or eng.context_length)
        reserve = min(HISTORY_RESERVE, max(0, (ctx - max_new_tokens) // 4)) if history else 0
        try:  # fit the documents once, leaving room for the question (and the turns)
            fitted = build_prompt(usable, "", eng, max_new_tokens + reserve, context_length=ctx, cut=cut.value,
                                  fit_cache=fit_cache_for(cache_config, eng.model_path))
        except PromptError as exc:
            fail(str(exc))
        render_cuts(err, fitted, turns_reserve=reserve)
        shared = shared_prefix_tokens(eng, fitted, history)
        err.print(
            f"[dim]{eng.name} engine, model {eng.model_name}, profile {prof.name}: {len(fitted.documents)} "
            f"document{'s' if len(fitted.documents) != 1 else ''}; system message and documents: {shared:,} tokens, "
            f"which each question after the first reuses from the KV cache; each prompt adds the "
            f"question{' and the earlier turns' if history else ''} and the chat template's closing tokens "
            f"(see 'prompt tokens' after each answer); ask one question per line, "
            f"{EXIT_COMMANDS[0]} or end of input to quit, /help for the commands[/]",
            highlight=False,
        )
        loop = _ChatLoop(eng, prof, docs, fitted, ctx, max_new_tokens, temperature, history, json_out, err,
                         setup=_Setup(read_s, engine_start_s, time.perf_counter() - t_setup))
        loop.run(sys.stdin)


def shared_prefix_tokens(eng, fitted, history: bool) -> int:
    """Tokens at the start of ``fitted.ids`` (the system message and the documents, encoded with an
    empty question) that every prompt of this chat shares: what the engine's KV cache can serve to
    each question after the first. Fewer than ``fitted.tokens``: the chat template's closing tokens
    after the question differ, and with ``history`` the earlier turns come before ``Question:``.

    Returns:
        the shared token count (``0 <= n <= fitted.tokens``).
    """
    from fpcli.engine.tokens import common_prefix_len
    from fpcli.prompt import SYSTEM_PROMPT, format_user

    turns = [("x", "x")] if history else []  # a later question: its earlier turns follow the documents
    return common_prefix_len(fitted.ids, eng.encode_chat(SYSTEM_PROMPT, format_user(fitted.documents, "x", turns)))


@dataclass(frozen=True)
class _Setup:
    """What ``fp chat`` spent before its first question, in seconds: reading the documents, starting
    the engine (0.0: a resident one answered) and all of it (fitting the documents included)."""

    read_s: float = 0.0
    engine_start_s: float = 0.0
    total_s: float = 0.0


class _ChatLoop:
    """The question loop of one ``fp chat``. The first answer's report counts the set-up
    (``_Setup``: its ``stages_s.read`` and ``engine_start_s``, and its ``wall_s``, which adds the
    set-up to the answer's time); each later one counts only its own question. An answer that gives
    no report (interrupted, or a question that does not fit) leaves the set-up to the next report."""

    def __init__(self, eng, prof, docs, fitted, ctx, max_new_tokens, temperature, history, json_out, err,
                 setup: "_Setup" = None) -> None:
        self.eng, self.prof, self.docs, self.fitted = eng, prof, docs, fitted
        self.ctx, self.max_new_tokens, self.temperature = ctx, max_new_tokens, temperature
        self.history, self.json_out, self.err = history, json_out, err
        self.setup = setup or _Setup()
        self.turns: list[tuple[str, str]] = []
        self.answered = 0  # answers written to stdout so far
        self.reported = 0  # answers reported (an interrupted one is not)

    def run(self, stdin) -> None:
        interactive = stdin.isatty()
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                sys.stderr.write("\n")
                return
            if not line:  # end of input
                return
            question = line.strip()
            if not question:
                continue
            if question.split()[0].lower() in EXIT_COMMANDS:  # "/exit now" ends the chat too
                return
            if COMMAND.fullmatch(question):  # /help, or a command chat does not know: never a question
                self.command(question)
                continue
            self.answer(question)

    def command(self, word: str) -> None:
        """Answer a slash command locally: ``/help`` lists the commands; any other is an error
        that lists them (the session goes on)."""
        listing = f"commands: {', '.join(EXIT_COMMANDS)} end the chat (so does end of input); {HELP_COMMAND} shows this"
        if word.lower() == HELP_COMMAND:
            self.err.print(listing + "; any other line is a question about the documents", highlight=False,
                           soft_wrap=True, markup=False)
        else:
            error(self.err, f"unknown command {word}; {listing}")

    def prompt_for(self, question: str):
        """The ``Prompt`` of ``question`` (documents, the turns that fit, the question), or ``None``
        after saying why it cannot fit."""
        from fpcli.prompt import SYSTEM_PROMPT, Prompt, engine_reserve, format_user

        reserved = engine_reserve(self.eng, self.max_new_tokens)
        budget = self.ctx - self.max_new_tokens - reserved
        turns = list(self.turns) if self.history else []
        while True:
            user = format_user(self.fitted.documents, question, turns)
            ids = self.eng.encode_chat(SYSTEM_PROMPT, user)
            if len(ids) <= budget or not turns:
                break
            turns.pop(0)
        dropped = len(self.turns) - len(turns) if self.history else 0
        if dropped:
            note(self.err, f"the {dropped} oldest earlier turn(s) no longer fit the context; left out of this prompt")
        if len(ids) > budget:
            error(self.err, f"this question needs {len(ids) - budget:,} tokens more than the prompt budget "
                            f"of {budget:,} (context {self.ctx:,} - {self.max_new_tokens:,} for the answer); ask a shorter one")
            return None
        return Prompt(SYSTEM_PROMPT, user, ids, self.ctx, self.max_new_tokens, dict(self.fitted.doc_tokens),
                      list(self.fitted.cuts), list(self.fitted.documents), self.fitted.question_room, reserved)

    def answer(self, question: str) -> None:
        from fpcli.prefill_progress import PrefillDisplay
        from fpcli.report import ask_report, summary_line

        t0 = time.perf_counter()
        prompt = self.prompt_for(question)
        fit_s = time.perf_counter() - t0
        if prompt is None:
            return
        stream = StdoutStream()
        if self.answered and not self.json_out:  # a blank line between answers: a cut one never runs into the next
            sys.stdout.write("\n")
        self.answered += 1

        try:
            with PrefillDisplay(self.err, prompt.tokens) as display:
                result = self.eng.generate(
                    prompt.ids, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    on_text=None if self.json_out else display.wrap(stream), on_progress=display.on_progress,
                    on_cached=display.on_cached,
                )
        except KeyboardInterrupt:  # cancels this answer only; the session goes on
            sys.stdout.write("\n")
            sys.stdout.flush()
            note(self.err, "interrupted; ask the next question, or /exit")
            return
        except Exception as exc:  # noqa: BLE001
            if not self.json_out:
                sys.stdout.write("\n")
            fail(f"generation failed: {_one_line(exc)}")
        first = self.reported == 0  # the set-up counts in the first report
        setup = self.setup if first else _Setup()
        self.reported += 1
        data = ask_report(result, question, self.docs, prompt, self.prof,
                          wall_s=time.perf_counter() - t0 + setup.total_s, engine_start_s=setup.engine_start_s,
                          read_s=setup.read_s, fit_s=fit_s, context_length=self.eng.context_length)
        if self.json_out:
            import json

            sys.stdout.write(json.dumps(data, ensure_ascii=False) + "\n")
        elif not stream.last.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        self.err.print(summary_line(data), highlight=False, soft_wrap=True, markup=False)
        if self.history:
            self.turns.append((question, result.text))

