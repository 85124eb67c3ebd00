"""The engine contract every backend of ``fp`` implements (transformers on CPU/GPU, SGLang on GPU).

Data path: document -> prompt (token ids) -> ``Engine.generate`` -> ``GenerationResult`` -> report.
"""
from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Callable, Protocol, runtime_checkable

from flashprefill.config import EIGHT_BIT_PRECISIONS


def dense_prefill_stats(prompt_tokens: int, layers: int, q_heads: int, kv_heads: int, head_dim: int) -> "PrefillStats":
    """``PrefillStats`` of a prefill that ran dense in every layer (the ``dense`` profile on an
    engine that records nothing per layer): density 1.0 everywhere and the dense-equivalent FLOPs
    ``layers * flashprefill.flops.dense_causal_flops(n, n, head_dim, q_heads)``, none skipped."""
    from flashprefill.flops import dense_causal_flops  # here: the package imports torch (client path)

    return PrefillStats(
        density=1.0,
        density_per_layer=[1.0] * layers,
        density_per_layer_head=[[1.0] * kv_heads for _ in range(layers)],
        attention_flops_dense=layers * dense_causal_flops(prompt_tokens, prompt_tokens, head_dim, q_heads),
    )


FP8_SPARSE = "fp8 (sparse layers)"  # GenerationResult.precision when the sparse prefill ran FP8
SPARSE_LAYERS = " (sparse layers)"  # what follows an 8-bit precision in GenerationResult.precision


def ran_precision(model_precision: str, eight_bit_layers: int, precision: str = "fp8") -> str:
    """``GenerationResult.precision`` of a prefill: ``"<precision> (sparse layers)"`` (``FP8_SPARSE``
    for ``"fp8"``, ``"int8qk (sparse layers)"``) when ``eight_bit_layers`` (sparse layers that ran
    the 8-bit ``precision``, one of ``EIGHT_BIT_PRECISIONS``) > 0, else ``model_precision`` (the
    dtype every layer ran at).

    >>> ran_precision("bf16", 3, "int8qk"), ran_precision("bf16", 0, "int8qk"), ran_precision("fp32", 2)
    ('int8qk (sparse layers)', 'bf16', 'fp8 (sparse layers)')

    Raises:
        ValueError: ``precision`` is not an 8-bit precision while ``eight_bit_layers`` > 0.
    """
    if eight_bit_layers <= 0:
        return model_precision
    if not eight_bit(precision):
        raise ValueError(f"ran_precision: {precision!r} is not one of {EIGHT_BIT_PRECISIONS}")
    return precision + SPARSE_LAYERS


def precision_family(precision: str) -> str:
    """``"fp8 (sparse layers)"`` -> ``"fp8"``; ``"bf16"`` -> ``"bf16"`` (compare with a profile's)."""
    return precision.split(" ", 1)[0]


def eight_bit(precision: str | None) -> bool:
    """Whether ``precision`` (a profile's, ``"int8qk"``, or what ran, ``"fp8 (sparse layers)"``) is
    one that runs the 8-bit kernels (``flashprefill.config.EIGHT_BIT_PRECISIONS``: ``fp8``,
    ``int8qk``; ``docs/fp8.md``). What they share: the FP8 GPU gate, the comparison with BF16
    (``compare_fp8``), the BF16 twin in ``fp eval``. Only ``fp8`` reads an e4m3 KV cache.

    >>> eight_bit("int8qk"), eight_bit("fp8 (sparse layers)"), eight_bit("bf16"), eight_bit(None)
    (True, True, False, False)
    """
    return precision_family(str(precision or "")) in EIGHT_BIT_PRECISIONS


def precision_label(precision: str) -> str:
    """A profile precision as messages write it: ``FP8``, ``BF16``; ``int8qk`` as it is."""
    return {"fp8": "FP8", "bf16": "BF16"}.get(precision, precision)


