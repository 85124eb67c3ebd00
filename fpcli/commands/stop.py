"""``fp status`` and ``fp stop``: what the resident engine is doing, and ending it."""
from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer
from rich.markup import escape

from fpcli.commands import FpCommand, error, fail, stderr_console, warning
from fpcli.server import STOP_WAIT_S

app = typer.Typer()

EXIT_NOT_RUNNING = 3  # fp status: nothing runs (or it was stale); 1: it hangs
EXIT_STARTING = 4  # fp status: fp start launched it and it does not answer yet


def _paths():
    from fpcli.server.paths import PathsError, default_paths

    try:
        return default_paths().ensure()
    except (PathsError, OSError) as exc:
        fail(f"cannot prepare the runtime folder: {exc}")


def _size(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@app.command("status", cls=FpCommand)
def status(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
) -> None:
    """Show the resident engine: model, profile, engine, address, idle time, memory, requests.

    Exit code 0 when it runs, 4 while fp start is still starting it, 3 when none runs (a stale state file of a dead engine, or a stale starting marker, is removed, and said), 1 when it does not answer (hung).
    """
    from fpcli.server.lifecycle import probe_status

    err = stderr_console()
    st = probe_status(_paths())
    code = {"running": 0, "starting": EXIT_STARTING, "none": EXIT_NOT_RUNNING, "stale": EXIT_NOT_RUNNING,
            "hung": 1}[st.kind]
    if json_out:
        sys.stdout.write(json.dumps(st.to_dict(), indent=2) + "\n")
        raise typer.Exit(code)
    if st.kind == "none":
        err.print("no resident engine runs (start one with fp start)", highlight=False)
    elif st.kind == "starting":
        sys.stdout.write(f"starting ({st.detail})" + (f"; log {st.starting.log}" if st.starting.log else "") + "\n")
    elif st.kind == "stale":
        warning(err, f"the resident engine is gone (stale): {st.detail}")
    elif st.kind == "hung":
        error(err, f"the resident engine hangs: {st.detail}; end it with fp stop")
    else:
        h, s = st.health, st.state
        device = h.get("device") or s.device  # "cuda" or "cpu"; None from an engine that predates the field
        rows = [
            ("model", f"{h['model']} ({h['model_path']})"),
            ("profile", h["profile"]),
            ("engine", f"{h['engine']}{' on ' + device if device else ''} ({h['precision']}, "
                       f"context {h['context_length']:,} tokens)"),
            ("address", s.address + (f" (token in {s.token_file})" if s.token_file else "")),
            ("pid", str(s.pid)),
            ("up", _duration(h["uptime_s"]) + f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(h['started_at']))})"),
            ("idle", _duration(h["idle_s"]) + (f" (ends after {_duration(h['idle_limit_s'])})" if h.get("idle_limit_s") else "")),
            ("requests", f"{h['requests_served']} served, {h['busy']} running, {h['queued']} queued, "
                         f"{h['requests_cancelled']} cancelled"),
            ("memory", f"RSS {_size(h['rss_bytes'])}" + (f", GPU {_size(h['gpu_used_bytes'])} in use" if h.get("gpu_used_bytes") else "")),
        ] + ([("log", s.log)] if s.log else [])
        out = sys.stdout
        for k, v in rows:
            out.write(f"{k + ':':<10}{v}\n")
    raise typer.Exit(code)


@app.command("stop", cls=FpCommand)
def stop(
    wait: Annotated[float, typer.Option("--wait", min=0.0, help="Seconds to wait for a clean shutdown before SIGTERM, then SIGKILL.")] = STOP_WAIT_S,
) -> None:
    """Stop the resident engine (and every process it started), also one that fp start is still starting; does nothing when none runs."""
    from fpcli.server.lifecycle import LifecycleError, stop_server

    err = stderr_console()
    try:
        before, how = stop_server(_paths(), wait_s=wait)
    except LifecycleError as exc:
        fail(str(exc))
    if before.kind == "none":
        err.print("no resident engine runs", highlight=False)
    elif before.kind == "stale":
        warning(err, f"the resident engine was already gone: {before.detail}")
    elif before.kind == "starting":
        err.print(f"fp: the starting resident engine ({before.detail}) ended with {how}; none runs", highlight=False,
                  soft_wrap=True)
    else:
        s = before.state
        ended = "shut down" if how == "shutdown" else f"ended with {how}"
        err.print(f"fp: resident engine {escape(s.model)} (pid {s.pid}) {ended}", highlight=False, soft_wrap=True)
