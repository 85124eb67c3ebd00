"""One module per ``fp`` command, joined in ``fpcli.cli`` with ``app.add_typer``.

Conventions (style guide habit 15): stdout carries only the answer or ``--json``; diagnostics
go to ``stderr_console()``; failures end with ``fail(message)`` -- one line, exit code 1 for a
failure, 2 for a usage error (bad path, bad option value).
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from enum import Enum
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup

from fpcli.models import DEFAULT_MODEL_HELP
from fpcli.console import WIDE, error, note, stderr_console, warning  # noqa: F401 - re-exported for the commands

ENGINE_FACTORY_ENV = "FP_ENGINE_FACTORY"  # "module:function" replacing fpcli.engine.load_engine (tests)


def _flag_metavars(params) -> None:
    """Boolean flags take no value: hide typer's ``<bool>`` type column for them; arguments are
    described by their help text, not by ``<list[str]>`` / ``<str>``."""
    for p in params:
        if getattr(p, "is_flag", False) and not getattr(p, "count", False) and p.metavar is None:
            p.metavar = ""
        elif isinstance(p, TyperArgument) and "display_type_rich" not in vars(p):
            p.display_type_rich = lambda ctx: None


def _usage_pieces(command, ctx) -> list[str]:
    """``[OPTIONS] FILE... QUESTION``: conventional argument names (``NAME``, ``[NAME]``,
    ``NAME...``) instead of typer's ``{NAME}`` braces."""
    pieces = [command.options_metavar] if command.options_metavar else []
    for p in command.get_params(ctx):
        if not isinstance(p, TyperArgument):
            continue
        name = p.metavar or (p.name or "").upper()
        name = name if p.required or p.name in getattr(command, "required_args", ()) else f"[{name}]"
        pieces.append(name + ("..." if p.nargs != 1 else ""))
    return pieces


