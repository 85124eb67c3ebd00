"""Document sessions on the GPU (run on the device): SGLang's radix cache serves the documents of
a second question, through ``SGLangEngine`` and through ``fp chat``.

Skips unless CUDA, SGLang and the staged Qwen2.5-Coder-0.5B (``$FPDEV_MODELS``, 32K context) are
present. A ~20K-token document, two different questions after it (``fpcli.prompt``, documents
first): the second prompt must be >= 95% served from the cache, and still answer.
"""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

from staged import QWEN, require_sglang_and  # noqa: E402

require_sglang_and(QWEN)

from fpcli.ttft import answered, needle_document  # noqa: E402
from fpcli.engine.sglang_engine import SGLangEngine  # noqa: E402
from fpcli.profiles import load_profile  # noqa: E402
from fpcli.prompt import build_prompt  # noqa: E402

DOC_TOKENS = 20_000


@dataclass
class Doc:
    name: str
    text: str


def test_second_question_is_served_from_the_radix_cache(tmp_path):
    with SGLangEngine(QWEN, load_profile("bf16")) as eng:
        text, secret = needle_document(eng.count_tokens, DOC_TOKENS, depth=0.4, seed=3)
        docs = [Doc("report.txt", text.rsplit("\n", 1)[0])]  # the document without needle_document's question
        first = eng.generate(build_prompt(docs, "Summarize the document in one sentence.", eng, 32).ids,
                             max_new_tokens=32)
        prompt = build_prompt(docs, "What is the secret number? Reply with the digits only.", eng, 16)
        second = eng.generate(prompt.ids, max_new_tokens=16)
    assert first.prompt_tokens >= 0.9 * DOC_TOKENS
    assert second.cached_tokens >= 0.95 * second.prompt_tokens, (second.cached_tokens, second.prompt_tokens)
    assert answered(second.text, secret), second.text


def test_fp_chat_reports_cached_tokens_on_the_gpu(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(QWEN)
    text, secret = needle_document(lambda s: len(tok(s, add_special_tokens=False)["input_ids"]), DOC_TOKENS, seed=4)
    doc = tmp_path / "report.txt"
    doc.write_text(text.rsplit("\n", 1)[0])
    fp = Path(sys.executable).with_name("fp")
    proc = subprocess.run(
        [str(fp), "chat", str(doc), "--model", str(QWEN), "-n", "16"],
        input="Summarize the document in one sentence.\nWhat is the secret number? Digits only.\n",
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"^prompt tokens ([\d,]+)(?: \(([\d,]+) cached\))?", proc.stderr, re.M)
    assert len(lines) == 2, proc.stderr[-3000:]
    total, cached = (int(x.replace(",", "") or 0) for x in lines[1])
    assert cached >= 0.95 * total, lines
    assert answered(proc.stdout, secret), proc.stdout


def test_sglang_output_only_with_verbose(tmp_path):
    """`fp ask` on the GPU: without -v stderr has fp's own lines only (no SGLang log records, no
    CUDA-graph capture bars, no "Multi-thread loading shards" bar of the scheduler); with -v
    SGLang's log lines appear."""
    doc = tmp_path / "note.txt"
    doc.write_text("The harbor opens on 14 May. The ferry leaves at nine.\n" * 40)
    fp = Path(sys.executable).with_name("fp")
    args = [str(fp), "ask", str(doc), "When does the harbor open?", "--model", str(QWEN), "-n", "16", "--engine", "sglang"]
    quiet = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    sglang_line = re.compile(r"^\[\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d|Capturing batches|it/s\]|Load weight|loading shards", re.M)
    assert not sglang_line.search(quiet.stderr), quiet.stderr[-3000:]
    assert re.search(r"^total time +[\d.]+ s \(.*engine start [\d.]+ s", quiet.stderr, re.M), quiet.stderr[-2000:]
    loud = subprocess.run(args + ["-v"], capture_output=True, text=True, timeout=900)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert sglang_line.search(loud.stderr), loud.stderr[-3000:]
