"""One module per ``fp`` command, joined in ``fpcli.cli`` with ``app.add_typer``.

Conventions (style guide habit 15): stdout carries only the answer or ``--json``; diagnostics
go to ``stderr_console()``; failures end with ``fail(message)`` -- one line, exit code 1 for a
failure, 2 for a usage error (bad path, bad option value).
"""
from __future__ import annotations

import importlib
import os
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

ENGINE_FACTORY_ENV = "FP_ENGINE_FACTORY"  # "module:function" replacing fpcli.engine.load_engine (tests)


def stderr_console() -> Console:
    """A rich console on stderr (built per call: test runners swap ``sys.stderr``)."""
    return Console(stderr=True, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``fp: error: message`` (one line) on stderr and exit with ``code``."""
    stderr_console().print(f"[bold red]fp: error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def engine_loader():
    """``fpcli.engine.load_engine``, or the factory named by ``$FP_ENGINE_FACTORY``
    (``module:function``; used by subprocess tests to run ``fp`` with a fake engine)."""
    spec = os.environ.get(ENGINE_FACTORY_ENV)
    if spec:
        module, _, func = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), func or "load_engine")
        except (ImportError, AttributeError) as exc:
            fail(f"${ENGINE_FACTORY_ENV}={spec}: cannot import it ({exc})")
    try:
        from fpcli.engine import load_engine
    except ImportError as exc:
        fail(f"the engine module is unavailable ({exc}); reinstall fp with `pip install -e .`")
    return load_engine


def load_profile_or_exit(name: str, fp8: bool = False):
    """The profile ``name`` (built-in or path); with ``fp8``, the ``fp8`` profile instead of ``bf16``,
    else the profile with its precision set to fp8 (named ``<name>+fp8``). Exit 2 on a bad profile."""
    from fpcli.profiles import ProfileError, load_profile

    if fp8 and name == "bf16":
        name = "fp8"  # the built-in fp8 profile is bf16 with fp8 attention
    try:
        profile = load_profile(name)
        if fp8 and profile.precision != "fp8":
            profile = profile.replace(precision="fp8", name=f"{profile.name}+fp8")
        return profile
    except ProfileError as exc:
        fail(str(exc), code=2)
