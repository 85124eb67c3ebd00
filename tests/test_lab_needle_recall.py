"""The lab's needle diagnosis (``scripts/lab/needle_recall.py``): it finds every needle of a real
``niah_multikey`` sample at the right tokens, and its one-knob configurations change only that knob
of the ``bf16`` profile. CPU; the embedded model's tokenizer only (skipped when not pulled)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import needle_recall  # noqa: E402  (scripts/lab is not a package)


def test_needles_are_found_at_their_tokens():
    from fpcli.models import model_path
    from fpcli.ruler.haystack import GeneratedHaystack
    from fpcli.ruler.tasks import TASKS, make_sample

    mdir = model_path()
    if not (mdir / "tokenizer.json").exists() and not (mdir / "tokenizer_config.json").exists():
        pytest.skip("embedded model not pulled")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(mdir))
    ct = needle_recall.ChatTokenizer(tok)
    sample = make_sample(TASKS["niah_multikey"], 1024, 1, 3, GeneratedHaystack(), ct, needle_recall.CONTEXT)
    text = tok.apply_chat_template(ct.messages(sample.system, sample.user), add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == sample.ids
    found = needle_recall.needles(text, enc["offset_mapping"], sample.expected[0])
    assert len(found) == 4
    assert sum(nd["asked"] for nd in found) == 1
    for nd in found:
        a, b = nd["value_tokens"]
        assert tok.decode(sample.ids[a:b]).strip() == nd["value"]
        s0, s1 = nd["tokens"]
        assert s0 < a and b <= s1
        assert nd["key"] in tok.decode(sample.ids[s0:s1])


def test_one_knob_changes_only_that_knob():
    base, dense = needle_recall.profile_base()
    assert base.min_sparse_len == needle_recall.CONTEXT // 2
    cfg, dl = needle_recall.parse_config("alpha=0.01", base, dense)
    assert (cfg.alpha, dl) == (0.01, dense)
    assert cfg.replace(alpha=base.alpha) == base
    cfg, dl = needle_recall.parse_config("mean_correction=false+dense_layers=6", base, dense)
    assert (cfg.mean_correction, dl) == (False, 6)
    assert cfg.replace(mean_correction=True) == base


def test_spans_cover_the_prompt_in_chunks():
    assert needle_recall.spans(2500, 1024) == [(0, 1024), (1024, 2048), (2048, 2500)]
    assert needle_recall.spans(2500, None) == [(0, 2500)]
    nl = [{"value_tokens": (10, 13)}, {"value_tokens": (40, 42)}]
    assert needle_recall.value_rows(nl) == [10, 11, 12, 40, 41]


def test_dense_config_is_no_sparse_layer():
    base, dense = needle_recall.profile_base()
    assert needle_recall.parse_config("dense", base, dense) == (None, 0)
    cfg, _ = needle_recall.parse_config("min_sparse_len=256", base, dense)
    assert cfg.min_sparse_len == 256


@pytest.mark.slow
def test_one_shot_and_chunked_runs_give_the_per_layer_table(tmp_path, monkeypatch):
    """The embedded SmolLM2 at ~1.5K tokens, knobs shrunk so the sparse path runs: both runs produce
    the per-layer table, and the chunked prefill calls the real operator with Lq < Lk (a hook on the
    operator the transformers integration calls, wrapping it, not replacing it)."""
    from fpcli.models import is_complete, model_path

    if not is_complete(model_path()):
        pytest.skip("embedded model not pulled")
    from flashprefill.integrations import transformers as fpt

    seen = []
    real = fpt.flashprefill_attention

    def hook(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, **kw):
        seen.append((int(q.shape[0]), int(seq_lens[0])))
        return real(q, k_cache, v_cache, page_table, seq_lens, cu_seqlens_q, **kw)

    monkeypatch.setattr(fpt, "flashprefill_attention", hook)
    knobs = "min_sparse_len=256+window_tokens=128+sink_tokens=128+dense_tail_tokens=64"
    out = tmp_path / "nr.json"
    report = needle_recall.main(["--len", "1536", "--chunk", "512", "--configs", knobs, "--json", str(out)])
    assert out.exists()
    lq = report["tokens"]
    n_layers = len(report["configs"][0]["kv_err_needle_values"])
    assert [c["mode"] for c in report["configs"]] == ["one-shot", "chunked"]
    for entry in report["configs"]:
        layers = entry["layers"]
        assert [x["layer"] for x in layers] == list(range(entry["dense_layers"], n_layers))
        assert 0 < entry["density"] < 1
        for x in layers:
            assert 0 < x["density"] <= 1
            assert all(0 <= m <= 1 for m in x["needle_rows_pruned_mass"])
            assert x["err_haystack"] >= 0
    one_shot, chunked = report["configs"]
    assert (lq, lq) in seen  # the one-shot runs (dense reference's diagnosis does not go through it)
    assert (512, 1024) in seen, "the chunked prefill never called the operator with Lq < Lk"
    assert all(q == k for _, q, k in one_shot["calls"])
    assert any(q < k for _, q, k in chunked["calls"])
    # a chunked sparse run changes the needle values' K/V against the dense run somewhere
    assert any(r["v"] > 0 for r in chunked["kv_err_needle_values"])
