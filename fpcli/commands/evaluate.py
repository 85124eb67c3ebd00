"""``fp eval``: RULER-style accuracy of several profiles side by side on the user's model."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
from rich.markup import escape

from fpcli.commands import (
    MODEL_HELP,
    FpCommand,
    check_model_or_exit,
    check_output_path_or_exit,
    obtain_engine,
    fail,
    load_profile_or_exit,
    model_context,
    note,
    stderr_console,
    warning,
    print_bad_paths,
    save_report_or_exit,
)
from fpcli.commands.bench import repeated_note, unique_lengths
from fpcli.ruler.render import FEW_SAMPLES

app = typer.Typer()

DEFAULT_LENS = "4k,32k,128k"
DEFAULT_PROFILES = "dense,bf16,fp8"


class EngineChoice(str, Enum):
    auto = "auto"
    sglang = "sglang"
    transformers = "transformers"


class EvalUsageError(ValueError):
    """Bad input found only once the model is loaded (its context length): exit 2."""


@app.command("eval", cls=FpCommand)
def evaluate(
    tasks: Annotated[str, typer.Option("--task", help="Tasks, comma list: niah_single, niah_multikey, niah_multivalue, vt, cwe. Default: all.", show_default=False)] = "",
    lens: Annotated[Optional[list[str]], typer.Option("--len", "-l", help=f"Prompt lengths in tokens of the model's tokenizer: 4k, 32768, or a comma list; repeatable (a length given twice runs once). Default: those of {DEFAULT_LENS} that fit the model's context.", show_default=False, metavar="LENGTHS")] = None,
    profiles: Annotated[str, typer.Option("--profiles", "-p", help="Profiles side by side, comma list of names (bf16, accurate, fp8, dense; NAME+fp8 or NAME+int8qk for a profile at that precision) or .yaml paths; with dense among them, each sparse profile is compared with it sample by sample.")] = DEFAULT_PROFILES,
    samples: Annotated[int, typer.Option("--samples", "-n", min=1, help="Samples per (task, length); the same samples for every profile.")] = FEW_SAMPLES,
    seed: Annotated[str, typer.Option("--seed", help="Seed of the generated samples (same seed, same samples), or a comma list (0,1): each seed adds its own samples, and the table gives the spread between seeds.")] = "0",
    haystack: Annotated[Optional[list[str]], typer.Option("--haystack", help="Use your own document(s) as the haystack instead of generated text (repeat for several files).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: SGLang when CUDA and sglang are present, else transformers.")] = EngineChoice.auto,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (schema fp.eval/1) on stdout.")] = False,
    report: Annotated[Optional[Path], typer.Option("--report", help="Also save the JSON object to this file.", dir_okay=False)] = None,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the models in this process even when a resident engine (fp start) runs with one of the profiles.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or table on stderr (warnings and errors still shown).")] = False,
) -> None:
    """Score profiles side by side on RULER-style long-context tasks generated on the spot.

    Each sample (a haystack with hidden needles, a question, the expected strings) is built at the given length with the model's tokenizer, the same samples for every profile. One engine per profile is loaded in turn and closed before the next. Each cell (task x length x profile) shows the score (RULER string match, points 0-100), the mean TTFT and the mean attention density; a profile whose precision did not run is labelled with what ran.

    The table goes to stderr; --json prints every cell and sample on stdout. See docs/eval.md.
    """
    from fpcli.ruler.tasks import TASKS

    err = stderr_console(quiet=quiet)
    # -- bad input: exit 2 before loading anything -------------------------------------------------
    task_names = [t.strip() for t in tasks.split(",") if t.strip()] or list(TASKS)
    unknown = [t for t in task_names if t not in TASKS]
    if unknown:
        fail(f"--task: unknown task {unknown[0]!r} (allowed: {', '.join(TASKS)})", code=2)
    task_list = [TASKS[t] for t in dict.fromkeys(task_names)]
    try:
        lengths, repeated = unique_lengths(lens or [DEFAULT_LENS])
    except ValueError as exc:
        fail(str(exc), code=2)
    if repeated:
        note(err, repeated_note(repeated))
    try:
        seeds = list(dict.fromkeys(int(x) for x in seed.split(",") if x.strip()))
    except ValueError:
        seeds = []
    if not seeds:
        fail(f"--seed: expected an integer or a comma list of integers (example: 0,1), got {seed!r}", code=2)
    if report is not None:  # the paths first: checking them needs no model
        check_output_path_or_exit("--report", report)
    _check_haystack_paths_or_exit(haystack or [], err)
    names = [p.strip() for p in profiles.split(",") if p.strip()]
    if not names:
        fail("--profiles: no profile given (example: --profiles dense,bf16)", code=2)
    profs = [load_profile_or_exit(n) for n in names]
    seen: dict[str, str] = {}
    for n, p in zip(names, profs):
        if p.name in seen:
            if n == seen[p.name]:
                fail(f"--profiles: {n} is given twice; give each profile once", code=2)
            fail(f"--profiles: {n} and {seen[p.name]} are both named {p.name!r} (a profile's `name:`); "
                 f"give each profile once, or rename the copy", code=2)
        seen[p.name] = n
    check_model_or_exit(model)
    caps = [c for c in [model_context(model, engine.value)] + [p.engine.context_length for p in profs] if c]
    lens_note = None
    if not lens and caps:  # the defaults that fit; an explicit --len is checked strictly below
        fitting = [n for n in lengths if n <= min(caps)] or [min(caps)]
        if fitting != lengths:
            lens_note = (f"--len not given: {', '.join(map(str, fitting))} (the defaults up to the model's "
                    f"context of {min(caps):,} tokens)")
        lengths = fitting
    try:
        _check_lengths(lengths, task_list, min(caps) if caps else None)
    except EvalUsageError as exc:
        fail(str(exc), code=2)
    stack = _haystack_or_exit(haystack or [], err, quiet)
    if lens_note and not quiet:
        note(err, lens_note)
    n_built = len(task_list) * len(lengths) * samples * len(seeds)  # samples built; each runs once per profile
    if not quiet:
        n_runs = n_built * len(profs)
        note(err, f"{n_runs:,} prefill{'s' if n_runs != 1 else ''}: {n_built:,} sample{'s' if n_built != 1 else ''} x "
                  f"{len(profs)} profile{'s' if len(profs) != 1 else ''} (Ctrl-C stops and keeps the finished ones)")

    # -- the run -----------------------------------------------------------------------------------
    from fpcli.console import step_progress
    from fpcli.ruler.runner import eval_report, run_profiles
    from fpcli.ruler.tasks import TaskError, make_samples

    bar = step_progress(err, disable=quiet or not err.is_terminal)
    building = bar.add_task("building samples", total=n_built, visible=False)
    answering = bar.add_task("answering", total=n_built * len(profs), visible=False)

    def say(message: str) -> None:
        if not quiet:
            err.print(f"[dim]{escape(message)}[/]", highlight=False)

    def open_engine(prof):
        bar.stop()  # the loader shows its own status and download bars
        try:
            return obtain_engine(engine.value, model, prof, False if quiet else err, no_server, err)
        except Exception as exc:  # noqa: BLE001 - one line for any load failure
            raise _LoadFailed(f"cannot load the model for profile {prof.name}: {_one_line(exc)}") from exc
        finally:
            bar.start()

    def build(eng, context_length: int):
        _check_lengths(lengths, task_list, context_length)  # a GGUF or hub model's context is known now
        bar.update(building, visible=True)
        built = make_samples(task_list, lengths, samples, seeds, stack, eng, context_length,
                             on_sample=lambda s: bar.advance(building))
        bar.update(building, visible=False)
        bar.update(answering, visible=True)
        low, high = min(s.prompt_tokens for s in built), max(s.prompt_tokens for s in built)
        say(f"{len(built)} sample{'s' if len(built) != 1 else ''} built with {eng.model_name}'s tokenizer "
            f"(seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}), "
            f"{'prompts of' if len(built) != 1 else 'a prompt of'} "
            f"{f'{low:,}' if low == high else f'{low:,}-{high:,}'} tokens")
        return built

    try:
        with bar:
            run = run_profiles(profs, open_engine, build, on_message=say,
                               on_sample=lambda done, total: bar.update(answering, completed=done))
    except (EvalUsageError, TaskError) as exc:
        fail(str(exc), code=2)
    except _LoadFailed as exc:
        fail(str(exc))
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"evaluation failed: {_one_line(exc)}")

    # after a Ctrl-C, a second one (while the partial results are shown and saved) stops quietly
    pending = {"report": report}  # set to None once the report is saved
    with _second_interrupt_stops(run.interrupted, pending):
        data = eval_report(run, seeds=seeds, samples_per_cell=samples, tasks=[t.name for t in task_list],
                           lengths=lengths, haystack=stack.name,
                           profile_sources={p.name: str(p.source) if p.source else None for p in profs},
                           profile_names=[p.name for p in profs])
        if json_out:
            from fpcli.report import dumps

            sys.stdout.write(dumps(data) + "\n")
            sys.stdout.flush()
        if report is not None:
            save_report_or_exit(report, data)
            pending["report"] = None
        from fpcli.ruler.render import missing_notes

        if not quiet:
            from fpcli.console import print_table
            from fpcli.ruler.render import (dense_notes, density_scope_notes, empty_notes, eval_table, fp8_notes, gap_notes,
                                            ttft_notes)

            if data["cells"]:
                print_table(eval_table(data), stderr=True)
            for line in ttft_notes(data):
                note(err, line)
            for line in dense_notes(data):
                note(err, line)
            for line in density_scope_notes(data):
                note(err, line)
            for line in gap_notes(data):
                note(err, line)
            for line in fp8_notes(data):
                note(err, line)
            for line in empty_notes(data):
                warning(err, line)
            if report is not None:
                err.print(f"[dim]report saved to {report}[/]", highlight=False)
        if run.interrupted:
            for line in missing_notes(data):
                warning(err, line)
            raise typer.Exit(130)


@contextmanager
def _second_interrupt_stops(interrupted: bool, pending: dict) -> Iterator[None]:
    """Around what follows an interrupted run (the partial table, --json, --report): another Ctrl-C
    there ends fp with one line, ``fp: error: interrupted again; stopping``, and exit 130 instead
    of a traceback; while ``pending["report"]`` names a report not yet saved, the line says so (the
    report is either whole or not written: ``save_report`` renames a complete temporary file). A
    run that was not interrupted lets Ctrl-C through to fp's own handler."""
    try:
        yield
    except KeyboardInterrupt:
        if not interrupted:
            raise
        unsaved = f" ({pending['report']} not written)" if pending.get("report") is not None else ""
        fail(f"interrupted again; stopping{unsaved}", code=130)


