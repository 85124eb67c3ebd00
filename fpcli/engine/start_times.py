"""How long an engine took to start the last time, so that the wait can be announced.

Starting SGLang takes about a minute (docs/benchmarks.md: two imports of SGLang, then weights,
CUDA graph, warm-up); the spinner says "~66 s last time" instead of leaving the user guessing.
One JSON file in fp's cache directory (``fpcli.models.cache_dir``), ``{key: seconds}``, keyed by
engine, model folder and context. Best effort: an unreadable or unwritable file only loses the hint.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FILE_NAME = "engine-start-times.json"
MIN_HINT_S = 2.0  # shorter starts need no announcement


def start_key(engine: str, model_path: str | os.PathLike, context_length: int | None) -> str:
    """``"<engine> <resolved model folder> <context or 'native'>"``."""
    return f"{engine} {Path(model_path).resolve()} {context_length or 'native'}"


def last_start_s(cache_dir: Path, key: str) -> float | None:
    """Seconds the start of ``key`` took last time, or ``None`` (never recorded, or the file unreadable)."""
    try:
        value = json.loads((Path(cache_dir) / FILE_NAME).read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def record_start_s(cache_dir: Path, key: str, seconds: float) -> None:
    """Store ``seconds`` for ``key`` (atomic replace of the file; errors ignored)."""
    path = Path(cache_dir) / FILE_NAME
    try:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            data = {}
        data[key] = round(float(seconds), 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".start-times-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def start_message(action: str, last_s: float | None) -> str:
    """``action`` plus the last start's duration when known and worth saying (``>= MIN_HINT_S``):
    ``"starting SGLang with m (...); ~66 s last time"``."""
    return action if last_s is None or last_s < MIN_HINT_S else f"{action}; ~{last_s:.0f} s last time"
