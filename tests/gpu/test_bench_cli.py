"""``fp bench --e2e --fp8`` through the real CLI on the GPU (run on the device): the operator table,
then three SGLang engines (the ``bf16``, ``fp8`` and ``dense`` profiles) on the same needle prompt,
all in one ``fp.bench/2`` JSON.

Skips unless CUDA (SM89+ for FP8), SGLang and the staged Qwen2.5-Coder-0.5B (``$FPDEV_MODELS``,
32K native context) are present. 16K tokens: above the profiles' 8192-token sparse threshold, so
both sparse engines run sparse layers (density below 1, FP8 reported by the fp8 one). Three engine
starts with their warm-ups: a few minutes.
"""
from __future__ import annotations

import json
import math
import subprocess

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

from staged import QWEN, require_sglang_and  # noqa: E402

require_sglang_and(QWEN, min_capability=(8, 9))  # FP8 tensor cores

from fp_fakes import fp_executable, run_env  # noqa: E402


def test_fp_bench_e2e_fp8_runs_bf16_fp8_and_dense_side_by_side():
    proc = subprocess.run([fp_executable(), "bench", "--e2e", "--fp8", "--len", "16k", "--json", "--model", str(QWEN)],
                          capture_output=True, text=True, env=run_env(), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    assert data["schema"] == "fp.bench/2" and data["kind"] == "operator+e2e"

    op = data["operator"]
    assert op["device"] == "cuda" and op["fp8"] and op["profile"] is None and [r["L"] for r in op["rows"]] == [16384]
    row = op["rows"][0]
    for key in ("index_ms", "total_ms", "dense_mode_ms", "fp8_total_ms"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert 0.0 < row["density"] < 1.0 and 0.0 < row["fp8_density"] < 1.0

    e2e = data["e2e"]
    assert e2e["profiles"] == ["bf16", "fp8", "dense"] and e2e["lens"] == [16384] and e2e["notes"] == []
    rows = {r["profile"]: r for r in e2e["rows"]}
    assert len(e2e["rows"]) == 3 and set(rows) == {"bf16", "fp8", "dense"}
    tokens = {r["prompt_tokens"] for r in e2e["rows"]}
    assert len(tokens) == 1 and abs(tokens.pop() - 16384) < 512  # the same prompt for every engine
    for name, r in rows.items():
        assert r["length"] == 16384 and math.isfinite(r["ttft_s"]) and r["ttft_s"] > 0, (name, r)
        assert math.isfinite(r["x_dense"]) and math.isfinite(r["x_bf16"]), (name, r)
    assert rows["fp8"]["precision"] == "fp8 (sparse layers)", rows["fp8"]
    assert rows["bf16"]["precision"] == "bf16" and rows["dense"]["precision"] == "bf16"
    assert 0.0 < rows["bf16"]["density"] < 1.0 and 0.0 < rows["fp8"]["density"] < 1.0, rows
    assert rows["dense"]["density"] == 1.0 and rows["dense"]["x_dense"] == pytest.approx(1.0)
    assert rows["dense"]["needle"], rows["dense"]["answer"]
    assert rows["fp8"]["x_bf16"] == pytest.approx(rows["bf16"]["ttft_s"] / rows["fp8"]["ttft_s"])
