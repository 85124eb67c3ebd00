"""The summary renderer: a rich table on a terminal, plain unwrapped lines in a log or a pipe."""
from __future__ import annotations

import io
import json
import os
import stat

import pytest

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
    assert "(no layer ran sparse: 813 prompt tokens < min_sparse_len 8,192)" in line
    assert "min_sparse_len" not in density_line(d, "flashprefill", prompt_tokens=9000, min_sparse_len=8192)
    assert "min_sparse_len" not in density_line(d, "flashprefill")
    assert "dense attention" in density_line(d, "dense", prompt_tokens=813, min_sparse_len=None)


def test_density_line_says_when_dense_layers_cover_the_model():
    """A profile whose dense_layers is at least the model's layer count (accurate's 12 copied to a
    model of 8 layers, say) runs dense at every length: the line names that, not min_sparse_len,
    and keeps saying min_sparse_len when the model has more layers than that."""
    from fpcli.report import density_line

    d = {"overall": 1.0, "per_layer": [1.0] * 4, "sparse_layers": [], "min": 1.0, "median": 1.0, "max": 1.0}
    line = density_line(d, "flashprefill", prompt_tokens=9_000, min_sparse_len=4096, dense_layers=12)
    assert "(no layer ran sparse: dense_layers 12 >= the model's 4 layers)" in line
    short = density_line(d, "flashprefill", prompt_tokens=813, min_sparse_len=4096, dense_layers=4)
    assert "dense_layers 4 >= the model's 4 layers" in short and "min_sparse_len" not in short
    assert "813 prompt tokens < min_sparse_len 4,096" in density_line(
        d, "flashprefill", prompt_tokens=813, min_sparse_len=4096, dense_layers=2)
    report = _report()
    s = report["summary"]
    s.update(prompt_tokens=9_000, cached_tokens=0, min_sparse_len=4096, density={**d, "over": "all layers"},
             sparse={**(s.get("sparse") or {}), "dense_layers": 40})
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=80, soft_wrap=True), report)
    row = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("attention density"))
    assert "dense_layers 40 >= the model's 4 layers" in row, row


def test_density_line_and_summary_with_a_set_of_dense_layers():
    """A set of dense layers (a list in the report's JSON): the density row says when the set
    covers every layer of the model (and says min_sparse_len when it does not); the FLOPs row
    counts the dense layers from the layers that did not run sparse."""
    from fpcli.report import density_line

    d = {"overall": 1.0, "per_layer": [1.0] * 4, "sparse_layers": [], "min": 1.0, "median": 1.0, "max": 1.0}
    line = density_line(d, "flashprefill", prompt_tokens=9_000, min_sparse_len=4096, dense_layers=[0, 1, 2, 3, 8])
    assert "(no layer ran sparse: dense_layers [0-3, 8] cover all the model's 4 layers)" in line, line
    short = density_line(d, "flashprefill", prompt_tokens=813, min_sparse_len=4096, dense_layers=(0, 2, 3))
    assert "813 prompt tokens < min_sparse_len 4,096" in short and "dense_layers" not in short
    report = _report()
    s = report["summary"]
    ran = {"overall": 0.5, "per_layer": [1.0, 0.4, 1.0, 0.6], "sparse_layers": [1, 3], "min": 0.4, "median": 0.8,
           "max": 1.0, "over": "sparse layers"}
    s.update(prompt_tokens=9_000, cached_tokens=0, min_sparse_len=4096, density=ran,
             sparse={**(s.get("sparse") or {}), "dense_layers": [0, 2]})
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), report)
    text = buf.getvalue()
    assert "over sparse layers (layers 1, 3)" in text and "the 2 dense layers skip none" in text, text
    assert "dense_layers [0, 2]" in text, text  # the settings row: what differs from bf16


def test_density_line_of_a_follow_up_counts_only_the_new_tokens():
    """A follow-up whose prompt the KV cache mostly served prefilled only its new tokens: when they
    are below min_sparse_len, that is the reason nothing ran sparse (the prompt's total is not)."""
    from fpcli.report import density_line

    d = {"overall": 1.0, "per_layer": [1.0] * 4, "sparse_layers": [], "min": 1.0, "median": 1.0, "max": 1.0}
    line = density_line(d, "flashprefill", prompt_tokens=9_000, min_sparse_len=8192, cached_tokens=8_950)
    assert "(no layer ran sparse: 50 new tokens after 8,950 cached < min_sparse_len 8,192)" in line
    assert "new tokens" not in density_line(d, "flashprefill", prompt_tokens=813, min_sparse_len=8192,
                                            cached_tokens=0)
    report = _report()
    s = report["summary"]
    s.update(prompt_tokens=9_000, cached_tokens=8_950, min_sparse_len=8192,
             density={**d, "over": "all layers"})
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=80, soft_wrap=True), report)
    row = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("attention density"))
    assert "50 new tokens after 8,950 cached < min_sparse_len 8,192" in row, row


