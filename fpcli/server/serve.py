"""Run the resident engine's application with uvicorn on a Unix socket (default) or on a loopback
TCP port with a bearer token; write the state file while it serves, remove it when it ends."""
from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import time
from dataclasses import dataclass

from . import LOOPBACK
from .app import ServerInfo, create_app
from .paths import ServerPaths, write_private
from .state import ServerState, clear_stale, clear_starting, clear_state, pid_alive, read_state, write_state


class ServeError(RuntimeError):
    """The server cannot start: another one runs, a bad host, the socket cannot be bound."""


@dataclass(frozen=True)
class ServeConfig:
    """How ``run_server`` listens.

    Attributes:
        port: ``None``: the Unix socket ``ServerPaths.socket``; else a TCP port on ``host``
            (0 = any free port) that needs the token in ``ServerPaths.token``.
        host: must be a loopback address (``127.0.0.1``, ``localhost``, ``::1``).
        idle_s: end after this many seconds without a request (``None``: never).
        log: the log file (for the state; a detached server writes there).
    """

    port: int | None = None
    host: str = LOOPBACK
    idle_s: float | None = None
    log: str | None = None


def check_host(host: str) -> str:
    """The host unchanged when it is loopback.

    Raises:
        ServeError: any other address (the server would be reachable by other machines or users).
    """
    if host == "localhost":
        return host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ServeError(f"--host {host}: only a loopback address is allowed (127.0.0.1, ::1 or localhost); "
                     "the resident engine is never exposed to other machines")


def live_state_or_clean(paths: ServerPaths) -> ServerState | None:
    """The state of a live server, cleaning a stale one (dead pid) on the way (unlike
    ``state.running_state``, which only reads)."""
    state = read_state(paths)
    if state is not None and not pid_alive(state.pid):
        clear_stale(paths, state)
        return None
    return state


def bind(paths: ServerPaths, config: ServeConfig) -> tuple[socket.socket, str, str | None]:
    """(listening socket, address, token file) for ``config``; the Unix socket is 0600 from birth.
    It is bound and listening under a temporary name before it is renamed onto ``paths.socket``
    (replacing a stale one: no live server, checked by the caller), so the path never names a
    socket that refuses connections: a client cleaning a dead server's leftovers (``clear_stale``)
    cannot take it for one."""
    if config.port is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fresh = paths.socket.with_name(f".{paths.socket.name}.{os.getpid()}")
        fresh.unlink(missing_ok=True)
        old = os.umask(0o177)
        try:
            sock.bind(str(fresh))
        finally:
            os.umask(old)
        try:
            os.chmod(fresh, 0o600)
            sock.listen(128)
            os.replace(fresh, paths.socket)
        except OSError:
            sock.close()
            fresh.unlink(missing_ok=True)
            raise
        return sock, f"unix:{paths.socket}", None
    host = check_host(config.host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, config.port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"--port {config.port}: cannot listen on {host} ({exc.strerror or exc})") from None
    sock.listen(128)
    port = sock.getsockname()[1]
    write_private(paths.token, secrets.token_urlsafe(32) + "\n")
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{port}", str(paths.token)


def run_server(engine, info: ServerInfo, paths: ServerPaths, config: ServeConfig, on_ready=None) -> None:
    """Serve ``engine`` until shutdown (``/fp/shutdown``, idle limit, SIGINT or SIGTERM), then close
    it. Blocks. ``on_ready(state)`` is called once the state file is written.

    Raises:
        ServeError: a live server already owns ``paths`` (names its pid and address), or the
            socket cannot be bound.
    """
    import uvicorn

    other = live_state_or_clean(paths)
    if other is not None and other.pid != os.getpid():
        raise ServeError(f"a resident engine already runs (pid {other.pid}, {other.address}, model {other.model}, "
                         f"profile {other.profile}); stop it with `fp stop`")
    sock, address, token_file = bind(paths, config)
    token = open(token_file).read().strip() if token_file else None
    holder: dict = {}
    app = create_app(engine, info, token=token, idle_s=config.idle_s,
                     request_exit=lambda: setattr(holder["server"], "should_exit", True))
    state = ServerState(pid=os.getpid(), address=address, model=info.model, model_path=info.model_path,
                        profile=info.profile, profile_hash=info.profile_hash, engine=info.engine,
                        started_at=time.time(), version=info.version, token_file=token_file, log=config.log,
                        idle_s=config.idle_s, context=info.context, settings_hash=info.settings_hash,
                        device=info.device)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                write_state(paths, state)
                clear_starting(paths, state.pid)  # its fp start may be gone (interrupted)
                if on_ready is not None:
                    on_ready(state)

    server = holder["server"] = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                                      timeout_graceful_shutdown=5))
    try:
        server.run(sockets=[sock])
    finally:
        clear_state(paths, os.getpid())
        if config.port is None:
            paths.socket.unlink(missing_ok=True)
        elif token_file:
            paths.token.unlink(missing_ok=True)
        sock.close()
        engine.close()
