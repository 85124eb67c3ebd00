"""The transformers engine: any ``AutoModelForCausalLM`` on CPU or GPU, with FlashPrefill V2 prefill.

FlashPrefill enters through transformers' attention-function interface: ``install_flashprefill``
registers ``flashprefill_attention_forward`` as ``attn_implementation="fp_sparse_prefill"`` and hangs a
``FlashPrefillRuntime`` (profile knobs + per-layer statistics) on every attention module. The
decoder layers then call it with transformers' own tensors::

    query [1, Hq, Lq, d]   key, value [1, Hkv, Lk, d]   (Lk = cached + new tokens, RoPE applied)

Prefill (``Lq > 1``) in a sparse layer (``layer_idx >= profile.dense_layers``) is mapped onto the
operator's layout (``docs/layout.md``): ``q -> [Lq, Hq, d]``; K/V -> a paged cache of
``PAGE_SIZE``-token pages ``[ceil(Lk/64), 64, Hkv, d]`` (zero padded), page table ``arange``,
``seq_lens = [Lk]``, ``cu_seqlens_q = [0, Lq]``; then
``flashprefill.flashprefill_attention(..., config=profile.sparse_config(), return_stats=True)``
(``backend="auto"``: the PyTorch reference on CPU, Triton on CUDA when it supports the dtype and
head dim; the operator decides, ``flashprefill.api._choose_backend``). Dense layers, the ``dense``
profile and decode steps (``Lq == 1``) run ``torch.nn.functional.scaled_dot_product_attention``
with bottom-right causal alignment.

Statistics (``PrefillStats``), per layer of the last prefill:

- density: selected / causally visible key blocks (1.0 for dense layers);
- dense-equivalent attention FLOPs, causal-aware:
  ``4 * d * Hq * sum_t (P + t + 1) = 4 * d * Hq * Lq * (P + (Lq + 1) / 2)``
  (QK^T and PV, 2 FLOPs per multiply-add each), i.e. ``4 Lq Lk_eff d Hq`` with ``Lk_eff`` the mean
  visible keys per query; skipped = dense x (1 - density) per sparse layer;
- index / attention time per layer (ms), synchronised on CUDA.

CPU dtype (``engine.dtype: auto``): float32. Measured with SmolLM2-135M, 2K-token prompt, dense
profile, 2-core AMD EPYC with AVX512-BF16 (no AMX): bf16 weights cut prefill CPU time ~1.4x
(7.5 s vs 10.3 s) but slowed decode ~1.6x (3.3 vs 5.5 tokens/s), and on CPUs without bf16 units
bf16 matmuls are emulated and much slower. float32 also keeps the dequantized GGUF weights exact,
and the reference operator computes in float32 anyway. A profile can ask for ``bfloat16``.
GPU: bfloat16 (the Triton operator's dtype).

Context: ``profile.engine.context_length`` caps the model's context, or extends it with YaRN when
it exceeds the native ``max_position_embeddings`` (``fpcli.engine.context``): the YaRN
``rope_scaling`` is set on the loaded config before the model is built (``apply_context``).

Threads: torch's OpenMP threads spin while idle; on a busy or shared CPU that made a 1K-token
prefill 4x slower here (18 s vs 4.6 s). ``OMP_WAIT_POLICY=PASSIVE`` (set before torch is imported)
avoids it.
"""
from __future__ import annotations

import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .base import GenerationResult, PrefillStats, causal_attention_flops
from .context import ContextPlan, plan_context
from .tokens import token_starts

# Not "flashprefill": transformers 5 treats any implementation name containing "flash" as a
# FlashAttention kernel request (``is_flash_attention_requested``) and tries to import it.
ATTN_NAME = "fp_sparse_prefill"
PAGE_SIZE = 64  # tokens per page of the paged view handed to the operator
DTYPE_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# --------------------------------------------------------------------------------------------
# attention function and its per-model runtime