# -- ragged per-head rows (SGLang: dense layers report no per-head row) ---------------------------


def sglang_like_stats(layers: int = 6, hkv: int = 4, dense_layers: int = 2):
    """``PrefillStats`` made by the SGLang statistics code (``prefill_stats_of``) for a prefill
    whose first ``dense_layers`` layers ran dense: their per-head rows are empty."""
    from flashprefill.integrations.sglang.stats_reader import RequestPrefill
    from fpcli.engine.sglang_engine import prefill_stats_of

    modes = ["dense:layer"] * dense_layers + ["sparse"] * (layers - dense_layers)
    selected = [None] * dense_layers + [[3 + h + i for h in range(hkv)] for i in range(layers - dense_layers)]
    visible = [None] * dense_layers + [[20] * hkv for _ in range(layers - dense_layers)]
    rec = RequestPrefill(rid="r", chunks=1, prompt_tokens=2048, layers=modes, selected=selected, visible=visible,
                         dense_flops=[1e9] * layers)
    return prefill_stats_of(rec)


def test_sglang_stats_are_ragged_and_the_grid_is_rectangular():
    from fpcli.report import density_grid

    st = sglang_like_stats()
    assert {len(r) for r in st.density_per_layer_head} == {0, 4}  # the shape that crashed the PNG
    grid = density_grid(st.density_per_layer_head, st.density_per_layer, st.sparse_layers)
    assert len(grid) == 6 and all(len(r) == 4 for r in grid)
    assert grid[0] == grid[1] == [1.0] * 4  # dense layers: every head 1.0
    assert grid[2] == st.density_per_layer_head[2] and grid[2][0] == 3 / 20


def test_grid_marks_missing_heads_and_single_values():
    from fpcli.report import density_grid

    grid = density_grid([[0.5, 0.25, 0.75], [0.4], [0.3, 0.2]], [0.5, 0.4, 0.25], sparse_layers=[0, 1, 2])
    assert grid == [[0.5, 0.25, 0.75], [None, None, None], [0.3, 0.2, None]]
    # without sparse_layers a per-layer density of 1.0 means dense
    assert density_grid([[0.5, 0.5], [1.0]], [0.5, 1.0]) == [[0.5, 0.5], [1.0, 1.0]]
    # no per-head value at all: one column, the per-layer densities
    assert density_grid([[], []], [1.0, 0.6]) == [[1.0], [0.6]]


def test_png_and_terminal_heatmap_of_ragged_rows(tmp_path):
    from fpcli.report import density_grid, heatmap_table, write_heatmap_png

    st = sglang_like_stats()
    grid = density_grid(st.density_per_layer_head, st.density_per_layer, st.sparse_layers)
    grid[3][1] = None  # a missing cell is drawn blank, not as a density
    path = write_heatmap_png(tmp_path / "h.png", grid, title="x")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(heatmap_table(grid))
    lines = buf.getvalue().splitlines()
    assert "--" in lines[4] and "**" in lines[1] and "99" not in lines[1]  # layer 3 has a blank cell, layer 0 is dense


def test_terminal_heatmap_shows_a_dense_cell_apart_from_99_percent():
    from fpcli.report import heatmap_legend, heatmap_table

    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False).print(heatmap_table([[1.0, 0.993, 0.42]]))
    row = buf.getvalue().splitlines()[1].split()
    assert row[:4] == ["0", "**", "99", "42"], row
    assert "** = 100%" in heatmap_legend().plain


def test_png_title_lies_within_the_figure():
    """A long title (file name, tokens, model, profile) over a narrow heatmap was clipped."""
    from fpcli.report import heatmap_figure

    title = "a-rather-long-document-name-2024-final-v3.pdf: 126,512 tokens, Qwen2.5-7B-Instruct-1M, bf16+fp8"
    for heads in (2, 4, 8):
        fig = heatmap_figure([[0.5 + 0.01 * h for h in range(heads)] for _ in range(24)], title=title)
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.axes[0].title.get_window_extent(renderer)
        fig_box = fig.bbox
        assert box.x0 >= fig_box.x0 and box.x1 <= fig_box.x1 and box.y1 <= fig_box.y1, (heads, box, fig_box)
        assert fig.axes[0].title.get_text().replace("\n", " ") == title
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_ask_report_density_per_layer_head_is_rectangular():
    from fpcli.engine.base import GenerationResult

    st = sglang_like_stats()
    result = GenerationResult("a", 2048, 2, 0.1, 0.1, 0.2, "sglang", "m", "bf16", stats=st)
    rows = ask_report(result, "q?", [], None, load_profile("bf16"))["summary"]["density_per_layer_head"]
    assert [len(r) for r in rows] == [4] * 6 and rows[0] == [1.0] * 4


