"""Public API of ``flashprefill``: input validation once, then lazy dispatch to a backend.

Backends (``impl/reference.py``, ``impl/triton/host.py``) expose the same three functions with
the signatures of ``docs/layout.md`` ("Implementations") and never import each other.
``backend="auto"`` sends CUDA tensors that the Triton kernels take (``TRITON_DTYPES``: bf16/fp16,
``TRITON_HEAD_DIMS``: d in 64/128/256) to Triton and everything else to the reference; an
explicitly requested backend never falls back silently (attention-gym ``api.py`` pattern).

Tensor arguments (``docs/layout.md`` defines every layout; ``docs/method.md`` the method)::

    q             [total_q, Hq, d]                   bf16/fp16 (fp32/fp64 on the reference), last dim contiguous
    k_cache       [num_pages, page_size, Hkv, d]     same dtype as q, paged KV pool, new tokens written
    v_cache       [num_pages, page_size, Hkv, d]     same as k_cache
    page_table    [batch, max_pages]                 int32 page ids, in order
    seq_lens      [batch]                            int32 Lk per request (new tokens included)
    cu_seqlens_q  [batch + 1]                        int32 cumulative Lq

Precision (``docs/fp8.md``): ``precision="fp8"`` runs e4m3 operands (block scoring, ``Q K^T``,
``P V``, the mean correction); ``k_cache`` / ``v_cache`` may then, or with ``"bf16"``, be
``float8_e4m3fn`` caches with their ``k_descale`` / ``v_descale`` (float32 0-dim or ``[batch, Hkv]``).
The reference runs both; the Triton FP8 kernels (SM89+) run both input kinds with ``precision="fp8"``.
``precision="int8qk"`` (``docs/fp8.md`` section 10): int8 operands in the block scoring, ``Q K^T`` and
the mean logits, e4m3 in the products with V; bf16 / fp16 caches only (an e4m3 cache raises).

Host syncs: ``make_plan`` reads the lengths (``.tolist()``). Build the plan once per batch and pass
``plan=`` to every layer's call: then the Triton backend syncs exactly once per index build (the
``nnz`` read, ``row_ptr[-1]``, that sizes ``col_idx``; ``flashprefill_attention`` without
``index=`` builds one) and nowhere else. The reference backend (CPU, the spec) has syncs of its own.

Example::

    plan = flashprefill.make_plan(seq_lens, cu_seqlens_q, group_size=Hq // Hkv, block_size=cfg.block_size)
    out, stats = flashprefill.flashprefill_attention(q, k_cache, v_cache, page_table, seq_lens,
                                                     cu_seqlens_q, cfg, return_stats=True, plan=plan)
    ref = flashprefill.dense_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, plan=plan)
"""
from __future__ import annotations

import importlib
import math
import os

import torch

from .config import (EIGHT_BIT_PRECISIONS, FP8_HEAD_DIMS, FP8_MIN_CAPABILITY, PRECISIONS, TRITON_DTYPES,
                     TRITON_HEAD_DIMS, SparseConfig)
from .index import BlockIndex, SparseStats
from .plan import BatchPlan, make_plan
from .quant import E4M3

