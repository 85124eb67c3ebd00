"""``fp profile`` through the real CLI with the SGLang engine on a staged model (run on the device).

SGLang's statistics give the dense layers (``dense_layers: 2`` of the ``bf16`` profile) an empty
per-head row and the sparse layers ``Hkv`` values; ``fp profile`` crashed on that ragged grid in
``write_heatmap_png``. This runs the command as a user does, then checks the JSON and the PNG.
Skips unless CUDA, SGLang and the staged models (``$FPDEV_MODELS``) are present.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from fp_fakes import fp_executable, run_env

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")
MODELS = Path(os.environ.get("FPDEV_MODELS", "/nonexistent"))
# ~12 tokens a line: Qwen (32K context, threshold 8192) gets ~12K tokens, SmolLM2 (8K, threshold
# 4096) ~6K
CANDIDATES = [(MODELS / "qwen2.5-coder-0.5b-instruct", 1000), (MODELS / "smollm2-135m-instruct", 500)]
STAGED = [(m, n) for m, n in CANDIDATES if (m / "config.json").is_file()]
if not STAGED:
    pytest.skip(f"staged models not found under FPDEV_MODELS={MODELS}", allow_module_level=True)


def document(sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["harbour", "budget", "terminal", "ferry", "council", "approved", "engineers", "tides", "cranes", "2023"]
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "." for _ in range(sentences))


@pytest.mark.parametrize("model,sentences", STAGED, ids=[m.name for m, _ in STAGED])
def test_fp_profile_sglang_png_and_json(model, sentences, tmp_path):
    doc = tmp_path / "harbour-minutes-of-the-annual-general-meeting-2024-final.txt"
    doc.write_text(document(sentences), encoding="utf-8")
    png = tmp_path / "heat.png"
    proc = subprocess.run(
        [fp_executable(), "profile", str(doc), "What did the council approve?", "--engine", "sglang",
         "--model", str(model), "--png", str(png), "--json"],
        capture_output=True, text=True, env=run_env(), timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout)
    assert data["engine"] == "sglang" and data["png"] == str(png.resolve())
    grid = data["density_per_layer_head"]
    config = json.loads((model / "config.json").read_text())
    assert len(grid) == config["num_hidden_layers"]
    assert {len(row) for row in grid} == {config["num_key_value_heads"]}  # rectangular
    sparse = data["density"]["sparse_layers"]
    assert sparse, f"no layer ran sparse at {data['prompt_tokens']} tokens"
    assert grid[0] == [1.0] * config["num_key_value_heads"]  # a dense layer: every head 1.0
    assert all(v is not None and 0.0 < v <= 1.0 for i in sparse for v in grid[i])
    assert min(v for i in sparse for v in grid[i]) < 1.0
    # stage times: one per sparse layer (fp profile asks the engine for them), summing to the totals
    assert len(data["index_ms_per_layer"]) == len(data["attention_ms_per_layer"]) == len(sparse)
    assert sum(data["index_ms_per_layer"]) == pytest.approx(data["index_ms"])
    assert sum(data["attention_ms_per_layer"]) == pytest.approx(data["attention_ms"])
    assert 0.0 < data["index_share"] < 1.0 and data["index_share_over"].startswith("layer")
    assert isinstance(data["times_notes"], list)
    print(f"{model.name}: index share {data['index_share']:.1%} over {data['index_share_over']}; "
          f"notes {data['times_notes']}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as im:
        assert im.size[0] >= 400 and im.size[1] >= 300