def test_a_prompt_served_from_the_kv_cache_says_so_instead_of_zero_flops():
    report = _report()
    s = report["summary"]
    s.update(cached_tokens=s["prompt_tokens"] - 1, attention_flops_dense=0.0, attention_flops_skipped=0.0,
             attention_flops_skipped_fraction=0.0)
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=80, soft_wrap=True), report)
    row = [line for line in buf.getvalue().splitlines() if line.startswith("attention FLOPs skipped")]
    assert len(row) == 1 and "0 of 0" not in row[0] and "came from the KV cache" in row[0]
    assert f"{s['prompt_tokens'] - 1:,} of {s['prompt_tokens']:,}" in row[0]


def test_a_partly_cached_prompt_says_its_cached_tokens_were_not_counted():
    report = _report()
    s = report["summary"]
    s.update(prompt_tokens=1337, cached_tokens=1326, attention_flops_dense=1.01e9, attention_flops_skipped=0.0,
             attention_flops_skipped_fraction=0.0)
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), report)
    row = [line for line in buf.getvalue().splitlines() if line.startswith("attention FLOPs skipped")]
    assert len(row) == 1 and "dense-equivalent (0.0%" in row[0], row
    assert "1,326 of 1,337 prompt tokens came from the KV cache, not counted" in row[0], row
    s.update(cached_tokens=0)
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), report)
    assert "KV cache" not in buf.getvalue()


@pytest.mark.parametrize("device, skipped, says", [("cpu", 1e9, True), ("cuda", 1e9, False), (None, 1e9, False),
                                                  ("cpu", 0.0, False)])
def test_flops_skipped_on_the_cpu_say_no_time_was_saved(device, skipped, says):
    report = _report()
    report["summary"].update(device=device, attention_flops_dense=4e9, attention_flops_skipped=skipped,
                             attention_flops_skipped_fraction=skipped / 4e9)
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), report)
    row = [line for line in buf.getvalue().splitlines() if line.startswith("attention FLOPs skipped")]
    assert len(row) == 1 and ("(CPU reference: no time saved)" in row[0]) == says, row


@pytest.mark.parametrize("mode, says", [("cuda graph", "(CUDA graph)"), ("eager", "(eager)"), (None, None)])
def test_decode_row_says_how_the_decode_ran(mode, says):
    """The engine's ``GenerationResult.decode_mode`` reaches the JSON summary and the decode row;
    an answer without decode steps (or an engine that does not say) gets no word."""
    eng = FakeEngine()
    result = eng.generate(eng.encode_chat(None, "word " * 50), max_new_tokens=4)
    result.decode_mode = mode
    report = ask_report(result, "q?", [], None, load_profile("bf16"))
    assert report["summary"]["decode_mode"] == mode
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), report)
    (row,) = [line for line in buf.getvalue().splitlines() if line.startswith("decode")]
    assert row.endswith("tokens/s" if says is None else f"tokens/s {says}"), row


# -- save_report: atomic for a regular file, in place for what a rename would replace ------------

def _report_doc(n: int = 3) -> dict:
    return {"schema": "test/1", "values": list(range(n)), "note": "ß"}


def test_save_report_new_and_existing_file_keeps_its_mode(tmp_path):
    from fpcli.report import save_report

    new = tmp_path / "new.json"
    save_report(new, _report_doc())
    assert json.loads(new.read_text(encoding="utf-8")) == _report_doc()
    old = tmp_path / "old.json"
    old.write_text("previous")
    old.chmod(0o600)
    save_report(old, _report_doc(5))
    assert json.loads(old.read_text(encoding="utf-8"))["values"] == [0, 1, 2, 3, 4]
    assert stat.S_IMODE(old.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_save_report_through_a_symlink_and_a_hard_link_writes_the_shared_file(tmp_path):
    from fpcli.report import save_report

    target = tmp_path / "real.json"
    target.write_text("previous")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    save_report(link, _report_doc())
    assert link.is_symlink() and json.loads(target.read_text(encoding="utf-8")) == _report_doc()
    other = tmp_path / "other-name.json"
    os.link(target, other)
    save_report(target, _report_doc(7))
    assert os.path.samefile(target, other)  # written in place: the hard link still shares the file
    assert json.loads(other.read_text(encoding="utf-8"))["values"] == list(range(7))


def test_save_report_to_a_pipe_writes_in_place(tmp_path):
    import threading

    from fpcli.report import save_report

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text(encoding="utf-8")), daemon=True)
    reader.start()
    save_report(fifo, _report_doc())
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # not replaced by a file (the reader would wait forever)
    reader.join(10)
    assert got and json.loads(got[0]) == _report_doc()


