"""``SGLangEngine``: the embedded SGLang 0.5.17 engine with the ``flashprefill`` prefill backend.

- Starts ``sglang.srt.entrypoints.engine.Engine`` in this process (its scheduler and detokenizer
  are spawned children) with ``prefill_attention_backend="flashprefill"``,
  ``decode_attention_backend="triton"`` (decode keeps its CUDA graphs), ``sampling_backend=
  "pytorch"``, prefill CUDA graphs off, chunked prefill and page size from the profile.
- The backend (``flashprefill.integrations.sglang``) is registered in the children by
  ``FlashPrefillEngine`` (scheduler entry wrapper) and by the ``sglang.srt.plugins`` entry point;
  see ``kernels/flashprefill/integrations/sglang/plugin.py``.
- The profile becomes a frozen ``BackendSettings`` (``backend_settings``) that reaches the
  scheduler through the ``FP_SGLANG_BACKEND`` environment variable (``settings.py`` there), set
  only while the children are spawned.
- Prefill statistics come back through a temp folder (``stats_reader.py`` there), turned into
  ``PrefillStats`` here (``prefill_stats_of``).
- ``close`` (also ``__exit__`` and ``atexit``) stops the engine within ``shutdown_timeout_s`` and
  then SIGKILLs whatever of its own child processes is still alive.

YaRN: a profile whose ``engine.context_length`` exceeds the model's native context
(``max_position_embeddings``) runs it with YaRN (``fpcli.engine.context.plan_context``): SGLang
gets ``json_model_override_args`` with ``rope_scaling = {"rope_type": "yarn", "factor": f,
"original_max_position_embeddings": native, "rope_theta": theta}`` (``rope_theta`` inside, else
SGLang's scheduler dies with KeyError 'rope_theta') and ``max_position_embeddings`` = the context.
``rope_scaling_factor`` (> 1) forces a factor instead (``max_position_embeddings = native * f``).

Start-up (``start_phases``): the tokenizer; SGLang's ``Engine`` (weights, a KV cache pool of
``kv_pool_tokens``: the context x ``max_requests`` rather than a memory fraction; decode CUDA
graphs for the batch sizes ``decode_graph_batch_sizes`` lists, up to ``max_requests``: only
batch 1 for an in-process ``fp ask``, 1, 2, 4, 8 for a resident engine; SGLang's own default
captures ~36 sizes up to 256; no tokenizer in SGLang's processes: ``skip_tokenizer_init``);
then one warm-up pass (``warmup_plan``): a prompt per KV-length range in which our Triton
kernels compile a different variant, the long one up to the context, so the first long request
runs as fast as the next (a warm-up that stopped at 49K tokens left a 6.8 s TTFT on the first
130K request on the H200, against 1.1 s: ``docs/benchmarks.md``).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from fpcli.engine import context as _context
from fpcli.engine.base import (GenerationResult, PrefillStats, check_fp8_profile, decode_mode, dense_prefill_stats,
                               eight_bit, precision_label, ran_precision)
from fpcli.engine.tokens import token_starts
from fpcli.profiles import MIN_CHUNKED_PREFILL

if TYPE_CHECKING:  # imported where used: the backend's settings import the operator (torch), which
    # ``import fpcli.engine`` (every command, the resident engine's client too) must not pay for
    from flashprefill.integrations.sglang.settings import BackendSettings
    from flashprefill.integrations.sglang.stats_reader import RequestPrefill

logger = logging.getLogger(__name__)

INSTALL_HINT = "install the GPU extras with `pip install -e .[gpu]` on a CUDA machine, or use `--engine transformers`"
DEFAULT_DENSE_BACKEND = "triton"
_LIVE_ENGINES: "set[SGLangEngine]" = set()


class EngineUnavailable(RuntimeError):
    """SGLang (or CUDA) is missing; the message names what to install and the fallback engine."""


def check_available() -> None:
    """Raise ``EngineUnavailable`` unless ``import sglang`` works and a CUDA GPU is visible."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover
        raise EngineUnavailable(f"the SGLang engine needs PyTorch ({exc}); {INSTALL_HINT}") from None
    try:
        import sglang  # noqa: F401
    except Exception as exc:
        raise EngineUnavailable(f"the SGLang engine is not available: cannot import sglang ({exc}); {INSTALL_HINT}") from None
    if not torch.cuda.is_available():
        raise EngineUnavailable(f"the SGLang engine needs a CUDA GPU and none is visible; {INSTALL_HINT}")


# ----------------------------------------------------------------------------------------------
# Model context and YaRN
# ----------------------------------------------------------------------------------------------


def _model_config(model_path: str | os.PathLike) -> dict:
    return _context.read_config(model_path)


def native_context_length(model_path: str | os.PathLike) -> int | None:
    """``max_position_embeddings`` of a Hugging Face folder (``None`` if unknown)."""
    return _context.native_context_length(_model_config(model_path))


def rope_theta(model_path: str | os.PathLike) -> float:
    return _context.rope_theta(_model_config(model_path))


def yarn_override(model_path: str | os.PathLike, factor: float) -> dict:
    """``json_model_override_args`` (as a dict) that turns on YaRN with ``factor`` over the native
    context (``max_position_embeddings = native * factor``)."""
    native = native_context_length(model_path)
    if not native:
        raise ValueError(f"{model_path}: config.json has no max_position_embeddings; cannot apply YaRN")
    if factor <= 1.0:
        raise ValueError(f"rope_scaling_factor must be > 1, got {factor}")
    return {
        "rope_scaling": _context.yarn_rope_scaling(native, factor, rope_theta(model_path)),
        "max_position_embeddings": int(native * factor),
    }


