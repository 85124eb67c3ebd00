"""How long the running ``fp`` process has existed: the honest wall time of a command.

The kernel records each process's start (``/proc/self/stat`` field 22, clock ticks since boot);
``CLOCK_BOOTTIME`` is the time since boot now, so their difference covers the interpreter's
start-up and every import before ``fp``'s own code ran. Where ``/proc`` is missing (not Linux),
the time since this module was imported stands in (``fpcli.cli`` imports it first).
"""
from __future__ import annotations

import os
import time

_IMPORTED_AT = time.monotonic()  # fallback anchor: the earliest point fp's own code runs


def process_age_s() -> float:
    """Seconds since this process started (10 ms resolution on Linux), >= 0."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22; fields[0] is field 3
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED_AT
