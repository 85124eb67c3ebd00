"""Runs ``fp`` in this process and records which heavy modules it imported.

``python tests/fp_import_probe.py OUT ARGS...`` runs ``fp ARGS...`` (``fpcli.cli.main``) and, when
the process exits, writes to the file ``OUT`` a JSON list of the modules of ``HEAVY`` found in
``sys.modules``: what a resident engine's client must not pay for (the model lives in the server).
"""
from __future__ import annotations

import atexit
import json
import sys

HEAVY = ("torch", "transformers", "sglang", "flashprefill.api")


def _record(out: str) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump([m for m in HEAVY if m in sys.modules], f)


if __name__ == "__main__":
    atexit.register(_record, sys.argv[1])
    sys.argv = ["fp", *sys.argv[2:]]
    from fpcli.cli import main

    main()
