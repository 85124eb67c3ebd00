"""GPU: the transformers engine's CUDA-graph decode (``decode_graph=True``, ``fpcli.engine.decode_graph``).
Run on the device::

    source .fpdev/bin/env.sh && python -m pytest -q tests/gpu/test_decode_graph_gpu.py -s

(a) SmolLM2-135M, dense profile, a ~6K needle: the graph path's greedy tokens equal the eager
path's (the same engine with ``decode_graph`` off), for a first question and for a second one on
the kept KV cache; the capture happens once and is reused by the second question.
(b) The same engine: one host sync per answer token (``torch.cuda.set_sync_debug_mode`` warns on
every synchronizing call; only those warnings are counted): an answer of ``n`` tokens syncs
``n + 1`` times (the prompt's upload, then each picked id), short, long and short again.
(c) Qwen2.5-Coder-0.5B at 131,072 tokens (YaRN), profile bf16 as ``fp ask`` loads it, ~32K and
~100K needles: the graph path's greedy tokens equal the eager path's for 32 and 16 tokens (bf16:
the captured step's attention, ``decode_masked``, sums in another order than the eager decode's
SDPA kernel; a differing token here is a finding to read, not noise to retry).
Skips without CUDA or the staged models (``$FPDEV_MODELS``).
"""
from __future__ import annotations

import gc
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

STEPS = 16


def answer_ids(eng, prompt: list[int], steps: int, graph: bool, keep: bool = False) -> list[int]:
    """The engine's ``steps - 1`` first greedy answer tokens (EOS is no stop here: the ids it fed
    back to its KV cache), decoded with the graph or eagerly; the kept cache is dropped unless
    ``keep`` (so the next call prefills whole)."""
    eng.decode_graph = graph
    r = eng.generate(prompt, max_new_tokens=steps)
    assert r.output_tokens == steps
    assert r.decode_mode == ("cuda graph" if graph else "eager")  # what fp ask's report says
    ids = eng._cache_ids[len(prompt):]
    if not keep:
        eng._cache, eng._cache_ids = None, []
    return ids


@pytest.fixture(scope="module")
def smol():
    eng = load_engine("transformers", str(staged(SMOL)), load_profile("dense"), progress=False, decode_graph=True)
    eng.eos_ids = set()
    yield eng
    eng.close()


def test_smollm2_graph_tokens_equal_eager_and_the_capture_is_reused(smol):
    eng = smol
    prompt, _ = needle_prompt(eng, 6000, seed=5)
    second = prompt[:-8] + prompt[-8:][::-1]  # another question after the same document
    want = answer_ids(eng, prompt, STEPS, graph=False, keep=True)
    want2 = answer_ids(eng, second, STEPS, graph=False)  # on the kept cache, as the graph's second below
    got = answer_ids(eng, prompt, STEPS, graph=True, keep=True)  # the eager kept cache is dropped: whole prefill
    g, capture_s = eng._graph, eng.last_capture_s
    assert g is not None and g.graph is not None and capture_s is not None and capture_s > 0
    got2 = answer_ids(eng, second, STEPS, graph=True)  # the kept cache on the graph's buffers, no new capture
    assert eng._graph is g and eng.last_capture_s is None
    assert got == want and got2 == want2


SYNC = "called a synchronizing CUDA operation"  # the sync debug mode's warning on each sync


def syncs_of(eng, prompt: list[int], steps: int) -> int:
    """Host syncs of one ``generate`` of ``steps`` tokens: the recorded warnings that say ``SYNC``.
    Not every warning: the mode's first use in a process also warns that it is a prototype, which
    the twelfth session's count took for a sync ((6, 21): 1 + 5 and 21; found with a tiny model on
    the H200, torch 2.11). Collected garbage and an idle device first, so neither lands inside."""
    gc.collect()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = eng.generate(prompt, max_new_tokens=steps)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert r.output_tokens == steps
    eng._cache, eng._cache_ids = None, []
    return sum(SYNC in str(w.message) for w in caught)


def test_one_host_sync_per_answer_token(smol):
    eng = smol
    eng.decode_graph = True
    prompt, _ = needle_prompt(eng, 6000, seed=6)
    eng.generate(prompt, max_new_tokens=4 + STEPS)  # captured for the longest answer, allocator warm
    eng._cache, eng._cache_ids = None, []
    short, long, again = syncs_of(eng, prompt, 4), syncs_of(eng, prompt, 4 + STEPS), syncs_of(eng, prompt, 4)
    assert eng.last_capture_s is None  # all three ran on the kept graph
    # the prompt's upload (torch.tensor(..., device=cuda) from host memory), then one read per token
    assert (short, long, again) == (4 + 1, 4 + STEPS + 1, 4 + 1), (short, long, again)


@pytest.fixture(scope="module")
def qwen():
    staged(QWEN)
    prof = with_context_length(load_profile("bf16"), 131072)
    with load_engine("transformers", str(QWEN), prof, progress=False, decode_graph=True) as eng:
        eng.eos_ids = set()
        yield eng


@pytest.mark.parametrize("tokens, steps", [(32_000, 32), (100_000, 16)])
def test_qwen_long_context_graph_tokens_equal_eager(qwen, tokens, steps):
    prompt, _ = needle_prompt(qwen, tokens, seed=7)
    got = answer_ids(qwen, prompt, steps, graph=True)
    print(f"\nQwen {len(prompt):,} tokens: capture {qwen.last_capture_s} s, graph capacity {qwen._graph.capacity:,}")
    want = answer_ids(qwen, prompt, steps, graph=False)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"first differing token at step {first}: graph {got}, eager {want}"
