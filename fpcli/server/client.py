"""``RemoteEngine``: the ``fpcli.engine.base.Engine`` protocol spoken to a resident engine, and
``connect``, which finds a running one that matches a model and profile.

Timeouts: connecting and ``/fp/health`` get a few seconds (a hung server is detected, never
waited on); a generate stream gets ``{}`` heartbeats from the server every ~2 s, so its read
timeout (``ClientConfig.stream_read_s``) bounds how long a silent server is trusted, whatever
the prefill length.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from fpcli.engine.base import GenerationResult

from .paths import ServerPaths, default_paths
from .state import ServerState, StartingState, clear_stale, pid_alive, profile_hash, read_starting, read_state


class ServerUnavailable(RuntimeError):
    """The resident engine did not answer (connection refused or closed, or a timeout)."""


class _NotServed(RuntimeError):
    """The server has no such endpoint (HTTP 404: an older fp started it)."""


@dataclass(frozen=True)
class ClientConfig:
    """Client timeouts, in seconds."""

    connect_s: float = 2.0
    health_s: float = 5.0
    request_s: float = 60.0  # tokenization requests
    stream_read_s: float = 30.0  # longest silence accepted inside a generate stream


def _client(state: ServerState, token: str | None = None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if state.address.startswith("unix:"):
        transport = httpx.HTTPTransport(uds=state.address[len("unix:"):])
        return httpx.Client(transport=transport, base_url="http://fp-engine", headers=headers)
    return httpx.Client(base_url=state.address, headers=headers)


def _token(state: ServerState) -> str | None:
    if not state.token_file:
        return None
    try:
        with open(state.token_file, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def probe(state: ServerState, config: ClientConfig = ClientConfig()) -> dict:
    """``/fp/health`` of the server in ``state``.

    Raises:
        ServerUnavailable: refused, closed, or no answer (``connect_s`` to connect, then
            ``health_s`` for the answer); ``"timed out after N s"`` in the message, N the seconds
            actually waited: the process lives but does not answer.
    """
    timeout = httpx.Timeout(config.health_s, connect=config.connect_s)
    t0 = time.monotonic()
    try:
        with _client(state, _token(state)) as c:
            r = c.get("/fp/health", timeout=timeout)
            r.raise_for_status()
            return r.json()
    except httpx.TimeoutException:
        raise ServerUnavailable(f"timed out after {time.monotonic() - t0:.1f} s") from None
    except (httpx.HTTPError, ValueError) as exc:
        raise ServerUnavailable(str(exc) or type(exc).__name__) from None


def shutdown(state: ServerState, config: ClientConfig = ClientConfig()) -> bool:
    """Ask the server to end; True if it acknowledged."""
    try:
        with _client(state, _token(state)) as c:
            c.post("/fp/shutdown", timeout=httpx.Timeout(config.health_s, connect=config.connect_s)).raise_for_status()
            return True
    except httpx.HTTPError:
        return False


class RemoteEngine:
    """An ``Engine`` whose model lives in the resident engine (see ``fpcli.engine.base.Engine``).

    ``server`` describes who answers (``address``, ``pid``, and ``engine_start_s = 0``: no engine
    was started for this command). ``waited_s``: seconds the command waited for it to start
    (``fp start`` was starting it; 0.0 when it ran), which the command counts as its engine start. ``close`` closes the connection only; the server lives on.
    """

    def __init__(self, state: ServerState, health: dict, config: ClientConfig = ClientConfig()) -> None:
        self.state = state
        self.config = config
        self.name = str(health["engine"])
        self.model_name = str(health["model"])
        self.precision = str(health["precision"])
        self.context_length = int(health["context_length"])
        self.profile_name = str(health["profile"])
        self.model_path = state.model_path  # the model folder (both processes read the same tokenizer)
        self.server = {"address": state.address, "pid": state.pid, "engine_start_s": 0.0}
        self.start_s = 0.0  # no engine was started by this process
        self.waited_s = 0.0  # seconds this command waited for it to start (``connect``); counted as engine start
        self._http = _client(state, _token(state))
        self._reserves: dict[int, int] = {}  # max_new_tokens -> the server's context_reserve

    def _post(self, path: str, body: dict) -> dict:
        try:
            r = self._http.post(path, json=body, timeout=httpx.Timeout(self.config.request_s, connect=self.config.connect_s))
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"the resident engine at {self.state.address} did not answer ({exc})") from None
        if r.status_code == 404:
            raise _NotServed(f"the resident engine does not serve {path} (an older fp)")
        if r.status_code != 200:
            raise RuntimeError(f"the resident engine refused {path}: HTTP {r.status_code} {r.text[:200]}")
        return r.json()

    def context_reserve(self, max_new_tokens: int) -> int:
        """Tokens a prompt leaves free beyond the answer, as the resident engine reports them
        (``POST /fp/context_reserve``; asked once per ``max_new_tokens``).

        A server too old to answer it (HTTP 404) gets the largest reserve of fp's engines,
        ``fpcli.engine.sglang_engine.context_reserve`` (2 to 6 tokens), whatever it runs: a prompt
        a few tokens shorter than it could be, never one the engine refuses or cuts the answer of.

        Raises:
            ServerUnavailable: the server did not answer.
            RuntimeError: it refused the request (other than 404).
        """
        n = int(max_new_tokens)
        if n not in self._reserves:
            try:
                self._reserves[n] = int(self._post("/fp/context_reserve", {"max_new_tokens": n})["tokens"])
            except _NotServed:
                from fpcli.engine.sglang_engine import context_reserve

                self._reserves[n] = context_reserve(n)
        return self._reserves[n]

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        return [int(i) for i in self._post("/fp/encode_chat", {"system": system, "user": user})["ids"]]

    def count_tokens(self, text: str) -> int:
        return int(self._post("/fp/count_tokens", {"text": text})["tokens"])

    def token_starts(self, text: str) -> list[int]:
        return [int(i) for i in self._post("/fp/token_starts", {"text": text})["starts"]]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_cached: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """As ``Engine.generate``: ``on_cached`` and ``on_progress`` get what the server's engine
        reports (its ``{"cached"}`` and ``{"progress"}`` lines; a server of an older fp sends
        neither); waits in the server's queue while it is busy. Interrupting
        (KeyboardInterrupt) closes the connection, which cancels this request on the server.

        Raises:
            ServerUnavailable: the server closed the connection or stayed silent for
                ``stream_read_s`` seconds.
            RuntimeError: the engine failed (its one-line message).
        """
        body = {"prompt_ids": [int(i) for i in prompt_ids], "max_new_tokens": int(max_new_tokens),
                "temperature": float(temperature)}
        timeout = httpx.Timeout(self.config.stream_read_s, connect=self.config.connect_s)
        try:
            with self._http.stream("POST", "/fp/generate", json=body, timeout=timeout) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"the resident engine refused the request: HTTP {r.status_code} {r.text[:200]}")
                for line in r.iter_lines():
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if "text" in msg:
                        if on_text is not None:
                            on_text(msg["text"])
                    elif "cached" in msg:
                        if on_cached is not None:
                            on_cached(int(msg["cached"]))
                    elif "progress" in msg:
                        if on_progress is not None:
                            on_progress(*(int(x) for x in msg["progress"]))
                    elif "result" in msg:
                        return GenerationResult.from_dict(msg["result"])
                    elif "error" in msg:
                        raise RuntimeError(msg["error"])
        except httpx.TimeoutException:
            raise ServerUnavailable(f"the resident engine at {self.state.address} was silent for "
                                    f"{self.config.stream_read_s:.0f} s") from None
        except httpx.HTTPError as exc:
            raise ServerUnavailable(self._lost(str(exc) or type(exc).__name__)) from None
        raise ServerUnavailable(self._lost("the stream ended before the result"))

    def _lost(self, detail: str) -> str:
        """What to say when the stream broke: the server process ended (waits up to
        ``config.connect_s`` for it to be gone), or it lives and closed the connection."""
        deadline = time.monotonic() + self.config.connect_s
        while pid_alive(self.state.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pid_alive(self.state.pid):
            return (f"the resident engine (pid {self.state.pid}) stopped during the answer; run the command again "
                    "(it will run in-process) or `fp start` again")
        return (f"the resident engine (pid {self.state.pid}, {self.state.address}) closed the connection during the "
                f"answer ({detail}); run the command again, or see `fp status`")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def profile_difference(state: ServerState, profile) -> str:
    """What differs between the resident engine's profile and ``profile`` (a ``Profile`` whose
    settings differ beyond the context), for the note of ``connect``: both names (with the YAML
    file of a path profile), both contexts when they differ, and the keys that differ when the
    resident profile is a built-in one (its settings are known here), e.g. "profile bf16 at
    context 8,192 tokens (this command: bf16 from my.yaml, differs in sparse.alpha)"."""
    from fpcli.profiles import builtin_profiles, load_profile, profile_file, with_context_length

    theirs = f"profile {state.profile}"
    mine = profile.name + (f" from {profile_file(profile)}" if profile_file(profile) else "")
    if state.context != profile.engine.context_length:
        theirs += f" at {context_words(state.context)}"
        mine += f" at {context_words(profile.engine.context_length)}"
    keys: list[str] = []
    if state.profile in builtin_profiles():
        try:
            resident = load_profile(state.profile)
            if state.context is not None:
                resident = with_context_length(resident, state.context)
            if profile_hash(resident) == state.profile_hash:  # it is the built-in, unchanged
                ours, other = _settings(profile), _settings(resident)
                keys = [k for k in sorted(set(ours) | set(other))
                        if ours.get(k) != other.get(k) and k != "engine.context_length"]
        except Exception:  # noqa: BLE001 - the note then names the profiles only
            keys = []
    if keys:
        mine += ", differs in " + ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    return f"{theirs} (this command: {mine})"