def test_save_report_interrupted_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from fpcli import report as R

    path = tmp_path / "r.json"
    path.write_text("previous")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(R.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        R.save_report(path, _report_doc())
    assert path.read_text() == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_profile_row_names_only_the_settings_that_differ_from_bf16():
    """min_sparse_len is compared as the profile asked (both are capped alike); a bool is 'true'."""
    import dataclasses

    from fpcli.profiles import sparse_cap_note, sparse_differences, sparse_settings

    bf16 = load_profile("bf16")
    assert sparse_differences(sparse_settings(bf16, 4096), bf16) == []
    other = dataclasses.replace(bf16, dense_layers=0, sparse=dataclasses.replace(
        bf16.sparse, alpha=0.1, mean_correction=False, min_sparse_len=16384, threshold_max="prunable"))
    assert sparse_differences(sparse_settings(other, 4096), bf16) == [
        "alpha 0.1", "mean_correction false", "threshold_max prunable", "dense_layers 0", "min_sparse_len 16,384"]
    assert sparse_settings(other, 4096)["min_sparse_len"] == 2048
    assert sparse_cap_note(other, 4096) == "min_sparse_len 16,384 capped to 2,048: half the 4,096-token context it runs at"
    assert sparse_cap_note(other, 65536) is None and sparse_settings(load_profile("dense"), 4096) is None
    assert sparse_differences(None, bf16) == []


def test_always_kept_note_when_the_prompt_fits_in_sink_window_and_tail():
    """100% in sparse layers is explained when the prompt fits in sink + local window + dense tail
    (every query keeps all of it), with the numbers; not otherwise."""
    from fpcli.report import always_kept_note, density_summary

    sparse = {"sink_tokens": 512, "window_tokens": 1024, "dense_tail_tokens": 256, "min_sparse_len": 0}
    full = density_summary([1.0, 1.0, 1.0], 1.0, sparse_layers=[1, 2])
    note = always_kept_note(93, sparse, full)
    assert note == ("every block was kept: the 93-token prompt fits in sink 512 + local window 1,024 + dense tail "
                    "256 = 1,792 tokens, which the sparse layers always keep (nothing to prune)")
    assert always_kept_note(1792, sparse, full) is not None       # at the bound: still nothing to prune
    assert always_kept_note(1793, sparse, full) is None           # longer: the 100% has another cause
    assert always_kept_note(93, sparse, density_summary([1.0, 0.9, 0.8], 0.85, sparse_layers=[1, 2])) is None
    assert always_kept_note(93, sparse, density_summary([1.0, 1.0], 1.0, sparse_layers=[])) is None  # none ran sparse
    assert always_kept_note(93, None, full) is None                # a dense profile


def test_heatmap_legend_without_colours_gives_the_scale_in_words():
    """Off a terminal the colour swatches print as blanks: the legend gives the scale's numbers."""
    from fpcli.report import heatmap_legend

    buf = io.StringIO()
    Console(file=buf, width=300, force_terminal=False).print(heatmap_legend(color=False))
    line = buf.getvalue().strip()
    assert line.endswith("colour scale on a terminal: 8 steps of 12.5%, 0% dark purple to 100% yellow (as the PNG)")
    assert "  " not in line and "** = 100%" in line
    assert len([s for s in heatmap_legend().spans if s.style.startswith("on #")]) == 8  # a terminal: the swatches


def test_reports_fit_min_sparse_len_as_the_engine_does_for_a_model_extended_with_yarn():
    """The engines fit min_sparse_len to the smaller of the model's own context and the one it runs
    at (Profile.fit_to_model); the reports did it to the run's context only: SmolLM2 (8K) at
    --context 16k ran 4,096 while fp ask / fp profile said 8,192."""
    from fpcli.profiles import sparse_cap_note, sparse_settings, with_context_length

    bf16 = with_context_length(load_profile("bf16"), 16384)
    ran = bf16.fit_to_model(8192).sparse.min_sparse_len
    assert ran == 4096
    assert sparse_settings(bf16, 16384, native_context=8192)["min_sparse_len"] == ran
    assert sparse_settings(bf16, 16384)["min_sparse_len"] == 8192        # without the native context: as before
    assert sparse_cap_note(bf16, 16384, native_context=8192) == (
        "min_sparse_len 8,192 capped to 4,096: half the model's own 8,192-token context (it runs at 16,384 with YaRN)")
    assert sparse_cap_note(bf16, 8192, native_context=32768) == (
        "min_sparse_len 8,192 capped to 4,096: half the 8,192-token context it runs at")
    assert sparse_cap_note(bf16, 131072, native_context=32768) is None
