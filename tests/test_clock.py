"""``fpcli.clock.process_age_s``: the process's age from the OS's record of its start."""
from __future__ import annotations

import subprocess
import sys


def test_process_age_counts_the_time_before_fpcli_was_imported():
    code = "import time; time.sleep(1.5); from fpcli.clock import process_age_s; print(process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    age = float(out.stdout)
    assert 1.5 <= age < 60, out  # the sleep before the import counts: the start is the process's own
