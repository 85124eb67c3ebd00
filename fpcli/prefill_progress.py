"""The live "prefilling N tokens" line on a terminal's stderr, gone before the answer streams.

A spinner with the elapsed time from submission; when the engine reports progress (the
transformers engine: decoder layers done of all layers) a bar, percentage and ETA. Only on a
terminal: in a log or a pipe nothing is drawn (the command prints its one static line).
"""
from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class PrefillDisplay:
    """Context manager; ``on_progress(done, total)`` and ``wrap(on_text)`` go to ``Engine.generate``.

    Args:
        console: the stderr console.
        tokens: prompt tokens to prefill (for the label).
        enabled: draw at all (``False`` for ``--quiet`` / ``--json``).
    """

    def __init__(self, console: Console, tokens: int, enabled: bool = True) -> None:
        self.console = console
        self.tokens = tokens
        self.enabled = enabled and console.is_terminal
        self._progress: Progress | None = None
        self._task = None

    def __enter__(self) -> "PrefillDisplay":
        if self.enabled:
            self._progress = Progress(
                SpinnerColumn(), TextColumn(f"prefilling {self.tokens:,} tokens"), BarColumn(),
                TaskProgressColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("prefill", total=None)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def active(self) -> bool:
        """Whether the live line is on screen."""
        return self._progress is not None

    def stop(self) -> None:
        """Remove the line (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_progress(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total)

    def wrap(self, on_text: Callable[[str], None] | None) -> Callable[[str], None] | None:
        """``on_text`` that first removes the live line (the answer starts)."""
        if on_text is None:
            return None

        def first(piece: str) -> None:
            self.stop()
            on_text(piece)

        return first
