"""Regenerate docs/cli.md from the real ``--help`` output of every ``fp`` command.

    python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    python scripts/gen_cli_docs.py --check  # exit 1 if docs/cli.md is stale (tests/test_cli_docs.py)
"""
from __future__ import annotations

import sys
from pathlib import Path

from typer.testing import CliRunner

COMMANDS = [[], ["ask"], ["chat"], ["bench"], ["eval"], ["profile"], ["serve"], ["start"], ["status"], ["stop"], ["model"],
            ["model", "list"],
            ["model", "pull"], ["model", "path"]]
DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def render() -> str:
    from fpcli.cli import app

    runner = CliRunner()
    parts = ["# `fp` command reference\n\n",
             "Generated from the real `--help` output by `python scripts/gen_cli_docs.py`; do not edit.\n"]
    for cmd in COMMANDS:
        res = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"},
                            terminal_width=100, prog_name="fp")
        if res.exit_code != 0:
            raise SystemExit(f"fp {' '.join(cmd)} --help exited {res.exit_code}: {res.output}")
        lines = [line.rstrip() for line in res.output.splitlines()]
        title = " ".join(["fp", *cmd])
        parts.append(f"\n## `{title}`\n\n```\n" + "\n".join(lines).strip("\n") + "\n```\n")
    return "".join(parts)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is stale: run python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
