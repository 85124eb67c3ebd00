"""``fp bench``: the operator benchmark (``flashprefill.bench``) or end-to-end TTFT (``--e2e``)."""
from __future__ import annotations

import json
import re
import sys
from typing import Annotated, Any, Optional

import typer

from fpcli.commands import FpCommand, check_model_or_exit, fail, load_profile_or_exit, note, stderr_console, warning
from fpcli.models import DEFAULT_MODEL

app = typer.Typer()

GPU_DEFAULT_LENS = "8k,32k,128k"
CPU_DEFAULT_LENS = "2k,4k"


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


@app.command("bench", cls=FpCommand)
def bench(
    lens: Annotated[Optional[str], typer.Option("--len", "-l", help=f"Lengths in tokens: 4k, 131072, 128k, or a comma list. Default: {GPU_DEFAULT_LENS} on a GPU, {CPU_DEFAULT_LENS} with --cpu.", show_default=False)] = None,
    fp8: Annotated[bool, typer.Option("--fp8", help="FP8 attention operands in the sparse path.")] = False,
    batch: Annotated[int, typer.Option("--batch", "-b", min=1, help="Requests per batch, each of the given length.")] = 1,
    heads: Annotated[str, typer.Option("--heads", help="Query/KV heads, e.g. 32/8.")] = "32/8",
    head_dim: Annotated[int, typer.Option("--head-dim", min=16, help="Head dimension d.")] = 128,
    e2e: Annotated[bool, typer.Option("--e2e", help="Measure end-to-end TTFT through the engine, flashprefill vs dense.")] = False,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=f"Model for --e2e, as for fp ask. Default: {DEFAULT_MODEL} (the embedded CPU default, on any device).")] = None,
    profile: Annotated[str, typer.Option("--profile", "-p", help="Profile for --e2e (bf16, fp8, dense, or a path).")] = "bf16",
    cpu: Annotated[bool, typer.Option("--cpu", help="Tiny CPU reference run (short lengths only); NOT representative of GPU speed.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the rows as a JSON object on stdout.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show other libraries' log lines, warnings and progress bars.")] = False,
) -> None:
    """Benchmark the FlashPrefill operator, or with --e2e the TTFT through the engine.

    Operator: index time, attention time, total, density, and the speed-up over each dense baseline available, all measured in the same run. Needs a CUDA GPU (--cpu: a tiny, non-representative CPU run).
    """
    err = stderr_console()
    if lens is None:
        lens = CPU_DEFAULT_LENS if cpu and not e2e else GPU_DEFAULT_LENS
    try:
        lengths = parse_lengths(lens)
        hq, hkv = parse_heads(heads)
    except ValueError as exc:
        fail(str(exc), code=2)

    cuda = _cuda_available()
    if e2e:
        prof = load_profile_or_exit(profile, fp8=fp8)
        dense = load_profile_or_exit("dense")
        if not cuda:
            fail("the end-to-end benchmark runs the SGLang engine and needs a CUDA GPU (none found"
                 + ("; --cpu applies to the operator benchmark only" if cpu else "")
                 + "); on a CPU, `fp ask FILE QUESTION` reports the TTFT of one real request")
        from fpcli.models import ModelError, resolve_model
        from fpcli.ttft import run_ttft_bench

        check_model_or_exit(model)
        try:
            model_path = str(resolve_model(model, progress=err))
        except ModelError as exc:
            fail(str(exc))
        rows = _run_with_progress(
            err, "TTFT", 2 * len(lengths), lambda progress: run_ttft_bench(lengths, model_path, prof, dense, progress=progress),
            verbose=verbose,
        )
        meta = {"kind": "e2e", "lens": lengths, "model": model_path, "profile": prof.name, "gpu": _gpu_name()}
    else:
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
        import torch

        from flashprefill.bench import run_operator_bench
        kwargs: dict[str, Any] = {"fp8": fp8, "batch": batch}
        if device == "cpu":
            kwargs["device"] = "cpu"
        rows = _run_with_progress(
            err,
            "operator",
            len(lengths),
            lambda progress: run_operator_bench(lengths, hq, hkv, head_dim, torch.bfloat16, progress=progress, **kwargs),
            verbose=verbose,
        )
        meta = {
            "kind": "operator",
            "lens": lengths,
            "heads_q": hq,
            "heads_kv": hkv,
            "head_dim": head_dim,
            "batch": batch,
            "fp8": fp8,
            "device": device,
            "gpu": _gpu_name() if device == "cuda" else None,
        }

    if json_out:
        sys.stdout.write(json.dumps({"schema": "fp.bench/1", **meta, "rows": rows}, indent=2, default=str) + "\n")
    else:
        from fpcli.console import print_table

        title = f"fp bench ({meta['kind']}" + (", CPU)" if meta.get("device") == "cpu" else ")")
        if meta["kind"] == "operator" and rows and "inputs" in rows[0]:
            # the operator's own fixed-width table: the main columns, never truncated
            from flashprefill.bench import format_table

            sys.stdout.write(f"{title}\n{format_table(rows)}\n")
        else:
            if meta.get("device") == "cpu":
                title = f"fp bench ({meta['kind']}, CPU reference, not representative of GPU speed)"
            table = rows_table(rows, title=title)
            print_table(table)  # the result: stdout, as wide as it needs
        if not (meta["kind"] == "operator" and rows and "inputs" in rows[0]):  # format_table prints its notes
            notes = {k: v for r in rows for k, v in (r.get("notes") or {}).items() if k != "cpu"}
            for k, v in notes.items():
                note(err, f"{k}: {v}")


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
