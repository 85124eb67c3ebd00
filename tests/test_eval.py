"""``fp eval``: the task generators (with the real embedded tokenizer), the scorer, the length fit,
the report through the CLI, bad input, and one end-to-end run with the REAL embedded model.

The generator and end-to-end tests use the embedded SmolLM2-135M-Instruct (pulled once through
``fp model pull``, see ``test_e2e_cpu.py``); the structure and bad-input tests use the fake engine.
"""
from __future__ import annotations

import json
import random
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from fpcli.cli import app
from fpcli.ruler.haystack import DocumentHaystack, GeneratedHaystack
from fpcli.ruler.scoring import mean_points, string_match
from fpcli.ruler.tasks import TASKS, TaskError, fit_units, make_sample
from fp_fakes import fp_executable, run_env  # noqa: F401

FIT_TOLERANCE = 48  # tokens a fitted prompt may fall short of its target (less than one filler unit)


# -- scorer -----------------------------------------------------------------------------------------


def test_string_match_exact_cases():
    assert string_match(["4821937"], "The special magic number is 4821937.") == 1.0
    assert string_match(["4821937"], "The number is 4821936.") == 0.0
    assert string_match(["alpha", "beta", "gamma", "delta"], "ALPHA, then Beta.") == 0.5
    assert string_match(["EZTBD", "CAQFW"], "variables: eztbd and caqfw") == 1.0
    assert mean_points([1.0, 0.5, 0.0]) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="expected"):
        string_match([], "anything")
    with pytest.raises(ValueError, match="scores"):
        mean_points([])


# -- length fit -------------------------------------------------------------------------------------


def test_fit_units_finds_the_largest_fitting_count():
    assert fit_units(lambda n: 10 + 3 * n, 100) == (30, 100)
    assert fit_units(lambda n: 10 + 3 * n, 102) == (30, 100)
    assert fit_units(lambda n: 10 + 3 * n + n // 7, 1000, first_guess=5) == (315, 1000)  # 316 -> 1003
    with pytest.raises(TaskError, match="needs 10 tokens"):
        fit_units(lambda n: 10 + n, 9)


# -- generators, with the real tokenizer ------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2):  # noqa: F811 - the fixture imported above
    """The embedded model's transformers engine: its ``encode_chat`` is what ``fp eval`` measures with."""
    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.profiles import load_profile

    eng = TransformersEngine(smollm2, load_profile("bf16"), model_name="smollm2-135m-instruct")
    yield eng
    eng.close()


def _document(sample) -> str:
    m = re.search(r'<document name="[^"]*">\n(.*)\n</document>', sample.user, re.S)
    assert m, "the sample has no document block"
    return m.group(1)


def _check_derivable(sample) -> None:
    """The expected answer is in (or follows from) the sample's haystack, and the question is last."""
    doc = _document(sample)
    assert sample.user.rstrip().endswith(sample.question)
    if sample.task.startswith("niah"):
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", doc)
        asked = re.search(r"for ([a-z]+-[a-z]+) mentioned", sample.question).group(1)
        assert sorted(v for k, v in needles if k == asked) == sorted(sample.expected)
        assert len(needles) == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 4}[sample.task]
    elif sample.task == "vt":
        value = re.search(r"the value (\d+)", sample.question).group(1)
        equal: set[str] = set()
        for name, rhs in re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", doc):  # statements in text order
            if rhs == value or rhs.removeprefix("VAR ") in equal:
                equal.add(name)
        assert equal == set(sample.expected) and len(equal) == 5
    elif sample.task == "cwe":
        counts = Counter(re.findall(r"^\d+\. ([a-z]{6})$", doc, re.M))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(sample.expected)
        assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)
    else:  # pragma: no cover - a new task needs its check here
        pytest.fail(f"no derivation check for task {sample.task}")


@pytest.mark.slow
@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [1024, 3000])
def test_sample_fits_its_length_and_holds_its_answer(tokenizer, task, length):
    s = make_sample(TASKS[task], length, 0, seed=7, haystack=GeneratedHaystack(), tokenizer=tokenizer,
                    context_length=tokenizer.context_length)
    assert s.target_tokens == length
    assert length - FIT_TOLERANCE <= s.prompt_tokens <= length
    assert s.ids == tokenizer.encode_chat(s.system, s.user)
    _check_derivable(s)


@pytest.mark.slow
def test_length_leaves_room_for_the_answer(tokenizer):
    """--len equal to the context: the prompt is shortened by the task's answer budget."""
    ctx = tokenizer.context_length
    s = make_sample(TASKS["niah_single"], ctx, 0, 0, GeneratedHaystack(), tokenizer, ctx)
    assert s.target_tokens == ctx - TASKS["niah_single"].max_new_tokens
    assert s.target_tokens - FIT_TOLERANCE <= s.prompt_tokens <= s.target_tokens
    _check_derivable(s)


@pytest.mark.slow
def test_length_leaves_the_sglang_engine_its_reserve(tokenizer):
    """--len equal to the context on the SGLang engine: the prompt also leaves the tokens SGLang
    keeps beyond prompt and answer (its answer cap is context - 2 - prompt), so the task gets its
    whole answer budget; before, the answer lost 2 tokens at the context's edge."""
    from fpcli.engine.sglang_engine import SGLangEngine

    class OnSGLang:  # the embedded model's tokenizer, the real SGLang engine's reserve
        context_length = tokenizer.context_length
        encode_chat = staticmethod(tokenizer.encode_chat)
        context_reserve = staticmethod(SGLangEngine.context_reserve)

    ctx, task = tokenizer.context_length, TASKS["niah_single"]
    s = make_sample(task, ctx, 0, 0, GeneratedHaystack(), OnSGLang(), ctx)
    assert s.target_tokens == ctx - task.max_new_tokens - SGLangEngine.context_reserve(task.max_new_tokens)
    assert s.prompt_tokens + task.max_new_tokens <= ctx - 2  # SGLang: max_req_len (ctx - 1) - prompt - 1


