"""Lab: where the cold start of the SGLang engine goes (H200, one device call, <= 240 s).

    source .fpdev/bin/env.sh && python scripts/lab/cold_start.py --budget 230

Each configuration runs in a fresh child process (this script with ``--child NAME``), the way an
in-process ``fp ask`` starts its engine: Qwen2.5-Coder-0.5B at 131,072 tokens with YaRN, profile
bf16, SGLang's log at ``info`` with millisecond timestamps (``SGLANG_LOG_MS=1``, SGLang's own
variable) and an empty Triton cache of its own (``TRITON_CACHE_DIR``, Triton's variable), so both
configurations compile from scratch. The child times its own stages; this process parses SGLang's
lines (strings read in SGLang 0.5.17: ``Init torch distributed begin.``, ``Load weight begin.``,
``Load weight end. elapsed=``, ``KV Cache is allocated. ... #tokens: N``, ``Memory pool end.``,
``Capture target decode CUDA graph begin. ... bs=[...]`` / ``... end. elapsed=``) into a breakdown.

Configurations: ``new`` = what ``fp ask`` runs now (``max_requests=1``: one decode graph, a KV pool
of one context, no tokenizer in SGLang's processes); ``old`` = the settings before (graphs for
1, 2, 4, 8, ``mem_fraction_static`` alone sizing the pool, SGLang's tokenizers). Both warm up to
the full context. Then ``fp ask --no-server FILE Q --json`` cold, as a user
runs it, with the ``new`` run's Triton cache (a user's second ever ``fp ask``) when time is left.

``transformers`` = the engine ``fp ask`` picks without ``--engine`` for one question in-process
(``TransformersEngine`` on CUDA, one process): process start -> imports (torch, transformers,
the operator) -> tokenizer -> weights -> first token -> answer. ``--ask-engine auto`` runs the
cold ``fp ask --no-server`` with no ``--engine`` (the transformers engine on a GPU). E.g.::

    source .fpdev/bin/env.sh && python scripts/lab/cold_start.py --configs transformers --ask-engine auto --budget 200

Writes ``$OUT/cold_start.json`` and the children's logs; prints a table. Lab tooling: never
imported by the product.
"""
from __future__ import annotations

import time

T0 = time.time()  # the child's process start as seen by Python (before the heavy imports)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

QWEN = "qwen2.5-coder-0.5b-instruct"
CONTEXT = 131072
PROMPT_TOKENS = 100_000
QUESTION = "What is the secret code mentioned in the text? Answer with the number only."

# SGLang 0.5.17 log lines -> event names (first match wins; the timestamp is the line's)
EVENTS = [
    ("scheduler_up", re.compile(r"Init torch distributed begin")),
    ("weights_begin", re.compile(r"Load weight begin")),
    ("weights_end", re.compile(r"Load weight end\. elapsed=(?P<s>[\d.]+) s")),
    ("kv_allocated", re.compile(r"KV Cache is allocated\. .*#tokens: (?P<tokens>\d+), (?:K size: (?P<k>[\d.]+) GB, V size: (?P<v>[\d.]+) GB|KV size: (?P<kv>[\d.]+) GB)")),
    ("pool_end", re.compile(r"Memory pool end")),
    ("graphs_begin", re.compile(r"Capture target decode CUDA graph begin\..*bs=(?P<bs>\[[^\]]*\])")),
    ("graphs_end", re.compile(r"Capture target decode CUDA graph end\. elapsed=(?P<s>[\d.]+) s")),
]
STAMP = re.compile(r"^\[(?P<t>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.(?P<ms>\d{3}))?[^\]]*\] (?P<msg>.*)$")


def parse_log(text: str) -> dict:
    """``{event: {"t": epoch seconds, **named groups}}`` from SGLang's log lines (first of each)."""
    found: dict = {}
    for line in text.splitlines():
        m = STAMP.match(line.strip())
        if not m:
            continue
        t = time.mktime(time.strptime(m["t"], "%Y-%m-%d %H:%M:%S")) + int(m["ms"] or 0) / 1000.0
        for name, rx in EVENTS:
            e = rx.search(m["msg"])
            if e and name not in found:
                found[name] = {"t": t, **{k: v for k, v in e.groupdict().items() if v is not None}}
    return found


