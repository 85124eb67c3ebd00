"""The README's promises match the code: the sample output is real output of the current code
(its summary rows are the ones ``render_summary`` prints), and the sizes it quotes are the real ones.
``tests/test_e2e_cpu.py::test_readme_sample_is_what_the_command_prints`` reruns the sample command."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def sample_block() -> list[str]:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"```\n(\$ fp ask examples/harbor-report\.md .*?)```", text, re.S)
    assert m, "the README's sample run of examples/harbor-report.md is missing"
    return m.group(1).splitlines()


def test_readme_sample_is_real_output_not_illustrative():
    lines = sample_block()
    assert not any("illustrative" in line for line in lines)
    rows = {line[:25].strip(): line[25:] for line in lines if re.match(r"^[a-zA-Z /]+ {2,}\S", line)}
    for key in ("prompt tokens", "TTFT", "attention density", "attention FLOPs skipped", "engine", "model", "profile"):
        assert key in rows, key
    # the rows are in the format the current summary prints
    # the default profile's threshold fitted to the 8K embedded model: min(8192, 8192 // 2)
    assert "(no layer ran sparse: 811 prompt tokens < min_sparse_len 4,096)" in rows["attention density"]
    assert "dense-equivalent" in rows["attention FLOPs skipped"] and "all layers" in rows["attention FLOPs skipped"]
    assert rows["engine"].strip() == "transformers" and rows["model"].strip() == "smollm2-135m-instruct"
    # a prompt this short is dense by construction; the README must say so next to the sample
    assert rows["attention density"].startswith("100.0%")
    text = README.read_text(encoding="utf-8")
    assert "dense by construction" in text or "100% by construction" in text
    assert "docs/benchmarks.md" in text


def test_readme_sizes_match_the_embedded_model():
    from fpcli.models import DEFAULT_MODEL, EMBEDDED

    text = README.read_text(encoding="utf-8")
    download_mb = round(EMBEDDED[DEFAULT_MODEL].wheel_bytes / 1e6)
    assert f"{download_mb} MB download" in text
    assert "about 100 MB" not in text
    assert "540 MB on disk" in text


def test_readme_exit_codes_list_every_code_fp_uses():
    from fpcli.commands.stop import EXIT_NOT_RUNNING, EXIT_STARTING

    text = " ".join(README.read_text(encoding="utf-8").split())
    codes = re.search(r"Exit codes: (.*?)(?:\n\n|\*\*The JSON report)", text, re.S)
    assert codes, "the README's exit-code list is missing"
    listed = codes.group(1)
    for code, what in ((0, "success"), (1, "failure"), (2, "bad usage"), (EXIT_NOT_RUNNING, "fp status"),
                       (EXIT_STARTING, "still starting")):
        assert re.search(rf"(^|[ ,;]){code} [^;,]*{re.escape(what)}", listed), (code, what, listed)


def test_readme_ask_table_lists_every_option_of_fp_ask():
    """The README's `fp ask` options table has a row for each option `fp ask --help` shows."""
    import typer

    from fpcli.cli import app

    command = typer.main.get_command(app).commands["ask"]
    text = README.read_text(encoding="utf-8")
    table = re.search(r"\| option \| meaning \|\n\|---\|---\|\n((?:\|.*\n)+)", text)
    assert table, "the README's fp ask options table is missing"
    rows = [line.split("|")[1] for line in table.group(1).splitlines()]
    documented = set(re.findall(r"`(--?[\w-]+)", " ".join(rows)))
    options = {name for p in command.params if p.param_type_name == "option" and not getattr(p, "hidden", False)
               for name in p.opts if name.startswith("--") and name != "--help"}
    assert "--no-server" in options and "--page-timeout" in options  # the test sees the options
    assert options - documented == set(), sorted(options - documented)


def test_documented_cpu_eval_runs_sparse_on_the_embedded_model():
    """The CPU `fp eval` example of the README and docs/eval.md uses a --len whose prompts exceed
    the bf16 profile's min_sparse_len fitted to the embedded model's context, and fit it: at --len
    4k every profile ran dense (a table of dense vs dense)."""
    from fpcli.commands.bench import parse_lengths
    from fpcli.models import DEFAULT_MODEL, EMBEDDED
    from fpcli.profiles import load_profile
    from fpcli.ruler.render import _longer_than

    context = EMBEDDED[DEFAULT_MODEL].context_length
    msl = load_profile("bf16").fit_to_context(context).sparse.min_sparse_len
    for doc in (README, README.parent / "docs" / "eval.md"):
        lines = [ln for ln in doc.read_text(encoding="utf-8").splitlines()
                 if ln.startswith("fp eval ") and "# CPU, embedded model" in ln]
        assert len(lines) == 1, doc
        m = re.search(r"--len (\S+)", lines[0])
        for n in parse_lengths(m.group(1)):
            assert _longer_than(msl) <= n <= context, (doc.name, n, msl, context)
        assert re.search(r"~\d+ min", lines[0]), "the expected minutes next to the example"