@dataclass
class LayerStat:
    """What one layer's prefill attention did."""

    layer: int
    sparse: bool
    q_len: int
    kv_len: int
    density: float
    density_per_kv_head: list[float]
    flops_dense: float
    index_ms: float | None = None
    attention_ms: float | None = None


@dataclass
class FlashPrefillRuntime:
    """Per-model state read by ``flashprefill_attention_forward``.

    Attributes:
        config: ``flashprefill.SparseConfig`` of the sparse layers; ``None`` = dense everywhere.
        dense_layers: layers ``< dense_layers`` attend densely.
        backend: the operator's ``backend=`` (``"auto"``: Triton on CUDA, reference otherwise).
        min_prefill_len: query lengths below this use SDPA (decode and tiny chunks).
        timing: measure index / attention time per layer (synchronises CUDA per layer).
        layers: ``layer_idx -> LayerStat`` of the current prefill (reset by ``reset``).
        on_layer: called with ``layer_idx`` after each layer's prefill attention (progress of a
            long prefill; set by the engine for one prefill, ``None`` otherwise).
    """

    config: object | None = None
    dense_layers: int = 0
    backend: str = "auto"
    min_prefill_len: int = 2
    timing: bool = True
    layers: dict[int, LayerStat] = field(default_factory=dict)
    on_layer: Callable[[int], None] | None = None
    _plans: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.layers.clear()
        self._plans.clear()

    def stats(self, n_layers: int) -> PrefillStats:
        """``PrefillStats`` of the current prefill over ``n_layers`` decoder layers."""
        rows = [self.layers.get(i) for i in range(n_layers)]
        dens = [r.density if r else 1.0 for r in rows]
        heads = [r.density_per_kv_head if r else [] for r in rows]
        flops = sum(r.flops_dense for r in rows if r)
        skipped = sum(r.flops_dense * (1.0 - r.density) for r in rows if r and r.sparse)
        sparse = [r for r in rows if r and r.sparse]
        # Overall density: selected / visible over sparse layers (they share one geometry, so the
        # mean of the per-layer ratios is the ratio of the sums).
        overall = sum(r.density for r in sparse) / len(sparse) if sparse else 1.0
        idx = [r.index_ms for r in rows if r and r.index_ms is not None]
        att = [r.attention_ms for r in rows if r and r.attention_ms is not None]
        return PrefillStats(
            density=overall,
            density_per_layer=dens,
            density_per_layer_head=heads,
            sparse_layers=[r.layer for r in sparse],
            attention_flops_dense=flops,
            attention_flops_skipped=skipped,
            index_ms=sum(idx) if idx else None,
            attention_ms=sum(att) if att else None,
        )


def _now(sync_device: torch.device | None) -> float:
    if sync_device is not None and sync_device.type == "cuda":
        torch.cuda.synchronize(sync_device)
    return time.perf_counter()


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, groups: int) -> torch.Tensor:
    """Dense attention, bottom-right causal, GQA without copying K/V. ``query [B, Hq, Lq, d]``,
    key/value ``[B, Hkv, Lk, d]`` with ``Hq = groups * Hkv`` (query head ``h`` reads KV head
    ``h // groups``) -> ``[B, Lq, Hq, d]``.

    A decode step (``Lq == 1``) runs ``_grouped_decode``; a prefill runs SDPA with
    ``enable_gqa``. Neither expands K/V to ``Hq`` heads (``repeat_interleave`` copied the whole
    cache on every decode step: ~25% of a CPU decode step at 7.8K tokens, docs/benchmarks.md).
    """
    lq, lk = query.shape[2], key.shape[2]
    if lq == 1:
        return _grouped_decode(query, key, value, scaling)
    gqa = groups > 1
    if lq == lk:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=gqa)
    else:  # chunk after a prefix: query t sees p <= (Lk - Lq) + t
        pos = torch.arange(lk, device=query.device)
        mask = pos[None, :] <= (lk - lq + torch.arange(lq, device=query.device))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                               enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def _grouped_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """One query token attending to every cached key, as a grouped matmul over views.

    ``query [B, Hq, 1, d]`` is viewed as ``[B, Hkv, g, d]`` (the ``g`` query heads of a KV head
    side by side), so ``q @ k^T`` is ``[B, Hkv, g, Lk]`` against the unexpanded
    ``key [B, Hkv, Lk, d]``; softmax in float32; ``@ value`` -> ``[B, Hkv, g, d]`` ->
    ``[B, 1, Hq, d]``. Example: SmolLM2-135M, ``Hq = 9``, ``Hkv = 3``: heads 0-2 read KV head 0.
    """
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(b, hkv, hq // hkv, d)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, g, Lk]
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, g, d]
    return out.reshape(b, 1, hq, d)