@pytest.mark.slow
def test_seeds_are_deterministic_and_differ(tokenizer):
    def sample(seed, index=0, task="vt"):
        return make_sample(TASKS[task], 1024, index, seed, GeneratedHaystack(), tokenizer, 8192)

    a, b = sample(3), sample(3)
    assert (a.ids, a.expected) == (b.ids, b.expected)
    assert sample(4).user != a.user and sample(4).expected != a.expected
    assert sample(3, index=1).expected != a.expected  # samples of one cell differ too
    c1, c2 = sample(3, task="cwe"), sample(3, task="cwe")
    assert c1.ids == c2.ids


@pytest.mark.slow
def test_user_documents_as_haystack(tokenizer):
    text = " ".join(f"Paragraph {i} of the report discusses topic number {i} in detail." for i in range(40))
    stack = DocumentHaystack.from_texts([("report.md", text)])
    s = make_sample(TASKS["niah_multikey"], 2048, 0, 1, stack, tokenizer, 8192)
    doc = _document(s)
    assert "of the report discusses topic number" in doc
    assert 2048 - FIT_TOLERANCE <= s.prompt_tokens <= 2048  # the 40 sentences wrap around to fill it
    _check_derivable(s)


def test_short_length_is_a_task_error():
    class Words:
        def encode_chat(self, system, user):
            return (system + " " + user).split()

    with pytest.raises(TaskError, match="--len 40: too short for task cwe"):
        make_sample(TASKS["cwe"], 40, 0, 0, GeneratedHaystack(), Words(), 8192)


def test_document_haystack_rejects_empty_text():
    with pytest.raises(ValueError, match="--haystack"):
        DocumentHaystack.from_texts([("empty.txt", "  \n")])
    stack = DocumentHaystack.from_texts([("a.txt", "One. Two! Three?")])
    first = list(__import__("itertools").islice(stack.stream(random.Random(0)), 7))
    assert sorted(set(first)) == ["One.", "Three?", "Two!"]  # wraps around


# -- the CLI with the fake engine: structure, labels, bad input -------------------------------------


def test_profile_label_says_what_ran_when_it_is_not_what_was_asked():
    from fpcli.ruler.runner import ProfileRun

    assert ProfileRun("fp8", "flashprefill", "fp8", ran_precision="fp8 (sparse layers)").label == "fp8"
    assert ProfileRun("fp8", "flashprefill", "fp8", ran_precision="bf16").label == "fp8 (ran bf16)"
    mixed = ProfileRun("fp8", "flashprefill", "fp8", ran_precision="fp32/fp8 (sparse layers)")
    assert mixed.label == "fp8 (ran fp32/fp8 (sparse layers))"  # some samples ran no sparse layer
    assert ProfileRun("bf16", "flashprefill", "bf16", ran_precision="fp32").label == "bf16 (ran fp32)"


def test_eval_json_structure_and_precision_labels(runner, fake_engine, monkeypatch):
    from fp_fakes import LAST_FAKE

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k,2k", "--task", "niah_single,vt", "--samples", "2",
                            "--profiles", "dense,fp8", "--seed", "5", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["schema"] == "fp.eval/1"
    assert (data["seed"], data["samples_per_cell"], data["samples_total"]) == (5, 2, 8)
    assert data["tasks"] == ["niah_single", "vt"] and data["lengths"] == [1024, 2048]
    labels = {p["name"]: p["label"] for p in data["profiles"]}
    assert labels == {"dense": "dense", "fp8": "fp8"}  # the fake runs FP8 in its sparse layers, as the engines do
    assert [p["ran_precision"] for p in data["profiles"]] == ["bf16", "fp8 (sparse layers)"]
    assert len(data["cells"]) == 2 * 2 * 2 and all(c["samples"] == 2 for c in data["cells"])
    assert all(0.0 <= c["score"] <= 100.0 and c["ttft_s"] > 0 and 0 < c["density"] <= 1 for c in data["cells"])
    fp8_density = [c["density"] for c in data["cells"] if c["profile"] == "fp8"]
    assert all(d < 1 for d in fp8_density)  # the fake's sparse statistics flow into the cells
    for s in data["samples"]:
        assert set(s["results"]) == {"dense", "fp8"} and s["expected"]
        assert s["prompt_tokens"] <= s["target_tokens"] <= s["length"]
    assert len(LAST_FAKE) == 2 and all(e.closed for e in LAST_FAKE)  # one engine per profile, closed
    # the same samples for every profile: each engine got the same prompt lengths in the same order
    assert [g["prompt_len"] for g in LAST_FAKE[0].generated] == [g["prompt_len"] for g in LAST_FAKE[1].generated]
    assert "fp8" in r.stderr and "(ran " not in r.stderr  # the table: FP8 ran, no "ran" label


def test_eval_report_file_and_a_wrong_answer(runner, fake_engine, monkeypatch, tmp_path):
    """--report saves the same object --json prints; an answer without the needle scores 0."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", "bf16", "--json", "--report", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["cells"][0]["score"] == 0.0  # "The answer is 42." holds no 7-digit value


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "niah,vt"], "--task: unknown task 'niah'"),
        (["--len", "16k"], "--len 16,384 is above the model's context of 8,192 tokens (the maximum --len here is 8,192)"),
        (["--len", "256"], "--len 256 is too short for task niah_single"),
        (["--len", "800", "--task", "cwe"], "--len 800 is too short for task cwe: it needs at least 1,024 tokens"),
        (["--len", "abc"], "--len: 'abc' is not a length"),
        (["--profiles", "dense,turbo"], "turbo"),
        (["--profiles", "dense,accurate,accurate"], "--profiles: accurate is given twice; give each profile once"),
        (["--haystack", "/nonexistent/doc.pdf"], "/nonexistent/doc.pdf"),
    ],
)
def test_eval_bad_input_exits_2_before_loading(runner, fake_engine, args, message):
    from fp_fakes import LAST_FAKE

    r = runner.invoke(app, ["eval", *args])
    assert r.exit_code == 2, r.stderr
    assert message in r.stderr
    assert len([ln for ln in r.stderr.strip().splitlines() if ln.strip()]) == 1
    assert LAST_FAKE == []  # nothing loaded


def test_eval_copy_of_a_builtin_keeping_its_name_is_named_in_the_error(runner, fake_engine, tmp_path):
    """A copy of accurate.yaml (as docs/profiles.md suggests, with other dense_layers) still says
    `name: accurate`: run beside accurate, the error names both and says to rename the copy."""
    from fp_fakes import LAST_FAKE
    from fpcli.profiles import profiles_dir

    copy = tmp_path / "my-accurate.yaml"
    copy.write_text((profiles_dir() / "accurate.yaml").read_text().replace("dense_layers: 12", "dense_layers: 15"))
    r = runner.invoke(app, ["eval", "--profiles", f"accurate,{copy}"])
    assert r.exit_code == 2, r.stderr
    assert f"--profiles: {copy} and accurate are both named 'accurate' (a profile's `name:`)" in r.stderr
    assert "rename the copy" in r.stderr
    assert LAST_FAKE == []


def test_eval_length_checked_against_the_loaded_context(runner, fake_engine, monkeypatch, tmp_path):
    """A model whose context is only known once loaded (here the fake reports 2,048): exit 2."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "2048")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    r = runner.invoke(app, ["eval", "--len", "4k", "--task", "niah_single", "--profiles", "dense", "-m", str(model)])
    assert r.exit_code == 2, r.stderr
    assert "--len 4,096 is above the model's context of 2,048 tokens" in r.stderr


