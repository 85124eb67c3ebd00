"""``fp profile FILE [QUESTION]``: one prefill, then its attention density per layer x KV head."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fpcli.commands import (MODEL_HELP, PROFILE_HELP, FpCommand, check_model_or_exit, check_output_path_or_exit, context_or_exit,
                            context_source,
                            fail, is_file, load_profile_or_exit, looks_like_question, obtain_engine,
                            render_answered_by, say_context,
                            stderr_console, warn_precision)
from fpcli.commands.ask import EngineChoice

app = typer.Typer()

DEFAULT_QUESTION = "Summarize this document."


@app.command("profile", cls=FpCommand)
def profile_cmd(
    file: Annotated[str, typer.Argument(metavar="FILE", help="PDF, HTML, .txt or .md file; '-' reads standard input.", show_default=False)],
    question: Annotated[str, typer.Argument(metavar="QUESTION", help="Question appended to the document (it shapes the prefill).")] = DEFAULT_QUESTION,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 attention in the sparse layers; also report the FP8-vs-BF16 output error per layer and KV head (the engine runs both on the same inputs).")] = False,
    int8qk: Annotated[bool, typer.Option("--int8qk", help="int8qk attention in the sparse layers (int8 Q and K, FP8 P and V); also report the int8qk-vs-BF16 output error, as --fp8 does for FP8.")] = False,
    png: Annotated[Optional[Path], typer.Option("--png", help="Where to write the heatmap PNG. Default: <FILE stem>.density.png in the current directory.", dir_okay=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    context: Annotated[Optional[str], typer.Option("--context", "-c", help="Context in tokens (e.g. 128k): a cap within the model's own context, YaRN beyond it (up to 8x).", show_default=False)] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help=PROFILE_HELP)] = "bf16",
    engine: Annotated[EngineChoice, typer.Option("--engine", help="auto: the resident engine (fp start, SGLang or transformers) when one answers with the same model and profile, else the transformers engine for this one prompt in-process (on the CUDA GPU when there is one).")] = EngineChoice.auto,
    password: Annotated[Optional[str], typer.Option("--password", help="Password of an encrypted PDF.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the statistics as JSON on stdout.")] = False,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the model in this process even when a resident engine (fp start) runs.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show other libraries' log lines, warnings and progress bars.")] = False,
) -> None:
    """Show the attention density per layer and KV head of one prefill of FILE.

    Prints a heatmap in the terminal, writes it as a PNG, shows index vs attention time per sparse layer (with a note when the first sparse layer carried a one-time cost such as kernel compilation; the headline share then leaves it out), and with --fp8 the FP8-vs-BF16 output error (relative L2) per layer and KV head, as a table and a second PNG (<FILE stem>.fp8.png beside the heatmap; --int8qk: the same for int8qk, <FILE stem>.int8qk.png).
    """
    from fpcli.logs import third_party_output

    if fp8 and int8qk:
        fail("--fp8 and --int8qk: give one (each compares its precision with BF16; fp eval --profiles "
             "P,P+fp8,P+int8qk runs both)", code=2)
    compared = "int8qk" if int8qk else ("fp8" if fp8 else None)
    with third_party_output(verbose):
        _profile(file, question, compared, png, model, profile, engine, password, json_out, verbose, context, no_server)


def _profile(file, question, compared, png, model, profile, engine, password, json_out, verbose, context,
             no_server) -> None:
    """``compared``: the 8-bit precision (``fp8``, ``int8qk``) run and compared with BF16, or ``None``."""
    from fpcli.console import print_table, stdout_console, warning
    from fpcli.ingest import check_paths, ingest
    from fpcli.prompt import NoRoomError, PromptError, build_prompt
    from fpcli.report import (always_kept_note, density_grid, density_line, density_summary, heatmap_legend,
                              heatmap_table, ingestion_report, render_ingestion, write_heatmap_png)

    err = stderr_console()
    problems = check_paths([file])
    if problems:
        fail(problems[0], code=2)
    if question != "-" and is_file(question) and not looks_like_question(question):
        fail(f"fp profile reads one FILE; the second argument {question} is a file, not a QUESTION "
             f"(fp profile FILE [QUESTION])", code=2)
    prof = load_profile_or_exit(profile, precision=compared)
    check_model_or_exit(model)
    prof = context_or_exit(context, prof, model, engine.value, one_request=True)
    if png is not None:
        check_output_path_or_exit("--png", png)
    from fpcli.doccache import DiskCache, default_config, fit_cache_for

    cache_config = default_config()  # a repeat reads neither the PDF nor the tokens again
    docs = ingest([file], password=password, cache=DiskCache(cache_config, "documents"))
    render_ingestion(err, docs)
    if not docs[0].ok or not docs[0].text.strip():
        fail("no readable document (see the reason above)")  # the reason was printed once, above

    from fpcli.engine.context import ContextError

    try:
        eng = obtain_engine(engine.value, model, prof, err, no_server, err, verbose=verbose, timing=True,
                            compare_fp8=compared is not None, one_request=True)
    except typer.Exit:
        raise
    except ContextError as exc:
        fail(f"{context_source(prof, context)}: {exc}", code=2)
    except Exception as exc:  # noqa: BLE001
        fail(f"cannot load the model: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")
    context_info = say_context(err, eng) or {}
    warn_precision(err, prof, eng)
    loaded, prof = prof, prof.fit_to_context(eng.context_length)  # the sparse threshold the engine runs (reports)
    with eng:
        try:
            prompt = build_prompt(docs, question, eng, max_new_tokens=1, context_length=prof.engine.context_length,
                                  fit_cache=fit_cache_for(cache_config, eng.model_path))
        except PromptError as exc:
            code = 2 if context or isinstance(exc, NoRoomError) else 1
            fail(f"{context_source(prof, context)}: {exc}" if context else str(exc), code=code)
        from fpcli.report import render_cuts

        render_cuts(err, prompt)
        with err.status(f"prefilling {prompt.tokens:,} tokens ({eng.name}, profile {prof.name})"):
            try:
                result = eng.generate(prompt.ids, max_new_tokens=1, temperature=0.0)
            except Exception as exc:  # noqa: BLE001
                fail(f"prefill failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}")

    from fpcli.profiles import sparse_cap_note, sparse_settings

    stats = result.stats
    # rectangular even when dense layers report no per-head row (one column without per-head data)
    grid = density_grid(stats.density_per_layer_head, stats.density_per_layer, getattr(stats, "sparse_layers", None))
    times = _stage_times_or_warn(err, stats)
    fp8_error = list(getattr(stats, "fp8_rel_l2_per_layer", None) or []) or None
    fp8_grid = list(getattr(stats, "fp8_rel_l2_per_layer_head", None) or []) or None
    data = {
        "schema": "fp.profile/1",
        "file": file,
        "question": question,
        "prompt_tokens": result.prompt_tokens,
        "prefill_s": result.prefill_s,
        "engine": result.engine,
        "model": result.model,
        "native_context": context_info.get("native_context"),
        "context": context_info.get("context"),
        "rope_scaling": context_info.get("rope_scaling"),
        "profile": prof.name,
        "precision": getattr(result, "precision", None) or prof.precision,
        "precision_requested": prof.precision,
        "sparse": sparse_settings(loaded, eng.context_length, context_info.get("native_context")),  # as run
        "sparse_note": sparse_cap_note(loaded, eng.context_length, context_info.get("native_context")),
        "density": density_summary(stats.density_per_layer, stats.density, getattr(stats, "sparse_layers", None)),
        "density_per_layer_head": grid,
        "density_note": None,  # always_kept_note, below (as in fp.ask/1)
        "index_ms": stats.index_ms,
        "attention_ms": stats.attention_ms,
        # one per sparse layer (density.sparse_layers, in that order); null when not measured
        "index_ms_per_layer": list(stats.index_ms_per_layer) if times else None,
        "attention_ms_per_layer": list(stats.attention_ms_per_layer) if times else None,
        # index / (index + attention) over index_share_over: the warm layers when the first
        # sparse layer carried a one-time cost (then times_notes says so)
        "index_share": _index_share(times, stats),
        "index_share_over": times.share_over if times else None,
        "times_notes": list(times.notes) if times else [],
        "fp8_rel_l2_per_layer": fp8_error,
        "fp8_rel_l2_per_layer_head": fp8_grid,
        "png": None,
        "png_fp8": None,
        "server": render_answered_by(err, eng),  # None: profiled in-process
        "ingestion": ingestion_report(docs, prompt),  # what was read and cut, as in fp.ask/1
    }
    data["density_note"] = always_kept_note(result.prompt_tokens, data["sparse"], data["density"])
    if grid:
        # default: the current directory (never beside the input, which may be read-only or shared)
        png_path = (png or Path.cwd() / f"{Path(file).stem if file != '-' else 'stdin'}.density.png").resolve()
        try:
            write_heatmap_png(png_path, grid, title=f"{Path(file).name}: {result.prompt_tokens:,} tokens, {result.model}, {prof.name}")
            data["png"] = str(png_path)
        except OSError as exc:
            warning(err, f"cannot write {png_path}: {exc.strerror or exc}")

    from fpcli.engine.base import precision_label

    label = precision_label(compared or "fp8")  # "FP8", "int8qk": the error's texts
    if fp8_grid and any(fp8_grid) and data["png"]:
        from fpcli.report import error_scale

        stem = Path(data["png"]).name.removesuffix(".png").removesuffix(".density")
        fp8_png = Path(data["png"]).with_name(f"{stem}.{compared or 'fp8'}.png")
        try:
            write_heatmap_png(fp8_png, fp8_grid, scale=error_scale(compared or "fp8"),
                              title=f"{Path(file).name}: {label} vs BF16 output, relative L2 ({result.model}, {prof.name})")
            data["png_fp8"] = str(fp8_png)
        except OSError as exc:
            warning(err, f"cannot write {fp8_png}: {exc.strerror or exc}")
    if data["png"]:
        err.print(f"heatmap written to {data['png']}", highlight=False, soft_wrap=True)
    if data["png_fp8"]:
        err.print(f"{label} error heatmap written to {data['png_fp8']}", highlight=False, soft_wrap=True)
    if json_out:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    out = stdout_console()
    if grid:
        out.print(f"[bold]attention density per layer x KV head[/] ({result.prompt_tokens:,} tokens, {result.model}, profile {prof.name})", soft_wrap=True)
        print_table(heatmap_table(grid))
        out.print(heatmap_legend(color=out.color_system is not None and not out.no_color), soft_wrap=True)
    else:
        out.print(f"no density statistics from the {result.engine} engine (profile {prof.name}, attention {prof.attention})")
    d = data["density"]
    if d["overall"] is not None:
        msl = None if prof.attention == "dense" else int(prof.sparse.min_sparse_len)
        out.print(f"density {density_line(d, prof.attention, result.prompt_tokens, msl, result.cached_tokens, prof.dense_layers)}", soft_wrap=True)
        if data["density_note"]:
            out.print(f"note: {data['density_note']}", soft_wrap=True, highlight=False)
    if times:
        print_table(_times_table(times, stats.density_per_layer))
        out.print(_times_headline(times), soft_wrap=True, highlight=False)
        if getattr(result, "device", None) == "cpu":
            out.print(f"note: {CPU_TIMES_NOTE}", soft_wrap=True, highlight=False)
        for note in times.notes:
            out.print(f"note: {note}", soft_wrap=True, highlight=False)
    else:
        out.print(_times_totals(stats.index_ms, stats.attention_ms, resident=bool(data["server"])),
                  soft_wrap=True, highlight=False)
    if compared:
        from fpcli.engine.base import precision_family

        if fp8_error:
            print_table(_fp8_table(fp8_error, fp8_grid, label))
        elif data["server"]:
            out.print(f"{label}-vs-BF16 error per layer: unavailable (the resident engine does not compare; "
                      "--no-server runs one in this process that does)")
        elif precision_family(str(data["precision"])) == compared:
            out.print(f"{label}-vs-BF16 error per layer: unavailable (the {result.engine} engine did not report it)")
        else:
            why = _no_fp8_reason(result.prompt_tokens, None if prof.is_dense else int(prof.sparse.min_sparse_len),
                                 label)
            out.print(f"{label}-vs-BF16 error per layer: none (no layer ran {label}: {data['precision']} ran){why}",
                      soft_wrap=True)


def _no_fp8_reason(prompt_tokens: int, min_sparse_len: int | None, label: str = "FP8") -> str:
    """Why no layer ran the 8-bit precision ``label`` (``FP8``, ``int8qk``) when the prompt (tokens)
    is below the fitted ``min_sparse_len`` (tokens; ``None`` for a dense profile: ""), and what makes
    it run: a longer document, or a ``--context`` of at most twice the prompt (``sparse_threshold``
    lowers min_sparse_len to half the context; a document longer than the context is cut to it),
    e.g. 811 tokens -> --context 1k."""
    if min_sparse_len is None or prompt_tokens >= min_sparse_len:
        return ""
    why = (f": the prompt's {prompt_tokens:,} tokens are below min_sparse_len {min_sparse_len:,}, and {label} runs "
           f"in the sparse layers only; a document of more than {min_sparse_len:,} tokens runs it")
    k = prompt_tokens // 512  # whole k, with half of it at most the prompt
    if k >= 1:
        why += (f", or --context {k}k (min_sparse_len is at most half the context: any --context up to "
                f"{2 * prompt_tokens:,} tokens)")
    return why


def _stage_times_or_warn(err, stats):
    """``fpcli.stage_times.StageTimes`` of the prefill, or ``None`` when the engine reported no
    per-layer times (or lists that do not match its sparse layers: warned, totals shown instead)."""
    from fpcli.console import warning
    from fpcli.stage_times import stage_times

    try:
        return stage_times(stats.sparse_layers, stats.index_ms_per_layer, stats.attention_ms_per_layer)
    except ValueError as exc:
        warning(err, f"per-layer times not shown: {exc}")
        return None


def _index_share(times, stats) -> float | None:
    """The headline share: the warm layers' (``times``), else from the totals; ``None`` without an
    index stage."""
    if times is not None:
        return times.index_share
    if stats.index_ms is None or stats.attention_ms is None or stats.index_ms + stats.attention_ms <= 0:
        return None
    return stats.index_ms / (stats.index_ms + stats.attention_ms)


CPU_TIMES_NOTE = ("CPU reference: its sparse attention saves no time, so these times say nothing of the GPU "
                  "kernels' speed or of the index's share there")


def _times_table(times, density_per_layer):
    """Layer, density, index ms, attention ms, index share: one row per sparse layer."""
    from rich.table import Table

    t = Table(title="index vs attention time per sparse layer (ms)", title_justify="left", min_width=40)
    for c in ("layer", "density", "index", "attention", "index share"):
        t.add_column(c, justify="right")
    for r in times.layers:
        density = density_per_layer[r.layer] if r.layer < len(density_per_layer) else None
        share = r.index_share
        t.add_row(str(r.layer), "-" if density is None else f"{density:.1%}", _ms(r.index_ms), _ms(r.attention_ms),
                  "-" if share is None else f"{share:.0%}")
    return t


def _times_headline(times) -> str:
    """'index 1.50 ms, attention 6.00 ms over layers 1-3: index 20%', over the warm layers when the
    first sparse layer carried a one-time cost, then with the share that includes it."""
    share = times.index_share
    line = (f"index {_ms(times.share_index_ms)} ms, attention {_ms(times.share_attention_ms)} ms over "
            f"{times.share_over}: index {'-' if share is None else f'{share:.0%}'}")
    if times.one_time_layer is not None and times.all_layers_share is not None:
        line += f"; with layer {times.one_time_layer}: index {times.all_layers_share:.0%}"
    return line


def _times_totals(index_ms, attention_ms, resident: bool = False) -> str:
    """The totals line of an engine that reported no per-layer times; ``resident``: the resident
    engine answered (it runs without per-layer timing, which ``--no-server`` gives)."""
    if index_ms is None and attention_ms is None:
        if resident:
            return ("index vs attention time: not measured by the resident engine (it runs without per-layer "
                    "timing; --no-server measures them in this process)")
        return "index vs attention time: not measured by this engine"
    if index_ms is None:  # dense attention: there is no index stage
        return f"attention {_ms(attention_ms)} ms over all layers (no index stage); per-layer times not reported"
    total = index_ms + (attention_ms or 0.0)
    share = f" (index {index_ms / total:.0%})" if total > 0 else ""
    return f"index {_ms(index_ms)} ms, attention {_ms(attention_ms)} ms over the sparse layers{share}; per-layer times not reported"


def _fp8_table(per_layer, per_head, label: str = "FP8"):
    """Layer, relative L2 over the layer, then one column per KV head; ``-`` for dense layers.
    ``label``: the 8-bit precision compared with BF16 (``FP8``, ``int8qk``)."""
    from rich.table import Table

    heads = max((len(r) for r in per_head or []), default=0)
    t = Table(title=f"{label}-vs-BF16 attention output error per layer (relative L2; - = dense layer, BF16 path)",
              title_justify="left")
    t.add_column("layer", justify="right")
    t.add_column("layer rel. L2", justify="right")
    for h in range(heads):
        t.add_column(f"kv{h}", justify="right")
    for i, v in enumerate(per_layer):
        row = (per_head[i] if per_head and i < len(per_head) else []) or []
        t.add_row(str(i), "-" if v is None else f"{v:.2e}",
                  *[f"{row[h]:.2e}" if h < len(row) else "-" for h in range(heads)])
    return t


def _ms(x) -> str:
    return "-" if x is None else f"{x:.2f}"