def _paged(x: torch.Tensor) -> torch.Tensor:
    """``[1, Hkv, Lk, d]`` -> pages ``[ceil(Lk / PAGE_SIZE), PAGE_SIZE, Hkv, d]`` (zero padded)."""
    _, hkv, lk, d = x.shape
    n_pages = -(-lk // PAGE_SIZE)
    pages = x.new_zeros(n_pages * PAGE_SIZE, hkv, d)
    pages[:lk] = x[0].transpose(0, 1)
    return pages.view(n_pages, PAGE_SIZE, hkv, d)


def flashprefill_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function ``attn_implementation="fp_sparse_prefill"`` (``ATTN_NAME``).

    Args:
        module: the model's attention module (``layer_idx``, ``num_key_value_groups``, and the
            ``fp_runtime`` set by ``install_flashprefill``).
        query: ``[B, Hq, Lq, d]``, RoPE applied. key, value: ``[B, Hkv, Lk, d]``, cache included.
        attention_mask: ignored for batch size 1 (this function applies bottom-right causal
            masking itself); with batch size > 1 a mask means a padded batch: ``ValueError``.
        scaling: softmax scale ``τ``.

    Returns:
        ``(out [B, Lq, Hq, d], None)``.
    """
    rt: FlashPrefillRuntime | None = getattr(module, "fp_runtime", None)
    if rt is None:
        rt = _DEFAULT_RUNTIME
    groups = query.shape[1] // key.shape[1]
    layer = int(getattr(module, "layer_idx", 0) or 0)
    bsz, hq, lq, d = query.shape
    lk = key.shape[2]
    if attention_mask is not None and bsz > 1:  # no .all(): a causal mask is never all True, and it syncs
        raise ValueError(f"flashprefill attention: padded batches are not supported: batch size 1 only, got {bsz}")
    if lq < rt.min_prefill_len:
        return _sdpa(query, key, value, scaling, groups), None
    sparse = (
        rt.config is not None
        and layer >= rt.dense_layers
        and lq >= rt.config.min_sparse_len  # short prefills dense, as in the SGLang backend
        and bsz == 1
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
    )
    flops = causal_attention_flops(lq, lk, d, hq) * bsz
    sync = query.device if rt.timing else None
    if not sparse:
        t0 = _now(sync)
        out = _sdpa(query, key, value, scaling, groups)
        ms = (_now(sync) - t0) * 1e3 if rt.timing else None
        rt.layers[layer] = LayerStat(layer, False, lq, lk, 1.0, [1.0] * key.shape[1], flops, None, ms)
        if rt.on_layer is not None:
            rt.on_layer(layer)
        return out, None

    from flashprefill import api as flashprefill  # the public API module (validation + dispatch)

    q = query[0].transpose(0, 1).contiguous()  # [Lq, Hq, d]
    k_cache, v_cache = _paged(key), _paged(value)  # [pages, PAGE_SIZE, Hkv, d]
    dev = query.device
    key_geom = (lq, lk, groups, dev)
    geom = rt._plans.get(key_geom)
    if geom is None:  # plan once per prefill, reuse in every layer
        page_table = torch.arange(k_cache.shape[0], dtype=torch.int32, device=dev)[None, :]
        seq_lens = torch.tensor([lk], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, lq], dtype=torch.int32, device=dev)
        plan = flashprefill.make_plan(seq_lens, cu, groups, rt.config.block_size)
        geom = rt._plans[key_geom] = (page_table, seq_lens, cu, plan)
    page_table, seq_lens, cu, plan = geom
    backend = rt.backend  # "auto": the operator picks Triton only for CUDA tensors it takes
    t0 = _now(sync)
    index_ms = None
    index = None
    if rt.timing:  # build the index separately to time the two stages
        index = flashprefill.build_index(q, k_cache, v_cache, page_table, seq_lens, cu, config=rt.config,
                                         softmax_scale=scaling, plan=plan, backend=backend)
        t1 = _now(sync)
        index_ms = (t1 - t0) * 1e3
        t0 = t1
    out, st = flashprefill.flashprefill_attention(
        q, k_cache, v_cache, page_table, seq_lens, cu, config=rt.config, softmax_scale=scaling,
        return_stats=True, plan=plan, index=index, backend=backend,
    )
    att_ms = (_now(sync) - t0) * 1e3 if rt.timing else None
    per_head = [float(x) for x in st.density_per_kv_head.tolist()]
    rt.layers[layer] = LayerStat(layer, True, lq, lk, float(st.density), per_head, flops, index_ms, att_ms)
    if rt.on_layer is not None:
        rt.on_layer(layer)
    return out.unsqueeze(0), None


_DEFAULT_RUNTIME = FlashPrefillRuntime(config=None)  # used when a model was not installed


def register_attention() -> None:
    """Register ``attn_implementation=ATTN_NAME`` with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, flashprefill_attention_forward)


