"""Where the resident engine keeps its files: a private runtime folder (mode 0700) with the Unix
socket, the state file, the start lock and the TCP token (each 0600), and a log folder.

``default_paths()`` follows platformdirs (``$XDG_RUNTIME_DIR/fp`` and ``$XDG_STATE_HOME/fp`` on
Linux); tests pass their own ``ServerPaths`` or set those two variables for a subprocess.
"""
from __future__ import annotations

import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

APP_NAME = "fp"
SOCKET_NAME = "engine.sock"
STATE_NAME = "engine.json"
LOCK_NAME = "engine.lock"
STARTING_NAME = "engine.starting.json"
TOKEN_NAME = "token"
LOG_NAME = "server.log"
UNIX_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes including the NUL


class PathsError(RuntimeError):
    """The runtime folder cannot be made private, or the socket path is too long."""


@dataclass(frozen=True)
class ServerPaths:
    """The resident engine's files.

    Attributes:
        runtime_dir: private folder (0700) for ``socket``, ``state``, ``starting``, ``lock`` and ``token``.
        log_dir: folder of ``log`` (the detached server's stdout and stderr).
    """

    runtime_dir: Path
    log_dir: Path

    @property
    def socket(self) -> Path:
        return self.runtime_dir / SOCKET_NAME

    @property
    def state(self) -> Path:
        return self.runtime_dir / STATE_NAME

    @property
    def starting(self) -> Path:
        """The marker of an engine ``fp start`` launched that does not answer yet (``StartingState``)."""
        return self.runtime_dir / STARTING_NAME

    @property
    def lock(self) -> Path:
        return self.runtime_dir / LOCK_NAME

    @property
    def token(self) -> Path:
        return self.runtime_dir / TOKEN_NAME

    @property
    def log(self) -> Path:
        return self.log_dir / LOG_NAME

    def ensure(self) -> "ServerPaths":
        """Create both folders with mode 0700 and check that the runtime folder is private.

        Raises:
            PathsError: the runtime folder belongs to another user or others can enter it, or
                the socket path exceeds the Unix limit of 107 bytes.
        """
        for folder in (self.runtime_dir, self.log_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.runtime_dir)
        if st.st_uid != os.getuid():
            raise PathsError(f"{self.runtime_dir}: owned by uid {st.st_uid}, expected {os.getuid()} (this user)")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(self.runtime_dir, 0o700)
        if len(os.fsencode(self.socket)) > UNIX_PATH_MAX:
            raise PathsError(f"socket path {self.socket} is {len(os.fsencode(self.socket))} bytes, "
                             f"longer than the Unix limit of {UNIX_PATH_MAX}; set XDG_RUNTIME_DIR to a shorter folder")
        return self


def default_paths() -> ServerPaths:
    """``ServerPaths`` of this user from platformdirs (not created; call ``ensure``)."""
    import platformdirs

    with warnings.catch_warnings():  # platformdirs warns when it falls back from $XDG_RUNTIME_DIR
        warnings.simplefilter("ignore")
        runtime = platformdirs.user_runtime_dir(APP_NAME)
    return ServerPaths(runtime_dir=Path(runtime), log_dir=Path(platformdirs.user_state_dir(APP_NAME)))


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically (a temp file renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
