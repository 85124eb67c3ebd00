"""The ``fp eval`` table (stderr): one row per (task, length), then the per-length averages; for
each profile three columns: score (points 0-100), mean TTFT (s) and mean density (%); and the
lines said under it (``dense_notes``, ``density_scope_notes``, ``gap_notes``, ``empty_notes``)."""
from __future__ import annotations

from rich.table import Table

from flashprefill.dense_layers import dense_layers_text, from_data
from fpcli.engine.base import eight_bit, precision_family, precision_label


def eval_table(report: dict) -> Table:
    """A rich table of an ``fp.eval/1`` report's ``cells`` and ``averages``. A profile's column
    title is its label: the name, plus what ran when it is not what the profile asked for."""
    profiles = report["profiles"]
    t = Table(
        title=(f"fp eval: {report['model']} ({report['engine']} engine), {_sample_count(report)}, "
               f"{_seeds(report)}, haystack {report['haystack']}"
               + (" [b]- PARTIAL: interrupted[/]" if report.get("interrupted") else "")),
        title_justify="left",
    )
    t.add_column("task")
    t.add_column("length", justify="right")
    t.add_column("prompt tokens", justify="right")
    for p in profiles:
        t.add_column(f"{p['label']}\nscore", justify="right")
        t.add_column("TTFT s", justify="right")
        t.add_column("density", justify="right")
    by_key = {(c["task"], c["length"], c["profile"]): c for c in report["cells"]}
    rows = list(dict.fromkeys((c["task"], c["length"]) for c in report["cells"]))
    for task, length in rows:
        first = next(by_key[(task, length, p["name"])] for p in profiles if (task, length, p["name"]) in by_key)
        cols = [task, _len(length), f"{first['prompt_tokens']:,.0f}"]
        for p in profiles:
            c = by_key.get((task, length, p["name"]))
            cols += _triple(c) if c else ["-", "-", "-"]  # an interrupted run: not answered
        t.add_row(*cols)
    if t.rows:
        t.rows[-1].end_section = True  # a rule above the averages
    avg = {(a["length"], a["profile"]): a for a in report["averages"]}
    several = len(report.get("seeds", [report["seed"]])) > 1
    for length in dict.fromkeys(a["length"] for a in report["averages"]):
        cols = ["[b]all tasks[/]", _len(length), ""]
        tasks = max(a["tasks"] for a in report["averages"] if a["length"] == length)
        for p in profiles:
            a = avg.get((length, p["name"]))
            cols += _triple(a, bold=True, spread=several, of_tasks=tasks) if a else ["-", "-", "-"]
        t.add_row(*cols)
    return t


def _sample_count(report: dict) -> str:
    """The samples a cell averages: ``samples_per_cell`` is per seed, e.g. "2 samples per seed x 2
    seeds = 4 per cell", or "1 sample per cell" with one seed."""
    n, seeds = report["samples_per_cell"], len(report.get("seeds", [report["seed"]]))
    per = f"{n} sample{'s' if n != 1 else ''}"
    if seeds == 1:
        return f"{per} per cell"
    return f"{per} per seed x {seeds} seeds = {n * seeds} per cell"


def _seeds(report: dict) -> str:
    seeds = report.get("seeds", [report["seed"]])
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(map(str, seeds))} (score ± half the spread between seeds)"


def _triple(c: dict, bold: bool = False, spread: bool = False, of_tasks: int | None = None) -> list[str]:
    """Score, TTFT and density of a cell or an average; an average over fewer tasks than the row's
    (an interrupted run) says so, e.g. "45.8 (1 of 2 tasks)": it does not compare with the others."""
    score = f"{c['score']:.1f}"
    if spread:
        score += f" ± {c['seed_spread'] / 2:.1f}"
    if of_tasks is not None and c.get("tasks", of_tasks) < of_tasks:
        score += f" ({c['tasks']} of {of_tasks} tasks)"
    return [f"[b]{score}[/]" if bold else score, f"{c['ttft_s']:.3f}", f"{100 * c['density']:.1f}%"]