def context_plan(model_path: str | os.PathLike, profile: Any, context_length: int | None = None,
                 rope_scaling_factor: float | None = None) -> _context.ContextPlan:
    """The context SGLang will run the model at: ``rope_scaling_factor`` (> 1) forces YaRN with
    that factor; else ``context_length`` or the profile's ``engine.context_length``, with YaRN when
    beyond the native context (``fpcli.engine.context.plan_context``).

    Raises:
        fpcli.engine.context.ContextError: a context the model cannot be extended to.
    """
    ctx = context_length or profile.engine.context_length
    if rope_scaling_factor and rope_scaling_factor > 1.0:
        override = yarn_override(model_path, rope_scaling_factor)
        used = min(ctx, override["max_position_embeddings"]) if ctx else override["max_position_embeddings"]
        return _context.ContextPlan(native_context_length(model_path), used, override["rope_scaling"])
    return _context.plan_context(_model_config(model_path), ctx, model=Path(model_path).name)


def decode_graph_batch_sizes(max_bs: int) -> list[int]:
    """Decode batch sizes to capture CUDA graphs for: powers of two below ``max_bs``, and ``max_bs``
    (8 -> [1, 2, 4, 8]; 6 -> [1, 2, 4, 6]). A larger batch still runs, without a graph."""
    sizes = [1 << i for i in range(max_bs.bit_length()) if (1 << i) < max_bs]
    return sizes + [int(max_bs)]


def context_reserve(max_new_tokens: int) -> int:
    """Tokens of the context SGLang (0.5.17) keeps from a request beyond its prompt and its
    ``max_new_tokens``: a prompt must leave them free to get its whole answer. SGLang's
    ``max_req_len`` is ``context - 1`` and ``Scheduler.init_req_max_new_tokens`` caps the answer
    at ``max_req_len - prompt - 1`` (2 tokens); ``validate_input_length`` refuses a prompt of
    ``max_req_len - 5`` tokens or more (a prompt is at most ``context - 7``: ``7 - max_new_tokens``
    for an answer shorter than 5). Example: ``context_reserve(256) == 2``, ``context_reserve(1) == 6``."""
    return max(2, 7 - int(max_new_tokens))


POOL_SPARE_PAGES = 2
"""Pages the KV pool holds beyond ``max_requests`` whole contexts (``kv_pool_tokens``)."""


