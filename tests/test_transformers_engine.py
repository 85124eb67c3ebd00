"""The transformers engine on a tiny randomly initialised Llama (CPU, float32, no download).

- the FlashPrefill attention function with a config that keeps every block gives the logits of
  transformers' own SDPA attention (prefill from scratch, and a second chunk after a prefix);
- a sparse config on a 1K-token input gives density < 1, finite logits and populated stats;
- the engine (tokenizer, chat template, greedy/sampled decode, streaming, stats) end to end;
- ``load_engine``: engine choice and the SGLang-unavailable error.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flashprefill import SparseConfig
from flashprefill.flops import dense_causal_flops as causal_attention_flops
from flashprefill.integrations.transformers import ATTN_NAME, FlashPrefillRuntime, install_flashprefill
from fpcli.engine.transformers_engine import TransformersEngine, prefill_stats
from fpcli.profiles import load_profile

HQ, HKV, D, LAYERS = 6, 2, 32, 2  # g = 3: GQA packing with an odd group
KEEP_ALL = SparseConfig(block_size=64, sink_tokens=0, window_tokens=1, dense_tail_tokens=0, alpha=0.0)
SPARSE = SparseConfig(block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64, alpha=1.0)
WORDS = [f"w{i}" for i in range(200)]


def tiny_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=256, hidden_size=HQ * D, intermediate_size=256, num_hidden_layers=LAYERS,
                num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=4096,
                rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_model(attn: str):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    # Larger q/k weights give peaked attention, so block selection has something to find.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.set_attn_implementation(attn)
    return model.eval()


@pytest.fixture(scope="module")
def ref_model():
    return tiny_model("sdpa")


def fp_model(config, dense_layers=0):
    model = tiny_model("sdpa")
    rt = install_flashprefill(model, FlashPrefillRuntime(config=config, dense_layers=dense_layers))
    assert model.config._attn_implementation == ATTN_NAME
    return model, rt


def ids(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


@torch.inference_mode()
@pytest.mark.parametrize("n", [1, 77, 300])
def test_keep_all_matches_sdpa(ref_model, n):
    model, rt = fp_model(KEEP_ALL)
    x = ids(n)
    want = ref_model(x).logits
    got = model(x).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    if n > 1:
        assert sorted(rt.layers) == [0, 1] and all(s.sparse and s.density == 1.0 for s in rt.summary(LAYERS))


@torch.inference_mode()
def test_dense_layers_and_chunk_after_prefix(ref_model):
    """Prefill 200 tokens, then a 130-token chunk (P = 200) through the cache: the operator's
    bottom-right causal alignment must match SDPA on the whole sequence."""
    from transformers import DynamicCache

    from fpcli.engine.transformers_engine import cache_argument

    model, rt = fp_model(KEEP_ALL, dense_layers=1)
    x = ids(330)
    want = ref_model(x).logits[:, 200:]
    cache = {cache_argument(model): DynamicCache()}  # past_key_values on transformers 5.12 (the GPU's)
    model(x[:, :200], use_cache=True, **cache)
    rt.reset()
    got = model(x[:, 200:], use_cache=True, **cache).logits
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert not rt.layers[0].sparse and rt.layers[1].sparse
    assert (rt.layers[1].q_len, rt.layers[1].kv_len) == (130, 330)


@torch.inference_mode()
def test_a_set_of_dense_layers_need_not_start_at_layer_0(ref_model):
    """``dense_layers=(1,)``: layer 1 dense and layer 0 sparse (not "the first N"); the logits
    still match SDPA with a config that keeps every block."""
    model, rt = fp_model(KEEP_ALL, dense_layers=(1,))
    x = ids(300)
    torch.testing.assert_close(model(x).logits, ref_model(x).logits, atol=2e-4, rtol=1e-4)
    assert [s.sparse for s in rt.summary(LAYERS)] == [True, False]


@torch.inference_mode()
def test_sparse_config_is_sparse_and_finite(ref_model):
    model, rt = fp_model(SPARSE, dense_layers=1)
    x = ids(1100)
    logits = model(x).logits
    assert torch.isfinite(logits).all()
    stats = prefill_stats(rt.summary(LAYERS))
    assert stats.density_per_layer[0] == 1.0  # the dense layer
    assert 0.0 < stats.density_per_layer[1] < 1.0
    assert stats.density == pytest.approx(stats.density_per_layer[1])
    assert len(stats.density_per_layer_head) == LAYERS and len(stats.density_per_layer_head[1]) == HKV
    assert all(0.0 < h <= 1.0 for h in stats.density_per_layer_head[1])
    dense_flops = causal_attention_flops(1100, 1100, D, HQ)
    assert stats.attention_flops_dense == pytest.approx(LAYERS * dense_flops)
    assert stats.attention_flops_skipped == pytest.approx(dense_flops * (1 - stats.density_per_layer[1]))
    assert stats.index_ms is None and stats.attention_ms is None  # timing is off unless asked for
    # Sparse, yet close to the dense model: the window, sink, dense tail and mean correction.
    want = ref_model(x).logits
    assert (logits[0, -1].argmax() == want[0, -1].argmax()) or torch.allclose(logits[0, -1], want[0, -1], atol=0.5)


def test_attention_function_mask_batch1_ignored_padded_batch_rejected():
    """A boolean causal mask (never all True) at batch 1 is ignored: the function masks itself."""
    from flashprefill.integrations.transformers import flashprefill_attention_forward

    module = torch.nn.Module()
    module.layer_idx = 0
    module.fp_runtime = FlashPrefillRuntime(config=KEEP_ALL, timing=False)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, HQ, 70, D, generator=g)
    k = torch.randn(1, HKV, 70, D, generator=g)
    v = torch.randn(1, HKV, 70, D, generator=g)
    causal = torch.ones(70, 70, dtype=torch.bool).tril()[None, None]
    with_mask, _ = flashprefill_attention_forward(module, q, k, v, causal, scaling=D ** -0.5)
    without, _ = flashprefill_attention_forward(module, q, k, v, None, scaling=D ** -0.5)
    torch.testing.assert_close(with_mask, without)
    assert module.fp_runtime.layers[0].sparse
    with pytest.raises(ValueError, match="padded batches are not supported: batch size 1 only, got 2"):
        flashprefill_attention_forward(module, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                       v.expand(2, -1, -1, -1), causal.expand(2, -1, -1, -1), scaling=D ** -0.5)


def test_flops_formula():
    # 4 * d * Hq * sum_{t < Lq} (P + t + 1)
    assert causal_attention_flops(3, 5, 2, 1) == 4 * 2 * 1 * (3 + 4 + 5)
    assert causal_attention_flops(2048, 2048, 64, 9) == pytest.approx(4 * 64 * 9 * 2048 * 2049 / 2)


# ---------------------------------------------------------------------------------------------
# The engine on a saved folder with a word-level tokenizer and a chat template


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-chat-llama")
    special = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(special + ["system", "user", "assistant"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    tiny_model("sdpa").save_pretrained(path)
    return path


def profile(name, **op):
    p = load_profile(name)
    if op:
        p = dataclasses.replace(p, sparse=p.sparse.replace(**op))
    return p


def test_engine_contract(model_dir):
    prof = profile("bf16", block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64, alpha=1.0)
    with TransformersEngine(model_dir, prof, model_name="tiny") as eng:
        assert (eng.name, eng.model_name, eng.context_length) == ("transformers", "tiny", 4096)
        assert eng.dtype == torch.float32
        assert eng.count_tokens("w1 w2 w3") == 3
        prompt = eng.encode_chat("w7 w8", "w5 w6")
        assert eng.tokenizer.decode(prompt).split() == "<|im_start|> system w7 w8 <|im_end|> <|im_start|> user w5 w6 <|im_end|> <|im_start|> assistant".split()
        user = " ".join(WORDS[i % 200] for i in range(1000))
        pieces: list[str] = []
        r = eng.generate(eng.encode_chat(None, user), max_new_tokens=6, on_text=pieces.append)
        assert r.prompt_tokens == 1000 + 5 and 1 <= r.output_tokens <= 6
        assert "".join(pieces) == r.text
        assert 0 < r.ttft_s <= r.total_s and 0 < r.prefill_s <= r.ttft_s
        assert (r.engine, r.model, r.profile) == ("transformers", "tiny", "bf16")
        s = r.stats
        assert len(s.density_per_layer) == LAYERS and s.density_per_layer[:2] == [1.0, 1.0]  # dense_layers: 2
        assert s.attention_flops_dense > 0 and s.attention_flops_skipped == 0.0
        json.dumps(r.to_dict())
        sampled = eng.generate(prompt, max_new_tokens=4, temperature=1.0)
        assert 1 <= sampled.output_tokens <= 4 or sampled.finish_reason == "stop"
    assert eng.model is None  # closed


def test_engine_sparse_layers_report_density(model_dir):
    prof = dataclasses.replace(profile("bf16", block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64,
                                       alpha=1.0, min_sparse_len=0), dense_layers=0)  # bf16 has 8192: ~1K would run dense
    with TransformersEngine(model_dir, prof) as eng:
        r = eng.generate(eng.encode_chat(None, " ".join(WORDS * 5)), max_new_tokens=2)
    assert r.stats.density < 1.0 and r.stats.attention_flops_skipped > 0
    assert all(len(h) == HKV for h in r.stats.density_per_layer_head)
    # the CPU reference computes every block: the summary's skipped FLOPs say they saved no time
    import io

    from rich.console import Console

    from fpcli.report import ask_report, render_summary

    assert r.device == "cpu"
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=200, soft_wrap=True), ask_report(r, "q?", [], None, prof))
    row = [line for line in buf.getvalue().splitlines() if line.startswith("attention FLOPs skipped")]
    assert len(row) == 1 and row[0].endswith("(CPU reference: no time saved)"), row


def test_engine_greedy_matches_transformers_generate(model_dir):
    from transformers import AutoModelForCausalLM

    with TransformersEngine(model_dir, load_profile("dense")) as eng:
        prompt = eng.encode_chat(None, " ".join(WORDS[:50]))
        r = eng.generate(prompt, max_new_tokens=8)
        assert r.stats.density == 1.0 and r.stats.density_per_layer == [1.0] * LAYERS
        ref = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=sorted(eng.eos_ids),
                           pad_token_id=0)
        want = eng.tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    assert r.text == want


def test_engine_rejects_overlong_prompt(model_dir):
    prof = dataclasses.replace(load_profile("dense"),
                               engine=dataclasses.replace(load_profile("dense").engine, context_length=256))
    with TransformersEngine(model_dir, prof) as eng:
        assert eng.context_length == 256
        with pytest.raises(ValueError, match="fills the context"):
            eng.generate([5] * 256)


# ---------------------------------------------------------------------------------------------
# load_engine


def test_load_engine_choices(model_dir, monkeypatch):
    import fpcli.engine as engine_mod

    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        engine_mod.load_engine("tpu")
    monkeypatch.setattr(engine_mod, "_sglang_missing", lambda: "sglang is not installed")
    with pytest.raises(engine_mod.EngineUnavailable, match=r"pip install -e \.\[gpu\].*--engine transformers"):
        engine_mod.load_engine("sglang", model=str(model_dir))
    assert engine_mod.available_engines() == ["transformers"]
    with engine_mod.load_engine("auto", model=str(model_dir), profile="dense", progress=False) as eng:
        assert eng.name == "transformers" and eng.model_name == model_dir.name
        assert eng.profile.name == "dense"


def test_runtime_stats_density_over_sparse_layers_flops_over_all():
    from flashprefill.integrations.transformers import LayerSummary

    f = causal_attention_flops(256, 256, D, HQ)
    rows = [LayerSummary(0, False, 256, 256, f, 1.0, (1.0, 1.0)),
            LayerSummary(1, True, 256, 256, f, 0.5, (0.4, 0.6), 10, 20),
            LayerSummary(2, True, 256, 256, f, 0.7, (0.7, 0.7), 21, 30)]
    st = prefill_stats(rows)
    assert st.sparse_layers == [1, 2]
    assert st.density == pytest.approx(31 / 50)  # selected / visible over the sparse layers only
    assert st.attention_flops_skipped / st.attention_flops_dense == pytest.approx((0.5 + 0.3) / 3)
    assert st.index_ms is None and st.attention_ms is None


@torch.inference_mode()
def test_engine_stats_come_from_the_index_the_attention_used(monkeypatch):
    """One path: each sparse layer calls ``flashprefill_attention(..., return_index=True)`` once, and
    the layer's statistics equal ``SparseStats.from_index`` of the index it returned."""
    import flashprefill.integrations.transformers as integ
    from flashprefill import SparseStats

    used, calls = [], []
    real = integ.flashprefill_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("return_index"))
        out, index = real(*args, **kwargs)
        used.append(index)
        return out, index

    monkeypatch.setattr(integ, "flashprefill_attention", spy)
    monkeypatch.setattr(integ, "build_index", lambda *a, **k: pytest.fail("build_index called with timing off"))
    model, rt = fp_model(SPARSE, dense_layers=0)
    model(ids(1100))
    rows = rt.summary(LAYERS)
    assert calls == [True] * LAYERS and len(used) == LAYERS
    for row, index in zip(rows, used):
        want = SparseStats.from_index(index)
        assert row.sparse and 0.0 < row.density < 1.0
        assert (row.selected_blocks, row.visible_blocks) == (want.selected_blocks, want.visible_blocks)
        assert row.density == pytest.approx(want.density)
        assert list(row.density_per_kv_head) == pytest.approx(want.density_per_kv_head.tolist())
    stats = prefill_stats(rows)
    sel = sum(SparseStats.from_index(i).selected_blocks for i in used)
    vis = sum(SparseStats.from_index(i).visible_blocks for i in used)
    assert stats.density == pytest.approx(sel / vis)


