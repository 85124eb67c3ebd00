"""The stderr console shared by the CLI, the model manager and the engines (diagnostics only:
stdout carries answers and ``--json``)."""
from __future__ import annotations

from rich.console import Console

WIDE = 200  # columns for tables when stderr is not a terminal (logs, pipes): never wrap a row


def stderr_console() -> Console:
    """A rich console on stderr (built per call: test runners swap ``sys.stderr``).

    On a terminal: rich's defaults (its width, wrapping, live status and progress bars). Not a
    terminal (a log file, a pipe, CI): messages are never hard-wrapped (``soft_wrap``: one
    warning = one line, greppable), tables get a wide fixed width so rows do not wrap, and
    ``is_terminal`` is False, which callers use to skip progress bars.
    """
    console = Console(stderr=True, highlight=False)
    if console.is_terminal:
        return console
    return Console(stderr=True, highlight=False, soft_wrap=True, width=max(WIDE, console.width))