# -- end to end, the REAL embedded model --------------------------------------------------------------


@pytest.mark.slow
def test_eval_end_to_end_real_model(smollm2, tmp_path):  # noqa: F811
    proc = subprocess.run(
        [fp_executable(), "eval", "--len", "1k", "--task", "niah_single,vt", "--samples", "1",
         "--profiles", "dense,bf16", "--engine", "transformers", "--json"],
        capture_output=True, text=True, env=run_env(), timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["schema"] == "fp.eval/1" and data["engine"] == "transformers"
    assert data["model"] == "smollm2-135m-instruct"
    assert [p["name"] for p in data["profiles"]] == ["dense", "bf16"]
    for p in data["profiles"]:  # the CPU runs float32: the columns say so
        assert p["ran_precision"] == "fp32" and p["label"] == f"{p['name']} (ran fp32)"
    assert len(data["cells"]) == 4 and len(data["samples"]) == 2
    for c in data["cells"]:
        assert 0.0 <= c["score"] <= 100.0 and c["ttft_s"] > 0 and 0 < c["density"] <= 1.0
    for s in data["samples"]:
        assert 1024 - FIT_TOLERANCE <= s["prompt_tokens"] <= 1024
        for r in s["results"].values():
            assert r["answer"].strip() and r["score"] == string_match(s["expected"], r["answer"])
    assert "one engine per profile" in proc.stderr


def test_eval_two_seeds_one_engine_per_profile_and_the_spread(runner, fake_engine, monkeypatch):
    """``--seed 0,1``: each seed adds its own samples, every profile's engine is loaded once for
    both, and the averages carry each seed's score and their spread."""
    from fp_fakes import LAST_FAKE

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single,vt", "--samples", "2",
                            "--profiles", "dense,bf16", "--seed", "0,1", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["seed"], data["seeds"], data["samples_total"]) == (0, [0, 1], 2 * 2 * 2)
    assert len(LAST_FAKE) == 2  # one engine per profile, for both seeds
    ids = [s["id"] for s in data["samples"]]
    assert len(set(ids)) == len(ids)
    by_seed = {sd: [s["question"] for s in data["samples"] if s["seed"] == sd] for sd in (0, 1)}
    assert by_seed[0] != by_seed[1]  # two seeds, different samples
    for c in data["cells"]:
        assert c["samples"] == 4 and set(c["score_by_seed"]) == {"0", "1"}
        assert abs(c["score"] - (c["score_by_seed"]["0"] + c["score_by_seed"]["1"]) / 2) < 1e-9
    for a in data["averages"]:
        s0, s1 = a["score_by_seed"]["0"], a["score_by_seed"]["1"]
        assert a["seed_spread"] == max(s0, s1) - min(s0, s1)
    assert "seeds 0, 1" in r.stderr
    err = " ".join(r.stderr.split())
    assert "2 samples per seed x 2 seeds = 4 per cell" in err and "sample(s)" not in err


def test_eval_bad_seed_is_a_usage_error(runner, fake_engine):
    r = runner.invoke(app, ["eval", "--len", "1k", "--seed", "zero"])
    assert r.exit_code == 2 and "--seed" in r.stderr and "'zero'" in r.stderr


def test_eval_says_when_sparse_profiles_ran_dense_below_min_sparse_len(runner, fake_engine, monkeypatch):
    from fp_fakes import FakeEngine

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")  # the profiles' min_sparse_len fitted to it: 4,096
    monkeypatch.setattr(FakeEngine, "min_sparse_len", 4096)  # as the engines: shorter prompts run dense
    r = runner.invoke(app, ["eval", "--len", "2k,8k", "--task", "vt", "--samples", "1",
                            "--profiles", "dense,bf16,fp8", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    avg = {(a["length"], a["profile"]): a for a in data["averages"]}
    assert avg[(2048, "bf16")]["ran_dense"] and avg[(2048, "fp8")]["ran_dense"]
    assert avg[(2048, "bf16")]["density"] == 1.0 and avg[(2048, "bf16")]["min_sparse_len"] == 4096
    assert not avg[(8192, "bf16")]["ran_dense"] and avg[(8192, "bf16")]["density"] < 1
    assert not avg[(2048, "dense")]["ran_dense"] and avg[(2048, "dense")]["min_sparse_len"] is None
    err = " ".join(r.stderr.split())
    # the advice is a length that runs sparse AND fits the context (8k is the whole context)
    assert ("at 2k every profile ran dense: prompts below min_sparse_len 4,096; "
            "use --len 5k to 8k (up to the context of 8,192 tokens)") in err
    assert "at 8k every" not in err and "at 8k profile" not in err and err.count("ran dense") == 1
    assert "2 samples built" in err  # one per length


def test_eval_one_sample_is_said_in_the_singular(runner, fake_engine, monkeypatch):
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "2k", "--task", "vt", "--samples", "1", "--profiles", "dense"])
    assert r.exit_code == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert "1 sample built" in err and "1 samples" not in err
    assert "1 sample per cell" in err and "sample(s)" not in err
    assert "a prompt of " in err and not re.search(r"(\d[\d,]*)-\1 tokens", err)