def breakdown(child: dict, events: dict) -> dict:
    """Seconds per stage from the child's timestamps and SGLang's lines (``None`` where a line is missing)."""
    def at(name):
        return events.get(name, {}).get("t")

    def span(a, b):
        return round(b - a, 2) if a is not None and b is not None else None

    t = child["t"]
    kv = events.get("kv_allocated", {})
    gb = float(kv["kv"]) if "kv" in kv else (float(kv["k"]) + float(kv["v"]) if "k" in kv else None)
    return {
        "spawn_to_python": span(child["spawned"], t["python"]),
        "imports": span(t["python"], t["imports"]),
        "tokenizer": round(child["start_phases"].get("tokenizer", 0.0), 2),
        "engine_call_to_scheduler_up": span(t["engine_call"], at("scheduler_up")),
        "scheduler_up_to_weights": span(at("scheduler_up"), at("weights_begin")),
        "weights": span(at("weights_begin"), at("weights_end")),
        "kv_pool": span(at("weights_end"), at("pool_end")),
        "kv_pool_tokens": int(kv["tokens"]) if "tokens" in kv else None,
        "kv_pool_gb": gb,
        "pool_to_graphs": span(at("pool_end"), at("graphs_begin")),
        "graph_capture": span(at("graphs_begin"), at("graphs_end")),
        "graph_bs": events.get("graphs_begin", {}).get("bs"),
        "graphs_to_engine_object": span(at("graphs_end") or at("pool_end"), t["engine_object"]),
        "engine_total": round(child["start_phases"].get("engine", 0.0), 2),
        "warmup": round(child["warmup_s"], 2),
        "warmup_lengths": child["warmup_lengths"],
        "ttft_first": round(child["ttft"][0], 3),
        "ttft_second": round(child["ttft"][1], 3) if len(child["ttft"]) > 1 else None,
        "prompt_tokens": child["prompt_tokens"],
        "spawn_to_ready": span(child["spawned"], t["ready"]),
        "spawn_to_first_answer": span(child["spawned"], t["first_answer"]),
    }


# ------------------------------------------------------------------------------------------------
# the child: one engine, as fp ask starts it
# ------------------------------------------------------------------------------------------------


