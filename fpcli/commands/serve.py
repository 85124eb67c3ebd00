"""``fp serve [SGLang args...]``: an SGLang server with the flashprefill attention backend."""
from __future__ import annotations

import importlib.util
from typing import Annotated

import typer

from fpcli.commands import FpCommand, fail, load_profile_or_exit

app = typer.Typer()

GPU_HINT = "install the GPU extras with `pip install -e .[gpu]` on a machine with a CUDA GPU"


@app.command(
    "serve",
    cls=FpCommand,
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def serve(
    ctx: typer.Context,
    profile: Annotated[str, typer.Option("--profile", "-p", help="bf16, fp8, dense, or a path; sets the backend and engine defaults.")] = "bf16",
) -> None:
    """Start an SGLang server whose prefill attention is FlashPrefill.

    Every other argument goes to SGLang unchanged, e.g. fp serve --model-path Qwen/Qwen3-8B --port 30000 --tp 2
    """
    prof = load_profile_or_exit(profile)
    if importlib.util.find_spec("sglang") is None:
        fail(f"fp serve needs SGLang, which is not installed: {GPU_HINT}")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        cuda = False
    if not cuda:
        fail(f"fp serve needs a CUDA GPU (none found): {GPU_HINT}")
    try:
        from fpcli.engine.sglang_engine import launch_server
    except ImportError as exc:
        fail(f"the SGLang engine is unavailable ({exc}): {GPU_HINT}")
    code = launch_server(list(ctx.args), prof)
    raise typer.Exit(code if isinstance(code, int) else 0)