@torch.inference_mode()
def test_timing_is_measured_only_when_asked_for():
    model, rt = fp_model(SPARSE, dense_layers=1)
    rt.timing = True
    model(ids(1100))
    rows = rt.summary(LAYERS)
    assert rows[0].index_ms is None and rows[0].attention_ms > 0  # a dense layer: no index stage
    assert rows[1].index_ms > 0 and rows[1].attention_ms > 0
    rt.reset()
    rt.timing = False
    model(ids(1100))
    assert all(r.index_ms is None and r.attention_ms is None for r in rt.summary(LAYERS))


@torch.inference_mode()
def test_stage_times_per_sparse_layer_sum_to_the_totals():
    """Timed, ``prefill_stats`` has one index and one attention time per sparse layer, in
    ``sparse_layers`` order, and the totals are their sums: the dense layer's SDPA is in neither
    (it diluted the index share); a prefill with no sparse layer keeps its attention total."""
    model, rt = fp_model(SPARSE, dense_layers=1)
    rt.timing = True
    model(ids(1100))
    rows = rt.summary(LAYERS)
    stats = prefill_stats(rows)
    assert stats.sparse_layers == [1]
    assert stats.index_ms_per_layer == [rows[1].index_ms] and stats.attention_ms_per_layer == [rows[1].attention_ms]
    assert stats.index_ms == sum(stats.index_ms_per_layer) and stats.attention_ms == sum(stats.attention_ms_per_layer)
    assert rows[0].attention_ms > 0 and stats.attention_ms == rows[1].attention_ms   # layer 0 (dense): not in it

    model, rt = fp_model(None)                         # dense everywhere: no index stage, no per-layer lists
    rt.timing = True
    model(ids(300))
    rows = rt.summary(LAYERS)
    stats = prefill_stats(rows)
    assert stats.index_ms is None and stats.index_ms_per_layer == [] and stats.attention_ms_per_layer == []
    assert stats.attention_ms == pytest.approx(rows[0].attention_ms + rows[1].attention_ms) and stats.attention_ms > 0


