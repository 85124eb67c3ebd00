"""The summary renderer: a rich table on a terminal, plain unwrapped lines in a log or a pipe."""
from __future__ import annotations

import io

from rich.console import Console

from fp_fakes import FakeEngine
from fpcli.profiles import load_profile
from fpcli.report import ask_report, density_summary, layer_ranges, render_summary


def _report(profile="bf16"):
    eng = FakeEngine(profile=profile)
    result = eng.generate(eng.encode_chat(None, "word " * 50), max_new_tokens=4)
    return ask_report(result, "q?", [], None, load_profile(profile))


def test_summary_in_a_log_is_one_unpadded_line_per_row():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=80, soft_wrap=True)
    render_summary(console, _report())
    lines = buf.getvalue().splitlines()
    assert lines[0] == "fp ask"
    density = [line for line in lines if line.startswith("attention density")]
    assert len(density) == 1 and len(density[0]) > 80 and density[0].endswith("(all 4 layers)")
    assert all(line == line.rstrip() for line in lines)


def test_summary_on_a_terminal_is_a_table():
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=True, width=200), _report("dense"))
    out = buf.getvalue()
    assert "fp ask" in out and "attention" in out and "no index stage" in out and "n/a" not in out


def test_density_summary_scope_and_layer_ranges():
    d = density_summary([1.0, 1.0, 0.5, 0.7], 0.6, sparse_layers=[2, 3])
    assert d["over"] == "sparse layers" and d["sparse_layers"] == [2, 3] and d["overall"] == 0.6
    assert density_summary([0.5, 0.7])["over"] == "all layers"
    assert layer_ranges([2, 3, 4, 7]) == "layers 2-4, 7" and layer_ranges([5]) == "layer 5"


def test_density_line_says_why_nothing_ran_sparse():
    """A prompt shorter than the profile's min_sparse_len is the usual reason for 100% density;
    the line names it (numbers of the run), and says nothing when it is not the reason."""
    from fpcli.report import density_line

    d = {"overall": 1.0, "per_layer": [1.0] * 4, "sparse_layers": [], "min": 1.0, "median": 1.0, "max": 1.0}
    line = density_line(d, "flashprefill", prompt_tokens=813, min_sparse_len=8192)
    assert "(no layer ran sparse: 813 prompt tokens < the profile's min_sparse_len 8,192)" in line
    assert "min_sparse_len" not in density_line(d, "flashprefill", prompt_tokens=9000, min_sparse_len=8192)
    assert "min_sparse_len" not in density_line(d, "flashprefill")
    assert "dense attention" in density_line(d, "dense", prompt_tokens=813, min_sparse_len=None)
