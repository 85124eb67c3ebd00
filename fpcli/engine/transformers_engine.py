"""The transformers engine: any ``AutoModelForCausalLM`` on CPU or GPU, with FlashPrefill V2 prefill.

FlashPrefill enters through transformers' attention-function interface
(``flashprefill.integrations.transformers``): the model is loaded with
``attn_implementation="fp_sparse_prefill"`` and a ``FlashPrefillRuntime`` (the profile's
``SparseConfig``, ``dense_layers``, timing) is hung on every attention module. This module owns the
engine's lifecycle and generation; the attention function and its per-layer records live there.

Statistics (``PrefillStats``) of the last prefill, from ``FlashPrefillRuntime.summary`` (the
index each sparse layer's attention used):

- density: selected / causally visible key blocks (1.0 for dense layers);
- dense-equivalent attention FLOPs (``flashprefill.flops.dense_causal_flops``); skipped =
  dense x (1 - density) per sparse layer;
- index / attention time per sparse layer (ms) and their sums only with ``timing=True`` (CUDA
  events, read once after the forward; ``fp profile`` asks for it, ``fp ask`` does not).

CPU dtype (``engine.dtype: auto``): float32. Measured with SmolLM2-135M, 2K-token prompt, dense
profile, 2-core AMD EPYC with AVX512-BF16 (no AMX): bf16 weights cut prefill CPU time ~1.4x
(7.5 s vs 10.3 s) but slowed decode ~1.6x (3.3 vs 5.5 tokens/s), and on CPUs without bf16 units
bf16 matmuls are emulated and much slower. float32 also keeps the dequantized GGUF weights exact,
and the reference operator computes in float32 anyway. A profile can ask for ``bfloat16``.
GPU: bfloat16 (the Triton operator's dtype); the weights load straight onto the GPU
(``weights_placement``).

At 128K tokens on a GPU (one request): no causal mask is built (transformers builds none for an
attention implementation it has no mask function for, and this engine passes no
``attention_mask``); logits for the last position only (``logits_to_keep=1``); a chunk after a
cached prefix attends in bounded row chunks (``integrations.transformers._row_chunks``); decode
attends to the unexpanded GQA cache (one SDPA call per layer, no mask); no host sync per layer (the
plan is built once per prefill, the statistics read once after it).

Decode: one forward per token, one host sync per token (reading the picked token: EOS, streamed
text). The KV cache is reserved for the prompt and the answer budget when the request starts
(``fpcli.engine.kv_cache``): a decode step writes its token's keys/values in place, where
transformers' ``DynamicCache`` copied the whole cache of every layer per token.

CUDA-graph decode (on a GPU by default: the profile's ``engine.cuda_graph_decode``, as for SGLang;
``decode_graph_choice`` decides): greedy decode steps of answers of ``GRAPH_MIN_NEW_TOKENS`` or more
tokens replay one captured step (``fpcli.engine.decode_graph``) instead of running transformers' forward per token;
the graph and its KV buffers (prompt + answer budget, rounded up) are captured at the first
request that needs them (capture time counts in that request's TTFT; ``last_capture_s``) and kept
for the next requests; a request that needs more room re-captures at ``decode_graph.GROWTH`` times
the capacity (the kept KV cache lives on the old buffers and is dropped: that request prefills
whole). Sampling (``temperature > 0``) decodes eagerly. On the CPU the same static step runs
eagerly, never captured (what the CPU tests check). The prefill is unchanged. The step's masked
decode attention is ``flashprefill.integrations.decode_masked`` (split batched GEMMs); the graph
decode measured on the H200 (6.49 tokens/s at 130K, below eager) ran an earlier one (SDPA's math
backend); with ``decode_masked`` it ran 202 tokens/s at 130K against eager's 9.84 (H200, thirteenth
session, docs/benchmarks.md), so it is on by default where it can be captured. A model whose step
cannot be captured (``decode_graph.check_graphable``), or a capture that fails, decodes eagerly,
and ``decode_graph_off`` says why (only ``decode_graph=True`` asked explicitly raises instead).

Context: ``profile.engine.context_length`` caps the model's context, or extends it with YaRN when
it exceeds the native ``max_position_embeddings`` (``fpcli.engine.context``): the YaRN
``rope_scaling`` is set on the loaded config before the model is built (``apply_context``).

Threads: torch's OpenMP threads spin while idle; on a busy or shared CPU that made a 1K-token
prefill 4x slower here (18 s vs 4.6 s). ``OMP_WAIT_POLICY=PASSIVE`` (set before torch is imported)
avoids it.
"""
from __future__ import annotations

import inspect
import logging
import os
import time
from typing import Callable

import torch