def check_fp8_profile(profile, device, head_dim: int) -> None:
    """Refuse, before any work, a profile whose sparse prefill asks for an 8-bit precision
    (``eight_bit``: ``fp8``, ``int8qk``) where its kernels cannot run
    (``flashprefill.api.check_fp8_support``, the gate of both: a CUDA GPU below compute capability
    8.9, or a head dim outside ``FP8_HEAD_DIMS``). Nothing for other profiles or the CPU (the
    reference runs both).

    Raises:
        ValueError: one line naming the profile, the precision, the GPU or the head dim, and that the
            ``bf16`` profile would run.
    """
    precision = str(getattr(profile, "precision", "bf16"))
    if getattr(profile, "is_dense", False) or not eight_bit(precision):
        return
    from flashprefill.api import check_fp8_support

    try:
        check_fp8_support(device, int(head_dim))
    except ValueError as exc:
        raise ValueError(f"profile {profile.name} asks for {precision_label(precision)} attention, which cannot run "
                         f"here: {exc} (the bf16 profile would run: --profile bf16)") from None


@dataclass
class PrefillStats:
    """Attention statistics of one prefill.

    Attributes:
        density: selected / causally visible key blocks over the sparse layers only
            (``sparse_layers``; 1.0 when no layer ran sparse).
        density_per_layer: one value per decoder layer (dense layers report 1.0).
        sparse_layers: indices of the layers that ran block-sparse (the others ran dense).
        density_per_layer_head: ``[layer][kv_head]`` densities, when collected.
        attention_flops_dense: dense-equivalent causal attention FLOPs of this prefill.
        attention_flops_skipped: FLOPs the block-sparse path did not compute, over all layers:
            ``sum_l flops_l * (1 - density_l)`` with dense layers skipping none, so the skipped
            fraction is below ``1 - density`` when some layers run dense.
        index_ms: time in the index stage (``build_index``) summed over the sparse layers (ms), when
            measured; ``None`` when not measured or no layer ran sparse.
        attention_ms: time in the sparse attention summed over the sparse layers (ms), when
            measured; a prefill with no sparse layer: its dense attention summed over all layers
            (the transformers engine times it; SGLang's backend does not). Dense layers of a
            sparse prefill are in neither total.
        index_ms_per_layer, attention_ms_per_layer: the same per sparse layer (ms), one entry per
            layer of ``sparse_layers`` in that order (a layer prefilled in several chunks: the sum
            over its chunks); ``[]`` when not measured. Their sums are ``index_ms`` and
            ``attention_ms``. Times are GPU time between CUDA events (the host's gaps between the
            stage's launches included; a layer whose kernels were compiled during the prefill
            carries that one-time cost), wall time on the CPU.
        fp8_rel_l2_per_layer: per decoder layer, the relative L2 error of the 8-bit attention output
            (the profile's ``fp8`` or ``int8qk``, ``eight_bit``) against the BF16 operator's on the
            same prefill inputs; ``None`` for layers that did not run it (dense layers); an empty
            list when the engine was not asked to compare (an engine setting, ``compare_fp8``).
        fp8_rel_l2_per_layer_head: ``[layer][kv_head]`` of the same; ``[]`` for layers without.
    """

    density: float = 1.0
    density_per_layer: list[float] = field(default_factory=list)
    density_per_layer_head: list[list[float]] = field(default_factory=list)
    sparse_layers: list[int] = field(default_factory=list)
    attention_flops_dense: float = 0.0
    attention_flops_skipped: float = 0.0
    index_ms: float | None = None
    attention_ms: float | None = None
    index_ms_per_layer: list[float] = field(default_factory=list)
    attention_ms_per_layer: list[float] = field(default_factory=list)
    fp8_rel_l2_per_layer: list[float | None] = field(default_factory=list)
    fp8_rel_l2_per_layer_head: list[list[float]] = field(default_factory=list)


DECODE_GRAPH = "cuda graph"
DECODE_EAGER = "eager"


def decode_mode(output_tokens: int, graph: bool) -> str | None:
    """``GenerationResult.decode_mode`` of an answer of ``output_tokens`` tokens whose decode steps
    ran through a CUDA graph (``graph``) or eagerly; ``None`` when there was no decode step (the
    first token comes from the prefill).

    >>> decode_mode(12, True), decode_mode(12, False), decode_mode(1, True)
    ('cuda graph', 'eager', None)
    """
    if output_tokens < 2:
        return None
    return DECODE_GRAPH if graph else DECODE_EAGER


