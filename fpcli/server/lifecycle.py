"""``fp start`` / ``fp status`` / ``fp stop``: spawn the server detached, probe it, end it.

``fp start`` holds the start lock (``state.start_lock``) from its check of the state file until
the server it spawned is ready, so two concurrent starts start one engine.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from . import START_TIMEOUT_S, STOP_WAIT_S
from .client import ClientConfig, ServerUnavailable, probe, shutdown
from .paths import ServerPaths
from .state import (ServerState, StartingState, clear_stale, clear_starting, clear_state, load_starting,
                    load_starting_or_none, pid_alive, proc_start_time, read_state, start_lock, starting_problem,
                    write_starting)


class LifecycleError(RuntimeError):
    """A start that failed or timed out (the message names the log file), or a stop that could
    not end the process."""


@dataclass(frozen=True)
class StartRequest:
    """What ``fp start`` asks for: ``fp serve`` arguments of the detached server.

    Attributes:
        serve_args: fp's own ``fp serve`` options (``--model``, ``--profile``, ``--engine``,
            ``--idle``, ...) as a list of strings.
        engine_args: engine settings for SGLang (e.g. ``["--tp", "2"]``); they follow ``--``,
            after every fp option.
        timeout_s: how long to wait for the server to be ready.
        serves: what the server will serve, as its state file will say (``model``, ``model_path``,
            ``profile``, ``profile_hash``, ``settings_hash``, ``engine``, ``context``; the fields of
            ``StartingState`` after ``proc_start``); the starting marker carries it, so an ``fp ask``
            for another model or profile does not wait for this engine. Empty: unknown.
    """

    serve_args: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    timeout_s: float = START_TIMEOUT_S
    serves: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Status:
    """What ``probe_status`` found: ``kind`` is ``running``, ``starting`` (``fp start`` spawned it and
    it does not answer yet: ``starting`` says which), ``none``, ``stale`` (the process was gone; its
    state file was removed) or ``hung`` (alive, no health answer)."""

    kind: str
    state: ServerState | None = None
    health: dict | None = None
    detail: str = ""
    starting: StartingState | None = None

    def to_dict(self) -> dict:
        return {"status": self.kind, "running": self.kind == "running",
                "state": self.state.to_dict() if self.state else None, "health": self.health, "detail": self.detail,
                "starting": asdict(self.starting) if self.starting else None}


def starting_words(starting: StartingState) -> str:
    """``pid 123, since 4 s`` for a starting engine."""
    return f"pid {starting.pid}, since {max(0.0, time.time() - starting.started_at):.0f} s"


def check_starting(paths: ServerPaths) -> tuple[StartingState | None, str]:
    """The starting marker while it is live: (marker, ``""``). Else (``None``, why): a stale marker
    (``state.starting_problem``: its process gone, its pid now another process, or past its deadline)
    or an unreadable one is removed and the reason returned, once (``""`` when there was none, or
    another reader removed it first). A marker past its deadline whose process is still the
    ``fp serve`` it names (same start time) has that process ended too, as its ``fp start`` would
    have; no other process is ever signalled."""
    try:
        starting = load_starting(paths)
    except ValueError:
        paths.starting.unlink(missing_ok=True)
        return None, f"removed an unreadable starting marker {paths.starting}"
    if starting is None:
        return None, ""
    problem, verified = starting_problem(starting)
    if not problem:
        return starting, ""
    if not clear_starting(paths, starting.pid):
        return None, ""  # another reader removed it (and said so)
    said = f"the starting engine's {problem}; removed its starting marker {paths.starting}"
    if verified:
        try:
            said += f" and ended it ({_end_process(starting.pid, grace_s=5.0)})"
        except LifecycleError as exc:
            said += f" ({exc})"
    return None, said


def probe_status(paths: ServerPaths, config: ClientConfig = ClientConfig()) -> Status:
    """The resident engine's status; cleans a stale state file or starting marker (``stale``, its
    ``detail`` says what was removed)."""
    state = read_state(paths)
    if state is None:
        starting, stale = check_starting(paths)
        if starting is not None:
            return Status("starting", detail=starting_words(starting), starting=starting)
        return Status("stale", detail=stale) if stale else Status("none")
    if not pid_alive(state.pid):
        removed = clear_stale(paths, state)
        return Status("stale", state, detail=f"pid {state.pid} is gone; removed {_files(removed, paths)}")
    try:
        return Status("running", state, probe(state, config))
    except ServerUnavailable as exc:
        return Status("hung", state, detail=f"pid {state.pid} lives but {state.address} does not answer ({exc})")


def _files(removed: list, paths: ServerPaths) -> str:
    """``its state file /run/fp/engine.json and socket /run/fp/engine.sock`` for the status line."""
    names = {paths.state: "state file", paths.socket: "socket"}
    said = " and ".join(f"{names.get(p, 'file')} {p}" for p in removed)
    return f"its {said}" if said else "nothing (already cleaned)"


def serve_command(request: StartRequest, log: str) -> list[str]:
    """The ``fp serve`` command line of a detached server: fp's options (``--log`` included)
    first, then ``--`` and the engine settings, if any."""
    engine = ["--", *request.engine_args] if request.engine_args else []
    return [sys.executable, "-m", "fpcli", "serve", *request.serve_args, "--log", log, *engine]


def spawn(paths: ServerPaths, request: StartRequest, on_wait: Callable[[float, str], None] | None = None,
          config: ClientConfig = ClientConfig()) -> ServerState:
    """Start ``fp serve`` detached (new session, stdout/stderr to ``paths.log``) and wait until its
    state file names it and its health check answers. The caller holds the start lock. Meanwhile
    the starting marker (``ServerPaths.starting``) names it; it is removed once the server is ready
    or has failed (an interrupted wait leaves it: the server goes on starting).

    Args:
        on_wait: called about every 0.5 s with (seconds waited, last log line).

    Raises:
        LifecycleError: the server exited first, or was not ready in ``request.timeout_s`` (then
            it is stopped); the message names the log file and its last line.
    """
    log = open(paths.log, "w", encoding="utf-8")
    os.chmod(paths.log, 0o600)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(serve_command(request, str(paths.log)), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, close_fds=True)
    log.close()
    now = time.time()
    try:
        started = proc_start_time(proc.pid)
    except ProcessLookupError:
        started = None  # already gone: the poll below says how it ended
    write_starting(paths, StartingState(pid=proc.pid, started_at=now, ready_by=now + request.timeout_s,
                                        log=str(paths.log), proc_start=started, **request.serves))
    t0 = time.monotonic()
    while True:
        waited = time.monotonic() - t0
        code = proc.poll()
        if code is not None:
            stopped = not clear_starting(paths, proc.pid) and code < 0  # fp stop removed the marker, then killed it
            if stopped:
                raise LifecycleError(f"the engine was stopped (fp stop, or replaced by fp start --replace) while it was "
                                     f"starting (log: {paths.log})")
            raise LifecycleError(f"the server {exit_words(code)} before it was ready{_colon(last_log_line(paths))} "
                                 f"(log: {paths.log})")
        state = read_state(paths)
        if state is not None and state.pid == proc.pid:
            try:
                probe(state, config)
                clear_starting(paths, proc.pid)
                return state
            except ServerUnavailable:
                pass
        if waited > request.timeout_s:
            _end_process(proc.pid, grace_s=5.0)
            proc.wait(timeout=10)
            clear_starting(paths, proc.pid)
            raise LifecycleError(f"the server was not ready after {request.timeout_s:.0f} s and was stopped"
                                 f"{_colon(last_log_line(paths))} (log: {paths.log})")
        if on_wait is not None:
            on_wait(waited, last_log_line(paths))
        time.sleep(0.25)


def exit_words(code: int) -> str:
    """How a process ended, from its ``Popen.returncode``: ``exited with code 1``, or ``was killed
    by SIGKILL`` for a negative code (the signal's number, negated)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _colon(detail: str) -> str:
    """``": detail"``, or nothing for an empty detail."""
    return f": {detail}" if detail else ""


def last_log_line(paths: ServerPaths) -> str:
    try:
        with open(paths.log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def _group_leader(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pid: int, sig: int) -> None:
    """``sig`` to the process group of ``pid`` when it leads one (a detached server and its
    children), else to ``pid`` alone (a foreground ``fp serve`` shares the shell's group).

    Raises:
        LifecycleError: not permitted (the pid, or one in its group, is another user's process).
    """
    try:
        if _group_leader(pid):
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        raise LifecycleError(f"not permitted to signal pid {pid} (another user's process); "
                             "it is not an engine of yours, nothing was ended") from None


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _end_process(pid: int, grace_s: float) -> str:
    """SIGTERM, then SIGKILL after ``grace_s``; returns how it ended."""
    group = _group_leader(pid)
    _signal(pid, signal.SIGCONT)  # a stopped (SIGSTOP) server cannot handle SIGTERM
    _signal(pid, signal.SIGTERM)
    if _wait_gone(pid, grace_s):
        how = "SIGTERM"
    else:
        _signal(pid, signal.SIGKILL)
        if not _wait_gone(pid, 10.0):
            raise LifecycleError(f"pid {pid} survived SIGKILL")
        how = "SIGKILL"
    if group:  # children left in the group (e.g. SGLang's scheduler) go too
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return how


def stop_server(paths: ServerPaths, wait_s: float = STOP_WAIT_S, config: ClientConfig = ClientConfig()) -> tuple[Status, str]:
    """End the resident engine: ``/fp/shutdown``, wait ``wait_s``, then SIGTERM and SIGKILL its
    process group; one still starting (``Status.kind == "starting"``) gets SIGTERM and SIGKILL at
    once (its ``fp start`` then fails, saying so); a stale starting marker is removed and nothing
    signalled (``check_starting``). Idempotent. Returns (status before, how it ended: ``shutdown``,
    ``SIGTERM``, ``SIGKILL``, or ``""`` when nothing ran).

    Raises:
        LifecycleError: the process survived SIGKILL, or signalling it was not permitted.
    """
    state = read_state(paths)
    if state is None:
        starting, stale = check_starting(paths)
        if starting is None:
            return (Status("stale", detail=stale) if stale else Status("none")), ""
        before = Status("starting", detail=starting_words(starting), starting=starting)
        paths.starting.unlink(missing_ok=True)  # first: its fp start then knows it was stopped
        how = _end_process(starting.pid, grace_s=5.0)
        late = read_state(paths)  # it became ready meanwhile
        if late is not None and late.pid == starting.pid:
            clear_stale(paths, late)
        return before, how
    if not pid_alive(state.pid):
        removed = clear_stale(paths, state)
        return Status("stale", state, detail=f"pid {state.pid} was already gone; removed {_files(removed, paths)}"), ""
    asked = shutdown(state, config)
    if asked and _wait_gone(state.pid, wait_s):
        how = "shutdown"
    else:
        how = _end_process(state.pid, grace_s=10.0)
    try:  # children left in the detached group
        os.killpg(state.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if not pid_alive(state.pid):
        clear_stale(paths, state)
    else:
        clear_state(paths, state.pid)
    return Status("running", state), how


def await_starting(paths: ServerPaths, starting: StartingState, on_wait: Callable[[float, str], None] | None = None,
                   config: ClientConfig = ClientConfig(), poll_s: float = 0.25) -> tuple[ServerState | None, str]:
    """Wait for the engine that ``fp start`` spawned, as its starting marker ``starting`` names it:
    ``(its state, "")`` once it answers its health check (its marker removed: an interrupted
    ``fp start`` did not), else ``(None, why)``: ``"stopped"`` (its marker removed and no state:
    ``fp stop``), ``"ended"`` (its process ended before it was ready) or ``"late"`` (not ready by
    the marker's ``ready_by``). The one wait of ``fp start`` (``wait_ready``) and ``fp ask``
    (``client.wait_for_starting``); each words the outcome.

    Args:
        on_wait: called about every ``poll_s`` with (seconds waited, last log line).
    """
    t0 = time.monotonic()
    while True:
        state = read_state(paths)
        if state is not None and state.pid == starting.pid:
            try:
                probe(state, config)
                clear_starting(paths, starting.pid)
                return state, ""
            except ServerUnavailable:
                pass
        elif load_starting_or_none(paths) is None:
            return None, "stopped"
        elif not pid_alive(starting.pid):
            return None, "ended"
        if time.time() > starting.ready_by:
            return None, "late"
        if on_wait is not None:
            on_wait(time.monotonic() - t0, last_log_line(paths))
        time.sleep(poll_s)


def wait_ready(paths: ServerPaths, starting: StartingState, on_wait: Callable[[float, str], None] | None = None,
               config: ClientConfig = ClientConfig(), poll_s: float = 0.25) -> ServerState:
    """Wait for the engine that another (interrupted) ``fp start`` spawned (``await_starting``):
    its state once it answers its health check.

    Raises:
        LifecycleError: it was stopped (its marker removed, no state: ``fp stop``), it ended
            before it was ready, or it was not ready by the marker's ``ready_by`` (left to
            ``check_starting``, which ends it); the message names the log file.
    """
    state, why = await_starting(paths, starting, on_wait, config, poll_s)
    if state is not None:
        return state
    log = f"log: {starting.log}" if starting.log else f"log: {paths.log}"
    if why == "stopped":
        raise LifecycleError(f"the engine that was starting (pid {starting.pid}) was stopped before it was ready ({log})")
    if why == "ended":
        raise LifecycleError(f"the engine that was starting (pid {starting.pid}) ended before it was ready"
                             f"{_colon(last_log_line(paths))} ({log})")
    raise LifecycleError(f"the engine that was starting (pid {starting.pid}) was not ready by its deadline "
                         f"({log}); see `fp status`, or `fp start --replace`")


def start_server(paths: ServerPaths, request: StartRequest, lock_timeout_s: float,
                 matches: Callable[[ServerState], list[str]], replace: bool = False,
                 on_wait: Callable[[float, str], None] | None = None,
                 on_note: Callable[[str], None] | None = None) -> tuple[str, ServerState]:
    """``fp start``: under the start lock, reuse a matching running server, replace or refuse a
    different one, else spawn one. Returns (``"running"`` | ``"waited"`` | ``"started"`` |
    ``"replaced"``, state).

    An engine still starting (an interrupted ``fp start`` spawned it) is waited for
    (``"waited"``, ``wait_ready``) when its marker says it will serve what ``matches`` accepts; a
    different one, or one whose marker does not say, is refused, or replaced with ``replace``.
    With ``replace``, an engine another ``fp start`` is starting right now (it holds the lock) is
    ended at once (that ``fp start`` then fails, saying it was stopped or replaced), said through
    ``on_note``; a wait for the lock held by another ``fp start`` is said through ``on_note`` too.

    Args:
        matches: the differences (``["model X", ...]``) between a running server and the request.
        on_wait: called about every 0.25 s with (seconds waited, last log line) while an engine starts.
        on_note: called with one line about what this start does or waits for.

    Raises:
        LifecycleError: a different server runs and ``replace`` is False (names it and how to
            stop it), or the start failed.
        TimeoutError: another start held the lock for ``lock_timeout_s``.
    """
    note = on_note or (lambda m: None)
    ended_starting = False
    if replace:
        starting, _ = check_starting(paths)
        if starting is not None:  # another fp start may hold the lock while it starts it
            note(f"ending the engine that is starting ({starting_words(starting)}) to replace it")
            stop_server(paths)
            ended_starting = True

    def blocked() -> None:
        note(f"waiting for another `fp start` to finish (it holds {paths.lock})")

    with start_lock(paths, lock_timeout_s, on_blocked=blocked):
        status = probe_status(paths)
        outcome = "replaced" if ended_starting else "started"
        if status.kind == "starting" and not replace:  # spawned by an fp start that was interrupted
            serves = status.starting.serves()
            differs = matches(serves) if serves is not None else None
            if differs == []:
                note(f"a resident engine with the same model and profile is starting ({status.detail}); waiting for it")
                return "waited", wait_ready(paths, status.starting, on_wait=on_wait)
            what = (f"with another {', '.join(differs)}" if differs else "(what it will serve is not recorded)")
            raise LifecycleError(f"a resident engine is starting {what} ({status.detail}; log {status.starting.log}); "
                                 "see `fp status`, stop it with `fp stop`, or use `fp start --replace`")
        if status.kind == "starting":
            stop_server(paths)
            outcome = "replaced"
        if status.kind == "running":
            differs = matches(status.state)
            if not differs:
                return "running", status.state
            if not replace:
                s = status.state
                raise LifecycleError(f"a resident engine already runs with another {', '.join(differs)} (pid {s.pid}, "
                                     f"{s.address}, model {s.model}, profile {s.profile}, engine {s.engine}); "
                                     "stop it with `fp stop` or use `fp start --replace`")
        if status.kind in ("running", "hung"):
            if status.kind == "hung" and not replace:
                raise LifecycleError(f"a resident engine hangs ({status.detail}); stop it with `fp stop` "
                                     "or use `fp start --replace`")
            stop_server(paths)
            outcome = "replaced"
        return outcome, spawn(paths, request, on_wait=on_wait)
