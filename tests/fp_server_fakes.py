"""A fake engine for the resident-engine fault tests (``FP_ENGINE_FACTORY=fp_server_fakes:load``).

Environment knobs (read by ``load`` in the server process):

- ``FP_FAKE_LOAD_S``: seconds the "model load" takes (to make two ``fp start`` overlap).
- ``FP_FAKE_PIECES`` / ``FP_FAKE_STEP_S``: answer pieces and seconds per decode step.
- ``FP_FAKE_PREFILL_STEPS``: prefill steps (``on_progress(i, n)`` after each, like the
  transformers engine's per-layer calls), ``FP_FAKE_STEP_S`` seconds each (default 0: none).
- ``FP_FAKE_TRACE``: a file that gets one line per event: ``load PID``, ``child PID``,
  ``start N`` (a generation of N prompt tokens began), ``stop N K`` (it ended after K pieces,
  raised from on_text), ``done N K``, ``args ...`` (the engine settings it was given, if any).
- ``FP_FAKE_ENGINE_NAME``: the engine's ``name`` (e.g. ``sglang``: a server that says it runs SGLang).
- ``FP_FAKE_RESERVE``: the engine's ``context_reserve`` (tokens, any answer length); unset: none.
- ``FP_FAKE_CHILD=1``: the engine starts a ``sleep`` child (like SGLang's scheduler) and leaks it
  (``close`` leaves it running): ``fp stop`` must still leave no process behind.
"""
from __future__ import annotations

import os
import subprocess
import time

from fp_fakes import FakeEngine
from fpcli.engine.base import GenerationResult


def _trace(line: str) -> None:
    path = os.environ.get("FP_FAKE_TRACE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


class SlowFakeEngine(FakeEngine):
    """``FakeEngine`` whose ``generate`` takes ``step_s`` per piece and calls ``on_text`` every step
    (so a raising ``on_text`` stops it, as in the real engines)."""

    def __init__(self, pieces: int, step_s: float, prefill_steps: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.pieces, self.step_s, self.prefill_steps = pieces, step_s, prefill_steps
        self.child = None

    def generate(self, prompt_ids, max_new_tokens=256, temperature=0.0, on_text=None, on_progress=None,
                 on_cached=None) -> GenerationResult:
        n = len(prompt_ids)
        _trace(f"start {n}")
        t0 = time.perf_counter()
        out = []
        try:
            for i in range(self.prefill_steps):
                time.sleep(self.step_s)
                if on_progress is not None:
                    on_progress(i + 1, self.prefill_steps)
            for i in range(min(self.pieces, max_new_tokens)):
                time.sleep(self.step_s)
                out.append(f"w{i} ")
                if on_text is not None:
                    on_text(out[-1])
        except BaseException:
            _trace(f"stop {n} {len(out)}")
            raise
        _trace(f"done {n} {len(out)}")
        total = time.perf_counter() - t0
        return GenerationResult(text="".join(out), prompt_tokens=n, output_tokens=len(out), ttft_s=self.step_s,
                                prefill_s=self.step_s, total_s=total, engine=self.name, model=self.model_name,
                                profile=self.profile, stats=self.stats_for(n), finish_reason="length",
                                precision=self.precision)


def load(engine="auto", model=None, profile=None, progress=None, **kwargs) -> SlowFakeEngine:
    time.sleep(float(os.environ.get("FP_FAKE_LOAD_S", "0")))
    _trace(f"load {os.getpid()}")
    if kwargs.get("engine_args"):
        _trace("args " + " ".join(kwargs["engine_args"]))
    eng = SlowFakeEngine(pieces=int(os.environ.get("FP_FAKE_PIECES", "5")),
                         step_s=float(os.environ.get("FP_FAKE_STEP_S", "0.05")),
                         prefill_steps=int(os.environ.get("FP_FAKE_PREFILL_STEPS", "0")),
                         profile=getattr(profile, "name", str(profile)),
                         model_name=os.path.basename(str(model)) if model else "fake-model")
    eng.name = os.environ.get("FP_FAKE_ENGINE_NAME", eng.name)
    if os.environ.get("FP_FAKE_DEVICE"):  # where it runs, as the transformers engine's ``device`` says
        eng.device = os.environ["FP_FAKE_DEVICE"]
    if os.environ.get("FP_FAKE_RESERVE"):
        reserve = int(os.environ["FP_FAKE_RESERVE"])
        eng.context_reserve = lambda max_new_tokens: reserve
    if os.environ.get("FP_FAKE_CHILD") == "1":
        eng.child = subprocess.Popen(["sleep", "300"])
        _trace(f"child {eng.child.pid}")
    return eng
