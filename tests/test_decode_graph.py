"""The transformers engine's static decode step (``fpcli.engine.decode_graph``), run eagerly on the CPU.

What a CUDA graph would replay, checked where it can be without a GPU (the capture itself is
tests/gpu/test_decode_graph_gpu.py):

- the engine with ``decode_graph=True`` gives the greedy tokens of today's decode on the embedded
  SmolLM2, for a first question and a second one on the kept KV cache, and grows its capacity when
  a request needs more;
- the mask from the device length counter hides the unwritten capacity (poisoned with large
  keys/values) and shows the token being decoded;
- the step reads no host value (no ``aten._local_scalar_dense``) and never asks the cache for its
  length (which a capture would bake in).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpcli.engine.decode_graph import (
    GRAPH_MIN_NEW_TOKENS, DecodeGraph, check_graphable, decode_graph_choice, graph_capacity,
)
from fpcli.engine.transformers_engine import TransformersEngine
from fpcli.profiles import load_profile
from flashprefill.integrations.transformers import _sdpa, flashprefill_attention_forward

TEXT = ("The harbor master logged every vessel that entered the port. The secret berth number is 4417. "
        "Cranes moved containers from the quay to the yard while the tide turned. ") * 12


def answer_ids(eng: TransformersEngine, prompt: list[int], steps: int) -> list[int]:
    """The engine's ``steps`` greedy answer tokens (EOS does not stop them): those it fed back
    to its KV cache (its kept ids after the prompt) plus the last one picked."""
    r = eng.generate(prompt, max_new_tokens=steps)
    assert r.output_tokens == steps
    fed = eng._cache_ids[len(prompt):]
    assert len(fed) == steps - 1
    return fed


@pytest.fixture(scope="module")
def engines(smollm2):
    torch.manual_seed(0)
    with TransformersEngine(smollm2, load_profile("dense")) as eager, \
            TransformersEngine(smollm2, load_profile("dense"), decode_graph=True) as graphed:
        eager.eos_ids = graphed.eos_ids = set()
        yield eager, graphed


def test_static_step_gives_todays_greedy_tokens_and_reuses_its_buffers(engines):
    eager, graphed = engines
    first = eager.encode_chat(None, TEXT + "\n\nWhat is the secret berth number?")
    want, got = answer_ids(eager, first, 10), answer_ids(graphed, first, 10)
    assert got == want
    g = graphed._graph
    assert g is not None and g.graph is None and graphed.last_capture_s is None  # never captured on the CPU
    assert g.capacity == graph_capacity(len(first) + 10) and g.backs(graphed._cache)

    # a second question on the same documents: the kept cache (on the graph's buffers) serves the prefix
    second = eager.encode_chat(None, TEXT + "\n\nWhat did the cranes move?")
    r_e, r_g = eager.generate(second, max_new_tokens=8), graphed.generate(second, max_new_tokens=8)
    assert r_g.cached_tokens == r_e.cached_tokens > len(second) // 2
    assert graphed._cache_ids == eager._cache_ids and r_g.text == r_e.text
    assert graphed._graph is g  # same capacity: the same step and buffers

    # a request beyond the capacity: a new graph, GROWTH times larger, the kept cache dropped
    third = eager.encode_chat(None, TEXT * 2 + "\n\nWhich number?")
    assert len(third) + 6 > g.capacity
    r3 = graphed.generate(third, max_new_tokens=6)
    assert graphed._graph is not g and graphed._graph.capacity >= 2 * g.capacity and r3.cached_tokens == 0
    r3_e = eager.generate(third, max_new_tokens=6)
    assert graphed._cache_ids == eager._cache_ids and r3.text == r3_e.text


def prefilled_graph(eng: TransformersEngine, prompt: list[int], capacity: int) -> DecodeGraph:
    g = DecodeGraph(eng.model, capacity, eng._cache_kw)
    out = eng.model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1,
                    **{eng._cache_kw: g.prefill_cache()})
    g.start(out.logits[0, -1].argmax(), len(prompt))
    return g


@torch.inference_mode()
def test_mask_hides_the_unwritten_capacity_and_shows_the_current_token(engines):
    """Logits of each step equal a ``DynamicCache`` forward loop's: a mask that let a poisoned slot
    in, or left out the key of the token being decoded, changes them."""
    from transformers import DynamicCache

    eager, _ = engines
    model, kw = eager.model, eager._cache_kw
    prompt = eager.encode_chat(None, TEXT + "\n\nWhat is the secret berth number?")
    cache, ids, want_ids, want_logits = DynamicCache(), torch.tensor([prompt]), [], []
    for _ in range(5):
        logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[0, -1]
        want_logits.append(logits)
        want_ids.append(int(logits.argmax()))
        ids = torch.tensor([[want_ids[-1]]])

    g = prefilled_graph(eager, prompt, len(prompt) + 64)
    n = len(prompt)
    for k, v in zip(g.keys, g.values):  # every slot the steps have not written yet
        k[:, :, n:].fill_(300.0)
        v[:, :, n:].fill_(-1e4)
    seen: list[torch.Tensor] = []
    handle = model.register_forward_hook(lambda m, a, out: seen.append(out.logits[0, -1].clone()))
    try:
        got_ids = [int(g.ids)] + [int(g.advance()) for _ in range(4)]
    finally:
        handle.remove()
    assert got_ids == want_ids
    for got, want in zip(seen, want_logits[1:]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert int(g.position) == n + 4
    assert torch.all(g.values[0][:, :, n + 4:] == -1e4) and not torch.any(g.values[0][:, :, n:n + 4] == -1e4)


def test_attention_function_sends_a_masked_decode_step_to_decode_masked():
    """The attention function with a decode step (``Lq = 1``) and a key mask over a fixed capacity
    (what the captured step passes) equals its unmasked decode over the filled keys
    (``decode_masked`` itself: tests/test_decode_masked.py)."""
    gen = torch.Generator().manual_seed(3)
    hkv, groups, d, n, cap = 3, 5, 16, 37, 64
    q = torch.randn(1, hkv * groups, 1, d, generator=gen)
    k = torch.randn(1, hkv, cap, d, generator=gen)
    v = torch.randn(1, hkv, cap, d, generator=gen)
    k[:, :, n:], v[:, :, n:] = 50.0, 1e4  # unwritten slots
    mask = (torch.arange(cap) < n).view(1, 1, 1, cap)
    module = torch.nn.Module()
    module.layer_idx = 0
    got, _ = flashprefill_attention_forward(module, q, k, v, mask, scaling=0.25)
    want = _sdpa(q, k[:, :, :n], v[:, :, :n], 0.25, groups)
    assert got.shape == want.shape == (1, 1, hkv * groups, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected a mask"):
        flashprefill_attention_forward(module, q, k, v, mask[..., :-1], scaling=0.25)


HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,  # int(t), t.item()
              torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,  # bool(t), torch.equal
              torch.ops.aten.nonzero.default}  # an output size read from the values


class NoHostRead(TorchDispatchMode):
    """Fails on an op that reads a tensor value on the host (``HOST_READS``: torch 2.13 dispatches
    ``int(t)`` as ``aten.item``, older versions as ``aten._local_scalar_dense``); counts ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError("host read of a tensor value inside the decode step")
        self.ops += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_step_reads_no_host_value_and_no_cache_length(engines):
    eager, _ = engines
    prompt = eager.encode_chat(None, TEXT[:400])
    g = prefilled_graph(eager, prompt, len(prompt) + 16)
    mode = NoHostRead()
    with mode:
        g.step()
        g.step()
    assert mode.ops > 100 and int(g.position) == len(prompt) + 2
    for read in (int, bool, torch.Tensor.item):  # the mode does catch a host read (tolist reads the memory unseen)
        with pytest.raises(AssertionError, match="host read"), NoHostRead():
            read(g.position)
    with pytest.raises(RuntimeError, match="lives on the device"):
        g._step_cache.get_seq_length()


