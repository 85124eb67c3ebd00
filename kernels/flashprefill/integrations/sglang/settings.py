"""Backend settings: what the ``flashprefill`` SGLang backend reads in the scheduler process.

SGLang starts its scheduler (one process per TP rank) with multiprocessing ``spawn``; nothing set
in the parent's Python objects reaches it, and SGLang's backend factory takes only the model
runner. The parent therefore serialises the frozen ``BackendSettings`` to JSON in the environment
variable ``FP_SGLANG_BACKEND`` before starting the engine (transport only: one variable carrying
the whole frozen configuration); spawned children inherit the environment, and the backend's
factory (``plugin.create_flashprefill_backend``) decodes it once per backend instance. Nothing
else of the backend or the operator reads the environment. Unset, the defaults apply (an SGLang
user who passes ``--prefill-attention-backend flashprefill`` alone).

Example::

    >>> s = BackendSettings(dense_layers=2)
    >>> BackendSettings.from_json(s.to_json()) == s
    True
    >>> s = BackendSettings(dense_layers=(0, 1, 8, 9))
    >>> BackendSettings.from_json(s.to_json()) == s, s.dense_layer(8), s.dense_layer(2)
    (True, True, False)
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...api import BACKENDS as OPERATOR_BACKENDS
from ...config import PRECISIONS, SparseConfig
from ...dense_layers import DenseLayers, dense_layer, dense_layers_problem, from_data

ENV_VAR = "FP_SGLANG_BACKEND"  # inline JSON, or "@/path/to/settings.json"
DENSE_BACKENDS = ("triton", "torch_native", "fa3", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class BackendSettings:
    """Knobs of the ``flashprefill`` backend (one engine, all layers, all requests).

    Attributes:
        sparse: the operator's method knobs (block size, sink/window/tail tokens, alpha, mean
            correction, min_sparse_len); ``flashprefill.SparseConfig``.
        dense_layers: the decoder layers that run dense attention (``flashprefill.dense_layers``):
            an int N = the first N layers (ids ``0 .. N-1``), or a tuple of layer ids (strictly
            increasing) = exactly those; ``dense_layer(layer_id)`` tells. JSON carries a tuple
            as a list; ``from_dict`` turns it back.
        precision: the attention operands of the sparse prefill, one of ``PRECISIONS``: ``bf16``,
            ``fp8`` or ``int8qk`` (``flashprefill_attention(precision=...)``; ``docs/fp8.md``). An
            e4m3 KV cache is read by ``fp8`` only: with ``bf16`` its layers run on the dense
            backend; ``fp``'s engine refuses ``int8qk`` with one before SGLang starts.
        dense_backend: the stock SGLang backend that runs every dense case (dense layers,
            batches of short requests only, sliding-window layers, unsupported KV pools) and
            decode when this backend is used alone.
        operator_backend: ``flashprefill_attention(backend=...)``, one of ``flashprefill.BACKENDS``:
            ``auto``, ``triton`` or ``reference``.
        collect_stats: record per-layer density and prefill time (device tensors and CUDA
            events; read by a writer thread after the forward).
        layer_timing: also time the index and attention stages of every sparse layer (three
            CUDA events per layer, the index built by ``build_index`` between the first two: at
            precision ``fp8`` / ``int8qk`` the index stage includes the attention's pre-pass, and
            the layer waits for the index before launching the attention, where the untimed path
            launches it first); off unless asked for.
        stats_dir: folder where the scheduler writes ``stats-<pid>.jsonl``; ``None`` = keep
            no stats on disk (they are still logged at debug level).
        debug_checks: validate the page table against ``req_to_token`` every batch (host
            syncs; for tests only).
        compare_fp8: with an 8-bit ``precision`` (``EIGHT_BIT_PRECISIONS``: ``fp8``, ``int8qk``),
            every sparse layer also runs the BF16 operator on the same inputs and the statistics
            carry the 8-bit-vs-BF16 output error sums per (request, KV head)
            (``integrations.fp8_error``; ``fp profile --fp8`` / ``--int8qk``). Needs a bf16 / fp16
            KV cache (an e4m3 cache has no BF16 path to compare with). Off by default.
        log_level: level of the ``flashprefill`` loggers in the scheduler processes (one of
            ``LOG_LEVELS``), and whether the plugin prints its registration lines before SGLang
            configures logging (only at ``debug`` / ``info``); ``None`` = leave logging as the
            host process configures it (an SGLang user's own ``--log-level``).
        scheduler_output: a file the scheduler processes append their stdout and stderr to (SGLang's
            log lines and its weight-loading progress bars, which pass ``disable=`` to tqdm
            explicitly and so ignore ``TQDM_DISABLE``); ``None`` = inherited from the host process
            (the terminal).
    """

    sparse: SparseConfig = field(default_factory=SparseConfig)
    dense_layers: DenseLayers = 0
    precision: str = "bf16"
    dense_backend: str = "triton"
    operator_backend: str = "auto"
    collect_stats: bool = True
    layer_timing: bool = False
    stats_dir: str | None = None
    debug_checks: bool = False
    compare_fp8: bool = False
    log_level: str | None = None
    scheduler_output: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sparse, SparseConfig):
            raise TypeError(f"BackendSettings.sparse must be a SparseConfig, got {type(self.sparse).__name__}")
        problem = dense_layers_problem(self.dense_layers)
        if problem:
            raise ValueError(f"BackendSettings.dense_layers: {problem}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"BackendSettings.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.dense_backend not in DENSE_BACKENDS:
            raise ValueError(
                f"BackendSettings.dense_backend must be one of {DENSE_BACKENDS}, got {self.dense_backend!r}"
            )
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            raise ValueError(f"BackendSettings.log_level must be None or one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.operator_backend not in OPERATOR_BACKENDS:
            raise ValueError(
                f"BackendSettings.operator_backend must be one of {OPERATOR_BACKENDS}, got {self.operator_backend!r}"
            )

    def dense_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` (0-based) runs dense because of ``dense_layers``."""
        return dense_layer(self.dense_layers, layer_id)

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sparse"] = dataclasses.asdict(self.sparse)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackendSettings":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"BackendSettings: unknown keys {unknown} (allowed: {sorted(known)})")
        kwargs = dict(data)
        if "dense_layers" in kwargs:
            kwargs["dense_layers"] = from_data(kwargs["dense_layers"])
        if "sparse" in kwargs and not isinstance(kwargs["sparse"], SparseConfig):
            sparse = dict(kwargs["sparse"] or {})
            bad = sorted(set(sparse) - set(SparseConfig.field_names()))
            if bad:
                raise ValueError(f"BackendSettings.sparse: unknown keys {bad} (allowed: {list(SparseConfig.field_names())})")
            kwargs["sparse"] = SparseConfig(**sparse)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "BackendSettings":
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> "BackendSettings":
        return dataclasses.replace(self, **changes)

    # -- environment ---------------------------------------------------------------------------
    def to_env(self) -> dict[str, str]:
        """The environment entries that carry these settings to spawned scheduler processes."""
        return {ENV_VAR: self.to_json()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "BackendSettings":
        """Settings from ``FP_SGLANG_BACKEND`` (inline JSON or ``@path``); defaults when unset.

        Raises:
            ValueError: naming the variable, when its JSON is malformed or has unknown keys.
        """
        env = os.environ if environ is None else environ
        raw = env.get(ENV_VAR, "").strip()
        if not raw:
            return cls()
        try:
            if raw.startswith("@"):
                with open(raw[1:], encoding="utf-8") as fh:
                    raw = fh.read()
            return cls.from_json(raw)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{ENV_VAR}: cannot read backend settings: {exc}") from exc