BACKENDS = ("auto", "reference", "triton")
_MODULES = {"reference": "flashprefill.impl.reference", "triton": "flashprefill.impl.triton.host"}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------
# Backend selection


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _choose_backend(backend: str, device_type: str, dtype: torch.dtype, head_dim: int, precision: str = "bf16") -> str:
    """The backend that runs ``q`` (device type, dtype, head dim): a pure function of its arguments
    (and ``TRITON_INTERPRET``).

    ``"auto"``: ``"triton"`` for CUDA tensors the kernels take (``TRITON_DTYPES``,
    ``TRITON_HEAD_DIMS``), else ``"reference"`` (CPU, float32 models, other head dims). An explicit
    backend is returned as is; ``"triton"`` off CUDA raises unless ``TRITON_INTERPRET`` is set (an
    unsupported dtype / head dim raises in ``_validate``). ``precision="fp8"`` with ``"auto"``: every
    CUDA tensor goes to ``"triton"`` (FP8 on a GPU is the kernels' job; what they refuse raises
    there), CPU tensors to the reference; ``"int8qk"`` likewise.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and precision in EIGHT_BIT_PRECISIONS:
        return "triton" if device_type == "cuda" else "reference"
    if backend == "auto":
        takes = device_type == "cuda" and dtype in TRITON_DTYPES and head_dim in TRITON_HEAD_DIMS
        return "triton" if takes else "reference"
    if backend == "triton" and device_type != "cuda" and not _triton_interpret():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got q on {device_type} "
            "(use backend='reference' or 'auto', or set TRITON_INTERPRET=1 to run the kernels in the interpreter)"
        )
    return backend


def _pick_backend(backend: str, q: torch.Tensor, precision: str = "bf16") -> str:
    return _choose_backend(backend, q.device.type, q.dtype, q.shape[-1] if q.dim() else 0, precision)


def _load(name: str):
    """Import a backend module lazily. A missing dependency (triton) raises its ``ImportError``:
    never a silent fallback to another backend."""
    return importlib.import_module(_MODULES[name])


# --------------------------------------------------------------------------------------------
# Validation (once, at the boundary; skipped while torch.compile traces)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_tensor(name: str, t, ndim: int, expected: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {expected}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {expected}, got shape {_shape(t)}")


def _check_int32(name: str, t: torch.Tensor, expected: str) -> None:
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 {expected}, got {t.dtype}")


def _validate(
    q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, backend: str, plan,
) -> None:
    """Shapes, dtypes, devices and layouts of the tensor arguments (no host sync)."""
    _check_tensor("q", q, 3, "[total_q, Hq, d]")
    _check_tensor("k_cache", k_cache, 4, "[num_pages, page_size, Hkv, d]")
    _check_tensor("v_cache", v_cache, 4, "[num_pages, page_size, Hkv, d]")
    _check_tensor("page_table", page_table, 2, "[batch, max_pages]")
    _check_tensor("seq_lens", seq_lens, 1, "[batch]")
    _check_tensor("cu_seqlens_q", cu_seqlens_q, 1, "[batch + 1]")
    total_q, hq, d = q.shape
    num_pages, page_size, hkv, dk = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape [num_pages, page_size, Hkv, d] = {_shape(k_cache)}, "
            f"got {_shape(v_cache)}"
        )
    if dk != d:
        raise ValueError(f"k_cache head_dim d must equal q's d = {d}, got k_cache {_shape(k_cache)}")
    if hkv < 1 or hq < 1:
        raise ValueError(f"need Hq >= 1 and Hkv >= 1, got q {_shape(q)} (Hq={hq}), k_cache {_shape(k_cache)} (Hkv={hkv})")
    if hq % hkv != 0:
        raise ValueError(
            f"q heads Hq={hq} must be a multiple of k_cache heads Hkv={hkv} (GQA group g = Hq / Hkv), "
            f"got q {_shape(q)}, k_cache {_shape(k_cache)}"
        )
    if page_size < 1:
        raise ValueError(f"k_cache page_size must be >= 1, got k_cache {_shape(k_cache)}")
    # dtypes
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be one of {_FLOAT_DTYPES}, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and not (t.dtype == E4M3 and k_cache.dtype == v_cache.dtype):
            raise TypeError(
                f"{name} must have q's dtype {q.dtype} (or float8_e4m3fn, both caches), "
                f"got k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
            )
    _check_int32("page_table", page_table, "[batch, max_pages]")
    _check_int32("seq_lens", seq_lens, "[batch]")
    _check_int32("cu_seqlens_q", cu_seqlens_q, "[batch + 1]")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(
            f"cu_seqlens_q must be [batch + 1] = [{batch + 1}] for seq_lens [batch] = [{batch}], "
            f"got {_shape(cu_seqlens_q)}"
        )
    if page_table.shape[0] != batch:
        raise ValueError(
            f"page_table must be [batch, max_pages] with batch = {batch} (seq_lens), got {_shape(page_table)}"
        )
    # devices
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("page_table", page_table),
                    ("seq_lens", seq_lens), ("cu_seqlens_q", cu_seqlens_q)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    # layouts: the kernels take any page / token / head stride but need a unit stride on d
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride(-1) == 1), got strides {tuple(t.stride())}; "
                f"pass {name}.contiguous()"
            )
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not (math.isfinite(softmax_scale) and softmax_scale > 0):
            raise ValueError(f"softmax_scale must be a finite float > 0, got {softmax_scale}")
    if backend == "triton":
        if q.dtype not in TRITON_DTYPES:
            raise TypeError(f"q must be bfloat16 or float16 for backend='triton', got {q.dtype}")
        if d not in TRITON_HEAD_DIMS:
            raise ValueError(f"q head_dim d must be one of {TRITON_HEAD_DIMS} for backend='triton', got {d}")
    if plan is not None:
        if not isinstance(plan, BatchPlan):
            raise TypeError(f"plan must be a flashprefill.BatchPlan (flashprefill.make_plan), got {type(plan).__name__}")
        if plan.batch != batch:
            raise ValueError(f"plan was built for batch {plan.batch}, got seq_lens [batch] = [{batch}]")
        if plan.group_size != hq // hkv:
            raise ValueError(
                f"plan was built for group_size {plan.group_size}, got Hq / Hkv = {hq} / {hkv} = {hq // hkv}"
            )


def _check_precision(precision) -> None:
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _check_int8qk_cache(precision: str, k_cache) -> None:
    """``precision="int8qk"`` quantises 16-bit K itself: an e4m3 cache raises (docs/fp8.md section 10)."""
    if precision == "int8qk" and getattr(k_cache, "dtype", None) == E4M3:
        raise ValueError(
            "precision='int8qk' cannot read a float8_e4m3fn KV cache (k_cache is float8_e4m3fn; int8qk quantises "
            "bf16 / fp16 K to int8 itself): precision='fp8' reads e4m3 caches as they are"
        )


def _check_fp8_gpu(device, precision: str = "fp8") -> None:
    """FP8 / int8qk need e4m3 tensor cores: compute capability >= ``FP8_MIN_CAPABILITY`` (8.9)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        need = ".".join(str(x) for x in FP8_MIN_CAPABILITY)
        raise ValueError(
            f"precision={precision!r} needs e4m3 tensor cores (compute capability >= {need}: Ada, Hopper, Blackwell), "
            f"got {name!r} ({device}) with compute capability {major}.{minor}; precision='bf16' runs on this GPU"
        )