def _len(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else f"{n:,}"


def dense_notes(report: dict) -> list[str]:
    """One line per length at which a sparse profile ran no sparse layer (an average's
    ``ran_dense``: every prompt below its ``min_sparse_len``), so that a table of identical dense
    runs says so, with the lengths that would run sparse: above ``min_sparse_len`` and within the
    report's ``context_length``, e.g. "at 4k every profile ran dense: prompts below min_sparse_len
    4,096; use --len 5k to 8k (up to the context of 8,192 tokens)". Empty when every sparse
    profile ran sparse."""
    sparse = [p["name"] for p in report["profiles"] if p.get("attention") != "dense"]
    by_length: dict[int, list[dict]] = {}
    for a in report["averages"]:
        if a["profile"] in sparse:
            by_length.setdefault(a["length"], []).append(a)
    notes = []
    for length, avgs in by_length.items():
        dense = [a for a in avgs if a.get("ran_dense")]
        if not dense:
            continue
        who = "every profile" if len(dense) == len(avgs) else "profile" + ("s " if len(dense) > 1 else " ") + \
            ", ".join(a["profile"] for a in dense)
        msl = max(a["min_sparse_len"] for a in dense)
        notes.append(f"at {_len(length)} {who} ran dense: prompts below min_sparse_len {msl:,}; "
                     + _sparse_lengths(msl, report.get("context_length")))
    return notes


def _sparse_lengths(min_sparse_len: int, context: int | None) -> str:
    """The advice of ``dense_notes``: the ``--len`` values (whole k) whose prompts exceed
    ``min_sparse_len`` and fit ``context`` (tokens; ``None``: unknown, no upper bound)."""
    low = _longer_than(min_sparse_len)
    if context is None:
        return f"use --len {_len(low)} or more"
    high = context // 1024 * 1024 if context >= 1024 else context
    if low > high:
        return (f"no --len up to the context of {context:,} tokens runs sparse "
                "(a profile file with a lower min_sparse_len does)")
    if low == high:
        return f"use --len {_len(low)} (the context is {context:,} tokens)"
    return f"use --len {_len(low)} to {_len(high)} (up to the context of {context:,} tokens)"


FEW_SAMPLES = 5
"""Below this many samples per cell, ``ttft_notes`` says which TTFT differences are noise; also
``fp eval``'s default ``--samples`` (which imports it), so a default run gets no such note."""


def ttft_notes(report: dict) -> list[str]:
    """One line under the table when its TTFT columns are easy to over-read: fewer than
    ``FEW_SAMPLES`` samples in a cell, or a length at which every sparse profile ran dense (the
    columns then time the same dense prefill). The noise is measured from the run itself: the
    largest TTFT range (max - min) among the samples of one profile at one length (prompts of
    nearly the same length, so the range is the machine's noise), e.g. "TTFT: 2 samples per cell;
    one profile's samples at one length differ by up to 0.412 s: smaller differences between
    profiles are noise". Empty otherwise."""
    cells = report.get("cells", [])
    if not cells:
        return []
    few = min(c["samples"] for c in cells)
    if few >= FEW_SAMPLES and not dense_notes(report):
        return []
    groups: dict[tuple[int, str], list[float]] = {}
    for smp in report.get("samples", []):
        for prof, r in smp["results"].items():
            groups.setdefault((smp["length"], prof), []).append(r["ttft_s"])
    ranges = [max(v) - min(v) for v in groups.values() if len(v) > 1]
    per = f"{few} sample{'s' if few != 1 else ''} per cell"
    if not ranges:
        return [f"TTFT: {per}, one per profile and length: its noise is not measured; "
                f"compare TTFT with --samples {FEW_SAMPLES} or more"]
    return [f"TTFT: {per}; one profile's samples at one length differ by up to {max(ranges):.3f} s: "
            "smaller TTFT differences between profiles are noise"]


GAP_POINTS = 2.0
"""A sparse profile more than this many points below dense at a length gets ``gap_notes``' advice
(the accuracy bar of ``docs/eval.md``: sparsity or FP8 within 2 points)."""

SIGNIFICANT_P = 0.05
"""``fp8_notes`` puts an 8-bit profile's lost answers on its precision only where the sign test of
its paired samples (the row's ``sign_p``, ``scoring.sign_test_p``) is below this; above it, it asks for more samples."""

ACCURATE_PROFILE = "accurate"
"""The built-in that keeps the first half of the layers dense (``fpcli/builtin_profiles``), which
``gap_notes`` suggests where a sparse profile loses answers and it was not run."""


def gap_notes(report: dict) -> list[str]:
    """One line per (length, sparse profile) of the report's ``against_dense`` (the same samples,
    paired), e.g. "at 32k bf16 against dense on the same 40 samples: 16 lost, 2 won (-35.0
    points)"; where a profile is more than ``GAP_POINTS`` below dense and ``accurate`` was not
    among the profiles (nor is the profile ``accurate``'s own twin, ``accurate+fp8``, ``accurate+int8qk``), the line adds
    how to measure it. Empty without a dense profile."""
    names = {p["name"] for p in report.get("profiles", [])}
    notes = []
    for g in report.get("against_dense", []):
        line = _paired_line(g, g["baseline"])
        if g["points"] < -GAP_POINTS and ACCURATE_PROFILE not in names and not g["profile"].startswith(ACCURATE_PROFILE):
            line += (f"; the {ACCURATE_PROFILE} profile (its early layers dense) may keep them: "
                     f"add it to --profiles (docs/profiles.md)")
        notes.append(line)
    return notes


def fp8_notes(report: dict) -> list[str]:
    """One line per (length, 8-bit profile: ``fp8`` or ``int8qk``) of the report's ``against_bf16``:
    its answers against its BF16 twin's on the same samples, e.g. "at 128k accurate+fp8 against
    accurate (the same profile at BF16) on the same 16 samples: 1 lost, 0 won (-6.2 points, sign test
    p 1.0)"; more than ``GAP_POINTS`` below, the line adds that its precision (FP8, int8qk) is what
    costs the answers where the row's ``sign_p`` is below ``SIGNIFICANT_P``, else that chance alone
    gives such a split this often and more paired samples are needed. An 8-bit profile that ran its
    precision with no BF16 twin in the run gets one line saying how to measure the precision's own
    cost (its twin beside it), since against dense its losses mix sparsity's and the precision's.
    Empty otherwise."""
    requested = {p["name"]: str(p.get("requested_precision") or "") for p in report.get("profiles", [])}
    notes = []
    for p in report.get("profiles", []):
        asked = requested[p["name"]]
        if (eight_bit(asked) and p.get("attention") != "dense" and p.get("bf16_twin") is None
                and any(precision_family(r) == asked for r in str(p.get("ran_precision") or "").split("/"))):
            pair = "bf16,fp8 or accurate,accurate+fp8" if asked == "fp8" else f"accurate,accurate+{asked}"
            notes.append(f"{p['name']} ran without its BF16 twin, so what {precision_label(asked)} alone costs is not "
                         f"separated from what sparsity costs: run the same profile at BF16 beside it (--profiles "
                         f"{pair}; any profile P with P+{asked})")
    for g in report.get("against_bf16", []):
        line = _paired_line(g, f"{g['baseline']} (the same profile at BF16)")
        label = precision_label(requested.get(g["profile"], "fp8"))
        if g["points"] < -GAP_POINTS and g["sign_p"] < SIGNIFICANT_P:
            line += f"; {label} is what costs these answers: {g['baseline']} keeps them"
        elif g["points"] < -GAP_POINTS:
            line += (f"; chance alone changes this many answers this often: pair more samples (--samples, "
                     f"more --seed values) before putting it on {label}")
        notes.append(line)
    return notes


def _paired_line(g: dict, baseline: str) -> str:
    """One pairing row of ``against_dense`` / ``against_bf16`` as a line: "at 32k bf16 against
    ``baseline`` on the same 40 samples: 16 lost, 2 won (-35.0 points, sign test p 0.0013)"; the
    row's ``sign_p`` only where a sample changed."""
    p = f", sign test p {_p_text(g['sign_p'])}" if g["lost"] + g["won"] else ""
    return (f"at {_len(g['length'])} {g['profile']} against {baseline} on the same {g['samples']} "
            f"sample{'s' if g['samples'] != 1 else ''}: {g['lost']} lost, {g['won']} won ({g['points']:+.1f} points{p})")


def _p_text(p: float) -> str:
    """A p value with two significant digits: 1.0, 0.25, 0.031, 0.0013."""
    return "1.0" if p >= 1.0 else f"{p:.2g}"


def density_scope_notes(report: dict) -> list[str]:
    """One line when the sparse profiles differ in ``dense_layers``: each density column is over
    that profile's own sparse layers, so a profile with more dense layers may show a lower density
    and still compute more, e.g. "density is over each profile's own sparse layers (dense_layers:
    bf16 2, accurate 12): compare the work they do by TTFT". A set of layers is written as its ranges
    ("dl [0-1, 8-11]"). Empty otherwise."""
    layers = {p["name"]: dense_layers_text(from_data(p["dense_layers"])) for p in report.get("profiles", [])
              if p.get("attention") != "dense" and p.get("dense_layers") is not None}
    if len(set(layers.values())) < 2:
        return []
    listed = ", ".join(f"{name} {text}" for name, text in layers.items())
    return [f"density is over each profile's own sparse layers (dense_layers: {listed}): "
            "compare the work they do by TTFT"]


def missing_notes(report: dict) -> list[str]:
    """For an interrupted report, one line naming each profile that did not answer every sample
    (its ``missing`` entries), e.g. "interrupted (Ctrl-C), the table is partial: profile bf16
    answered 3 of 8 samples (its cells average those); profile fp8 answered none of its 8 samples
    (no cells)". Empty for a finished run."""
    if not report.get("interrupted"):
        return []
    parts = []
    for m in report.get("missing", []):
        if m["answered"] == 0:
            parts.append(f"profile {m['profile']} answered none of its {m['samples']} "
                         f"sample{'s' if m['samples'] != 1 else ''} (no cells)")
        else:
            parts.append(f"profile {m['profile']} answered {m['answered']} of {m['samples']} samples "
                         "(its cells average those)")
    if not parts:
        return ["interrupted after the last answer: the table is complete"]
    return ["interrupted (Ctrl-C), the table is partial: " + "; ".join(parts)]


def empty_notes(report: dict) -> list[str]:
    """One line per (length, profile) average with answers on which the engine generated no token
    (``empty_answers``), e.g. "at 128k 8 of 8 dense answers were empty (the engine generated no
    token): their score of 0 measures nothing". Empty when every answer has a token."""
    notes = []
    for a in report["averages"]:
        n = a.get("empty_answers", 0)
        if n:
            notes.append(f"at {_len(a['length'])} {n} of {a.get('samples', n)} {a['profile']} answers were empty "
                         "(the engine generated no token): their score of 0 measures nothing")
    return notes


def _longer_than(tokens: int) -> int:
    """The smallest whole-k length (tokens) whose prompts exceed ``tokens``: a prompt of --len N
    holds a little fewer than N tokens (short of it by less than one filler sentence, and by the
    answer budget near the context), so it keeps at least 512 tokens of margin: 4,096 -> 5,120."""
    return (tokens + 512) // 1024 * 1024 + 1024
