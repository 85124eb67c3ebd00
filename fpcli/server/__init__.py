"""The resident engine: one long-lived process that holds a loaded engine and answers ``fp ask``,
``fp profile`` and OpenAI-compatible clients.

Modules, one job each:

- ``paths``: where the socket, state file, lock, token and log live (``ServerPaths``).
- ``state``: the per-user state file (``ServerState``), the start lock, process liveness.
- ``app``: the FastAPI application around any in-process ``fpcli.engine.base.Engine``.
- ``serve``: binds the socket (Unix or loopback TCP) and runs the app with uvicorn.
- ``client``: ``RemoteEngine`` (the ``Engine`` protocol over the socket) and ``connect``.
- ``lifecycle``: ``fp start`` / ``fp status`` / ``fp stop``: spawn, probe and end the server.

Nothing here imports torch or an engine at import time.
"""
