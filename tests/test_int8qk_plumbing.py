"""The ``int8qk`` precision through the product (CPU): profiles and ``NAME+int8qk``, the BF16 twin,
the engines' gate and the e4m3-cache refusal, the SGLang backend settings, what the reports say.

Plumbing only: the fake engine stands in for the model where a command is run (it takes the
profile's precision as the real engines do), and no test here calls the int8qk operator. The
end-to-end test with the real operator is ``test_e2e_cpu.py::test_fp_profile_8bit_reports_its_
error_per_layer`` (its ``int8qk`` case).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fp_fakes import FakeEngine, invoke
from fpcli.cli import app
from fpcli.engine.base import check_fp8_profile, eight_bit, precision_label, ran_precision
from fpcli.profiles import (ProfileError, bf16_twin, load_profile, precision_twins, profile_from_dict,
                            with_precision)


# -- profiles ------------------------------------------------------------------------------------
def test_a_profile_asks_for_int8qk_and_name_plus_int8qk_is_its_twin(tmp_path):
    p = profile_from_dict({"name": "mine", "precision": "int8qk", "dense_layers": 3})
    assert (p.precision, p.dense_layers) == ("int8qk", 3)
    acc = load_profile("accurate+int8qk")
    assert (acc.name, acc.precision) == ("accurate+int8qk", "int8qk")
    assert acc.replace(precision="bf16", name="accurate") == load_profile("accurate")  # nothing else changed
    # the built-in bf16 / fp8 have no int8qk built-in: their twin is bf16+int8qk, whichever asked
    assert with_precision(load_profile("bf16"), "int8qk") == with_precision(load_profile("fp8"), "int8qk")
    assert load_profile("fp8+int8qk").name == load_profile("bf16+int8qk").name == "bf16+int8qk"
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\ndense_layers: 3\n")
    assert (load_profile(f"{mine}+int8qk").name, load_profile(f"{mine}+int8qk").precision) == ("mine+int8qk", "int8qk")
    with pytest.raises(ProfileError, match=r"precision: 'int4' is not allowed \(allowed: bf16, fp8, int8qk\)"):
        profile_from_dict({"name": "x", "precision": "int4"})
    with pytest.raises(ProfileError, match=r"unknown profile 'accurate\+int4' .*NAME\+int8qk"):
        load_profile("accurate+int4")


def test_an_int8qk_profile_pairs_with_its_bf16_twin_like_fp8():
    acc, acc8, acc_i = load_profile("accurate"), load_profile("accurate+fp8"), load_profile("accurate+int8qk")
    dense, bf16 = load_profile("dense"), load_profile("bf16")
    assert precision_twins(acc, acc_i) and precision_twins(acc8, acc_i)  # one profile at three precisions
    assert bf16_twin(acc_i, [dense, bf16, acc8, acc]) is acc  # the BF16 one, never the FP8 one
    assert bf16_twin(load_profile("bf16+int8qk"), [acc, bf16]) is bf16
    assert bf16_twin(acc_i, [dense, acc8]) is None and bf16_twin(acc, [acc]) is None  # no twin; not 8-bit


# -- engines -------------------------------------------------------------------------------------
def test_eight_bit_precisions_and_what_ran():
    assert [eight_bit(p) for p in ("fp8", "int8qk", "bf16", "int8qk (sparse layers)", "fp32")] == \
        [True, True, False, True, False]
    assert ran_precision("bf16", 3, "int8qk") == "int8qk (sparse layers)" and ran_precision("fp32", 0, "int8qk") == "fp32"
    with pytest.raises(ValueError, match="'bf16' is not one of"):
        ran_precision("bf16", 2, "bf16")
    assert (precision_label("int8qk"), precision_label("fp8")) == ("int8qk", "FP8")


def test_int8qk_is_refused_on_a_gpu_without_fp8_tensor_cores(monkeypatch):
    """int8qk runs the 8-bit kernels: the FP8 gate (check_fp8_support) applies, before any work."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"profile accurate\+int8qk asks for int8qk attention.*A100.*--profile bf16"):
        check_fp8_profile(load_profile("accurate+int8qk"), torch.device("cuda", 0), 128)
    check_fp8_profile(load_profile("accurate+int8qk"), torch.device("cpu"), 96)  # the reference runs it anywhere
    check_fp8_profile(load_profile("dense+int8qk"), torch.device("cuda", 0), 128)  # dense: no sparse prefill


def test_the_sglang_engine_refuses_int8qk_with_an_e4m3_kv_cache():
    from fpcli.engine.sglang_engine import check_kv_cache_precision

    with pytest.raises(ValueError, match=r"profile accurate\+int8qk asks for int8qk attention, which needs a 16-bit "
                                         r"KV cache .*--kv-cache-dtype fp8_e4m3 stores e4m3, which only fp8 reads"):
        check_kv_cache_precision(load_profile("accurate+int8qk"), "fp8_e4m3")
    for name, kv in [("fp8", "fp8_e4m3"), ("bf16", "fp8_e4m3"), ("dense+int8qk", "fp8_e4m3"),
                     ("accurate+int8qk", None), ("accurate+int8qk", "auto"), ("accurate+int8qk", "bf16")]:
        check_kv_cache_precision(load_profile(name), kv)  # fp8 reads e4m3; bf16 runs such layers dense


