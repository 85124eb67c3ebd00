"""One greedy decode step of the transformers engine's model, captured as a CUDA graph and replayed per token.

An eager decode step of a small model is host-bound: transformers' Python and ~1,000 kernel
launches per step (Qwen2.5-Coder-0.5B at 130K tokens on the H200: ~100 ms per step, of which the
kernels take ~2.6 ms; docs/benchmarks.md). ``DecodeGraph`` runs the step on static tensors, so it
can be captured once (``capture``) and replayed (``advance``):

- ``ids`` ``[1, 1]`` int64: the token fed to the step (the last picked one);
- ``position`` ``[1]`` int64: its position, i.e. the number of tokens in the KV cache before it
  (the length counter, on the device);
- the KV buffers ``[1, Hkv, capacity, d]`` per layer (the model's dtype), shared with the prefill:
  ``prefill_cache()`` is a ``kv_cache.ReservedLayer`` cache on the same buffers, so the prefill
  writes the prompt's keys/values where the step reads them.

One step (``step``, what the graph holds): the mask ``[1, 1, 1, capacity]`` = ``slot <= position``
(bool, computed on the device); the model's forward with ``input_ids=ids``, ``position_ids =
position``, that mask as ``attention_mask`` and a cache whose layers write the new key/value at
``position`` (``index_copy_``) and return the whole buffers; the argmax of the last logits copied
into ``ids``; ``position += 1``. No host value is read in the step; the caller reads ``ids`` once
per token (the one host sync: EOS, the streamed text).

What the capture bakes in (read in transformers 5.12.1 and 5.24.0, ``LlamaModel.forward`` /
``Qwen2Model.forward`` and ``masking_utils``), and why each is safe:

- ``position_ids`` is given, so the forward never derives positions from ``get_seq_length()``
  (the step's cache raises if anything asks it for a length: a test runs the step eagerly under
  both versions, and any such call would fail it);
- the mask: ``create_causal_mask`` (called by Llama always, by Qwen2 when ``attention_mask`` is
  not a dict) returns a 4D tensor mask as it is, before it reads any cache size; the attention
  function (``flashprefill.integrations.transformers``) hands a decode step (``Lq == 1``) with a
  tensor mask to ``flashprefill.integrations.decode_masked`` and reads nothing else from the host;
- RoPE: cos/sin are computed on the device from ``position_ids``; rope types that update their
  frequencies from the positions in Python (``dynamic``, ``longrope``: a host read of the largest
  position) are refused; default and YaRN (what ``apply_context`` sets) are static;
- ``logits_to_keep=1`` slices the last position (static);
- shapes (``[1, 1]`` input, ``capacity`` keys) are fixed, so every kernel's launch shape is too
  (``decode_masked`` derives its key splits from the capacity alone);
- sliding-window layers are refused: their window would need a second mask;
- the attention function records nothing at decode (its per-layer records and ``on_layer``
  belong to the prefill, ``Lq >= 2``).

Greedy only (argmax in the graph); sampling stays on the eager path. Capture needs CUDA; on the
CPU the same step runs eagerly (``advance``), which is what the CPU tests check.

Speed, Qwen2.5-Coder-0.5B at ~130K tokens on the H200 (docs/benchmarks.md). Measured with the
earlier masked attentions: 7.46 tokens/s (cuDNN's prefill kernel, tenth session) and 6.49 tokens/s
(SDPA's math backend, 142.6 ms of a 154 ms step; twelfth session), both below eager decode
(9.84 tokens/s). With ``decode_masked`` (thirteenth session, ``scripts/lab/decode_profile.py --len
130000 --cuda-graph``, 64 steps): **202 tokens/s**, 4.95 ms a step (median 4.15), capture 0.57 s,
one host sync per step, within the prediction written before the run (the eager step's other
kernels ~2.0 ms + ``decode_masked`` 2.16 ms + ~0.1 ms host: ~4.3 ms, 150-250 tokens/s; SGLang: 220
on the same prompt). So the transformers engine decodes through the graph by default on a CUDA
device (``decode_graph_choice``), for answer budgets of ``GRAPH_MIN_NEW_TOKENS`` or more.
"""
from __future__ import annotations

