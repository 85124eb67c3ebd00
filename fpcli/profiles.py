"""Run profiles: named YAML files that carry the method configuration and the engine settings.

A profile is a built-in ``fpcli/builtin_profiles/<name>.yaml`` (``bf16``, ``accurate``, ``fp8``, ``dense``;
package data, read with ``importlib.resources``) or any YAML path; ``NAME+fp8`` / ``NAME+int8qk`` /
``NAME+bf16`` is that profile at another precision (``with_precision``), a rule, not a file. The schema is documented in ``docs/profiles.md``; every key but ``name`` is optional
and defaults to the values of ``DEFAULTS`` below. A wrong key or value raises ``ProfileError``
naming the file, the key and what is allowed.

Example::

    >>> p = load_profile("bf16")
    >>> p.sparse.alpha
    0.05
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from flashprefill.config import PRECISIONS, SparseConfig, setting_text
from flashprefill.dense_layers import DenseLayers, dense_layer, dense_layers_text, from_data, to_data

ATTENTIONS = ("flashprefill", "dense")
DTYPES = ("auto", "bfloat16", "float16", "float32")
MIN_CHUNKED_PREFILL = 8192
MIN_CONTEXT_LENGTH = 256
MAX_CONTEXT_LENGTH = 1 << 20  # 1,048,576 tokens; a model's own limit (YaRN <= 8x native) comes later
TOP_KEYS = ("name", "description", "attention", "precision", "dense_layers", "sparse", "engine")
RENAMED_KEYS = {"operator": "sparse"}  # old top-level key -> its name now
BUILTIN_DIR = "builtin_profiles"  # package data of fpcli


class ProfileError(ValueError):
    """A profile that cannot be found or does not follow the schema. One line, names file and key."""


@dataclass(frozen=True)
class EngineSettings:
    """Serving settings. SGLang uses all of them; the transformers engine uses ``dtype`` and
    ``context_length``.

    Attributes:
        chunked_prefill_size: tokens per prefill chunk, >= 8192 (shorter chunks cost accuracy:
            the dense tail applies to every chunk, ``docs/method.md`` section 3.5).
        page_size: KV cache page size in tokens, >= 1.
        mem_fraction_static: share of GPU memory for weights and KV cache, in (0, 1).
        cuda_graph_decode: capture decode steps in CUDA graphs.
        cuda_graph_max_bs: largest decode batch captured in a CUDA graph, >= 1 (SGLang captures
            1, 2, 4, ..., this; larger batches run without a graph). Small for one local user:
            each captured size costs start-up time.
        dtype: weight dtype, one of ``DTYPES``; ``auto`` = the model's own (bf16 on GPU).
        context_length: the context to run the model at, in tokens (256 .. 1,048,576):
            a cap at or below the model's native context, YaRN beyond it; ``None`` = the model's own.
        max_requests: requests the engine runs at once, >= 1 (SGLang ``max_running_requests``;
            more wait in its queue). Also caps the decode CUDA-graph batch sizes and sizes the KV
            cache pool. A command that asks one question in-process runs with 1.
        kv_cache_tokens: KV cache pool size in tokens (SGLang ``max_total_tokens``), >= 256;
            ``None`` = ``context_length x max_requests`` (``fpcli.engine.sglang_engine.
            kv_pool_tokens``), never more than ``mem_fraction_static`` allows.
    """

    chunked_prefill_size: int = 16384
    page_size: int = 64
    mem_fraction_static: float = 0.85
    cuda_graph_decode: bool = True
    cuda_graph_max_bs: int = 8
    dtype: str = "auto"
    context_length: int | None = None
    max_requests: int = 8
    kv_cache_tokens: int | None = None


@dataclass(frozen=True)
class Profile:
    """One run profile. Build with ``load_profile``; frozen, validated.

    Attributes:
        name: the profile's name (``bf16``, ``fp8``, ``dense`` or the user's).
        description: one line for humans.
        attention: ``flashprefill`` (block-sparse prefill) or ``dense``.
        precision: the attention operands of the sparse prefill, one of ``PRECISIONS``: ``bf16``,
            ``fp8`` (e4m3 operands) or ``int8qk`` (int8 Q and K for the block scoring and the
            logits, e4m3 P and V; ``docs/fp8.md``).
        dense_layers: the decoder layers that always attend densely (``flashprefill.dense_layers``;
            parsed by ``parse_dense_layers``): an int N = the first N layers; a sorted tuple of
            layer ids = exactly those (a set that is ``0 .. N-1`` is kept as the int N).
            ``dense_layer(i)`` tells whether layer ``i`` is one; ``dense_layers_text`` writes it.
        sparse: the method configuration (``flashprefill.SparseConfig``; YAML key ``sparse``).
        engine: serving settings.
        source: the YAML file it came from (``None`` when built in code).
    """

    name: str
    description: str = ""
    attention: str = "flashprefill"
    precision: str = "bf16"
    dense_layers: DenseLayers = 0
    sparse: SparseConfig = field(default_factory=SparseConfig)
    engine: EngineSettings = field(default_factory=EngineSettings)
    source: Path | None = None

    def sparse_config(self) -> SparseConfig:
        """The method configuration (``flashprefill.SparseConfig``); meaningful when ``attention``
        is ``flashprefill``, see ``is_dense``."""
        return self.sparse

    @property
    def is_dense(self) -> bool:
        return self.attention == "dense"

    def dense_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (0-based) is one of ``dense_layers`` (it runs dense
        whatever the prompt length; ``flashprefill.dense_layers.dense_layer``)."""
        return dense_layer(self.dense_layers, layer)

    @property
    def dense_layers_text(self) -> str:
        """``dense_layers`` for messages: ``"12"`` or ``"[0-1, 8-11]"``."""
        return dense_layers_text(self.dense_layers)

    def fit_to_context(self, context_length: int) -> "Profile":
        """This profile with ``sparse.min_sparse_len`` lowered to ``sparse_threshold(...,
        context_length)`` for a model of ``context_length`` tokens (the same profile when nothing
        changes; idempotent). The engines apply it when they load a model."""
        msl = sparse_threshold(self.sparse.min_sparse_len, context_length)
        if msl == self.sparse.min_sparse_len:
            return self
        return dataclasses.replace(self, sparse=dataclasses.replace(self.sparse, min_sparse_len=msl))

    def fit_to_model(self, native_context: int | None) -> "Profile":
        """``fit_to_context`` of the context the sparse threshold follows (docs/profiles.md, "The
        sparse threshold fits the model"): the model's native context (``max_position_embeddings``,
        tokens) capped by ``engine.context_length``; either alone when the other is unknown
        (``None``); this profile when both are.

        >>> Profile("p", sparse=SparseConfig(min_sparse_len=8192)).fit_to_model(8192).sparse.min_sparse_len
        4096
        """
        context = threshold_context(native_context, self.engine.context_length)
        return self.fit_to_context(context) if context else self

    def replace(self, **changes: Any) -> "Profile":
        """A copy with top-level fields changed, e.g. ``p.replace(precision="fp8")``."""
        new = dataclasses.replace(self, **changes)
        _check_choice(new.source, "precision", new.precision, PRECISIONS)
        _check_choice(new.source, "attention", new.attention, ATTENTIONS)
        return new

    def to_dict(self) -> dict:
        """Plain data (the YAML schema), plus ``source`` as a string."""
        d = dataclasses.asdict(self)
        d["source"] = str(self.source) if self.source else None
        return d


