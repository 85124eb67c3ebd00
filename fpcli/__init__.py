"""fp: ask questions about long documents with a local LLM, fast (FlashPrefill V2 prefill)."""

import os as _os

# On a busy or shared CPU, OpenMP's default busy-wait makes torch several times slower (a 1K-token
# prefill: 18.6 s vs 4.6 s measured here). Must be set before torch is imported; a user's own
# setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
