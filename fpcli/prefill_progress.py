"""The live "prefilling N tokens" line on a terminal's stderr, gone before the answer streams.

A spinner with the elapsed time from submission; when the engine reports progress (the
transformers engine: decoder layers done of all layers) a bar, percentage and ETA. When the
engine says before the prefill how many prompt tokens its KV cache serves (``on_cached``: the
transformers engine, in-process or resident), the line counts only the others ("prefilling 40
tokens (773 cached)"); an engine that learns it only after the prefill (SGLang) shows the whole
prompt, and no ETA. Only on a terminal: in a log or a pipe nothing is drawn (the command prints
its one static line, which for the resident engine gives the prompt's size, not a prefill count).
"""
from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def tokens_phrase(n: int) -> str:
    """``1 token``, ``1,343 tokens`` (``0 tokens``)."""
    return f"{n:,} token{'' if n == 1 else 's'}"


class PrefillDisplay:
    """Context manager; ``on_progress(done, total)`` and ``wrap(on_text)`` go to ``Engine.generate``.

    Args:
        console: the stderr console.
        tokens: the prompt's tokens (for the label, less the cached ones ``on_cached`` reports).
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
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TaskProgressColumn(), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.console, transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.label(), total=None)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def active(self) -> bool:
        """Whether the live line is on screen."""
        return self._progress is not None

    @property
    def line(self) -> str | None:
        """The live line's label now (``None``: not on screen)."""
        return self._progress.tasks[0].description if self._progress is not None else None

    def stop(self) -> None:
        """Remove the line (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def label(self, cached: int = 0) -> str:
        """``prefilling 813 tokens``, or with ``cached`` prompt tokens served by the KV cache
        ``prefilling 40 tokens (773 cached)`` (``prefilling 1 token (812 cached)``)."""
        if cached <= 0:
            return f"prefilling {tokens_phrase(self.tokens)}"
        return f"prefilling {tokens_phrase(max(0, self.tokens - cached))} ({cached:,} cached)"

    def on_cached(self, tokens: int) -> None:
        """The engine's count of prompt tokens its KV cache serves (before the prefill)."""
        if self._progress is not None:
            self._progress.update(self._task, description=self.label(int(tokens)))

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
