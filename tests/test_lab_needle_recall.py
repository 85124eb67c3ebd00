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