def sparse_threshold(min_sparse_len: int, context_length: int) -> int:
    """The prefill length (tokens) from which a model of ``context_length`` tokens runs sparse:
    ``min(min_sparse_len, context_length // 2)``.

    A profile's ``min_sparse_len`` is tuned for long-context models on the GPU (8192: sparse was
    slower than dense below 8K on the H200). On a model whose whole context is 8K that would
    never run sparse, so the threshold is capped at half the context: prompts in the upper half
    of a small model's context run sparse, and a 32K+ model keeps 8192.

    >>> sparse_threshold(8192, 8192), sparse_threshold(8192, 32768), sparse_threshold(0, 8192)
    (4096, 8192, 0)
    """
    return min(int(min_sparse_len), int(context_length) // 2)


def threshold_context(native_context: int | None, context_length: int | None) -> int | None:
    """The context (tokens) that ``min_sparse_len`` is fitted to (``Profile.fit_to_model``, the
    engines' rule, docs/profiles.md "The sparse threshold fits the model"): the smaller of the
    model's native context and the context the engine runs at (``--context``, YaRN); either alone
    when the other is unknown (``None``); ``None`` when both are.

    >>> threshold_context(8192, 16384), threshold_context(32768, 131072), threshold_context(None, 4096)
    (8192, 32768, 4096)
    """
    known = [int(c) for c in (native_context, context_length) if c]
    return min(known) if known else None


def sparse_settings(profile: Profile, context_length: int | None, native_context: int | None = None) -> dict | None:
    """The sparse settings a run of ``profile`` on a model of ``context_length`` tokens uses: every
    ``SparseConfig`` field after ``fit_to_context`` (``min_sparse_len`` as run, tokens), plus
    ``dense_layers`` (an int, or a list of layer ids: ``flashprefill.dense_layers.to_data``) and
    ``min_sparse_len_requested`` (the profile's own, larger when capped to half
    the context). ``None`` for a dense profile. ``context_length`` (the engine's) and
    ``native_context`` (the model's own): fitted to ``threshold_context`` of the two, as the engines
    fit it; both ``None``: not fitted.

    >>> sparse_settings(Profile("p", sparse=SparseConfig(min_sparse_len=8192)), 8192)["min_sparse_len"]
    4096
    """
    if profile.is_dense:
        return None
    context = threshold_context(native_context, context_length)
    run = profile.fit_to_context(context) if context else profile
    settings = dataclasses.asdict(run.sparse)
    settings["dense_layers"] = to_data(profile.dense_layers)  # an int, or a list of layer ids
    settings["min_sparse_len_requested"] = int(profile.sparse.min_sparse_len)
    return settings


def sparse_cap_note(profile: Profile, context_length: int | None, native_context: int | None = None) -> str | None:
    """One line when the engines' fit (``threshold_context`` of ``native_context``, the model's own
    context, and ``context_length``, the context the engine runs at, tokens) lowered ``profile``'s
    ``min_sparse_len``: "min_sparse_len 8,192 capped to 4,096: half the 8,192-token context it runs
    at", or "... half the model's own 8,192-token context (it runs at 16,384 with YaRN)" when the
    native context is the smaller; else ``None``."""
    context = threshold_context(native_context, context_length)
    if profile.is_dense or not context:
        return None
    requested = int(profile.sparse.min_sparse_len)
    run = sparse_threshold(requested, context)
    if run == requested:
        return None
    head = f"min_sparse_len {requested:,} capped to {run:,}: half the"
    if context_length and context < int(context_length):
        return f"{head} model's own {context:,}-token context (it runs at {int(context_length):,} with YaRN)"
    return f"{head} {context:,}-token context it runs at"


def sparse_differences(settings: dict | None, base: Profile) -> list[str]:
    """The settings of ``settings`` (``sparse_settings``) that differ from ``base``'s (the built-in
    ``bf16`` in the summary), each as "key value" ("block_score mass", "alpha 0.1"); the profile's
    ``min_sparse_len`` is compared as requested (the cap to the context is the same for both).
    Empty for ``None`` (dense) or a dense ``base``."""
    if settings is None or base.is_dense:
        return []
    ref = dict(dataclasses.asdict(base.sparse), dense_layers=base.dense_layers)
    out = []
    for key, value in settings.items():
        if key == "min_sparse_len":
            continue
        name = "min_sparse_len" if key == "min_sparse_len_requested" else key
        if name == "dense_layers":  # a set: a tuple in process, a list read from JSON
            value = from_data(value)
            if name in ref and value != ref[name]:
                out.append(setting_text({name: value if isinstance(value, int) else dense_layers_text(value)}))
        elif name in ref and value != ref[name]:
            out.append(setting_text({name: value}))
    return out


def profiles_dir() -> Path:
    """The built-in profiles: ``fpcli/builtin_profiles/*.yaml``, package data of the installed
    ``fpcli`` (found with ``importlib.resources``, editable install or wheel alike).

    Raises:
        ProfileError: the folder is missing (a broken installation).
    """
    path = Path(str(importlib.resources.files("fpcli") / BUILTIN_DIR))
    if not path.is_dir():
        raise ProfileError(
            f"built-in profiles not found: {path} is missing (a broken installation of fp: reinstall it); "
            "pass --profile PATH/TO/profile.yaml instead"
        )
    return path


def builtin_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.stem for p in profiles_dir().glob("*.yaml"))


