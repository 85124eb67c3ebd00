"""scripts/lab/decode_profile.py: its per-step profile table from a real ``torch.profiler`` run,
the forward-hook step clock, and its synthetic prompt through a real engine's tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import decode_profile  # noqa: E402  (scripts/lab is not a package)

from fpcli.engine.transformers_engine import TransformersEngine  # noqa: E402
from fpcli.profiles import load_profile  # noqa: E402
from test_transformers_engine import model_dir  # noqa: E402,F401 - the tiny chat model fixture


def test_profile_table_counts_ops_per_step():
    from torch.profiler import ProfilerActivity, profile, schedule

    a, b = torch.randn(32, 32), torch.randn(32, 32)
    model = torch.nn.Linear(32, 32)
    clock = decode_profile.StepClock()
    model.register_forward_hook(clock)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=3, repeat=1)) as prof:
        clock.prof = prof
        for _ in range(5):  # 5 "steps", each ending with a forward: 3 profiled
            torch.mm(a, b)
            torch.mm(a, b)
            model(a)
    table = decode_profile.profile_table(prof, 3, "cpu", top=50)
    calls = {r["op"]: r["calls"] for r in table["top"]}
    assert calls["aten::mm"] == 2.0 and calls["aten::linear"] == 1.0, calls
    assert table["syncs_per_step"] == 0 and table["sort"] == "self_cpu_ms"
    assert len(clock.stamps) == 5 and len(clock.step_ms(1)) == 3


def test_synthetic_prompt_has_the_asked_length(model_dir):  # noqa: F811
    with TransformersEngine(model_dir, load_profile("dense")) as eng:
        ids = decode_profile.synthetic_prompt(eng, 500)
        assert abs(len(ids) - 500) <= 8, len(ids)
        assert decode_profile.synthetic_prompt(eng, 500) == ids  # seeded


def test_step_clock_stamps_a_wrapped_graph_replay():
    clock, calls = decode_profile.StepClock(), []
    advance = clock.wrap(lambda: calls.append(1) or torch.tensor([[7]]))
    outs = [advance() for _ in range(3)]
    assert len(calls) == 3 and len(clock.stamps) == 3 and all(int(o) == 7 for o in outs)
    assert clock.stamps == sorted(clock.stamps) and len(clock.step_ms(0)) == 2