def _settings(profile) -> dict:
    """A profile's settings as ``{"sparse.alpha": 0.05, ...}`` (no name, description or source)."""
    flat = {}
    for key, value in profile.to_dict().items():
        if key in ("name", "description", "source"):
            continue
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def context_words(tokens: int | None) -> str:
    """``context 2,048 tokens``, or ``the model's own context`` for ``None``."""
    return "the model's own context" if tokens is None else f"context {int(tokens):,} tokens"


def wait_for_starting(paths: ServerPaths, note: Callable[[str], None], warn: Callable[[str], None],
                      poll_s: float = 0.1, starting: StartingState | None = None) -> ServerState | None:
    """Wait for the engine that ``fp start`` is starting, if any (``starting``, else its starting
    marker read now; ``lifecycle.await_starting``): its state once it answers, or ``None`` when none
    is starting, or it was stopped (its marker removed: ``fp stop``), ended by itself, or was not
    ready when its ``fp start`` gives up on it (``StartingState.ready_by``), each said through
    ``warn``. Says that it waits through ``note``. Blocks; Ctrl-C raises KeyboardInterrupt."""
    from .lifecycle import await_starting

    starting = starting or read_starting(paths)
    if starting is None:
        return None
    note(f"a resident engine is starting (pid {starting.pid}, since {max(0.0, time.time() - starting.started_at):.0f} s); "
         "waiting for it (--no-server runs in-process instead)")
    state, why = await_starting(paths, starting, poll_s=poll_s)
    if state is not None:
        return state
    what = f"the resident engine that was starting (pid {starting.pid})"
    if why == "stopped":
        warn(f"{what} was stopped; running in-process")
    elif why == "ended":
        warn(f"{what} ended before it was ready" + (f" (log {starting.log}); " if starting.log else "; ")
             + "running in-process")
    else:
        warn(f"{what} was not ready by its deadline; running in-process")
    return None


