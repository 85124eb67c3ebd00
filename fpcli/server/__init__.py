"""The resident engine: one long-lived process that holds a loaded engine and answers ``fp ask``,
``fp profile`` and OpenAI-compatible clients.

Modules, one job each:

- ``paths``: where the socket, state file, lock, token and log live (``ServerPaths``).
- ``state``: the per-user state file (``ServerState``), the start lock, process liveness.
- ``app``: the FastAPI application around any in-process ``fpcli.engine.base.Engine``.
- ``serve``: binds the socket (Unix or loopback TCP) and runs the app with uvicorn.
- ``client``: ``RemoteEngine`` (the ``Engine`` protocol over the socket) and ``connect``.
- ``lifecycle``: ``fp start`` / ``fp status`` / ``fp stop``: spawn, probe and end the server.

Nothing here imports torch or an engine at import time; this package's own defaults are below
(importing them costs nothing, the CLI uses them as option defaults).
"""

LOOPBACK = "127.0.0.1"  # the only kind of TCP address fp serve listens on (IPv6 ::1 and localhost allowed too)
START_TIMEOUT_S = 900.0  # fp start: longest wait for a new engine (SGLang starts in 41-100 s on an H200)
STOP_WAIT_S = 30.0  # fp stop: wait for a clean shutdown before SIGTERM, then SIGKILL

