"""GPU tests: skipped as a whole when CUDA is absent (they run on the device machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch missing or broken: nothing here can run
    _HAS_CUDA = False

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu runs on the device machine)")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