def test_backend_settings_carry_int8qk_to_the_scheduler(tmp_path):
    from flashprefill.integrations.sglang.settings import BackendSettings
    from fpcli.engine.sglang_engine import backend_settings

    s = backend_settings(load_profile("accurate+int8qk"), str(tmp_path), compare_fp8=True)
    assert s.precision == "int8qk" and s.compare_fp8 and s.dense_layers == 12
    assert json.loads(s.to_json())["precision"] == "int8qk" and s.to_dict()["precision"] == "int8qk"
    assert BackendSettings.from_json(s.to_json()) == s and BackendSettings.from_env(s.to_env()) == s
    assert BackendSettings.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'fp8', 'int8qk'\), got 'int4'"):
        BackendSettings(precision="int4")


def test_the_schedulers_int8qk_layers_are_what_the_request_ran():
    from flashprefill.integrations.sglang.stats_reader import aggregate
    from flashprefill.integrations.sglang.stats_writer import BatchStats
    from flashprefill.plan import make_plan
    from fpcli.engine.sglang_engine import ran_precision_of

    plan = make_plan(torch.tensor([300], dtype=torch.int32), torch.tensor([0, 300], dtype=torch.int32), 2, 128)
    st = BatchStats(num_layers=2, layer_offset=0, num_q_heads=4, num_kv_heads=2, head_dim=64, q_lens=[300],
                    kv_lens=[300], rids=["r1"], device="cpu", plan=plan)
    st.mark_dense(0, "dense_layers")
    st.add_index(1, None, precision="int8qk")
    st.finish()
    req = aggregate(st.records(), "r1")
    assert req.precision == [None, "int8qk"] and ran_precision_of(req, "bf16") == "int8qk (sparse layers)"


# -- reports -------------------------------------------------------------------------------------
def test_ask_reports_int8qk_only_when_it_ran(runner, fake_engine, doc, monkeypatch):
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "accurate+int8qk", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)["summary"]
    assert (s["precision"], s["precision_requested"]) == ("int8qk (sparse layers)", "int8qk")
    assert "warning" not in r.stderr
    real = FakeEngine.generate  # a prefill in which no layer ran sparse ran at the model's dtype
    monkeypatch.setattr(FakeEngine, "generate", lambda self, *a, **k: dataclasses.replace(real(self, *a, **k), precision="bf16"))
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "accurate+int8qk"])
    assert "bf16; int8qk requested, int8qk runs in sparse layers only and none ran sparse" in " ".join(r.stderr.split())


def test_a_dense_profile_at_int8qk_warns_that_int8qk_does_not_run(runner, fake_engine, doc):
    r = invoke(runner, ["ask", str(doc), "q?", "--profile", "dense+int8qk"])
    err = " ".join(r.stderr.split())
    assert r.exit_code == 0 and "warning: int8qk attention was requested (profile dense+int8qk) but int8qk applies " \
        "to the sparse prefill and this profile is dense" in err