def child(name: str, model: str, out: Path) -> None:
    t = {"python": T0}
    if name == "transformers":
        import fpcli.engine.transformers_engine  # noqa: F401 - the imports an in-process fp ask pays
    else:
        import fpcli.engine.sglang_engine as se
    from fpcli.profiles import load_profile, with_context_length
    from fpcli.ttft import answered, needle_document

    t["imports"] = time.time()
    profile = with_context_length(load_profile("bf16"), CONTEXT)
    if name == "transformers":
        return child_transformers(model, out, t, profile)
    kwargs: dict = {"log_level": "info"}
    if name in ("new", "warm", "nowarm"):
        kwargs["max_requests"] = 1
        kwargs["warmup"] = name != "nowarm"  # "nowarm": the first real request is the warm-up  # as fpcli.commands.obtain_engine loads it for fp ask
    elif name == "old":  # the settings before: SGLang sizes the pool from mem_fraction_static alone
        kwargs["server_overrides"] = {"max_total_tokens": None, "max_running_requests": None,
                                      "skip_tokenizer_init": False}
    else:
        raise SystemExit(f"unknown configuration {name!r} (new, old, warm, nowarm, transformers)")
    t["engine_call"] = time.time()
    eng = se.SGLangEngine(model, profile, **kwargs)
    t["engine_object"] = t["engine_call"] + eng.startup_s + eng.start_phases.get("tokenizer", 0.0)
    t["ready"] = time.time()
    try:
        count = lambda s: len(eng.tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        ttfts, ok, tokens = [], [], 0
        for seed in (21, 22):  # two documents: no radix-cache reuse between them
            text, secret = needle_document(count, PROMPT_TOKENS, seed=seed)
            res = eng.generate(eng.encode_chat(None, text), max_new_tokens=16)  # text ends with the question
            if seed == 21:
                t["first_answer"] = time.time()
            ttfts.append(res.ttft_s)
            ok.append(answered(res.text, secret))
            tokens = res.prompt_tokens
        rec = {"config": name, "t": t, "start_phases": eng.start_phases, "warmup_s": eng.warmup_s,
               "warmup_lengths": eng.warmup_lengths(), "ttft": ttfts, "answered": ok, "prompt_tokens": tokens,
               "server_kwargs": {k: v for k, v in eng.server_kwargs.items() if k != "json_model_override_args"}}
    finally:
        eng.close()
    out.write_text(json.dumps(rec, default=str))


def child_transformers(model: str, out: Path, t: dict, profile) -> None:
    """The transformers engine on CUDA as ``fp ask`` loads it (no ``--engine``, one question):
    start phases from the engine, then two ~100K needles (the first is the cold one)."""
    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.ttft import answered, needle_document

    t["engine_call"] = time.time()
    eng = TransformersEngine(model, profile, reuse_cache=False)  # device: CUDA when visible
    t["ready"] = time.time()
    try:
        ttfts, ok, tokens = [], [], 0
        for seed in (21, 22):
            text, secret = needle_document(eng.count_tokens, PROMPT_TOKENS, seed=seed)
            res = eng.generate(eng.encode_chat(None, text), max_new_tokens=16)
            if seed == 21:
                t["first_answer"] = time.time()
                t["first_token"] = t["first_answer"] - (res.total_s - res.ttft_s)
            ttfts.append(res.ttft_s)
            ok.append(answered(res.text, secret))
            tokens = res.prompt_tokens
        rec = {"config": "transformers", "t": t, "start_phases": eng.start_phases, "warmup_s": 0.0,
               "warmup_lengths": [], "ttft": ttfts, "answered": ok, "prompt_tokens": tokens,
               "device": str(eng.device), "precision": eng.precision, "density": res.stats.density,
               "server_kwargs": {}}
    finally:
        eng.close()
    out.write_text(json.dumps(rec, default=str))


def breakdown_transformers(child: dict) -> dict:
    """Seconds per stage of the ``transformers`` configuration (the child's own timestamps)."""
    t, ph = child["t"], child["start_phases"]

    def span(a, b):
        return round(t[b] - t[a], 2) if a in t and b in t else None

    return {
        "spawn_to_python": round(t["python"] - child["spawned"], 2),
        "imports": span("python", "imports"),
        "tokenizer": round(ph.get("tokenizer", 0.0), 2),
        "weights": round(ph.get("weights", 0.0), 2),
        "engine_total": span("engine_call", "ready"),
        "ttft_first": round(child["ttft"][0], 3),
        "ttft_second": round(child["ttft"][1], 3) if len(child["ttft"]) > 1 else None,
        "prompt_tokens": child["prompt_tokens"],
        "spawn_to_ready": round(t["ready"] - child["spawned"], 2),
        "spawn_to_first_token": round(t["first_token"] - child["spawned"], 2),
        "spawn_to_first_answer": round(t["first_answer"] - child["spawned"], 2),
        "density": child.get("density"),
    }


# ------------------------------------------------------------------------------------------------
# the parent
# ------------------------------------------------------------------------------------------------


def run_child(name: str, model: str, outdir: Path, limit: float) -> dict:
    rec_path, log_path = outdir / f"cold_start_{name}.child.json", outdir / f"cold_start_{name}.log"
    env = dict(os.environ, SGLANG_LOG_MS="1", PYTHONUNBUFFERED="1")
    if name not in ("warm", "nowarm", "transformers"):  # "warm": Triton's own cache, as a user's machine has it after the first run
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{name}-")
    spawned = time.time()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, __file__, "--child", name, "--model", model, "--child-out", str(rec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - spawned
    if rc != 0 or not rec_path.exists():
        tail = log_path.read_text(errors="replace").splitlines()[-8:]
        return {"config": name, "rc": rc, "wall_s": round(wall, 1), "log_tail": tail}
    rec = json.loads(rec_path.read_text())
    rec["spawned"] = spawned
    events = parse_log(log_path.read_text(errors="replace"))
    table = breakdown_transformers(rec) if name == "transformers" else breakdown(rec, events)
    return {"config": name, "rc": 0, "wall_s": round(wall, 1), "triton_cache": env.get("TRITON_CACHE_DIR"),
            "breakdown": table, "answered": rec["answered"], "server_kwargs": rec["server_kwargs"]}


def run_ask(model: str, outdir: Path, limit: float, triton_cache: str | None, engine: str = "sglang") -> dict:
    doc = Path(".fpdocs/beameruserguide.pdf")
    question = "How do I make an item appear only on the second slide of a frame?"
    if not doc.is_file():  # synthetic ~100K-token text
        from fpcli.ttft import needle_document

        text, _ = needle_document(lambda s: len(s) // 4, PROMPT_TOKENS, seed=31)
        doc = outdir / "cold_start_doc.txt"
        doc.write_text(text)
        question = QUESTION
    env = dict(os.environ, **({"TRITON_CACHE_DIR": triton_cache} if triton_cache else {}))
    argv = [sys.executable, "-m", "fpcli.cli", "ask", "--no-server", str(doc), question, "--json",
            "--model", model, "--context", "128k"] + ([] if engine == "auto" else ["--engine", engine])
    t0 = time.time()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=limit)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = "timeout", exc.stdout or "", exc.stderr or ""
    wall = time.time() - t0
    (outdir / "cold_start_ask.err").write_text(err if isinstance(err, str) else err.decode(errors="replace"))
    res = {"config": "fp ask --no-server", "rc": rc, "wall_s": round(wall, 1), "argv": argv[2:]}
    try:
        s = json.loads(out)["summary"]
        res["summary"] = {k: s.get(k) for k in ("engine", "device", "prompt_tokens", "ttft_s", "prefill_s", "wall_s",
                                                "engine_start_s", "engine_start_phases", "stages_s", "density",
                                                "context")}
    except Exception as exc:  # noqa: BLE001 - lab: keep what came back
        res["no_json"] = str(exc)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(os.environ.get("FPDEV_MODELS", ""), QWEN))
    ap.add_argument("--configs", default="new,old", help="comma list of new, old, warm (new with Triton's default, already warm cache), nowarm (warm without the start-up warm-up), transformers (the transformers engine on CUDA, Triton's default cache)")
    ap.add_argument("--ask-engine", default="sglang", choices=["sglang", "transformers", "auto"],
                    help="--engine of the cold fp ask --no-server run (auto: none given, as a user runs it)")
    ap.add_argument("--no-ask", action="store_true", help="skip the fp ask --no-server run")
    ap.add_argument("--budget", type=float, default=230.0, help="seconds for the whole script")
    ap.add_argument("--child")
    ap.add_argument("--child-out")
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.model, Path(a.child_out))
    if not Path(a.model, "config.json").is_file():
        raise SystemExit(f"--model {a.model}: no config.json there (set FPDEV_MODELS or pass --model)")
    outdir = Path(os.environ.get("OUT") or "out-cold-start")
    outdir.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + a.budget
    runs, cache = [], None
    for name in [c for c in a.configs.split(",") if c]:
        left = deadline - time.time()
        if left < 45:
            runs.append({"config": name, "rc": "skipped (budget)"})
            continue
        r = run_child(name, a.model, outdir, left - 5)
        cache = cache or r.get("triton_cache")
        runs.append(r)
    if not a.no_ask:
        left = deadline - time.time()
        runs.append(run_ask(a.model, outdir, left - 3, cache, a.ask_engine) if left > 30 else
                    {"config": "fp ask --no-server", "rc": "skipped (budget)"})
    (outdir / "cold_start.json").write_text(json.dumps(runs, indent=2, default=str))
    keys = ["spawn_to_python", "imports", "tokenizer", "engine_call_to_scheduler_up", "scheduler_up_to_weights",
            "weights", "kv_pool", "kv_pool_tokens", "kv_pool_gb", "pool_to_graphs", "graph_capture", "graph_bs",
            "graphs_to_engine_object", "engine_total", "warmup", "warmup_lengths", "ttft_first", "ttft_second",
            "prompt_tokens", "spawn_to_ready", "spawn_to_first_token", "spawn_to_first_answer", "density"]
    shown = [r for r in runs if "breakdown" in r]
    if shown:
        print(f"{'stage (s)':32}" + "".join(f"{r['config']:>22}" for r in shown))
        for k in keys:
            print(f"{k:32}" + "".join(f"{str(r['breakdown'].get(k)):>22}" for r in shown))
        print(f"{'answered':32}" + "".join(f"{str(r['answered']):>22}" for r in shown))
    for r in runs:
        if "breakdown" not in r:
            print(r["config"], json.dumps({k: v for k, v in r.items() if k != "config"}, default=str)[:1500])
    print(f"wrote {outdir / 'cold_start.json'}")


if __name__ == "__main__":
    main()
