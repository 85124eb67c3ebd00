"""The device machine's staged models (``$FPDEV_MODELS``, see the device README) and the skips the
GPU engine tests share: no CUDA, no SGLang, or a model not staged."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fpcli.models import QWEN_CODER

MODELS = Path(os.environ.get("FPDEV_MODELS", "/nonexistent"))
QWEN = MODELS / QWEN_CODER
SMOL = MODELS / "smollm2-135m-instruct"


def require_sglang_and(*models: Path, min_capability: tuple[int, int] | None = None) -> None:
    """Skip the calling test module unless CUDA (of at least ``min_capability``), SGLang and every
    model folder of ``models`` are present. Call it at module level, before importing what needs
    them."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    if min_capability is not None and torch.cuda.get_device_capability() < min_capability:
        pytest.skip(f"needs compute capability >= {min_capability[0]}.{min_capability[1]}", allow_module_level=True)
    pytest.importorskip("sglang")
    for m in models:
        if not (m / "config.json").is_file():
            pytest.skip(f"staged model {m.name} not found under FPDEV_MODELS={MODELS}", allow_module_level=True)


def staged(model: Path) -> Path:
    """``model`` (a folder under ``MODELS``), or skip the calling test when it is not staged."""
    if not (model / "config.json").is_file():
        pytest.skip(f"staged model {model.name} not found under FPDEV_MODELS={MODELS}")
    return model
