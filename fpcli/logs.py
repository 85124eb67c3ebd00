"""Third-party output on stderr: shown with ``-v/--verbose``, else kept off the terminal.

Without ``-v`` the terminal shows ``fp``'s own stages and the answer only: the log records of
other libraries (transformers, SGLang, torch, huggingface_hub, the FlashPrefill integration's
logger), Python warnings and Hugging Face progress bars are dropped unless they are errors.
``fp``'s own warnings go through its console, not through ``logging``, and are always shown.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Iterator

# Libraries that set their own logger level (a root-level setting does not reach them).
OWN_LEVEL_LOGGERS = ("transformers", "sglang", "flashprefill", "flashprefill.integrations", "torch",
                     "huggingface_hub", "accelerate", "urllib3", "filelock")
# fp's own loggers outside the FlashPrefill integration: their warnings stay visible.
FP_LOGGERS = ("fpcli.engine",)
# Read by transformers and huggingface_hub when they are imported.
QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@contextlib.contextmanager
def third_party_output(verbose: bool) -> Iterator[None]:
    """Within the block, third-party log lines below ERROR, Python warnings and Hugging Face
    progress bars are suppressed unless ``verbose``; everything is restored on exit. Settings the
    user made in the environment (e.g. ``TRANSFORMERS_VERBOSITY``) are kept."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in OWN_LEVEL_LOGGERS]
    ours = [logging.getLogger(n) for n in FP_LOGGERS]
    levels = [lg.level for lg in loggers + ours]
    env_added = [k for k in QUIET_ENV if k not in os.environ]
    bars = _hf_progress_bars(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k in env_added:
            os.environ[k] = QUIET_ENV[k]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        for lg in ours:
            lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for lg, level in zip(loggers + ours, levels):
                lg.setLevel(level)
            for k in env_added:
                os.environ.pop(k, None)
            if bars:
                _hf_progress_bars(True)


def _hf_progress_bars(enable: bool) -> bool:
    """Switch transformers' progress bars if transformers is already imported (else the
    environment above covers its import); returns whether they were enabled before."""
    import sys

    if "transformers" not in sys.modules:
        return False
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enable else hf_logging.disable_progress_bar)()
    return was
