"""Reports: one JSON schema for ``fp ask --json``, ``--report FILE`` and the terminal summary.

``ask_report`` builds the dict; ``render_*`` draw it with rich on a stderr console; the heatmap
helpers draw per-layer x per-KV-head density in the terminal and as a PNG (matplotlib, Agg).

Schema ``fp.ask/1`` (all times in seconds unless the key says ms; ``fp profile --json``, schema
``fp.profile/1``, has the same ``ingestion`` block: ``ingestion_report``)::

    {
      "schema": "fp.ask/1", "fp_version": "0.1.0", "created": "2025-01-01T12:00:00+00:00",
      "question": "...", "answer": "...",
      "error": null,               # why no answer came, one line: "no readable document", "cannot load
                                   # the model: ...", a prompt that does not fit, "generation failed: ..."
                                   # (then "answer" and "summary" are null, "ingestion" has each
                                   # document's error: why it gave no text, an empty file included)
      "summary": {
        "prompt_tokens", "output_tokens", "ttft_s", "prefill_s", "decode_tokens_per_s",
        "decode_mode",           # how the decode steps ran: "cuda graph" or "eager"; null when no decode
                                 # step ran (a one-token answer) or the engine did not say
        "total_s",               # the engine's part: from when it took the request to the last answer
                                 # token (ttft_s + decode); not wall_s, the whole command
        "cached_tokens",         # prompt tokens served from the KV cache of an earlier request
        "wall_s",                # the whole command, from the start of the fp process (the OS's record) to
                                 # the answer's end; the process's exit after the summary is not in it
                                 # (fp chat: from reading the question to the end of its answer; the
                                 # first answer's also counts reading the documents and the engine start);
                                 # null when not measured
        "engine_start_s",        # part of wall_s spent loading/starting the engine, or waiting for a
                                 # resident engine that fp start was starting (0: it was running)
        "stages_s",              # wall_s split: {"read", "fit", "engine_start", "queued", "ttft", "decode",
                                 # "other"} (read: ingestion; fit: prompt building; queued: waiting in the
                                 # resident engine's queue behind other requests; other: the rest, process
                                 # start and imports included); null when wall_s is not measured
        "finish_reason", "engine", "model", "profile",
        "profile_source",        # the profile's YAML file when it is not a built-in one, else null
        "device",                # where the attention ran: "cpu", "cuda", or null (not said)
        "precision",             # attention precision that RAN: bf16/fp16/fp32, or "fp8 (sparse layers)" / "int8qk (sparse layers)"
        "precision_requested",   # the profile's precision (bf16 / fp8 / int8qk)
        "attention",
        "min_sparse_len",        # as run (tokens; null for dense): shorter prefill chunks run dense
        "sparse",                # the sparse settings as run, null for dense: every SparseConfig field
                                 # ("block_size", "sink_tokens", "window_tokens", "dense_tail_tokens",
                                 # "alpha", "mean_correction", "min_sparse_len", "threshold_max",
                                 # "block_score") after fitting to the context, "dense_layers", and
                                 # "min_sparse_len_requested" (the profile's; larger when capped)
        "sparse_note",           # null, or why min_sparse_len is lower than the profile's: "min_sparse_len
                                 # 8,192 capped to 4,096: half the 8,192-token context it runs at"
        "density": {"overall", "min", "median", "max", "per_layer": [...],
                    "over": "sparse layers" | "all layers",   # what "overall" averages
                    "sparse_layers": [...]},                  # layer indices that ran sparse
        # skipped FLOPs are over ALL layers (dense layers skip none):
        #   skipped_fraction = sum_l flops_l * (1 - density_l) / sum_l flops_l
        "density_per_layer_head": [[...], ...],   # rectangular [layer][kv_head]; null = not reported
        "density_note",          # null, or why the sparse layers kept every block: the prompt fits in
                                 # sink + local window + dense tail (always_kept_note)
        "attention_flops_dense", "attention_flops_skipped", "attention_flops_skipped_fraction",
        "index_ms", "attention_ms"   # stage times over the sparse layers (ms), when the engine timed them
      },
      "ingestion": {
        "documents": [{"name", "kind", "pages", "chars", "tokens", "skipped_pages", "empty_pages",
                       "scanned_pages", "glued_pages", "notes", "warnings", "error",
                       "from_cache",     # text from fp's document cache (fpcli.doccache)
                       "password_protected"}],   # a PDF that needs a user password
        "prompt": {"prompt_tokens", "context_length", "max_new_tokens", "budget",
                   "budget_note",   # null, or why the documents got little room (the answer reserve)
                   "question_room", # tokens of the budget a cut kept for any question (0: not cut, or cut for this one)
                   "reserved",      # tokens the engine keeps free beyond prompt and answer (SGLang: >= 2)
                   "doc_tokens",
                   "truncated", "cuts": [{"file", "tokens_total", "tokens_kept", "tokens_dropped",
                                          "where", "char_start", "char_end", "first_page", "last_page"}]}
      }
    }
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import stat
import statistics
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from flashprefill.dense_layers import DenseLayers, dense_layer_ids, dense_layers_text, from_data
from fpcli.console import note, warning

SCHEMA = "fp.ask/1"


def density_summary(per_layer: Sequence[float], overall: float | None = None,
                    sparse_layers: Sequence[int] | None = None) -> dict:
    """``{"overall", "min", "median", "max", "per_layer", "over", "sparse_layers"}``; ``None``
    values when unknown.

    ``overall`` is the engine's density over its sparse layers when ``sparse_layers`` is known
    (``over = "sparse layers"``), else the given value or the mean over all layers (``"all layers"``).
    min / median / max are over all layers (dense layers count as 1.0).
    """
    values = [float(v) for v in per_layer]
    sparse = [int(i) for i in (sparse_layers or [])]
    over = "sparse layers" if sparse else "all layers"
    if not values:
        return {"overall": overall, "min": None, "median": None, "max": None, "per_layer": [],
                "over": over, "sparse_layers": sparse}
    return {
        "overall": float(overall) if overall is not None else statistics.fmean(values),
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "per_layer": values,
        "over": over,
        "sparse_layers": sparse,
    }


def density_grid(per_layer_head: Sequence[Sequence[float]], per_layer: Sequence[float] = (),
                 sparse_layers: Sequence[int] | None = None) -> list[list[float | None]]:
    """A rectangular ``[layer][kv_head]`` density grid from the engine's rows, which may be ragged.

    Engines report a row of ``Hkv`` values for a sparse layer but may report an empty row or a
    single value for a dense one (SGLang's statistics: ``[]``). ``Hkv`` is the longest row. A
    dense layer (not in ``sparse_layers`` when that is given, else a ``per_layer`` density of
    1.0) whose row is empty or all 1.0 gets ``Hkv`` cells of 1.0; a full row is kept; any other
    row is padded with ``None`` (not reported; a single value, which is no per-head data, becomes
    all ``None``). Layers in ``per_layer`` beyond the rows count as empty rows. With no per-head
    value at all, the grid is one column: ``per_layer``.

    >>> density_grid([[1.0], [], [0.5, 0.25]], [1.0, 1.0, 0.375], sparse_layers=[2])
    [[1.0, 1.0], [1.0, 1.0], [0.5, 0.25]]
    >>> density_grid([[0.5], [0.5, 0.25]], [0.5, 0.375], sparse_layers=[0, 1])
    [[None, None], [0.5, 0.25]]
    """
    rows = [[float(v) for v in r] for r in per_layer_head]
    layers = max(len(rows), len(per_layer))
    heads = max((len(r) for r in rows), default=0)
    if heads == 0:
        return [[float(v)] for v in per_layer]
    sparse = set(int(i) for i in sparse_layers) if sparse_layers else None
    grid: list[list[float | None]] = []
    for i in range(layers):
        row = rows[i] if i < len(rows) else []
        if len(row) == heads:
            grid.append(list(row))
            continue
        if sparse is not None:
            dense = i not in sparse
        else:
            dense = i < len(per_layer) and float(per_layer[i]) >= 1.0
        if dense and all(v >= 1.0 for v in row):
            grid.append([1.0] * heads)
        elif len(row) == 1:
            grid.append([None] * heads)
        else:
            grid.append(list(row) + [None] * (heads - len(row)))
    return grid


def layer_ranges(layers: Sequence[int]) -> str:
    """[2, 3, 4, 7] -> 'layers 2-4, 7'; [5] -> 'layer 5'."""
    out: list[str] = []
    for i in sorted(set(layers)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    text = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)
    return ("layer " if len(layers) == 1 else "layers ") + text


def ask_report(result, question: str, docs: Sequence, prompt, profile, context: dict | None = None,
               start_phases: dict | None = None, *, wall_s: float | None = None,
               engine_start_s: float | None = None, read_s: float | None = None,
               fit_s: float | None = None, context_length: int | None = None) -> dict:
    """The ``fp.ask/1`` report of one answer.

    Args:
        result: ``fpcli.engine.base.GenerationResult``.
        question: the user's question.
        docs: ``fpcli.ingest.Document`` list (all inputs, failed ones included).
        prompt: ``fpcli.prompt.Prompt`` that was sent.
        profile: ``fpcli.profiles.Profile`` in use, as loaded (``min_sparse_len`` not yet fitted).
        context: the engine's context (``ContextPlan.to_dict``: ``native_context``, ``context``,
            ``rope_scaling``), in tokens; ``None`` when the engine does not say.
        start_phases: the engine's start-up seconds per phase (``engine.start_phases``).
        wall_s: seconds the whole command took (``fpcli.clock.process_age_s``), or ``None``.
        engine_start_s: seconds of ``wall_s`` spent starting the engine (0.0 when it was running).
        read_s, fit_s: seconds of ``wall_s`` spent reading the documents and building the prompt
            (``None``: not measured, counted in ``other``).
        context_length: the engine's context in tokens (``engine.context_length``); ``profile``'s
            ``min_sparse_len`` is fitted as the engines fit it, to the smaller of it and
            ``context["native_context"]`` (``fpcli.profiles.threshold_context``); ``None``: as is.
    """
    from fpcli.profiles import sparse_cap_note, sparse_settings

    stats = result.stats
    native = (context or {}).get("native_context")  # the engines fit min_sparse_len to the smaller
    sparse = sparse_settings(profile, context_length, native)
    dense = float(stats.attention_flops_dense or 0.0)
    skipped = float(stats.attention_flops_skipped or 0.0)
    summary = {
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "ttft_s": result.ttft_s,
        "prefill_s": result.prefill_s,
        "total_s": result.total_s,
        "decode_tokens_per_s": result.decode_tokens_per_s,
        "decode_mode": getattr(result, "decode_mode", None),
        "cached_tokens": int(result.cached_tokens),
        "wall_s": wall_s,
        "engine_start_s": engine_start_s,
        "stages_s": stages(wall_s, result.ttft_s, result.total_s, read_s=read_s, fit_s=fit_s,
                           engine_start_s=engine_start_s, queued_s=getattr(result, "queued_s", 0.0)),
        "finish_reason": result.finish_reason,
        "engine": result.engine,
        "device": getattr(result, "device", None),
        "model": result.model,
        "native_context": (context or {}).get("native_context"),
        "context": (context or {}).get("context"),
        "rope_scaling": (context or {}).get("rope_scaling"),
        "engine_start_phases": dict(start_phases) if start_phases else None,
        "profile": result.profile or profile.name,
        "profile_source": _profile_file(profile),
        "precision": getattr(result, "precision", None) or profile.precision,
        "precision_requested": profile.precision,
        "attention": profile.attention,
        "min_sparse_len": None if sparse is None else sparse["min_sparse_len"],
        "sparse": sparse,
        "sparse_note": sparse_cap_note(profile, context_length, native),
        "density": density_summary(stats.density_per_layer, stats.density, getattr(stats, "sparse_layers", None)),
        "density_per_layer_head": density_grid(stats.density_per_layer_head, stats.density_per_layer,
                                               getattr(stats, "sparse_layers", None)),
        "density_note": None,  # always_kept_note, below
        "attention_flops_dense": dense,
        "attention_flops_skipped": skipped,
        "attention_flops_skipped_fraction": skipped / dense if dense > 0 else 0.0,
        "index_ms": stats.index_ms,
        "attention_ms": stats.attention_ms,
    }
    summary["density_note"] = always_kept_note(result.prompt_tokens, sparse, summary["density"])
    return _ask_envelope(question, result.text, None, summary, ingestion_report(docs, prompt))


def ingestion_report(docs: Sequence, prompt) -> dict:
    """The ``ingestion`` block of the reports (``fp.ask/1``; ``fp.profile/1`` has the same): what
    was read (one row per document, ``Document.to_dict`` plus ``tokens``: its tokens in the prompt)
    and the prompt it made, with what was cut to fit the context (``Prompt.to_dict``: ``budget``,
    ``truncated``, ``cuts``, ...).

    Args:
        docs: ``fpcli.ingest.Document`` list (all inputs, failed ones included).
        prompt: the ``fpcli.prompt.Prompt`` that was sent, or ``None`` (none was built: ``tokens``
            and ``prompt`` are then ``None``).
    """
    documents = []
    for d in docs:
        row = d.to_dict()
        row["tokens"] = prompt.doc_tokens.get(d.name) if prompt is not None else None
        documents.append(row)
    return {"documents": documents, "prompt": prompt.to_dict() if prompt is not None else None}


def _ask_envelope(question: str, answer: str | None, error: str | None, summary: dict | None,
                  ingestion: dict) -> dict:
    """The ``fp.ask/1`` object around an answered or a failed question."""
    from fpcli import __version__

    return {
        "schema": SCHEMA,
        "fp_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "question": question,
        "answer": answer,
        "error": error,
        "summary": summary,
        "ingestion": ingestion,
    }


def failed_report(question: str, docs: Sequence, error: str) -> dict:
    """The ``fp.ask/1`` report of a question that got no answer (no readable document, the model
    did not load, the documents did not fit, generation failed): ``answer``, ``summary`` and
    ``ingestion.prompt`` are ``None``, ``error`` says why (one line), ``ingestion.documents`` has
    each document's row, whose ``error`` says why a document gave no text (an empty or blank file
    included: its warning, e.g. ``"a.txt: empty"``), else ``None``.

    Args:
        question: the user's question.
        docs: ``fpcli.ingest.Document`` list (all inputs).
        error: why there is no answer, one line.
    """
    ingestion = ingestion_report(docs, None)
    for d, row in zip(docs, ingestion["documents"]):
        if row.get("error") is None and not d.text.strip():  # read, but nothing in it: say why here too
            row["error"] = d.warnings[-1] if d.warnings else "no text"
    return _ask_envelope(question, None, error, None, ingestion)


def stages(wall_s: float | None, ttft_s: float, total_s: float, *, read_s: float | None = None,
           fit_s: float | None = None, engine_start_s: float | None = None,
           queued_s: float | None = None) -> dict | None:
    """Where the wall time of one answer went, in seconds: ``{"read", "fit", "engine_start",
    "queued", "ttft", "decode", "other"}``; ``queued``: waiting in the resident engine's queue
    (``GenerationResult.queued_s``); ``other`` = ``wall_s`` less the rest (process start, imports,
    connecting, output), never negative. ``None`` when ``wall_s`` is ``None``.

    Example: wall 9.0, read 1.0, fit 0.5, engine start 5.0, TTFT 0.5, generation 2.0 (decode
    1.5): other = 9.0 - 1.0 - 0.5 - 5.0 - 0.5 - 1.5 = 0.5.
    """
    if wall_s is None:
        return None
    parts = {"read": float(read_s or 0.0), "fit": float(fit_s or 0.0), "engine_start": float(engine_start_s or 0.0),
             "queued": float(queued_s or 0.0), "ttft": float(ttft_s), "decode": max(0.0, float(total_s) - float(ttft_s))}
    parts["other"] = max(0.0, float(wall_s) - sum(parts.values()))
    return parts


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)


def save_report(path: str | Path, report: dict) -> None:
    """Write ``report`` as JSON to ``path``.

    A new file, or an existing regular file with one link that the user may write, is written
    atomically: a temporary file in the same folder (a symlink's target folder), given the old
    file's mode, renamed over it, so it is either the whole report or left as it was, even when
    Ctrl-C or a full disk stops the write. Anything else is written in place as before: a device or
    pipe (``/dev/stdout``, ``>(jq .)``), a file with other hard links, a read-only file (the write
    fails as it should), or a folder where no temporary file can be made.

    Raises:
        OSError: the report cannot be written (the temporary file, if any, is removed).
    """
    path = Path(path)
    text = dumps(report) + "\n"
    try:
        st = os.stat(path)                      # follows a symlink to its target
    except OSError:
        st = None                               # none yet (or, e.g., a name too long: the write below says why)
    in_place = st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1
                                   or not os.access(path, os.W_OK))
    if in_place:
        path.write_text(text, encoding="utf-8")
        return
    target = Path(os.path.realpath(path))
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for a new file
    except OSError:
        path.write_text(text, encoding="utf-8")  # no temporary file here (read-only folder): as before
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))  # keep the old file's mode
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- terminal rendering ---------------------------------------------------------------------------


def format_flops(x: float | None) -> str:
    """1.2e12 -> '1.20 TFLOP'."""
    if not x:
        return "0"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} FLOP"


def _fmt(x: Any, spec: str = ".3f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


FINISH_WORDS = {"length": "length: stopped at --max-new-tokens"}
"""How the summary says a ``finish_reason`` (the JSON keeps the engine's word)."""


def render_summary(console: Console, report: dict) -> None:
    """The summary table of an ``fp.ask/1`` report (stderr console)."""
    s = report["summary"]
    d = s["density"]
    t = _SummaryRows()
    t.add_row("prompt tokens", prompt_tokens_text(s))
    t.add_row("answer tokens", f"{s['output_tokens']:,} ({FINISH_WORDS.get(s['finish_reason'], s['finish_reason'])})")
    t.add_row("TTFT", f"{s['ttft_s']:.3f} s (prefill {s['prefill_s']:.3f} s)")
    t.add_row(*time_row(s))
    from fpcli.engine.base import DECODE_EAGER, DECODE_GRAPH

    mode = {DECODE_GRAPH: " (CUDA graph)", DECODE_EAGER: " (eager)"}.get(s.get("decode_mode") or "", "")
    t.add_row("decode", f"{s['decode_tokens_per_s']:.1f} tokens/s{mode}")
    t.add_row("attention density", density_line(d, s.get("attention"), s.get("prompt_tokens"),
                                                s.get("min_sparse_len"), s.get("cached_tokens") or 0,
                                                (s.get("sparse") or {}).get("dense_layers")))
    dense_layers = len(d["per_layer"]) - len(d.get("sparse_layers") or [])
    scope = "all layers" + (
        (f"; the {dense_layers} dense layers skip none" if dense_layers > 1 else "; the dense layer skips none")
        if d.get("sparse_layers") and dense_layers > 0 else ""
    )
    t.add_row("attention FLOPs skipped", flops_text(s, scope))
    if s.get("index_ms") is not None and s.get("attention_ms") is not None:
        t.add_row("index / attention", f"{s['index_ms']:.1f} ms / {s['attention_ms']:.1f} ms")
    elif s.get("attention_ms") is not None:
        t.add_row("attention", f"{s['attention_ms']:.1f} ms (no index stage)")
    elif s.get("index_ms") is not None:
        t.add_row("index", f"{s['index_ms']:.1f} ms")
    t.add_row("engine", s["engine"])
    t.add_row("model", s["model"])
    precision = s["precision"]
    requested = s.get("precision_requested")
    from fpcli.engine.base import eight_bit, precision_family, precision_label

    if requested and requested != precision_family(precision):
        why = (f"{precision_label(requested)} runs in sparse layers only and none ran sparse" if eight_bit(requested)
               else "ran at the model's dtype")
        precision = f"{precision}; {requested} requested, {why}"
    source = f"{Path(s['profile_source']).name}; " if s.get("profile_source") else ""
    t.add_row("profile", f"{s['profile']} ({source}{s['attention']}, {precision}{profile_differences(s)})")
    t.print(console, title="fp ask")
    if s.get("sparse_note"):
        note(console, s["sparse_note"])
    if s.get("density_note"):
        note(console, s["density_note"])


def profile_differences(s: dict) -> str:
    """The summary's sparse settings (``s["sparse"]``) that differ from the built-in ``bf16``
    profile's, as "; block_score mass, alpha 0.1" ("" when none differ, for a dense run, or a
    report without them)."""
    from fpcli.profiles import load_profile, sparse_differences

    found = sparse_differences(s.get("sparse"), load_profile("bf16"))
    return "; " + ", ".join(found) if found else ""


def flops_text(s: dict, scope: str) -> str:
    """The 'attention FLOPs skipped' row; when the engine counted no prefill attention because the
    prompt came from the KV cache, say that instead of '0 of 0'. On the CPU (``device``) the sparse
    path is the PyTorch reference, which computes every block: skipped FLOPs save no time there.
    When part of the prompt came from the KV cache, the counts cover only the prefilled tokens and
    the row says how many were cached (not counted)."""
    cached = s.get("cached_tokens") or 0
    if not s["attention_flops_dense"] and cached:
        return (f"none counted: {cached:,} of {s['prompt_tokens']:,} prompt tokens came from the KV cache "
                "(their attention was computed by an earlier request)")
    cpu = " (CPU reference: no time saved)" if s.get("device") == "cpu" and s["attention_flops_skipped"] else ""
    not_counted = (f"; {cached:,} of {s['prompt_tokens']:,} prompt tokens came from the KV cache, not counted"
                   if cached else "")
    return (f"{format_flops(s['attention_flops_skipped'])} of {format_flops(s['attention_flops_dense'])} dense-equivalent "
            f"({s['attention_flops_skipped_fraction']:.1%}, {scope}{not_counted}){cpu}")


def prompt_tokens_text(s: dict) -> str:
    """'813' or '813 (780 cached)' from a report summary."""
    cached = s.get("cached_tokens") or 0
    return f"{s['prompt_tokens']:,}" + (f" ({cached:,} cached)" if cached else "")


def time_row(s: dict) -> tuple[str, str]:
    """The summary's time row: ``total time`` is the whole command (``wall_s``) with its parts
    (reading, prompt fitting, engine start, time queued in the resident engine, TTFT, decode, and
    ``other``: the rest, mostly the process's start and imports); without a measured ``wall_s`` the row is the generation's own time, labelled as such, never a total."""
    gen = s["total_s"]
    decode = max(0.0, gen - s["ttft_s"])
    if s.get("wall_s") is None:
        return "generation time", f"{gen:.3f} s (TTFT {s['ttft_s']:.3f} s + decode {decode:.3f} s)"
    st = s.get("stages_s") or stages(s["wall_s"], s["ttft_s"], gen, engine_start_s=s.get("engine_start_s"))
    measured = [("read", "read"), ("fit", "fit")]
    head = "".join(f"{label} {st[key]:.3f} s, " for key, label in measured if st.get(key))
    queued = f"queued {st['queued']:.3f} s, " if st.get("queued") else ""
    return "total time", (f"{s['wall_s']:.3f} s ({head}engine start {st['engine_start']:.3f} s, {queued}TTFT {st['ttft']:.3f} s, "
                          f"decode {st['decode']:.3f} s, other {st['other']:.3f} s)")


def summary_line(report: dict) -> str:
    """One line per answer (``fp chat``): 'prompt tokens 813 (780 cached), TTFT 0.412 s, decode
    12.3 tokens/s, answer 30 tokens (stop), density 100.0%, wall time 2.950 s' (``wall_s``; the
    first answer's counts the chat's set-up: reading the documents and starting the engine)."""
    s = report["summary"]
    d = s["density"]["overall"]
    density = "n/a" if d is None else f"{d:.1%}" + ("" if s["density"].get("sparse_layers") else " (dense)")
    wall = "" if s.get("wall_s") is None else f", wall time {s['wall_s']:.3f} s"
    return (f"prompt tokens {prompt_tokens_text(s)}, TTFT {s['ttft_s']:.3f} s, decode {s['decode_tokens_per_s']:.1f} "
            f"tokens/s, answer {s['output_tokens']:,} tokens ({s['finish_reason']}), density {density}{wall}")


class _SummaryRows:
    """Label / value rows: a rich table on a terminal; plain ``label  value`` lines otherwise
    (a log or a pipe: no wrapping, no padding, one row per line, greppable)."""

    LABEL_WIDTH = 25

    def __init__(self) -> None:
        self.rows: list[tuple[str, str]] = []

    def add_row(self, label: str, value: str) -> None:
        self.rows.append((label, value))

    def print(self, console: Console, title: str) -> None:
        if not console.is_terminal:
            console.print(Text(title), soft_wrap=True)
            for label, value in self.rows:
                console.print(Text(f"{label:<{self.LABEL_WIDTH - 1}} {value}"), soft_wrap=True)
            return
        t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        for label, value in self.rows:
            t.add_row(label, value)
        console.print(t)


def density_line(d: dict, attention: str | None = None, prompt_tokens: int | None = None,
                 min_sparse_len: int | None = None, cached_tokens: int = 0,
                 dense_layers: DenseLayers | list[int] | None = None) -> str:
    """'89.5% over sparse layers (layers 2-29); per layer min ... / median ... / max ... (all 30 layers)'.

    When no layer ran sparse because the tokens prefilled are fewer than the profile's
    ``min_sparse_len`` (tokens), the line says so: that is the usual reason, and a user expecting
    sparsity needs it. The tokens prefilled are ``prompt_tokens`` less ``cached_tokens`` (served
    from the KV cache of an earlier request: a follow-up prefills only the new ones). A profile
    whose ``dense_layers`` is at least the model's layer count (``len(d["per_layer"])``) never runs
    sparse, at any length: the line says that first ("dense_layers 40 >= the model's 30 layers"; for
    a set of layers, a list from JSON or a tuple: "dense_layers [0-29] cover all the model's 30
    layers").
    """
    if d.get("overall") is None:
        return "n/a (not reported by this engine)"
    if d.get("sparse_layers"):
        head = f"{d['overall']:.1%} over sparse layers ({layer_ranges(d['sparse_layers'])})"
    elif d["per_layer"] and attention == "dense":
        head = f"{d['overall']:.1%} (dense attention: every layer)"
    elif d["per_layer"] and all(v >= 1.0 for v in d["per_layer"]):
        why = ""
        cached = max(0, int(cached_tokens or 0))
        n_layers = len(d["per_layer"])
        layers = None if dense_layers is None else from_data(dense_layers)
        if isinstance(layers, int) and layers >= n_layers:
            why = f": dense_layers {layers:,} >= the model's {n_layers:,} layers"
        elif layers is not None and len(dense_layer_ids(layers, n_layers)) == n_layers:
            why = f": dense_layers {dense_layers_text(layers)} cover all the model's {n_layers:,} layers"
        elif prompt_tokens is not None and min_sparse_len and prompt_tokens - cached < min_sparse_len:
            if cached:
                why = f": {prompt_tokens - cached:,} new tokens after {cached:,} cached < min_sparse_len {min_sparse_len:,}"
            else:
                why = f": {prompt_tokens:,} prompt tokens < min_sparse_len {min_sparse_len:,}"
        head = f"{d['overall']:.1%} (no layer ran sparse{why})"
    else:
        head = f"{d['overall']:.1%} over all layers"
    if not d["per_layer"]:
        return head + " (no per-layer data)"
    n = len(d["per_layer"])
    return head + f"; per layer min {d['min']:.1%} / median {d['median']:.1%} / max {d['max']:.1%} (all {n} layers)"


def always_kept_note(prompt_tokens: int | None, sparse: dict | None, density: dict) -> str | None:
    """Why the sparse layers kept every block (density 100%), when that is because the prompt fits
    in what every query keeps anyway: "every block was kept: the 93-token prompt fits in sink 512 +
    local window 1,024 + dense tail 256 = 1,792 tokens, which the sparse layers always keep (nothing
    to prune)"; else ``None``.

    A query row keeps the blocks of the first ``sink_tokens`` positions and of its last
    ``window_tokens``, and the last ``dense_tail_tokens`` query rows keep all (``docs/method.md``
    section 3.5). A row before the dense tail is at position ``t < L - tail``, so its window starts
    at ``t - window + 1 < L - tail - window + 1``: at most ``sink`` when ``L <= sink + window +
    tail``, leaving no block between the sink and the window. ``L`` is every token the prompt
    attends to, those from the KV cache included (they shift the window).

    Args:
        prompt_tokens: the prompt's tokens (``GenerationResult.prompt_tokens``).
        sparse: the sparse settings as run (``fpcli.profiles.sparse_settings``); ``None``: dense.
        density: ``density_summary``'s dict; the note needs sparse layers at 100%.
    """
    if sparse is None or prompt_tokens is None or not density.get("sparse_layers"):
        return None
    if density.get("overall") is None or density["overall"] < 1.0:
        return None
    sink, window, tail = (int(sparse[k]) for k in ("sink_tokens", "window_tokens", "dense_tail_tokens"))
    kept = sink + window + tail
    if prompt_tokens > kept:
        return None
    return (f"every block was kept: the {prompt_tokens:,}-token prompt fits in sink {sink:,} + local window "
            f"{window:,} + dense tail {tail:,} = {kept:,} tokens, which the sparse layers always keep "
            "(nothing to prune)")


def render_ingestion(console: Console, docs: Sequence) -> None:
    """Notes, warnings and the reason a file was skipped, of every document: one ``fp: note:`` /
    ``fp: warning:`` line each (``fpcli.console``)."""
    for d in docs:
        if d.error:
            warning(console, f"skipped {d.error}")  # the command goes on with the other files
        for n in getattr(d, "notes", []):
            note(console, n)
        for w in d.warnings:
            warning(console, w)


def render_cuts(console: Console, prompt, turns_reserve: int = 0) -> None:
    """Say what was cut to fit the context (never silently), and the size of ``prompt`` (for ``fp ask``,
    the tokens it prefills; the budget it leaves unused is room for a longer question): a note
    and one line per cut, or, on a quiet console (``-q``: no notes), one warning line naming the
    cuts.

    Args:
        turns_reserve: tokens of ``prompt.max_new_tokens`` that are not the answer's but kept for
            the later turns of ``fp chat`` (named apart from the answer's); 0 for ``fp ask``.
    """
    if not prompt.cuts:
        return
    if not getattr(console, "notes", True):  # -q: no notes, but a cut is still said, on one line
        warning(console, f"the documents were cut to fit the prompt budget of {prompt.budget:,} tokens: "
                         + "; ".join(c.describe() for c in prompt.cuts))
        if prompt.budget_note:
            warning(console, prompt.budget_note)
        return
    turns_reserve = min(max(0, int(turns_reserve)), prompt.max_new_tokens)
    answer = f"{prompt.max_new_tokens - turns_reserve:,} for the answer"
    if turns_reserve:
        answer += f" - {turns_reserve:,} kept for the later turns"
    kept = f" - {prompt.reserved} kept by the engine" if prompt.reserved else ""
    unused = prompt.budget - prompt.tokens
    # the fit ignores the question (up to question_room tokens): the same cut, and a reusable KV cache,
    # for every such question; the budget it leaves unused is that room less this question
    slack = (f", {unused:,} left unused so that any question up to {prompt.question_room:,} tokens gets the same cut"
             if prompt.question_room and unused > 0 else "")
    note(console, f"the documents exceed the prompt budget of {prompt.budget:,} tokens "
                  f"(context {prompt.context_length:,} - {answer}{kept}); "
                  f"the prompt is fitted to {prompt.tokens:,} tokens{slack}; cut:")
    for c in prompt.cuts:
        console.print(Text(f"  {c.describe()}", style="yellow"))
    if prompt.budget_note:
        warning(console, prompt.budget_note)


# -- density heatmaps ----------------------------------------------------------------------------

_RAMP = ["#440154", "#46327e", "#365c8d", "#277f8e", "#1fa187", "#4ac16d", "#a0da39", "#fde725"]  # viridis, as the PNG


def density_color(x: float) -> str:
    """A colour for density ``x`` in [0, 1] (dark purple = sparse, yellow = dense)."""
    x = min(1.0, max(0.0, float(x)))
    return _RAMP[min(len(_RAMP) - 1, int(x * len(_RAMP)))]


def heatmap_table(per_layer_head: Sequence[Sequence[float | None]]) -> Table:
    """A rich table: one row per layer, one coloured cell per KV head (with its density in percent,
    readable without colours too), the layer mean (over the reported heads) at the end. ``None``
    cells (not reported) and short rows print as ``--``; see ``density_grid``."""
    heads = max((len(r) for r in per_layer_head), default=0)
    t = Table(box=None, padding=(0, 1, 0, 0), show_edge=False)
    t.add_column("layer", justify="right", style="bold")
    t.add_column(" ")
    for h in range(heads):
        t.add_column(str(h) if heads <= 16 or h % 4 == 0 else "", justify="center", min_width=2)
    t.add_column(" mean", justify="right")
    for layer, row in enumerate(per_layer_head):
        cells = [Text("--", style="dim") if v is None else
                 Text(density_cell(v), style=f"{_ink(v)} on {density_color(v)}") for v in row]
        known = [v for v in row if v is not None]
        mean = f" {sum(known) / len(known):.1%}" if known else " n/a"
        t.add_row(str(layer), " ", *cells, *[Text("--", style="dim")] * (heads - len(row)), mean)
    return t


def density_cell(x: float) -> str:
    """A heatmap cell's two characters for density ``x`` in [0, 1]: ``**`` when dense (every
    visible block kept, ``x >= 1``), else the percent, rounded, at most ``99`` (over 98.5%, under 100%)."""
    if x >= 1.0:
        return "**"
    return f"{min(99, round(x * 100)):2d}"


def _ink(x: float) -> str:
    """Readable text colour on ``density_color(x)``."""
    return "black" if x >= 0.6 else "white"


def heatmap_legend(color: bool = True) -> Text:
    """What a cell says: the density in percent (``**`` = 100%, ``99`` = over 98.5%, under 100%),
    then the colour scale: with ``color``, a swatch per step between ``0%`` and ``100%``; without
    (a pipe, a log, ``NO_COLOR``: the swatches would print as blanks), the scale in words, e.g.
    "colour scale on a terminal: 8 steps of 12.5%, 0% dark purple to 100% yellow"."""
    legend = Text("cells: density in % (** = 100%, dense; 99 = over 98.5%, under 100%); ")
    if not color:
        step = 100 / len(_RAMP)
        return legend.append(f"colour scale on a terminal: {len(_RAMP)} steps of {step:g}%, 0% dark purple "
                             "to 100% yellow (as the PNG)")
    legend.append("scale: ")
    for i, swatch in enumerate(_RAMP):
        legend.append("  ", style=f"on {swatch}")
        if i in (0, len(_RAMP) - 1):
            legend.append(" 0% " if i == 0 else " 100%")
    return legend


DENSITY_SCALE = ("density", 1.0, "FlashPrefill attention density (selected / visible key blocks)")
def error_scale(precision: str = "fp8") -> tuple[str, None, str]:
    """``heatmap_figure``'s scale for the 8-bit ``precision``'s (``fp8``, ``int8qk``) output error
    against BF16 (relative L2, vmax the data's max)."""
    from fpcli.engine.base import precision_label

    label = precision_label(precision)
    return (f"relative L2 error, {label} vs BF16", None, f"{label}-vs-BF16 attention output error (relative L2)")


FP8_ERROR_SCALE = error_scale("fp8")


def heatmap_figure(per_layer_head: Sequence[Sequence[float | None]], title: str = "",
                   scale: tuple[str, float | None, str] = DENSITY_SCALE):
    """A per layer x KV head heatmap as a matplotlib ``Figure`` (Agg): layers down, KV heads across,
    ``None`` cells and short rows (not reported) drawn light grey. The title is wrapped to the
    figure's width so that no part of it falls outside the image. ``scale``: ``(colour bar label,
    vmax or None for the data's max, default title)``: ``DENSITY_SCALE`` (0-1) or
    ``error_scale(precision)`` (``FP8_ERROR_SCALE``).

    Raises:
        ValueError: ``per_layer_head`` has no cell.
    """
    import textwrap

    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    layers = len(per_layer_head)
    heads = max((len(r) for r in per_layer_head), default=0)
    if layers == 0 or heads == 0:
        raise ValueError(f"per_layer_head: expected at least one layer and one head, got {layers} x {heads}")
    data = np.full((layers, heads), np.nan)
    for i, row in enumerate(per_layer_head):
        for h, v in enumerate(row):
            if v is not None:
                data[i, h] = float(v)
    width = max(4.0, 1.2 + 0.35 * heads)
    fontsize = 9
    fig, ax = plt.subplots(figsize=(width, max(3.0, 1.0 + 0.22 * layers)), dpi=120)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")  # None cells: light grey
    label, vmax, default_title = scale
    if vmax is None:
        finite = data[np.isfinite(data)]
        vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    im = ax.imshow(np.ma.masked_invalid(data), vmin=0.0, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(0, layers, max(1, layers // 16)))
    # an average character is ~0.6 em wide; keep the title within ~90% of the figure's width
    chars = max(20, int(0.9 * width * 72 / (0.6 * fontsize)))
    text = title or default_title
    ax.set_title(textwrap.fill(text, chars), fontsize=fontsize)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    return fig


def write_heatmap_png(path: str | Path, per_layer_head: Sequence[Sequence[float | None]], title: str = "",
                      scale: tuple[str, float | None, str] = DENSITY_SCALE) -> Path:
    """Save ``heatmap_figure(per_layer_head, title, scale)`` as a PNG at ``path``.

    Raises:
        ValueError: no cell to draw. OSError: ``path`` cannot be written.
    """
    import matplotlib.pyplot as plt

    fig = heatmap_figure(per_layer_head, title, scale)
    path = Path(path)
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def _profile_file(profile) -> str | None:
    from fpcli.profiles import Profile, profile_file

    return profile_file(profile) if isinstance(profile, Profile) else None