@torch.inference_mode()
def test_stage_marks_enclose_the_operator_only(monkeypatch):
    """In a sparse layer the marks enclose ``build_index`` (index) and ``flashprefill_attention``
    (attention); the copies into pages and the plan (with its host sync) come before the first mark:
    the index time counted them on the H200 (``fp profile``: "index 77%")."""
    import flashprefill.integrations.transformers as integ

    order = []

    def spy(name, fn):
        def wrapped(*a, **k):
            order.append(name)
            return fn(*a, **k)
        return wrapped

    for name in ("_paged", "make_plan", "build_index", "flashprefill_attention"):
        monkeypatch.setattr(integ, name, spy(name, getattr(integ, name)))
    real_mark = FlashPrefillRuntime.mark
    monkeypatch.setattr(FlashPrefillRuntime, "mark", lambda self, dev: (order.append("mark"), real_mark(self, dev))[1])
    model, rt = fp_model(SPARSE, dense_layers=0)
    rt.timing = True
    model(ids(1100))
    first = order[:order.index("mark", order.index("flashprefill_attention")) + 1]     # layer 0
    assert first == ["_paged", "_paged", "make_plan", "mark", "build_index", "mark", "flashprefill_attention", "mark"]
    second = order[len(first):]                                                          # layer 1
    assert second == ["_paged", "_paged", "mark", "build_index", "mark", "flashprefill_attention", "mark"]  # plan reused


