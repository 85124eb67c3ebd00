"""One SGLang engine in its own process, for ``tests/gpu/test_sglang_engine.py``.

    python tests/gpu/sglang_worker.py SPEC.json RESULT.json

The test module starts several of these at once (their start-up, mostly imports in SGLang's
spawned children, overlaps) instead of starting one engine after another in the test process.
Every worker also is an instance of "the engine starts with decode CUDA graphs on and the process
exits promptly after ``close()``": it writes ``closed_t`` and the parent times the exit.

SPEC keys: ``name``, ``model``, ``profile`` ("bf16" or "dense"), ``overrides`` (ServerArgs),
``min_sparse_len`` (optional, replaces the profile's), ``rope_scaling_factor`` (optional),
``requests``: a list of ``{"key", "ids" | "needle_tokens" + "seed", "max_new_tokens" | "logprobs"}``.

RESULT: ``{"name", "startup_s", "warmup_s", "decode_graph", "results": {key: {...}}, "closed_t",
"error"}``, written twice (before and after ``close()``), so a hang at exit still leaves results.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "kernels", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _write(path: str, out: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)


def run(spec: dict, result_path: str) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from fpcli.ttft import answered, needle_prompt
    from fpcli.engine.sglang_engine import SGLangEngine
    from fpcli.profiles import load_profile

    out: dict = {"name": spec["name"], "results": {}, "error": None, "closed_t": None}
    prof = load_profile("bf16")
    if spec.get("profile") == "dense":
        prof = prof.replace(attention="dense")
    if spec.get("min_sparse_len") is not None:
        prof = prof.replace(sparse=prof.sparse.replace(min_sparse_len=int(spec["min_sparse_len"])))
    t0 = time.perf_counter()
    try:
        with SGLangEngine(spec["model"], prof, server_overrides=spec.get("overrides") or {},
                          rope_scaling_factor=spec.get("rope_scaling_factor"),
                          log_level="info") as eng:
            out["startup_s"] = round(time.perf_counter() - t0, 2)
            out["warmup_s"] = round(eng.warmup_s, 2)
            cfg = getattr(eng._engine.server_args, "cuda_graph_config", None)
            out["decode_graph"] = str(getattr(getattr(cfg, "decode", None), "backend", None))
            out["disable_cuda_graph"] = bool(getattr(eng._engine.server_args, "disable_cuda_graph", False))
            for req in spec.get("requests", []):
                key = req["key"]
                secret = None
                if "needle_tokens" in req:
                    ids, secret = needle_prompt(eng, int(req["needle_tokens"]), seed=int(req.get("seed", 0)))
                else:
                    ids = [int(x) for x in req["ids"]]
                if req.get("logprobs"):
                    top = eng.first_token_logprobs(ids, k=int(req["logprobs"]))
                    out["results"][key] = {"top": top, "prompt_tokens": len(ids)}
                else:
                    r = eng.generate(ids, max_new_tokens=int(req.get("max_new_tokens", 16)))
                    out["results"][key] = {
                        "text": r.text, "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s, "prefill_s": r.prefill_s,
                        "density": r.stats.density, "density_per_layer": r.stats.density_per_layer,
                        "secret": secret, "answered": answered(r.text, secret) if secret else None,
                    }
                print(f"WORKER {spec['name']} {key}: {json.dumps(out['results'][key])[:300]}", flush=True)
                if req.get("flush"):
                    eng.flush_cache()
            _write(result_path, out)
        out["closed_t"] = time.time()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
        out["closed_t"] = time.time()
        _write(result_path, out)
        print("WORKER ERROR", out["error"], file=sys.stderr, flush=True)
        return 1
    _write(result_path, out)
    print(f"WORKER {spec['name']} CLOSED {out['closed_t']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]))