def test_check_graphable_refuses_sliding_windows_and_host_side_rope(engines):
    from transformers import LlamaConfig, Qwen2Config

    check_graphable(LlamaConfig(num_hidden_layers=2))
    with pytest.raises(ValueError, match="full-attention layers only"):
        check_graphable(Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                                    use_sliding_window=True, sliding_window=64))
    with pytest.raises(ValueError, match="'dynamic'"):
        check_graphable(LlamaConfig(num_hidden_layers=2,
                                    rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="capture needs a CUDA device, the model is on cpu"):
        DecodeGraph(engines[0].model, 8, engines[0]._cache_kw).capture()


def test_default_choice_follows_the_profile_on_cuda_and_falls_back_where_the_step_cannot_be_captured():
    from transformers import LlamaConfig, Qwen2Config

    full = LlamaConfig(num_hidden_layers=2)
    sliding = Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                          use_sliding_window=True, sliding_window=64)
    assert decode_graph_choice(None, True, "cuda", full) == (True, None)
    assert decode_graph_choice(None, False, "cuda", full) == (False, "the profile sets engine.cuda_graph_decode: false")
    assert decode_graph_choice(None, True, "cpu", full) == (False, "no CUDA graphs on the cpu")
    on, why = decode_graph_choice(None, True, "cuda", sliding)  # the default never raises: eager, and why
    assert not on and "full-attention layers only" in why
    assert decode_graph_choice(False, True, "cuda", full)[0] is False
    assert decode_graph_choice(True, False, "cpu", full) == (True, None)  # asked explicitly: on, even on the CPU
    with pytest.raises(ValueError, match="full-attention layers only"):
        decode_graph_choice(True, True, "cuda", sliding)


