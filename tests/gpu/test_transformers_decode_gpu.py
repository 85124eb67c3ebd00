"""GPU: the transformers engine's decode on CUDA (reserved KV cache written in place, one SDPA call
per layer at decode, one host sync per token). Run on the device::

    source .fpdev/bin/env.sh && python -m pytest -q tests/gpu/test_transformers_decode_gpu.py -s

(a) SmolLM2-135M, dense profile, a ~6K needle: the engine's greedy tokens equal those of a stock
transformers model (``attn_implementation="sdpa"``, ``DynamicCache``) run one forward per token.
(b) The same engine (eager decode: ``decode_graph=False``; the CUDA-graph decode is test_decode_graph_gpu.py): exactly one host sync per decode step (``torch.cuda.set_sync_debug_mode``
warns on every synchronizing call: the read of the picked token), none that grows with the steps.
(c) Qwen2.5-Coder-0.5B at 131,072 tokens (YaRN), profile bf16 as ``fp ask`` loads it, a ~100K
needle: the engine's greedy tokens equal a forward loop of the same model (the same sparse
prefill) with transformers' ``DynamicCache`` (the cache the engine used before).
Skips without CUDA or the staged models (``$FPDEV_MODELS``). About 60 s warm.
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fpcli.engine import load_engine  # noqa: E402
from fpcli.profiles import load_profile, with_context_length  # noqa: E402
from fpcli.ttft import needle_prompt  # noqa: E402
from staged import QWEN, SMOL, staged  # noqa: E402

STEPS = 12


@torch.inference_mode()
def forward_loop(model, prompt: list[int], steps: int, cache_kw: str) -> list[int]:
    """Greedy tokens of ``model`` one forward per token with transformers' ``DynamicCache``."""
    from transformers import DynamicCache

    cache, ids, out_ids = DynamicCache(), torch.tensor([prompt], device=model.device), []
    for _ in range(steps):
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        out_ids.append(int(out.logits[0, -1].float().argmax()))
        ids = torch.tensor([[out_ids[-1]]], device=model.device)
    return out_ids


def engine_tokens(eng, prompt: list[int], steps: int) -> list[int]:
    """The engine's first ``steps - 1`` greedy tokens (EOS is no stop here): the inputs of its decode
    forwards, seen by a forward pre-hook on its model."""
    inputs: list[torch.Tensor] = []
    handle = eng.model.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(kwargs["input_ids"]),
                                                 with_kwargs=True)
    try:
        eng.generate(prompt, max_new_tokens=steps)
    finally:
        handle.remove()
    return [int(t.reshape(-1)[-1]) for t in inputs[1:]]


@pytest.fixture(scope="module")
def smol_dense():
    eng = load_engine("transformers", str(staged(SMOL)), load_profile("dense"), progress=False, decode_graph=False)
    eng.eos_ids = set()
    yield eng
    eng.close()


def test_smollm2_decode_matches_stock_sdpa_forward_loop(smol_dense):
    from transformers import AutoModelForCausalLM

    eng = smol_dense
    prompt, _ = needle_prompt(eng, 6000, seed=5)
    got = engine_tokens(eng, prompt, STEPS)
    ref = AutoModelForCausalLM.from_pretrained(str(SMOL), dtype=eng.dtype, attn_implementation="sdpa").to("cuda").eval()
    want = forward_loop(ref, prompt, STEPS - 1, eng._cache_kw)
    assert got == want


def test_one_host_sync_per_decode_step(smol_dense):
    eng = smol_dense
    prompt, _ = needle_prompt(eng, 6000, seed=6)
    eng.generate(prompt, max_new_tokens=4)  # kernels loaded, allocator warm
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = eng.model.register_forward_pre_hook(lambda m, a: marks.append(len(caught)))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            eng.generate(prompt, max_new_tokens=STEPS)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            handle.remove()
    # syncs between the starts of decode forwards i and i+1: decode step i and the pick of its token
    per_step = [b - a for a, b in zip(marks[1:], marks[2:])]
    assert len(per_step) == STEPS - 2 and per_step == [1] * len(per_step), (
        per_step, [str(w.message)[:120] for w in caught[:6]])


def test_qwen_128k_decode_matches_a_dynamic_cache_forward_loop():
    staged(QWEN)
    prof = with_context_length(load_profile("bf16"), 131072)
    with load_engine("transformers", str(QWEN), prof, progress=False, decode_graph=False) as eng:
        eng.eos_ids = set()
        prompt, _ = needle_prompt(eng, 100_000, seed=7)
        got = engine_tokens(eng, prompt, 8)
        eng.runtime.reset()
        want = forward_loop(eng.model, prompt, 7, eng._cache_kw)
    assert got == want
