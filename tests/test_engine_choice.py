"""Which engine ``auto`` resolves to (``fpcli.engine.choose_engine``) and the default model of its
device (``fpcli.models.default_model``, ``fpcli.engine.engine_device``): a command that sends one
prompt in-process gets the transformers engine (it starts in one process), on the CUDA GPU when
there is one, with the GPU's default model; commands of many requests keep SGLang."""
from __future__ import annotations

import pytest

from fpcli.engine import EngineUnavailable, choose_engine, engine_device
from fpcli.models import DEFAULT_CONTEXT_GPU, DEFAULT_MODEL, QWEN_CODER, DefaultModel, default_model

CUDA_AND_SGLANG = lambda: None  # noqa: E731 - nothing missing: SGLang could run
NO_CUDA = lambda: "no CUDA GPU is visible"  # noqa: E731


def never_probed():
    raise AssertionError("the SGLang/CUDA probe ran where the choice does not need it")


@pytest.mark.parametrize("one_request, expected", [(True, "transformers"), (False, "sglang")])
def test_auto_with_cuda_and_sglang_one_prompt_gets_transformers_many_get_sglang(one_request, expected):
    assert choose_engine("auto", CUDA_AND_SGLANG, one_request=one_request) == expected


def test_auto_one_request_needs_no_probe():
    assert choose_engine("auto", never_probed, one_request=True) == "transformers"


def test_auto_one_request_uses_a_resident_sglang_engine_without_probing():
    assert choose_engine("auto", never_probed, running="sglang", one_request=True) == "sglang"


def test_auto_one_request_beside_a_resident_transformers_engine_gets_transformers():
    assert choose_engine("auto", never_probed, running="transformers", one_request=True) == "transformers"


def test_auto_without_cuda_is_transformers():
    assert choose_engine("auto", NO_CUDA) == "transformers"
    assert choose_engine("auto", NO_CUDA, one_request=True) == "transformers"


def test_engine_sglang_is_forced_for_one_request():
    assert choose_engine("sglang", CUDA_AND_SGLANG, one_request=True) == "sglang"


def test_engine_sglang_without_cuda_names_the_reason():
    with pytest.raises(EngineUnavailable, match="no CUDA GPU is visible.*--engine transformers"):
        choose_engine("sglang", NO_CUDA, one_request=True)


def test_engine_transformers_is_kept():
    assert choose_engine("transformers", never_probed) == "transformers"


def test_unknown_engine():
    with pytest.raises(ValueError, match="unknown engine 'vllm'"):
        choose_engine("vllm", never_probed)


def test_default_model_follows_the_device():
    gpu = DefaultModel(QWEN_CODER, DEFAULT_CONTEXT_GPU)
    assert default_model("sglang") == gpu
    assert default_model("transformers", "cuda") == gpu  # same model and context as SGLang on a GPU
    assert default_model("transformers", "cpu") == DefaultModel(DEFAULT_MODEL)
    assert default_model("transformers") == DefaultModel(DEFAULT_MODEL)
    with pytest.raises(ValueError, match="device: expected 'cuda' or 'cpu', got 'tpu'"):
        default_model("transformers", "tpu")


def test_engine_device_of_a_resident_transformers_engine_comes_from_its_state():
    assert engine_device("sglang") == "cuda"
    assert engine_device("transformers", running="transformers", running_device="cuda") == "cuda"
    assert engine_device("transformers", running="transformers", running_device="cpu") == "cpu"


def test_a_client_beside_a_resident_transformers_engine_on_the_gpu_gets_the_gpu_default():
    """``fp ask`` (one prompt, no ``--model``) beside a resident transformers engine on a GPU:
    the default comes from the state's device (no CUDA probe), so it matches the engine that
    ``fp start`` loaded with defaults there."""
    from fpcli.engine import resolve_request

    engine, model, profile = resolve_request("auto", None, "bf16", running="transformers", one_request=True,
                                             running_device="cuda")
    assert (engine, model, profile.engine.context_length) == ("transformers", QWEN_CODER, DEFAULT_CONTEXT_GPU)
    engine, model, profile = resolve_request("auto", None, "bf16", running="transformers", one_request=True,
                                             running_device="cpu")
    assert (engine, model, profile.engine.context_length) == ("transformers", DEFAULT_MODEL, None)


def test_the_resident_hint_follows_a_cold_answer_on_the_gpu_only():
    import io
    import types

    import torch
    from rich.console import Console

    from fpcli.commands.ask import render_resident_hint

    for device, shown in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        out = io.StringIO()
        render_resident_hint(Console(file=out, width=200), types.SimpleNamespace(name="transformers", device=device))
        assert ("`fp start` keeps an engine resident" in out.getvalue()) == shown, out.getvalue()


def test_the_resident_hint_names_the_fp_start_options_this_ask_needs():
    """A cold answer with --model/--profile/--context/--engine: a plain ``fp start`` would load the
    defaults, which this ``fp ask`` does not use (it would run in-process again); the hint names
    the options that make the resident engine match."""
    import io
    import types

    import torch
    from rich.console import Console

    from fpcli.commands.ask import render_resident_hint, start_args

    args = start_args("./my model", "dense", "32k", "transformers")
    assert args == ["--model", "./my model", "--profile", "dense", "--context", "32k", "--engine", "transformers"]
    assert start_args(None, "bf16", None, "auto") == []
    out = io.StringIO()
    render_resident_hint(Console(file=out, width=300), types.SimpleNamespace(name="transformers", device=torch.device("cuda", 0)),
                         args)
    assert ("`fp start --model './my model' --profile dense --context 32k --engine transformers` keeps an engine "
            "resident") in out.getvalue(), out.getvalue()