def test_engine_times_every_sparse_layer(model_dir):
    """The engine with ``timing`` (what ``fp profile`` asks for) reports the per-layer lists, one per
    sparse layer, summing to the totals; without it, none."""
    prof = dataclasses.replace(profile("bf16", block_size=64, sink_tokens=64, window_tokens=64, dense_tail_tokens=64,
                                       alpha=1.0, min_sparse_len=0), dense_layers=0)
    prompt_words = " ".join(WORDS * 5)
    with TransformersEngine(model_dir, prof, timing=True) as eng:
        s = eng.generate(eng.encode_chat(None, prompt_words), max_new_tokens=1).stats
    assert s.sparse_layers == list(range(LAYERS))
    assert len(s.index_ms_per_layer) == len(s.attention_ms_per_layer) == LAYERS
    assert all(x > 0 for x in s.index_ms_per_layer + s.attention_ms_per_layer)
    assert s.index_ms == pytest.approx(sum(s.index_ms_per_layer))
    assert s.attention_ms == pytest.approx(sum(s.attention_ms_per_layer))
    with TransformersEngine(model_dir, prof) as eng:
        s = eng.generate(eng.encode_chat(None, prompt_words), max_new_tokens=1).stats
    assert s.index_ms_per_layer == [] and s.attention_ms_per_layer == [] and s.index_ms is None