import time

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .kv_cache import ReservedLayer

GROWTH = 2.0  # capacity factor when a request needs more room than the captured graph has
SLOTS = 256  # capacities are rounded up to a multiple of this many tokens
WARMUP_STEPS = 2  # eager steps on a side stream before capture (PyTorch's CUDA graph recipe)


def graph_capacity(need: int, current: int = 0) -> int:
    """Tokens of KV room for a graph that must hold ``need`` tokens: ``need``, at least ``GROWTH``
    times ``current`` when it grows from a captured capacity, rounded up to ``SLOTS``.

    >>> graph_capacity(1000), graph_capacity(1500, current=1024)
    (1024, 2048)
    """
    want = max(int(need), int(current * GROWTH) if current else 0)
    return -(-want // SLOTS) * SLOTS


class _StepLayer(DynamicLayer):
    """A cache layer of the decode step: writes the new key/value (``[1, Hkv, 1, d]``) at the
    device ``position`` of its buffers and returns the whole buffers ``[1, Hkv, capacity, d]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.position = keys, values, position
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.position, key_states)
        self.values.index_copy_(2, self.position, value_states)
        return self.keys, self.values

    def get_seq_length(self, *args, **kwargs) -> int:
        raise RuntimeError("decode graph: the cache length lives on the device (position); "
                           "a host-side length would be baked into the captured step")


GRAPH_MIN_NEW_TOKENS = 8
"""Answer budgets below this decode eagerly under the default choice (``decode_graph=None``): a
capture costs about six eager steps (H200, Qwen2.5-Coder-0.5B at 130K: 0.57 s against ~100 ms a
step; thirteenth session, docs/benchmarks.md), so a one-token answer (``fp profile``) never pays it."""


def decode_graph_choice(asked: bool | None, profile_graphs: bool, device_type: str, config) -> tuple[bool, str | None]:
    """Whether the transformers engine decodes through a CUDA graph, and if not, why.

    Args:
        asked: ``TransformersEngine(decode_graph=...)``: ``True`` always (a model that cannot be
            captured raises), ``False`` never, ``None`` the default below.
        profile_graphs: the profile's ``engine.cuda_graph_decode``.
        device_type: ``"cuda"`` or ``"cpu"``: by default only a CUDA device captures.
        config: the model's transformers config (``check_graphable``).

    Returns:
        ``(on, reason_off)``: ``reason_off`` is ``None`` when on, else one line for the user.

    Raises:
        ValueError: ``asked=True`` for a model whose step cannot be captured (``check_graphable``).
    """
    if asked is True:
        check_graphable(config)
        return True, None
    if asked is False:
        return False, "decode_graph=False"
    if not profile_graphs:
        return False, "the profile sets engine.cuda_graph_decode: false"
    if device_type != "cuda":
        return False, f"no CUDA graphs on the {device_type}"
    try:
        check_graphable(config)
    except ValueError as exc:
        return False, str(exc)
    return True, None


def check_graphable(config) -> None:
    """Refuse a model whose decode step cannot be captured as this module captures it.

    Raises:
        ValueError: sliding-window or other non-full attention layers (``config.layer_types``),
            or a RoPE type that updates its frequencies from the positions on the host
            (``dynamic``, ``longrope``).
    """
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise ValueError(f"decode graph: expected full-attention layers only, got layer types {sorted(types)}")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = {str(v.get("rope_type", v.get("type"))) for v in ([rope] if "rope_type" in rope or "type" in rope
                                                              else [x for x in rope.values() if isinstance(x, dict)])}
    bad = sorted(k for k in kinds if "dynamic" in k or k == "longrope")
    if bad:
        raise ValueError(f"decode graph: RoPE type {bad[0]!r} updates its frequencies on the host; "
                         "expected default, linear, yarn or llama3")


class DecodeGraph:
    """Static tensors and KV buffers of one greedy decode step of ``model`` (module docstring).

    Args:
        model: a transformers causal LM (batch 1), on its device, in eval mode.
        capacity: KV tokens per layer (prompt + answer budget), >= 1.
        cache_kw: the name of the model's cache argument (``transformers_engine.cache_argument``).

    Attributes:
        ids: ``[1, 1]`` int64, the token the next step feeds (after a step: the token it picked).
        position: ``[1]`` int64, the position of ``ids`` (tokens already in the KV cache).
        keys, values: per layer ``[1, Hkv, capacity, d]`` in the model's dtype.
        capture_s: seconds the last ``capture`` took (warm-up included); ``None`` before.

    Raises:
        ValueError: ``capacity < 1``; a model ``check_graphable`` refuses.
    """

    def __init__(self, model, capacity: int, cache_kw: str) -> None:
        if capacity < 1:
            raise ValueError(f"decode graph: expected capacity >= 1, got {capacity}")
        cfg = model.config
        check_graphable(cfg)
        p = next(model.parameters())
        hkv = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        n_layers = int(cfg.num_hidden_layers)
        self.model, self.capacity, self.cache_kw = model, int(capacity), cache_kw
        self.device = p.device
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._slots = torch.arange(self.capacity, device=self.device)
        self.keys = [torch.zeros(1, hkv, self.capacity, d, dtype=p.dtype, device=self.device) for _ in range(n_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._step_cache = Cache(layers=[_StepLayer(k, v, self.position) for k, v in zip(self.keys, self.values)])
        self.graph: torch.cuda.CUDAGraph | None = None
        self.capture_s: float | None = None

    def prefill_cache(self) -> Cache:
        """An empty transformers ``Cache`` of ``ReservedLayer``\\ s on this graph's buffers: a
        prefill (and eager decode steps) through it write where the captured step reads."""
        layers = []
        for k, v in zip(self.keys, self.values):
            layer = ReservedLayer(self.capacity)
            layer.adopt(k, v)
            layers.append(layer)
        return Cache(layers=layers)

    def backs(self, cache: Cache) -> bool:
        """Whether ``cache``'s layers are ``ReservedLayer``\\ s on this graph's buffers."""
        return len(cache.layers) == len(self.keys) and all(
            isinstance(layer, ReservedLayer) and layer.buffers_are(k, v)
            for layer, k, v in zip(cache.layers, self.keys, self.values))

    def step(self) -> None:
        """One greedy decode step on the static tensors (eager; what ``capture`` records): feeds
        ``ids`` at ``position``, writes its key/value there, puts the argmax token in ``ids`` and
        advances ``position``. Reads no host value."""
        mask = (self._slots <= self.position).view(1, 1, 1, self.capacity)
        out = self.model(input_ids=self.ids, position_ids=self.position.view(1, 1), attention_mask=mask,
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: self._step_cache})
        self.ids.copy_(torch.argmax(out.logits[0, -1]).view(1, 1))
        self.position.add_(1)

    def capture(self, warmup: int = WARMUP_STEPS) -> float:
        """Capture ``step`` in a CUDA graph (after ``warmup`` eager steps on a side stream); returns
        the seconds it took. Writes garbage keys/values at the first positions: capture before
        the prefill that fills the buffers. Leaves ``ids`` and ``position`` at 0.

        Raises:
            ValueError: the model is not on a CUDA device.
        """
        if self.device.type != "cuda":
            raise ValueError(f"decode graph: capture needs a CUDA device, the model is on {self.device}")
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        self._reset()
        torch.cuda.synchronize(self.device)
        self.graph = graph
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def _reset(self) -> None:
        self.ids.zero_()
        self.position.zero_()

    def start(self, token: torch.Tensor, length: int) -> None:
        """Set the next step's input: ``token`` (a device tensor of one id, e.g. the prefill's
        pick) at position ``length`` (the tokens in the KV cache). No host sync.

        Raises:
            ValueError: ``length`` outside ``[0, capacity)``.
        """
        if not 0 <= length < self.capacity:
            raise ValueError(f"decode graph: expected a position in [0, {self.capacity}), got {length}")
        self.ids.copy_(token.view(1, 1))
        self.position.fill_(int(length))

    def advance(self) -> torch.Tensor:
        """One decode step (the graph's replay once captured, else ``step``); returns ``ids``, the
        picked token ``[1, 1]`` (read it with ``int``: the step's host sync on a GPU)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()
        return self.ids


__all__ = ["GROWTH", "DecodeGraph", "check_graphable", "graph_capacity"]
