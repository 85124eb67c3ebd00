"""The layout's rules: the operator library (``kernels/``) never imports ``fp``'s CLI, the SGLang
plugin entry point points into it, and a wheel carries the built-in profiles."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"


def _imported_modules(path: Path) -> set[str]:
    """Top-level module names imported by ``path`` (``import x.y`` and ``from x.y import z``;
    relative imports are inside the same package and skipped)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_nothing_under_kernels_imports_fpcli():
    sources = sorted(KERNELS.rglob("*.py"))
    assert len(sources) > 10 and any(p.parts[-2] == "sglang" for p in sources)
    offenders = [str(p.relative_to(ROOT)) for p in sources if "fpcli" in _imported_modules(p)]
    assert offenders == []


def test_the_import_check_sees_a_function_level_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from fpcli.engine.base import PrefillStats\n    return PrefillStats\n")
    assert "fpcli" in _imported_modules(path)


def test_the_sglang_entry_point_points_into_the_operator_library():
    tomllib = pytest.importorskip("tomllib", reason="the standard library's TOML reader is Python 3.11+")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    target = data["project"]["entry-points"]["sglang.srt.plugins"]["flashprefill"]
    assert target == "flashprefill.integrations.sglang.plugin:register"


def test_the_integrations_import_with_fpcli_unimportable(tmp_path):
    """A process where ``fpcli`` cannot be imported (an SGLang scheduler with the operator
    library alone) imports the plugin, the settings and both statistics modules, and the
    transformers integration; ``OMP_WAIT_POLICY`` (set by importing fpcli) stays unset."""
    blocker = tmp_path / "fpcli"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('fpcli must not be imported here')\n")
    code = (
        "import os, sys\n"
        "import flashprefill.integrations.sglang.plugin as plugin\n"
        "import flashprefill.integrations.sglang.settings as settings\n"
        "import flashprefill.integrations.sglang.stats_reader, flashprefill.integrations.sglang.stats_writer\n"
        "import flashprefill.integrations.sglang.metadata\n"
        "import flashprefill.integrations.transformers\n"
        "assert settings.BackendSettings.from_env({}) == settings.BackendSettings()\n"
        "assert 'fpcli' not in sys.modules and 'OMP_WAIT_POLICY' not in os.environ\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(KERNELS)])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.slow
def test_a_wheel_carries_the_builtin_profiles(tmp_path):
    """``pip wheel .`` (what a non-editable ``pip install .`` builds): the YAML files sit inside
    the ``fpcli`` package, where ``fpcli.profiles.profiles_dir`` looks for them."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = tmp_path.glob("fp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"fpcli/builtin_profiles/{n}.yaml" for n in ("bf16", "accurate", "fp8", "dense")} <= names
    assert "flashprefill/integrations/sglang/plugin.py" in names and "flashprefill/integrations/transformers.py" in names
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "flashprefill = flashprefill.integrations.sglang.plugin:register" in text
