"""The resident engine (``fp start`` / ``fp status`` / ``fp stop`` / ``fp serve``) and its faults.

Every server here is a real ``fp serve`` subprocess in temporary runtime and state folders
(``XDG_RUNTIME_DIR`` / ``XDG_STATE_HOME`` for that subprocess); the fault tests use the fake engine
of ``fp_server_fakes`` (``FP_ENGINE_FACTORY``), one lifecycle test loads the real embedded model.
Every wait is bounded, and the ``servers`` fixture kills whatever a test started.
"""
from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fpcli.server.paths import ServerPaths

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DOC = ROOT / "examples" / "harbor-report.md"


def _alive(pid: int) -> bool:
    from fpcli.server.state import pid_alive

    return pid_alive(pid)


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Servers:
    """Runs ``python -m fpcli`` in private runtime/state folders; remembers every pid to kill."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.runtime = root / "rt"
        self.state_home = root / "st"
        self.runtime.mkdir(mode=0o700)
        self.state_home.mkdir(mode=0o700)
        self.trace = root / "trace.txt"
        self.model = str(model_dir)
        self.paths = ServerPaths(self.runtime / "fp", self.state_home / "fp")
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(self.runtime), XDG_STATE_HOME=str(self.state_home),
                        FP_ENGINE_FACTORY="fp_server_fakes:load", FP_FAKE_TRACE=str(self.trace),
                        PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.pids: set[int] = set()

    def fp(self, *args, timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "fpcli", *args], capture_output=True, text=True, timeout=timeout,
                           env={**self.env, **(env or {})}, cwd=str(ROOT), **kw)
        self.remember()
        return r

    def probe(self, *args, timeout: float = 120, env: dict | None = None, **kw) -> tuple[subprocess.CompletedProcess, list]:
        """``fp(*args)`` run through ``fp_import_probe``: also returns the heavy modules it imported."""
        out = self.trace.with_name("modules.json")
        out.unlink(missing_ok=True)
        r = subprocess.run([sys.executable, str(TESTS / "fp_import_probe.py"), str(out), *args], capture_output=True,
                           text=True, timeout=timeout, env={**self.env, **(env or {})}, cwd=str(ROOT), **kw)
        self.remember()
        return r, json.loads(out.read_text()) if out.exists() else ["(no record: the process did not exit normally)"]

    def popen(self, *args, env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-m", "fpcli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**self.env, **(env or {})}, cwd=str(ROOT))
        self.pids.add(p.pid)
        return p

    def state(self) -> dict | None:
        try:
            return json.loads(self.paths.state.read_text())
        except FileNotFoundError:
            return None

    def remember(self) -> None:
        s = self.state()
        if s:
            self.pids.add(int(s["pid"]))

    def traced(self, kind: str) -> list[list[str]]:
        if not self.trace.exists():
            return []
        return [ln.split()[1:] for ln in self.trace.read_text().splitlines() if ln.split()[0] == kind]

    def kill_all(self) -> None:
        self.remember()
        children = [int(p[0]) for p in self.traced("child")]
        for pid in list(self.pids) + children:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, sig)
                    else:
                        os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def servers():
    root = Path(tempfile.mkdtemp(prefix="fps-", dir="/tmp"))  # short: a Unix socket path holds 107 bytes
    model = root / "fake-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    s = Servers(root, model)
    try:
        yield s
    finally:
        s.kill_all()
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _start(s: Servers, *extra, env=None):
    r = s.fp("start", "--model", s.model, *extra, "--timeout", "60", env=env)
    assert r.returncode == 0, r.stderr
    st = s.state()
    assert st is not None and _alive(st["pid"])
    return st


def _ask(s: Servers, *extra, timeout=120, env=None):
    return s.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--model", s.model, "--json", *extra,
                timeout=timeout, env=env)


# -- units ------------------------------------------------------------------------------------------


def test_default_paths_follow_xdg(monkeypatch, tmp_path):
    from fpcli.server.paths import default_paths

    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(rt))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "st"))
    p = default_paths().ensure()
    assert p.runtime_dir.parent == rt and p.log_dir.parent == tmp_path / "st"
    assert stat.S_IMODE(os.stat(p.runtime_dir).st_mode) == 0o700


def test_profile_hash_is_content_not_name():
    from fpcli.profiles import load_profile
    from fpcli.server.state import profile_hash

    bf16 = load_profile("bf16")
    assert profile_hash(bf16) == profile_hash(bf16.replace(name="mine", description="same settings"))
    assert profile_hash(bf16) != profile_hash(load_profile("dense"))
    assert profile_hash(bf16) != profile_hash(bf16.replace(dense_layers=bf16.dense_layers + 1))


def test_generation_result_round_trips():
    from fp_fakes import FakeEngine

    from fpcli.engine.base import GenerationResult

    r = FakeEngine().generate([5, 6, 7, 8], max_new_tokens=3)
    r.cached_tokens = 2
    r.decode_mode = "cuda graph"  # what a resident engine's answer says of its decode reaches the client
    back = GenerationResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.stats.density_per_layer_head == r.stats.density_per_layer_head
    assert back.decode_mode == "cuda graph"
    with pytest.raises(KeyError, match="text"):
        GenerationResult.from_dict({k: v for k, v in r.to_dict().items() if k != "text"})


@pytest.mark.parametrize("text,seconds", [("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0), ("45", 45.0), ("never", None)])
def test_durations(text, seconds):
    from fpcli.commands import parse_duration_or_exit

    assert parse_duration_or_exit("--idle", text) == seconds


def test_bad_duration_is_a_usage_error(runner):
    from fpcli.cli import app

    r = runner.invoke(app, ["start", "--idle", "ten minutes"])
    assert r.exit_code == 2 and "--idle ten minutes: expected a duration" in r.stderr


def test_non_loopback_host_is_refused(runner):
    from fpcli.cli import app

    for host in ("0.0.0.0", "192.168.1.5", "example.com"):
        r = runner.invoke(app, ["serve", "--port", "0", "--host", host])
        assert r.exit_code == 2 and f"--host {host}: only a loopback address is allowed" in r.stderr, r.stderr


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _left_socket(path: Path, listening: bool):
    """A Unix socket file at ``path``: closed without unlinking (what ``kill -9`` leaves), or
    listening (a live server's); returns the open socket of the latter."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(1)
        return sock
    sock.close()
    return None


@pytest.mark.parametrize("command", [["status"], ["stop"]])
def test_a_killed_servers_socket_is_removed_with_its_state(runner, command):
    from fpcli.cli import app
    from fpcli.server.paths import default_paths
    from fpcli.server.state import ServerState, write_state

    paths = default_paths().ensure()
    _left_socket(paths.socket, listening=False)
    write_state(paths, ServerState(pid=_dead_pid(), address=f"unix:{paths.socket}", model="m", model_path="/m",
                                   profile="bf16", profile_hash="0", engine="transformers", started_at=0.0,
                                   version="0"))
    r = runner.invoke(app, command)
    assert r.exit_code == (3 if command == ["status"] else 0) and "gone" in r.stderr, r.output
    assert not paths.state.exists() and not paths.socket.exists()
    assert f"socket {paths.socket}" in r.stderr


def test_a_stale_state_never_removes_a_socket_a_live_server_listens_on(runner):
    from fpcli.cli import app
    from fpcli.server.paths import default_paths
    from fpcli.server.state import ServerState, write_state

    paths = default_paths().ensure()
    live = _left_socket(paths.socket, listening=True)
    try:
        write_state(paths, ServerState(pid=_dead_pid(), address=f"unix:{paths.socket}", model="m",
                                       model_path="/m", profile="bf16", profile_hash="0", engine="transformers",
                                       started_at=0.0, version="0"))
        r = runner.invoke(app, ["status"])
        assert r.exit_code == 3 and "stale" in r.stderr
        assert not paths.state.exists() and paths.socket.is_socket()
    finally:
        live.close()


def test_a_stale_state_cleaned_while_a_new_server_binds_leaves_its_socket(monkeypatch):
    """A client that read a killed server's state cleans it (``clear_stale``) while a new server
    binds the same path: it must not unlink the new server's socket between its bind and its
    listen (a refused connect there looked like a leftover; the new server then listened on a
    removed path, unreachable, and every client saw it 'hung')."""
    import socket

    from fpcli.server.serve import ServeConfig, bind
    from fpcli.server.state import ServerState, clear_stale

    paths = ServerPaths(Path(tempfile.mkdtemp(prefix="fp-")), Path(tempfile.mkdtemp(prefix="fp-log-")))
    _left_socket(paths.socket, listening=False)  # what the killed server left
    dead = ServerState(pid=_dead_pid(), address=f"unix:{paths.socket}", model="m", model_path="/m",
                       profile="bf16", profile_hash="0", engine="transformers", started_at=0.0, version="0")
    chmod = os.chmod

    def chmod_then_clean(path, mode, *args, **kwargs):  # called by bind before it listens
        chmod(path, mode, *args, **kwargs)
        clear_stale(paths, dead)

    monkeypatch.setattr(os, "chmod", chmod_then_clean)
    sock, address, _ = bind(paths, ServeConfig())
    monkeypatch.setattr(os, "chmod", chmod)
    try:
        assert address == f"unix:{paths.socket}" and paths.socket.is_socket()
        assert stat.S_IMODE(paths.socket.stat().st_mode) == 0o600
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(paths.socket))  # the new server's socket answers
        client.close()
        assert not [p for p in paths.runtime_dir.iterdir() if p != paths.socket]  # no temporary name left
    finally:
        sock.close()


