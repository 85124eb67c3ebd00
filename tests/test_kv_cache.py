"""The transformers engine's KV cache (``fpcli.engine.kv_cache``) and what a decode step allocates.

- ``ReservedLayer`` returns the same keys/values as transformers' ``DynamicLayer`` through
  prefill, decode steps, a crop and a regrowth, and writes decode steps in place (same storage);
- the engine's decode steps allocate no tensor as large as one layer's K cache (a
  ``TorchDispatchMode`` sees every op's output: ``DynamicCache``'s ``torch.cat`` made two per layer
  and step) and give the tokens of a plain ``DynamicCache`` forward loop;
- each decode forward takes the picked token's tensor (no host-built input per step).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.cache_utils import DynamicLayer

from fpcli.engine.kv_cache import ReservedLayer, reserve, reserved_cache
from fpcli.engine.transformers_engine import TransformersEngine
from fpcli.profiles import load_profile
from test_transformers_engine import HKV, WORDS, model_dir  # noqa: F401 - the tiny chat model fixture

D = 8


def states(n: int, seed: int, heads: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, n, D, generator=g), torch.randn(1, heads, n, D, generator=g)


def test_reserved_layer_equals_dynamic_layer_and_decodes_in_place():
    ref, got = DynamicLayer(), ReservedLayer(reserve_tokens=20)
    for step, n in enumerate([7, 1, 1, 1]):  # a prefill, then decode steps
        k, v = states(n, seed=step)
        want = ref.update(k, v)
        out = got.update(k, v)
        torch.testing.assert_close(out[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(out[1], want[1], rtol=0, atol=0)
        if step == 0:
            storage = out[0].untyped_storage().data_ptr()
        assert out[0].untyped_storage().data_ptr() == storage  # no copy of the cache per step
    assert got.capacity == 20 and got.get_seq_length() == ref.get_seq_length() == 10
    ref.crop(-4)  # a negative count removes that many tokens (the only form transformers 5.24 accepts)
    got.crop(-4)
    k, v = states(30, seed=9)  # beyond the reserved room: one reallocation, the prefix kept
    torch.testing.assert_close(got.update(k, v)[0], ref.update(k, v)[0], rtol=0, atol=0)
    assert got.get_seq_length() == 36 and got.capacity >= 36


def test_reserved_layer_regrows_when_the_buffer_no_longer_backs_the_keys():
    layer = ReservedLayer(reserve_tokens=8)
    k, v = states(4, seed=1)
    layer.update(k, v)
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # e.g. reorder_cache's index_select
    k2, v2 = states(1, seed=2)
    out_k, out_v = layer.update(k2, v2)
    torch.testing.assert_close(out_k, torch.cat([k, k2], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(out_v, torch.cat([v, v2], dim=-2), rtol=0, atol=0)


def test_reserve_raises_the_room_of_a_kept_cache():
    cache = reserved_cache(2, 5)
    for i in range(2):
        cache.update(*states(5, seed=i), layer_idx=i)
    assert [layer.capacity for layer in cache.layers] == [5, 5]
    reserve(cache, 12)
    cache.update(*states(1, seed=3), layer_idx=0)
    assert cache.layers[0].capacity == 12 and cache.get_seq_length() == 6
    with pytest.raises(ValueError, match="n_layers >= 1"):
        reserved_cache(0, 5)


class AllocationLog(TorchDispatchMode):
    """Every op's output tensors that own new storage (not a view of an input), per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.forward = 0
        self.new: list[tuple[int, str, int]] = []  # (forward, op, numel)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.new.append((self.forward, str(func), t.numel()))
        return out


def test_decode_steps_allocate_nothing_of_the_cache_size(model_dir):  # noqa: F811
    """Before ``ReservedLayer``: two ``aten.cat`` outputs of ``[1, Hkv, n, d]`` per layer and
    decode step (the whole cache copied each step)."""
    from transformers import DynamicCache

    with TransformersEngine(model_dir, load_profile("dense"), reuse_cache=False) as eng:
        eng.eos_ids = set()  # all the steps asked for
        prompt = eng.encode_chat(None, " ".join(WORDS[i % 200] for i in range(1500)))
        layer_kv = HKV * len(prompt) * eng.model.config.head_dim  # one layer's K cache, elements
        log = AllocationLog()

        def count(module, args):
            log.forward += 1

        handle = eng.model.register_forward_pre_hook(count)
        try:
            with log:
                r = eng.generate(prompt, max_new_tokens=5)
        finally:
            handle.remove()
        assert log.forward == 5 and r.output_tokens == 5  # a prefill and 4 decode steps
        assert any(f == 1 and n >= layer_kv for f, _, n in log.new)  # the prefill fills the reserved cache
        big = [(f, op, n) for f, op, n in log.new if f > 1 and n >= layer_kv]
        assert big == [], big[:4]

        # the same greedy tokens as transformers' own DynamicCache, one forward per token
        model, cache, ids, want = eng.model, DynamicCache(), torch.tensor([prompt]), []
        with torch.inference_mode():
            for _ in range(5):
                out = model(input_ids=ids, use_cache=True, **{eng._cache_kw: cache})
                want.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[want[-1]]])
    assert r.text == eng_text(model_dir, want)