class _OneLineErrors:
    """``main`` for fp's commands and groups: a usage error the parser finds (a bad option value,
    an unknown option, a missing argument) is one line ``fp: error: ...`` on stderr, exit 2, like
    the errors fp's commands find themselves, instead of typer's boxed panel; a group given no
    command (``fp``, ``fp model``) prints its help and exits 0. ``invoke``: Ctrl-C
    anywhere in a command (reading, fitting, loading, prefill, decode) is ``fp: error: interrupted``,
    exit 130 (a command that ends a partial answer on stdout does so and re-raises; a serving
    ``fp serve`` stops normally instead)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode: bool = True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Abort:
            error(stderr_console(), "aborted")
            sys.exit(1)
        except typer.TyperException as exc:  # the parser's errors (typer's ClickException and its kinds)
            if not hasattr(exc, "format_message"):
                raise
            if _is_a(exc, "NoArgsIsHelpError"):  # a group alone (``fp``, ``fp model``): its help, exit 0
                help_text = exc.format_message()  # rich help has printed itself on stdout: empty here
                if help_text:
                    typer.echo(help_text)
                sys.exit(0)
            message = (missing_message(exc) or option_value_message(exc)
                       or parser_message(" ".join(exc.format_message().split())))
            error(stderr_console(), f"{message}{see_help(getattr(exc, 'ctx', None))}")
            sys.exit(getattr(exc, "exit_code", 2))
        # not standalone: an Exit comes back as its code, a finished command as its return value
        sys.exit(rv if isinstance(rv, int) else 0)


def _is_a(exc: Exception, name: str) -> bool:
    """``exc`` is click's exception class ``name`` or a subclass (typer vendors click privately and
    exports none of its exception classes: matched by class name)."""
    return any(c.__name__ == name for c in type(exc).__mro__)


def see_help(ctx) -> str:
    """`` (see 'fp ask -h')``, the end of every usage error; empty without a context."""
    if ctx is None:
        return ""
    return f" (see '{ctx.command_path} {(ctx.help_option_names or ['--help'])[0]}')"


def parser_message(message: str) -> str:
    """click's own wording in fp's style: a lower-case start, no closing period (``No such command
    'bogus'.`` -> ``no such command 'bogus'``); a message that starts with a name (``FILE``,
    ``--cut``) keeps its case."""
    message = re.sub(r"(^|\()([A-Z])(?=[a-z])", lambda m: m.group(1) + m.group(2).lower(), message.strip())
    return message.rstrip(".")


def missing_message(exc: Exception) -> str | None:
    """``fp profile: missing FILE`` for a required argument or option the parser did not get;
    ``None`` for other parser errors."""
    param, ctx = getattr(exc, "param", None), getattr(exc, "ctx", None)
    if not _is_a(exc, "MissingParameter") or param is None or ctx is None:
        return None
    if param.param_type_name == "argument":
        name = (param.metavar or (param.name or "").upper()) + ("..." if param.nargs != 1 else "")
    else:
        name = max(param.opts, key=len)
    return f"{ctx.command_path}: missing {name}"


def option_value_message(exc: Exception) -> str | None:
    """fp's wording for a value the parser refused, named by its option: ``--cut: expected one of
    middle, end; got 'start'``, ``--max-new-tokens: expected an integer >= 1, got 0`` (typer checks
    each value with a pydantic adapter and words the failure like pydantic: reworded here from the
    option's type and range), ``--report: file '/' is a directory``. ``None`` for a parser error
    that is not about one value (its own message is kept)."""
    param = getattr(exc, "param", None)
    if param is None or not isinstance(getattr(exc, "message", None), str):
        return None
    opts = [o for o in param.opts if o.startswith("--")] or [param.metavar or (param.name or "").upper()]
    name = max(opts, key=len)
    errors = getattr(exc.__cause__, "errors", None)
    expected = _expected_value(param) if callable(errors) and errors() else None
    if expected is None:
        return f"{name}: {exc.message.rstrip('.')}"
    found = str(errors()[0].get("input"))
    shown = found if re.fullmatch(r"[-+]?\d+(\.\d*)?([eE][-+]?\d+)?", found) else repr(found)
    return f"{name}: expected {expected}{';' if ',' in expected else ','} got {shown}"


def _expected_value(param) -> str | None:
    """``one of a, b`` / ``an integer >= 1`` / ``a number from 0 to 1`` for an option of an Enum,
    int or float type (its range from the option's ``min`` / ``max``); ``None`` for other types."""
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(str(m.value) for m in annotation)
    if annotation is not int and annotation is not float:
        return None
    expected = "an integer" if annotation is int else "a number"
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is not None and high is not None:
        return f"{expected} from {low:g} to {high:g}"
    if low is not None:
        return f"{expected} >= {low:g}"
    return f"{expected} <= {high:g}" if high is not None else expected


class FpCommand(_OneLineErrors, TyperCommand):
    """A typer command whose help renders flags as flags and a conventional usage line.
    ``required_args``: arguments optional for the parser (the command checks them itself, to
    give a better message) but required in the usage line. Parser errors are one line."""

    required_args: tuple[str, ...] = ()

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params

    def collect_usage_pieces(self, ctx) -> list[str]:
        return _usage_pieces(self, ctx)

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            # a usage error that names what is missing (``fp ask: missing FILE... and QUESTION``),
            # instead of the help followed by an empty error
            required = [p for p in _usage_pieces(self, ctx)[1:] if not p.startswith("[")]
            if required:
                error(stderr_console(), f"{ctx.command_path}: missing {' and '.join(required)}{see_help(ctx)}")
                raise typer.Exit(2)
        return super().parse_args(ctx, args)


class EngineArgsCommand(FpCommand):
    """An ``FpCommand`` whose engine settings all follow ``--``: before it, an unknown option or a
    stray argument is a usage error (exit 2, before anything starts); after it, every word goes to
    ``ctx.args`` untouched."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        args = list(args)
        engine_args: list[str] = []
        if "--" in args:
            i = args.index("--")
            args, engine_args = args[:i], args[i + 1:]
        rest = super().parse_args(ctx, args)
        ctx.args = engine_args
        return rest


class FpGroup(_OneLineErrors, TyperGroup):
    """The same for command groups (``fp``, ``fp model``)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        _flag_metavars(params)
        return params


class StdoutStream:
    """``on_text`` for an answer streamed to stdout: writes each piece as it arrives (flushed) and
    keeps the last one, so the caller can end the answer with a newline."""

    def __init__(self) -> None:
        self.last = ""

    def __call__(self, piece: str) -> None:
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
            self.last = piece


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``fp: error: message`` (one line) on stderr and exit with ``code``."""
    error(stderr_console(), message)
    raise typer.Exit(code)


def engine_loader():
    """``fpcli.engine.load_engine``, or the factory named by ``$FP_ENGINE_FACTORY``
    (``module:function``; used by subprocess tests to run ``fp`` with a fake engine)."""
    spec = os.environ.get(ENGINE_FACTORY_ENV)
    if spec:
        module, _, func = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), func or "load_engine")
        except (ImportError, AttributeError) as exc:
            fail(f"${ENGINE_FACTORY_ENV}={spec}: cannot import it ({exc})")
    from fpcli.engine import load_engine

    return load_engine


def load_profile_or_exit(name: str, fp8: bool = False, precision: str | None = None):
    """The profile ``name`` (built-in or path); with ``precision`` (``fp8``: the same as ``fp8=True``;
    ``int8qk``), its twin at that precision (``fpcli.profiles.with_precision``: the ``fp8`` profile
    instead of ``bf16``, else the profile with its precision set, named ``<name>+<precision>``).
    Exit 2 on a bad profile."""
    from fpcli.profiles import ProfileError, load_profile, with_precision

    precision = precision or ("fp8" if fp8 else None)
    try:
        profile = load_profile(name)
        if precision:
            profile = with_precision(profile, precision)
        return profile
    except ProfileError as exc:
        fail(str(exc), code=2)


def check_model_or_exit(model: str | None) -> None:
    """Exit 2 when ``--model`` cannot name a model (checked before anything is loaded)."""
    from fpcli.models import ModelError, check_model

    try:
        check_model(model)
    except ModelError as exc:
        fail(f"--model: {exc}", code=2)


MODEL_HELP = ("Embedded model name (`fp model list`), Hugging Face folder or cached id, or a .gguf file. "
              + DEFAULT_MODEL_HELP)
"""The help of ``--model`` for every command that loads an engine (its default: ``fpcli.models.default_model``)."""

PROFILE_HELP = ("bf16, accurate, fp8, dense, or a path to a profile .yaml; NAME+fp8 or NAME+int8qk: that profile "
                "at another precision.")
"""The help of ``--profile`` for every command that takes one profile (``fpcli.profiles.load_profile``)."""

CONTEXT_HELP = ("Context to run the model at, in tokens (e.g. 32k, 128k, 131072): a cap within the model's own "
                "context, YaRN beyond it (up to 8x). Default: the profile's engine context_length, else the model's own.")


def context_or_exit(text: str | None, profile, model: str | None, engine: str | None = None,
                    one_request: bool = False):
    """``profile`` run at the context ``--context TEXT`` asks for (``128k``, ``131072``; the
    project's length parser), or ``profile`` itself without ``--context``. Exit 2 when ``TEXT``
    is not one length, is out of range, or is beyond what a model whose native context is known
    before loading (embedded, Hugging Face folder) can be extended to with YaRN. Without
    ``model``, that model is the default one of ``engine`` (``--engine``; ``one_request`` as in
    ``model_context``) when it is given; else the check waits for the load."""
    if text is None:
        return profile
    from fpcli.commands.bench import parse_lengths
    from fpcli.engine.context import ContextError, plan_context
    from fpcli.profiles import ProfileError, with_context_length

    try:
        values = parse_lengths(text, option="--context")
    except ValueError as exc:
        fail(str(exc), code=2)
    if len(values) != 1:
        fail(f"--context: expected one length (e.g. 128k), got {text!r}", code=2)
    try:
        profile = with_context_length(profile, values[0])
    except ProfileError as exc:
        fail(f"--context {text}: {exc}", code=2)
    from fpcli.models import known_context_length

    default = _default_model(engine, one_request) if model is None and engine else None
    name = model if model is not None else (default.name if default is not None else None)
    native = known_context_length(name)
    if native:
        try:
            plan_context({"max_position_embeddings": native}, values[0], model=name)
        except ContextError as exc:
            fail(f"--context {text}: {exc}", code=2)
    return profile


def context_source(profile, context: str | None) -> str:
    """Who asked for the context, for error messages: ``--context 128k`` or the profile's key."""
    if context is not None:
        return f"--context {context}"
    return f"{profile.source or 'profile ' + profile.name}: engine.context_length"


def say_context(console: Console | None, engine) -> dict | None:
    """One line on ``console`` (stderr; ``None`` = quiet) when the engine extends its model with
    YaRN; returns the engine's context for the report (``ContextPlan.to_dict``), or ``None`` when
    the engine does not say."""
    plan = getattr(engine, "context_plan", None)
    if plan is None:
        return None
    line = plan.describe(getattr(engine, "model_name", "the model"))
    if line and console is not None:
        console.print(f"[dim]{escape(line)}[/]", highlight=False, soft_wrap=True)
    return plan.to_dict()


def check_max_new_tokens_or_exit(max_new_tokens: int, model: str | None, profile, context_length: int | None = None,
                                 engine: str = "auto", one_request: bool = False) -> None:
    """Exit 2 when ``--max-new-tokens`` leaves no room for a prompt in the context: before loading
    when that context is known (the profile's ``engine.context_length``, an embedded model, a
    Hugging Face folder, or the default model of ``engine``; ``one_request`` as in
    ``model_context``), else with the loaded engine's ``context_length``."""
    known = context_length or profile.engine.context_length
    if known is None:
        known = model_context(model, engine, one_request=one_request)
    if known and max_new_tokens >= known:
        fail(
            f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
            f"{known:,} tokens (the prompt needs most of it: e.g. -n {max(1, min(512, known // 4))})",
            code=2,
        )


def _default_model(engine: str, one_request: bool):
    """The model a command of ``engine`` (``--engine``) loads without ``--model``: the default
    of the engine that will run and its device (``fpcli.engine.default_for``; a resident engine's
    state file spares the CUDA probe; ``one_request``: the command sends one prompt,
    ``fpcli.engine.choose_engine``), or ``None`` when that is not known before loading."""
    try:
        from fpcli.engine import default_for
        from fpcli.server.state import running_state

        state = running_state()
        _, default = default_for(engine, running=state.engine if state else None, one_request=one_request,
                                 running_device=state.device if state else None)
        return default
    except Exception:  # noqa: BLE001 - unknown before loading: checked against the loaded engine
        return None


def model_context(model: str | None, engine: str, one_request: bool = False) -> int | None:
    """The context ``model`` runs at by default, if known before loading; for ``model=None`` the
    default model of the engine that will run and its device (``_default_model``). ``one_request``:
    the command sends one prompt (``fpcli.engine.choose_engine``)."""
    try:
        from fpcli.models import known_context_length

        if model is not None:
            return known_context_length(model)
        default = _default_model(engine, one_request)
        if default is None:
            return None
        return default.context_length or known_context_length(default.name)
    except Exception:  # noqa: BLE001 - unknown before loading: checked against the loaded engine
        return None


def check_output_path_or_exit(option: str, path) -> None:
    """Exit 2 unless ``path`` can be written: its folder exists and is writable, and it is not
    a folder itself (checked before the run, not after it)."""
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    try:
        if p.is_dir():
            fail(f"{option} {path}: is a folder; give a file name", code=2)
        if not parent.is_dir():
            fail(f"{option} {path}: the folder {parent} does not exist", code=2)
        if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            fail(f"{option} {path}: not writable (permission denied)", code=2)
    except OSError as exc:  # e.g. a name too long for the file system
        fail(f"{option} {path}: cannot be written ({exc.strerror or exc})", code=2)


def resident_setup_or_exit(profile: str, model: str | None, context: str | None, idle: str | None):
    """What ``fp start`` and ``fp serve`` check before anything starts: ``--idle``, the profile, the
    model, ``--context``, and the private runtime folder. Returns ``(profile, idle_s, paths)``;
    exits 2 on bad input, 1 when the folder cannot be prepared."""
    from fpcli.server.paths import PathsError, default_paths

    idle_s = parse_duration_or_exit("--idle", idle)
    prof = load_profile_or_exit(profile)
    check_model_or_exit(model)
    prof = context_or_exit(context, prof, model)
    try:
        paths = default_paths().ensure()
    except (PathsError, OSError) as exc:
        fail(f"cannot prepare the runtime folder: {exc}")
    return prof, idle_s, paths


def print_bad_paths(console: Console, problems: list[str], prefix: str = "") -> None:
    """One ``fp: error:`` line per bad path (``fpcli.ingest.check_paths``), e.g. ``--haystack: ``
    as ``prefix``; the caller exits 2 (after its own hints)."""
    for p in problems:
        error(console, prefix + p)


def save_report_or_exit(path, data: dict) -> None:
    """``fpcli.report.save_report``, or exit 1 with one line naming the file."""
    from fpcli.report import save_report

    try:
        save_report(path, data)
    except OSError as exc:
        fail(f"cannot write the report {path}: {exc.strerror or exc}")


def warn_precision(console: Console, profile, engine) -> None:
    """One line on stderr when the profile asks for an 8-bit precision (``fp8``, ``int8qk``) and the
    engine will not run it (it applies to the sparse prefill: a dense profile, or a resident engine
    started with another profile, runs at the model's dtype); the summary reports what ran. Engines
    refuse 8-bit profiles where the GPU cannot run them, before loading. (A bf16 profile running
    fp32 on the CPU is the documented CPU default, not worth a warning; the summary shows it.)"""
    from fpcli.engine.base import eight_bit, precision_family, precision_label

    ran = getattr(engine, "precision", None)
    asked = str(profile.precision)
    if ran and eight_bit(asked) and precision_family(ran) != asked:
        why = (f"{precision_label(asked)} applies to the sparse prefill and this profile is dense"
               if getattr(profile, "is_dense", False) else "this engine runs without it")
        warning(console, f"{asked} attention was requested (profile {profile.name}) but {why}; "
                         f"{ran} runs, and the summary reports {ran}")


def is_file(arg: str) -> bool:
    """``Path(arg).is_file()`` that is False, not an OSError, for a long question (ENAMETOOLONG)."""
    try:
        return Path(arg).is_file()
    except (OSError, ValueError):
        return False


def looks_like_question(arg: str) -> bool:
    """A 'file' name that is more likely the question: it has spaces or ends with '?'."""
    return " " in arg.strip() or arg.rstrip().endswith("?")


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_or_exit(option: str, text: str | None) -> float | None:
    """Seconds of ``10m``, ``90s``, ``1.5h``, ``2d`` or a bare number of seconds; ``None`` for
    ``None``, ``0``, ``never`` or ``off``. Exit 2 on anything else."""
    if text is None:
        return None
    t = text.strip().lower()
    if t in ("0", "never", "off", "none"):
        return None
    unit = DURATION_UNITS.get(t[-1:], None)
    number = t[:-1] if unit else t
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not value > 0:
        fail(f"{option} {text}: expected a duration such as 90s, 10m, 1h or never", code=2)
    return value


def obtain_engine(engine: str, model: str | None, profile, progress, no_server: bool, console: Console,
                  verbose: bool = False, timing: bool = False, compare_fp8: bool = False,
                  one_request: bool = False):
    """The engine for a command: the resident engine when one runs with the same model, profile
    and engine (``fpcli.server.client.connect``; warnings on ``console`` when it is stale or does
    not answer), else an in-process engine from ``engine_loader()``. ``no_server`` skips the
    resident engine. ``timing``: an in-process engine measures index / attention time per layer
    (the resident engine runs as it was started); ``compare_fp8``: an in-process engine also reports
    the 8-bit-vs-BF16 output error per layer of an ``fp8`` / ``int8qk`` profile (the resident engine
    does not). An in-process engine runs
    one request at a time (``max_requests=1``: one decode CUDA graph, a KV pool of one context).
    ``one_request``: the command sends a single prompt (``fp ask``, ``fp profile``), so ``"auto"``
    resolves to the transformers engine, which starts in one process (on the CUDA GPU when there is
    one; ``fpcli.engine.choose_engine``), unless a resident SGLang engine answers; and an in-process
    engine skips its start-up warm-up (``load_engine(warmup=False)``).
    The caller handles load errors (``fail``)."""
    if not no_server:
        from fpcli.server.client import connect

        remote = connect(
            model, profile, engine, one_request=one_request,
            warn=lambda m: warning(console, m),
            note=lambda m: note(console, m),
        )
        if remote is not None:
            return remote
    extra = {"compare_fp8": True} if compare_fp8 else {}
    if one_request:
        extra.update(warmup=False, one_request=True)
    # in-process, this command is the engine's only client, one request at a time
    return engine_loader()(engine, model, profile, progress=progress, verbose=verbose, timing=timing,
                           max_requests=1, **extra)


def engine_start_seconds(engine, t_load: float) -> float:
    """The seconds a command spent on its engine since ``t_load`` (``time.perf_counter()`` before
    ``obtain_engine``): the loader's wall time when it started one (``engine.start_s > 0``; model
    fetch and conversion included), or the wait for a resident engine that ``fp start`` was starting
    (``RemoteEngine.waited_s > 0``); 0.0 when a running resident engine answered at once."""
    import time

    started = engine.start_s > 0 or getattr(engine, "waited_s", 0.0) > 0
    return time.perf_counter() - t_load if started else 0.0


def server_of(engine) -> dict | None:
    """The report's ``server`` value: ``{"address", "pid", "engine_start_s": 0.0}`` when the resident
    engine answered (``RemoteEngine``), ``None`` for an in-process engine."""
    from fpcli.server.client import RemoteEngine

    return dict(engine.server) if isinstance(engine, RemoteEngine) else None


def render_answered_by(console: Console, engine) -> dict | None:
    """One dim line when the resident engine answered (its address and pid); returns ``server_of``."""
    server = server_of(engine)
    if server:
        console.print(f"[dim]answered by the resident engine at {escape(server['address'])} (pid {server['pid']}; "
                      "no engine start)[/]", highlight=False, soft_wrap=True)
    return server
