"""``fpcli.engine.context``: a model's context and YaRN beyond it; both engines' use of it."""
from __future__ import annotations

import json

import pytest

from fpcli.engine.context import ContextError, ContextPlan, plan_context, yarn_factor

QWEN_CONFIG = {"max_position_embeddings": 32768, "rope_theta": 1000000.0}


def test_no_request_runs_the_native_context():
    plan = plan_context(QWEN_CONFIG, None)
    assert plan == ContextPlan(32768, 32768, None)
    assert plan.override() == {} and plan.describe("qwen") is None


def test_a_request_within_the_native_context_is_a_cap():
    plan = plan_context(QWEN_CONFIG, 20000)
    assert plan.context == 20000 and plan.rope_scaling is None


def test_beyond_the_native_context_yarn_with_rope_theta_inside():
    plan = plan_context(QWEN_CONFIG, 131072, model="qwen2.5-coder-0.5b-instruct")
    assert plan.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                 "rope_theta": 1000000.0}
    assert plan.override()["max_position_embeddings"] == 131072
    assert plan.describe("qwen2.5-coder-0.5b-instruct") == (
        "extending qwen2.5-coder-0.5b-instruct from 32,768 to 131,072 tokens with YaRN factor 4")
    assert plan.to_dict() == {"native_context": 32768, "context": 131072, "rope_scaling": plan.rope_scaling}


@pytest.mark.parametrize("requested, factor", [(32769, 2), (65536, 2), (65537, 3), (100000, 4), (131072, 4)])
def test_factor_is_the_ceiling_of_the_ratio(requested, factor):
    assert yarn_factor(requested, 32768) == factor
    plan = plan_context(QWEN_CONFIG, requested)
    assert plan.yarn_factor == factor and plan.context == requested  # max_position_embeddings = the request


def test_rope_theta_from_transformers_5_rope_parameters():
    cfg = {"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
    assert plan_context(cfg, 16384).rope_scaling["rope_theta"] == 100000.0


def test_too_long_and_unknown_native_are_one_line_errors():
    with pytest.raises(ContextError, match=r"at most 262,144 \(8x its native 32,768 with YaRN\)") as e:
        plan_context(QWEN_CONFIG, 300_000, model="qwen")
    assert "\n" not in str(e.value) and "300,000" in str(e.value)
    with pytest.raises(ContextError, match="no max_position_embeddings"):
        plan_context({}, 4096, model="m")
    assert plan_context({}, None) == ContextPlan(None, None)


# -- the transformers engine: YaRN on the config before the model is built -----------------------


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    """A tiny random Qwen2 folder (native context 256) with a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen")
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=50000.0)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    vocab = {f"w{i}": i for i in range(62)} | {"<unk>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return path


def _profile(context_length):
    from fpcli.profiles import load_profile, with_context_length

    prof = load_profile("dense")
    return with_context_length(prof, context_length) if context_length else prof


def test_transformers_engine_extends_with_yarn(tiny_qwen):
    import torch

    from fpcli.engine.transformers_engine import TransformersEngine

    eng = TransformersEngine(tiny_qwen, _profile(1024), device="cpu")
    try:
        assert eng.context_length == 1024
        assert eng.context_plan.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 256, "rope_theta": 50000.0}
        rotary = eng.model.model.rotary_emb
        assert rotary.rope_type == "yarn" and rotary.attention_scaling != 1.0  # YaRN's mscale is in use
        native = TransformersEngine(tiny_qwen, _profile(None), device="cpu")
        assert native.context_length == 256 and native.context_plan.rope_scaling is None
        assert native.model.model.rotary_emb.rope_type == "default"
        assert not torch.equal(native.model.model.rotary_emb.inv_freq, rotary.inv_freq)
        ids = [(7 * i) % 60 + 1 for i in range(600)]  # beyond the native 256 positions
        out = eng.generate(ids, max_new_tokens=2)
        assert out.prompt_tokens == 600 and out.output_tokens >= 1
    finally:
        eng.close()


def test_transformers_engine_refuses_beyond_8x(tiny_qwen):
    from fpcli.engine.transformers_engine import TransformersEngine

    with pytest.raises(ContextError, match="at most 2,048"):
        TransformersEngine(tiny_qwen, _profile(4096), device="cpu")


# -- the SGLang engine's server arguments (no GPU needed) -----------------------------------------


def _model_dir(tmp_path, **cfg):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 32768, "rope_theta": 1000000.0, **cfg}))
    return d


def test_sglang_kwargs_yarn_from_the_profile_context(tmp_path):
    from fpcli.engine.sglang_engine import build_server_kwargs

    kw = build_server_kwargs(_model_dir(tmp_path), _profile(131072))
    over = json.loads(kw["json_model_override_args"])
    assert over["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                    "rope_theta": 1000000.0}
    assert over["max_position_embeddings"] == 131072 and kw["context_length"] == 131072
    capped = build_server_kwargs(tmp_path / "model", _profile(16384))
    assert capped["context_length"] == 16384 and "json_model_override_args" not in capped
    native = build_server_kwargs(tmp_path / "model", _profile(None))
    assert "context_length" not in native and "json_model_override_args" not in native
    with pytest.raises(ContextError, match="at most 262,144"):
        build_server_kwargs(tmp_path / "model", _profile(524288))