def profile_file(profile: "Profile") -> str | None:
    """The YAML file ``profile`` was loaded from when it is not a built-in profile (a user's file,
    which may carry a built-in's name), else ``None``."""
    if profile.source is None:
        return None
    if Path(profile.source).resolve().parent == profiles_dir().resolve():
        return None
    return str(profile.source)


def resolve_profile_path(name_or_path: str | Path) -> Path:
    """``bf16`` -> ``<fpcli>/builtin_profiles/bf16.yaml``; an existing path is returned as is.

    Raises:
        ProfileError: no such built-in profile or file, or the path is a directory.
    """
    text = str(name_or_path)
    candidate = Path(text).expanduser()
    looks_like_path = text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text
    not_a_file = f"profile {text}: is a directory; give a profile .yaml file or a built-in name"
    if looks_like_path:
        if candidate.is_dir():
            raise ProfileError(not_a_file)
        if not candidate.is_file():
            raise ProfileError(f"profile file not found: {text}")
        return candidate
    path = profiles_dir() / f"{text}.yaml"
    if not path.is_file():
        if candidate.is_file():
            return candidate
        if candidate.is_dir():
            raise ProfileError(not_a_file)
        raise ProfileError(
            f"unknown profile {text!r} (built-in: {', '.join(builtin_profiles())}; or a path to a .yaml file; "
            f"{', '.join(f'NAME+{p}' for p in PRECISIONS)}: a profile at that precision)"
        )
    return path