def eng_text(model_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=True)


def test_decode_input_is_the_picked_tensor_not_rebuilt_from_the_host(model_dir):  # noqa: F811
    """Each decode forward takes the tensor the pick returned (on a GPU: no host-to-device copy of
    the token, which synchronised a second time per step); the host reads the token once."""
    with TransformersEngine(model_dir, load_profile("dense")) as eng:
        eng.eos_ids = set()
        picks: list[torch.Tensor] = []
        inputs: list[torch.Tensor] = []

        def pick(logits, temperature):
            picks.append(TransformersEngine._pick(logits, temperature))
            return picks[-1]

        eng._pick = pick
        handle = eng.model.register_forward_pre_hook(lambda m, a, kw: inputs.append(kw["input_ids"]), with_kwargs=True)
        try:
            r = eng.generate(eng.encode_chat(None, " ".join(WORDS[:40])), max_new_tokens=4)
        finally:
            handle.remove()
    assert r.output_tokens == 4 and len(inputs) == 4 and len(picks) == 4
    for fed, picked in zip(inputs[1:], picks):
        assert fed.shape == (1, 1) and fed.data_ptr() == picked.data_ptr()


def test_adopted_buffers_take_the_prefill_and_mark_filled_shows_tokens_written_outside_update():
    kbuf, vbuf = torch.zeros(1, 2, 12, D), torch.zeros(1, 2, 12, D)
    layer = ReservedLayer(12)
    layer.adopt(kbuf, vbuf)
    k, v = states(5, seed=4)
    out_k, _ = layer.update(k, v)
    assert out_k.data_ptr() == kbuf.data_ptr() and layer.buffers_are(kbuf, vbuf)
    torch.testing.assert_close(kbuf[:, :, :5], k, rtol=0, atol=0)
    k2, v2 = states(2, seed=5)
    kbuf[:, :, 5:7], vbuf[:, :, 5:7] = k2, v2  # what a captured decode step writes
    layer.mark_filled(7)
    assert layer.get_seq_length() == 7
    torch.testing.assert_close(layer.values, torch.cat([v, v2], dim=-2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected an empty layer"):
        layer.adopt(torch.zeros_like(kbuf), torch.zeros_like(vbuf))
    with pytest.raises(ValueError, match="0 <= n <= capacity"):
        layer.mark_filled(13)


def test_reserved_layer_does_not_call_lazy_initialization_with_the_5_0_signature(monkeypatch):
    """pyproject allows transformers 4.56, whose ``DynamicLayer.lazy_initialization`` takes one
    argument (two from 5.0): with that method as 4.57.1 defines it, a prefill, a decode step, a
    crop and ``mark_filled`` still work (before, they raised TypeError on the first update)."""
    def lazy_initialization_4_57(self, key_states):  # transformers 4.57.1 cache_utils.DynamicLayer
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    monkeypatch.setattr(DynamicLayer, "lazy_initialization", lazy_initialization_4_57)
    k, v = states(5, seed=6)
    layer = ReservedLayer(8)
    layer.update(k, v)
    k1, v1 = states(1, seed=7)
    keys, values = layer.update(k1, v1)
    torch.testing.assert_close(keys, torch.cat([k, k1], dim=-2), rtol=0, atol=0)
    assert layer.get_seq_length() == 6 and layer.capacity == 8
    layer.crop(-2)
    assert layer.get_seq_length() == 4
    adopted = ReservedLayer(12)
    adopted.adopt(torch.zeros(1, 2, 12, D), torch.zeros(1, 2, 12, D))
    adopted.mark_filled(3)
    assert adopted.get_seq_length() == 3 and adopted.keys.dtype == torch.float32
