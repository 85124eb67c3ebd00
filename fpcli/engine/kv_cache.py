"""The transformers engine's KV cache: decode steps write in place into a reserved buffer.

transformers' ``DynamicCache`` appends each decode step's key/value with ``torch.cat``: every step
copies the whole cache of every layer into a new tensor (O(L) per step and layer). Measured on the
CPU (SmolLM2-135M, 30 layers, float32): ``aten::cat`` took 24 ms of a 112 ms decode step at 1K
tokens and 69 ms of 211 ms at 6K, more than the decode attention itself
(``scripts/lab/decode_profile.py``). On a GPU at 130K tokens (Qwen2.5-Coder-0.5B, 24 layers) it is
1.6 GB read and written per token.

``ReservedLayer`` keeps each layer's keys and values in a buffer ``[B, Hkv, capacity, d]`` and
exposes the filled part as a view (``keys = buffer[:, :, :n]``): an update writes the new tokens
after the filled part (``copy_``) and re-views; the buffer is reallocated (one copy of the filled
part) only when a request needs more than its capacity. ``reserved_cache(n_layers, tokens)``
builds a transformers ``Cache`` of them with room for ``tokens`` (the engine asks for the prompt
plus the answer budget, so a request allocates once); ``reserve(cache, tokens)`` raises the room
of a kept cache before the next request. Everything else (``get_seq_length``, ``crop``, the mask
sizes) is ``DynamicLayer``'s, on the view.

The views are not contiguous across heads (head stride ``capacity * d``); the attention function
reads them as they are (SDPA, the paged copy of a sparse prefill).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

GROWTH = 1.5  # capacity factor when a layer outgrows its buffer beyond the reserved room


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` (``[B, Hkv, n, d]``) are views of buffers
    ``[B, Hkv, capacity, d]`` of the states' dtype and device.

    Args:
        reserve_tokens: the capacity allocated at the first update (at least the tokens it brings).
    """

    def __init__(self, reserve_tokens: int = 0) -> None:
        super().__init__()
        self.is_initialized = False  # set here too: transformers 4.56 has no such field
        self.reserve_tokens = int(reserve_tokens)
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before the next reallocation (0 before the first update)."""
        return 0 if self._key_buf is None else int(self._key_buf.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states`` / ``value_states`` (``[B, Hkv, Lq, d]``) after the cached tokens;
        returns the views ``[B, Hkv, n + Lq, d]`` of every cached token. Writes in place unless the
        buffers lack room (or no longer back ``keys``, e.g. after ``reorder_cache``)."""
        if not self.is_initialized:
            self._initialize(key_states, value_states)
        n, new = self.get_seq_length(), key_states.shape[-2]
        if not self._backs(key_states, n) or n + new > self.capacity:
            self._reallocate(key_states, value_states, n, n + new)
        self._key_buf[:, :, n:n + new].copy_(key_states)
        self._value_buf[:, :, n:n + new].copy_(value_states)
        self.keys = self._key_buf[:, :, :n + new]
        self.values = self._value_buf[:, :, :n + new]
        return self.keys, self.values

    def adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> None:
        """Use ``key_buffer`` / ``value_buffer`` (``[B, Hkv, capacity, d]``, e.g. a captured decode
        graph's, ``decode_graph.DecodeGraph``) as this empty layer's buffers: updates write into
        them in place while they have room.

        Raises:
            ValueError: the layer already holds tokens, or the buffers differ in shape.
        """
        if self.is_initialized and self.get_seq_length():
            raise ValueError("ReservedLayer.adopt: expected an empty layer, it holds tokens")
        if key_buffer.shape[:-1] != value_buffer.shape[:-1] or key_buffer.dim() != 4:
            raise ValueError(f"ReservedLayer.adopt: expected two [B, Hkv, capacity, d] buffers, got "
                             f"{tuple(key_buffer.shape)} and {tuple(value_buffer.shape)}")
        self._key_buf, self._value_buf = key_buffer, value_buffer

    def buffers_are(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor) -> bool:
        """Whether this layer's buffers are these tensors (and still back its cached tokens)."""
        return (self._key_buf is key_buffer and self._value_buf is value_buffer
                and self._backs(key_buffer, self.get_seq_length() if self.is_initialized else 0))

    def mark_filled(self, n: int) -> None:
        """The buffers hold ``n`` tokens, some written outside ``update`` (a captured decode step
        writes its keys/values straight into the buffers): ``keys`` / ``values`` become the views
        of the first ``n`` tokens.

        Raises:
            ValueError: ``n`` outside ``[0, capacity]`` or no buffers yet.
        """
        if self._key_buf is None or not 0 <= n <= self.capacity:
            raise ValueError(f"ReservedLayer.mark_filled: expected 0 <= n <= capacity ({self.capacity}), got {n}")
        if not self.is_initialized:
            self._initialize(self._key_buf, self._value_buf)
        self.keys = self._key_buf[:, :, :n]
        self.values = self._value_buf[:, :, :n]

    def _initialize(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """What ``DynamicLayer.lazy_initialization`` does (device, dtype, empty keys/values), here
        because its signature changed: one argument before transformers 5.0, two from 5.0."""
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def _backs(self, states: torch.Tensor, n: int) -> bool:
        """Whether the buffers hold the ``n`` cached tokens and take ``states``' batch, heads, dim and dtype."""
        buf = self._key_buf
        if buf is None:
            return n == 0
        same = buf.shape[:2] == states.shape[:2] and buf.shape[-1] == states.shape[-1] and buf.dtype == states.dtype
        return same and (n == 0 or (self.keys.data_ptr() == buf.data_ptr() and self.keys.stride() == buf.stride()))

    def _reallocate(self, key_states: torch.Tensor, value_states: torch.Tensor, n: int, need: int) -> None:
        grown = int(self.capacity * GROWTH) if self._key_buf is not None else 0
        cap = max(need, self.reserve_tokens, grown if need > self.reserve_tokens else 0)
        b, h, _, d = key_states.shape
        kbuf = key_states.new_empty(b, h, cap, d)
        vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
        if n:
            kbuf[:, :, :n].copy_(self.keys)
            vbuf[:, :, :n].copy_(self.values)
        self._key_buf, self._value_buf = kbuf, vbuf


def reserved_cache(n_layers: int, tokens: int) -> Cache:
    """A transformers ``Cache`` of ``n_layers`` ``ReservedLayer``\\ s with room for ``tokens``
    tokens each (allocated at each layer's first update).

    Raises:
        ValueError: ``n_layers < 1`` or ``tokens < 0``.
    """
    if n_layers < 1 or tokens < 0:
        raise ValueError(f"reserved_cache: expected n_layers >= 1 and tokens >= 0, got {n_layers} and {tokens}")
    return Cache(layers=[ReservedLayer(tokens) for _ in range(n_layers)])


def reserve(cache: Cache, tokens: int) -> None:
    """Room for ``tokens`` tokens in every ``ReservedLayer`` of ``cache``: a layer whose buffers
    are smaller reallocates to that room (one copy of its cached tokens) at the first update that
    needs more than it has. The room never shrinks; other layers are left as they are."""
    for layer in cache.layers:
        if isinstance(layer, ReservedLayer):
            layer.reserve_tokens = max(layer.reserve_tokens, int(tokens))


__all__ = ["ReservedLayer", "reserve", "reserved_cache"]