def test_detached_server_gets_fp_options_before_the_engine_settings():
    """``fp start -- --tp 2``: the server's command line parses back to engine settings ``--tp 2``
    alone, with ``--log`` read by fp serve, not passed to the engine."""
    import typer

    from fpcli.cli import app
    from fpcli.server.lifecycle import StartRequest, serve_command

    cmd = serve_command(StartRequest(serve_args=["--profile", "bf16"], engine_args=["--tp", "2"]), "/tmp/x/server.log")
    assert cmd[3] == "serve"
    group = typer.main.get_command(app)
    serve = group.commands["serve"]
    ctx = serve.make_context("serve", cmd[4:], parent=group.make_context("fp", ["serve"], resilient_parsing=True))
    assert ctx.args == ["--tp", "2"] and ctx.params["log"] == "/tmp/x/server.log"
    plain = serve_command(StartRequest(serve_args=["--profile", "bf16"]), "/tmp/x/server.log")
    assert "--" not in plain and plain[-2:] == ["--log", "/tmp/x/server.log"]


# -- lifecycle with the real embedded model ----------------------------------------------------------


@pytest.mark.slow
def test_lifecycle_with_the_real_engine(servers):
    s = servers
    env = {"FP_ENGINE_FACTORY": ""}  # the real loader
    r = s.fp("start", "--engine", "transformers", "--timeout", "300", timeout=360, env=env)
    assert r.returncode == 0, r.stderr
    st = s.state()
    assert "started" in r.stderr and st["engine"] == "transformers"
    answers = []
    for _ in range(2):
        a = s.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--engine", "transformers", "-n", "8", "--json",
                 timeout=300, env=env)
        assert a.returncode == 0, a.stderr
        data = json.loads(a.stdout)
        assert data["summary"]["server"]["pid"] == st["pid"] and data["summary"]["server"]["engine_start_s"] == 0.0
        assert data["summary"]["output_tokens"] > 0 and data["summary"]["engine"] == "transformers"
        answers.append(data["answer"])
    assert answers[0] == answers[1]  # greedy: the same question gets the same answer
    local = s.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--engine", "transformers", "-n", "8", "--json",
                 "--no-server", timeout=300, env=env)
    assert local.returncode == 0, local.stderr
    assert json.loads(local.stdout)["summary"]["server"] is None and json.loads(local.stdout)["answer"] == answers[0]
    status = s.fp("status", "--json", env=env)
    info = json.loads(status.stdout)
    assert status.returncode == 0 and info["status"] == "running"
    assert info["health"]["requests_served"] == 2 and info["health"]["rss_bytes"] > 0
    assert re.search(r"^engine: +transformers on (cpu|cuda) \(", s.fp("status", env=env).stdout, re.M)
    stop = s.fp("stop", env=env)
    assert stop.returncode == 0 and "shut down" in stop.stderr, stop.stderr
    assert not _alive(st["pid"]) and s.state() is None and not s.paths.socket.exists()
    again = s.fp("stop", env=env)  # idempotent
    assert again.returncode == 0 and "no resident engine runs" in again.stderr


