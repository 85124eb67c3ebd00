"""The resident engine's state file (one per user) and the lock that serialises ``fp start``.

The state file (``ServerPaths.state``, mode 0600) is written by the server once it accepts
requests and removed when it ends. A state whose process is gone is stale: readers clean it.

Between the spawn and the state file, ``fp start`` keeps a starting marker (``ServerPaths.starting``,
``StartingState``): ``fp status`` says "starting", ``fp stop`` ends the starting process and ``fp ask``
waits for it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator

from .paths import ServerPaths, write_private


def _from_known_fields(cls, data: dict):
    """``cls(**data)`` with the keys ``cls`` does not have left out (a file written by a newer or
    older fp). Raises ``ValueError`` when a required field is missing."""
    names = {f.name for f in fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class ServerState:
    """What runs, as written by the server.

    Attributes:
        pid: the server process (its process group leader when started by ``fp start``).
        address: ``unix:/path/engine.sock`` or ``http://127.0.0.1:PORT``.
        model: the model's display name; model_path: its resolved local path.
        profile: profile name; profile_hash: ``profile_hash`` of its content.
        engine: ``transformers`` or ``sglang`` (what runs, never ``auto``).
        started_at: Unix time the server started accepting requests.
        version: the ``fp`` version of the server.
        token_file: file holding the bearer token (TCP only), else ``None``.
        log: the log file of a detached server, else ``None``.
        idle_s: seconds without a request after which the server ends (``None``: never).
        context: the profile's ``engine.context_length`` the server runs (``--context``, or the
            default model's), in tokens; ``None``: the model's own.
        settings_hash: ``profile_hash(profile, context=False)``: a client whose profile differs
            only in context is told so.
        device: ``"cuda"`` or ``"cpu"``, where the engine runs (``None`` in state files written
            before the field: probed when needed); a client derives the default model from it
            without importing torch (``fpcli.engine.engine_device``).
    """

    pid: int
    address: str
    model: str
    model_path: str
    profile: str
    profile_hash: str
    engine: str
    started_at: float
    version: str
    token_file: str | None = None
    log: str | None = None
    idle_s: float | None = None
    context: int | None = None
    settings_hash: str | None = None
    device: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ServerState":
        """Raises ``ValueError`` when a required field is missing or of the wrong type."""
        state = _from_known_fields(cls, data)
        if not isinstance(state.pid, int) or not isinstance(state.address, str):
            raise ValueError("pid must be an integer and address a string")
        return state


STARTING_GRACE_S = 30.0  # a starting marker this long past its ready_by is stale (its fp start gave up on it)


@dataclass(frozen=True)
class StartingState:
    """An engine that ``fp start`` spawned and that does not answer yet (the starting marker).

    Attributes:
        pid: the ``fp serve`` process (leader of its process group).
        started_at: Unix time it was spawned.
        ready_by: Unix time after which ``fp start`` gives up on it (and stops it); past it (plus
            ``STARTING_GRACE_S``) the marker is stale.
        log: its log file, or ``None``.
        proc_start: the process's start time (``proc_start_time``: Linux clock ticks since boot),
            ``None`` where ``/proc`` is absent (or in a marker of an older fp): a pid whose start time
            differs is another process, never reported as starting nor signalled.
        model, model_path, profile, profile_hash, settings_hash, engine, context: what it will serve,
            as its ``ServerState`` will say (``None`` in a marker of an older fp: unknown).
    """

    pid: int
    started_at: float
    ready_by: float
    log: str | None = None
    proc_start: int | None = None
    model: str | None = None
    model_path: str | None = None
    profile: str | None = None
    profile_hash: str | None = None
    settings_hash: str | None = None
    engine: str | None = None
    context: int | None = None

    @classmethod
    def from_dict(cls, data: dict) -> "StartingState":
        """Raises ``ValueError`` when a field is missing or of the wrong type."""
        state = _from_known_fields(cls, data)
        if not isinstance(state.pid, int) or not isinstance(state.started_at, (int, float)) \
                or not isinstance(state.ready_by, (int, float)):
            raise ValueError("pid must be an integer, started_at and ready_by numbers")
        if state.proc_start is not None and not isinstance(state.proc_start, int):
            raise ValueError("proc_start must be an integer")
        return state

    def serves(self) -> ServerState | None:
        """What it will serve, as a ``ServerState`` (no address yet), or ``None`` when the marker
        does not say (an older fp wrote it)."""
        if not (self.model_path and self.profile_hash and self.engine):
            return None
        return ServerState(pid=self.pid, address="", model=self.model or self.model_path, model_path=self.model_path,
                           profile=self.profile or "?", profile_hash=self.profile_hash, engine=self.engine,
                           started_at=self.started_at, version="", context=self.context,
                           settings_hash=self.settings_hash)


def proc_start_time(pid: int) -> int | None:
    """The start time of process ``pid``: field 22 of ``/proc/<pid>/stat`` (clock ticks since
    boot), which tells a process from a later one that reuses its pid. ``None`` where ``/proc`` is
    absent or unreadable.

    Raises:
        ProcessLookupError: ``/proc`` exists and has no such process.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            raise ProcessLookupError(pid) from None
        return None
    except OSError:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])  # fields 3.. follow the ")" of the command name
    except (IndexError, ValueError):
        return None


def write_starting(paths: ServerPaths, starting: StartingState) -> None:
    write_private(paths.starting, json.dumps(asdict(starting), indent=2) + "\n")