def test_eval_warns_when_the_engine_generated_no_answer_token(runner, fake_engine, monkeypatch):
    """An empty answer scores 0 without saying anything about attention: the cells count them and
    stderr says so (seen on the H200: SGLang capped the answers of prompts near a 131,072-token
    context at 0 tokens while fp's KV pool had one spare page)."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    monkeypatch.setenv("FP_FAKE_ANSWER", "")  # the engine generates no token
    r = runner.invoke(app, ["eval", "--len", "2k", "--task", "vt", "--samples", "2", "--profiles", "dense", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [c["empty_answers"] for c in data["cells"]] == [2]
    assert data["averages"][0]["empty_answers"] == 2 and data["averages"][0]["samples"] == 2
    err = " ".join(r.stderr.split())
    assert "at 2k 2 of 2 dense answers were empty (the engine generated no token)" in err
    monkeypatch.setenv("FP_FAKE_ANSWER", "The value is 1.")
    r = runner.invoke(app, ["eval", "--len", "2k", "--task", "vt", "--samples", "2", "--profiles", "dense", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["cells"][0]["empty_answers"] == 0 and "were empty" not in r.stderr


def test_dense_note_advises_lengths_that_run_sparse_within_the_context():
    """The advice of the "ran dense" note: whole-k lengths whose prompts (a little shorter than
    --len) exceed min_sparse_len, and at most the context; none when no such length exists."""
    from fpcli.ruler.render import dense_notes

    def report(msl, context):
        return {"context_length": context,
                "profiles": [{"name": "bf16", "attention": "flashprefill"}],
                "averages": [{"length": 2048, "profile": "bf16", "ran_dense": True, "min_sparse_len": msl}]}

    assert dense_notes(report(4096, 8192))[0].endswith("use --len 5k to 8k (up to the context of 8,192 tokens)")
    assert dense_notes(report(4600, 32768))[0].endswith("use --len 5k to 32k (up to the context of 32,768 tokens)")
    assert dense_notes(report(4700, 32768))[0].endswith("use --len 6k to 32k (up to the context of 32,768 tokens)")
    assert dense_notes(report(4096, 5120))[0].endswith("use --len 5k (the context is 5,120 tokens)")
    assert "no --len up to the context of 8,192 tokens runs sparse" in dense_notes(report(8192, 8192))[0]


def test_eval_ctrl_c_keeps_the_finished_cells_and_exits_130(runner, fake_engine, monkeypatch, tmp_path):
    """Ctrl-C during the second profile: the table shows what finished (marked partial), --json and
    --report carry it with "interrupted": true and what is missing, and fp exits 130. Up front, one
    note gives the number of prefills."""
    from fp_fakes import LAST_FAKE, FakeEngine

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    real = FakeEngine.generate
    calls = []

    def generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # 4 samples per profile: the second profile's second answer
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FakeEngine, "generate", generate)
    r = runner.invoke(app, ["eval", "--len", "1k,2k", "--task", "niah_single", "--samples", "2",
                            "--profiles", "dense,bf16,fp8", "--json", "--report", str(tmp_path / "r.json")])
    assert r.exit_code == 130, r.stderr
    data = json.loads(r.stdout)
    assert json.loads((tmp_path / "r.json").read_text()) == data
    assert data["interrupted"] is True
    assert data["missing"] == [{"profile": "bf16", "answered": 1, "samples": 4},
                               {"profile": "fp8", "answered": 0, "samples": 4}]
    assert [p["name"] for p in data["profiles"]] == ["dense", "bf16"]
    cells = {(c["length"], c["profile"]): c for c in data["cells"]}
    assert set(cells) == {(1024, "dense"), (2048, "dense"), (1024, "bf16")}
    assert cells[(1024, "dense")]["samples"] == 2 and cells[(1024, "bf16")]["samples"] == 1
    for (length, prof), c in cells.items():  # tokens are an int: the mean of the samples, rounded
        sizes = [s["prompt_tokens"] for s in data["samples"] if s["length"] == length and prof in s["results"]]
        assert type(c["prompt_tokens"]) is int and c["prompt_tokens"] == round(sum(sizes) / len(sizes))
    assert sum(len(s["results"]) for s in data["samples"]) == 5
    assert all(e.closed for e in LAST_FAKE) and len(LAST_FAKE) == 2  # the engine in use was closed
    err = " ".join(r.stderr.split())
    assert "12 prefills: 4 samples x 3 profiles" in err
    assert "PARTIAL: interrupted" in err
    assert ("interrupted (Ctrl-C), the table is partial: profile bf16 answered 1 of 4 samples (its cells average "
            "those); profile fp8 answered none of its 4 samples (no cells)") in err
    assert "fp8 none" not in err


@pytest.mark.parametrize("step", ["engine_close", "report_write", "table"])
def test_eval_second_ctrl_c_during_the_cleanup_stops_quietly(runner, fake_engine, monkeypatch, tmp_path, step):
    """A second Ctrl-C while the first is handled (the engine closing, --report being written, the
    partial table printing): no traceback, exit 130, and the report whole or absent, never half
    written (a KeyboardInterrupt in the middle of the write leaves no file and no temporary file).
    Caught after the run, it ends fp with one line, the last one."""
    import fpcli.console
    from fp_fakes import FakeEngine

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    real_generate, calls = FakeEngine.generate, []

    def generate(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first Ctrl-C: the second answer of 2
            raise KeyboardInterrupt
        return real_generate(self, *args, **kwargs)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    import fpcli.report

    real_fdopen = fpcli.report.os.fdopen

    class _HalfFile:  # the second Ctrl-C halfway through writing the report's temporary file
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:len(text) // 2])
            raise KeyboardInterrupt

    def half_write(fd, *args, **kwargs):
        return _HalfFile(real_fdopen(fd, *args, **kwargs))

    monkeypatch.setattr(FakeEngine, "generate", generate)
    if step == "engine_close":
        monkeypatch.setattr(FakeEngine, "close", interrupt)
    elif step == "report_write":
        monkeypatch.setattr(fpcli.report.os, "fdopen", half_write)
    else:
        monkeypatch.setattr(fpcli.console, "print_table", interrupt)
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "2", "--profiles", "dense",
                            "--report", str(out)])
    assert r.exit_code == 130, (r.exception, r.stderr)
    assert isinstance(r.exception, SystemExit), r.exception
    assert "Traceback" not in r.stdout + r.stderr
    assert [p.name for p in tmp_path.iterdir()] in ([], ["r.json"])  # no temporary file left
    if out.exists():
        assert json.loads(out.read_text())["interrupted"] is True
    lines = r.stderr.strip().splitlines()
    if step == "engine_close":  # inside the run: it ends as the first one did, the report written
        assert out.exists() and "interrupted again" not in r.stderr
        assert "PARTIAL: interrupted" in " ".join(r.stderr.split())
    else:  # the last line (rich may wrap it: compared without whitespace), and the unsaved report named
        want = "fp: error: interrupted again; stopping" + (f" ({out} not written)" if step == "report_write" else "")
        assert "".join(r.stderr.split()).endswith("".join(want.split())), lines[-3:]
        assert r.stderr.count("interrupted again") == 1
    if step == "report_write":
        assert not out.exists()


def test_eval_finished_run_is_not_interrupted(runner, fake_engine, monkeypatch):
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "vt", "--samples", "1", "--profiles", "dense", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["interrupted"] is False and data["missing"] == []
    assert "1 prefill: 1 sample x 1 profile" in r.stderr and "PARTIAL" not in r.stderr


def test_eval_says_which_ttft_differences_are_noise_with_few_samples(runner, fake_engine, monkeypatch):
    """Fewer than 5 samples per cell: one line under the table with the run's own TTFT spread
    (the largest range among one profile's samples at one length); none with 5 or more."""
    from fp_fakes import FakeEngine

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    real = FakeEngine.generate
    ttfts = iter([0.5, 0.9, 0.6, 0.7, 0.55, 0.62, 0.58, 0.61])

    def generate(self, *args, **kwargs):
        r = real(self, *args, **kwargs)
        r.ttft_s = next(ttfts)
        return r

    monkeypatch.setattr(FakeEngine, "generate", generate)
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single,vt", "--samples", "2",
                            "--profiles", "dense,bf16", "--json"])
    assert r.exit_code == 0, r.stderr
    err = " ".join(r.stderr.split())
    # dense: 0.5, 0.9, 0.6, 0.7 (range 0.4); bf16: 0.55, 0.62, 0.58, 0.61 (range 0.07)
    assert ("TTFT: 2 samples per cell; one profile's samples at one length differ by up to 0.400 s: "
            "smaller TTFT differences between profiles are noise") in err
    monkeypatch.setattr(FakeEngine, "generate", real)
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "vt", "--samples", "5", "--profiles", "dense,bf16"])
    assert r.exit_code == 0, r.stderr
    assert "TTFT:" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--report", "/nonexistent-folder/r.json"], "--report /nonexistent-folder/r.json: the folder /nonexistent-folder does not exist"),
    (["--haystack", "nope.pdf"], "--haystack: nope.pdf"),
])
def test_eval_checks_paths_before_the_profiles_and_the_model(runner, fake_engine, monkeypatch, args, message):
    """A bad --report or --haystack path is found before the profiles are loaded and the model
    looked up (the slow part, seconds, before any engine loads)."""
    import fpcli.commands.evaluate as evaluate

    def too_late(*a, **kw):
        raise AssertionError("the paths are checked after the model")

    monkeypatch.setattr(evaluate, "check_model_or_exit", too_late)
    monkeypatch.setattr(evaluate, "load_profile_or_exit", too_late)
    r = runner.invoke(app, ["eval", "--len", "1k", *args])
    assert r.exit_code == 2, r.stderr
    assert message in r.stderr