@pytest.mark.slow
def test_the_prefill_line_counts_only_what_a_resident_engine_prefills(servers):
    """A follow-up whose documents the resident transformers engine holds in its KV cache: the live
    line says the tokens it prefills and the cached ones, before the prefill (it said the whole
    prompt), and the engine's per-layer progress reaches the client (bar and ETA)."""
    import io

    from rich.console import Console

    from fpcli.prefill_progress import PrefillDisplay

    s = servers
    env = {"FP_ENGINE_FACTORY": ""}  # the real loader
    r = s.fp("start", "--engine", "transformers", "--timeout", "300", timeout=360, env=env)
    assert r.returncode == 0, r.stderr
    text = DOC.read_text(encoding="utf-8")[:1500]
    seen = []
    with _remote(s) as eng:
        for question in ("Who runs the harbor?", "When will the new ferry terminal open?"):
            ids = eng.encode_chat(None, f"{text}\n\n{question}")
            console = Console(file=io.StringIO(), force_terminal=True, width=120)
            events = []
            with PrefillDisplay(console, len(ids)) as display:
                def on_cached(n, display=display, events=events):
                    display.on_cached(n)
                    events.append(("cached", n, display.line))

                def on_progress(done, total, display=display, events=events):
                    display.on_progress(done, total)
                    events.append(("progress", (done, total), display.line))

                result = eng.generate(ids, max_new_tokens=2, on_cached=on_cached, on_progress=on_progress)
            seen.append((len(ids), result, events))
    (n0, first, ev0), (n1, second, ev1) = seen
    assert ev0[0] == ("cached", 0, f"prefilling {n0:,} tokens") and first.cached_tokens == 0
    c = second.cached_tokens
    assert 0 < c < n1  # the documents' prefix was served by the KV cache
    assert ev1[0] == ("cached", c, f"prefilling {n1 - c:,} tokens ({c:,} cached)")  # before any progress
    progress = [e for e in ev1 if e[0] == "progress"]
    assert progress and progress[-1][1][0] == progress[-1][1][1]  # every layer reported
    assert all(e[2] == f"prefilling {n1 - c:,} tokens ({c:,} cached)" for e in progress)


def _fake_sglang(root: Path) -> str:
    """A folder holding an importable-looking ``sglang`` package (empty): ``fp`` then believes SGLang
    is installed, as on a GPU host, and resolving ``--engine auto`` would probe CUDA (import torch)."""
    pkg = root / "fake-site" / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    return str(pkg.parent)


@pytest.mark.parametrize("command", ["ask", "profile", "chat"])
def test_resident_client_imports_no_model_libraries(servers, command):
    """A command answered by a running SGLang engine imports neither torch, transformers nor sglang
    (seconds on a GPU host), even where sglang is installed: the running engine says what runs."""
    s = servers
    env = {"FP_FAKE_ENGINE_NAME": "sglang", "PYTHONPATH": os.pathsep.join([_fake_sglang(s.runtime.parent), s.env["PYTHONPATH"]])}
    st = _start(s, env=env)
    assert st["engine"] == "sglang"
    args = {"ask": ("ask", DOC.as_posix(), "Who runs the harbor?", "--json"),
            "profile": ("profile", DOC.as_posix(), "--json", "--png", str(s.runtime.parent / "d.png")),
            "chat": ("chat", DOC.as_posix())}[command]
    r, heavy = s.probe(*args, "--model", s.model, env=env, input="Who runs the harbor?\n" if command == "chat" else None)
    assert r.returncode == 0, r.stderr
    assert len(s.traced("load")) == 1  # the server's engine answered: none was loaded in-process
    assert heavy == [], f"fp {command} through the resident engine imported {heavy}"


# -- faults (fake engine) ---------------------------------------------------------------------------


def test_files_are_private_and_ask_uses_the_server(servers):
    s = servers
    st = _start(s)
    p = s.paths
    assert stat.S_IMODE(os.stat(p.runtime_dir).st_mode) == 0o700
    for f in (p.socket, p.state, p.log):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert stat.S_ISSOCK(os.stat(p.socket).st_mode) and st["address"] == f"unix:{p.socket}"
    a = _ask(s)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["summary"]["server"]["pid"] == st["pid"]
    assert len(s.traced("load")) == 1  # answered by the server's engine, none loaded in-process
    b = _ask(s, "--no-server")
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["summary"]["server"] is None and len(s.traced("load")) == 2


def test_ask_through_the_resident_engine_does_not_claim_to_prefill_the_whole_prompt(servers):
    """The resident engine's KV cache may serve most of the prompt, and it says how much only during
    the request: the static line gives the prompt's size, never "prefilling" all of it."""
    _start(servers)
    resident = servers.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--model", servers.model)
    assert resident.returncode == 0, resident.stderr
    line = next(ln for ln in resident.stderr.splitlines() if " engine, model " in ln)
    assert re.search(r": prompt [\d,]+ tokens$", line) and "prefilling" not in resident.stderr, resident.stderr
    local = servers.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--model", servers.model, "--no-server")
    assert local.returncode == 0 and re.search(r": prefilling [\d,]+ tokens$", local.stderr, re.M), local.stderr


def test_stale_state_is_cleaned(servers):
    s = servers
    st = _start(s)
    os.kill(st["pid"], signal.SIGKILL)
    _wait(lambda: not _alive(st["pid"]), 10, "the server to die")
    status = s.fp("status")
    assert status.returncode == 3 and "stale" in status.stderr and f"pid {st['pid']} is gone" in status.stderr
    assert s.state() is None and not s.paths.socket.exists()
    # and through fp ask: a state naming a dead pid is cleaned, the answer comes in-process
    s.paths.state.write_text(json.dumps({**st, "pid": st["pid"]}))
    a = _ask(s)
    assert a.returncode == 0 and "removed its stale state file" in a.stderr, a.stderr
    assert json.loads(a.stdout)["summary"]["server"] is None and s.state() is None


def test_hung_server_is_reported_and_ask_falls_back(servers):
    s = servers
    st = _start(s)
    os.kill(st["pid"], signal.SIGSTOP)
    try:
        status = s.fp("status", timeout=30)
        assert status.returncode == 1 and "hangs" in status.stderr and "timed out" in status.stderr, status.stderr
        a = _ask(s, timeout=60)  # bounded: the health check times out in seconds
        assert a.returncode == 0, a.stderr
        assert "does not answer" in a.stderr and json.loads(a.stdout)["summary"]["server"] is None
        assert s.state() is not None  # hung is not stale: the state stays for fp stop
    finally:
        stop = s.fp("stop", "--wait", "2", timeout=60)
    assert stop.returncode == 0, stop.stderr
    assert not _alive(st["pid"]) and s.state() is None