def test_engine_reports_the_precision_that_ran(model_dir):
    prof = load_profile("fp8")  # FP8 in the sparse layers; a short prompt runs none of them sparse
    with TransformersEngine(model_dir, prof) as eng:
        assert eng.precision == "fp8 (sparse layers)" and eng.model_precision == "fp32"
        r = eng.generate(eng.encode_chat(None, "w1 w2 w3"), max_new_tokens=1)
    assert r.precision == "fp32" and r.to_dict()["precision"] == "fp32"  # below min_sparse_len: all SDPA
    with TransformersEngine(model_dir, dataclasses.replace(prof, sparse=dataclasses.replace(prof.sparse, min_sparse_len=0),
                                                           dense_layers=1)) as eng:
        user = " ".join(WORDS[i % 200] for i in range(400))
        r = eng.generate(eng.encode_chat(None, user), max_new_tokens=1)
    assert r.precision == "fp8 (sparse layers)" and r.stats.sparse_layers == [1]
    assert r.stats.fp8_rel_l2_per_layer == []  # not asked to compare


@torch.inference_mode()
def test_fp8_runtime_runs_fp8_and_reports_its_error_against_bf16():
    model, rt = fp_model(SPARSE, dense_layers=1)
    x = ids(1100)
    bf16 = model(x).logits
    assert [r.precision for r in rt.summary(LAYERS)] == [None, "bf16"]
    rt.reset()
    rt.precision, rt.compare_fp8 = "fp8", True
    fp8 = model(x).logits
    rows = rt.summary(LAYERS)
    assert [r.precision for r in rows] == [None, "fp8"]
    assert rows[0].fp8_rel_l2 is None and rows[0].fp8_rel_l2_per_kv_head is None  # dense layer: SDPA
    assert 0.0 < rows[1].fp8_rel_l2 < 0.5 and len(rows[1].fp8_rel_l2_per_kv_head) == HKV
    assert all(0.0 < e < 0.5 for e in rows[1].fp8_rel_l2_per_kv_head)
    assert torch.isfinite(fp8).all() and not torch.equal(fp8, bf16)  # FP8 operands really ran
    # the model's output is the FP8 one: the comparison does not change it
    rt.reset()
    rt.compare_fp8 = False
    assert torch.equal(model(x).logits, fp8) and rt.summary(LAYERS)[1].fp8_rel_l2 is None
    stats = prefill_stats(rows)
    assert stats.fp8_rel_l2_per_layer == [None, rows[1].fp8_rel_l2]
    assert stats.fp8_rel_l2_per_layer_head == [[], list(rows[1].fp8_rel_l2_per_kv_head)]