from flashprefill.integrations.transformers import (
    ATTN_NAME, FlashPrefillRuntime, LayerSummary, install_flashprefill, register_attention,
)

from .base import GenerationResult, PrefillStats, check_fp8_profile, decode_mode, eight_bit, ran_precision
from .context import ContextPlan, plan_context
from .decode_graph import GRAPH_MIN_NEW_TOKENS, decode_graph_choice
from .tokens import common_prefix_len, token_starts

log = logging.getLogger(__name__)

DTYPE_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _now(sync_device: torch.device | None) -> float:
    if sync_device is not None and sync_device.type == "cuda":
        torch.cuda.synchronize(sync_device)
    return time.perf_counter()


def prefill_stats(rows: list[LayerSummary | None]) -> PrefillStats:
    """``PrefillStats`` of one prefill from ``FlashPrefillRuntime.summary`` (``None`` = a layer
    whose attention was not called: density 1.0, no FLOPs). The overall density is selected /
    visible blocks summed over the sparse layers. Stage times (when timed): per sparse layer, and
    their sums; a prefill with no sparse layer has its dense layers' attention time as
    ``attention_ms`` (no index stage)."""
    sparse = [r for r in rows if r is not None and r.sparse]
    sel, vis = sum(r.selected_blocks for r in sparse), sum(r.visible_blocks for r in sparse)
    fp8 = [r for r in sparse if r.fp8_rel_l2 is not None]
    timed = bool(sparse) and all(r.index_ms is not None and r.attention_ms is not None for r in sparse)
    idx = [r.index_ms for r in sparse] if timed else []
    att = [r.attention_ms for r in sparse] if timed else []
    dense_att = [r.attention_ms for r in rows if r is not None and r.attention_ms is not None] if not sparse else []
    return PrefillStats(
        density=(sel / vis) if vis else 1.0,
        density_per_layer=[r.density if r else 1.0 for r in rows],
        density_per_layer_head=[list(r.density_per_kv_head) if r else [] for r in rows],
        sparse_layers=[r.layer for r in sparse],
        attention_flops_dense=sum(r.flops_dense for r in rows if r),
        attention_flops_skipped=sum(r.flops_dense * (1.0 - r.density) for r in sparse),
        index_ms=sum(idx) if idx else None,
        attention_ms=sum(att) if att else (sum(dense_att) if dense_att else None),
        index_ms_per_layer=idx,
        attention_ms_per_layer=att,
        fp8_rel_l2_per_layer=[r.fp8_rel_l2 if r else None for r in rows] if fp8 else [],
        fp8_rel_l2_per_layer_head=[list(r.fp8_rel_l2_per_kv_head or ()) if r else [] for r in rows] if fp8 else [],
    )


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