def load_starting(paths: ServerPaths) -> StartingState | None:
    """The starting marker as written, checking nothing.

    Raises:
        ValueError: it cannot be parsed.
    """
    try:
        text = paths.starting.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return StartingState.from_dict(json.loads(text))
    except AttributeError:
        raise ValueError("not a JSON object") from None


def starting_problem(starting: StartingState, now: float | None = None) -> tuple[str, bool]:
    """Why the marker ``starting`` is stale (``""``: it is not), and whether its process is the one
    ``fp start`` spawned and still lives (its start time matches ``proc_start``): only then may it be
    signalled. Stale: its process is gone, or the pid is now another process (another start time),
    or it is more than ``STARTING_GRACE_S`` past ``ready_by``."""
    now = time.time() if now is None else now
    if not pid_alive(starting.pid):
        return f"pid {starting.pid} is gone", False
    verified = False
    if starting.proc_start is not None:
        try:
            current = proc_start_time(starting.pid)
        except ProcessLookupError:
            return f"pid {starting.pid} is gone", False
        if current is not None and current != starting.proc_start:
            return f"pid {starting.pid} is now another process", False
        verified = current is not None
    late = now - starting.ready_by
    if late > STARTING_GRACE_S:
        return f"pid {starting.pid} was not ready by its deadline ({late:.0f} s ago)", verified
    return "", verified


def read_starting(paths: ServerPaths) -> StartingState | None:
    """The starting marker while it is not stale (``starting_problem``), else ``None``; reads only
    (``fpcli.server.lifecycle.check_starting`` removes a stale one and says why)."""
    starting = load_starting_or_none(paths)
    if starting is None or starting_problem(starting)[0]:
        return None
    return starting


def load_starting_or_none(paths: ServerPaths) -> StartingState | None:
    """The starting marker as written (``load_starting``), or ``None`` when it is absent or unreadable."""
    try:
        return load_starting(paths)
    except ValueError:
        return None


def clear_starting(paths: ServerPaths, pid: int) -> bool:
    """Remove the starting marker if it names ``pid``. True if removed."""
    try:
        data = json.loads(paths.starting.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("pid") != pid:
        return False
    paths.starting.unlink(missing_ok=True)
    return True


def profile_hash(profile, context: bool = True) -> str:
    """sha256 (16 hex digits) of a profile's settings (``Profile.to_dict`` without its name,
    description and source file): two profiles with the same settings match whatever they are called.
    ``context=False`` also leaves out ``engine.context_length`` (``--context``): two profiles that
    differ only in context then match."""
    data = dict(profile.to_dict())
    for key in ("name", "description", "source"):
        data.pop(key, None)
    if not context:
        data["engine"] = {k: v for k, v in data.get("engine", {}).items() if k != "context_length"}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_state(paths: ServerPaths) -> ServerState | None:
    """The state file, or ``None`` when there is none or it cannot be parsed (then it is removed:
    a half-written or foreign file is as stale as a dead process)."""
    try:
        text = paths.state.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return ServerState.from_dict(json.loads(text))
    except (ValueError, AttributeError):
        paths.state.unlink(missing_ok=True)
        return None


def write_state(paths: ServerPaths, state: ServerState) -> None:
    write_private(paths.state, json.dumps(state.to_dict(), indent=2) + "\n")


def clear_state(paths: ServerPaths, pid: int | None = None) -> bool:
    """Remove the state file (only if it names ``pid``, when given). True if removed."""
    current = read_state(paths)
    if current is None or (pid is not None and current.pid != pid):
        return False
    paths.state.unlink(missing_ok=True)
    return True


def clear_stale(paths: ServerPaths, state: ServerState) -> list[Path]:
    """Clean what the dead server ``state`` left (its process is gone, e.g. ``kill -9``): its state
    file, and its Unix socket when ``state.address`` names ``paths.socket`` and nothing listens on
    it (a live server that bound the socket since keeps it). Returns the files removed."""
    removed = [paths.state] if clear_state(paths, state.pid) else []
    if state.address != f"unix:{paths.socket}" or not paths.socket.is_socket():
        return removed
    current = read_state(paths)
    if current is not None and pid_alive(current.pid):  # another server runs now
        return removed
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(paths.socket))
        return removed  # a listener answers: a live server owns it
    except ConnectionRefusedError:  # no listener: the dead server's leftover
        paths.socket.unlink(missing_ok=True)
        return [*removed, paths.socket]
    except OSError:
        return removed
    finally:
        probe.close()


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: not ours, but alive
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def running_state(paths: ServerPaths | None = None) -> ServerState | None:
    """The ``ServerState`` of the resident engine whose state file is in ``paths`` (default: this
    user's) while its process lives, else ``None``. Reads the state file only: no connection, no
    cleanup (``fpcli.server.client.connect`` checks and cleans)."""
    if paths is None:
        from .paths import default_paths

        paths = default_paths()
    try:
        text = paths.state.read_text(encoding="utf-8")
        state = ServerState.from_dict(json.loads(text))
    except (OSError, ValueError, AttributeError):
        return None
    return state if pid_alive(state.pid) else None


@contextmanager
def start_lock(paths: ServerPaths, timeout_s: float, on_blocked: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the exclusive start lock (``fcntl.flock`` on ``paths.lock``).

    Args:
        on_blocked: called once when another process holds the lock (before waiting for it).

    Raises:
        TimeoutError: another ``fp start`` held it for ``timeout_s``.
    """
    fd = os.open(paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_blocked is not None:
                    on_blocked()
                    on_blocked = None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another `fp start` holds {paths.lock} (waited {timeout_s:.0f} s)") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock
