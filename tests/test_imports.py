"""The resident engine's client side imports neither torch nor transformers: an ``fp ask``
answered by a running engine should not pay seconds of imports for a model it does not load.
``flashprefill``'s configuration (``flashprefill.config``, the method's knobs the profiles hold) is
light and allowed; its operator (``flashprefill.api``) is not."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["fpcli.engine", "fpcli.server.client", "fpcli.commands.ask", "fpcli.cli",
                                    "fpcli.doccache", "fpcli.prompt", "fpcli.ingest", "fpcli.report"])
def test_client_side_modules_do_not_import_torch(module):
    code = (f"import sys, {module}; heavy = [m for m in ('torch', 'transformers', 'sglang', 'flashprefill.api') "
            f"if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} imports {out.stdout.strip()}"
