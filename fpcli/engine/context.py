"""A model's context: its native length, and YaRN beyond it.

Both engines run a model at the context a profile asks for (``engine.context_length``, set by
``fp ask --context``). At or below the model's native context (``max_position_embeddings`` of its
``config.json``) that is a cap; above it the model's RoPE is extended with YaRN:

    factor F = ceil(requested / native)          e.g. 131072 / 32768 -> 4; 100000 / 32768 -> 4
    rope_scaling = {"rope_type": "yarn", "factor": F,
                    "original_max_position_embeddings": native, "rope_theta": theta}
    max_position_embeddings = requested

``rope_theta`` is inside ``rope_scaling`` because SGLang's scheduler reads it from there (without
it: KeyError 'rope_theta'). At most ``MAX_YARN_FACTOR`` times the native context: YaRN's quality
falls off beyond the factors models are published with (Qwen2.5 documents 4 for 128K).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

MAX_YARN_FACTOR = 8
DEFAULT_ROPE_THETA = 10000.0


class ContextError(ValueError):
    """A requested context the model cannot run at. One line: the request, the native context,
    the allowed range."""


@dataclass(frozen=True)
class ContextPlan:
    """The context a model runs at.

    Attributes:
        native: the model's ``max_position_embeddings`` in tokens (``None`` if its config lacks it).
        context: the context used, in tokens (prompt + answer).
        rope_scaling: the YaRN ``rope_scaling`` mapping when ``context > native``, else ``None``.
    """

    native: int | None
    context: int | None
    rope_scaling: dict | None = None

    @property
    def yarn_factor(self) -> float | None:
        return None if self.rope_scaling is None else float(self.rope_scaling["factor"])

    def override(self) -> dict:
        """Config fields to change (``json_model_override_args`` for SGLang, attributes of a
        transformers config): ``{}`` without YaRN."""
        if self.rope_scaling is None:
            return {}
        return {"rope_scaling": dict(self.rope_scaling), "max_position_embeddings": int(self.context)}

    def describe(self, model: str) -> str | None:
        """``extending M from 32,768 to 131,072 tokens with YaRN factor 4`` (``None`` without YaRN)."""
        if self.rope_scaling is None:
            return None
        return (f"extending {model} from {self.native:,} to {self.context:,} tokens with YaRN factor "
                f"{self.yarn_factor:g}")

    def to_dict(self) -> dict:
        """For the JSON report: ``native_context``, ``context``, ``rope_scaling``."""
        return {"native_context": self.native, "context": self.context,
                "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None}


def read_config(model_path: str | os.PathLike) -> dict:
    """``config.json`` of a Hugging Face folder as a dict (``{}`` when missing or unreadable)."""
    try:
        data = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def native_context_length(config: dict) -> int | None:
    """``max_position_embeddings`` of a model config (top level or ``text_config``), or ``None``."""
    text = config.get("text_config") or {}
    value = config.get("max_position_embeddings") or (text.get("max_position_embeddings") if isinstance(text, dict) else None)
    return int(value) if isinstance(value, int) and value > 0 else None


def rope_theta(config: dict) -> float:
    """The RoPE base: ``rope_theta`` at the top level, in ``rope_parameters`` (transformers 5),
    ``rope_scaling`` or ``text_config``; 10000 when none has it."""
    for src in (config, config.get("rope_parameters") or {}, config.get("rope_scaling") or {},
                config.get("text_config") or {}):
        if isinstance(src, dict) and src.get("rope_theta"):
            return float(src["rope_theta"])
    return DEFAULT_ROPE_THETA


def yarn_factor(requested: int, native: int) -> int:
    """``ceil(requested / native)``: 131072 / 32768 -> 4, 100000 / 32768 -> 4, 40000 / 32768 -> 2."""
    return max(2, math.ceil(requested / native))


def yarn_rope_scaling(native: int, factor: float, theta: float) -> dict:
    """The ``rope_scaling`` mapping of YaRN with ``factor`` over a native context of ``native``."""
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(native),
            "rope_theta": float(theta)}


def plan_context(config: dict, requested: int | None, model: str = "the model") -> ContextPlan:
    """The context to run a model with ``config`` at, given the ``requested`` tokens (``None`` =
    its native context).

    Raises:
        ContextError: ``requested`` exceeds the native context and the config has no
            ``max_position_embeddings``, or exceeds ``MAX_YARN_FACTOR`` x native.
    """
    native = native_context_length(config)
    if requested is None:
        return ContextPlan(native, native)
    requested = int(requested)
    if native is None:
        raise ContextError(f"cannot extend {model} to {requested:,} tokens: its config.json has no "
                           "max_position_embeddings")
    if requested <= native:
        return ContextPlan(native, requested)
    if requested > MAX_YARN_FACTOR * native:
        raise ContextError(
            f"context {requested:,} tokens is too long for {model}: at most {MAX_YARN_FACTOR * native:,} "
            f"({MAX_YARN_FACTOR}x its native {native:,} with YaRN)"
        )
    factor = yarn_factor(requested, native)
    return ContextPlan(native, requested, yarn_rope_scaling(native, factor, rope_theta(config)))
