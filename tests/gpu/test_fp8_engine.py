"""FP8 in the engines on the GPU (run on the device): the ``fp8`` profile through embedded SGLang.

Skips unless CUDA (SM89+ for FP8), SGLang and the staged Qwen2.5-Coder-0.5B (``$FPDEV_MODELS``,
32K context) are present. A ~20K-token needle document (above the profile's 8192-token sparse
threshold):

- the SGLang engine with the ``fp8`` profile answers it and reports ``fp8 (sparse layers)``;
- the same with SGLang's ``--kv-cache-dtype fp8_e4m3`` (the backend reads the e4m3 cache with the
  layers' ``k_scale`` / ``v_scale``; the sparse layers must still run, not fall back to dense);
- ``fp profile --fp8 --json`` reports finite FP8-vs-BF16 errors for every sparse layer and none
  for the dense ones;
- ``fp ask`` with the fp8 profile and without ``-v`` prints no plugin line and no progress bar.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

from staged import QWEN, require_sglang_and  # noqa: E402

require_sglang_and(QWEN, min_capability=(8, 9))  # FP8 tensor cores

from fpcli.engine.sglang_engine import SGLangEngine  # noqa: E402
from fpcli.profiles import load_profile  # noqa: E402
from fpcli.ttft import answered, needle_prompt  # noqa: E402

DOC_TOKENS = 20_000
FP = str(Path(sys.executable).with_name("fp"))


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_sglang_fp8_profile_answers_a_needle_and_reports_fp8(kv_cache_dtype):
    overrides = {"kv_cache_dtype": kv_cache_dtype} if kv_cache_dtype else None
    with SGLangEngine(QWEN, load_profile("fp8"), server_overrides=overrides) as eng:
        ids, secret = needle_prompt(eng, DOC_TOKENS, seed=11)
        r = eng.generate(ids, max_new_tokens=24)
    assert r.precision == "fp8 (sparse layers)", r.precision
    assert r.stats.sparse_layers and r.stats.sparse_layers[0] == 2  # the profile's 2 dense layers first
    assert 0.0 < r.stats.density < 1.0
    assert answered(r.text, secret), r.text


def test_fp_profile_fp8_json_has_finite_per_layer_errors(tmp_path):
    from transformers import AutoTokenizer

    from fpcli.ttft import needle_document

    tok = AutoTokenizer.from_pretrained(QWEN)
    text, _ = needle_document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), DOC_TOKENS, seed=12)
    doc = tmp_path / "report.txt"
    doc.write_text(text)
    proc = subprocess.run([FP, "profile", str(doc), "--fp8", "--json", "--no-server", "--engine", "sglang", "--model", str(QWEN),
                           "--png", str(tmp_path / "h.png")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["precision"] == "fp8 (sparse layers)" and data["engine"] == "sglang"
    sparse = set(data["density"]["sparse_layers"])
    assert sparse
    for i, (err, heads) in enumerate(zip(data["fp8_rel_l2_per_layer"], data["fp8_rel_l2_per_layer_head"])):
        if i in sparse:
            assert math.isfinite(err) and 0.0 < err < 0.5 and heads and all(0.0 < e < 0.5 for e in heads), (i, err)
        else:
            assert err is None and heads == [], (i, err, heads)
    assert Path(data["png_fp8"]).is_file()


def test_fp8_ask_without_verbose_prints_no_plugin_lines_or_bars(tmp_path):
    doc = tmp_path / "note.txt"
    doc.write_text("The harbor opens on 14 May. The ferry leaves at nine.\n" * 40)
    args = [FP, "ask", str(doc), "When does the harbor open?", "--model", str(QWEN), "-n", "16", "--profile", "fp8",
            "--no-server"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "[fp] flashprefill" not in quiet.stderr and not re.search(r"it/s\]|Multi-thread loading", quiet.stderr)
    loud = subprocess.run(args + ["-v"], capture_output=True, text=True, timeout=900)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "flashprefill" in loud.stderr


def test_sglang_engine_refuses_int8qk_with_an_e4m3_kv_cache_before_start():
    """int8qk quantizes K from a 16-bit cache; only fp8 reads SGLang's e4m3 cache: the engine says so
    before SGLang starts (no scheduler, no weights)."""
    with pytest.raises(ValueError, match=r"accurate\+int8qk asks for int8qk attention, which needs a 16-bit KV cache"):
        SGLangEngine(QWEN, load_profile("accurate+int8qk"), server_overrides={"kv_cache_dtype": "fp8_e4m3"})