def test_fp8_error_sums_per_request_and_kv_head():
    from flashprefill.integrations.fp8_error import fp8_error_sums, layer_rel_l2, rel_l2

    g = torch.Generator().manual_seed(3)
    ref = torch.randn(5, 4, 8, generator=g)  # 5 tokens, Hq 4, Hkv 2
    out = ref.clone()
    out[3:, 2:] += 0.5  # request 1 (tokens 3, 4), KV head 1 (query heads 2, 3) only
    sums = fp8_error_sums(out, ref, 2, torch.tensor([0, 0, 0, 1, 1]), batch=2)
    assert sums.shape == (2, 2, 2) and sums.dtype == torch.float64
    assert sums[0, 0].tolist() == [0.0, 0.0] and sums[0, 1, 0] == 0.0
    assert sums[0, 1, 1].item() == pytest.approx(2 * 2 * 8 * 0.25)
    assert sums[1, 1, 1].item() == pytest.approx(ref[3:, 2:].double().square().sum().item())
    err = rel_l2(sums[0, 1].tolist(), sums[1, 1].tolist())
    assert err[0] == 0.0 and err[1] == pytest.approx(8 ** 0.5 / ref[3:, 2:].double().norm().item())
    assert layer_rel_l2([1.0, 3.0], [4.0, 12.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="multiple"):
        fp8_error_sums(out, ref, 3)


def test_fp8_profile_refused_before_work_on_a_gpu_without_fp8(monkeypatch):
    from fpcli.engine.base import check_fp8_profile

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"profile fp8 .*A100.*8\.0.*bf16 profile would run"):
        check_fp8_profile(load_profile("fp8"), torch.device("cuda", 0), 128)
    check_fp8_profile(load_profile("bf16"), torch.device("cuda", 0), 128)  # bf16: nothing to check
    check_fp8_profile(load_profile("fp8"), torch.device("cpu"), 96)  # the reference runs FP8 anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"head_dim .*d = 96.*bf16 profile would run"):
        check_fp8_profile(load_profile("fp8"), torch.device("cuda", 0), 96)
    check_fp8_profile(load_profile("fp8"), torch.device("cuda", 0), 128)


def test_engine_stops_when_on_text_raises(model_dir):
    """A client that goes away (the resident engine's on_text raises) stops the generation before
    the next decode step, and the exception reaches the caller."""

    class Cancelled(Exception):
        pass

    with TransformersEngine(model_dir, profile("dense"), model_name="tiny") as eng:
        user = " ".join(WORDS[i % 200] for i in range(1000))
        prompt = eng.encode_chat(None, user)
        assert eng.generate(prompt, max_new_tokens=6).output_tokens >= 2  # it would go on
        forwards = []
        real = eng.model.forward
        eng.model.forward = lambda *a, **k: forwards.append(1) or real(*a, **k)
        pieces = []

        def on_text(piece):
            pieces.append(piece)
            raise Cancelled

        with pytest.raises(Cancelled):
            eng.generate(prompt, max_new_tokens=6, on_text=on_text)
        assert len(pieces) == 1 and len(forwards) == 1  # the prefill only, no decode step after it