def weights_placement(device: torch.device) -> dict:
    """``from_pretrained`` arguments that load the weights straight onto ``device`` when it is a GPU
    (``device_map``: safetensors tensors copied to the GPU as they are read, no CPU copy of the
    model first); ``{}`` on the CPU, and where transformers cannot place them (``device_map``
    needs ``accelerate``): the engine then moves the loaded model (``.to(device)``), the same
    model a little later."""
    if device.type != "cuda":
        return {}
    from transformers.utils import is_accelerate_available

    return {"device_map": device} if is_accelerate_available() else {}


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
        timing: measure per-layer index / attention time (CUDA events, read after the forward).
        reuse_cache: keep the last request's KV cache (``kv_cache.reserved_cache``) and token ids,
            and prefill only what follows the longest common token prefix with the next prompt (the same
            documents with another question). ``False`` prefills every prompt whole (benchmarks).
        compare_fp8: with an 8-bit profile (``fp8``, ``int8qk``: ``base.eight_bit``), also run the
            BF16 operator in every sparse layer and report the 8-bit-vs-BF16 output error per layer
            and KV head (``PrefillStats.fp8_rel_l2_per_layer``; ``fp profile --fp8`` / ``--int8qk``).
            Off by default.
        decode_graph: greedy decode replays a CUDA graph of one step (module docstring): ``None``
            (default) = the profile's ``engine.cuda_graph_decode`` on a CUDA device, falling back to
            eager decode where the step cannot be captured; ``True`` = always (on the CPU the same
            static step runs eagerly; a model that cannot be captured raises); ``False`` = never.

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
        ValueError: an 8-bit profile (``fp8``, ``int8qk``) on a GPU without FP8 tensor cores or with
            an unsupported head dim (``base.check_fp8_profile``), before the weights load; ``decode_graph`` with a model
            whose step cannot be captured (``decode_graph.check_graphable``).
    """

    name = "transformers"

    def __init__(self, model_path, profile=None, model_name: str | None = None, device: str | None = None,
                 timing: bool = False, reuse_cache: bool = True, compare_fp8: bool = False,
                 decode_graph: bool | None = None) -> None:
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
        # The model's dtype: dense layers, short prefills and decode; the sparse layers run the
        # profile's precision (GenerationResult.precision says what a prefill ran).
        self.model_precision = DTYPE_PRECISION.get(self.dtype, str(self.dtype).replace("torch.", ""))
        self.sparse_precision = "bf16" if profile.is_dense else str(profile.precision)
        self.precision = ran_precision(self.model_precision, int(eight_bit(self.sparse_precision)), self.sparse_precision)
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.start_phases: dict[str, float] = {"tokenizer": time.perf_counter() - t0}  # seconds per phase
        register_attention()
        config = AutoConfig.from_pretrained(self.model_path)
        self.context_plan = plan_context(config.to_dict(), profile.engine.context_length, model=self.model_name)
        apply_context(config, self.context_plan)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        check_fp8_profile(profile, self.device, head_dim)
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, config=config, dtype=self.dtype, attn_implementation=ATTN_NAME,
                **weights_placement(self.device),
            ).to(self.device).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        cfg = self.model.config
        self.n_layers = int(cfg.num_hidden_layers)
        sparse_cfg = None if profile.is_dense else profile.sparse_config()
        self.runtime = install_flashprefill(
            self.model, FlashPrefillRuntime(config=sparse_cfg, dense_layers=profile.dense_layers, timing=timing,
                                            precision=self.sparse_precision, compare_fp8=compare_fp8)
        )
        self.context_length = int(self.context_plan.context or getattr(self.tokenizer, "model_max_length", 2048))
        self.eos_ids = self._eos_ids()
        self.load_s = time.perf_counter() - t0
        self.start_phases["weights"] = self.load_s - self.start_phases["tokenizer"]
        self.start_s = self.load_s
        self.reuse_cache = reuse_cache
        self._cache = None  # KV cache (kv_cache.reserved_cache) of the last request, holding _cache_ids
        self._cache_ids: list[int] = []
        self._cache_kw = cache_argument(self.model)
        self._graph = None  # decode_graph.DecodeGraph of the last greedy request (decode_graph on)
        self.last_capture_s: float | None = None  # seconds the last generate spent capturing; None: none
        self.decode_graph_required = decode_graph is True
        self.decode_graph, self.decode_graph_off = decode_graph_choice(
            decode_graph, profile.engine.cuda_graph_decode, self.device.type, self.model.config)

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
        on_cached: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """See ``Engine.generate``; ``on_cached(tokens)`` once the kept KV cache is matched (before
        the prefill), ``on_progress(layers_done, n_layers)`` after each decoder layer's prefill
        attention. An exception raised by ``on_text`` (e.g. a cancelled client)
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
        self.last_capture_s = None
        graph = None
        if self.decode_graph and temperature <= 0 and (self.decode_graph_required or max_new >= GRAPH_MIN_NEW_TOKENS):
            graph = self._graph_or_eager(n_prompt + max_new)
        cache, cached = self._take_cache(prompt_ids, n_prompt + max_new, graph)  # ours until this call succeeds
        ids = torch.tensor([prompt_ids[cached:]], dtype=torch.long, device=self.device)
        if on_cached is not None:
            on_cached(cached)
        if on_progress is not None:
            self.runtime.on_layer = lambda layer: on_progress(layer + 1, self.n_layers)
        t0 = _now(self.device)
        try:
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
        finally:
            self.runtime.on_layer = None
        picked = self._pick(out.logits[0, -1].float(), temperature)
        token = int(picked)  # the one host sync of a step: EOS, the streamed text
        t_first = _now(self.device)
        prefill_s = t_first - t0
        rows = self.runtime.summary(self.n_layers)
        stats = prefill_stats(rows)
        eight_bit_layers = sum(1 for r in rows if r is not None and eight_bit(r.precision))
        precision = ran_precision(self.model_precision, eight_bit_layers, self.sparse_precision)

        fed: list[int] = []  # answer tokens whose keys/values are in the cache
        if graph is not None:
            graph.start(picked, n_prompt)
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
            if graph is not None:  # the step feeds the token it picked last (graph.ids): no host input
                picked = graph.advance()
            else:  # the token's device copy is the next input: no host-to-device copy (a second sync)
                out = self.model(input_ids=picked.view(1, 1), use_cache=True, **{self._cache_kw: cache})
                picked = self._pick(out.logits[0, -1].float(), temperature)
            fed.append(token)
            token = int(picked)
        if graph is not None:  # the steps wrote into the buffers behind the cache's back
            for layer in cache.layers:
                layer.mark_filled(n_prompt + len(fed))
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
            precision=precision,
            cached_tokens=cached,
            device=self.device.type,
            decode_mode=decode_mode(len(generated), graph is not None and graph.graph is not None),  # captured
        )

    def _graph_or_eager(self, tokens: int):
        """``decode_graph_for(tokens)``; when the graph was not asked for explicitly
        (``decode_graph=None``), a failed capture turns the graph decode off for this engine
        (``decode_graph_off`` says why, a warning is logged) and returns ``None``: eager decode."""
        try:
            return self.decode_graph_for(tokens)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to eager decode
            if self.decode_graph_required:
                raise
            self._graph, self._cache, self._cache_ids = None, None, []
            self.decode_graph = False
            self.decode_graph_off = f"the capture failed ({type(exc).__name__}: {exc})"
            log.warning("CUDA-graph decode off: %s; decoding eagerly", self.decode_graph_off)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return None

    def decode_graph_for(self, tokens: int):
        """The ``decode_graph.DecodeGraph`` with room for ``tokens`` KV tokens: the kept one, or a
        new one of ``decode_graph.graph_capacity(tokens, kept capacity)`` tokens, captured on a GPU
        (never on the CPU: its step runs eagerly there); ``last_capture_s`` says how long the
        capture took. A new graph drops the kept KV cache (it lives on the old buffers)."""
        from .decode_graph import DecodeGraph, graph_capacity

        g = self._graph
        if g is not None and g.capacity >= tokens:
            return g
        cap = graph_capacity(tokens, g.capacity if g is not None else 0)
        self._graph, self._cache, self._cache_ids = None, None, []  # free the old buffers first
        g = DecodeGraph(self.model, cap, self._cache_kw)
        if self.device.type == "cuda":
            self.last_capture_s = g.capture()
        self._graph = g
        return g

    def _take_cache(self, prompt_ids: list[int], tokens: int, graph=None):
        """``(cache, P)``: the kept cache cropped to ``P`` tokens, the longest common prefix of its
        ids and ``prompt_ids`` (at most ``len(prompt_ids) - 1``), or a new empty cache and
        ``P = 0``; either way with room for ``tokens`` tokens (``kv_cache.reserve``: the prompt and
        the answer budget, so no decode step reallocates). With a ``graph``
        (``decode_graph.DecodeGraph``), the cache lives on its buffers: a kept cache elsewhere
        is not reused. The kept cache is released either way (it is mutated in place)."""
        from .kv_cache import reserve, reserved_cache

        cache, kept = self._cache, self._cache_ids
        self._cache, self._cache_ids = None, []
        if cache is not None and graph is not None and not graph.backs(cache):
            cache = None
        n = common_prefix_len(kept, prompt_ids, limit=len(prompt_ids) - 1) if cache is not None and self.reuse_cache else 0
        if n == 0:
            return (graph.prefill_cache() if graph is not None else reserved_cache(self.n_layers, tokens)), 0
        extra = cache.get_seq_length() - n
        if extra > 0:
            cache.crop(-extra)  # a negative count removes that many tokens (transformers 4.56 and 5)
        reserve(cache, tokens)
        return cache, n

    def close(self) -> None:
        self.model = None
        self.tokenizer = None
        self._cache, self._cache_ids = None, []
        self._graph = None
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
    def _pick(logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The next token id of ``logits [V]`` (float32): argmax when ``temperature <= 0``, else a
        sample of ``softmax(logits / temperature)``; an int64 scalar-sized tensor on the logits'
        device (read it with ``int``: a host sync on a GPU)."""
        if temperature <= 0:
            return torch.argmax(logits)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1)[0]


def cache_argument(model) -> str:
    """The name of the KV cache argument of ``model.forward``: ``"cache"`` where transformers
    has it (newer 5.x), else ``"past_key_values"`` (4.56 to 5.12 at least). A name the model does
    not take is swallowed by its ``**kwargs``: the cache would be ignored, not refused."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def flops_summary(stats: PrefillStats) -> str:
    """``"4.8 GFLOP dense-equivalent, 37% skipped"`` for logs."""
    if stats.attention_flops_dense <= 0:
        return "no attention FLOPs recorded"
    frac = stats.attention_flops_skipped / stats.attention_flops_dense
    return f"{stats.attention_flops_dense / 1e9:.1f} GFLOP dense-equivalent, {100 * frac:.0f}% skipped"


__all__ = [
    "ATTN_NAME",
    "FlashPrefillRuntime",
    "TransformersEngine",
    "cache_argument",
    "common_prefix_len",
    "install_flashprefill",
    "prefill_stats",
    "register_attention",
]