def kv_pool_tokens(context_length: int, max_requests: int, page_size: int, override: int | None = None) -> int:
    """KV cache pool size in tokens (SGLang ``max_total_tokens``): ``override`` (the profile's
    ``engine.kv_cache_tokens``) when given, else room for ``max_requests`` requests at the full
    context in whole pages, plus ``POOL_SPARE_PAGES``. SGLang takes the smaller of this and what
    ``mem_fraction_static`` leaves, so it only ever shrinks the pool.

    Why two spare pages: SGLang's scheduler (0.5.17, ``Scheduler.init_req_max_new_tokens``) caps a
    request's answer at ``max_total_tokens - ceil_page(prompt) - page_size - 1`` tokens. For a
    prompt ``p`` and an answer ``n`` with ``p + n <= context``, ``ceil_page(p) <= p + page_size - 1``,
    so a pool of ``ceil_page(context) + 2 page_size`` leaves the full ``n``; with one spare page a
    prompt near the context got no answer token at all (H200, 131,038 tokens + 32: docs/benchmarks.md).

    Example (Qwen2.5-Coder-0.5B at 131,072 tokens, one request, pages of 64)::

        131072 x 1 -> 2048 pages + 2 = 131,200 tokens; 24 layers x 2 KV heads x 64 dims x 2 (K, V)
        x 2 bytes = 12,288 bytes a token -> 1.6 GB (mem_fraction_static 0.85 alone: ~110 GB on an H200)

    Raises:
        ValueError: a non-positive ``context_length``, ``max_requests`` or ``page_size``.
    """
    if override is not None:
        return int(override)
    if context_length < 1 or max_requests < 1 or page_size < 1:
        raise ValueError(f"kv_pool_tokens: context_length, max_requests and page_size must be >= 1, got "
                         f"{context_length}, {max_requests}, {page_size}")
    pages = -(-int(context_length) * int(max_requests) // int(page_size)) + POOL_SPARE_PAGES
    return pages * int(page_size)


# ----------------------------------------------------------------------------------------------
# Server arguments (pure: tested on CPU)
# ----------------------------------------------------------------------------------------------


def server_defaults(profile: Any) -> dict[str, Any]:
    """The ``ServerArgs`` fields ``fp`` sets for ``profile``, in one place (``build_server_kwargs``
    for the embedded engine, ``serve_argv`` for ``fp serve`` spell them): the flashprefill prefill
    backend (the stock ``triton`` one for a dense profile), ``triton`` decode with its CUDA graphs,
    the PyTorch sampler, page and chunk size (at least ``MIN_CHUNKED_PREFILL``), memory fraction,
    prefill CUDA graphs off (flashprefill does not capture prefill; dense gets the same for
    fairness), decode CUDA graphs as the profile says, and up to ``DECODE_KV_SPLITS`` KV splits for
    the ``triton`` decode kernel."""
    eng = profile.engine
    return dict(
        attention_backend=DEFAULT_DENSE_BACKEND,
        prefill_attention_backend=DEFAULT_DENSE_BACKEND if profile.is_dense else "flashprefill",
        decode_attention_backend=DEFAULT_DENSE_BACKEND,
        sampling_backend="pytorch",
        page_size=int(eng.page_size),
        chunked_prefill_size=max(int(eng.chunked_prefill_size), MIN_CHUNKED_PREFILL),
        mem_fraction_static=float(eng.mem_fraction_static),
        disable_prefill_cuda_graph=True,
        disable_decode_cuda_graph=not bool(eng.cuda_graph_decode),
        triton_attention_num_kv_splits=DECODE_KV_SPLITS,
    )


def decode_graph_max_bs(server_args: Any, kwargs: dict) -> int:
    """The largest decode batch SGLang replays as a CUDA graph (larger batches decode eagerly): 0
    when decode graphs are off (``disable_cuda_graph`` or ``disable_decode_cuda_graph``, ours from
    the profile's ``engine.cuda_graph_decode`` or the user's SGLang options), else
    ``cuda_graph_max_bs_decode`` (or ``cuda_graph_max_bs``). Read from the engine's ``server_args``
    when it has them (what SGLang resolved), else from the keyword arguments it was given.

    >>> decode_graph_max_bs(None, {"disable_decode_cuda_graph": False, "cuda_graph_max_bs_decode": 8})
    8
    >>> decode_graph_max_bs(None, {"disable_cuda_graph": True, "cuda_graph_max_bs_decode": 8})
    0
    """
    def get(name: str):
        value = getattr(server_args, name, None) if server_args is not None else None
        return kwargs.get(name) if value is None else value

    if get("disable_cuda_graph") or get("disable_decode_cuda_graph"):
        return 0
    return int(get("cuda_graph_max_bs_decode") or get("cuda_graph_max_bs") or 1)  # unsaid: batch 1 at least


# The most KV splits SGLang's Triton decode kernel may use per request (its ``ServerArgs``
# default: 8; it picks fewer for short contexts). For GQA models the grouped decode kernel runs
# batch x ceil(q heads / group) x splits programs: Qwen2.5-Coder-0.5B (14 q / 2 KV heads) at batch
# 1 gets 2 x 8 = 16 programs on 132 SMs, each walking 16K keys of a 128K context one tile at a
# time; measured on the H200: 40 tokens/s of decode at 130K tokens (docs/benchmarks.md). 64
# splits give 128 programs of 2K keys.
DECODE_KV_SPLITS = 64


def build_server_kwargs(
    model_path: str | os.PathLike,
    profile: Any,
    *,
    rope_scaling_factor: float | None = None,
    context_length: int | None = None,
    log_level: str = "error",
    overrides: dict | None = None,
    max_requests: int | None = None,
) -> dict:
    """``ServerArgs`` keyword arguments for a profile (``Engine(**kwargs)``) of the local,
    single-user engine: at most ``max_requests`` running requests (``None``: the profile's
    ``engine.max_requests``; an in-process command asking one question passes 1); decode CUDA
    graphs only for ``decode_graph_batch_sizes(min(engine.cuda_graph_max_bs, max_requests))``; a
    KV pool of ``kv_pool_tokens`` (the context x ``max_requests``, or ``engine.kv_cache_tokens``);
    no tokenizer in SGLang's processes (``skip_tokenizer_init``: ``fp`` sends token ids, decodes
    the answer itself and passes the EOS id); YaRN when the context exceeds the model's
    (``context_plan``).

    ``server_defaults(profile)`` first; ``overrides`` wins over everything (SGLang options the user
    gave, e.g. ``tp_size``; tests use it for ``page_size`` and ``disable_cuda_graph``).

    Raises:
        fpcli.engine.context.ContextError: a context the model cannot be extended to.
    """
    eng = profile.engine
    plan = context_plan(model_path, profile, context_length, rope_scaling_factor)
    reqs = int(max_requests or eng.max_requests)
    if reqs < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    kwargs: dict[str, Any] = dict(model_path=str(model_path), **server_defaults(profile), log_level=log_level,
                                  random_seed=0, max_running_requests=reqs, skip_tokenizer_init=True)
    if eng.cuda_graph_decode:
        sizes = decode_graph_batch_sizes(min(int(eng.cuda_graph_max_bs), reqs))
        kwargs.update(cuda_graph_bs_decode=sizes, cuda_graph_max_bs_decode=max(sizes))
    if plan.context or eng.kv_cache_tokens:
        kwargs["max_total_tokens"] = kv_pool_tokens(int(plan.context or 0), reqs, int(eng.page_size),
                                                    eng.kv_cache_tokens)
    if eng.dtype and eng.dtype != "auto":
        kwargs["dtype"] = eng.dtype
    if plan.rope_scaling is not None:
        override = plan.override()
        if rope_scaling_factor and rope_scaling_factor > 1.0:  # a forced factor keeps native * factor
            override["max_position_embeddings"] = int(plan.native * plan.yarn_factor)
        kwargs["json_model_override_args"] = json.dumps(override)
    if context_length or eng.context_length or plan.rope_scaling is not None:
        kwargs["context_length"] = int(plan.context)
    if overrides:
        kwargs.update(overrides)
    return kwargs


@contextmanager
def _env(entries: dict[str, str]) -> Iterator[None]:
    """Set environment entries while SGLang spawns its children; restore them afterwards."""
    saved = {k: os.environ.get(k) for k in entries}
    os.environ.update(entries)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _children() -> set[int]:
    try:
        import psutil

        return {p.pid for p in psutil.Process().children(recursive=True)}
    except Exception:
        import multiprocessing

        return {p.pid for p in multiprocessing.active_children() if p.pid}


def _kill(pids: Sequence[int], wait_s: float = 10.0) -> list[int]:
    """SIGKILL ``pids`` (our own children) and wait for them; returns the pids that were alive."""
    alive = []
    try:
        import psutil

        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
        for p in procs:
            try:
                p.kill()
                alive.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=wait_s)
    except ImportError:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                alive.append(pid)
            except ProcessLookupError:
                pass
    return alive


WARMUP_SHORT = 64  # a short prompt: the dense extend path of short requests (below min_sparse_len)
WARMUP_MARGIN = 64  # tokens left free below the context (the answer's 2 tokens, template slack)


def kernel_kv_thresholds() -> tuple[int, ...]:
    """KV lengths at which the Triton operator switches code paths (each side compiles its own
    kernel variants): ``flashprefill.impl.triton.host.kv_length_thresholds``. Imports the Triton
    backend (needs the ``triton`` package)."""
    from flashprefill.impl.triton.host import kv_length_thresholds

    return kv_length_thresholds()


def _unaligned(n: int) -> int:
    """``n`` moved down to a length that is not a multiple of 16, as real prompts mostly are
    (Triton specialises integer arguments divisible by 16; full chunks already cover those)."""
    return n - 3 if n % 16 == 0 else n