def install_flashprefill(model: torch.nn.Module, runtime: FlashPrefillRuntime) -> FlashPrefillRuntime:
    """Switch ``model`` to the flashprefill attention function and attach ``runtime`` to every
    attention module (modules with a ``layer_idx`` and ``num_key_value_groups``)."""
    register_attention()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "layer_idx") and hasattr(mod, "num_key_value_groups"):
            mod.fp_runtime = runtime
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__}: no attention module with layer_idx/num_key_value_groups found")
    return runtime


# --------------------------------------------------------------------------------------------
# engine


def apply_context(config, plan: ContextPlan) -> None:
    """Turn on YaRN on a transformers ``PretrainedConfig`` before the model is built (nothing
    without ``plan.rope_scaling``): ``rope_parameters`` (transformers 5; ``rope_scaling`` in
    older versions) = the plan's mapping, ``max_position_embeddings`` = the plan's context."""
    if plan.rope_scaling is None:
        return
    params = dict(plan.rope_scaling)
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = params
    else:  # pragma: no cover - transformers < 5
        config.rope_scaling = params
    config.max_position_embeddings = int(plan.context)


def _pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, requested)


class TransformersEngine:
    """``Engine`` on transformers: load a HF folder, prefill with FlashPrefill, decode with SDPA.

    Args:
        model_path: a local Hugging Face folder (see ``fpcli.models.resolve_model``).
        profile: ``fpcli.profiles.Profile`` (default: ``load_profile("bf16")``).
        model_name: name for reports (default: the folder name).
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).
        timing: measure per-layer index/attention time (one CUDA sync per layer).
        reuse_cache: keep the last request's KV cache (``DynamicCache``) and token ids, and prefill
            only what follows the longest common token prefix with the next prompt (the same
            documents with another question). ``False`` prefills every prompt whole (benchmarks).

    KV reuse: the kept cache holds the last prompt and the answer tokens fed back during its
    decode; the next ``generate`` crops it to the common prefix with the new prompt ids (at most
    ``len(prompt) - 1`` tokens, so at least one token is prefilled for the first logits) and
    prefills the rest after that prefix (``P > 0``: the attention sees ``Lk = P + Lq`` keys).
    Dense layers (and prompts below ``min_sparse_len``) give the same tokens as a whole prefill;
    in sparse layers the reused keys/values are those of the earlier prefill, as with SGLang's
    radix cache, and the new tokens' block selection covers only the new query blocks.

    Raises:
        fpcli.engine.context.ContextError: ``profile.engine.context_length`` beyond what the model
            can be extended to.
    """

    name = "transformers"

    def __init__(self, model_path, profile=None, model_name: str | None = None, device: str | None = None,
                 timing: bool = True, reuse_cache: bool = True) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        if profile is None:
            from fpcli.profiles import load_profile

            profile = load_profile("bf16")
        self.profile = profile
        self.model_path = str(model_path)
        self.model_name = model_name or os.path.basename(os.path.normpath(self.model_path))
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = _pick_dtype(profile.engine.dtype, self.device)
        # No FP8 attention path exists yet (operator or engine): attention runs at the model's
        # dtype whatever the profile asks; reports say so (GenerationResult.precision).
        self.precision = DTYPE_PRECISION.get(self.dtype, str(self.dtype).replace("torch.", ""))
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.start_phases: dict[str, float] = {"tokenizer": time.perf_counter() - t0}  # seconds per phase
        register_attention()
        config = AutoConfig.from_pretrained(self.model_path)
        self.context_plan = plan_context(config.to_dict(), profile.engine.context_length, model=self.model_name)
        apply_context(config, self.context_plan)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, config=config, dtype=self.dtype, attn_implementation=ATTN_NAME
            ).to(self.device).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        cfg = self.model.config
        self.n_layers = int(cfg.num_hidden_layers)
        sparse_cfg = None if profile.is_dense else profile.sparse_config()
        self.runtime = install_flashprefill(
            self.model, FlashPrefillRuntime(config=sparse_cfg, dense_layers=profile.dense_layers, timing=timing)
        )
        self.context_length = int(self.context_plan.context or getattr(self.tokenizer, "model_max_length", 2048))
        self.eos_ids = self._eos_ids()
        self.load_s = time.perf_counter() - t0
        self.start_phases["weights"] = self.load_s - self.start_phases["tokenizer"]
        self.start_s = self.load_s
        self.reuse_cache = reuse_cache
        self._cache = None  # DynamicCache of the last request (reuse_cache), holding _cache_ids
        self._cache_ids: list[int] = []
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in forward_params else "past_key_values"

    # -- contract ------------------------------------------------------------------------------

    def encode_chat(self, system: str | None, user: str) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            return [int(i) for i in ids]
        text = (f"{system}\n\n" if system else "") + f"{user}\n\nAnswer: "
        return self.tokenizer(text)["input_ids"]

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_starts(self, text: str) -> list[int]:
        return token_starts(self.tokenizer, text)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> GenerationResult:
        """See ``Engine.generate``; ``on_progress(layers_done, n_layers)`` after each decoder
        layer's prefill attention. An exception raised by ``on_text`` (e.g. a cancelled client)
        stops the generation before the next decode step and propagates.

        Raises:
            ValueError: empty ``prompt_ids``, or a prompt that leaves no room in the context.
        """
        t_submit = time.perf_counter()
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        prompt_ids = [int(i) for i in prompt_ids]
        n_prompt = len(prompt_ids)
        budget = self.context_length - n_prompt
        if budget <= 0:
            raise ValueError(f"generate: the prompt ({n_prompt} tokens) fills the context ({self.context_length})")
        max_new = min(max_new_tokens, budget)
        self.runtime.reset()
        cache, cached = self._take_cache(prompt_ids)  # the kept cache is ours until this call succeeds
        ids = torch.tensor([prompt_ids[cached:]], dtype=torch.long, device=self.device)
        if on_progress is not None:
            self.runtime.on_layer = lambda layer: on_progress(layer + 1, self.n_layers)
        t0 = _now(self.device)
        try:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        finally:
            self.runtime.on_layer = None
        logits = out.logits[0, -1].float()
        token = self._pick(logits, temperature)
        t_first = _now(self.device)
        prefill_s = t_first - t0
        stats = self.runtime.stats(self.n_layers)

        fed: list[int] = []  # answer tokens whose keys/values are in the cache
        generated: list[int] = []
        emitted = ""
        finish = "length"
        while True:
            if token in self.eos_ids:
                finish = "stop"
                break
            generated.append(token)
            if on_text is not None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if not text.endswith("\ufffd") and len(text) > len(emitted):  # hold back split UTF-8
                    on_text(text[len(emitted):])
                    emitted = text
            if len(generated) >= max_new:
                break
            step = torch.tensor([[token]], dtype=torch.long, device=self.device)
            out = self.model(input_ids=step, use_cache=True, **{self._cache_kw: cache})
            fed.append(token)
            token = self._pick(out.logits[0, -1].float(), temperature)
        if self.reuse_cache:
            self._cache, self._cache_ids = cache, prompt_ids + fed
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        if on_text is not None and len(text) > len(emitted) and text.startswith(emitted):
            on_text(text[len(emitted):])
        total_s = _now(self.device) - t_submit
        return GenerationResult(
            text=text,
            prompt_tokens=n_prompt,
            output_tokens=len(generated),
            ttft_s=t_first - t_submit,
            prefill_s=prefill_s,
            total_s=total_s,
            engine=self.name,
            model=self.model_name,
            profile=self.profile.name,
            stats=stats,
            finish_reason=finish,
            precision=self.precision,
            cached_tokens=cached,
        )

    def _take_cache(self, prompt_ids: list[int]):
        """``(cache, P)``: the kept ``DynamicCache`` cropped to ``P`` tokens, the longest common
        prefix of its ids and ``prompt_ids`` (at most ``len(prompt_ids) - 1``), or a new empty
        cache and ``P = 0``. The kept cache is released either way (it is mutated in place)."""
        from transformers import DynamicCache

        cache, kept = self._cache, self._cache_ids
        self._cache, self._cache_ids = None, []
        if cache is None or not self.reuse_cache:
            return DynamicCache(), 0
        n = common_prefix_len(kept, prompt_ids, limit=len(prompt_ids) - 1)
        if n == 0:
            return DynamicCache(), 0
        extra = cache.get_seq_length() - n
        if extra > 0:
            cache.crop(-extra)  # a negative count removes that many tokens (transformers 4.56 and 5)
        return cache, n

    def close(self) -> None:
        self.model = None
        self.tokenizer = None
        self._cache, self._cache_ids = None, []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> "TransformersEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.model.config.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok) if tok in self.tokenizer.get_vocab() else None
            if tid is not None:
                ids.add(int(tid))
        return {int(i) for i in ids}

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / temperature, dim=-1)
        return int(torch.multinomial(probs, 1))


def common_prefix_len(a: list[int], b: list[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of token id lists ``a`` and ``b``, at most ``limit``.

    >>> common_prefix_len([1, 2, 3, 4], [1, 2, 5], limit=10)
    2
    """
    n = min(len(a), len(b), len(a) + len(b) if limit is None else max(0, limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def flops_summary(stats: PrefillStats) -> str:
    """``"4.8 GFLOP dense-equivalent, 37% skipped"`` for logs."""
    if stats.attention_flops_dense <= 0:
        return "no attention FLOPs recorded"
    frac = stats.attention_flops_skipped / stats.attention_flops_dense
    return f"{stats.attention_flops_dense / 1e9:.1f} GFLOP dense-equivalent, {100 * frac:.0f}% skipped"


__all__ = [
    "ATTN_NAME",
    "FlashPrefillRuntime",
    "LayerStat",
    "TransformersEngine",
    "causal_attention_flops",
    "common_prefix_len",
    "flashprefill_attention_forward",
    "install_flashprefill",
    "register_attention",
]