def test_engine_stops_in_the_prefill_when_on_progress_raises(model_dir):
    """A cancel seen at a prefill step (the resident engine's on_progress raises) stops the prefill
    at that layer, before any decode step; the exception reaches the caller and the engine answers
    the next request from a clean cache."""

    class Cancelled(Exception):
        pass

    with TransformersEngine(model_dir, profile("dense"), model_name="tiny") as eng:
        prompt = eng.encode_chat(None, " ".join(WORDS[i % 200] for i in range(300)))
        assert eng.n_layers >= 2  # (no earlier request: a repeated prompt would prefill one token)
        steps, pieces = [], []

        def on_progress(done, total):
            steps.append((done, total))
            raise Cancelled

        with pytest.raises(Cancelled):
            eng.generate(prompt, max_new_tokens=4, on_text=pieces.append, on_progress=on_progress)
        assert steps == [(1, eng.n_layers)] and pieces == []  # the first layer's prefill, no decode step
        after = eng.generate(prompt, max_new_tokens=4)  # no half-filled cache kept from the cancelled prefill
        assert after.cached_tokens == 0 and after.prompt_tokens == len(prompt) and after.output_tokens >= 1


def test_dense_profile_reports_dense_equivalent_flops(model_dir):
    """The dense profile skips nothing, but its dense-equivalent FLOPs are known and reported
    (the summary printed "0 of 0 dense-equivalent")."""
    import io

    from rich.console import Console

    from flashprefill.flops import dense_causal_flops as formula
    from fpcli.report import ask_report, render_summary

    prof = load_profile("dense")
    with TransformersEngine(model_dir, prof) as eng:
        prompt = eng.encode_chat(None, " ".join(WORDS[:300]))
        r = eng.generate(prompt, max_new_tokens=2)
    n = len(prompt)
    assert r.stats.attention_flops_dense == pytest.approx(LAYERS * formula(n, n, D, HQ))
    assert r.stats.attention_flops_skipped == 0.0
    buf = io.StringIO()
    render_summary(Console(file=buf, force_terminal=False, width=300), ask_report(r, "q?", [], None, prof))
    line = next(x for x in buf.getvalue().splitlines() if x.startswith("attention FLOPs skipped"))
    assert " of 0 " not in line and "MFLOP dense-equivalent" in line


def test_sglang_dense_profile_stats_from_the_model_config(model_dir):
    """The SGLang engine records nothing per layer with the dense profile (stock attention); its
    stats come from the model's config with the same FLOP formula."""
    from flashprefill.flops import dense_causal_flops as formula
    from fpcli.engine.sglang_engine import SGLangEngine

    eng = SGLangEngine.__new__(SGLangEngine)  # no server: only the config-reading helper runs
    eng.model_path = str(model_dir)
    st = eng._dense_stats(1000)
    assert st.attention_flops_dense == pytest.approx(LAYERS * formula(1000, 1000, D, HQ))
    assert st.density_per_layer_head == [[1.0] * HKV] * LAYERS and st.density == 1.0


@torch.inference_mode()
@pytest.mark.parametrize("lk", [1, 37, 300])
def test_decode_attention_equals_expanded_kv(lk):
    """Decode attention without expanding K/V (one SDPA call with enable_gqa, no mask) equals SDPA on
    K/V expanded to Hq heads with repeat_interleave, with K/V given as the reserved KV cache gives
    them (views of a longer buffer: head stride ``capacity * d``)."""
    from flashprefill.integrations.transformers import _sdpa

    g = torch.Generator().manual_seed(lk)
    q = torch.randn(1, HQ, 1, D, generator=g)
    k = (torch.randn(1, HKV, lk + 9, D, generator=g) * 3)[:, :, :lk]
    v = torch.randn(1, HKV, lk + 9, D, generator=g)[:, :, :lk]
    assert not k.is_contiguous()
    groups = HQ // HKV
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), scale=0.2).transpose(1, 2)
    got = _sdpa(q, k, v, 0.2, groups)
    assert got.shape == (1, 1, HQ, D)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and a prefill chunk after a prefix (enable_gqa) against the expanded path
    q2 = torch.randn(1, HQ, 5, D, generator=g)
    if lk >= 5:
        pos = torch.arange(lk)
        mask = pos[None, :] <= (lk - 5 + torch.arange(5))[:, None]
        want2 = torch.nn.functional.scaled_dot_product_attention(
            q2, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask,
            scale=0.2).transpose(1, 2)
        torch.testing.assert_close(_sdpa(q2, k, v, 0.2, groups), want2, rtol=1e-5, atol=1e-5)


