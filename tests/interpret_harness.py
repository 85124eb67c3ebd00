"""The harness of the Triton-interpreter test modules (``tests/test_fp8_*_interpret.py``,
``tests/test_int8qk_interpret.py``).

``TRITON_INTERPRET=1`` must be set before Triton is imported, so each module runs its cases in a
child process (the module itself with ``--worker``) that prints one JSON object per case; the
module's ``results`` fixture (``results_fixture``: ``interpreter_results``) collects them by ``"case"``. The FP8 kernel
modules build each case's operands with ``fp8_case``. A module's skeleton::

    results = results_fixture(__file__)          # test side: runs the worker once per module

    def test_something(results, name):
        r = case_result(results, name)           # fails with the worker's traceback if the case raised
        assert r["..."], r

    if __name__ == "__main__" and "--worker" in sys.argv:
        run_cases(CASES, _run_case)              # worker side
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

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


def results_fixture(script: str | os.PathLike, timeout_s: float = 900):
    """Test side: a module-scoped fixture named ``results`` returning ``interpreter_results(script,
    timeout_s)``; bind it in the test module as ``results = results_fixture(__file__)``."""

    @pytest.fixture(scope="module", name="results")
    def results() -> dict[str, dict]:
        """The interpreter worker's results of this module, by case name."""
        return interpreter_results(script, timeout_s)

    return results


def case_result(results: dict[str, dict], name: str) -> dict:
    """Test side: the result of case ``name``; fails the test with the worker's error and traceback
    when the case raised."""
    r = results[name]
    if "error" in r:
        pytest.fail(f"case {name}: {r['error']}\n{r.get('trace', '')}")
    return r


@dataclass(frozen=True)
class Fp8Case:
    """The operands of one FP8 kernel case (``fp8_case``), on the CPU.

    Attributes:
        q, k, v: fp16 ``[tokens, Hq | Hkv | Hkv, d]`` (``fp_brute.make_inputs``, structured; K and V
            paged by ``pt``).
        pt, sl, cu: the page table, KV lengths and query offsets of ``make_inputs``.
        cfg: ``SparseConfig(block_size=B, sink_tokens=B, window_tokens=B, dense_tail_tokens=1,
            alpha=0.3)``; ``scale``: ``d ** -0.5``; ``plan``: ``make_plan(sl, cu, Hq // Hkv, B)``.
        kernels: ``tiles.get_config(d, float16, B, precision="fp8", variant="plain")`` (every optional
            field off: the baseline each variant is compared against); ``attn``: its ``.attn``.
        index: the CPU reference ``BlockIndex`` (``reference.build_index``) and ``kv``: the FP8
            pre-pass operands (``host_fp8.kv_operands``), or both ``None`` (``with_index=False``).
    """

    q: Any
    k: Any
    v: Any
    pt: Any
    sl: Any
    cu: Any
    cfg: Any
    scale: float
    plan: Any
    kernels: Any
    attn: Any
    index: Any = None
    kv: Any = None


def fp8_case(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, page_size: int, block_size: int,
             *, seed: int, v_factor: float = 1.0, with_index: bool = True) -> Fp8Case:
    """Worker side: the shared setup of the FP8 kernel cases: ``make_inputs`` (float32, ``seed``,
    structured) cast to fp16 (V times ``v_factor`` first), the sparse config, the plan, the fp8
    tiles and, with ``with_index``, the reference index and the FP8 K / V operands. Imports torch
    and ``flashprefill`` (call it in the ``TRITON_INTERPRET=1`` worker only)."""
    import torch

    from fp_brute import make_inputs
    from flashprefill import SparseConfig, make_plan
    from flashprefill.impl import reference as R
    from flashprefill.impl.triton import host_fp8
    from flashprefill.impl.triton.tiles import get_config

    B = block_size
    q, k, v, pt, sl, cu = make_inputs(q_lens, kv_lens, hq, hkv, d, page_size, dtype=torch.float32, seed=seed,
                                      structured=True)
    q, k, v = q.half(), k.half(), (v_factor * v).half()
    cfg = SparseConfig(block_size=B, sink_tokens=B, window_tokens=B, dense_tail_tokens=1, alpha=0.3)
    scale = d ** -0.5
    plan = make_plan(sl, cu, hq // hkv, B)
    kernels = get_config(d, torch.float16, B, precision="fp8", variant="plain")
    index = kv = None
    if with_index:
        index = R.build_index(q, k, v, pt, sl, cu, cfg, scale, plan)
        kv = host_fp8.kv_operands(k, v, pt, sl, plan)
    return Fp8Case(q, k, v, pt, sl, cu, cfg, scale, plan, kernels, kernels.attn, index, kv)
