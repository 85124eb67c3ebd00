"""``FlashPrefillAttnBackend``: FlashPrefill V2 block-sparse prefill inside stock SGLang 0.5.17.

A thin ``AttentionBackend`` (style guide habit 11). It owns only the extend (prefill) path:

- ``init_forward_metadata`` builds ``FlashPrefillMetadata`` once per batch (page table from
  ``req_to_token``, ``cu_seqlens_q``, the operator's ``BatchPlan`` from SGLang's host-side
  lengths, so no device-to-host copy) and a ``BatchStats`` (device counters, CUDA events).
- ``forward_extend`` writes the new K/V into SGLang's pool, then calls
  ``flashprefill_attention(..., return_index=True)`` on the pool viewed as pages, with the batch
  plan: the fused path the operator benchmark times. The statistics (``stats_writer.BatchStats``)
  are read from the index it returned. With ``layer_timing`` (off unless asked for) the index is
  built by ``build_index`` between two CUDA events and handed to the attention.
- Everything the operator does not cover runs on a stock SGLang backend (``dense_backend``,
  ``triton`` by default) built from SGLang's own registry: the ``dense_layers`` layers (the first N or a set),
  batches whose requests are all shorter than ``min_sparse_len``, sliding-window, cross and
  encoder layers, logit soft-capping, sinks, an e4m3 KV cache with a precision other than ``"fp8"``, KV pools
  that are not plain token-major MHA pools (SWA / unified / HND), speculative modes, and models the
  Triton operator cannot take (head_dim not 64/128/256, dtype not bf16/fp16; decided at init by
  ``metadata.operator_dense_reason``, unless ``operator_backend="reference"``).
- Precision: ``settings.precision`` goes to the operator (``"fp8"``: e4m3 operands in the sparse
  prefill; ``"int8qk"``: int8 Q and K, e4m3 P and V; ``docs/fp8.md``). With SGLang's
  ``--kv-cache-dtype fp8_e4m3`` the pool holds e4m3 codes
  (``get_key_buffer`` views them as ``float8_e4m3fn``); with ``precision="fp8"`` they are passed
  as they are, with the layer's ``k_scale`` / ``v_scale`` (``RadixAttention``; ``None`` = 1.0) as
  ``k_descale`` / ``v_descale``: nothing is converted back to bf16; with ``"int8qk"`` (int8 Q and
  K from 16-bit K only) such layers run dense, and ``fp``'s engine refuses the pair before
  start. With ``compare_fp8`` every sparse 8-bit layer (``EIGHT_BIT_PRECISIONS``) also runs the
  BF16 operator and the statistics carry the error sums (``integrations.fp8_error``).
- Decode is not ours: with ``prefill_attention_backend="flashprefill"`` and
  ``decode_attention_backend="triton"`` SGLang's ``HybridAttnBackend`` sends decode (and its CUDA
  graphs) to the decode backend. Used alone, this backend delegates decode and the decode CUDA
  graph hooks to its dense backend.
- Prefill CUDA graphs (SGLang's breakable / tc_piecewise capture of extend batches) are not
  supported: the engine wrapper and ``fp serve`` set ``disable_prefill_cuda_graph``; a capture
  attempt raises a ``RuntimeError`` that says so.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType

from ...api import build_index, flashprefill_attention
from ...config import EIGHT_BIT_PRECISIONS
from ...dense_layers import dense_layers_text
from ..fp8_error import fp8_error_sums
from .metadata import (
    FlashPrefillMetadata, build_metadata, check_page_table, last_attention_layer_id, operator_dense_reason,
)
from .settings import BackendSettings
from .stats_writer import BatchStats, StatsWriter

logger = logging.getLogger(__name__)

_EXTRA_KWARGS_DENSE = ("sinks", "score_mod", "aux_tensors", "rel_bias", "q_descale", "k_descale", "v_descale")


def _registered_by() -> str:
    from . import plugin

    return plugin.REGISTERED_BY or "unknown"


class FlashPrefillAttnBackend(AttentionBackend):
    """Block-sparse prefill through ``flashprefill``; dense cases and decode on a stock backend."""

    needs_cpu_seq_lens: bool = True  # the plan is built from seq_lens_cpu / extend_seq_lens_cpu

    def __init__(self, model_runner: Any, settings: BackendSettings):
        super().__init__()
        self.settings = settings
        self.model_runner = model_runner
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = self.req_to_token_pool.req_to_token
        self.device = self.req_to_token.device
        self.page_size = max(1, int(getattr(model_runner, "page_size", 1) or 1))

        # The dense backend: every case the operator does not serve, and decode when used alone.
        if settings.dense_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"flashprefill: dense_backend {settings.dense_backend!r} is not registered in SGLang")
        self.dense = ATTENTION_BACKENDS[settings.dense_backend](model_runner)

        pool = self.token_to_kv_pool
        self.layer_offset = int(getattr(pool, "start_layer", 0) or 0)
        self.num_layers = int(getattr(pool, "layer_num", 0) or 0) or int(model_runner.model_config.num_hidden_layers)
        # Not pool.end_layer: SGLang passes the model's exclusive end there (see last_attention_layer_id).
        self.last_layer_id, last_src = last_attention_layer_id(
            getattr(model_runner, "model", None), pool, getattr(model_runner.model_config, "num_hidden_layers", None))
        self.num_q_heads, self.num_kv_heads, self.head_dim = self._head_geometry(model_runner)
        self.group_size = max(1, self.num_q_heads // max(1, self.num_kv_heads))
        model_dtype = getattr(model_runner, "dtype", None) or getattr(model_runner.model_config, "dtype", None)
        self.unsupported_reason = self._check_pool(model_runner) or operator_dense_reason(
            self.head_dim, model_dtype if isinstance(model_dtype, torch.dtype) else None, settings.operator_backend)
        tp_rank = getattr(model_runner, "tp_rank", None)  # SGLang's ModelRunner keeps its TP rank
        if tp_rank is None:
            tp_rank = getattr(getattr(model_runner, "ps", None), "tp_rank", 0)
        self.tp_rank = int(tp_rank or 0)

        self._op_kwargs: dict[str, Any] = dict(backend=settings.operator_backend, precision=settings.precision)

        self.writer = StatsWriter(settings.stats_dir, self.device) if settings.collect_stats and self.tp_rank == 0 else None
        self.forward_metadata: Optional[FlashPrefillMetadata] = None
        self._batch_stats: Optional[BatchStats] = None
        self._dense_ready = False
        self._logged_reasons: set[str] = set()
        self._sparse_seen = False  # logs the first sparse prefill once (fp serve has no stats)
        logger.info(
            "flashprefill backend: layers %d (%s dense), heads q=%d kv=%d d=%d, page_size %d, "
            "last layer id %d (%s), registered by the %s path, config %s, precision %s, dense backend %s, stats %s%s",
            self.num_layers, (f"first {settings.dense_layers}" if isinstance(settings.dense_layers, int)
                              else f"layers {dense_layers_text(settings.dense_layers)}"), self.num_q_heads, self.num_kv_heads, self.head_dim,
            self.page_size, self.last_layer_id, last_src, _registered_by(), settings.sparse, settings.precision, settings.dense_backend,
            settings.stats_dir if self.writer else "off",
            f"; SPARSE DISABLED: {self.unsupported_reason}" if self.unsupported_reason else "",
        )

    # ------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _head_geometry(model_runner: Any) -> tuple[int, int, int]:
        cfg = model_runner.model_config
        try:
            from sglang.srt.runtime_context import get_parallel

            tp = int(get_parallel().attn_tp_size)
        except Exception:  # older layouts / mocks
            tp = int(getattr(model_runner, "tp_size", 1) or 1)
        hq = int(cfg.get_num_attention_heads(tp))
        hkv = int(cfg.get_num_kv_heads(tp))
        d = int(getattr(cfg, "head_dim", 0) or model_runner.token_to_kv_pool.get_key_buffer(0).shape[-1])
        return hq, hkv, d

    def _check_pool(self, model_runner: Any) -> str | None:
        """Why the pool cannot be read as ``[pages, page_size, Hkv, d]`` (``None`` = it can)."""
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        pool = self.token_to_kv_pool
        if getattr(model_runner, "use_mla_backend", False):
            return "MLA model"
        if not isinstance(pool, MHATokenToKVPool):
            return f"KV pool {type(pool).__name__} is not a plain MHATokenToKVPool (SWA/hybrid)"
        if type(pool).__name__ != "MHATokenToKVPool":
            return f"KV pool subclass {type(pool).__name__}"
        if getattr(pool, "is_quantized_kv_cache", False) and getattr(pool, "dtype", None) != torch.float8_e4m3fn:
            return f"quantized KV cache ({getattr(pool, 'dtype', '?')})"
        if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
            return f"KV layout {getattr(pool, 'kv_cache_layout', '?')}"
        alloc = getattr(model_runner, "token_to_kv_pool_allocator", None)
        if getattr(alloc, "translate_kv_loc", None) is not None or getattr(alloc, "translate_kv_loc_dense", None) is not None:
            return "unified (virtual-slot) KV pool"
        if getattr(self.dense, "dcp_size", 1) > 1:
            return "decode context parallelism"
        kb = pool.get_key_buffer(self.layer_offset)
        if kb.dim() != 3:
            return f"key buffer of rank {kb.dim()}"
        if kb.shape[0] % self.page_size:
            logger.warning("flashprefill: pool rows %d not a multiple of page_size %d; the tail is unused",
                           kb.shape[0], self.page_size)
        return None

    # ------------------------------------------------------------------------------------------
    # per batch
    # ------------------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():  # only when this backend is used alone
            self.forward_metadata = None
            self.dense.init_forward_metadata(forward_batch)
            return
        self._finish_batch()  # a batch whose last layer never called us (defensive)
        self._dense_ready = False
        dense_reason = self.unsupported_reason
        if dense_reason is None and getattr(mode, "name", "") not in ("EXTEND", "MIXED"):
            dense_reason = f"forward mode {getattr(mode, 'name', mode)}"
        if dense_reason is None and forward_batch.encoder_lens is not None:
            dense_reason = "encoder-decoder batch"
        if dense_reason is None and getattr(forward_batch, "spec_info", None) is not None:
            dense_reason = "speculative batch"
        kv_host, q_host = self._host_lengths(forward_batch)
        meta = build_metadata(
            req_to_token=self.req_to_token,
            req_pool_indices=forward_batch.req_pool_indices,
            seq_lens=forward_batch.seq_lens,
            extend_seq_lens=forward_batch.extend_seq_lens,
            kv_lens_host=kv_host,
            q_lens_host=q_host,
            page_size=self.page_size,
            pool_rows=int(self.token_to_kv_pool.get_key_buffer(self.layer_offset).shape[0]),
            group_size=self.group_size,
            block_size=self.settings.sparse.block_size,
            min_sparse_len=self.settings.sparse.min_sparse_len,
            dense_reason=dense_reason,
            rids=getattr(forward_batch, "rids", None),
        )
        self.forward_metadata = meta
        if self.settings.debug_checks and meta.sparse:
            check_page_table(meta.page_table, self.req_to_token, forward_batch.req_pool_indices, meta.kv_lens, self.page_size)
        if meta.dense_reason is not None:
            self._log_once(f"batch dense: {meta.dense_reason}")
        if self.settings.collect_stats:
            self._batch_stats = BatchStats(
                num_layers=self.num_layers,
                layer_offset=self.layer_offset,
                num_q_heads=self.num_q_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                q_lens=meta.q_lens,
                kv_lens=meta.kv_lens,
                rids=meta.rids,
                device=self.device,
                layer_timing=self.settings.layer_timing,
                plan=meta.plan,
            )

    @staticmethod
    def _host_lengths(forward_batch: Any) -> tuple[list[int], list[int]]:
        """(Lk, Lq) per request from SGLang's host copies; device copies (a sync) only as fallback."""
        seq_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        kv = seq_cpu.tolist() if seq_cpu is not None else forward_batch.seq_lens.tolist()
        q = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if q is None:
            q = forward_batch.extend_seq_lens.tolist() if forward_batch.extend_seq_lens is not None else kv
        return [int(x) for x in kv], [int(x) for x in q]

    def _ensure_dense(self, forward_batch: Any) -> None:
        if not self._dense_ready:
            self.dense.init_forward_metadata(forward_batch)
            self._dense_ready = True

    def _finish_batch(self) -> None:
        stats, self._batch_stats = self._batch_stats, None
        if stats is not None:
            stats.finish()
            if self.writer is not None:
                self.writer.submit(stats)

    def _log_once(self, reason: str) -> None:
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            logger.info("flashprefill: %s (logged once)", reason)

    # ------------------------------------------------------------------------------------------
    # per layer
    # ------------------------------------------------------------------------------------------
    def _layer_dense_reason(self, q, k, v, layer, meta, kwargs) -> str | None:
        if meta is None:
            return "no metadata"
        if meta.dense_reason is not None:
            return meta.dense_reason.split(" (")[0]
        if self.settings.dense_layer(layer.layer_id):
            return "dense_layers"
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            return "sliding_window"
        if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
            return "non-causal layer"
        if layer.logit_cap and layer.logit_cap > 0:
            return "logit_cap"
        if layer.qk_head_dim != layer.v_head_dim:
            return "qk/v head dims differ"
        if k is None or v is None:
            return "shared KV (k/v None)"
        if any(kwargs.get(name) is not None for name in _EXTRA_KWARGS_DENSE):
            return "extra attention inputs (sinks/score_mod/...)"
        if layer.tp_q_head_num // layer.tp_k_head_num != meta.plan.group_size:
            return "group size differs from the plan"
        if q.shape[0] != meta.total_q:
            return "padded tokens"
        return None

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        meta = self.forward_metadata
        reason = self._layer_dense_reason(q, k, v, layer, meta, kwargs)
        if reason is None:
            reason = self._kv_dtype_reason(self.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype, q.dtype)
        if reason is not None:
            self._ensure_dense(forward_batch)
            out = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
            if self._batch_stats is not None:
                self._batch_stats.mark_dense(layer.layer_id, reason)
        else:
            out = self._sparse_extend(q, k, v, layer, forward_batch, save_kv_cache, meta)
        if layer.layer_id >= self.last_layer_id:
            if layer.layer_id > self.last_layer_id:  # defensive: never seen with the RadixAttention scan
                logger.warning("flashprefill: layer %d after the expected last layer %d; finishing stats there",
                               layer.layer_id, self.last_layer_id)
                self.last_layer_id = layer.layer_id
            self._finish_batch()
        return out

    def _kv_dtype_reason(self, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> str | None:
        """Why a layer with this KV pool dtype runs dense (``None``: the operator reads it): an
        e4m3 pool needs ``precision="fp8"`` (``int8qk`` quantizes K from 16 bits); any other pool
        must match q's dtype."""
        if kv_dtype == torch.float8_e4m3fn:
            return None if self.settings.precision == "fp8" else f"e4m3 KV cache with precision {self.settings.precision}"
        return None if kv_dtype == q_dtype else f"KV dtype {kv_dtype} != q dtype {q_dtype}"

    @staticmethod
    def _descale(scale: Any, device: torch.device) -> torch.Tensor:
        """A layer's ``k_scale`` / ``v_scale`` as the operator's descale: float32 0-dim on
        ``device``; ``None`` (SGLang's default when the checkpoint has no scales) is 1.0."""
        if scale is None:
            return torch.ones((), dtype=torch.float32, device=device)
        if isinstance(scale, torch.Tensor):
            return scale.detach().to(device=device, dtype=torch.float32).reshape(())
        # a Python float: filled on the device (a CPU tensor copied over would sync the stream per layer)
        return torch.full((), float(scale), dtype=torch.float32, device=device)

    def _sparse_extend(self, q, k, v, layer, forward_batch, save_kv_cache, meta: FlashPrefillMetadata):
        pool = self.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        hq, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        rows = meta.num_pages * meta.page_size
        k_cache = pool.get_key_buffer(layer.layer_id)[:rows].view(meta.num_pages, meta.page_size, hkv, d)
        v_cache = pool.get_value_buffer(layer.layer_id)[:rows].view(meta.num_pages, meta.page_size, hkv, d)
        q3 = q.reshape(-1, hq, d)
        if not self._sparse_seen:
            self._sparse_seen = True
            logger.info("flashprefill: first sparse prefill on tp rank %d: %d new tokens in %d requests, "
                        "layer %d, %d q / %d kv heads", self.tp_rank, meta.total_q, len(meta.q_lens),
                        layer.layer_id, hq, hkv)
        op_kwargs = dict(self._op_kwargs)
        e4m3 = k_cache.dtype == torch.float8_e4m3fn
        if e4m3:  # SGLang's e4m3 pool, read as it is: code * scale
            op_kwargs.update(k_descale=self._descale(getattr(layer, "k_scale", None), q.device),
                             v_descale=self._descale(getattr(layer, "v_scale", None), q.device))
        stats = self._batch_stats
        timed = stats is not None and stats.layer_timing
        ev0 = stats.stage_event() if timed else None
        index = None
        if timed:  # the index stage alone, between two events
            index = build_index(q3, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q,
                                config=self.settings.sparse, softmax_scale=layer.scaling, plan=meta.plan,
                                **op_kwargs)
        ev1 = stats.stage_event() if timed else None
        out, index = flashprefill_attention(
            q3, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q,
            config=self.settings.sparse, softmax_scale=layer.scaling, plan=meta.plan, index=index,
            return_index=True, **op_kwargs,
        )
        if stats is not None:
            stats.add_index(layer.layer_id, index, (ev0, ev1, stats.stage_event()) if timed else None,
                            precision=self.settings.precision)
            if self.settings.compare_fp8 and self.settings.precision in EIGHT_BIT_PRECISIONS and not e4m3:
                ref = flashprefill_attention(
                    q3, k_cache, v_cache, meta.page_table, meta.seq_lens, meta.cu_seqlens_q,
                    config=self.settings.sparse, softmax_scale=layer.scaling, plan=meta.plan,
                    backend=self.settings.operator_backend, precision="bf16")
                stats.add_fp8_error(layer.layer_id, fp8_error_sums(out, ref, hkv, stats.token_request(),
                                                                    len(meta.q_lens)))
        return out.reshape(-1, hq * layer.v_head_dim)

    # ------------------------------------------------------------------------------------------
    # decode and CUDA graphs: the dense backend's (only reached when used without the hybrid split)
    # ------------------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        return self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise RuntimeError(
                "flashprefill does not support prefill CUDA graphs; start SGLang with "
                "disable_prefill_cuda_graph=True (--disable-prefill-cuda-graph)"
            )
        return self.dense.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch: Any):
        if forward_batch.forward_mode.is_decode_or_idle():
            return self.dense.init_forward_metadata_in_graph(forward_batch)
        return None

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch: Any):
        raise RuntimeError(
            "flashprefill does not support breakable prefill CUDA graphs; set disable_prefill_cuda_graph=True"
        )

    def support_triton(self):
        return self.dense.support_triton()