@dataclass
class GenerationResult:
    """One answer and its timings. Times in seconds unless the name says ms.

    ``precision`` is the attention precision that actually ran: the model's dtype (``bf16``,
    ``fp16``, ``fp32``) when every layer ran at it, or ``FP8_SPARSE`` (``"fp8 (sparse layers)"``,
    ``"int8qk (sparse layers)"``: ``ran_precision``) when the sparse layers ran an 8-bit precision
    (dense layers and prefills shorter than
    ``min_sparse_len`` always run the stock path at the model's dtype). Use
    ``precision_family`` to compare it with a profile's ``precision``.

    ``cached_tokens``: prompt tokens served from the KV cache of an earlier request (a shared
    token prefix, e.g. the same documents with another question); only the other
    ``prompt_tokens - cached_tokens`` were prefilled.

    ``queued_s``: seconds the request waited in the resident engine's queue before its engine took
    it (set by the server; 0 in-process). ``ttft_s`` and ``total_s`` start when the engine took it.

    ``device``: where the attention ran, ``"cpu"`` or ``"cuda"`` (``None``: the engine does not
    say); on the CPU the sparse path is the PyTorch reference, which computes every block.

    ``decode_mode``: how the decode steps after the first token ran: ``DECODE_GRAPH`` (a captured
    CUDA graph replayed per step) or ``DECODE_EAGER`` (one forward launched per step); ``None`` when
    no decode step ran (an answer of one token) or the engine does not say.
    """

    text: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # submission to first answer token
    prefill_s: float  # the prefill forward alone
    total_s: float
    engine: str
    model: str
    profile: str
    stats: PrefillStats = field(default_factory=PrefillStats)
    finish_reason: str = "length"
    precision: str = "bf16"
    cached_tokens: int = 0
    queued_s: float = 0.0
    device: str | None = None
    decode_mode: str | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.total_s - self.ttft_s
        return (self.output_tokens - 1) / decode_s if self.output_tokens > 1 and decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["decode_tokens_per_s"] = self.decode_tokens_per_s
        return d

    @classmethod
    def from_dict(cls, data: dict) -> "GenerationResult":
        """The inverse of ``to_dict`` (derived and unknown keys are ignored).

        Raises:
            KeyError: a required field is missing.
        """
        names = {f.name for f in fields(cls)}
        kept = {k: v for k, v in data.items() if k in names}
        stats = kept.pop("stats", None) or {}
        stat_names = {f.name for f in fields(PrefillStats)}
        missing = [f.name for f in fields(cls) if f.name not in kept and f.name != "stats"
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise KeyError(f"GenerationResult fields missing: {', '.join(missing)}")
        return cls(**kept, stats=PrefillStats(**{k: v for k, v in stats.items() if k in stat_names}))


@runtime_checkable
class Engine(Protocol):
    """A loaded model that answers prompts. Use as a context manager; ``close`` must be prompt."""

    name: str  # "transformers" or "sglang"
    model_name: str
    precision: str  # attention precision that runs (see GenerationResult.precision)
    context_length: int  # max positions the model accepts (prompt + answer)
    start_s: float  # seconds this process spent starting the engine; 0.0 for an already running (resident) one
    model_path: str | None  # the model's local folder (its tokenizer files identify cached prompt fits); None: none

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        """Token ids of a chat prompt built with the model's own chat template (generation prompt added)."""

    def count_tokens(self, text: str) -> int:
        """Tokens of ``text`` alone (no template)."""

    def token_starts(self, text: str) -> list[int]:
        """Character offset where each token of ``text`` begins (no template); its length is
        ``count_tokens(text)`` (``fpcli.engine.tokens.token_starts``)."""

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_cached: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Greedy when ``temperature == 0``; streams decoded text pieces to ``on_text``.

        ``on_progress(done, total)`` is called during the prefill where the engine can observe it
        (``done`` of ``total`` units, e.g. decoder layers; engines that cannot may never call it).
        ``on_cached(tokens)`` is called once before the prefill by an engine that knows then how
        many prompt tokens its KV cache serves (only ``len(prompt_ids) - tokens`` are prefilled);
        an engine that learns it only after the prefill (SGLang) never calls it, and
        ``GenerationResult.cached_tokens`` says it.
        An exception raised by ``on_text`` or ``on_progress`` (a cancelled request) stops the
        generation at that step and propagates."""

    def close(self) -> None: ...

    def __enter__(self) -> "Engine": ...

    def __exit__(self, *exc) -> None: ...