def test_eval_table_marks_an_average_over_fewer_tasks():
    """An interrupted run: a profile that answered one of two tasks gets an 'all tasks' average
    over that task only; the row says so instead of ranking it beside the full averages."""
    from rich.console import Console

    from fpcli.ruler.render import eval_table

    def cell(task, prof, score):
        return {"task": task, "length": 4096, "profile": prof, "score": score, "ttft_s": 0.5, "density": 0.4,
                "prompt_tokens": 4000, "score_by_seed": {0: score}}

    def avg(prof, score, tasks):
        return {"length": 4096, "profile": prof, "score": score, "ttft_s": 0.5, "density": 0.4, "tasks": tasks,
                "seed_spread": 0.0, "score_by_seed": {0: score}}

    report = {"model": "m", "engine": "transformers", "samples_per_cell": 1, "seed": 0, "seeds": [0],
              "haystack": "generated", "interrupted": True,
              "profiles": [{"name": "dense", "label": "dense"}, {"name": "bf16", "label": "bf16"}],
              "cells": [cell("niah_single", "dense", 100.0), cell("vt", "dense", 50.0), cell("niah_single", "bf16", 100.0)],
              "averages": [avg("dense", 75.0, 2), avg("bf16", 100.0, 1)]}
    console = Console(record=True, width=300)
    console.print(eval_table(report))
    rows = [line for line in console.export_text().splitlines() if "all tasks" in line]
    assert len(rows) == 1
    assert "100.0 (1 of 2 tasks)" in rows[0] and "75.0 (" not in rows[0]


def test_eval_reports_min_sparse_len_as_the_engine_fitted_it():
    """An in-process engine keeps the profile load_engine fitted to the model (Profile.fit_to_model:
    SmolLM2's own 8K at --context 16k gives 4,096); the report said 8,192 (fitted to 16K)."""
    from fpcli.engine.base import GenerationResult
    from fpcli.profiles import load_profile, with_context_length
    from fpcli.ruler.runner import run_profiles
    from fpcli.ruler.tasks import Sample

    class Engine:  # what run_profiles reads of a loaded engine; the real ones keep .profile fitted
        name, model_name, context_length = "transformers", "smollm2-135m-instruct", 16384

        def __init__(self, profile):
            self.profile = profile

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def generate(self, ids, max_new_tokens, temperature):
            return GenerationResult(text="7", prompt_tokens=len(ids), output_tokens=1, ttft_s=0.1, prefill_s=0.1,
                                    total_s=0.1, engine=self.name, model=self.model_name, profile=self.profile.name)

    bf16 = with_context_length(load_profile("bf16"), 16384)
    sample = Sample(task="niah_single", length=12000, index=0, target_tokens=12000, ids=[1, 2, 3], system="",
                    user="q", question="q", expected=("7",), max_new_tokens=8)
    run = run_profiles([bf16], lambda p: Engine(p.fit_to_model(8192)), lambda eng, ctx: [sample])
    assert run.profiles[0].min_sparse_len == 4096


