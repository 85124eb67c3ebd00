"""The ``fp`` command line: ``fp ask``, ``fp chat``, ``fp bench``, ``fp eval``, ``fp profile``, ``fp serve``,
``fp start``, ``fp status``, ``fp stop``, ``fp model``.

One module per command under ``fpcli/commands/``, joined here with ``add_typer``. stdout carries
only answers and ``--json`` output; everything else goes to stderr.
"""
from __future__ import annotations

from typing import Annotated

import typer

from fpcli import clock  # noqa: F401 - first: anchors the wall clock where /proc is missing
from fpcli import __version__
from fpcli.commands import FpGroup, ask, bench, chat, evaluate, model, profile, serve, start, stop

app = typer.Typer(
    name="fp",
    cls=FpGroup,
    help="Ask questions about long documents with a local LLM, fast: FlashPrefill V2 block-sparse prefill.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(ask.app)
app.add_typer(chat.app)
app.add_typer(bench.app)
app.add_typer(evaluate.app)
app.add_typer(profile.app)
app.add_typer(serve.app)
app.add_typer(start.app)
app.add_typer(stop.app)
app.add_typer(model.app, name="model", help="Manage the embedded models (list, pull, path).")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fp {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Ask questions about long documents with a local LLM, fast: FlashPrefill V2 block-sparse prefill."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