def test_profile_int8qk_reports_the_int8qk_error_against_bf16(runner, fake_engine, doc, tmp_path, monkeypatch):
    real = FakeEngine.stats_for

    def richer(self, n):
        s = real(self, n)
        s.fp8_rel_l2_per_layer = [None, 2e-3, 3e-3, 4e-3]  # the shape the real engines report
        s.fp8_rel_l2_per_layer_head = [[], [2e-3, 2.5e-3], [3e-3, 3e-3], [4e-3, 4.5e-3]]
        return s

    monkeypatch.setattr(FakeEngine, "stats_for", richer)
    r = invoke(runner, ["profile", str(doc), "--int8qk", "--png", str(tmp_path / "h.png")])
    assert r.exit_code == 0, r.output
    assert "int8qk-vs-BF16 attention output error per layer" in r.stdout and "FP8" not in r.stdout
    assert fake_engine().requested["profile"].name == "bf16+int8qk" and fake_engine().load_kwargs.get("compare_fp8") is True
    assert (tmp_path / "h.int8qk.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "h.fp8.png").exists()
    assert "int8qk error heatmap written to" in r.stderr
    r = invoke(runner, ["profile", str(doc), "--int8qk", "--json", "-p", "accurate", "--png", str(tmp_path / "h.png")])
    data = json.loads(r.stdout)
    assert data["profile"] == "accurate+int8qk" and data["precision"] == "int8qk (sparse layers)"
    assert data["png_fp8"] == str(tmp_path / "h.int8qk.png")
    r = invoke(runner, ["profile", str(doc), "--int8qk", "--fp8"])
    assert r.exit_code == 2 and "--fp8 and --int8qk: give one" in r.stderr


def test_eval_runs_a_profile_beside_its_int8qk_twin(runner, fake_engine, monkeypatch):
    """``fp eval --profiles dense,accurate,accurate+int8qk``: the int8qk profile gets its column, its
    pairing with dense and with its BF16 twin (what int8qk alone costs), in the JSON and a line."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "2",
                            "--profiles", "dense,accurate,accurate+int8qk", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [(p["name"], p["label"], p["requested_precision"], p["ran_precision"], p["bf16_twin"])
            for p in data["profiles"]] == [
        ("dense", "dense", "bf16", "bf16", None), ("accurate", "accurate", "bf16", "bf16", None),
        ("accurate+int8qk", "accurate+int8qk", "int8qk", "int8qk (sparse layers)", "accurate")]
    assert [g["profile"] for g in data["against_dense"]] == ["accurate", "accurate+int8qk"]
    assert [(g["profile"], g["baseline"], g["samples"]) for g in data["against_bf16"]] == \
        [("accurate+int8qk", "accurate", 2)]
    err = " ".join(r.stderr.split())
    assert "at 1k accurate+int8qk against accurate (the same profile at BF16) on the same 2 samples" in err


def test_eval_notes_name_int8qk_as_what_costs_the_answers():
    from fpcli.ruler.render import fp8_notes
    from fpcli.ruler.scoring import sign_test_p

    profiles = [{"name": "accurate", "attention": "flashprefill", "requested_precision": "bf16"},
                {"name": "accurate+int8qk", "attention": "flashprefill", "requested_precision": "int8qk",
                 "ran_precision": "int8qk (sparse layers)", "bf16_twin": "accurate"}]
    row = {"length": 131072, "profile": "accurate+int8qk", "baseline": "accurate", "samples": 16, "lost": 6,
           "won": 0, "points": -37.5, "sign_p": sign_test_p(6, 0)}
    (line,) = fp8_notes({"profiles": profiles, "against_bf16": [row]})
    assert line.endswith("; int8qk is what costs these answers: accurate keeps them") and "FP8" not in line
    (line,) = fp8_notes({"profiles": profiles,
                         "against_bf16": [dict(row, lost=2, points=-12.5, sign_p=sign_test_p(2, 0))]})
    assert line.endswith("before putting it on int8qk") and "FP8" not in line  # 2 of 2 changed: p 0.5
    lone = [dict(profiles[1], bf16_twin=None)]
    (hint,) = fp8_notes({"profiles": lone, "against_bf16": []})
    assert hint.startswith("accurate+int8qk ran without its BF16 twin, so what int8qk alone costs")
    assert "accurate,accurate+int8qk" in hint and "P+int8qk" in hint and "fp8" not in hint
    ran_bf16 = [dict(lone[0], ran_precision="bf16")]  # int8qk never ran: nothing to separate
    assert fp8_notes({"profiles": ran_bf16, "against_bf16": []}) == []


def test_ttft_rows_put_int8qk_beside_bf16():
    from fpcli.ttft import ttft_rows

    acc, acc_i, dense = load_profile("accurate"), load_profile("accurate+int8qk"), load_profile("dense")
    m = {(n, 4096): {"ttft_s": t, "density": d, "needle": True, "answer": "", "prompt_tokens": 4000, "precision": p}
         for n, t, d, p in [("accurate", 2.0, 0.4, "bf16"), ("accurate+int8qk", 1.6, 0.4, "int8qk (sparse layers)"),
                            ("dense", 4.0, 1.0, "bf16")]}
    rows = {r["profile"]: r for r in ttft_rows([4096], [acc, acc_i, dense], m)}
    assert rows["accurate+int8qk"]["x_bf16"] == pytest.approx(2.0 / 1.6)
    assert rows["accurate+int8qk"]["precision"] == "int8qk (sparse layers)"


def test_bench_e2e_runs_an_int8qk_profile_beside_its_bf16_twin():
    from fpcli.commands.bench import _e2e_profiles

    acc_i = load_profile("accurate+int8qk")
    names = [(p.name, p.precision) for p in _e2e_profiles(acc_i, False)]
    # each row is named for what it runs: the BF16 twin is accurate itself, not accurate+int8qk+bf16
    assert names == [("accurate", "bf16"), ("accurate+int8qk", "int8qk"), ("dense", "bf16")]
    assert _e2e_profiles(acc_i, False)[0] == load_profile("accurate")
    names = [(p.name, p.precision) for p in _e2e_profiles(acc_i, True)]
    assert names == [("accurate", "bf16"), ("accurate+fp8", "fp8"), ("accurate+int8qk", "int8qk"), ("dense", "bf16")]
    assert [p.name for p in _e2e_profiles(load_profile("bf16+int8qk"), True)] == ["bf16", "fp8", "bf16+int8qk", "dense"]
    assert [p.name for p in _e2e_profiles(load_profile("fp8"), True)] == ["bf16", "fp8", "dense"]  # as before
