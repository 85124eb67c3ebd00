"""``python -m fpcli``: the ``fp`` command line (used to spawn the detached resident engine)."""
from fpcli.cli import main

main()
