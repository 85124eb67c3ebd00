"""``fp bench``: the operator benchmark (``flashprefill.bench``), and with ``--e2e`` the end-to-end
TTFT (``fpcli.ttft``) after it, in one run and one JSON (``--e2e-only``: the end-to-end part alone)."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from typing import Annotated, Any, Optional

import typer

from fpcli.commands import FpCommand, check_model_or_exit, fail, load_profile_or_exit, note, stderr_console, warning
from fpcli.models import QWEN_CODER

app = typer.Typer()

GPU_DEFAULT_LENS = "8k,32k,128k"
CPU_DEFAULT_LENS = "2k,4k"
BENCH_SCHEMA = "fp.bench/2"
"""``fp bench --json``: ``{"schema", "kind": "operator" | "operator+e2e" | "e2e", "operator": {meta...,
"notes", "rows"} | null, "e2e": {meta..., "notes", "rows"} | null}`` (``_operator_part``, ``_e2e_part``);
``notes``: the lines the tables print as notes (``flashprefill.bench.table_notes``, ``fpcli.ttft.ttft_notes``)."""


def parse_lengths(text: str, option: str = "--len") -> list[int]:
    """``"4k,32k,131072"`` -> ``[4096, 32768, 131072]`` (``flashprefill.lengths.parse_lengths``,
    the project's one length parser; ``k`` = 1024, ``m`` = 1024**2).

    Raises:
        ValueError: naming ``option`` and the bad item.
    """
    from flashprefill.lengths import parse_lengths as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"{option}: {exc}") from None


def unique_lengths(texts: list[str], option: str = "--len") -> tuple[list[int], list[int]]:
    """The lengths of ``option`` given once or more (each value one length or a comma list, as
    ``parse_lengths``), in the order given, each token count once: ``["32k,8k", "32768"]`` ->
    ``([32768, 8192], [32768])``. Returns ``(lengths, repeated)``: ``repeated``, the token counts
    given more than once (merged into their first place).

    Raises:
        ValueError: naming ``option`` and the bad item.
    """
    given = [n for text in texts for n in parse_lengths(text, option=option)]
    lengths = list(dict.fromkeys(given))
    repeated = [n for n in lengths if given.count(n) > 1]
    return lengths, repeated


def repeated_note(repeated: list[int], option: str = "--len") -> str:
    """The note for the lengths ``unique_lengths`` merged (tokens), e.g. "--len: 32,768 tokens given
    more than once: run once"."""
    return f"{option}: {', '.join(f'{n:,}' for n in repeated)} tokens given more than once: run once"


def parse_heads(text: str) -> tuple[int, int]:
    """``"32/8"`` -> ``(32, 8)`` (query / KV heads); ``"32"`` -> ``(32, 32)``.

    Raises:
        ValueError: when malformed or the query heads are not a multiple of the KV heads.
    """
    m = re.fullmatch(r"\s*(\d+)\s*(?:/\s*(\d+)\s*)?", text)
    if not m:
        raise ValueError(f"--heads: {text!r} is not HQ/HKV (example: 32/8)")
    hq = int(m.group(1))
    hkv = int(m.group(2) or hq)
    if hq < 1 or hkv < 1 or hq % hkv:
        raise ValueError(f"--heads: query heads {hq} must be a positive multiple of KV heads {hkv}")
    return hq, hkv


DENSE_PROFILE_ERROR = "has no sparse settings to benchmark; the dense baselines are in every row"


@app.command("bench", cls=FpCommand)
def bench(
    lens: Annotated[Optional[list[str]], typer.Option("--len", "-l", help=f"Lengths in tokens: 4k, 131072, 128k, or a comma list; repeatable (a length given twice runs once). Default: {GPU_DEFAULT_LENS} on a GPU, {CPU_DEFAULT_LENS} with --cpu.", show_default=False, metavar="LENGTHS")] = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 attention operands in the sparse path, beside BF16: FP8 columns in the operator table; with --e2e an FP8 engine beside the BF16 and dense ones (the built-in fp8 profile beside bf16; for another profile, the same at fp8 precision, named PROFILE+fp8). Implied by an fp8 profile.")] = False,
    batch: Annotated[int, typer.Option("--batch", "-b", min=1, help="Operator table: requests per batch, each of the given length.")] = 1,
    heads: Annotated[str, typer.Option("--heads", help="Operator table: query/KV heads, e.g. 32/8.")] = "32/8",
    head_dim: Annotated[int, typer.Option("--head-dim", min=16, help="Operator table: head dimension d.")] = 128,
    e2e: Annotated[bool, typer.Option("--e2e", help="After the operator table, the end-to-end TTFT through the engine in the same run: the profile (with --fp8 its BF16 and FP8 twins) and dense side by side. Needs a CUDA GPU.")] = False,
    e2e_only: Annotated[bool, typer.Option("--e2e-only", help="The end-to-end TTFT alone, without the operator table.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=f"Model for --e2e, as for fp ask. Default: {QWEN_CODER} (the GPU default of fp ask, extended with YaRN to the longest --len).")] = None,
    profile: Annotated[Optional[str], typer.Option("--profile", "-p", help="Profile (bf16, fp8, NAME+int8qk, or a path): the operator table runs its sparse settings (without --profile: the default SparseConfig, not the bf16 profile's), --e2e its engine (default: bf16; an fp8 or int8qk profile beside its BF16 twin). Not dense: the dense baselines are in every run.", show_default=False)] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Tiny CPU reference run of the operator table (short lengths only); NOT representative of GPU speed.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the tables' rows as one JSON object on stdout (schema fp.bench/2).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show other libraries' log lines, warnings and progress bars.")] = False,
) -> None:
    """Benchmark the FlashPrefill operator, and with --e2e also the TTFT through the engine.

    Operator table: index time, attention time, total, density, and the speed-up over each dense baseline available, all measured in the same run, with the profile's sparse settings (its header names them). Needs a CUDA GPU (--cpu: a tiny, non-representative CPU run). End-to-end table (--e2e, --e2e-only): per length and profile, the median TTFT of a needle prompt, the precision that ran, the density, whether the needle was answered, and the speed-up over dense and over BF16.
    """
    err = stderr_console()
    with_e2e = e2e or e2e_only
    if cpu and with_e2e:
        fail("--cpu runs the operator table alone, on the CPU reference; the end-to-end benchmark runs the SGLang "
             "engine and needs a CUDA GPU (on a CPU, `fp ask FILE QUESTION` reports the TTFT of one real request)", code=2)
    if model is not None and not with_e2e:
        fail("--model: the operator table runs synthetic inputs, not a model; --model is for --e2e or --e2e-only", code=2)
    if not lens:
        lens = [CPU_DEFAULT_LENS if cpu else GPU_DEFAULT_LENS]
    try:
        lengths, repeated = unique_lengths(lens)
        hq, hkv = parse_heads(heads)
    except ValueError as exc:
        fail(str(exc), code=2)
    if repeated:
        note(err, repeated_note(repeated))
    prof = None
    if profile is not None:
        prof = load_profile_or_exit(profile)
        if prof.is_dense:
            who = "dense" if prof.name == "dense" else f"{prof.name} (attention: dense)"
            fail(f"--profile {profile}: {who} {DENSE_PROFILE_ERROR}", code=2)
        fp8 = fp8 or prof.precision == "fp8"

    cuda = _cuda_available()
    run_operator = not e2e_only
    if with_e2e and not cuda:
        fail("the end-to-end benchmark runs the SGLang engine and needs a CUDA GPU (none found); on a CPU, "
             "`fp ask FILE QUESTION` reports the TTFT of one real request, and `fp bench --cpu` runs the operator "
             "table on the CPU reference")
    if run_operator:
        device = _operator_device_or_exit(cuda, cpu, lengths, json_out, err)
    e2e_profiles = _e2e_profiles(prof, fp8) if with_e2e else []
    model_path = None
    if with_e2e:
        from fpcli.models import ModelError, default_model, resolve_model

        check_model_or_exit(model)
        if model is None:  # the e2e part runs SGLang: the GPU default model, as fp ask's
            model = default_model("sglang").name
        checked = _check_e2e_context_or_exit(model, model, lengths)  # embedded names: before any fetch
        try:
            model_path = str(resolve_model(model, progress=err))
        except ModelError as exc:
            fail(str(exc))
        if not checked:
            _check_e2e_context_or_exit(model, model_path, lengths)

    operator_part = e2e_part = None
    if run_operator:
        operator_part = _operator_part(err, lengths, hq, hkv, head_dim, batch, fp8, device, prof, verbose)
        if not json_out:
            _print_operator(err, operator_part, with_e2e and prof is None)
            if with_e2e:
                sys.stdout.write("\n")
                sys.stdout.flush()
    if with_e2e:
        e2e_part = _e2e_part(err, lengths, model_path, e2e_profiles, verbose)
        if not json_out:
            from fpcli.ttft import format_ttft_table

            sys.stdout.write(format_ttft_table(e2e_part["rows"], e2e_part) + "\n")
            sys.stdout.flush()
            for line in e2e_part["notes"]:
                note(err, line)

    if json_out:
        kind = "operator+e2e" if run_operator and with_e2e else ("e2e" if with_e2e else "operator")
        data = {"schema": BENCH_SCHEMA, "kind": kind, "operator": operator_part, "e2e": e2e_part}
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _operator_device_or_exit(cuda: bool, cpu: bool, lengths: list[int], json_out: bool, err) -> str:
    """``"cuda"`` or ``"cpu"`` (``--cpu``) for the operator table; exit 1 without a GPU and without
    ``--cpu``, exit 2 for a CPU length above ``CPU_MAX_LEN``."""
    if not cuda and not cpu:
        fail(
            "the operator benchmark needs a CUDA GPU (none found); `fp bench --cpu --len 2k` runs a tiny "
            "CPU reference instead, which is not representative of GPU speed"
        )
    device = "cuda" if cuda and not cpu else "cpu"
    if device == "cpu":
        from flashprefill.bench import CPU_MAX_LEN  # the reference is O(L^2) on the CPU

        too_long = [n for n in lengths if n > CPU_MAX_LEN]
        if too_long:
            fail(f"--cpu runs lengths up to {CPU_MAX_LEN} tokens; got {too_long} (use --len 2k for example)", code=2)
        if json_out:  # the table says it otherwise, once, in its header
            warning(err, "CPU reference run: correctness plumbing only, NOT representative of GPU speed")
    return device


def _check_e2e_context_or_exit(model: str, spec: str, lengths: list[int]) -> bool:
    """Exit 2, before anything runs, when ``model`` cannot be run at the context the end-to-end
    part needs (``fpcli.ttft.e2e_context``: the longest length plus ``ANSWER_MARGIN``; YaRN up to
    ``MAX_YARN_FACTOR`` x the native context: ``fpcli.engine.context.plan_context``). ``spec``: an
    embedded name or a model folder (``fpcli.models.known_context_length``). Returns whether the
    native context could be read (``False``: left to the engine)."""
    from fpcli.engine.context import ContextError, plan_context
    from fpcli.models import known_context_length
    from fpcli.ttft import ANSWER_MARGIN, e2e_context

    native = known_context_length(spec)
    if native is None:
        return False
    need = e2e_context(lengths)
    try:
        plan_context({"max_position_embeddings": native}, need, model=model)
    except ContextError as exc:
        fail(f"--len {max(lengths):,} needs a context of {need:,} tokens ({ANSWER_MARGIN} for the question "
             f"and the answer): {exc}; use a shorter --len or another --model", code=2)
    return True


def _e2e_profiles(prof, fp8: bool) -> list:
    """The engines of the end-to-end part, in order: the sparse profile (``prof``, default the
    built-in ``bf16``), with ``fp8`` its BF16 and FP8 twins (``fpcli.profiles.with_precision``),
    an ``int8qk`` profile after its BF16 (and, with ``fp8``, FP8) twin, then the built-in ``dense``."""
    from fpcli.profiles import with_precision

    base = prof if prof is not None else load_profile_or_exit("bf16")
    precisions = ["bf16", "fp8"] if fp8 else []
    if base.precision not in ("bf16", "fp8"):  # int8qk: beside its BF16 twin, as fp8 is
        precisions = (precisions or ["bf16"]) + [base.precision]
    sparse = [with_precision(base, p) for p in precisions] if precisions else [base]
    return sparse + [load_profile_or_exit("dense")]


def _operator_part(err, lengths, hq, hkv, head_dim, batch, fp8, device, prof, verbose) -> dict:
    """Run the operator table (``flashprefill.bench.run_operator_bench``) with ``prof``'s sparse
    settings (``None``: the default ``SparseConfig``); its meta and rows for the JSON."""
    import torch

    from flashprefill.bench import run_operator_bench, table_notes
    from flashprefill.config import SparseConfig
    from fpcli.profiles import profile_file

    config = prof.sparse_config() if prof is not None else SparseConfig()
    int8qk = prof is not None and prof.precision == "int8qk"  # its columns beside BF16 (and FP8 with --fp8)
    kwargs: dict[str, Any] = {"fp8": fp8, "int8qk": int8qk, "batch": batch}
    if device == "cpu":
        kwargs["device"] = "cpu"
    if prof is not None:
        kwargs["config"] = config
    rows = _run_with_progress(
        err,
        "operator",
        len(lengths),
        lambda progress: run_operator_bench(lengths, hq, hkv, head_dim, torch.bfloat16, progress=progress, **kwargs),
        verbose=verbose,
    )
    return {
        "lens": lengths,
        "heads_q": hq,
        "heads_kv": hkv,
        "head_dim": head_dim,
        "batch": batch,
        "fp8": fp8,
        "int8qk": int8qk,
        "device": device,
        "gpu": _gpu_name() if device == "cuda" else None,
        "profile": prof.name if prof is not None else None,  # None: the default SparseConfig
        "profile_file": profile_file(prof) if prof is not None else None,
        "config": dataclasses.asdict(config),
        "config_differences": config.differences(),  # from the default SparseConfig
        "notes": table_notes(rows),  # the notes the table prints (short lengths, timings, skipped baselines)
        "rows": rows,
    }


def _print_operator(err, part: dict, default_beside_e2e: bool) -> None:
    """The operator table on stdout (its notes with it); ``default_beside_e2e``: a note on stderr
    that the table ran the default ``SparseConfig`` while the end-to-end part runs a profile."""
    from fpcli.console import print_table

    rows = part["rows"]
    if rows and "inputs" in rows[0]:
        # the operator's own fixed-width table: the main columns, never truncated
        from flashprefill.bench import format_table

        name = None
        if part["profile"] is not None:
            name = f"profile {part['profile']}" + (f" ({part['profile_file']})" if part["profile_file"] else "")
        sys.stdout.write(f"fp bench (operator{', CPU)' if part['device'] == 'cpu' else ')'}\n"
                         f"{format_table(rows, config_name=name)}\n")
    else:
        title = ("fp bench (operator, CPU reference, not representative of GPU speed)" if part["device"] == "cpu"
                 else "fp bench (operator)")
        print_table(rows_table(rows, title=title))  # the result: stdout, as wide as it needs
        for line in part["notes"]:
            note(err, line)
    sys.stdout.flush()
    if default_beside_e2e:
        note(err, "the operator table ran the default SparseConfig (no --profile); the end-to-end table runs the "
                  "bf16 profile: --profile bf16 runs its settings in both")


def _e2e_part(err, lengths, model_path: str, profiles: list, verbose: bool) -> dict:
    """Run the end-to-end table (``fpcli.ttft.run_ttft_bench``) of ``profiles``; its meta and rows."""
    from fpcli.models import known_context_length
    from fpcli.ttft import REPEATS, run_ttft_bench, ttft_notes

    rows = _run_with_progress(
        err, "TTFT", len(profiles) * len(lengths),
        lambda progress: run_ttft_bench(lengths, model_path, profiles, progress=progress, repeats=REPEATS),
        verbose=verbose,
    )
    notes = ttft_notes(rows, profiles, known_context_length(model_path))  # the min_sparse_len each engine ran
    return {"lens": lengths, "model": model_path, "gpu": _gpu_name(), "repeats": REPEATS,
            "profiles": [p.name for p in profiles], "notes": notes, "rows": rows}


def rows_table(rows: list[dict], title: str = ""):
    """A rich table with one column per key (in first-seen order) of ``rows``."""
    from rich.table import Table

    keys: list[str] = []
    for r in rows:  # nested values (config, notes, profiles) are in --json; notes go to stderr
        keys.extend(k for k in r if k not in keys and not isinstance(r[k], (dict, list)))
    t = Table(title=title, title_justify="left")
    for k in keys:
        t.add_column(k, justify="right")
    for r in rows:
        t.add_row(*[_cell(r.get(k)) for k in keys])
    return t


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def _run_with_progress(err, label: str, total: int, fn, verbose: bool = False):
    """Run ``fn(progress)`` under a rich progress bar, with other libraries' output shown only
    when ``verbose`` (``fpcli.logs.third_party_output``). ``progress`` accepts ``()`` (one step
    done), ``(done, total)`` or ``(message,)``: on a terminal a message labels the bar; off it (a
    log, a pipe) there is no bar, and a message (the library's own log line) is a plain line only
    when ``verbose``."""
    from fpcli.logs import third_party_output

    with third_party_output(verbose):
        return _run_with_bar(err, label, total, fn, verbose)


def _run_with_bar(err, label: str, total: int, fn, verbose: bool):
    from fpcli.console import step_progress

    if not err.is_terminal:  # a log or a pipe: no redrawn bar; messages with -v only
        def plain(*args, **kwargs) -> None:
            if verbose and args and isinstance(args[0], str):
                err.print(f"{label}: {args[0]}", highlight=False, markup=False)

        try:
            return fn(plain)
        except (RuntimeError, ValueError, TypeError, ImportError) as exc:
            lines = str(exc).strip().splitlines()
            fail(f"benchmark failed: {lines[0] if lines else type(exc).__name__}")

    with step_progress(err) as bar:
        task = bar.add_task(label, total=total)

        def progress(*args, **kwargs) -> None:
            if len(args) >= 2 and all(isinstance(a, int) for a in args[:2]):
                bar.update(task, completed=args[0], total=args[1])
            elif args and isinstance(args[0], str):
                bar.update(task, description=f"{label}: {args[0]}")
            else:
                bar.advance(task)

        try:
            return fn(progress)
        except (RuntimeError, ValueError, TypeError, ImportError) as exc:
            bar.stop()
            lines = str(exc).strip().splitlines()
            fail(f"benchmark failed: {lines[0] if lines else type(exc).__name__}")


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        return None