def test_engine_default_is_eager_on_the_cpu_and_a_failed_capture_falls_back_to_eager(smollm2, engines, monkeypatch):
    eager, graphed = engines
    assert eager.decode_graph is False and eager.decode_graph_off == "no CUDA graphs on the cpu"
    assert graphed.decode_graph is True and graphed.decode_graph_required
    prompt = eager.encode_chat(None, TEXT + "\n\nWhat is the secret berth number?")
    want = eager.generate(prompt, max_new_tokens=GRAPH_MIN_NEW_TOKENS).text
    eager._cache, eager._cache_ids = None, []

    def broken(tokens):
        raise RuntimeError("CUDA error: out of memory (injected)")

    with TransformersEngine(smollm2, load_profile("dense")) as eng:
        eng.eos_ids = eager.eos_ids
        eng.decode_graph = True  # as the default choice turns it on with a CUDA device
        monkeypatch.setattr(eng, "decode_graph_for", broken)
        r = eng.generate(prompt, max_new_tokens=GRAPH_MIN_NEW_TOKENS)
        assert r.text == want and r.output_tokens == GRAPH_MIN_NEW_TOKENS
        assert eng.decode_graph is False and "capture failed (RuntimeError: CUDA error: out of memory" in eng.decode_graph_off
        graphed_required = graphed.decode_graph_for
        monkeypatch.setattr(graphed, "decode_graph_for", broken)
        with pytest.raises(RuntimeError, match="injected"):  # decode_graph=True asked for it: no silent fallback
            graphed.generate(prompt, max_new_tokens=GRAPH_MIN_NEW_TOKENS)
        monkeypatch.setattr(graphed, "decode_graph_for", graphed_required)


def test_short_answers_skip_the_graph_under_the_default_choice(smollm2, engines):
    eager, _ = engines
    prompt = eager.encode_chat(None, TEXT + "\n\nWhat is the secret berth number?")
    with TransformersEngine(smollm2, load_profile("dense")) as eng:
        eng.eos_ids = set()  # every answer its full length: decode steps to report
        eng.decode_graph = True  # the default choice on a CUDA device; on the CPU its step runs eagerly
        short = eng.generate(prompt, max_new_tokens=GRAPH_MIN_NEW_TOKENS - 1)
        assert eng._graph is None  # a one-token answer (fp profile) never pays a capture
        assert short.decode_mode == "eager"  # what the report says: this one's steps ran eagerly
        long = eng.generate(prompt, max_new_tokens=GRAPH_MIN_NEW_TOKENS)
        assert eng._graph is not None
        assert long.decode_mode == "eager"  # the static step, but no CUDA graph on the CPU: said as it ran
        one = eng.generate(prompt, max_new_tokens=1)
        assert one.output_tokens == 1 and one.decode_mode is None  # no decode step


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor value on the host (``HOST_READS``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in HOST_READS
        return func(*args, **(kwargs or {}))


def host_reads(eng: TransformersEngine, prompt: list[int], tokens: int, monkeypatch) -> int:
    """Host reads of tensor values during one ``generate`` of ``tokens`` answer tokens: the ops
    ``HostReads`` sees plus ``Tensor.tolist`` / ``Tensor.numpy`` calls (they read the memory
    without dispatching an op). On a GPU each is a host sync; the kept cache is dropped after."""
    unseen: list[str] = []
    with monkeypatch.context() as mp:
        for name in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, name)
            mp.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **kw: unseen.append(_n) or _o(self, *a, **kw))
        with HostReads() as mode:
            r = eng.generate(prompt, max_new_tokens=tokens)
    assert r.output_tokens == tokens
    eng._cache, eng._cache_ids = None, []
    return mode.reads + len(unseen)


@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_one_host_read_per_answer_token(engines, graph, monkeypatch):
    """The engine's decode loop reads one value per answer token (the picked id: EOS, streamed
    text), with the static step and with the eager forward: short, long and short answers again,
    so a read that happens once per request (or only on the first) cannot pass for a per-token one.
    What the GPU test counts as syncs (tests/gpu/test_decode_graph_gpu.py), here as host reads."""
    eng = engines[1] if graph else engines[0]
    assert eng.decode_graph is graph
    prompt = eng.encode_chat(None, TEXT[:600])
    eng._cache, eng._cache_ids = None, []
    short, long, again = (host_reads(eng, prompt, n, monkeypatch) for n in (3, 3 + 9, 3))
    assert (short, long, again) == (3, 12, 3)  # the prefill's pick, then one per decode step
