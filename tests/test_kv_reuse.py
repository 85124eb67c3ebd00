"""KV reuse and prefill progress of the transformers engine, on the tiny random Llama of
``test_transformers_engine`` (CPU, float32, no download).

Exactness: with dense attention (the ``dense`` profile, or prompts below ``min_sparse_len``), a
generate that reuses the kept cache must give the same greedy tokens as a fresh engine that
prefills the whole prompt; the reuse counts only the common token prefix, never the earlier
answer's tokens beyond it.
"""
from __future__ import annotations

import dataclasses

import pytest

from fpcli.engine.transformers_engine import TransformersEngine, common_prefix_len
from test_transformers_engine import LAYERS, WORDS, model_dir, profile  # noqa: F401 - model_dir is a fixture


def doc(n: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 13) % len(WORDS)] for i in range(n))


def test_common_prefix_len():
    assert common_prefix_len([5, 6, 7, 8], [5, 6, 9]) == 2
    assert common_prefix_len([5, 6, 7], [5, 6, 7, 8], limit=2) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [3, 2]) == 0
    assert common_prefix_len([4, 4, 4], [4, 4, 4], limit=-1) == 0


@pytest.mark.parametrize("prof_name", ["dense", "bf16"])  # bf16: 600 tokens < min_sparse_len, so dense too
def test_reuse_gives_the_tokens_of_a_fresh_prefill(model_dir, prof_name):
    prof = profile(prof_name)
    text = doc(600, 1)
    with TransformersEngine(model_dir, prof) as eng, TransformersEngine(model_dir, prof, reuse_cache=False) as fresh:
        q1 = eng.encode_chat("w1 w2", f"{text} w190 w191 w192")
        q2 = eng.encode_chat("w1 w2", f"{text} w150 w151")
        first = eng.generate(q1, max_new_tokens=8)
        assert first.cached_tokens == 0
        second = eng.generate(q2, max_new_tokens=8)
        expect = common_prefix_len(q1, q2)
        assert expect >= 0.9 * len(q2)
        assert second.cached_tokens == expect
        assert second.prompt_tokens == len(q2)
        ref = fresh.generate(q2, max_new_tokens=8)
        assert ref.cached_tokens == 0
        assert second.text == ref.text and second.output_tokens == ref.output_tokens
        # the FLOPs count only the prefilled suffix, its queries seeing the cached prefix
        assert 0 < second.stats.attention_flops_dense < 0.2 * ref.stats.attention_flops_dense


def test_same_prompt_twice_prefills_one_token(model_dir):
    with TransformersEngine(model_dir, profile("dense")) as eng:
        ids = eng.encode_chat(None, doc(300, 2))
        a = eng.generate(ids, max_new_tokens=6)
        b = eng.generate(ids, max_new_tokens=6)
        assert b.cached_tokens == len(ids) - 1  # at least one token is prefilled for the first logits
        assert (a.text, a.output_tokens) == (b.text, b.output_tokens)


def test_reuse_never_takes_the_earlier_answer_beyond_the_common_prefix(model_dir):
    """The kept cache holds prompt + answer; a new prompt = old prompt + other tokens must reuse
    only the old prompt (and any answer tokens it really repeats), and answer exactly."""
    prof = profile("dense")
    with TransformersEngine(model_dir, prof) as eng, TransformersEngine(model_dir, prof, reuse_cache=False) as fresh:
        ids = eng.encode_chat(None, doc(300, 3))
        first = eng.generate(ids, max_new_tokens=6)
        answer_ids = eng.tokenizer(first.text, add_special_tokens=False)["input_ids"]
        other = next(t for t in range(3, 200) if not answer_ids or t != answer_ids[0])
        longer = ids + [other, other + 1, other + 2]
        second = eng.generate(longer, max_new_tokens=6)
        assert second.cached_tokens == len(ids)
        ref = fresh.generate(longer, max_new_tokens=6)
        assert (second.text, second.output_tokens) == (ref.text, ref.output_tokens)


def test_another_document_reuses_only_the_template_prefix(model_dir):
    with TransformersEngine(model_dir, profile("dense")) as eng:
        a = eng.encode_chat("w1 w2", doc(400, 4) + " w9")
        b = eng.encode_chat("w1 w2", doc(400, 5) + " w9")
        eng.generate(a, max_new_tokens=4)
        r = eng.generate(b, max_new_tokens=4)
        assert r.cached_tokens == common_prefix_len(a, b) < 10


def test_reuse_off_prefills_everything(model_dir):
    with TransformersEngine(model_dir, profile("dense"), reuse_cache=False) as eng:
        ids = eng.encode_chat(None, doc(200, 6))
        eng.generate(ids, max_new_tokens=3)
        assert eng.generate(ids, max_new_tokens=3).cached_tokens == 0


def test_prefill_progress_per_layer_changes_nothing(model_dir):
    prof = dataclasses.replace(profile("bf16", block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64,
                                       alpha=1.0, min_sparse_len=0), dense_layers=0)  # the sparse path too
    seen: list[tuple[int, int]] = []
    with TransformersEngine(model_dir, prof, reuse_cache=False) as eng:
        ids = eng.encode_chat(None, doc(900, 7))
        quiet = eng.generate(ids, max_new_tokens=5)
        shown = eng.generate(ids, max_new_tokens=5, on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i + 1, LAYERS) for i in range(LAYERS)]  # once per layer of the prefill, none in decode
    assert (shown.text, shown.stats.density_per_layer) == (quiet.text, quiet.stats.density_per_layer)
    assert shown.stats.density < 1.0


def test_sparse_prefill_after_a_reused_prefix(model_dir):
    """A long new suffix after the cached documents takes the FlashPrefill path with P > 0: every
    layer sparse, its queries the suffix only, its keys the cached prefix plus the suffix."""
    prof = dataclasses.replace(profile("bf16", block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64,
                                       alpha=1.0, min_sparse_len=0), dense_layers=0)
    with TransformersEngine(model_dir, prof) as eng:
        a = eng.encode_chat(None, doc(700, 8) + " w1")
        b = eng.encode_chat(None, doc(700, 8) + " " + doc(400, 9))
        eng.generate(a, max_new_tokens=3)
        r = eng.generate(b, max_new_tokens=3)
        p = common_prefix_len(a, b)
        assert r.cached_tokens == p > 600
        rows = [eng.runtime.layers[i] for i in range(LAYERS)]
    assert all(row.sparse and row.q_len == len(b) - p and row.kv_len == len(b) for row in rows)
    assert r.stats.sparse_layers == list(range(LAYERS)) and 0.0 < r.stats.density <= 1.0
    assert r.output_tokens >= 1