def load_profile(name_or_path: str | Path = "bf16") -> Profile:
    """Load and validate a profile by built-in name or path. ``NAME+fp8`` / ``NAME+int8qk`` /
    ``NAME+bf16`` (a built-in name or a path, when no file has that whole name) is that profile's
    twin at the precision (``with_precision``), e.g. ``accurate+fp8``, as ``fp bench --fp8`` names it.

    >>> p = load_profile("accurate+fp8"); p.name, p.precision, p.dense_layers
    ('accurate+fp8', 'fp8', 12)
    >>> p = load_profile("accurate+int8qk"); p.name, p.precision, p.dense_layers
    ('accurate+int8qk', 'int8qk', 12)

    Raises:
        ProfileError: file missing, a directory, empty, not YAML, unknown key, or wrong value; the
            message names the file, the key and the allowed keys or values.
    """
    base, plus, precision = str(name_or_path).rpartition("+")
    if plus and base and precision in PRECISIONS and not Path(str(name_or_path)).expanduser().is_file():
        return with_precision(load_profile(base), precision)
    path = resolve_profile_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not a text file (not UTF-8: byte {exc.start})") from None
    if data is None:  # no YAML document: nothing, blank lines or comments only
        raise ProfileError(f"{path}: is empty (a profile needs at least 'name'; schema: docs/profiles.md)")
    return profile_from_dict(data, source=path)