def warmup_plan(context_length: int, chunk: int, min_sparse_len: int | None,
                kv_thresholds: Sequence[int] = ()) -> list[int]:
    """Prompt lengths (tokens) whose prefill compiles every kernel variant a request of up to
    ``context_length`` tokens can hit, each length once, longest first.

    A prompt of ``n`` tokens is prefilled in chunks of ``chunk`` tokens whose KV lengths are
    ``chunk, 2 chunk, ..., n``; the sparse path (chunks of ``>= min_sparse_len`` new tokens; ``None``
    = dense profile) compiles different variants on each side of every ``kv_thresholds`` entry.
    The plan is one prompt at the context (its chunks cover every range from ``chunk`` up), one
    per range that lies below the first chunk's KV length (only a prompt shorter than a chunk
    reaches it), and a short dense one. Example (Qwen at 131072, chunk 16384, min_sparse_len 8192,
    thresholds 16384 and 32769)::

        long:  131072 - 64 = 131008 -> 131005 (not a multiple of 16); its 8 chunks end at KV
               16384, 32768, 49152, ..., 131005: both sides of 32769
        range [8192, 16384) lies below the first chunk's KV 16384: (8192 + 16384) // 2 = 12288 -> 12285
        short: 64
        plan:  [131005, 12285, 64]
    """
    cap = context_length - WARMUP_MARGIN
    lengths: list[int] = []
    if min_sparse_len is not None and cap >= max(min_sparse_len, 1) + 256:
        lengths.append(_unaligned(cap))
        first_kv = min(chunk, cap)  # the KV length of the long prompt's first chunk
        edges = sorted({max(min_sparse_len, 1), *[t for t in kv_thresholds if t > max(min_sparse_len, 1)]})
        for lo, hi in zip(edges, edges[1:] + [cap + 1]):
            if lo >= first_kv:  # the long prompt's chunks reach this range
                break
            hi = min(hi, first_kv)
            mid = _unaligned((lo + hi) // 2)
            if lo <= mid < hi and mid not in lengths:
                lengths.append(mid)
    elif min_sparse_len is None and cap > WARMUP_SHORT:
        lengths.append(_unaligned(min(cap, chunk + 1024)))  # dense profile: a chunk and a prefix chunk
    if cap >= WARMUP_SHORT:
        lengths.append(WARMUP_SHORT)
    return lengths


def _finish_reason(meta: dict) -> str:
    fr = meta.get("finish_reason")
    if isinstance(fr, dict):
        return str(fr.get("type") or "stop")
    return str(fr) if fr else "length"


def attention_precision(profile: Any) -> str:
    """The model dtype's precision for ``profile`` (``bf16`` unless the profile asks for
    float16/float32): what dense layers, short prefills and decode run. The sparse layers run the
    profile's ``precision`` (``GenerationResult.precision`` says what a prefill ran)."""
    dtype = str(getattr(getattr(profile, "engine", None), "dtype", "auto"))
    return {"float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")


def backend_settings(profile: Any, stats_dir: str | None, timing: bool = False, compare_fp8: bool = False,
                     verbose: bool = False) -> "BackendSettings":
    """The ``flashprefill`` backend's frozen settings for ``profile`` (an ``fpcli.profiles.Profile``):
    its ``SparseConfig``, ``dense_layers`` and ``precision``; statistics written to ``stats_dir``;
    per-layer index / attention timing only with ``timing``; 8-bit-vs-BF16 errors (``fp8``,
    ``int8qk``) only with ``compare_fp8``; the plugin's log level ``info`` when ``verbose``, else ``warning`` (its
    registration lines are printed only when verbose); unless ``verbose`` the scheduler's own
    output (SGLang's log lines, its weight-loading bars) goes to ``scheduler_log_path(stats_dir)``,
    not to the terminal."""
    from flashprefill.integrations.sglang.settings import BackendSettings

    return BackendSettings(sparse=profile.sparse_config(), dense_layers=profile.dense_layers,
                           precision=str(profile.precision), stats_dir=stats_dir, layer_timing=timing,
                           compare_fp8=compare_fp8, log_level="info" if verbose else "warning",
                           scheduler_output=None if verbose or stats_dir is None else scheduler_log_path(stats_dir))


def scheduler_log_path(stats_dir: str) -> str:
    """Where a quiet engine's scheduler output goes (inside its private statistics folder)."""
    return os.path.join(stats_dir, "scheduler.log")


def log_tail(path: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' when it is missing or empty); carriage-return
    progress-bar updates collapse to their last state."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as fh:  # keep the \r of bars
            text = fh.read()
    except OSError:
        return ""
    out = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]  # not splitlines: it splits at \r
    return "\n".join(line for line in out[-lines:] if line.strip())


def quiet_children_env(verbose: bool) -> dict[str, str]:
    """Environment entries for SGLang's spawned processes: ``TQDM_DISABLE=1`` unless ``verbose``
    (tqdm reads it for bars whose caller does not pass ``disable=``; set only while the children
    are spawned). SGLang's weight-loading bars pass ``disable=`` explicitly: the scheduler's
    output file (``BackendSettings.scheduler_output``) is what keeps those off the terminal."""
    return {} if verbose else {"TQDM_DISABLE": "1"}


def ran_precision_of(req: RequestPrefill | None, model_precision: str) -> str:
    """``GenerationResult.precision`` of one request from the scheduler's lines: ``"fp8 (sparse
    layers)"`` / ``"int8qk (sparse layers)"`` when any of its sparse layers ran that 8-bit precision
    (``base.ran_precision``), else the model's precision."""
    ran = [p for p in (req.precision if req is not None else []) if eight_bit(p)]
    return ran_precision(model_precision, len(ran), ran[0] if ran else "fp8")


E4M3_KV_CACHE_DTYPES = ("fp8_e4m3",)  # SGLang --kv-cache-dtype values whose pool holds e4m3 codes


def check_kv_cache_precision(profile: Any, kv_cache_dtype: str | None) -> None:
    """Refuse, before SGLang starts, a profile whose sparse prefill cannot read the KV cache SGLang
    would keep: an e4m3 cache (``--kv-cache-dtype fp8_e4m3``, ``E4M3_KV_CACHE_DTYPES``) is read as
    it is only by ``precision: fp8``; ``int8qk`` (int8 Q and K) needs a 16-bit cache (the operator
    raises on e4m3 K). A ``bf16`` profile passes: its backend runs such layers dense (stock SGLang).
    ``kv_cache_dtype``: SGLang's ``ServerArgs.kv_cache_dtype`` (``None`` / ``"auto"``: the model's).

    Raises:
        ValueError: one line naming the profile, the cache dtype and what would run.
    """
    precision = str(getattr(profile, "precision", "bf16"))
    if (getattr(profile, "is_dense", False) or precision == "fp8" or not eight_bit(precision)
            or str(kv_cache_dtype) not in E4M3_KV_CACHE_DTYPES):
        return
    raise ValueError(f"profile {profile.name} asks for {precision_label(precision)} attention, which needs a 16-bit "
                     f"KV cache (bf16 / fp16), but --kv-cache-dtype {kv_cache_dtype} stores e4m3, which only fp8 "
                     f"reads: leave out --kv-cache-dtype, or run an fp8 profile (--profile fp8, or NAME+fp8)")


def prefill_stats_of(req: "RequestPrefill") -> PrefillStats:
    """``PrefillStats`` of one request from the scheduler's lines (``stats_reader.aggregate``): per
    sparse layer selected / visible blocks summed over KV heads and chunks, density 1.0 elsewhere;
    skipped FLOPs = dense FLOPs x (1 - density) per sparse layer."""
    from flashprefill.integrations.fp8_error import layer_rel_l2, rel_l2  # here: it imports torch

    per_layer, per_head = [], []
    sel_total = vis_total = 0
    flops_skipped = 0.0
    sparse_layers: list[int] = []
    for i, mode in enumerate(req.layers):
        s = req.selected[i] if i < len(req.selected) else None
        v = req.visible[i] if i < len(req.visible) else None
        if mode == "sparse" and s is not None and v is not None and sum(v) > 0:
            per_head.append([si / vi if vi else 1.0 for si, vi in zip(s, v)])
            d = sum(s) / sum(v)
            per_layer.append(d)
            sparse_layers.append(i)
            sel_total += sum(s)
            vis_total += sum(v)
            if i < len(req.dense_flops):
                flops_skipped += req.dense_flops[i] * (1.0 - d)
        else:
            per_layer.append(1.0)
            per_head.append([1.0] * (len(s) if s else 0))
    index_per_layer, attention_per_layer = _stage_ms_of(req, sparse_layers)
    fp8 = any(e is not None for e in req.fp8_err_sq)
    return PrefillStats(
        fp8_rel_l2_per_layer=[layer_rel_l2(e, r) if e is not None and r is not None else None
                              for e, r in zip(req.fp8_err_sq, req.fp8_ref_sq)] if fp8 else [],
        fp8_rel_l2_per_layer_head=[rel_l2(e, r) if e is not None and r is not None else []
                                   for e, r in zip(req.fp8_err_sq, req.fp8_ref_sq)] if fp8 else [],
        density=(sel_total / vis_total) if vis_total else 1.0,
        density_per_layer=per_layer,
        density_per_layer_head=per_head,
        sparse_layers=sparse_layers,
        attention_flops_dense=float(sum(req.dense_flops)),
        attention_flops_skipped=flops_skipped,
        index_ms=sum(index_per_layer) if index_per_layer else req.index_ms,
        attention_ms=sum(attention_per_layer) if attention_per_layer else req.attention_ms,
        index_ms_per_layer=index_per_layer,
        attention_ms_per_layer=attention_per_layer,
    )


def _stage_ms_of(req: "RequestPrefill", sparse_layers: list[int]) -> tuple[list[float], list[float]]:
    """Index and attention milliseconds of each of ``sparse_layers`` (summed over the chunks by
    ``stats_reader.aggregate``), or ``([], [])`` when any of them was not timed (timing off, or
    lines without per-layer times). ``prefill_stats_of`` sums them for the totals, so a layer
    timed without counts (not in ``sparse_layers``) counts in neither."""
    idx, att = req.index_ms_per_layer, req.attention_ms_per_layer
    got = [(idx[i], att[i]) for i in sparse_layers if i < len(idx) and i < len(att)]
    if not sparse_layers or len(got) < len(sparse_layers) or any(a is None or b is None for a, b in got):
        return [], []
    return [a for a, _ in got], [b for _, b in got]


class SGLangEngine:
    """The ``fp`` engine contract (``fpcli.engine.base.Engine``) on embedded SGLang.

    Args:
        model_path: a Hugging Face folder.
        profile: an ``fpcli.profiles.Profile`` (attention, operator knobs, engine settings).
        rope_scaling_factor: opt in to YaRN with this factor (> 1) for prompts beyond the model's
            native context.
        context_length: cap on the context (tokens); default the profile's or the model's.
        timing: also time the index and attention stages per layer (CUDA events in the
            scheduler; ``fp profile`` asks for it).
        server_overrides: extra ``ServerArgs`` fields (SGLang's own options), win over the profile.
        log_level: SGLang's log level (default ``error``); ``info`` / ``debug`` also let the
            plugin's lines and the children's progress bars through (``quiet_children_env``).
        compare_fp8: with an 8-bit profile (``fp8``, ``int8qk``), report its output error against
            BF16 per layer and KV head (``BackendSettings.compare_fp8``; bf16 / fp16 KV cache only).
        max_requests: requests run at once (``build_server_kwargs``); ``None`` = the profile's
            ``engine.max_requests``; 1 for a command that asks one question.

    Raises:
        ValueError: an 8-bit profile (``fp8``, ``int8qk``) on a GPU without FP8 tensor cores or with
            an unsupported head dim (``base.check_fp8_profile``); an ``int8qk`` profile with an e4m3
            KV cache (``check_kv_cache_precision``); both before SGLang starts.
        shutdown_timeout_s: how long ``close`` waits for SGLang before killing its children.
        warmup: compile every kernel at start (``warmup``).
    """

    name = "sglang"
    stats_timeout_s = 5.0  # how long generate() waits for the scheduler's statistics line (normally ms)

    def __init__(
        self,
        model_path: str | os.PathLike,
        profile: Any,
        *,
        rope_scaling_factor: float | None = None,
        context_length: int | None = None,
        timing: bool = False,
        server_overrides: dict | None = None,
        log_level: str | None = None,
        shutdown_timeout_s: float = 30.0,
        warmup: bool = True,
        compare_fp8: bool = False,
        max_requests: int | None = None,
    ):
        check_available()
        cfg = _model_config(model_path)
        cfg = {**(cfg.get("text_config") or {}), **cfg}
        if cfg.get("num_attention_heads"):
            import torch

            check_fp8_profile(profile, torch.device("cuda", 0),
                              int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])))
        check_kv_cache_precision(profile, (server_overrides or {}).get("kv_cache_dtype"))  # the profile sets none
        self.model_path = str(model_path)
        self.model_name = Path(model_path).name
        self.profile = profile
        self.profile_name = getattr(profile, "name", "?")
        self.shutdown_timeout_s = shutdown_timeout_s
        self.sparse = not bool(getattr(profile, "is_dense", False))
        self.model_precision = attention_precision(profile)
        sparse_precision = str(profile.precision)
        self.precision = ran_precision(self.model_precision, int(self.sparse and eight_bit(sparse_precision)),
                                       sparse_precision)
        self._closed = False
        self._engine = None
        self._stats_dir = tempfile.mkdtemp(prefix="fp-sglang-stats-")
        self.server_kwargs = build_server_kwargs(
            model_path, profile, rope_scaling_factor=rope_scaling_factor, context_length=context_length,
            log_level=log_level or "error", overrides=server_overrides, max_requests=max_requests,
        )
        verbose = str(self.server_kwargs.get("log_level", "error")) in ("debug", "info")
        self.settings: BackendSettings = backend_settings(profile, self._stats_dir, timing=timing,
                                                          compare_fp8=compare_fp8, verbose=verbose)
        self._child_env = {**self.settings.to_env(), **quiet_children_env(verbose)}
        self.context_plan = context_plan(model_path, profile, context_length, rope_scaling_factor)
        from transformers import AutoTokenizer

        self.start_phases: dict[str, float] = {}  # seconds per start-up phase, in order
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.start_phases["tokenizer"] = time.perf_counter() - t0
        from flashprefill.integrations.sglang.plugin import engine_class

        before = _children()
        t0 = time.perf_counter()
        logger.info("starting SGLang: %s", self.server_kwargs)
        try:
            with _env(self._child_env):
                self._engine = engine_class()(**self.server_kwargs)
        except BaseException as exc:
            self._child_pids = sorted(_children() - before)
            self._closed = True
            _kill(self._child_pids)
            tail = log_tail(self.settings.scheduler_output)
            shutil.rmtree(self._stats_dir, ignore_errors=True)
            if tail and isinstance(exc, Exception):
                raise RuntimeError(f"SGLang did not start: {str(exc).strip() or type(exc).__name__}\n"
                                   f"the scheduler's last output (run with -v to see it live):\n{tail}") from exc
            raise
        self.startup_s = time.perf_counter() - t0
        self.start_phases["engine"] = self.startup_s  # weights, KV cache pool, decode CUDA graphs
        self._child_pids = sorted(_children() - before)
        _LIVE_ENGINES.add(self)
        atexit.register(self.close)
        sa = getattr(self._engine, "server_args", None)
        self.context_length = int(getattr(sa, "context_length", None) or self.server_kwargs.get("context_length")
                                  or native_context_length(model_path) or 0)
        self._incremental = bool(getattr(sa, "incremental_streaming_output", False))
        self.decode_graph_max_bs = decode_graph_max_bs(sa, self.server_kwargs)
        logger.info("SGLang started in %.1f s (children %s)", self.startup_s, self._child_pids)
        self.warmup_s = 0.0
        if warmup:
            try:
                self.warmup()
            except BaseException:
                self.close()
                raise
        self.start_s = self.startup_s + self.warmup_s

    def warmup_lengths(self) -> list[int]:
        """Prompt lengths of the start-up warm-up (``warmup_plan`` for this engine's context,
        chunk size and ``min_sparse_len``, with the Triton launchers' KV-length thresholds)."""
        min_sparse = int(self.settings.sparse.min_sparse_len) if self.sparse else None
        chunk = int(self.server_kwargs.get("chunked_prefill_size") or MIN_CHUNKED_PREFILL)
        ctx = self.context_length or 0
        # a KV cache pool smaller than the context caps the longest request SGLang accepts
        info = getattr(getattr(self, "_engine", None), "scheduler_info", None) or {}
        if isinstance(info, dict) and info.get("max_req_input_len"):
            ctx = min(ctx, int(info["max_req_input_len"]) + WARMUP_MARGIN)
        return warmup_plan(ctx, chunk, min_sparse, kernel_kv_thresholds() if self.sparse else ())

    def warmup(self) -> float:
        """Compile every kernel a request up to the context length can hit (our Triton operator in
        each KV-length range, SGLang's dense extend kernels, sampling, decode) with one pass of
        dummy prompts (``warmup_lengths``), then flush the radix cache, so the first real request
        is as fast as the next. Returns the seconds it took (also ``self.warmup_s``); each prompt's
        time is in ``start_phases`` as ``warmup <n> tokens``."""
        t0 = time.perf_counter()
        vocab = max(1000, min(len(self.tokenizer), int(getattr(self.tokenizer, "vocab_size", 0) or 0) or 32000))
        lengths = self.warmup_lengths()
        for length in lengths:
            t1 = time.perf_counter()
            ids = [(i * 7919 + 13) % (vocab - 200) + 100 for i in range(length)]
            self.generate(ids, max_new_tokens=2, rid=f"fp-warmup-{uuid.uuid4().hex[:8]}")
            self.start_phases[f"warmup {length} tokens"] = time.perf_counter() - t1
        self.flush_cache()
        self.warmup_s = time.perf_counter() - t0
        logger.info("SGLang warm-up (prompts of %s tokens, radix cache flushed) in %.1f s", lengths, self.warmup_s)
        return self.warmup_s

    # -- tokens --------------------------------------------------------------------------------
    @staticmethod
    def context_reserve(max_new_tokens: int) -> int:
        """Tokens a prompt leaves free beyond the answer (module ``context_reserve``)."""
        return context_reserve(max_new_tokens)

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_starts(self, text: str) -> list[int]:
        return token_starts(self.tokenizer, text)

    # -- generation ----------------------------------------------------------------------------
    def _sampling_params(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> dict:
        params: dict[str, Any] = {"max_new_tokens": int(max_new_tokens), "temperature": float(temperature)}
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None:  # SGLang runs without a tokenizer (skip_tokenizer_init): the chat EOS from ours
            params["stop_token_ids"] = [int(eos)]
        if temperature > 0:
            params.update(top_p=float(top_p), top_k=int(top_k))
        return params

    def generate(
        self,
        prompt_ids: list[int] | str,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        on_cached: Callable[[int], None] | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = -1,
        rid: str | None = None,
    ) -> GenerationResult:
        """Greedy when ``temperature == 0``; streams text deltas to ``on_text``. ``prompt_ids`` may
        be a string (tokenized here, no template). TTFT = submission to the first answer token.
        An exception raised by ``on_text`` (e.g. a cancelled client) aborts the request in SGLang
        and propagates. ``on_progress`` and ``on_cached`` are accepted for the contract and not
        called (SGLang's scheduler runs the prefill in another process; the cached count arrives
        with the answer). ``cached_tokens``: prompt tokens SGLang's
        radix cache served (``meta_info["cached_tokens"]``; on unless ``disable_radix_cache``)."""
        if self._closed:
            raise RuntimeError("SGLangEngine is closed")
        if isinstance(prompt_ids, str):
            prompt_ids = self.tokenizer(prompt_ids, add_special_tokens=False)["input_ids"]
        ids = [int(x) for x in prompt_ids]
        rid = rid or f"fp-{uuid.uuid4().hex}"
        t0 = time.perf_counter()
        stream = self._engine.generate(
            input_ids=ids, sampling_params=self._sampling_params(max_new_tokens, temperature, top_p, top_k),
            stream=True, rid=rid,
        )
        first_t = None
        out_ids: list[int] = []
        meta: dict = {}
        shown = ""
        try:
            for chunk in stream:
                new = list(chunk.get("output_ids") or [])
                if self._incremental:
                    out_ids.extend(new)
                elif new:
                    out_ids = new
                if out_ids and first_t is None:
                    first_t = time.perf_counter()
                meta = chunk.get("meta_info") or meta
                if on_text is not None and out_ids:
                    text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
                    if text.startswith(shown) and not text.endswith("\ufffd") and len(text) > len(shown):
                        on_text(text[len(shown):])  # may raise to cancel: the request is aborted below
                        shown = text
        except BaseException:
            self._abort(rid)
            raise
        t_end = time.perf_counter()
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        if on_text is not None and text.startswith(shown) and len(text) > len(shown):
            on_text(text[len(shown):])
        ttft = (first_t or t_end) - t0
        prompt_tokens = int(meta.get("prompt_tokens", len(ids)))
        stats, prefill_s, precision = self._prefill_stats(rid, prompt_tokens, ttft)
        result = GenerationResult(
            text=text,
            prompt_tokens=prompt_tokens,
            output_tokens=len(out_ids),
            ttft_s=ttft,
            prefill_s=prefill_s,
            total_s=t_end - t0,
            engine=self.name,
            model=self.model_name,
            profile=self.profile_name,
            stats=stats,
            finish_reason=_finish_reason(meta),
            precision=precision,
            device="cuda",
            cached_tokens=int(meta.get("cached_tokens", 0) or 0),
            decode_mode=decode_mode(len(out_ids), self.decode_graph_max_bs >= 1),
        )
        result.rid = rid
        return result

    def _abort(self, rid: str) -> None:
        """Abort request ``rid`` in SGLang's scheduler (after ``on_text`` raised or an interrupt),
        so a cancelled answer stops decoding and frees its batch slot."""
        tm = getattr(self._engine, "tokenizer_manager", None)
        if tm is None:
            return
        try:
            tm.abort_request(rid)
        except Exception as exc:  # noqa: BLE001 - best effort; the stream is already abandoned
            logger.warning("could not abort SGLang request %s: %s", rid, exc)

    def _prefill_stats(self, rid: str, prompt_tokens: int, ttft: float) -> tuple[PrefillStats, float, str]:
        """(stats, prefill seconds, precision that ran) from the backend's JSONL; TTFT stands in for
        prefill time when the backend wrote nothing (dense profile, or stats off), and the
        engine's expected precision for what ran."""
        if not self.sparse:  # stock SGLang attention records nothing; the dense FLOPs are known
            return self._dense_stats(prompt_tokens), ttft, self.model_precision
        from flashprefill.integrations.sglang.stats_reader import read_prefill_stats

        rec = read_prefill_stats(self._stats_dir, rid, timeout_s=self.stats_timeout_s, expect_tokens=prompt_tokens)
        if rec is None:
            logger.warning("flashprefill: no prefill statistics arrived for %s", rid)
            return PrefillStats(), ttft, self.precision
        prefill_s = rec.prefill_ms / 1000.0 if rec.prefill_ms is not None else ttft
        return prefill_stats_of(rec), prefill_s, ran_precision_of(rec, self.model_precision)

    def _dense_stats(self, prompt_tokens: int) -> PrefillStats:
        """``dense_prefill_stats`` from the model's config (``PrefillStats()`` if it lacks a field).
        A prefix-cache hit is counted as computed: an upper bound for that request."""
        cfg = _model_config(self.model_path)
        cfg = {**(cfg.get("text_config") or {}), **cfg}
        try:
            layers, hq = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
            hkv = int(cfg.get("num_key_value_heads") or hq)
            d = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // hq)
        except (KeyError, TypeError, ValueError):
            return PrefillStats()
        return dense_prefill_stats(prompt_tokens, layers, hq, hkv, d)

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                       temperature: float = 0.0) -> list[GenerationResult]:
        """Several prompts in one SGLang call (they are batched together). TTFT per request is not
        observable here; ``ttft_s`` is the whole call's time."""
        rids = [f"fp-{uuid.uuid4().hex}" for _ in prompts]
        t0 = time.perf_counter()
        outs = self._engine.generate(
            input_ids=[[int(x) for x in p] for p in prompts],
            sampling_params=self._sampling_params(max_new_tokens, temperature, 1.0, -1), rid=rids,
        )
        total = time.perf_counter() - t0
        results = []
        for rid, p, out in zip(rids, prompts, outs):
            meta = out.get("meta_info") or {}
            ids = list(out.get("output_ids") or [])
            stats, prefill_s, precision = self._prefill_stats(rid, int(meta.get("prompt_tokens", len(p))), total)
            res = GenerationResult(
                text=self.tokenizer.decode(ids, skip_special_tokens=True), prompt_tokens=int(meta.get("prompt_tokens", len(p))),
                output_tokens=len(ids), ttft_s=total, prefill_s=prefill_s, total_s=total, engine=self.name,
                model=self.model_name, profile=self.profile_name, stats=stats, finish_reason=_finish_reason(meta),
                precision=precision, device="cuda",
                decode_mode=decode_mode(len(ids), self.decode_graph_max_bs >= len(prompts)),
            )
            res.rid = rid
            results.append(res)
        return results

    def first_token_logprobs(self, prompt_ids: Sequence[int], k: int = 20) -> list[tuple[float, int]]:
        """Top-``k`` (logprob, token id) of the first answer token (one greedy step)."""
        out = self._engine.generate(
            input_ids=[int(x) for x in prompt_ids], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True, top_logprobs_num=k,
        )
        top = (out.get("meta_info") or {}).get("output_top_logprobs") or []
        if not top:
            raise RuntimeError("SGLang returned no output_top_logprobs")
        return [(float(e[0]), int(e[1])) for e in top[0]]

    def flush_cache(self, timeout_s: float = 3.0) -> bool:
        """Empty SGLang's radix (prefix) cache, so the next request prefills its whole prompt.

        SGLang refuses (``success=False``) while a request is still in its running batch, which
        happens right after an answer streamed out; retried until ``timeout_s``."""
        if self._engine is None:
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._engine.flush_cache()
            ok = bool(getattr(out, "success", True))
            if ok or time.monotonic() >= deadline:
                if not ok:
                    logger.warning("SGLang did not flush its cache: %s", getattr(out, "message", ""))
                return ok
            time.sleep(0.05)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop SGLang; kill its children if it does not stop within ``shutdown_timeout_s``, or when
        the shutdown is interrupted (Ctrl-C while waiting for it): the children never outlive a
        close that began."""
        if self._closed:
            return
        self._closed = True
        _LIVE_ENGINES.discard(self)
        eng, self._engine = self._engine, None
        t0 = time.perf_counter()
        try:
            if eng is not None:
                tm = getattr(eng, "tokenizer_manager", None)
                watchdog = getattr(tm, "_subprocess_watchdog", None)
                if watchdog is not None:
                    try:
                        watchdog.stop()
                    except Exception:
                        pass
                if not _LIVE_ENGINES:
                    # Engine.shutdown kills every child of this process: only when no other engine lives.
                    worker = threading.Thread(target=eng.shutdown, name="fp-sglang-shutdown", daemon=True)
                    worker.start()
                    worker.join(self.shutdown_timeout_s)
                    if worker.is_alive():
                        logger.warning("SGLang shutdown did not finish in %.0f s; killing its processes",
                                       self.shutdown_timeout_s)
        finally:
            killed = _kill(self._child_pids)
            if killed:
                logger.info("killed SGLang children %s", killed)
            shutil.rmtree(self._stats_dir, ignore_errors=True)
        logger.info("SGLang engine closed in %.1f s", time.perf_counter() - t0)

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# fp serve
# ----------------------------------------------------------------------------------------------


def _spell_out(argv: Sequence[str]) -> list[str]:
    """``--tp N`` / ``--dp N`` (and ``=`` forms) as SGLang spells them: ``--tp-size`` / ``--dp-size``."""
    out: list[str] = []
    alias = {"--tp": "--tp-size", "--dp": "--dp-size"}
    for a in argv:
        head, sep, tail = a.partition("=")
        if head in alias:
            a = alias[head] + (sep + tail if sep else "")
        out.append(a)
    return out


def server_overrides_from_argv(argv: Sequence[str]) -> dict:
    """``ServerArgs`` fields set by SGLang command-line options (``--tp 2``, ``--dp 2``,
    ``--mem-fraction-static 0.5`` ...), parsed by SGLang's own parser: only the options given.
    They become ``SGLangEngine(server_overrides=...)`` in the resident engine.

    Raises:
        ValueError: an option SGLang does not know, or a bad value (SGLang's message).
    """
    import argparse

    from sglang.srt.server_args import ServerArgs

    class Parser(argparse.ArgumentParser):
        def error(self, message):  # argparse exits; we raise
            raise ValueError(f"SGLang settings {' '.join(argv)}: {message}")

    parser = Parser(add_help=False)
    ServerArgs.add_cli_args(parser)
    given = vars(parser.parse_args(["--model-path", "unused", *_spell_out(argv)]))
    # against a parse without the options, not parser.get_default: options that share a dest
    # (SGLang's dsa_*_backend) report another default than the one a plain parse gives
    base = vars(parser.parse_args(["--model-path", "unused"]))
    return {k: v for k, v in given.items() if k != "model_path" and base.get(k) != v}


def serve_argv(argv: Sequence[str], profile: Any) -> list[str]:
    """SGLang CLI arguments for ``fp serve``: ``--tp N`` / ``--dp N`` spelled out, the profile's
    defaults added where the user gave none (pure; tested on CPU)."""
    out = _spell_out(argv)
    given = {a.partition("=")[0] for a in out if a.startswith("--")}
    eng = profile.engine
    for name, value in server_defaults(profile).items():
        flag = "--" + name.replace("_", "-")
        if flag in given or (name == "disable_prefill_cuda_graph" and "--cuda-graph-backend-prefill" in given):
            continue
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    if eng.context_length and "--context-length" not in given:
        out += ["--context-length", str(eng.context_length)]
    return out
