"""The harness of the Triton-interpreter test modules (``tests/test_fp8_*_interpret.py``).

``TRITON_INTERPRET=1`` must be set before Triton is imported, so each module runs its cases in a
child process (the module itself with ``--worker``) that prints one JSON object per case; the
module's ``results`` fixture (``interpreter_results``) collects them by ``"case"``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cases(cases: Iterable[str], run_case: Callable[[str], dict], patch_range: bool = True) -> None:
    """Worker side: ``run_case(name)`` for each case, one JSON line each on stdout; an exception
    becomes ``{"case", "error", "trace"}`` (the test names the case). ``patch_range``: apply
    ``test_triton_interpret._patch_interpreter`` first (numpy >= 2.3 breaks the interpreter's
    ``range()`` over a runtime value)."""
    if patch_range:
        from test_triton_interpret import _patch_interpreter

        _patch_interpreter()
    for name in cases:
        try:
            res = run_case(name)
        except Exception as e:  # reported; the test names the case
            import traceback

            res = {"case": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(res), flush=True)


def interpreter_results(script: str | os.PathLike, timeout_s: float = 900) -> dict[str, dict]:
    """Test side: run ``script --worker`` under ``TRITON_INTERPRET=1`` (``kernels/``, the repository
    and ``tests/`` on ``PYTHONPATH``) and return its JSON lines by ``"case"``; fails the test when
    none came back (with the worker's stderr)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "kernels"), str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script), "--worker"], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[r["case"]] = r
    if not out:
        pytest.fail(f"interpreter worker produced no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return out