class _LoadFailed(RuntimeError):
    """The engine of a profile could not be loaded (exit 1, one line)."""


def _check_lengths(lengths: list[int], tasks: list, context_length: int | None) -> None:
    """Raise ``EvalUsageError`` for a length above the context or below a task's minimum."""
    if context_length is not None:
        for n in lengths:
            if n > context_length:
                raise EvalUsageError(f"--len {n:,} is above the model's context of {context_length:,} tokens "
                                     f"(the maximum --len here is {context_length:,})")
    for t in tasks:
        for n in lengths:
            if n < t.min_length:
                raise EvalUsageError(f"--len {n:,} is too short for task {t.name}: it needs at least "
                                     f"{t.min_length:,} tokens")


def _check_haystack_paths_or_exit(files: list[str], err) -> None:
    """Exit 2 naming every ``--haystack`` path that is missing or not a readable file."""
    if not files:
        return
    from fpcli.ingest import check_paths

    problems = check_paths(files)
    if problems:
        print_bad_paths(err, problems, prefix="--haystack: ")
        raise typer.Exit(2)


def _haystack_or_exit(files: list[str], err, quiet: bool):
    """The generated haystack, or the documents of ``--haystack`` (paths checked before, by
    ``_check_haystack_paths_or_exit``; exit 1 when none is readable)."""
    from fpcli.ruler.haystack import DocumentHaystack, GeneratedHaystack

    if not files:
        return GeneratedHaystack()
    from fpcli.ingest import ingest
    from fpcli.report import render_ingestion

    docs = ingest(files)
    if not quiet:
        render_ingestion(err, docs)
    usable = [(d.name, d.text) for d in docs if d.ok and d.text.strip()]
    if not usable:
        fail("--haystack: no readable document (see the reasons above)")
    return DocumentHaystack.from_texts(usable)


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
