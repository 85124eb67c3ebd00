"""The wait outside the model in ``fp ask``: ingestion and prompt fitting with and without the
document/fit cache (``fpcli.doccache``), and a repeat ``fp ask`` through a resident engine.

Usage (CPU; FP_CACHE_DIR pointing at the pulled models)::

    FP_CACHE_DIR=/tmp/models-fpcache python scripts/bench_fastpath.py PDF [--qwen] [--resident]

Prints one JSON object: seconds per piece (median of ``--repeat`` runs), and with ``--resident``
the ``summary.stages_s`` and ``wall_s`` of a cold (cache emptied) and a repeat ``fp ask -n 1``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

QUESTIONS = ("What does the frame environment do?", "How do I make an overlay appear on the second slide?")


def _timed(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def pieces(pdf: str, model: str, context: int | None, repeat: int) -> dict:
    from fpcli.doccache import CacheConfig, DiskCache, fit_cache_for
    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.ingest import ingest
    from fpcli.models import resolve_model
    from fpcli.profiles import load_profile
    from fpcli.prompt import build_prompt

    root = Path(tempfile.mkdtemp(prefix="fp-bench-cache-"))
    config = CacheConfig(root=root)
    out: dict = {"model": model}
    out["ingest_uncached_s"], docs = _timed(lambda: ingest([pdf]), repeat)
    ingest([pdf], cache=DiskCache(config, "documents"))
    out["ingest_cached_s"], cached = _timed(lambda: ingest([pdf], cache=DiskCache(config, "documents")), repeat)
    assert cached[0].from_cache and cached[0].text == docs[0].text
    profile = load_profile("bf16")
    if context:
        profile = dataclasses.replace(profile, engine=dataclasses.replace(profile.engine, context_length=context))
    with TransformersEngine(resolve_model(model), profile, model_name=model) as eng:
        out["context_length"] = eng.context_length
        fits = fit_cache_for(config, eng.model_path)
        out["fit_uncached_s"], plain = _timed(lambda: build_prompt(docs, QUESTIONS[0], eng, 1), repeat)
        build_prompt(docs, QUESTIONS[0], eng, 1, fit_cache=fits)
        out["fit_cached_s"], warm = _timed(lambda: build_prompt(docs, QUESTIONS[1], eng, 1, fit_cache=fits), repeat)
        assert warm.ids == build_prompt(docs, QUESTIONS[1], eng, 1).ids
        out["prompt_tokens"] = plain.tokens
    shutil.rmtree(root, ignore_errors=True)
    return out


def resident(pdf: str, fp: str) -> dict:
    from fpcli.doccache import default_config

    subprocess.run([fp, "start", "--engine", "transformers"], check=True, capture_output=True)
    try:
        shutil.rmtree(default_config().root, ignore_errors=True)  # cold: nothing cached
        runs = {}
        for label, q in (("cold", QUESTIONS[0]), ("repeat", QUESTIONS[1])):
            t = time.perf_counter()
            proc = subprocess.run([fp, "ask", pdf, q, "-n", "1", "--json"], capture_output=True, text=True, check=True)
            s = json.loads(proc.stdout)["summary"]
            runs[label] = {"measured_wall_s": time.perf_counter() - t, "wall_s": s["wall_s"],
                           "stages_s": s["stages_s"], "prompt_tokens": s["prompt_tokens"],
                           "cached_tokens": s["cached_tokens"], "server": s["server"] is not None}
        return runs
    finally:
        subprocess.run([fp, "stop"], capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pdf")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--qwen", action="store_true", help="also time the fit with qwen2.5-coder-0.5b (128K context)")
    ap.add_argument("--resident", action="store_true", help="also time fp ask through a resident engine")
    ap.add_argument("--fp", default="fp", help="the fp executable")
    args = ap.parse_args()
    result = {"smollm2": pieces(args.pdf, "smollm2-135m-instruct", None, args.repeat)}
    if args.qwen:
        result["qwen"] = pieces(args.pdf, "qwen2.5-coder-0.5b", 131072, args.repeat)
    if args.resident:
        result["resident"] = resident(args.pdf, args.fp)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
