"""The stderr console shared by the CLI, the model manager and the engines (diagnostics only:
stdout carries answers and ``--json``)."""
from __future__ import annotations

from rich.console import Console
from rich.text import Text

WIDE = 200  # columns for tables when stderr is not a terminal (logs, pipes): never wrap a row


class DiagnosticConsole(Console):
    """A rich ``Console`` that knows whether its ``fp: note:`` lines are wanted.

    Attributes:
        notes: False for a command run with ``--quiet``: ``diagnostic`` drops notes, and keeps
            warnings and errors.
    """

    def __init__(self, *args, notes: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes = notes


def _console(stderr: bool, notes: bool = True) -> Console:
    console = DiagnosticConsole(stderr=stderr, highlight=False, notes=notes)
    if console.is_terminal:
        return console
    return DiagnosticConsole(stderr=stderr, highlight=False, soft_wrap=True, width=max(WIDE, console.width),
                             notes=notes)


def stdout_console() -> Console:
    """A rich console on stdout (a command's result), with ``stderr_console``'s rules: off a
    terminal, lines are never hard-wrapped and tables get at least ``WIDE`` columns (tables wider
    than that: ``print_table``)."""
    return _console(stderr=False)


def stderr_console(quiet: bool = False) -> Console:
    """A rich console on stderr (built per call: test runners swap ``sys.stderr``); ``quiet``
    (a command's ``--quiet``): ``diagnostic`` prints no notes on it, only warnings and errors.

    On a terminal: rich's defaults (its width, wrapping, live status and progress bars). Not a
    terminal (a log file, a pipe, CI): messages are never hard-wrapped (``soft_wrap``: one
    warning = one line, greppable), tables get a wide fixed width so rows do not wrap, and
    ``is_terminal`` is False, which callers use to skip progress bars.
    """
    return _console(stderr=True, notes=not quiet)


def print_table(table, stderr: bool = False) -> None:
    """Print a rich table (or any renderable) on stdout, or stderr, as wide as it needs: rich would
    otherwise shrink columns and cut cells with "…" (a narrow terminal wraps the line instead,
    which keeps every cell copyable)."""
    need = Console(width=10_000).measure(table).maximum
    base = _console(stderr)
    Console(stderr=stderr, width=max(base.width, need), highlight=False).print(table)


LEVELS = {"error": "bold red", "warning": "yellow", "note": "dim"}
"""The levels of ``diagnostic`` and the style of each one's prefix."""


def diagnostic_text(level: str, message: str) -> Text:
    """``fp: <level>: <message>`` as a rich ``Text`` (``message`` is plain text: no markup).

    Raises:
        ValueError: ``level`` is not one of ``LEVELS``.
    """
    if level not in LEVELS:
        raise ValueError(f"diagnostic level: expected one of {', '.join(LEVELS)}, got {level!r}")
    return Text.assemble((f"fp: {level}:", LEVELS[level]), " ", message)


def diagnostic(console: Console, level: str, message: str) -> None:
    """Print one diagnostic on ``console`` (stderr) as ``fp: error: ...``, ``fp: warning: ...`` or
    ``fp: note: ...``: the one form of every error, warning and note fp prints (never wrapped
    off a terminal: one message, one greppable line). A note is dropped on a console built with
    ``stderr_console(quiet=True)``.

    Raises:
        ValueError: ``level`` is not one of ``LEVELS``.
    """
    if level not in LEVELS:
        raise ValueError(f"diagnostic level: expected one of {', '.join(LEVELS)}, got {level!r}")
    if level == "note" and not getattr(console, "notes", True):
        return
    console.print(diagnostic_text(level, message), soft_wrap=not console.is_terminal, highlight=False)


def error(console: Console, message: str) -> None:
    """``diagnostic(console, "error", message)``."""
    diagnostic(console, "error", message)


def warning(console: Console, message: str) -> None:
    """``diagnostic(console, "warning", message)``."""
    diagnostic(console, "warning", message)


def note(console: Console, message: str) -> None:
    """``diagnostic(console, "note", message)``."""
    diagnostic(console, "note", message)


def step_progress(console: Console, *, disable: bool = False):
    """A transient ``rich.progress.Progress`` of counted steps (description, bar, done/total,
    elapsed time) on ``console``: the bar of ``fp bench`` and ``fp eval``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, transient=True, disable=disable)
