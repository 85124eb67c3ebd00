"""GPU test of the resident engine with SGLang (run on the device): ``fp start --engine sglang``,
two ``fp ask`` about the same ~20K-token document (the second served mostly from SGLang's radix
cache), ``fp status``, a third ``fp ask`` whose process imports no torch, ``fp stop`` leaving no process.

Needs CUDA, SGLang and the staged Qwen model (``$FPDEV_MODELS/qwen2.5-coder-0.5b-instruct``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from staged import QWEN, require_sglang_and  # noqa: E402

require_sglang_and(QWEN)

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [g for k in kids for g in _descendants(k)]


def _alive(pid: int) -> bool:
    from fpcli.server.state import pid_alive

    return pid_alive(pid)


def test_resident_sglang_engine_reuses_the_document_kv_cache():
    from transformers import AutoTokenizer

    from fpcli.ttft import needle_document

    root = Path(tempfile.mkdtemp(prefix="fpg-", dir="/tmp"))
    (root / "rt").mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(root / "rt"), XDG_STATE_HOME=str(root / "st"))
    env.pop("FP_ENGINE_FACTORY", None)
    tok = AutoTokenizer.from_pretrained(QWEN)
    text, secret = needle_document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), 20000, seed=5)
    doc = root / "doc.txt"
    doc.write_text(text)

    def fp(*args, timeout=900):
        return subprocess.run([sys.executable, "-m", "fpcli", *args], capture_output=True, text=True, env=env,
                              cwd=str(ROOT), timeout=timeout)

    pid = None
    try:
        r = fp("start", "--engine", "sglang", "--model", str(QWEN), "--timeout", "800")
        assert r.returncode == 0, r.stderr
        state = json.loads((root / "rt" / "fp" / "engine.json").read_text())
        pid = state["pid"]
        assert state["engine"] == "sglang"
        children = _descendants(pid)
        assert children, "SGLang's scheduler and detokenizer run as children of the server"
        reports = []
        for question in ("What is the secret number?", "Repeat the secret number, please."):
            a = fp("ask", str(doc), question, "--engine", "sglang", "--model", str(QWEN), "-n", "16", "--json")
            assert a.returncode == 0, a.stderr
            reports.append(json.loads(a.stdout)["summary"])
        first, second = reports
        assert first["server"]["pid"] == pid and second["server"]["pid"] == pid
        assert first["prompt_tokens"] > 18000
        assert second["cached_tokens"] > 0.9 * second["prompt_tokens"], second
        assert second["ttft_s"] < first["ttft_s"]
        status = fp("status", "--json", timeout=60)
        health = json.loads(status.stdout)["health"]
        assert status.returncode == 0 and health["requests_served"] == 2 and health["gpu_used_bytes"] > 0
        # the client of a resident engine imports no torch / transformers / sglang, even with --engine auto
        # (which probes CUDA when no engine runs)
        modules = root / "modules.json"
        a = subprocess.run([sys.executable, str(ROOT / "tests" / "fp_import_probe.py"), str(modules), "ask", str(doc),
                            "What is the secret number?", "--model", str(QWEN), "-n", "16", "--json"],
                           capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
        assert a.returncode == 0, a.stderr
        assert json.loads(a.stdout)["summary"]["server"]["pid"] == pid
        assert json.loads(modules.read_text()) == [], "the resident client imported a model library"
        stop = fp("stop", timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert not _alive(pid) and not any(_alive(c) for c in children)
        assert not (root / "rt" / "fp" / "engine.json").exists()
    finally:
        if pid is not None and _alive(pid):
            os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


def test_sglang_settings_become_server_overrides():
    from fpcli.engine.sglang_engine import server_overrides_from_argv

    assert server_overrides_from_argv(["--tp", "2", "--mem-fraction-static=0.5"]) == {"tp_size": 2, "mem_fraction_static": 0.5}
    assert server_overrides_from_argv(["--dp", "2"]) == {"dp_size": 2}
    with pytest.raises(ValueError, match="--no-such-option"):
        server_overrides_from_argv(["--no-such-option", "1"])
