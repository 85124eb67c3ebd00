"""Registration of the ``flashprefill`` attention backend into the installed SGLang (0.5.17).

How the registration reaches every SGLang process (read in the 0.5.17 sources):

1. Entry point. ``pyproject.toml`` declares ``[project.entry-points."sglang.srt.plugins"]
   flashprefill = "flashprefill.integrations.sglang.plugin:register"``. SGLang's
   ``sglang/srt/plugins/__init__.py::load_plugins`` runs every function of that group once per
   process. It is called by ``Engine.__init__`` (``entrypoints/engine.py``, before ServerArgs is
   built), by ``Engine._launch_subprocesses`` and, in the spawned scheduler (one per TP rank, also
   under the DP controller), first thing in ``managers/scheduler.py::run_scheduler_process``; and
   by ``sglang serve`` / ``python -m sglang.launch_server``. Needs this distribution installed
   (``pip install .``) so the entry point is in the environment's metadata; ``SGLANG_PLUGINS`` (a
   whitelist) must include ``flashprefill`` when it is set. The entry point imports only the
   operator library (``flashprefill``), never ``fpcli``: an SGLang process gets no side effect of
   the CLI.
2. Scheduler entry wrapper (works without the entry point). ``run_scheduler_process`` below
   calls ``register()`` and then SGLang's own ``run_scheduler_process``. ``FlashPrefillEngine``
   (an ``Engine`` subclass, its ``run_scheduler_process_func`` class attribute) and
   ``launch_server`` (``http_server.launch_server(run_scheduler_process_func=...)``) pass it to
   SGLang, which hands it to ``mp.Process(target=...)`` (and to the DP controller, which starts
   the schedulers with it). It is a module-level function, so ``spawn`` pickles it by name and
   the child imports this module.

``register()`` is idempotent and does two things:

- ``attention_registry.register_attention_backend("flashprefill")(factory)``: the factory decodes
  ``BackendSettings`` (``BackendSettings.from_env()``: the frozen settings the parent serialised
  into ``FP_SGLANG_BACKEND``; defaults when unset) and builds ``FlashPrefillAttnBackend``; the
  backend module is imported only then (lazily).
- ``server_args.add_attention_backend_choices(["flashprefill"])``: argparse ``choices`` of
  ``--attention-backend``, ``--prefill-attention-backend`` and ``--decode-attention-backend``
  (the dataclass itself does not check names).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

BACKEND_NAME = "flashprefill"


def create_flashprefill_backend(runner: Any):
    """SGLang's factory signature: ``ATTENTION_BACKENDS[name](model_runner)``."""
    from .backend import FlashPrefillAttnBackend
    from .settings import BackendSettings

    settings = BackendSettings.from_env()
    apply_log_level(settings.log_level)
    return FlashPrefillAttnBackend(runner, settings)


def apply_log_level(level: str | None) -> None:
    """Set the ``flashprefill`` loggers' level (``BackendSettings.log_level``; ``None``: unchanged)."""
    if level is not None:
        logging.getLogger("flashprefill").setLevel(level.upper())


def _settings_log_level() -> str | None:
    """``BackendSettings.log_level`` of this process (``None`` when unset or unreadable: the
    backend's factory reports a malformed variable, not the registration)."""
    from .settings import BackendSettings

    try:
        return BackendSettings.from_env().log_level
    except ValueError:
        return None


def is_registered() -> bool:
    try:
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    except ImportError:
        return False
    return BACKEND_NAME in ATTENTION_BACKENDS


# How this process got the backend: "entry point" (SGLang's load_plugins called ``register()``),
# "engine subclass" (the scheduler entry wrapper), "direct" (``register(source="direct")``, tests,
# ``fp serve`` in the parent); ``None`` until registered.
REGISTERED_BY: str | None = None


def register(source: str = "entry point") -> None:
    """Register ``flashprefill`` into the installed SGLang (idempotent; needs sglang).

    ``source`` only labels the log line: SGLang's ``load_plugins`` calls this with no argument
    (hence the default ``"entry point"``); the scheduler wrapper passes ``"engine subclass"``.
    Every call logs which path registered the backend in this process, once per path.
    """
    global REGISTERED_BY
    import os

    from sglang.srt import server_args as sgl_server_args
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in sgl_server_args.ATTENTION_BACKEND_CHOICES:
        sgl_server_args.add_attention_backend_choices([BACKEND_NAME])
    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_flashprefill_backend:
        register_attention_backend(BACKEND_NAME)(create_flashprefill_backend)
        REGISTERED_BY = source
        _say(f"flashprefill: attention backend registered in SGLang by the {source} path (pid {os.getpid()})")
    elif source not in _SEEN_SOURCES:
        _say(f"flashprefill: the {source} path found the backend already registered by the "
             f"{REGISTERED_BY or 'unknown'} path (pid {os.getpid()})")
    _SEEN_SOURCES.add(source)


_SEEN_SOURCES: set[str] = set()


def _say(msg: str) -> None:
    """Log, and print to stderr when ``BackendSettings.log_level`` is ``debug`` / ``info``: in a
    fresh scheduler process the registration runs before SGLang configures logging, so an INFO
    record would be dropped. At any other level (``fp`` without ``-v`` sets ``warning``) or unset,
    nothing is printed; the record still goes to logging."""
    import sys

    level = _settings_log_level()
    apply_log_level(level)
    logger.info(msg)
    if level in ("debug", "info") and not logging.getLogger().handlers:
        print(f"[fp] {msg}", file=sys.stderr, flush=True)


def redirect_output(path: str) -> None:
    """Append this process's stdout and stderr (file descriptors 1 and 2, so native code and child
    processes follow) to ``path`` (created 0600).

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for std in (sys.stdout, sys.stderr):
            try:
                std.flush()
            except (AttributeError, ValueError):
                pass
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _settings_scheduler_output() -> str | None:
    from .settings import BackendSettings

    try:
        return BackendSettings.from_env().scheduler_output
    except ValueError:
        return None


def run_scheduler_process(*args: Any, **kwargs: Any):
    """SGLang's ``run_scheduler_process`` with ``register()`` first (the spawned child's entry).

    With ``BackendSettings.scheduler_output`` set, the scheduler's stdout and stderr go to that
    file first (``redirect_output``). SGLang's own ``run_scheduler_process`` then calls
    ``load_plugins()``; with the entry point installed that registration finds the backend there
    already (logged)."""
    out = _settings_scheduler_output()
    if out:
        redirect_output(out)
    register(source="engine subclass")
    from sglang.srt.managers.scheduler import run_scheduler_process as _sglang_run_scheduler_process

    return _sglang_run_scheduler_process(*args, **kwargs)


_ENGINE_CLASS = None


def engine_class():
    """``FlashPrefillEngine``: ``sglang.srt.entrypoints.engine.Engine`` whose scheduler processes
    register the backend before anything else (built lazily; needs sglang)."""
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        register(source="direct")
        from sglang.srt.entrypoints.engine import Engine

        class FlashPrefillEngine(Engine):
            run_scheduler_process_func = staticmethod(run_scheduler_process)

        _ENGINE_CLASS = FlashPrefillEngine
    return _ENGINE_CLASS