def connect(model: str | None, profile, engine: str = "auto", paths: ServerPaths | None = None,
            config: ClientConfig = ClientConfig(), warn: Callable[[str], None] | None = None,
            note: Callable[[str], None] | None = None, one_request: bool = False) -> RemoteEngine | None:
    """The running resident engine when it holds the same model (resolved path), the same profile
    (by content: ``profile_hash``) and, unless ``engine`` is ``auto``, the same engine; else
    ``None`` (run in-process).

    An engine that ``fp start`` is still starting (``ServerPaths.starting``) is waited for, said
    through ``note`` (``wait_for_starting``), unless its marker says it will serve another model,
    profile or engine (said through ``note``: in-process at once); Ctrl-C stops the wait
    (KeyboardInterrupt). A stale starting marker is removed and said through ``warn``.
    A stale state (dead process) is removed and reported through ``warn``; a server that does not
    answer its health check within ``config`` timeouts is reported through ``warn`` (in-process
    then); a running engine that does not match is reported through ``note``. Never raises for a
    server problem.
    """
    warn = warn or (lambda m: None)
    note = note or (lambda m: None)
    paths = paths or default_paths()
    state = read_state(paths)
    if state is None:
        from .lifecycle import check_starting

        starting, stale = check_starting(paths)
        if stale:
            warn(f"{stale}; running in-process")
        if starting is None:
            return None
        serves = starting.serves()
        if serves is not None:
            differs = _differences(serves, model, profile, engine, one_request)
            if differs is None:
                return None
            if differs:
                note(f"the resident engine that is starting (pid {starting.pid}) will run {', '.join(differs)}; "
                     "this command runs in-process")
                return None
        t_wait = time.monotonic()
        state = wait_for_starting(paths, note, warn, starting=starting)
        waited = time.monotonic() - t_wait
    else:
        waited = 0.0
    if state is None:
        return None
    if not pid_alive(state.pid):
        clear_stale(paths, state)
        warn(f"the resident engine (pid {state.pid}) is gone; removed its stale state file; running in-process")
        return None
    differs = _differences(state, model, profile, engine, one_request)
    if differs is None:
        return None
    if differs:
        note(f"the resident engine runs {', '.join(differs)}; this command runs in-process")
        return None
    try:
        health = probe(state, config)
    except ServerUnavailable as exc:
        warn(f"the resident engine (pid {state.pid}, {state.address}) does not answer ({exc}); "
             "running in-process (see `fp status`)")
        return None
    remote = RemoteEngine(state, health, config)
    remote.waited_s = waited
    return remote


def _differences(state: ServerState, model: str | None, profile, engine: str, one_request: bool) -> list[str] | None:
    """What differs between the engine ``state`` describes and this command's model, profile and
    engine (``["model X", ...]``; empty: it matches), or ``None`` when the request cannot be
    resolved (the in-process path reports a bad model)."""
    try:
        from fpcli.engine import resolve_request
        from fpcli.models import resolve_model

        # the same defaults as the server's; the running engine spares a CUDA probe (torch)
        _, model, profile = resolve_request(engine, model, profile, running=state.engine, one_request=one_request,
                                            running_device=state.device)
        wanted = str(resolve_model(model, progress=False))
    except Exception:  # noqa: BLE001 - the in-process path reports a bad model
        return None
    differs = []
    if wanted != state.model_path:
        differs.append(f"model {state.model}")
    if profile_hash(profile) != state.profile_hash:
        if state.settings_hash is not None and profile_hash(profile, context=False) == state.settings_hash:
            differs.append(f"profile {state.profile} at {context_words(state.context)} "
                           f"(this command: {context_words(profile.engine.context_length)})")
        else:
            differs.append(profile_difference(state, profile))
    if engine not in ("auto", state.engine):
        differs.append(f"engine {state.engine}")
    return differs
