"""``SGLangEngine.close`` on the CPU: an interrupted shutdown still kills the engine's children.

The engine object is built without starting SGLang (``object.__new__``) and given a real child
process; its stand-in for SGLang's ``Engine`` raises ``KeyboardInterrupt`` where Ctrl-C would
land while ``close`` waits for the shutdown."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fpcli.engine import sglang_engine as se


class _InterruptedWatchdog:
    def stop(self):
        raise KeyboardInterrupt


class _Tokenizer:
    _subprocess_watchdog = _InterruptedWatchdog()


class _Engine:
    tokenizer_manager = _Tokenizer()

    def shutdown(self):  # never reached: the interrupt comes first
        raise AssertionError("shutdown should not run after the interrupt")


def _engine_with_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    eng = object.__new__(se.SGLangEngine)
    eng._closed = False
    eng._engine = _Engine()
    eng._child_pids = [child.pid]
    eng._stats_dir = Path(tempfile.mkdtemp(prefix="fp-close-test-"))
    eng.shutdown_timeout_s = 5.0
    return eng, child


def test_close_interrupted_while_stopping_sglang_still_kills_its_children():
    eng, child = _engine_with_child()
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.close()
        assert child.wait(timeout=15) != 0          # killed, not finished
        assert not eng._stats_dir.exists()
        assert eng._closed
        eng.close()                                  # a second close is a no-op
    finally:
        if child.poll() is None:
            child.kill()