def test_eval_len_is_repeatable_and_a_length_given_twice_runs_once(runner, fake_engine, monkeypatch):
    """As fp bench: a second --len added to the first (it replaced it, silently), and 1k given as
    1k and 1024 is one length, with a note."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k,2k", "--len", "1024", "--task", "niah_single", "--samples", "1",
                            "--profiles", "dense", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["lengths"] == [1024, 2048]
    assert "--len: 1,024 tokens given more than once: run once" in " ".join(r.stderr.split())


def _sample(i: int, length: int, expected: str):
    from fpcli.ruler.tasks import Sample

    return Sample(task="niah_multikey", length=length, index=i, target_tokens=length, ids=[1, 2, 3], system="",
                  user="u", question=f"q{i}", expected=(expected,), max_new_tokens=16)


def _answer(text: str):
    from fpcli.engine.base import GenerationResult

    return GenerationResult(text=text, prompt_tokens=3, output_tokens=4, ttft_s=0.1, prefill_s=0.1, total_s=0.2,
                            engine="transformers", model="m", profile="p")


def test_against_dense_pairs_the_same_samples():
    """Lost / won count samples, not cell differences: a profile that loses one sample and wins
    another scores the same cell as dense, and the pairing says it changed two answers; partial
    credit and samples the baseline did not answer are handled; no dense profile, no pairing."""
    from fpcli.ruler.runner import EvalRun, ProfileRun, against_dense

    samples = [_sample(i, 4096, f"{1000 + i}") for i in range(4)] + [_sample(4, 8192, "77 88")]
    dense = ProfileRun("dense", "dense", "bf16", results={
        s.id: _answer(f"it is {s.expected[0]}") for s in samples[:3]})  # dense wrong on sample 3, absent at 8K
    dense.results[samples[3].id] = _answer("no idea")
    sparse = ProfileRun("bf16", "flashprefill", "bf16", results={
        samples[0].id: _answer("it is 1000"), samples[1].id: _answer("it is 9999"),  # same, lost
        samples[2].id: _answer("it is 1002"), samples[3].id: _answer("it is 1003"),  # same, won
        samples[4].id: _answer("77 88")})
    other = ProfileRun("fp8", "flashprefill", "fp8", results={s.id: _answer("nothing") for s in samples[:4]})
    run = EvalRun(samples, [dense, sparse, other], context_length=8192)
    rows = against_dense(run)
    assert [(r["length"], r["profile"]) for r in rows] == [(4096, "bf16"), (4096, "fp8")]  # 8K: dense has none
    bf16, fp8 = rows
    assert (bf16["baseline"], bf16["samples"], bf16["lost"], bf16["won"], bf16["points"]) == ("dense", 4, 1, 1, 0.0)
    assert (fp8["lost"], fp8["won"], fp8["points"]) == (3, 0, -75.0)
    assert against_dense(EvalRun(samples, [sparse, other], context_length=8192)) == []


def test_gap_notes_say_what_changed_and_suggest_the_accurate_profile():
    from fpcli.ruler.render import gap_notes
    from fpcli.ruler.scoring import sign_test_p

    def report(*names, points=-35.0):
        return {"profiles": [{"name": n} for n in names],
                "against_dense": [{"length": 32768, "profile": "bf16", "baseline": "dense", "samples": 40,
                                   "lost": 16, "won": 2, "points": points, "sign_p": sign_test_p(16, 2)}]}

    (line,) = gap_notes(report("dense", "bf16"))
    assert line.startswith("at 32k bf16 against dense on the same 40 samples: 16 lost, 2 won (-35.0 points, "
                           "sign test p 0.0013)")
    assert "accurate profile" in line and "--profiles" in line
    assert "accurate" not in gap_notes(report("dense", "bf16", "accurate"))[0]  # already measured
    assert "accurate" not in gap_notes(report("dense", "bf16", points=-2.0))[0]  # within the 2-point bar
    twin = report("dense", "accurate+fp8")
    twin["against_dense"][0]["profile"] = "accurate+fp8"
    assert "profile (its early" not in gap_notes(twin)[0]  # accurate's own FP8 twin: no advice to run accurate
    assert gap_notes({"profiles": [{"name": "bf16"}], "against_dense": []}) == []


def test_eval_prints_the_paired_comparison_with_dense(runner, fake_engine, monkeypatch):
    """Through the CLI: the report carries ``against_dense`` and the table is followed by its line;
    the fake answers every profile alike, so nothing is lost or won."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "3",
                            "--profiles", "dense,bf16,fp8", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [(g["profile"], g["samples"], g["lost"], g["won"], g["points"]) for g in data["against_dense"]] == \
        [("bf16", 3, 0, 0, 0.0), ("fp8", 3, 0, 0, 0.0)]
    err = " ".join(r.stderr.split())
    assert "at 1k bf16 against dense on the same 3 samples: 0 lost, 0 won (+0.0 points)" in err
    assert [g["sign_p"] for g in data["against_dense"]] == [1.0, 1.0]  # nothing changed