def _yaml_problem(exc: Exception) -> str:
    """'line 3, column 5: mapping values are not allowed here' (1-based, from yaml's marks)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    context = getattr(exc, "context", None)
    what = f"{context}: {problem}" if context else str(problem)
    if mark is None:
        return what
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}"


def profile_from_dict(data: Any, source: Path | None = None) -> Profile:
    """Validate plain data (the YAML schema) into a ``Profile``. See ``load_profile``."""
    where = str(source) if source else "<profile>"
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping of keys ({', '.join(TOP_KEYS)}), got {type(data).__name__}")
    for old, new in RENAMED_KEYS.items():
        if old in data:
            raise ProfileError(f"{where}: key '{old}' was renamed to '{new}' (the method configuration, "
                               f"flashprefill.SparseConfig): rename it in the file")
    _check_keys(where, "", data, TOP_KEYS)
    if "name" not in data:
        raise ProfileError(f"{where}: missing key 'name'")
    name = _typed(where, "name", data["name"], str)
    description = _typed(where, "description", data.get("description", ""), str)
    attention = _check_choice(source, "attention", data.get("attention", "flashprefill"), ATTENTIONS)
    precision = _check_choice(source, "precision", data.get("precision", "bf16"), PRECISIONS)
    dense_layers = parse_dense_layers(data.get("dense_layers", 0), where)

    op = data.get("sparse") or {}
    if not isinstance(op, dict):
        raise ProfileError(f"{where}: sparse: expected a mapping, got {type(op).__name__}")
    _check_keys(where, "sparse.", op, SparseConfig.field_names())
    try:
        sparse = SparseConfig(**op)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        key = next((k for k in op if f"SparseConfig.{k} " in msg), None)
        label = f"sparse.{key}" if key else "sparse"
        raise ProfileError(f"{where}: {label}: {msg.replace(f'SparseConfig.{key} ', '') if key else msg}") from None

    eng = data.get("engine") or {}
    if not isinstance(eng, dict):
        raise ProfileError(f"{where}: engine: expected a mapping, got {type(eng).__name__}")
    engine_keys = tuple(f.name for f in dataclasses.fields(EngineSettings))
    _check_keys(where, "engine.", eng, engine_keys)
    engine = EngineSettings(**eng)
    _validate_engine(where, engine)
    return Profile(
        name=name,
        description=description,
        attention=attention,
        precision=precision,
        dense_layers=dense_layers,
        sparse=sparse,
        engine=engine,
        source=source,
    )


_LAYER_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")  # "8" or "8-11" (inclusive)


def parse_dense_layers(value: Any, where: str = "<profile>") -> DenseLayers:
    """A profile's ``dense_layers`` (YAML) as ``Profile.dense_layers``: an int N >= 0 stays N
    (the first N layers); a list of layer ids and inclusive ranges (``[0, 1, 8-11]``: YAML reads
    ``8-11`` as the string "8-11") or one string of them joined by commas (``"0-1, 8-11"``) becomes
    the sorted tuple of those ids, or the int N when they are exactly ``0 .. N-1`` (``[0-11]`` is
    ``12``; ``[]`` is ``0``).

    >>> parse_dense_layers([0, 1, "8-11"]), parse_dense_layers("0-1,8-11"), parse_dense_layers(["0-11"])
    ((0, 1, 8, 9, 10, 11), (0, 1, 8, 9, 10, 11), 12)

    Raises:
        ProfileError: naming ``where`` and the key: a negative int; another type (a float, a bool, a
            mapping); an item that is neither a layer id nor a range ``A-B``; a range whose start
            exceeds its end (``11-8``); a layer listed twice (a repeat or overlapping ranges: both
            items are named).
    """
    key = f"{where}: dense_layers"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ProfileError(f"{key}: must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        items: list[Any] = [x for x in value.split(",")] if value.strip() else []
    elif isinstance(value, list):
        items = value
    else:
        raise ProfileError(f"{key}: must be int (the first N layers) or a list of layer ids and ranges "
                           f"such as [0, 1, 8-11], got {type(value).__name__} {value!r}")
    owner: dict[int, str] = {}  # layer id -> the item that listed it
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            if item < 0:
                raise ProfileError(f"{key}: layer ids must be >= 0, got {item}")
            lo = hi = item
        else:
            m = _LAYER_ITEM.match(item) if isinstance(item, str) else None
            if m is None:
                raise ProfileError(f"{key}: {item!r} is not a layer id (an int >= 0) or a range A-B such as 8-11")
            lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
            if lo > hi:
                raise ProfileError(f"{key}: range {item.strip()!r} runs backwards: write {hi}-{lo}")
        text = str(item).strip()
        for layer in range(lo, hi + 1):
            if layer in owner:
                raise ProfileError(f"{key}: layer {layer} is listed twice ({owner[layer]} and {text})")
            owner[layer] = text
    layers = tuple(sorted(owner))
    return len(layers) if layers == tuple(range(len(layers))) else layers


def _validate_engine(where: str, e: EngineSettings) -> None:
    size = _typed(where, "engine.chunked_prefill_size", e.chunked_prefill_size, int)
    if size < MIN_CHUNKED_PREFILL:
        raise ProfileError(
            f"{where}: engine.chunked_prefill_size: must be >= {MIN_CHUNKED_PREFILL} "
            f"(shorter chunks cost accuracy), got {size}"
        )
    if _typed(where, "engine.page_size", e.page_size, int) < 1:
        raise ProfileError(f"{where}: engine.page_size: must be >= 1, got {e.page_size}")
    frac = _typed(where, "engine.mem_fraction_static", e.mem_fraction_static, float)
    if not 0.0 < frac < 1.0:
        raise ProfileError(f"{where}: engine.mem_fraction_static: must be in (0, 1), got {frac}")
    _typed(where, "engine.cuda_graph_decode", e.cuda_graph_decode, bool)
    if _typed(where, "engine.cuda_graph_max_bs", e.cuda_graph_max_bs, int) < 1:
        raise ProfileError(f"{where}: engine.cuda_graph_max_bs: must be >= 1, got {e.cuda_graph_max_bs}")
    if _typed(where, "engine.max_requests", e.max_requests, int) < 1:
        raise ProfileError(f"{where}: engine.max_requests: must be >= 1, got {e.max_requests}")
    if e.kv_cache_tokens is not None and _typed(where, "engine.kv_cache_tokens", e.kv_cache_tokens, int) < MIN_CONTEXT_LENGTH:
        raise ProfileError(f"{where}: engine.kv_cache_tokens: must be >= {MIN_CONTEXT_LENGTH} or absent, "
                           f"got {e.kv_cache_tokens}")
    if e.dtype not in DTYPES:
        raise ProfileError(f"{where}: engine.dtype: {e.dtype!r} is not allowed (allowed: {', '.join(DTYPES)})")
    if e.context_length is not None:
        _typed(where, "engine.context_length", e.context_length, int)
        problem = context_length_problem(e.context_length)
        if problem:
            raise ProfileError(f"{where}: engine.context_length: {problem} or absent")


def context_length_problem(tokens: int) -> str | None:
    """What is wrong with a context of ``tokens`` (``None`` if it is in range)."""
    if tokens < MIN_CONTEXT_LENGTH:
        return f"must be >= {MIN_CONTEXT_LENGTH}, got {tokens:,}"
    if tokens > MAX_CONTEXT_LENGTH:
        return f"must be <= {MAX_CONTEXT_LENGTH:,} tokens, got {tokens:,}"
    return None


def with_context_length(profile: Profile, tokens: int) -> Profile:
    """``profile`` with ``engine.context_length = tokens``.

    Raises:
        ProfileError: ``tokens`` out of range (``context_length_problem``).
    """
    problem = context_length_problem(int(tokens))
    if problem:
        raise ProfileError(problem)
    return dataclasses.replace(profile, engine=dataclasses.replace(profile.engine, context_length=int(tokens)))


def with_precision(profile: Profile, precision: str) -> Profile:
    """The twin of ``profile`` whose sparse prefill runs its attention operands at ``precision``
    (one of ``PRECISIONS``), everything else the same: for the built-in ``bf16`` and ``fp8`` profiles
    (twins that differ only in precision) the built-in named ``precision``, as a user expects by
    name, or ``bf16+<precision>`` where there is none (``int8qk``); for any other profile the same
    profile at ``precision``, named ``<name>+<precision>`` (a dense profile only records the
    request: it has no sparse prefill, and the engines say so). A name that ends in
    ``+<its own precision>`` (a twin made here) loses that suffix first, so that a twin's twin is
    named for what it runs: ``accurate+int8qk`` at ``bf16`` is ``accurate``, at ``fp8``
    ``accurate+fp8`` (never ``accurate+int8qk+bf16``). ``profile`` itself when it already asks for
    ``precision``.

    >>> with_precision(load_profile("bf16"), "fp8").name, with_precision(load_profile("fp8"), "bf16").name
    ('fp8', 'bf16')
    >>> with_precision(load_profile("fp8"), "int8qk").name, with_precision(load_profile("accurate"), "int8qk").name
    ('bf16+int8qk', 'accurate+int8qk')
    >>> [with_precision(load_profile("accurate+int8qk"), p).name for p in ("bf16", "fp8")]
    ['accurate', 'accurate+fp8']

    Raises:
        ProfileError: ``precision`` is not one of ``PRECISIONS``.
    """
    _check_choice(None, "precision", precision, PRECISIONS)
    if profile.precision == precision:
        return profile
    base = _twin_base(profile)
    if base is not None:  # a twin made here: its twin is made from the profile it came from
        return with_precision(base, precision)
    if profile.source is not None and profile_file(profile) is None and profile.name in PRECISIONS:
        if precision in builtin_profiles():
            return load_profile(precision)  # the built-in twin: bf16 <-> fp8
        profile = load_profile(PRECISIONS[0])  # bf16+int8qk, whichever built-in twin it came from
    return profile.replace(precision=precision, name=f"{profile.name}+{precision}")


def _twin_base(profile: Profile) -> Profile | None:
    """The profile that ``with_precision`` made ``profile`` from, when ``profile`` is such a twin:
    its name ends in ``+<its precision>``, and its file (``source``) loads as a profile named
    without that suffix and equal in everything but name, description and precision; else (a
    profile not made so, or a file changed or gone since) ``profile`` renamed without the suffix,
    or ``None`` when its name has no such suffix."""
    own = f"+{profile.precision}"
    if not profile.name.endswith(own) or profile.name == own:
        return None
    name = profile.name.removesuffix(own)
    if profile.source is not None:
        try:
            base = load_profile(profile.source)
        except ProfileError:
            base = None
        if base is not None and base.name == name and base.replace(precision=profile.precision) == \
                dataclasses.replace(profile, name=name, description=base.description):
            return base
    return dataclasses.replace(profile, name=name)


def precision_twins(a: Profile, b: Profile) -> bool:
    """Whether ``a`` and ``b`` are one profile at two precisions: they ask for different
    ``precision`` and are equal in everything else but ``name``, ``description`` and ``source``
    (what ``with_precision`` makes; the built-ins ``bf16`` and ``fp8`` are such a pair). Dense
    profiles are never twins (they have no sparse prefill to run at a precision).

    >>> precision_twins(load_profile("bf16"), load_profile("fp8"))
    True
    >>> precision_twins(load_profile("accurate"), load_profile("fp8"))
    False
    """
    if a.precision == b.precision or a.is_dense or b.is_dense:
        return False

    def rest(p: Profile) -> Profile:
        return dataclasses.replace(p, name="", description="", source=None, precision=PRECISIONS[0])

    return rest(a) == rest(b)


def bf16_twin(profile: Profile, candidates: Sequence[Profile]) -> Profile | None:
    """The BF16 twin of the 8-bit ``profile`` (``fp8`` or ``int8qk``: ``fpcli.engine.base.
    eight_bit``) among ``candidates`` (``precision_twins``): the one whose twin at ``profile``'s
    precision ``with_precision`` names as ``profile`` (``bf16`` for ``fp8`` and ``bf16+int8qk``,
    ``accurate`` for ``accurate+fp8`` and ``accurate+int8qk``) when it is there, else the first twin
    (a copy of ``bf16`` under another name is one too); ``None`` when ``profile`` is not 8-bit or
    has no twin among them.

    >>> mine = load_profile("bf16").replace(name="mine")
    >>> bf16_twin(load_profile("fp8"), [mine, load_profile("bf16")]).name
    'bf16'
    >>> bf16_twin(load_profile("accurate+int8qk"), [load_profile("fp8"), load_profile("accurate")]).name
    'accurate'
    """
    from fpcli.engine.base import eight_bit  # here: fpcli.engine imports this module

    if not eight_bit(profile.precision):
        return None
    twins = [q for q in candidates if q.precision == "bf16" and precision_twins(profile, q)]
    return next((q for q in twins if with_precision(q, profile.precision).name == profile.name),
                twins[0] if twins else None)


def _check_keys(where: str, prefix: str, data: dict, allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            raise ProfileError(f"{where}: unknown key '{prefix}{key}' (allowed: {', '.join(allowed)})")


def _check_choice(source: Path | None, key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        where = str(source) if source else "<profile>"
        raise ProfileError(f"{where}: {key}: {value!r} is not allowed (allowed: {', '.join(allowed)})")
    return value


def _typed(where: str, key: str, value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (ints pass as floats; bools never pass as numbers)."""
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ProfileError(f"{where}: {key}: must be {kind.__name__}, got {type(value).__name__} {value!r}")
    return value
