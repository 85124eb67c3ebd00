"""``fp start``: run the resident engine detached and return once it is ready."""
from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fpcli.commands import (MODEL_HELP, PROFILE_HELP, CONTEXT_HELP, EngineArgsCommand, fail, resident_setup_or_exit, stderr_console,
                            note, warning)
from fpcli.commands.ask import EngineChoice
from fpcli.server import START_TIMEOUT_S

app = typer.Typer()


@app.command(
    "start",
    cls=EngineArgsCommand,
)
def start(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    context: Annotated[Optional[str], typer.Option("--context", "-c", help=CONTEXT_HELP, show_default=False)] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP)] = "bf16",
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: SGLang when CUDA and sglang are present, else transformers.")] = EngineChoice.auto,
    idle: Annotated[Optional[str], typer.Option("--idle", help="End after this long without a request, e.g. 10m (default: never).")] = None,
    replace: Annotated[bool, typer.Option("--replace", help="Stop a resident engine with another model or profile first (one still starting too).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Seconds to wait for the engine to be ready.")] = START_TIMEOUT_S,
) -> None:
    """Start the resident engine in the background and return once it answers; fp ask and fp profile then use it.

    Extra arguments after -- are engine settings for SGLang, e.g. fp start --engine sglang -- --tp 2. See fp status and fp stop. Ctrl-C stops the wait, not the engine: it goes on starting (fp stop ends it; fp start with the same options waits for it).
    """
    from fpcli.server.lifecycle import LifecycleError, StartRequest, start_server
    from fpcli.server.state import profile_hash

    err = stderr_console()
    prof, idle_s, paths = resident_setup_or_exit(profile, model, context, idle)
    try:
        from fpcli.engine import check_engine_args, resolve_request
        from fpcli.models import resolve_model

        resolved_engine, resolved_model, prof = resolve_request(engine.value, model, prof)  # the server applies the same defaults
        try:
            check_engine_args(resolved_engine, ctx.args)
        except ValueError as exc:
            fail(f"engine settings after --: {exc}", code=2)
        model_path = str(resolve_model(resolved_model, progress=err))  # fetch/convert here, with progress
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"cannot load the model: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")

    args = ["--profile", os.path.abspath(profile) if os.path.exists(profile) else profile, "--engine", engine.value]
    if model is not None:
        args += ["--model", os.path.abspath(model) if os.path.exists(model) else model]
    if idle_s:
        args += ["--idle", f"{idle_s}s"]
    if context is not None:
        args += ["--context", context]
    want_hash = profile_hash(prof)
    serves = {"model": os.path.basename(str(resolved_model).rstrip("/")), "model_path": model_path,
              "profile": prof.name, "profile_hash": want_hash, "settings_hash": profile_hash(prof, context=False),
              "engine": resolved_engine, "context": prof.engine.context_length}

    def differences(state) -> list[str]:
        out = []
        if state.model_path != model_path:
            out.append("model")
        if state.profile_hash != want_hash:
            same_settings = state.settings_hash is not None and state.settings_hash == profile_hash(prof, context=False)
            out.append("context" if same_settings else "profile")
        if engine.value not in ("auto", state.engine):
            out.append("engine")
        return out

    with err.status("starting the resident engine") as status:
        def waiting(waited: float, line: str) -> None:
            status.update(f"starting the resident engine ({waited:.0f} s){': ' + escape(line[:80]) if line else ''}")

        try:
            outcome, state = start_server(paths, StartRequest(serve_args=args, engine_args=list(ctx.args),
                                                                           timeout_s=timeout, serves=serves), lock_timeout_s=timeout + 30,
                                          matches=differences, replace=replace, on_wait=waiting,
                                          on_note=lambda m: note(err, m))
        except (LifecycleError, TimeoutError) as exc:
            fail(str(exc))
        except KeyboardInterrupt:  # the detached server is not interrupted: it goes on starting
            from fpcli.server.state import read_starting

            starting = read_starting(paths)
            if starting is None:
                raise
            warning(err, f"interrupted; the engine goes on starting (pid {starting.pid}): fp stop ends it")
            raise typer.Exit(130) from None
    verb = {"running": "already runs", "started": "started", "waited": "started (it was starting; waited for it)", "replaced": "replaced the previous one and started"}[outcome]
    err.print(f"fp: resident engine {verb}: {escape(state.model)} ({state.engine} engine, profile {escape(state.profile)}) "
              f"at {escape(state.address)}, pid {state.pid}" + (f"; log {escape(state.log)}" if state.log else ""),
              highlight=False, soft_wrap=True)
