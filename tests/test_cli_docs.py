"""docs/cli.md is the real --help output of the current code (regenerated, never hand-edited)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_cli_docs_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_cli_docs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr + "\n(run: python scripts/gen_cli_docs.py)"
