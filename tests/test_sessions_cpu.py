"""Document sessions on the CPU with the REAL embedded model (SmolLM2-135M-Instruct): the prompt
order shares the documents' tokens between questions, the transformers engine reuses their KV
cache exactly, and ``fp chat`` reports it. Marked ``slow`` (the model is pulled once, as in
``test_e2e_cpu``); ~1-2 min on 2 cores.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from fpcli.engine.transformers_engine import TransformersEngine, common_prefix_len
from fpcli.profiles import load_profile
from fpcli.prompt import build_prompt
from test_e2e_cpu import fp_executable, make_document, run_env  # smollm2: a fixture of conftest.py

pytestmark = pytest.mark.slow

HARBOR = Path(__file__).resolve().parent.parent / "examples" / "harbor-report.md"
Q1 = "When will the new ferry terminal open?"
Q2 = "Who pays for the new breakwater, and how much does it cost?"


@dataclass
class Doc:
    name: str
    text: str


@pytest.fixture(scope="module")
def engine(smollm2):
    with TransformersEngine(smollm2, load_profile("bf16"), model_name="smollm2-135m-instruct") as eng:
        yield eng


def test_prompts_about_the_same_documents_share_the_documents_tokens(engine):
    """With the model's real chat template: everything up to the question is a common prefix."""
    docs = [Doc("harbor-report.md", HARBOR.read_text(encoding="utf-8")), Doc("notes.txt", "Short notes: none.")]
    a = build_prompt(docs, Q1, engine, 64)
    b = build_prompt(docs, "Why?", engine, 64)
    n = common_prefix_len(a.ids, b.ids)
    head = engine.tokenizer.decode(a.ids[:n])
    assert head.rstrip().endswith("</document>\n\nQuestion:") or head.endswith("</document>\n\nQuestion: ")
    assert n >= 0.95 * len(b.ids)


def test_engine_reuses_the_documents_cache_exactly(engine, smollm2):
    docs = [Doc("harbor-report.md", HARBOR.read_text(encoding="utf-8"))]
    engine.generate(build_prompt(docs, Q1, engine, 48).ids, max_new_tokens=48)
    prompt = build_prompt(docs, Q2, engine, 48)
    second = engine.generate(prompt.ids, max_new_tokens=48)
    assert second.cached_tokens >= 0.8 * second.prompt_tokens
    with TransformersEngine(smollm2, load_profile("bf16"), reuse_cache=False) as fresh:
        ref = fresh.generate(prompt.ids, max_new_tokens=48)
    assert ref.cached_tokens == 0
    assert (second.text, second.output_tokens) == (ref.text, ref.output_tokens)  # greedy: the same tokens

    other = [Doc("story.txt", make_document(60, "The lighthouse keeper is called Ada.", 0.5, seed=9))]
    third = engine.generate(build_prompt(other, Q2, engine, 16).ids, max_new_tokens=16)
    assert third.cached_tokens < 0.15 * third.prompt_tokens  # the system prompt and template only


def test_fp_chat_two_questions_second_is_cached(smollm2):
    proc = subprocess.run(  # the README's path: the document's name is part of the prompt
        [fp_executable(), "chat", "examples/harbor-report.md", "-n", "32"], input=f"{Q1}\n{Q2}\n",
        capture_output=True, text=True, env=run_env(), timeout=900, cwd=HARBOR.parent.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"^prompt tokens ([\d,]+)(?: \(([\d,]+) cached\))?, TTFT", proc.stderr, re.M)
    assert len(rows) == 2, proc.stderr
    (p1, c1), (p2, c2) = [(int(p.replace(",", "")), int((c or "0").replace(",", ""))) for p, c in rows]
    assert c1 == 0 and c2 >= 0.8 * p2
    header = int(re.search(r"system message and documents: ([\d,]+) tokens", proc.stderr).group(1).replace(",", ""))
    assert c2 >= header > 0.9 * p1  # the header counts what the second question really reuses
    assert "14 May" in proc.stdout
    # a quiet terminal: fp's own lines only (no log records, Python warnings or progress bars)
    third_party = re.compile(r"^(WARNING|INFO|DEBUG)\b|Warning:|warnings\.warn|\d+%\|[^\n]*\||it/s\]", re.M)
    assert not third_party.search(proc.stderr), proc.stderr