def test_two_concurrent_starts_start_one_engine(servers):
    s = servers
    env = {"FP_FAKE_LOAD_S": "1.5"}
    procs = [s.popen("start", "--model", s.model, "--timeout", "60", env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted("started" if "engine started" in err else "running" if "already runs" in err else err for _, err in outs)
    assert said == ["running", "started"]
    s.remember()
    assert len(s.traced("load")) == 1


def test_second_start_with_another_profile_says_what_runs(servers):
    s = servers
    st = _start(s)
    r = s.fp("start", "--model", s.model, "--profile", "dense", "--timeout", "60")
    assert r.returncode == 1 and f"pid {st['pid']}" in r.stderr and "fp stop" in r.stderr and "--replace" in r.stderr
    assert s.state()["pid"] == st["pid"]
    r = s.fp("start", "--model", s.model, "--profile", "dense", "--replace", "--timeout", "60")
    assert r.returncode == 0, r.stderr
    new = s.state()
    assert new["pid"] != st["pid"] and new["profile"] == "dense" and not _alive(st["pid"])
    # an ask with the old profile does not use a server with another profile
    a = _ask(s)
    assert json.loads(a.stdout)["summary"]["server"] is None and "runs profile dense" in a.stderr


@pytest.mark.parametrize("extra,expected", [
    (["--bogus"], "no such option: --bogus"),
    (["stray"], "unexpected extra argument(s) (stray)"),
    (["--engine", "transformers", "--", "--tp", "2"], "engine settings after --: the transformers engine takes no extra engine settings (got --tp 2)"),
])
def test_start_refuses_bad_arguments_before_launching(servers, extra, expected):
    """Only what follows -- is engine settings; anything else unknown, or engine settings for the
    transformers engine, is a usage error before a server is launched."""
    s = servers
    r = s.fp("start", "--model", s.model, "--timeout", "60", *extra)
    assert r.returncode == 2, r.stderr
    assert expected in " ".join(r.stderr.split()), r.stderr
    assert s.state() is None and s.traced("load") == []


def test_start_with_context_matches_an_ask_with_the_same_context(servers):
    s = servers
    st = _start(s, "--context", "2k")
    assert st["context"] == 2048
    a = _ask(s, "--context", "2k")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["summary"]["server"]["pid"] == st["pid"]
    # the same profile at another context: the note says it is the context that differs
    b = _ask(s)
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["summary"]["server"] is None
    note = " ".join(b.stderr.split())
    assert "profile bf16 at context 2,048 tokens (this command: the model's own context)" in note, b.stderr
    again = s.fp("start", "--model", s.model, "--context", "2k", "--timeout", "60")
    assert again.returncode == 0 and "already runs" in again.stderr
    other = s.fp("start", "--model", s.model, "--timeout", "60")
    assert other.returncode == 1 and "another context" in other.stderr, other.stderr


def _remote(s: Servers):
    from fpcli.server.client import ClientConfig, RemoteEngine, probe
    from fpcli.server.state import ServerState

    state = ServerState.from_dict(s.state())
    return RemoteEngine(state, probe(state), ClientConfig())


@pytest.mark.parametrize("name,reserve", [("transformers", 5), ("sglang", 0)])
def test_the_client_uses_the_reserve_the_server_reports(servers, name, reserve):
    """The running engine's own reserve, whatever its name says (a name-based rule gave 0 and 2)."""
    s = servers
    _start(s, env={"FP_FAKE_ENGINE_NAME": name, "FP_FAKE_RESERVE": str(reserve)})
    from fpcli.prompt import engine_reserve

    with _remote(s) as eng:
        assert eng.name == name
        assert engine_reserve(eng, 256) == reserve and engine_reserve(eng, 1) == reserve


def test_a_server_without_the_reserve_endpoint_gets_the_largest_reserve(servers):
    """An older server (404 on ``/fp/context_reserve``): SGLang's reserve, the largest, for any engine."""
    import httpx

    from fpcli.engine.sglang_engine import context_reserve

    s = servers
    _start(s)
    with _remote(s) as eng:
        eng._http.close()
        eng._http = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(404)),
                                 base_url="http://fp-engine")
        assert eng.name != "sglang"
        assert eng.context_reserve(256) == context_reserve(256) and eng.context_reserve(1) == context_reserve(1) == 6


def test_busy_engine_queues_and_a_disconnect_cancels_only_its_request(servers):
    s = servers
    _start(s, env={"FP_FAKE_PIECES": "40", "FP_FAKE_STEP_S": "0.1"})
    first_piece, second_queued = threading.Event(), threading.Event()
    results: dict = {}

    def interrupted_client():  # like Ctrl-C in fp ask: KeyboardInterrupt while streaming
        def on_text(piece):
            first_piece.set()
            if second_queued.is_set():
                raise KeyboardInterrupt

        with _remote(s) as eng:
            try:
                eng.generate([1] * 11, max_new_tokens=40, on_text=on_text)
            except KeyboardInterrupt:
                results["a"] = "interrupted"

    def waiting_client():
        with _remote(s) as eng:
            results["b"] = eng.generate([1] * 22, max_new_tokens=40)

    a = threading.Thread(target=interrupted_client)
    a.start()
    assert first_piece.wait(30)
    from fpcli.server.client import probe
    from fpcli.server.state import ServerState

    state = ServerState.from_dict(s.state())
    b = threading.Thread(target=waiting_client)
    b.start()
    _wait(lambda: probe(state)["queued"] == 1, 20, "the second request to queue")
    assert probe(state)["busy"] == 1 and len(s.traced("start")) == 1  # one at a time: the second waits
    second_queued.set()  # now the first client interrupts its own request
    a.join(60)
    b.join(60)
    assert not a.is_alive() and not b.is_alive()
    assert results["a"] == "interrupted"
    assert results["b"].output_tokens == 40 and results["b"].prompt_tokens == 22
    stops, dones = s.traced("stop"), s.traced("done")
    assert stops and stops[0][0] == "11" and int(stops[0][1]) < 40  # cancelled early, at a decode step
    assert dones == [["22", "40"]]
    h = probe(state)
    assert h["requests_cancelled"] == 1 and h["requests_served"] == 1 and h["busy"] == 0


def test_a_disconnect_during_the_prefill_stops_it_before_decoding(servers):
    s = servers
    _start(s, env={"FP_FAKE_PREFILL_STEPS": "200", "FP_FAKE_STEP_S": "0.05"})  # a 10 s prefill
    ask = s.popen("ask", DOC.as_posix(), "Who runs the harbor?", "--model", s.model, "--json")
    _wait(lambda: s.traced("start"), 30, "the request to start")
    ask.send_signal(signal.SIGINT)  # Ctrl-C
    assert ask.wait(30) == 130
    _wait(lambda: s.traced("stop") or s.traced("done"), 30, "the request to end")
    assert s.traced("done") == [] and s.traced("stop")[0][1] == "0"  # stopped in the prefill, no decode step


