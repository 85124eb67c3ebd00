"""Lab: where a decode step of the transformers engine goes (per-step time, top ops, host syncs).

    python scripts/lab/decode_profile.py --len 6000 --steps 32            # CPU, the embedded SmolLM2
    python scripts/lab/decode_profile.py --len 130000 --steps 64 --out $OUT   # H200: Qwen2.5-Coder at 131K
    python scripts/lab/decode_profile.py --model $FPDEV_MODELS/qwen2.5-coder-0.5b-instruct --context 128k \
        --len 130000 --steps 64 --out $OUT                                    # a staged folder
    python scripts/lab/decode_profile.py --len 130000 --steps 64 --cuda-graph --out $OUT   # the graph path

The engine is loaded as ``fp ask`` loads it (``fpcli.engine.load_engine(one_request=True)``: the
transformers engine on the CUDA GPU when there is one, the device's default model and context,
profile ``bf16`` fitted to the model), so the numbers are the product's. The prompt is synthetic
text (seeded random words) cut to ``--len`` tokens by the real tokenizer and wrapped in the chat
template (``encode_chat``).

Two generations of ``--steps`` answer tokens each (EOS does not stop them here: the engine's
``eos_ids`` is emptied, so every run times the same number of steps):

1. timed: the whole prefill, then the decode steps; a forward hook on the model stamps the end of
   every forward, so a step is the time between two stamps (the pick of the token, its host sync,
   the streamed text and the next forward). Reported: tokens/s and the mean / median ms per step
   (the first ``--warmup`` steps left out, and shown apart: on a GPU the first decode step of a
   process loads its kernels, which a short answer's tokens/s includes).
2. profiled: the same prompt again (the kept KV cache leaves one token to prefill) under
   ``torch.profiler`` (CPU, and CUDA on a GPU), stepped by the same hook; the table lists the top
   ops per decode step (self CPU time, CUDA time, calls) and counts the host syncs per step
   (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``; device-to-host
   copies) and the kernel launches per step.

``--cuda-graph``: the engine replays a CUDA graph of one greedy decode step
(``TransformersEngine(decode_graph=True)``, ``fpcli.engine.decode_graph``). The graph is captured
before the timed run for its prompt and answer budget (``decode_graph_for``), and its capture time
is printed apart (the start-up cost of a first answer); a step is then stamped at the end of each
replay (no forward runs in a replay), and the profiler counts ``cudaGraphLaunch`` as a launch. On
the CPU the same static step runs eagerly (no capture).

Prints a short table; ``--out DIR`` writes ``decode_profile.json`` (and ``--trace`` a Chrome trace).
Lab tooling: never imported by the product.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from flashprefill.lengths import parse_length

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
DTOH_OPS = ("Memcpy DtoH",)  # CUDA activity names of device-to-host copies (a sync each when pageable)
LAUNCH_OPS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
QUESTION = "Summarize the text above in one long paragraph."


def synthetic_prompt(eng, n_tokens: int, seed: int = 0) -> list[int]:
    """Chat-template ids of about ``n_tokens`` tokens (the template and ``QUESTION`` included):
    seeded random words cut at a token boundary by the engine's tokenizer, then ``QUESTION``."""
    rng = random.Random(seed)
    words = ["harbor", "ledger", "cargo", "tide", "crane", "manifest", "berth", "pilot", "quay", "vessel",
             "customs", "tonnage", "draft", "anchor", "freight", "dock", "container", "schedule", "port", "storm"]
    text = ""
    while eng.count_tokens(text) < n_tokens + 64:
        text += " ".join(rng.choice(words) for _ in range(max(64, n_tokens // 4))) + ".\n"
    starts = eng.token_starts(text)
    overhead = len(eng.encode_chat(None, "\n\n" + QUESTION))  # the template and the question
    body = text[: starts[min(len(starts) - 1, max(1, n_tokens - overhead))]]
    return eng.encode_chat(None, body + "\n\n" + QUESTION)


class StepClock:
    """A forward hook that stamps the end of every forward of the model (``time.perf_counter``)
    and steps a profiler when one is attached."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.prof = None

    def __call__(self, module, args, output) -> None:
        self.stamps.append(time.perf_counter())
        if self.prof is not None:
            self.prof.step()

    def wrap(self, advance):
        """``advance`` (a ``DecodeGraph``'s) stamped like a forward: a replay runs no forward."""
        def stamped():
            out = advance()
            self(None, None, out)
            return out
        return stamped

    def step_ms(self, skip: int) -> list[float]:
        """Milliseconds between consecutive forwards after the prefill, the first ``skip`` left out."""
        gaps = [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        return gaps[skip:]


def profile_table(prof, steps: int, device: str, top: int) -> dict:
    """Top ops per decode step from a finished ``torch.profiler.profile`` of ``steps`` active steps."""
    rows = []
    syncs = dtoh = launches = 0
    for ev in prof.key_averages():
        name = ev.key
        cuda_us = getattr(ev, "device_time_total", None)
        if cuda_us is None:
            cuda_us = getattr(ev, "cuda_time_total", 0.0)
        if name in SYNC_OPS:
            syncs += ev.count
        if any(name.startswith(p) for p in DTOH_OPS):
            dtoh += ev.count
        if name in LAUNCH_OPS:
            launches += ev.count
        rows.append({"op": name, "calls": ev.count / steps, "self_cpu_ms": ev.self_cpu_time_total / 1e3 / steps,
                     "cpu_ms": ev.cpu_time_total / 1e3 / steps, "cuda_ms": cuda_us / 1e3 / steps})
    key = "cuda_ms" if device == "cuda" else "self_cpu_ms"
    rows.sort(key=lambda r: r[key], reverse=True)
    return {"sort": key, "syncs_per_step": syncs / steps, "dtoh_copies_per_step": dtoh / steps,
            "kernel_launches_per_step": launches / steps, "top": rows[:top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--len", type=parse_length, default=4000, help="prompt tokens, template included (4000, 128k)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--warmup", type=int, default=2, help="decode steps left out of the timing and the profile")
    ap.add_argument("--model", default=None, help="as fp ask --model (default: the device's default model)")
    ap.add_argument("--context", type=parse_length, default=None,
                    help="as fp ask --context (e.g. 128k with --model PATH; the default model has its own)")
    ap.add_argument("--profile", default="bf16", help="as fp ask --profile")
    ap.add_argument("--engine", default="auto", help="as fp ask --engine (auto: transformers, one request)")
    ap.add_argument("--top", type=int, default=15, help="ops in the table")
    ap.add_argument("--no-profile", action="store_true", help="time only (no torch.profiler run)")
    ap.add_argument("--out", type=Path, default=None, help="folder for decode_profile.json")
    ap.add_argument("--trace", action="store_true", help="also write a Chrome trace of the profiled steps (--out)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="decode by replaying a captured CUDA graph of one step (transformers engine, lab setting)")
    args = ap.parse_args()

    import torch

    from fpcli.engine import load_engine
    from fpcli.profiles import load_profile, with_context_length

    prof = load_profile(args.profile)
    if args.context is not None:
        prof = with_context_length(prof, args.context)
    t0 = time.perf_counter()
    eng = load_engine(args.engine, args.model, prof, progress=False, one_request=True, decode_graph=args.cuda_graph)
    start_s = time.perf_counter() - t0
    dev = getattr(getattr(eng, "device", None), "type", "cuda")
    eng.eos_ids = set()  # time exactly --steps steps
    ids = synthetic_prompt(eng, args.len)
    clock = StepClock()
    handle = eng.model.register_forward_hook(clock)
    out: dict = {"engine": eng.name, "model": eng.model_name, "device": dev, "precision": eng.precision,
                 "prompt_tokens": len(ids), "steps": args.steps, "engine_start_s": round(start_s, 2),
                 "torch": torch.__version__, "cuda_graph": args.cuda_graph}
    if dev == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers

        out["transformers"] = transformers.__version__
        if args.cuda_graph:
            graph = eng.decode_graph_for(len(ids) + args.steps + 1)  # what the first answer captures
            out.update(capture_s=round(eng.last_capture_s, 3) if eng.last_capture_s is not None else None,
                       graph_capacity=graph.capacity)
            if graph.graph is not None:  # a replay runs no forward; on the CPU the eager step's forward stamps
                graph.advance = clock.wrap(graph.advance)
        res = eng.generate(ids, max_new_tokens=args.steps + 1)
        first = clock.step_ms(1)[: args.warmup]  # the first decode steps (kernels loaded, first allocations)
        ms = clock.step_ms(1 + args.warmup)  # gaps after the prefill's forward
        out.update(ttft_s=round(res.ttft_s, 3), output_tokens=res.output_tokens,
                   step_ms_mean=round(statistics.fmean(ms), 3), step_ms_median=round(statistics.median(ms), 3),
                   tokens_per_s=round(1e3 / statistics.fmean(ms), 2), step_ms=[round(x, 3) for x in ms],
                   first_steps_ms=[round(x, 3) for x in first])
        if not args.no_profile:
            from torch.profiler import ProfilerActivity, profile, schedule

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
            active = max(1, args.steps - args.warmup - 1)
            with profile(activities=acts, schedule=schedule(wait=1, warmup=args.warmup, active=active, repeat=1)) as prof:
                clock.prof = prof
                eng.generate(ids, max_new_tokens=args.steps + 1)
                clock.prof = None
            out["profile"] = profile_table(prof, active, dev, args.top)
            if args.trace and args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.out / "decode_trace.json"))
    finally:
        handle.remove()
        eng.close()

    print(f"{out['engine']} engine, {out['model']} on {dev}" + (f" ({out['gpu']})" if dev == "cuda" else "")
          + f", {out['precision']}: prompt {out['prompt_tokens']:,} tokens, TTFT {out['ttft_s']:.3f} s")
    if args.cuda_graph:
        cap = out["capture_s"]
        print(f"CUDA graph: {out['graph_capacity']:,} KV tokens, capture "
              + (f"{cap:.3f} s (warm-up included; start-up of the first answer)" if cap is not None else "none (CPU: eager static step)"))
    print(f"decode: {out['tokens_per_s']:.2f} tokens/s, {out['step_ms_mean']:.2f} ms/step mean, "
          f"{out['step_ms_median']:.2f} median ({len(out['step_ms'])} steps; the first {len(out['first_steps_ms'])}: "
          f"{', '.join(f'{x:.1f}' for x in out['first_steps_ms'])} ms)")
    if "profile" in out:
        p = out["profile"]
        print(f"per step: {p['syncs_per_step']:.1f} host syncs, {p['dtoh_copies_per_step']:.1f} DtoH copies, "
              f"{p['kernel_launches_per_step']:.0f} kernel launches (profiled; sorted by {p['sort']})")
        print(f"{'op':48} {'calls':>6} {'self CPU ms':>11} {'CPU ms':>8} {'CUDA ms':>8}")
        for r in p["top"]:
            print(f"{r['op'][:48]:48} {r['calls']:6.1f} {r['self_cpu_ms']:11.3f} {r['cpu_ms']:8.3f} {r['cuda_ms']:8.3f}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode_profile.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
