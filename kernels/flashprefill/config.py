"""Method knobs of FlashPrefill V2 (``docs/method.md`` sections 3 and 4).

One frozen dataclass, validated at construction; loaded from ``profiles/*.yaml`` by the CLI; plus
the Triton kernels' capability constants (dtypes, head dims). Kernel tile choices live elsewhere
(``impl/triton/tiles.py::get_config``), never here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


SUPPORTED_BLOCK_SIZES = (64, 128)
THRESHOLD_MAX = ("scored", "prunable")  # SparseConfig.threshold_max (docs/method.md section 3.4)
BLOCK_SCORES = ("energy", "mass")  # SparseConfig.block_score (docs/method.md section 3.3)

# What the Triton kernels take (``impl/triton/``). Kept here, in a module that does not
# import triton, so ``api.py`` (``backend="auto"``) and callers can test it without the kernels.
TRITON_HEAD_DIMS = (64, 128, 256)
# Attention operand precisions (``precision=`` of the API; semantics of "fp8" in docs/fp8.md).
PRECISIONS = ("bf16", "fp8", "int8qk")
EIGHT_BIT_PRECISIONS = ("fp8", "int8qk")  # precisions that run the 8-bit kernels (docs/fp8.md)
# FP8 on a GPU: e4m3 tensor cores need compute capability 8.9 (Ada) or newer (Hopper, Blackwell);
# head dims the FP8 kernels take (a multiple of the 32-wide k step of an 8-bit MMA).
FP8_MIN_CAPABILITY = (8, 9)
FP8_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse prefill settings. All lengths are in tokens.

    Attributes:
        block_size: key block size ``B`` (``docs/method.md`` section 3.1). 128 by default; 64 also supported.
        sink_tokens: the key blocks covering KV positions ``[0, sink_tokens)`` are always kept
            (section 3.5).
        window_tokens: every query row keeps the blocks covering its last ``window_tokens``
            visible KV positions (section 3.5); always includes the diagonal block. >= 1.
        dense_tail_tokens: the last ``dense_tail_tokens`` query tokens of each request attend
            densely; a query tile holding any of them is dense (section 3.5).
        alpha: max-based threshold, keep scored block ``j`` iff ``E_j >= alpha * max E``
            (section 3.4). In ``[0, 1]``; 0 keeps every scored block (dense), larger is sparser.
        mean_correction: fold every pruned block fully visible to the whole tile back in as
            ``n_j`` copies of its mean key/value (section 4).
        min_sparse_len: requests with fewer new query tokens ``Lq`` than this run dense.
        threshold_max: which blocks' largest energy the threshold is relative to (section 3.4):
            ``"scored"`` (every scored block, the method as published) or ``"prunable"`` (only the
            scored blocks that sink, local window and dense tail do not keep anyway, so that an
            attention-sink or local block does not set the bar for the blocks the threshold decides).
        block_score: how a tile scores a block (section 3.3): ``"energy"`` (``E_j = Σ_ρ exp(ℓ(ρ, j) -
            M)``, the method as published: the rows with the largest logits dominate) or ``"mass"``
            (``Σ_ρ softmax_ρ(ℓ)_j``: each row's attention distribution over the block means it
            decides, summed over the tile's rows, so every (token, head) row weighs the same).
        global_keys: per request and KV head, the number of "vertical" keys that every query tile
            attends exactly where their block is pruned (section 4.1, an option of ours, not in the
            published method; 0, the default, is the method as published). A pruned block then
            folds back only its other keys. Reference backend only for now (``backend="auto"``
            runs it; ``"triton"`` raises).
        global_queries: how many query tokens, spread evenly over the request's body, rank the
            keys for ``global_keys`` (their attention mass summed per key, section 4.1). >= 1.

    Raises:
        ValueError: naming the field, when a value is out of range.
        TypeError: naming the field, when a value has the wrong type.
    """

    block_size: int = 128
    sink_tokens: int = 256
    window_tokens: int = 512
    dense_tail_tokens: int = 256
    alpha: float = 0.1
    mean_correction: bool = True
    min_sparse_len: int = 0
    threshold_max: str = "scored"
    block_score: str = "energy"
    global_keys: int = 0
    global_queries: int = 64

    def __post_init__(self) -> None:
        for name in ("block_size", "sink_tokens", "window_tokens", "dense_tail_tokens", "min_sparse_len", "global_keys",
                     "global_queries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SparseConfig.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 0:
                raise ValueError(f"SparseConfig.{name} must be >= 0, got {value}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"SparseConfig.block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}"
            )
        if self.window_tokens < 1:
            raise ValueError(f"SparseConfig.window_tokens must be >= 1, got {self.window_tokens}")
        if self.global_queries < 1:
            raise ValueError(f"SparseConfig.global_queries must be >= 1, got {self.global_queries}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)):
            raise TypeError(f"SparseConfig.alpha must be a float, got {type(self.alpha).__name__} {self.alpha!r}")
        if not (0.0 <= float(self.alpha) <= 1.0):
            raise ValueError(f"SparseConfig.alpha must be in [0, 1], got {self.alpha}")
        if self.threshold_max not in THRESHOLD_MAX:
            raise ValueError(f"SparseConfig.threshold_max must be one of {THRESHOLD_MAX}, got {self.threshold_max!r}")
        if self.block_score not in BLOCK_SCORES:
            raise ValueError(f"SparseConfig.block_score must be one of {BLOCK_SCORES}, got {self.block_score!r}")
        if not isinstance(self.mean_correction, bool):
            raise TypeError(
                f"SparseConfig.mean_correction must be a bool, got {type(self.mean_correction).__name__}"
            )

    def replace(self, **changes) -> "SparseConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def differences(self, other: "SparseConfig | None" = None) -> dict[str, Any]:
        """The settings of this config that differ from ``other``'s (default: ``SparseConfig()``),
        as ``{field: this config's value}`` in field order; empty when they are equal.

        >>> SparseConfig(alpha=0.05, sink_tokens=512).differences()
        {'sink_tokens': 512, 'alpha': 0.05}

        Raises:
            TypeError: ``other`` is not a ``SparseConfig``.
        """
        if other is None:
            other = SparseConfig()
        if not isinstance(other, SparseConfig):
            raise TypeError(f"SparseConfig.differences: other must be a SparseConfig, got {type(other).__name__}")
        return {name: getattr(self, name) for name in self.field_names() if getattr(self, name) != getattr(other, name)}


def setting_text(settings: Mapping[str, Any]) -> str:
    """One line for a few settings, "name value" joined by ", ": ints with thousands separators,
    booleans in lower case (as in a profile's YAML), e.g. ``SparseConfig.differences`` ->
    ``"sink_tokens 512, window_tokens 1,024, alpha 0.05, block_score mass"``; ``""`` for none.

    >>> setting_text({"window_tokens": 1024, "mean_correction": False})
    'window_tokens 1,024, mean_correction false'
    """
    def value_text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    return ", ".join(f"{name} {value_text(value)}" for name, value in settings.items())


def __getattr__(name: str):
    """``TRITON_DTYPES`` (``(torch.bfloat16, torch.float16)``: what the Triton kernels take) on first
    use, so that importing this module (profiles, the CLI's client path) does not import torch."""
    if name == "TRITON_DTYPES":
        import torch

        return (torch.bfloat16, torch.float16)
    raise AttributeError(f"module 'flashprefill.config' has no attribute {name!r}")