def test_load_engine_fits_the_sparse_threshold_to_the_model(model_dir):
    """bf16's min_sparse_len 8192 on a 4096-token model: the engine runs 2048 (half the context)."""
    import fpcli.engine as engine_mod

    with engine_mod.load_engine("transformers", model=str(model_dir), profile="bf16", progress=False) as eng:
        assert eng.context_length == 4096
        assert eng.profile.sparse.min_sparse_len == 2048 and eng.runtime.config.min_sparse_len == 2048


@torch.inference_mode()
def test_chunk_after_prefix_attends_in_bounded_row_chunks(monkeypatch):
    """A dense chunk after a cached prefix never builds an ``[Lq, Lk]`` mask (at 128K on a GPU:
    60K new tokens after a 70K prefix would be 8.4 GB of mask, and the math kernel's scores
    ``Hq`` times that in float32): each masked SDPA call covers at most ``MASK_ELEMENTS`` entries,
    and the rows together equal the bottom-right causal attention over the whole chunk."""
    import flashprefill.integrations.transformers as fpt

    g = torch.Generator().manual_seed(7)
    lq, lk, groups = 45, 100, HQ // HKV
    q = torch.randn(1, HQ, lq, D, generator=g)
    k = torch.randn(1, HKV, lk, D, generator=g) * 3
    v = torch.randn(1, HKV, lk, D, generator=g)
    pos = torch.arange(lk)
    full = pos[None, :] <= (lk - lq + torch.arange(lq))[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=full,
        scale=0.2).transpose(1, 2)
    real = torch.nn.functional.scaled_dot_product_attention
    masks = []

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(None if attn_mask is None else attn_mask.numel())
        return real(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(fpt, "MASK_ELEMENTS", 10 * lk)  # 10 rows per call
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    got = fpt._sdpa(q, k, v, 0.2, groups)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(masks) == 5 and all(m is not None and m <= 10 * lk for m in masks), masks


@torch.inference_mode()
def test_engine_prefill_and_decode_get_no_causal_mask_from_transformers(model_dir):
    """transformers builds no ``[L, L]`` causal mask for the flashprefill attention function (at
    131,072 tokens one would be 17 GB): every call, prefill and decode, receives
    ``attention_mask=None``. Would fail if a mask function were registered for ``ATTN_NAME`` or the
    engine passed a padding mask."""
    from transformers import AttentionInterface

    import flashprefill.integrations.transformers as fpt

    seen = []

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        seen.append((query.shape[2], attention_mask))
        return fpt.flashprefill_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    with TransformersEngine(model_dir, load_profile("bf16"), model_name="tiny") as eng:
        AttentionInterface.register(ATTN_NAME, spy)  # looked up by name at every attention call
        try:
            res = eng.generate(eng.encode_chat(None, " ".join(WORDS[:150])), max_new_tokens=3)
        finally:
            fpt.register_attention()
    assert any(lq > 100 for lq, _ in seen)  # the prefill
    assert any(lq == 1 for lq, _ in seen) == (res.output_tokens > 1)  # decode steps after the first token
    assert all(mask is None for _, mask in seen), [(lq, tuple(m.shape)) for lq, m in seen if m is not None]


def test_weights_load_onto_the_gpu_where_transformers_can_place_them(monkeypatch):
    import transformers.utils

    from fpcli.engine.transformers_engine import weights_placement

    assert weights_placement(torch.device("cpu")) == {}
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: True)
    assert weights_placement(cuda) == {"device_map": cuda}
    monkeypatch.setattr(transformers.utils, "is_accelerate_available", lambda: False)
    assert weights_placement(cuda) == {}
