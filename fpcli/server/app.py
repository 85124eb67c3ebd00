"""The resident engine's HTTP application (FastAPI) around any in-process ``Engine``.

Endpoints for ``fpcli.server.client.RemoteEngine`` (JSON bodies):

- ``GET /fp/health``: ``ServerInfo`` fields plus pid, uptime, idle time, requests served,
  busy/queued counts, RSS and (on CUDA) device memory in use, in bytes.
- ``POST /fp/encode_chat`` ``{system, user}`` -> ``{ids}``; ``POST /fp/count_tokens`` ``{text}``
  -> ``{tokens}``; ``POST /fp/token_starts`` ``{text}`` -> ``{starts}`` (character offset of each
  token); these run beside a generation, not queued behind it.
- ``POST /fp/context_reserve`` ``{max_new_tokens}`` -> ``{tokens}``: the tokens of the context the
  engine keeps from a request beyond its prompt and answer (``fpcli.prompt.engine_reserve``).
- ``POST /fp/generate`` ``{prompt_ids, max_new_tokens, temperature}`` -> NDJSON stream: ``{"cached":
  tokens}`` once before the prefill (engines that know it then: the prompt tokens its KV cache
  serves), ``{"progress": [done, total]}`` during the prefill (the engine's ``on_progress``),
  ``{"text": piece}`` lines, ``{}`` heartbeats every ``heartbeat_s`` while waiting or prefilling,
  then one ``{"result": GenerationResult.to_dict()}`` or ``{"error": message}`` line.
- ``POST /fp/shutdown``: the server ends after this response.

OpenAI-compatible, for other clients: ``GET /v1/models``, ``POST /v1/chat/completions`` (one user
message, optional system messages; ``stream`` true or false). A stream sends SSE comments while
no token comes: ``: waiting`` every ``heartbeat_s``, and ``: prefill done/total`` for each step of
the prefill an engine reports (those steps restart the heartbeat's timer, so they are the
keep-alive of a prefill whose steps come faster than it).

Requests run one at a time, first come first served, on one worker thread. A client that
disconnects cancels its own request only: queued, it is dropped; running, the generation stops at
its next decode step (the ``on_text`` callback raises ``GenerationCancelled``).
With a token (TCP), every request needs ``Authorization: Bearer <token>``.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

HEARTBEAT_S = 2.0


class GenerationCancelled(Exception):
    """Raised inside ``Engine.generate`` (from ``on_text``) when the client went away."""


@dataclass(frozen=True)
class ServerInfo:
    """What the server holds (reported by ``/fp/health``, matched by clients)."""

    model: str
    model_path: str
    profile: str
    profile_hash: str
    engine: str
    context_length: int
    precision: str
    version: str
    context: int | None = None  # the profile's engine.context_length (None: the model's own)
    settings_hash: str | None = None  # profile_hash(profile, context=False)
    device: str | None = None  # "cuda" or "cpu": where the engine runs


@dataclass
class ServerCounters:
    started_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)
    requests_served: int = 0
    requests_cancelled: int = 0
    busy: int = 0
    queued: int = 0


class EncodeChatBody(BaseModel):
    system: str | None = None
    user: str


class CountTokensBody(BaseModel):
    text: str


class ReserveBody(BaseModel):
    max_new_tokens: int = Field(ge=1)


class GenerateBody(BaseModel):
    prompt_ids: list[int] = Field(min_length=1)
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0)


class ChatMessage(BaseModel):
    role: str
    content: str | list | None = None


class ChatCompletionBody(BaseModel):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    stream: bool = False


def memory_usage() -> dict:
    """``rss_bytes`` of this process and, when torch has CUDA up, ``gpu_used_bytes`` of its device
    (device-wide: SGLang's model lives in child processes)."""
    out: dict = {"rss_bytes": None, "gpu_used_bytes": None}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info()
                out["gpu_used_bytes"] = int(total - free)
        except Exception:  # noqa: BLE001 - memory is informative only
            pass
    return out


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def create_app(engine, info: ServerInfo, token: str | None = None, idle_s: float | None = None,
               request_exit: Callable[[], None] | None = None, heartbeat_s: float = HEARTBEAT_S) -> FastAPI:
    """The application serving ``engine`` (an ``fpcli.engine.base.Engine``, kept open).

    Args:
        engine: the loaded engine; used from one worker thread for generation.
        info: what is served (reported by ``/fp/health``).
        token: bearer token every request must present (``None``: no check; Unix socket).
        idle_s: end the server (``request_exit``) after this many seconds without a request.
        request_exit: asks the hosting server to stop (uvicorn's ``should_exit``).
        heartbeat_s: seconds between ``{}`` lines of a waiting or prefilling generate stream.
    """
    counters = ServerCounters()
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp-engine")  # FIFO, one at a time
    stop = request_exit or (lambda: None)

    async def idle_watch() -> None:
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            if counters.busy == 0 and counters.queued == 0 and time.monotonic() - counters.last_activity >= idle_s:
                from fpcli.console import note, stderr_console

                note(stderr_console(), f"no request for {idle_s:g} s (the idle limit): stopping")
                stop()
                return

    async def lifespan(app):
        task = asyncio.create_task(idle_watch()) if idle_s else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="fp resident engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if token is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return JSONResponse({"error": "missing or wrong bearer token (see the token file fp serve printed)"},
                                    status_code=401)
        if request.url.path != "/fp/health":  # probes (fp status, fp start) do not keep it alive
            counters.last_activity = time.monotonic()
        return await call_next(request)

    def health() -> dict:
        now = time.monotonic()
        return {
            **asdict(info),
            "pid": os.getpid(),
            "started_at": counters.started_at,
            "uptime_s": time.time() - counters.started_at,
            "idle_s": 0.0 if counters.busy else now - counters.last_activity,
            "idle_limit_s": idle_s,
            "requests_served": counters.requests_served,
            "requests_cancelled": counters.requests_cancelled,
            "busy": counters.busy,
            "queued": counters.queued,
            **memory_usage(),
        }

    @app.get("/fp/health")
    async def get_health() -> dict:
        return health()

    tokenizing = threading.Lock()  # tokenization requests one at a time (beside a running generation)

    @app.post("/fp/encode_chat")
    def encode_chat(body: EncodeChatBody) -> dict:  # sync: starlette runs it in its thread pool
        with tokenizing:
            return {"ids": [int(i) for i in engine.encode_chat(body.system, body.user)]}

    @app.post("/fp/count_tokens")
    def count_tokens(body: CountTokensBody) -> dict:
        with tokenizing:
            return {"tokens": int(engine.count_tokens(body.text))}

    @app.post("/fp/token_starts")
    def token_starts(body: CountTokensBody) -> dict:
        with tokenizing:
            return {"starts": [int(i) for i in engine.token_starts(body.text)]}

    @app.post("/fp/context_reserve")
    def context_reserve(body: ReserveBody) -> dict:
        from fpcli.prompt import engine_reserve

        return {"tokens": int(engine_reserve(engine, body.max_new_tokens))}

    @app.post("/fp/shutdown")
    async def shutdown() -> dict:
        stop()
        return {"stopping": True, "pid": os.getpid()}

    async def run_queued(prompt_ids, max_new_tokens, temperature):
        """Async iterator of ("cached", tokens) / ("progress", (done, total)) / ("text", piece) /
        ("wait", None) / ("result", GenerationResult) / ("error", message); cancels the request
        when the consumer stops early."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def on_text(piece: str) -> None:
            if cancel.is_set():
                raise GenerationCancelled("the client disconnected")
            loop.call_soon_threadsafe(pieces.put_nowait, ("text", piece))

        def on_progress(done: int, total: int) -> None:  # prefill steps: a cancel stops the prefill too
            if cancel.is_set():
                raise GenerationCancelled("the client disconnected during the prefill")
            loop.call_soon_threadsafe(pieces.put_nowait, ("progress", (int(done), int(total))))

        def on_cached(tokens: int) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, ("cached", int(tokens)))

        def work():
            counters.queued -= 1
            queued_s = time.perf_counter() - t_queued
            if cancel.is_set():
                raise GenerationCancelled("the client disconnected while queued")
            counters.busy += 1
            try:
                result = engine.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                         on_text=on_text, on_progress=on_progress, on_cached=on_cached)
                result.queued_s = queued_s
                return result
            finally:
                counters.busy -= 1
                counters.last_activity = time.monotonic()

        counters.queued += 1
        t_queued = time.perf_counter()
        future = loop.run_in_executor(worker, work)
        future.add_done_callback(lambda f: pieces.put_nowait(("done", None)))
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(pieces.get(), timeout=heartbeat_s)
                except asyncio.TimeoutError:
                    yield "wait", None
                    continue
                if kind == "done":
                    break
                yield kind, value
            try:
                result = future.result()
            except GenerationCancelled:
                counters.requests_cancelled += 1
                return
            except Exception as exc:  # noqa: BLE001 - reported to the client, the server lives on
                yield "error", _one_line(exc)
                return
            counters.requests_served += 1
            yield "result", result
        finally:
            if not future.done():
                cancel.set()
                counters.requests_cancelled += 1
                future.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)

    @app.post("/fp/generate")
    async def generate(body: GenerateBody):
        async def lines():
            async for kind, value in run_queued(body.prompt_ids, body.max_new_tokens, body.temperature):
                if kind == "text":
                    yield json.dumps({"text": value}) + "\n"
                elif kind == "wait":
                    yield "{}\n"
                elif kind in ("cached", "progress"):
                    yield json.dumps({kind: value}) + "\n"
                elif kind == "result":
                    yield json.dumps({"result": value.to_dict()}) + "\n"
                else:
                    yield json.dumps({"error": value}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # -- OpenAI-compatible ------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": info.model, "object": "model", "created": int(counters.started_at),
                                            "owned_by": "fp"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody):
        system = "\n\n".join(_text_of(m.content) for m in body.messages if m.role in ("system", "developer"))
        turns = [m for m in body.messages if m.role not in ("system", "developer")]
        if len(turns) != 1 or turns[0].role != "user":
            raise HTTPException(400, "messages: expected system messages and exactly one user message "
                                     f"(multi-turn chat is not supported), got roles {[m.role for m in body.messages]}")
        ids = (await asyncio.to_thread(encode_chat, EncodeChatBody(system=system or None,
                                                                    user=_text_of(turns[0].content))))["ids"]
        max_new = body.max_completion_tokens or body.max_tokens or 256
        temperature = body.temperature or 0.0
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        base = {"id": cid, "created": created, "model": info.model}

        if not body.stream:
            result, error = None, None
            async for kind, value in run_queued(ids, max_new, temperature):
                if kind == "result":
                    result = value
                elif kind == "error":
                    error = value  # cached and progress: not in OpenAI's API
            if result is None:
                raise HTTPException(500, error or "generation failed")
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                                 "finish_reason": result.finish_reason}],
                    "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.output_tokens,
                              "total_tokens": result.prompt_tokens + result.output_tokens}}

        async def events():
            def chunk(delta: dict, finish=None) -> str:
                data = {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                return f"data: {json.dumps(data)}\n\n"

            yield chunk({"role": "assistant", "content": ""})
            async for kind, value in run_queued(ids, max_new, temperature):
                if kind == "text":
                    yield chunk({"content": value})
                elif kind == "wait":
                    yield ": waiting\n\n"  # an SSE comment: keeps the connection alive
                elif kind == "progress":  # the prefill's steps reset the heartbeat's timer: they keep it alive
                    yield f": prefill {value[0]}/{value[1]}\n\n"
                elif kind == "result":
                    yield chunk({}, value.finish_reason)
                elif kind == "error":
                    yield f"data: {json.dumps({'error': {'message': value}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