def test_time_in_the_queue_is_reported_as_queued(servers):
    """An ask behind another request: its wait in the server's queue is ``stages_s.queued`` (and in
    the time row), not ``other``; the parts still add up to the wall time."""
    s = servers
    _start(s, env={"FP_FAKE_PIECES": "100", "FP_FAKE_STEP_S": "0.1"})  # a 10 s answer holds the engine
    first_piece = threading.Event()
    holder = threading.Thread(target=lambda: _remote(s).generate([1] * 11, max_new_tokens=100,
                                                                 on_text=lambda p: first_piece.set()))
    holder.start()
    assert first_piece.wait(30)
    a = s.fp("ask", DOC.as_posix(), "Who runs the harbor?", "--model", s.model, "--json", "-n", "3")
    holder.join(60)
    assert a.returncode == 0, a.stderr
    summary = json.loads(a.stdout)["summary"]
    st = summary["stages_s"]
    assert summary["server"] is not None and st["queued"] > 0
    assert st["queued"] > st["other"]  # the wait is the bulk of what was "other"
    assert sum(st.values()) == pytest.approx(summary["wall_s"], abs=1e-6)


def test_a_server_killed_mid_answer_is_said_in_fps_words(servers):
    s = servers
    st = _start(s, env={"FP_FAKE_PIECES": "200", "FP_FAKE_STEP_S": "0.05"})
    ask = s.popen("ask", DOC.as_posix(), "Who runs the harbor?", "--model", s.model)
    _wait(lambda: s.traced("start"), 30, "the request to start")
    os.kill(st["pid"], signal.SIGKILL)
    _, err = ask.communicate(timeout=60)
    assert ask.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert f"the resident engine (pid {st['pid']}) stopped during the answer" in last and "fp start" in last, err
    assert "peer closed" not in err and "chunked" not in err


def test_stop_leaves_no_process(servers):
    s = servers
    st = _start(s, env={"FP_FAKE_CHILD": "1"})
    child = int(s.traced("child")[0][0])
    assert _alive(child)
    r = s.fp("stop")
    assert r.returncode == 0, r.stderr
    _wait(lambda: not _alive(child) and not _alive(st["pid"]), 10, "the server and its child to end")
    assert s.state() is None and not s.paths.socket.exists()


def test_idle_limit_ends_the_server(servers):
    import re

    s = servers
    r = s.fp("start", "--model", s.model, "--idle", "3s", "--timeout", "60")
    assert r.returncode == 0 and "engine started" in r.stderr, r.stderr
    pid = int(re.search(r"pid (\d+)", r.stderr).group(1))
    s.pids.add(pid)
    _wait(lambda: not _alive(pid), 30, "the idle server to end")  # it may already be gone (slow machine)
    _wait(lambda: s.state() is None, 5, "the state file to go")
    assert "idle" in s.paths.log.read_text()


def test_status_shows_the_device_on_the_engine_line(servers):
    """``fp status --json`` had the device and the human form did not."""
    s = servers
    _start(s, env={"FP_FAKE_DEVICE": "cpu"})
    status = s.fp("status")
    assert status.returncode == 0, status.stderr
    engine_line = [ln for ln in status.stdout.splitlines() if ln.startswith("engine:")]
    assert len(engine_line) == 1 and " on cpu " in engine_line[0], status.stdout
    assert json.loads(s.fp("status", "--json").stdout)["health"]["device"] == "cpu"


def test_ctrl_c_stops_a_foreground_serve_cleanly(servers):
    """Ctrl-C is how a foreground ``fp serve`` is stopped: a normal line and exit 0 (it was
    ``fp: error: interrupted``, exit 130), no state file or socket left behind."""
    s = servers
    p = s.popen("serve", "--model", s.model)
    _wait(lambda: s.state() is not None or p.poll() is not None, 60, "fp serve to be ready")
    assert s.state() is not None, p.communicate(timeout=5)
    assert s.paths.socket.exists()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "server stopped" in err and "error" not in err
    assert s.state() is None and not s.paths.socket.exists()