def _validate_precision(q, k_cache, seq_lens, k_descale, v_descale) -> None:
    """The e4m3-cache arguments (docs/fp8.md section 5)."""
    e4m3 = k_cache.dtype == E4M3
    batch, hkv = seq_lens.shape[0], k_cache.shape[2]
    expected = f"(a float32 0-dim tensor or [batch, Hkv] = [{batch}, {hkv}])"
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            if e4m3:
                raise ValueError(
                    f"{name} is required with float8_e4m3fn caches {expected}: the value of a cached code is "
                    f"code * {name}; got {name}=None"
                )
            continue
        if not e4m3:
            raise ValueError(
                f"{name} applies to float8_e4m3fn caches only, got k_cache {k_cache.dtype} with {name} given"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {expected}, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 {expected}, got {t.dtype}")
        if not (t.dim() == 0 or tuple(t.shape) == (batch, hkv)):
            raise ValueError(f"{name} must be {expected}, got shape {_shape(t)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def check_fp8_support(device: torch.device | str, head_dim: int, precision: str = "fp8") -> None:
    """Whether ``precision="fp8"`` (or ``"int8qk"``: the same kernels and limits) can run on
    ``device`` with this head dim, before any work: the check the Triton 8-bit path makes, for
    callers (engines) that want it at start-up.

    The CPU (the reference) takes any head dim; a CUDA device needs compute capability >=
    ``FP8_MIN_CAPABILITY`` and ``head_dim`` in ``FP8_HEAD_DIMS``.

    Raises:
        ValueError: naming the GPU and its compute capability, or the head dim, and saying that
            ``precision='bf16'`` runs there.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return
    _check_fp8_gpu(device, precision)
    if head_dim not in FP8_HEAD_DIMS:
        raise ValueError(
            f"precision={precision!r} on the GPU needs head_dim d in {FP8_HEAD_DIMS}, got d = {head_dim}; "
            "precision='bf16' runs with this shape"
        )


def _validate_fp8_gpu(q, precision: str = "fp8") -> None:
    """FP8 / int8qk on the Triton path: the GPU and the head dim, checked before anything else."""
    _check_tensor("q", q, 3, "[total_q, Hq, d]")
    if q.device.type == "cuda":
        _check_fp8_gpu(q.device, precision)
    d = q.shape[2]
    if d not in FP8_HEAD_DIMS:
        raise ValueError(
            f"precision={precision!r} on the GPU needs head_dim d in {FP8_HEAD_DIMS}, got q {_shape(q)} (d = {d}); "
            "precision='bf16' runs with this shape"
        )


def _check_triton_precision(precision: str, k_cache) -> None:
    """What the Triton kernels do not run: e4m3 caches on the 16-bit path."""
    if k_cache.dtype == E4M3 and precision not in EIGHT_BIT_PRECISIONS:
        raise ValueError(
            "float8_e4m3fn caches with backend='triton' and precision='bf16': the 16-bit kernels do not read "
            "e4m3 caches; use precision='fp8' (reads them as they are) or backend='reference'"
        )


def _precision_kwargs(precision: str, k_descale, v_descale) -> dict:
    """Keyword arguments for a backend: none on the default path (bf16, no descales)."""
    if precision == "bf16" and k_descale is None and v_descale is None:
        return {}
    return {"precision": precision, "k_descale": k_descale, "v_descale": v_descale}


def _validate_plan(plan: BatchPlan, q, page_table, k_cache, config: SparseConfig | None) -> None:
    """Checks that need the host lengths (free: they live in the plan)."""
    total = sum(plan.q_lens)
    if total != q.shape[0]:
        raise ValueError(
            f"q must have total_q = sum of the plan's q_lens = {total} rows (cu_seqlens_q[-1] when the plan "
            f"was built), got q {_shape(q)}"
        )
    if config is not None and plan.block_size != config.block_size:
        raise ValueError(
            f"plan was built for block_size {plan.block_size}, got config.block_size {config.block_size}"
        )
    page_size = k_cache.shape[1]
    cap = page_table.shape[1] * page_size
    for b, lk in enumerate(plan.kv_lens):
        if lk > cap:
            raise ValueError(
                f"page_table too short for seq_lens: request {b} has seq_len {lk} but page_table "
                f"{_shape(page_table)} holds max_pages * page_size = {page_table.shape[1]} * {page_size} = {cap} tokens"
            )


def _check_page_ids(page_table: torch.Tensor, plan: BatchPlan, num_pages: int, page_size: int) -> None:
    """Page ids of the used part of ``page_table`` lie in ``[0, num_pages)`` (one host sync)."""
    if page_table.numel() == 0:
        return
    need = torch.tensor([-(-lk // page_size) for lk in plan.kv_lens], device=page_table.device)
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < need[:, None]
    bad = used & ((page_table < 0) | (page_table >= num_pages))
    if bool(bad.any()):
        b, col = (int(x) for x in torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"page_table[{b}, {col}] = {int(page_table[b, col])} is out of range for k_cache with "
            f"num_pages = {num_pages} (request {b} uses its first {int(need[b])} pages)"
        )


def _prepare(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan, backend,
             dense: bool = False, precision: str = "bf16", k_descale=None, v_descale=None):
    """Validate, resolve defaults, build the plan when absent. Returns (config, scale, plan, module).

    ``dense``: for ``dense_attention``, where a given plan's block size does not matter.
    ``precision``, ``k_descale``, ``v_descale``: checked here (``_validate_precision``).
    """
    if config is None:
        config = SparseConfig()
    compiling = torch.compiler.is_compiling()
    if not compiling:
        if not isinstance(config, SparseConfig):
            raise TypeError(f"config must be a flashprefill.SparseConfig or None, got {type(config).__name__}")
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor [total_q, Hq, d], got {type(q).__name__}")
    if not compiling:
        _check_precision(precision)
        _check_int8qk_cache(precision, k_cache)
    if config.global_keys and not dense and backend == "triton":           # docs/method.md section 4.1
        raise NotImplementedError(
            f"SparseConfig.global_keys={config.global_keys} (docs/method.md section 4.1) has no Triton kernel "
            "yet: use backend='auto' or 'reference' (the reference runs it, on the GPU too, slower)")
    name = _pick_backend(backend, q, precision)
    if config.global_keys and not dense:
        name = "reference"
    if not compiling:
        if precision in EIGHT_BIT_PRECISIONS and name == "triton":
            _validate_fp8_gpu(q, precision)
        _validate(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, softmax_scale, name, plan)
        _validate_precision(q, k_cache, seq_lens, k_descale, v_descale)
    if name == "triton":
        _check_triton_precision(precision, k_cache)
    built = plan is None
    if built:
        plan = make_plan(seq_lens, cu_seqlens_q, q.shape[1] // k_cache.shape[2], config.block_size)
    if not compiling:
        _validate_plan(plan, q, page_table, k_cache, None if dense else config)
        if built:  # already synced for the plan: the page-id range check is cheap here
            _check_page_ids(page_table, plan, k_cache.shape[0], k_cache.shape[1])
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    return config, scale, plan, _load(name)


def _check_index(index, plan: BatchPlan, config: SparseConfig, hkv: int) -> None:
    if not isinstance(index, BlockIndex):
        raise TypeError(f"index must be a flashprefill.BlockIndex (flashprefill.build_index), got {type(index).__name__}")
    if index.block_size != config.block_size:
        raise ValueError(f"index was built with block_size {index.block_size}, got config.block_size {config.block_size}")
    if index.group_size != plan.group_size:
        raise ValueError(f"index was built for group_size {index.group_size}, got Hq / Hkv = {plan.group_size}")
    if index.n_segments != hkv * plan.n_tiles:
        raise ValueError(
            f"index has {index.n_segments} segments, expected Hkv * n_tiles = {hkv} * {plan.n_tiles} "
            "(was it built for another batch?)"
        )
    bits = index.sel_bits
    if bits is not None:
        words = -(-plan.max_blocks(config.block_size) // 32)
        if (bits.dtype != torch.int32 or bits.dim() != 2 or bits.shape[0] != index.n_segments
                or bits.shape[1] < max(1, words) or not bits.is_contiguous()):
            raise ValueError(
                f"index.sel_bits must be a contiguous int32 [n_segments, >= ceil(max_blocks / 32)] = "
                f"[{index.n_segments}, >= {max(1, words)}], got {bits.dtype} {list(bits.shape)} "
                "(a BlockIndex with another CSR must set sel_bits=None)"
            )


# --------------------------------------------------------------------------------------------
# Public functions


def build_index(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    config: SparseConfig | None = None,
    softmax_scale: float | None = None,
    *,
    plan: BatchPlan | None = None,
    backend: str = "auto",
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> BlockIndex:
    """Block index of a batch: K/V block means and the CSR of selected blocks (``docs/method.md``
    sections 3.1-3.6).

    Args:
        q: ``[total_q, Hq, d]`` new queries, varlen-packed (see module docstring for all tensors).
        k_cache, v_cache: ``[num_pages, page_size, Hkv, d]``, ``q``'s dtype.
        page_table: int32 ``[batch, max_pages]``.
        seq_lens: int32 ``[batch]``, ``Lk`` per request, new tokens included.
        cu_seqlens_q: int32 ``[batch + 1]``.
        config: ``SparseConfig`` (defaults when None).
        softmax_scale: ``τ``; ``1/sqrt(d)`` when None.
        plan: from ``make_plan`` with ``group_size = Hq // Hkv`` and ``config.block_size``; built
            (one host sync) when None.
        backend: ``"auto"`` | ``"reference"`` | ``"triton"``.
        precision: ``"bf16"`` | ``"fp8"`` | ``"int8qk"`` (``PRECISIONS``): with ``"fp8"`` the block
            scoring ``q·k̄`` takes e4m3 operands (``docs/fp8.md``), with ``"int8qk"`` int8 operands
            (section 10); the means stay float32.
        k_descale, v_descale: float32 0-dim or ``[batch, Hkv]``; required when ``k_cache`` /
            ``v_cache`` are ``float8_e4m3fn`` (a code's value is ``code * descale``), else None.

    Returns:
        ``BlockIndex`` (``row_ptr`` int32 ``[Hkv * n_tiles + 1]``, ``col_idx`` int32 ``[nnz]``,
        ``k_mean``/``v_mean`` float32 ``[n_blocks, Hkv, d]``; see ``docs/layout.md``).

    Raises:
        ValueError / TypeError: naming the argument, the expected shape/dtype/device and what was found;
            ``precision="fp8"`` on a GPU below compute capability 8.9 or with a head dim outside
            ``FP8_HEAD_DIMS`` (naming the GPU / the shape); e4m3 caches without their descale;
            ``precision="int8qk"`` with e4m3 caches (``precision="fp8"`` reads them).
    """
    config, scale, plan, mod = _prepare(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q,
                                        config, softmax_scale, plan, backend, precision=precision,
                                        k_descale=k_descale, v_descale=v_descale)
    return mod.build_index(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, scale, plan,
                           **_precision_kwargs(precision, k_descale, v_descale))


def flashprefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    config: SparseConfig | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    return_stats: bool = False,
    *,
    plan: BatchPlan | None = None,
    index: BlockIndex | None = None,
    backend: str = "auto",
    return_index: bool = False,
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Block-sparse causal prefill attention with mean correction (FlashPrefill V2, ``docs/method.md``
    sections 3-4).

    Query token ``t`` of a request sees KV positions ``p <= P + t`` (``P = Lk - Lq``, bottom-right
    causal). Selected blocks are computed exactly; pruned blocks fully seen by the whole tile are
    folded back as ``n_j`` copies of their mean key/value (``config.mean_correction``).

    Args:
        q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, softmax_scale, plan,
            backend, k_descale, v_descale: as ``build_index``.
        precision: ``"bf16"`` | ``"fp8"``: with ``"fp8"``, e4m3 operands in the block scoring, in
            ``Q K^T`` and ``P V``, and in both mean-correction products; fp32 accumulation, output in
            q's dtype (``docs/fp8.md``); ``"int8qk"``: int8 operands in the block scoring, ``Q K^T``
            and the mean logits (int32 sums), e4m3 in the products with V (section 10).
        return_lse: also return ``lse``.
        return_stats: also return ``SparseStats`` (density overall and per KV head, the index).
            It reads the index on the host: one more sync.
        index: a ``BlockIndex`` of this batch and config (built when None).
        return_index: also return the ``BlockIndex`` the attention used (the one given, or the
            one built here), without a host sync: a caller derives its statistics from the exact
            index that ran (e.g. ``SparseStats.from_index`` later, or ``row_ptr`` / ``n_visible``
            on the device).

    Returns:
        ``out`` ``[total_q, Hq, d]`` in q's dtype, or, when any ``return_*`` flag is set, the
        tuple ``(out[, lse][, stats][, index])`` in that order. ``lse`` ``[total_q, Hq]`` float32
        (float64 for float64 inputs on the reference): natural log of the corrected softmax
        denominator. ``stats`` = ``SparseStats.from_index(index)`` (it syncs; ask only when
        needed). ``index``: ``BlockIndex`` (device tensors, see ``docs/layout.md``).

    Raises:
        ValueError / TypeError: naming the argument, the expected shape/dtype/device and what was found.
    """
    config, scale, plan, mod = _prepare(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q,
                                        config, softmax_scale, plan, backend, precision=precision,
                                        k_descale=k_descale, v_descale=v_descale)
    extra = _precision_kwargs(precision, k_descale, v_descale)
    if index is None:   # one call: the Triton backend launches the attention before the index's nnz sync
        out, lse, index = mod.attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, scale, plan,
                                        **extra)
    else:
        if not torch.compiler.is_compiling():
            _check_index(index, plan, config, k_cache.shape[2])
        out, lse = mod.sparse_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, config, scale,
                                        plan, index, **extra)
    result = (out,)
    if return_lse:
        result += (lse,)
    if return_stats:
        result += (SparseStats.from_index(index),)
    if return_index:
        result += (index,)
    return result[0] if len(result) == 1 else result


def dense_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    plan: BatchPlan | None = None,
    backend: str = "auto",
    precision: str = "bf16",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
):
    """Dense causal attention over the paged KV (bottom-right aligned), the comparison baseline.

    Args: as ``flashprefill_attention`` (no config; ``plan`` may use any block size;
        ``precision="fp8"``: e4m3 ``Q K^T`` and ``P V``; ``"int8qk"``: int8 ``Q K^T``, e4m3 ``P V``).

    Returns:
        ``out`` ``[total_q, Hq, d]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    _, scale, plan, mod = _prepare(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q,
                                   None, softmax_scale, plan, backend, dense=True, precision=precision,
                                   k_descale=k_descale, v_descale=v_descale)
    out, lse = mod.dense_attention(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, scale, plan,
                                   **_precision_kwargs(precision, k_descale, v_descale))
    return (out, lse) if return_lse else out

