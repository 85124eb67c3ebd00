"""``fp serve``: the resident engine in the foreground -- the OpenAI-compatible server for other
clients, and the server ``fp ask`` / ``fp profile`` use (``fp start`` runs it detached)."""
from __future__ import annotations

import os
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fpcli.commands import (MODEL_HELP, PROFILE_HELP, CONTEXT_HELP, FpCommand, context_source, engine_loader, fail,
                            resident_setup_or_exit, stderr_console)
from fpcli.commands.ask import EngineChoice
from fpcli.server import LOOPBACK

app = typer.Typer()


@app.command(
    "serve",
    cls=FpCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "-m", "--model-path", help=MODEL_HELP)] = None,
    context: Annotated[Optional[str], typer.Option("--context", "-c", help=CONTEXT_HELP, show_default=False)] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP + " It sets the backend and engine defaults.")] = "bf16",
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: SGLang when CUDA and sglang are present, else transformers.")] = EngineChoice.auto,
    port: Annotated[Optional[int], typer.Option("--port", min=0, max=65535, help="Listen on this TCP port of 127.0.0.1 (0: any free port) with a bearer token, instead of the private Unix socket.")] = None,
    host: Annotated[str, typer.Option("--host", help="With --port: a loopback address only (127.0.0.1, ::1, localhost).")] = LOOPBACK,
    idle: Annotated[Optional[str], typer.Option("--idle", help="End after this long without a request, e.g. 10m (default: never).")] = None,
    log: Annotated[Optional[str], typer.Option("--log", hidden=True, help="The log file (set by fp start).")] = None,
) -> None:
    """Serve a model until stopped: fp ask and fp profile use it, and other clients through its OpenAI-compatible API (/v1/models, /v1/chat/completions).

    Listens on a Unix socket in a private runtime folder, or with --port on 127.0.0.1 with a bearer token in a 0600 file (OpenAI clients pass it as api_key). Other arguments are engine settings for SGLang, e.g. fp serve --engine sglang --tp 2. Stop with Ctrl-C or fp stop.
    """
    from fpcli import __version__
    from fpcli.server.app import ServerInfo
    from fpcli.server.serve import ServeConfig, ServeError, check_host, run_server
    from fpcli.server.state import profile_hash

    err = stderr_console()
    if port is not None:
        try:
            check_host(host)
        except ServeError as exc:
            fail(str(exc), code=2)
    elif host != LOOPBACK:
        fail(f"--host {host}: only with --port (without it fp serve listens on a private Unix socket)", code=2)
    prof, idle_s, paths = resident_setup_or_exit(profile, model, context, idle)
    engine_args = list(ctx.args)
    from fpcli.engine.context import ContextError

    try:
        from fpcli.engine import resolve_request
        from fpcli.models import resolve_model

        _, model, prof = resolve_request(engine.value, model, prof)  # the defaults the client applies too
        model_path = str(resolve_model(model, progress=err))
        load = engine_loader()
        kwargs = {"engine_args": engine_args} if engine_args else {}
        eng = load(engine.value, model, prof, progress=err, **kwargs)
    except typer.Exit:
        raise
    except ContextError as exc:
        fail(f"{context_source(prof, context)}: {exc}", code=2)
    except Exception as exc:  # noqa: BLE001 - one line for any load failure
        lines = str(exc).strip().splitlines()
        fail(f"cannot load the model: {lines[0] if lines else type(exc).__name__}")
    from fpcli.engine import device_of

    info = ServerInfo(model=eng.model_name, model_path=model_path, profile=prof.name, profile_hash=profile_hash(prof),
                      engine=eng.name, context_length=int(eng.context_length), precision=str(eng.precision),
                      version=__version__, context=prof.engine.context_length,
                      settings_hash=profile_hash(prof, context=False), device=device_of(eng))

    def ready(state) -> None:
        err.print(f"fp: serving {escape(info.model)} ({info.engine} engine, profile {escape(info.profile)}) at "
                  f"{escape(state.address)}, pid {os.getpid()}", highlight=False, soft_wrap=True)
        if state.token_file:
            err.print(f"fp: bearer token in {escape(state.token_file)} (OpenAI clients: api_key=<its content>, "
                      f"base_url={escape(state.address)}/v1)", highlight=False, soft_wrap=True)

    try:
        run_server(eng, info, paths, ServeConfig(port=port, host=host, idle_s=idle_s, log=log), on_ready=ready)
    except KeyboardInterrupt:  # Ctrl-C is how a foreground server is stopped (run_server has cleaned up)
        pass
    except ServeError as exc:
        eng.close()
        fail(str(exc))
    err.print("fp: the server stopped", highlight=False)