def test_tcp_needs_the_token_and_speaks_openai(servers):
    import httpx

    s = servers
    p = s.popen("serve", "--model", s.model, "--port", "0")
    _wait(lambda: s.state() is not None or p.poll() is not None, 60, "fp serve to be ready")
    st = s.state()
    assert st is not None, p.communicate(timeout=5)
    assert st["address"].startswith("http://127.0.0.1:")
    assert stat.S_IMODE(os.stat(st["token_file"]).st_mode) == 0o600
    token = Path(st["token_file"]).read_text().strip()
    base = st["address"]
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{base}/fp/health", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    auth = {"Authorization": f"Bearer {token}"}
    models = httpx.get(f"{base}/v1/models", headers=auth, timeout=10).json()
    assert models["data"][0]["id"] == "fake-model"
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a b c"}], "max_tokens": 3}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers=auth, timeout=30).json()
    assert r["choices"][0]["message"]["content"] == "w0 w1 w2 " and r["usage"]["completion_tokens"] == 3
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=30) as resp:
        events = [ln[len("data: "):] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "w0 w1 w2 "
    bad = httpx.post(f"{base}/v1/chat/completions", headers=auth, timeout=10,
                     json={"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                        {"role": "user", "content": "c"}]})
    assert bad.status_code == 400 and "exactly one user message" in bad.text
    p.send_signal(signal.SIGINT)  # Ctrl-C in the foreground
    p.communicate(timeout=30)
    assert s.state() is None and not Path(st["token_file"]).exists()


def test_a_server_that_hangs_mid_answer_is_detected(servers):
    """A server that stops answering inside a generate stream: the client gives up after
    ``stream_read_s`` of silence (the server sends heartbeats while it works) instead of hanging."""
    from fpcli.server.client import ClientConfig, RemoteEngine, ServerUnavailable, probe
    from fpcli.server.state import ServerState

    s = servers
    st = _start(s, env={"FP_FAKE_PIECES": "100", "FP_FAKE_STEP_S": "0.1"})
    state = ServerState.from_dict(st)
    pieces = []

    def on_text(piece):
        if not pieces:
            os.kill(st["pid"], signal.SIGSTOP)
        pieces.append(piece)

    with RemoteEngine(state, probe(state), ClientConfig(stream_read_s=3.0)) as eng:
        with pytest.raises(ServerUnavailable, match="silent for 3 s"):
            eng.generate([1] * 5, max_new_tokens=100, on_text=on_text)
    assert len(pieces) < 100


def test_profile_uses_the_resident_engine(servers, tmp_path):
    s = servers
    st = _start(s)
    png = tmp_path / "d.png"
    r = s.fp("profile", DOC.as_posix(), "--model", s.model, "--json", "--png", str(png))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["server"]["pid"] == st["pid"] and len(data["density_per_layer_head"]) == 4
    assert len(s.traced("load")) == 1 and png.is_file()


def test_default_model_context_beside_a_running_sglang_engine_probes_no_cuda(servers):
    """``fp ask`` without ``--model`` checks ``--max-new-tokens`` against the default model of the
    engine that will run; a live SGLang state file answers that without importing torch."""
    s = servers
    s.paths.ensure()
    from fpcli.server.state import ServerState, write_state

    code = ("import sys; from fpcli.commands import model_context; "
            "print(model_context(None, 'auto'), [m for m in ('torch', 'sglang') if m in sys.modules])")
    env = {**s.env, "PYTHONPATH": os.pathsep.join([_fake_sglang(s.runtime.parent), s.env["PYTHONPATH"]])}
    sleeper = subprocess.Popen(["sleep", "60"])  # a live pid for the state file
    s.pids.add(sleeper.pid)
    write_state(s.paths, ServerState(pid=sleeper.pid, address="unix:/nowhere", model="m", model_path="/m", profile="bf16",
                                     profile_hash="0", engine="sglang", started_at=0.0, version="0"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    from fpcli.models import default_model

    assert r.stdout.split() == [str(default_model("sglang").context_length), "[]"], r.stdout


def test_the_note_beside_a_resident_engine_says_what_differs(tmp_path):
    """A profile file named like the resident built-in, or another profile at another context:
    the note names the file, the keys that differ and both contexts, not only the profile's name."""
    from fpcli.profiles import load_profile, with_context_length
    from fpcli.server.client import profile_difference
    from fpcli.server.state import ServerState, profile_hash

    resident = with_context_length(load_profile("bf16"), 8192)
    state = ServerState(pid=1, address="unix:/x", model="m", model_path="/m", profile="bf16",
                        profile_hash=profile_hash(resident), engine="transformers", started_at=0.0, version="0",
                        context=8192, settings_hash=profile_hash(resident, context=False))
    mine = tmp_path / "my.yaml"
    builtin = Path(__file__).resolve().parent.parent / "fpcli" / "builtin_profiles" / "bf16.yaml"
    mine.write_text(builtin.read_text(encoding="utf-8").replace("alpha: 0.05", "alpha: 0.02"), encoding="utf-8")
    same_name = with_context_length(load_profile(str(mine)), 8192)
    assert profile_difference(state, same_name) == f"profile bf16 (this command: bf16 from {mine}, differs in sparse.alpha)"
    dense = with_context_length(load_profile("dense"), 3072)
    said = profile_difference(state, dense)
    assert said.startswith("profile bf16 at context 8,192 tokens (this command: dense at context 3,072 tokens, differs in ")
    assert "attention" in said


# -- while fp start is still starting the engine ------------------------------------------------------


def _starting(s: Servers, env: dict, timeout: float = 60) -> tuple[subprocess.Popen, int]:
    """``fp start`` in the background; returns it and the pid of the server it is starting, once
    its starting marker names one (the state file not written yet)."""
    start = s.popen("start", *(["--model", s.model] if "FP_ENGINE_FACTORY" not in env else []),
                    "--timeout", "300", env=env)
    _wait(lambda: s.paths.starting.exists(), timeout, "the starting marker")
    pid = json.loads(s.paths.starting.read_text())["pid"]
    s.pids.add(pid)
    return start, pid


def test_status_and_ask_while_the_engine_starts(servers):
    """fp status says "starting" (exit 4) and fp ask waits for the starting engine and uses it
    instead of loading its own model."""
    s = servers
    start, pid = _starting(s, {"FP_FAKE_LOAD_S": "6"})
    st = s.fp("status")
    assert st.returncode == 4, (st.stdout, st.stderr)
    assert re.match(rf"starting \(pid {pid}, since \d+ s\); log ", st.stdout), st.stdout
    info = json.loads(s.fp("status", "--json").stdout)
    assert info["status"] == "starting" and info["starting"]["pid"] == pid and info["state"] is None
    a = _ask(s, timeout=120)
    assert a.returncode == 0, a.stderr
    assert f"a resident engine is starting (pid {pid}" in a.stderr and "waiting for it" in a.stderr, a.stderr
    summary = json.loads(a.stdout)["summary"]
    assert summary["server"]["pid"] == pid
    # the wait for the engine is its start, not "other"
    assert summary["engine_start_s"] > 0 and summary["stages_s"]["engine_start"] == summary["engine_start_s"]
    assert len(s.traced("load")) == 1  # the ask loaded no model of its own
    assert start.wait(timeout=60) == 0
    assert not s.paths.starting.exists() and s.fp("status").returncode == 0


@pytest.mark.slow
def test_stop_ends_an_engine_that_is_still_starting(servers):
    """With the real embedded model: fp stop while fp start loads it ends the starting server;
    no engine comes up afterwards and fp start says it was stopped."""
    s = servers
    env = {"FP_ENGINE_FACTORY": ""}  # the real loader
    start, pid = _starting(s, {**env, "FP_ENGINE_FACTORY": ""})
    st = s.fp("status", env=env)
    assert st.returncode == 4 and st.stdout.startswith(f"starting (pid {pid}, since "), (st.stdout, st.stderr)
    stop = s.fp("stop", env=env)
    assert stop.returncode == 0 and f"the starting resident engine (pid {pid}" in stop.stderr, stop.stderr
    assert not _alive(pid)
    _, err = start.communicate(timeout=60)
    assert start.returncode == 1 and "was stopped (fp stop, or replaced by fp start --replace) while it was starting" in " ".join(err.split()), err
    time.sleep(1.0)
    assert s.state() is None and not s.paths.starting.exists() and not _alive(pid)
    after = s.fp("status", env=env)
    assert after.returncode == 3 and "no resident engine runs" in after.stderr


def test_a_hung_servers_timeout_says_the_time_waited(tmp_path):
    """A server that accepts the connection and never answers: the message says the seconds
    waited (the health timeout here; it said connect + health, 30.3 s, whatever was waited)."""
    import socket as _socket

    from fpcli.server.client import ClientConfig, ServerUnavailable, probe
    from fpcli.server.state import ServerState

    path = Path(tempfile.mkdtemp(prefix="fph-", dir="/tmp")) / "s.sock"
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)  # the kernel accepts the connection; nobody ever answers
    state = ServerState(pid=os.getpid(), address=f"unix:{path}", model="m", model_path="/m", profile="bf16",
                        profile_hash="x", engine="transformers", started_at=0.0, version="0")
    try:
        with pytest.raises(ServerUnavailable) as info:
            probe(state, ClientConfig(connect_s=30.0, health_s=0.3))
    finally:
        listener.close()
        path.unlink(missing_ok=True)
    waited = float(re.search(r"timed out after ([\d.]+) s", str(info.value)).group(1))
    assert 0.3 <= waited < 30.0, str(info.value)


# -- a starting marker that is stale, or names another process -------------------------------------------


def _marker(s: Servers, pid: int, ready_in_s: float, **fields) -> None:
    """A starting marker naming ``pid`` (as ``fp start`` writes one), ``ready_by`` ``ready_in_s``
    from now (negative: in the past)."""
    from fpcli.server.state import StartingState, write_starting

    s.paths.ensure()
    now = time.time()
    write_starting(s.paths, StartingState(pid=pid, started_at=now - 7200, ready_by=now + ready_in_s, **fields))


@pytest.fixture
def sleeper():
    """A ``sleep`` in a session of its own (as ``setsid sleep 1000 &``): a live process that is no engine."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait(timeout=10)


def test_a_marker_past_its_deadline_is_stale_and_its_process_never_signalled(servers, sleeper):
    """A marker naming an unrelated live process, an hour past ready_by: fp status says it was
    stale and removes it (exit 3, said once), fp ask runs in-process at once, fp stop signals nothing."""
    s = servers
    _marker(s, sleeper.pid, -3600)
    st = s.fp("status")
    assert st.returncode == 3, (st.stdout, st.stderr)
    assert f"pid {sleeper.pid} was not ready by its deadline" in st.stderr and "removed its starting marker" in st.stderr
    assert not s.paths.starting.exists() and sleeper.poll() is None
    again = s.fp("status")
    assert again.returncode == 3 and "no resident engine runs" in again.stderr and "stale" not in again.stderr
    _marker(s, sleeper.pid, -3600)
    a = _ask(s, timeout=120)
    assert a.returncode == 0, a.stderr
    assert "waiting for it" not in a.stderr and "was not ready by its deadline" in a.stderr, a.stderr
    assert "server" not in json.loads(a.stdout)["summary"] or not json.loads(a.stdout)["summary"]["server"]
    _marker(s, sleeper.pid, -3600)
    stop = s.fp("stop")
    assert stop.returncode == 0 and "was not ready by its deadline" in stop.stderr, stop.stderr
    time.sleep(0.3)
    assert sleeper.poll() is None  # never signalled
    _marker(s, sleeper.pid, -3600)
    assert _start(s)["pid"] != sleeper.pid and sleeper.poll() is None  # fp start is not refused


def test_a_marker_whose_pid_is_another_process_is_stale(servers, sleeper):
    """A marker in time whose pid now runs another process (its start time differs): not
    "starting", removed, and fp stop sends it no signal; with the right start time it is starting."""
    from fpcli.server.state import proc_start_time

    s = servers
    ticks = proc_start_time(sleeper.pid)
    assert isinstance(ticks, int) and ticks > 0
    _marker(s, sleeper.pid, 600, proc_start=ticks + 1)
    st = s.fp("status", "--json")
    assert st.returncode == 3 and json.loads(st.stdout)["status"] == "stale", (st.stdout, st.stderr)
    assert f"pid {sleeper.pid} is now another process" in json.loads(st.stdout)["detail"]
    _marker(s, sleeper.pid, 600, proc_start=ticks + 1)
    stop = s.fp("stop")
    assert stop.returncode == 0 and "is now another process" in stop.stderr, stop.stderr
    time.sleep(0.3)
    assert sleeper.poll() is None and not s.paths.starting.exists()
    _marker(s, sleeper.pid, 600, proc_start=ticks)
    assert s.fp("status").returncode == 4


def test_replace_stops_an_engine_that_is_still_starting(servers, sleeper):
    """fp start beside a starting engine refuses (naming --replace); with --replace it ends the
    starting process (here a sleep named by a marker with its start time) and starts its own."""
    from fpcli.server.state import proc_start_time

    s = servers
    _marker(s, sleeper.pid, 600, proc_start=proc_start_time(sleeper.pid))
    r = s.fp("start", "--model", s.model, "--timeout", "60")
    assert r.returncode == 1 and "a resident engine is starting" in r.stderr and "--replace" in r.stderr, r.stderr
    assert sleeper.poll() is None
    r = s.fp("start", "--model", s.model, "--timeout", "60", "--replace")
    assert r.returncode == 0 and "replaced" in r.stderr, r.stderr
    assert sleeper.wait(timeout=20) < 0  # signalled
    assert s.state() is not None and s.state()["pid"] != sleeper.pid


def test_a_late_marker_of_its_own_engine_ends_it(servers, sleeper):
    """A marker past its deadline whose process is still the one it names (same start time): as
    its fp start would have, the reader ends it and says so."""
    from fpcli.server.state import proc_start_time

    s = servers
    _marker(s, sleeper.pid, -3600, proc_start=proc_start_time(sleeper.pid))
    st = s.fp("status")
    assert st.returncode == 3 and "and ended it (SIGTERM)" in st.stderr, st.stderr
    assert sleeper.wait(timeout=20) < 0 and not s.paths.starting.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may signal every process")
def test_signalling_another_users_process_is_a_clear_error():
    from fpcli.server.lifecycle import LifecycleError, _signal

    with pytest.raises(LifecycleError, match="not permitted to signal pid 1"):
        _signal(1, 0)


def test_ask_does_not_wait_for_a_starting_engine_of_another_model(servers, sleeper):
    """The marker says what the starting engine will serve: an ask for another model says so in
    one line and runs in-process at once instead of waiting for it."""
    from fpcli.server.state import proc_start_time

    s = servers
    _marker(s, sleeper.pid, 600, proc_start=proc_start_time(sleeper.pid), model="other", model_path="/models/other",
            profile="bf16", profile_hash="0123456789abcdef", engine="transformers")
    a = _ask(s, timeout=120)
    assert a.returncode == 0, a.stderr
    assert f"the resident engine that is starting (pid {sleeper.pid}) will run model other" in a.stderr, a.stderr
    assert "waiting for it" not in a.stderr
    assert s.paths.starting.exists() and sleeper.poll() is None  # still starting, left alone


def test_ctrl_c_on_fp_start_leaves_the_engine_starting(servers):
    """Ctrl-C while fp start waits: exit 130, it says the engine goes on starting (pid N) and that
    fp stop ends it; the engine does come up, and fp stop ends it."""
    s = servers
    start, pid = _starting(s, {"FP_FAKE_LOAD_S": "4"})
    start.send_signal(signal.SIGINT)
    _, err = start.communicate(timeout=60)
    assert start.returncode == 130, err
    assert f"fp: warning: interrupted; the engine goes on starting (pid {pid}): fp stop ends it" in err, err
    assert "fp: error" not in err, err
    _wait(lambda: s.state() is not None, 60, "the engine to come up")
    assert s.state()["pid"] == pid and s.fp("status").returncode == 0
    assert s.fp("stop").returncode == 0 and not _alive(pid)


def test_exit_words_name_the_signal():
    from fpcli.server.lifecycle import _colon, exit_words

    assert exit_words(-9) == "was killed by SIGKILL" and exit_words(-15) == "was killed by SIGTERM"
    assert exit_words(2) == "exited with code 2"
    assert _colon("") == "" and _colon("boom") == ": boom"


def test_start_whose_engine_is_killed_says_by_which_signal(servers):
    """kill -9 of the engine fp start is starting: 'was killed by SIGKILL before it was ready',
    never 'exited with code -9', and no empty detail after a colon."""
    s = servers
    start, pid = _starting(s, {"FP_FAKE_LOAD_S": "30"})
    os.kill(pid, signal.SIGKILL)
    _, err = start.communicate(timeout=60)
    err = " ".join(err.split())
    assert start.returncode == 1, err
    assert "the server was killed by SIGKILL before it was ready" in err and "code -9" not in err, err
    assert ":  (" not in err and ": (log" not in err, err


def test_ask_waiting_for_an_engine_that_is_stopped_says_so_and_counts_the_wait(servers, tmp_path):
    """fp stop while fp ask waits for the starting engine: the ask says it 'was stopped' (not 'did
    not start'), runs in-process, and its engine start counts the wait plus its own start."""
    s = servers
    start, pid = _starting(s, {"FP_FAKE_LOAD_S": "60"})
    log = tmp_path / "ask.err"
    with open(log, "w") as err_file:
        ask = subprocess.Popen([sys.executable, "-m", "fpcli", "ask", DOC.as_posix(), "Who runs the harbor?", "--model",
                                s.model, "--json"], stdout=subprocess.PIPE, stderr=err_file, text=True, env=s.env,
                               cwd=str(ROOT))
        s.pids.add(ask.pid)
        _wait(lambda: "waiting for it" in log.read_text(), 120, "the ask to wait")
        assert s.fp("stop").returncode == 0
        out, _ = ask.communicate(timeout=120)
    err = " ".join(log.read_text().split())
    assert ask.returncode == 0, err
    assert f"the resident engine that was starting (pid {pid}) was stopped; running in-process" in err, err
    assert "did not start" not in err
    summary = json.loads(out)["summary"]
    assert not summary.get("server") and summary["engine_start_s"] > 0
    assert summary["stages_s"]["engine_start"] == summary["engine_start_s"]
    start.communicate(timeout=60)


def test_replace_ends_an_engine_another_fp_start_is_starting(servers):
    """fp start --replace while another fp start is still starting its engine (and holds the start
    lock): the starting engine is ended at once (said), the first fp start fails saying it was
    replaced (never 'started'), and the replacing start's engine runs."""
    s = servers
    first, pid = _starting(s, {"FP_FAKE_LOAD_S": "60"})
    r = s.fp("start", "--model", s.model, "--timeout", "60", "--replace")
    err = " ".join(r.stderr.split())
    assert r.returncode == 0, err
    assert f"ending the engine that is starting (pid {pid}" in err and "replaced the previous one" in err, err
    _, first_err = first.communicate(timeout=60)
    first_err = " ".join(first_err.split())
    assert first.returncode == 1, first_err
    assert "replaced by fp start --replace" in first_err and "resident engine started" not in first_err, first_err
    assert not _alive(pid) and s.state() is not None and s.state()["pid"] != pid


def test_plain_start_waits_for_a_matching_engine_that_is_starting(servers):
    """After Ctrl-C of fp start, a plain fp start with the same options waits for the engine that
    goes on starting and reports it started (exit 0); it starts no second engine."""
    s = servers
    first, pid = _starting(s, {"FP_FAKE_LOAD_S": "6"})
    first.send_signal(signal.SIGINT)
    first.communicate(timeout=60)
    assert first.returncode == 130
    r = s.fp("start", "--model", s.model, "--timeout", "60")
    err = " ".join(r.stderr.split())
    assert r.returncode == 0, err
    assert "waiting for it" in err and f"pid {pid}" in err and "started" in err, err
    assert s.state()["pid"] == pid and not s.paths.starting.exists()
    assert len(s.traced("load")) == 1  # one engine loaded


def test_plain_start_refuses_a_starting_engine_of_another_model(servers, sleeper):
    """A starting engine whose marker names another model: a plain fp start refuses, naming the
    difference and --replace, and leaves it alone."""
    from fpcli.server.state import proc_start_time

    s = servers
    _marker(s, sleeper.pid, 600, proc_start=proc_start_time(sleeper.pid), model="other", model_path="/models/other",
            profile="bf16", profile_hash="0123456789abcdef", engine="transformers")
    r = s.fp("start", "--model", s.model, "--timeout", "60")
    err = " ".join(r.stderr.split())
    assert r.returncode == 1 and "a resident engine is starting with another model" in err and "--replace" in err, err
    assert sleeper.poll() is None and s.paths.starting.exists()


def test_profile_says_why_the_resident_engine_has_no_stage_times():
    """On the GPU the resident SGLang engine runs without per-layer timing (seen on the H200, 2026-12-03:
    ``fp profile`` printed "not measured by this engine"): the line names the resident engine and
    ``--no-server``, which measures them; an in-process engine keeps the plain line."""
    from fpcli.commands.profile import _times_totals

    line = _times_totals(None, None, resident=True)
    assert "resident engine" in line and "--no-server" in line
    assert _times_totals(None, None) == "index vs attention time: not measured by this engine"
    assert _times_totals(2.0, 6.0, resident=True).startswith("index 2")  # measured totals are shown as they are