def test_eval_takes_a_twin_at_fp8_by_name(runner, fake_engine, monkeypatch):
    """``--profiles accurate,accurate+fp8``: the accurate profile and its FP8 twin side by side (what
    measuring FP8's cost on top of a profile needs), each with its own column and pairing."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", "dense,accurate,accurate+fp8", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [(p["name"], p["requested_precision"]) for p in data["profiles"]] == \
        [("dense", "bf16"), ("accurate", "bf16"), ("accurate+fp8", "fp8")]
    assert [g["profile"] for g in data["against_dense"]] == ["accurate", "accurate+fp8"]


def test_precision_twins_are_the_same_profile_at_two_precisions():
    """The built-ins bf16 / fp8 and a profile / its ``+fp8`` twin are twins; a profile differing in
    any setting besides precision, or a dense one, is not."""
    from fpcli.profiles import load_profile, precision_twins

    bf16, fp8, accurate = load_profile("bf16"), load_profile("fp8"), load_profile("accurate")
    assert precision_twins(bf16, fp8) and precision_twins(fp8, bf16)
    assert precision_twins(accurate, load_profile("accurate+fp8"))
    assert not precision_twins(accurate, fp8)  # dense_layers and alpha differ
    assert not precision_twins(bf16, bf16)  # the same precision
    assert not precision_twins(bf16, fp8.replace(dense_layers=3))
    assert not precision_twins(load_profile("dense"), load_profile("dense").replace(precision="fp8"))


def test_against_bf16_pairs_each_fp8_profile_with_its_twin():
    """FP8 against its BF16 twin, sample by sample; an FP8 profile without a twin in the run (or
    whose twin answered nothing) gets no row."""
    from dataclasses import replace

    from fpcli.engine.base import FP8_SPARSE
    from fpcli.ruler.runner import EvalRun, ProfileRun, against_bf16

    samples = [_sample(i, 4096, f"{1000 + i}") for i in range(4)]
    bf16 = ProfileRun("accurate", "flashprefill", "bf16", results={s.id: _answer(f"it is {s.expected[0]}") for s in samples})
    fp8 = ProfileRun("accurate+fp8", "flashprefill", "fp8", bf16_twin="accurate", results={
        s.id: replace(_answer(f"it is {s.expected[0]}" if s.index != 2 else "it is 5"), precision=FP8_SPARSE)
        for s in samples})
    lone = ProfileRun("fp8", "flashprefill", "fp8", results={s.id: _answer("x") for s in samples})
    (row,) = against_bf16(EvalRun(samples, [bf16, fp8, lone], context_length=8192))
    assert (row["profile"], row["baseline"], row["samples"], row["lost"], row["won"], row["points"]) == \
        ("accurate+fp8", "accurate", 4, 1, 0, -25.0)
    assert against_bf16(EvalRun(samples, [fp8, lone], context_length=8192)) == []  # the twin did not run


def test_against_bf16_leaves_out_samples_where_fp8_did_not_run():
    """An FP8 profile whose prompts all ran dense (below ``min_sparse_len``: the real engines then
    report the model's precision, not ``fp8 (sparse layers)``) computed its twin's answers: no row,
    where a "0 lost, 0 won" line would say FP8 costs nothing; on mixed samples only those that ran FP8
    are paired."""
    from dataclasses import replace

    from fpcli.engine.base import FP8_SPARSE
    from fpcli.ruler.runner import EvalRun, ProfileRun, against_bf16

    samples = [_sample(i, 4096, f"{1000 + i}") for i in range(3)]
    bf16 = ProfileRun("bf16", "flashprefill", "bf16", results={s.id: _answer(f"it is {s.expected[0]}") for s in samples})

    def fp8_run(precisions):
        return ProfileRun("fp8", "flashprefill", "fp8", bf16_twin="bf16", results={
            s.id: replace(_answer(f"it is {s.expected[0]}" if s.index else "no"), precision=prec)
            for s, prec in zip(samples, precisions)})

    assert against_bf16(EvalRun(samples, [bf16, fp8_run(["fp32"] * 3)], context_length=8192)) == []
    (row,) = against_bf16(EvalRun(samples, [bf16, fp8_run(["fp32", FP8_SPARSE, FP8_SPARSE])], context_length=8192))
    assert (row["samples"], row["lost"], row["points"]) == (2, 0, 0.0)


def test_bf16_twin_prefers_the_twin_by_name():
    """A copy of bf16 under another name is fp8's twin too; with both in the run, fp8 pairs with
    bf16 (as ``with_precision`` names them), accurate+fp8 with accurate; a renamed FP8 copy with
    no twin by name takes the first twin; a BF16 or twinless profile gets none."""
    from fpcli.profiles import bf16_twin, load_profile

    bf16, fp8, accurate = load_profile("bf16"), load_profile("fp8"), load_profile("accurate")
    mine, mine_acc = bf16.replace(name="mine"), accurate.replace(name="mine-acc")
    assert bf16_twin(fp8, [mine, bf16, accurate]).name == "bf16"
    assert bf16_twin(load_profile("accurate+fp8"), [mine_acc, bf16, accurate]).name == "accurate"
    assert bf16_twin(fp8.replace(name="mine8"), [accurate, mine, bf16]).name == "mine"
    assert bf16_twin(bf16, [bf16, fp8]) is None
    assert bf16_twin(fp8, [accurate, mine_acc]) is None


def test_eval_pairs_fp8_with_bf16_not_an_earlier_copy(runner, fake_engine, monkeypatch, tmp_path):
    """Through the CLI: a renamed copy of bf16.yaml before bf16 in --profiles does not take fp8's
    pairing from bf16."""
    from importlib.resources import files

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    text = (files("fpcli") / "builtin_profiles" / "bf16.yaml").read_text()
    mine = tmp_path / "mine.yaml"
    mine.write_text(text.replace("name: bf16", "name: mine", 1))
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", f"{mine},bf16,fp8", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert {p["name"]: p["bf16_twin"] for p in data["profiles"]} == {"mine": None, "bf16": None, "fp8": "bf16"}
    assert [(g["profile"], g["baseline"]) for g in data["against_bf16"]] == [("fp8", "bf16")]


def test_fp8_notes_say_what_fp8_alone_costs():
    from fpcli.ruler.render import fp8_notes
    from fpcli.ruler.scoring import sign_test_p

    def report(points, lost=6, won=0):
        return {"against_bf16": [{"length": 131072, "profile": "accurate+fp8", "baseline": "accurate",
                                  "samples": 16, "lost": lost, "won": won, "points": points,
                                  "sign_p": sign_test_p(lost, won)}]}

    (line,) = fp8_notes(report(-37.5))
    assert line.startswith("at 128k accurate+fp8 against accurate (the same profile at BF16) on the same 16 samples: "
                           "6 lost, 0 won (-37.5 points, sign test p 0.031)")
    assert line.endswith("; FP8 is what costs these answers: accurate keeps them")
    assert "costs" not in fp8_notes(report(-2.0))[0]
    # one answer lost of 16 (p 1.0): more than 2 points, but as likely by chance as not, so not put on FP8
    (line,) = fp8_notes(report(-6.25, lost=1))
    assert "(-6.2 points, sign test p 1.0)" in line and "costs" not in line
    assert line.endswith("pair more samples (--samples, more --seed values) before putting it on FP8")
    (line,) = fp8_notes(report(-25.0, lost=5, won=1))  # p 0.22: still not shown to be FP8's
    assert "sign test p 0.22" in line and "before putting it on FP8" in line
    assert fp8_notes({"against_bf16": []}) == []
    lone = {"profiles": [{"name": "accurate+fp8", "attention": "flashprefill", "requested_precision": "fp8",
                          "ran_precision": "fp8 (sparse layers)", "bf16_twin": None}], "against_bf16": []}
    (hint,) = fp8_notes(lone)
    assert hint.startswith("accurate+fp8 ran without its BF16 twin") and "P+fp8" in hint
    lone["profiles"][0]["ran_precision"] = "bf16"  # FP8 did not run (short prompts, no FP8 GPU): nothing to separate
    assert fp8_notes(lone) == []
    lone["profiles"][0].update(ran_precision="fp8 (sparse layers)", bf16_twin="accurate")  # the twin was asked for
    assert fp8_notes(lone) == []


def test_eval_pairs_fp8_with_its_bf16_twin(runner, fake_engine, monkeypatch):
    """Through the CLI: ``--profiles dense,accurate,accurate+fp8,fp8`` pairs accurate+fp8 with
    accurate (fp8's twin, bf16, was not asked for: no row for it), in the JSON and in a line."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "2",
                            "--profiles", "dense,accurate,accurate+fp8,fp8", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert {p["name"]: p["bf16_twin"] for p in data["profiles"]} == \
        {"dense": None, "accurate": None, "accurate+fp8": "accurate", "fp8": None}
    assert [(g["profile"], g["baseline"], g["samples"], g["lost"]) for g in data["against_bf16"]] == \
        [("accurate+fp8", "accurate", 2, 0)]
    err = " ".join(r.stderr.split())
    assert "at 1k accurate+fp8 against accurate (the same profile at BF16) on the same 2 samples: 0 lost" in err


def test_missing_notes_says_one_sample_in_the_singular():
    """An interrupted --samples 1 run: 'none of its 1 sample', not '1 samples'."""
    from fpcli.ruler.render import missing_notes

    notes = missing_notes({"interrupted": True, "missing": [{"profile": "accurate", "answered": 0, "samples": 1}]})
    assert notes == ["interrupted (Ctrl-C), the table is partial: profile accurate answered none of its 1 sample "
                     "(no cells)"]


def test_eval_says_density_is_per_profile_when_dense_layers_differ(runner, fake_engine, monkeypatch):
    """``bf16`` (2 dense layers) beside ``accurate`` (12): the report carries each profile's
    ``dense_layers`` and a line says the density columns are not over the same layers; the same
    ``dense_layers`` everywhere (bf16 and fp8) gets no such line."""
    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", "dense,bf16,accurate", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [p["dense_layers"] for p in data["profiles"]] == [None, 2, 12]
    err = " ".join(r.stderr.split())
    assert "density is over each profile's own sparse layers (dense_layers: bf16 2, accurate 12)" in err
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", "dense,bf16,fp8"])
    assert r.exit_code == 0, r.stderr
    assert "own sparse layers" not in r.stderr


def test_eval_names_a_set_of_dense_layers_by_its_ranges(runner, fake_engine, monkeypatch):
    """A lab profile whose dense layers are a set (``[0, 1, 8-11]``) beside ``accurate``: the
    report writes the set as a list, and the density line names it by its ranges."""
    from fpcli.ruler.render import density_scope_notes

    monkeypatch.setenv("FP_FAKE_CONTEXT", "8192")
    lab = Path(__file__).resolve().parent.parent / "scripts" / "lab" / "profiles" / "bf16-dl0189.yaml"
    r = runner.invoke(app, ["eval", "--len", "1k", "--task", "niah_single", "--samples", "1",
                            "--profiles", f"accurate,{lab}", "--json"])
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert [p["dense_layers"] for p in data["profiles"]] == [12, [0, 1, 8, 9, 10, 11]]
    err = " ".join(r.stderr.split())
    assert "(dense_layers: accurate 12, bf16-dl0189 [0-1, 8-11])" in err, err
    same = {"profiles": [{"name": "a", "dense_layers": [0, 1, 8]}, {"name": "b", "dense_layers": [0, 1, 8]}]}
    assert density_scope_notes(same) == []  # equal sets, read back from JSON as lists


def test_sign_test_p_is_the_two_sided_binomial_tail():
    """``sign_test_p`` against the binomial tail summed here term by term (n = lost + won, p = 1/2),
    and its edges: nothing changed, an even split, a lopsided one, order of the arguments."""
    from math import factorial

    from fpcli.ruler.scoring import sign_test_p

    def tail(k, n):  # P(X <= k), X ~ Binomial(n, 1/2)
        return sum(factorial(n) // (factorial(i) * factorial(n - i)) for i in range(k + 1)) / 2 ** n

    assert sign_test_p(0, 0) == 1.0
    assert sign_test_p(1, 0) == 1.0 and sign_test_p(3, 3) == 1.0
    assert sign_test_p(6, 0) == sign_test_p(0, 6) == 2 * 0.5 ** 6
    assert abs(sign_test_p(16, 2) - 2 * tail(2, 18)) < 1e-15 and sign_test_p(16, 2) < 0.002
    assert abs(sign_test_p(3, 0) - 0.25) < 1e-15  # fp8 at 32K over 108 samples: far from a verdict
    with pytest.raises(ValueError, match="lost and won"):
        sign_test_p(-1, 2)
