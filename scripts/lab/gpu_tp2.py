"""Device check for issue 3: ``fp serve --tp 2`` (tensor parallelism over two GPUs) with the
flashprefill prefill backend, driven over SGLang's OpenAI-compatible HTTP API.

    python scripts/lab/gpu_tp2.py --model $FPDEV_MODELS/qwen2.5-coder-0.5b-instruct --out $OUT/tp2 [--dense]

The HTTP server imports packages the device stage does not carry: run ``scripts/lab/serve_wheels.sh``
here first and install ``.whl`` on the device (that script says how).

Starts ``python -m fpcli.cli serve --model-path M --tp 2 ...`` (the ``fp serve`` command), waits for
``/v1/models``, sends a planted-needle prompt of ``--tokens`` tokens as a streamed chat completion
(greedy, twice: the first one compiles kernels) and a short question, measures TTFT (request sent
to first streamed token, wall clock, the HTTP path included), checks the needle, stops the server
(SIGINT, then the process group) and checks that it exited. ``--dense`` repeats the same with
``--profile dense`` for a same-run baseline. The server logs show, per TP rank, the backend's
geometry (``flashprefill backend: ... heads q=7 kv=1``) and ``first sparse prefill on tp rank N``;
both are counted. Writes ``tp2.json`` and the server logs under ``--out``; prints a short table.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fpcli.ttft import answered, needle_document  # noqa: E402


def _auth() -> dict:
    """``fp serve --port`` needs the bearer token it writes to a 0600 file in the runtime folder."""
    from fpcli.server.paths import default_paths

    try:
        return {"Authorization": "Bearer " + default_paths().token.read_text().strip()}
    except OSError:
        return {}


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_auth()), timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def stream_chat(base: str, text: str, max_tokens: int = 16, timeout: float = 300.0) -> dict:
    """One streamed greedy chat completion: TTFT (s), total (s) and the answer text."""
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": text}], "stream": True,
                       "temperature": 0.0, "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", **_auth()})
    t0 = time.perf_counter()
    ttft, parts = None, []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            for ch in chunk.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(piece)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "answer": "".join(parts)}


def run_server(model: str, profile: str, port: int, out: Path, tokens: int, tp: int, timeout_s: float) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    text, secret = needle_document(count, tokens, depth=0.5, seed=3)
    log_path = out / f"server-{profile}.log"
    cmd = [sys.executable, "-m", "fpcli.cli", "serve", "--profile", profile, "--model-path", model,
           "--tp", str(tp), "--port", str(port), "--mem-fraction-static", "0.5", "--log-level", "info",
           "--cuda-graph-max-bs-decode", "8"]
    res: dict = {"profile": profile, "tp": tp, "cmd": " ".join(cmd), "prompt_tokens_approx": tokens, "secret": secret}
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            while _get(base + "/v1/models") != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
                if time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")
                time.sleep(1.0)
            res["ready_s"] = round(time.perf_counter() - t0, 1)
            runs = [stream_chat(base, text) for _ in range(2)]   # the first one JIT-compiles
            res["ttft_first_s"] = runs[0]["ttft_s"]
            res["ttft_s"] = runs[1]["ttft_s"]
            res["answer"] = runs[1]["answer"].strip()[:80]
            res["needle"] = answered(runs[1]["answer"], secret)
            short = stream_chat(base, "What is the capital of France? Answer in one word.", max_tokens=8)
            res["short_answer"] = short["answer"].strip()[:40]
        except Exception as exc:  # report, still stop the server
            res["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            t1 = time.perf_counter()
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
            res["stop_s"] = round(time.perf_counter() - t1, 1)
            res["exit_code"] = proc.poll()
            # whatever of the server's process group is still there (scheduler / detokenizer
            # children that outlived the main process) must not hold the GPUs for the next run
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if proc.poll() is None:
                proc.wait(timeout=30)
    log_text = log_path.read_text(errors="replace")
    res["backend_ranks"] = sorted(set(re.findall(r"TP(\d+).*flashprefill backend: layers", log_text)))
    res["backend_lines"] = len(re.findall(r"flashprefill backend: layers", log_text))
    res["sparse_ranks"] = sorted(set(re.findall(r"first sparse prefill on tp rank (\d+)", log_text)))
    res["geometry"] = sorted(set(re.findall(r"heads q=(\d+) kv=(\d+)", log_text)))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default="out-tp2")
    ap.add_argument("--tokens", type=int, default=24000, help="needle prompt length (tokens)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--dense", action="store_true", help="also run the same server with --profile dense")
    ap.add_argument("--timeout", type=float, default=300.0, help="server start limit (s)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # a `timeout` around this script sends SIGTERM: turn it into SystemExit so the `finally` that
    # stops the server runs (else a TP=2 server keeps half of both GPUs on a warm machine)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[dict] = []

    def save() -> None:   # after every server: a cut run keeps what it measured
        (out / "tp2.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows},
                                                 indent=2))

    for profile, port in [("bf16", a.port)] + ([("dense", a.port + 1)] if a.dense else []):
        rows.append(run_server(a.model, profile, port, out, a.tokens, a.tp, a.timeout))
        save()
    print(f"{'profile':8} {'tp':>2} {'ready s':>8} {'TTFT s':>8} {'1st TTFT':>9} {'needle':>6} {'exit':>5} "
          f"{'stop s':>6}  ranks(backend/sparse)  answer")
    for r in rows:
        print(f"{r['profile']:8} {r['tp']:>2} {r.get('ready_s', float('nan')):>8} {r.get('ttft_s') or float('nan'):>8.3f} "
              f"{r.get('ttft_first_s') or float('nan'):>9.3f} {str(r.get('needle')):>6} {str(r.get('exit_code')):>5} "
              f"{r.get('stop_s')!s:>6}  {','.join(r['backend_ranks'])}/{','.join(r['sparse_ranks'])}  "
              f"{r.get('answer', r.get('error', ''))!r}")
    ok = all("error" not in r and r.get("needle") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
