"""Time (and optionally profile) the read and fit stages of a first ``fp ask`` on a new document.

The same calls as ``fp ask``: ``fpcli.ingest.ingest`` with an empty document cache, then
``fpcli.prompt.build_prompt`` with an empty fit cache, at a given context (131,072 by default) and
256 new tokens, with the real tokenizer of a model folder (no weights loaded: the engine's
tokenizer methods on a tokenizer-only object). ``--remote`` goes through the resident engine's
HTTP application (``fpcli.server.app``, served by uvicorn on a loopback port, ``RemoteEngine``
as the client), as a resident ``fp ask`` does.

    python scripts/lab/fit_profile.py /path/to/qwen-folder doc.pdf [--remote] [--profile out.prof]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path


class TokenizerEngine:
    """The tokenizer part of ``TransformersEngine`` (its own methods), without weights."""

    name = "transformers"
    start_s = 0.0

    def __init__(self, folder: str, context_length: int) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model_path = folder
        self.model_name = Path(folder).name
        self.context_length = context_length
        self.precision = "bf16"

    from fpcli.engine.transformers_engine import TransformersEngine as _T

    encode_chat = _T.encode_chat
    count_tokens = _T.count_tokens
    token_starts = _T.token_starts
    del _T


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("files", nargs="+")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--remote", action="store_true")
    ap.add_argument("--profile")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()

    from fpcli.doccache import CacheConfig, DiskCache, fit_cache_for
    from fpcli.ingest import ingest
    from fpcli.prompt import build_prompt

    engine = TokenizerEngine(args.model, args.context)
    server = None
    if args.remote:
        engine, server = serve(engine)
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            config = CacheConfig(root=Path(tmp))
            prof = cProfile.Profile() if args.profile else None
            prof and prof.enable()
            t0 = time.perf_counter()
            docs = ingest(args.files, cache=DiskCache(config, "documents"))
            t1 = time.perf_counter()
            prompt = build_prompt([d for d in docs if d.ok], "What does the document say about overlays?", engine,
                                  args.max_new_tokens, cut="middle", fit_cache=fit_cache_for(config, args.model))
            t2 = time.perf_counter()
            prof and prof.disable()
        chars = sum(len(d.text) for d in docs)
        print(f"read {t1 - t0:.3f} s  fit {t2 - t1:.3f} s  chars {chars:,}  doc_tokens {prompt.doc_tokens}  "
              f"prompt {prompt.tokens:,} / budget {prompt.budget:,}  cuts {len(prompt.cuts)}", flush=True)
        if prof:
            prof.dump_stats(args.profile)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if server is not None:
        server.should_exit = True


def serve(engine):
    """``engine`` behind ``fpcli.server.app`` on a loopback port; a ``RemoteEngine`` to it."""
    import threading

    import uvicorn

    from fpcli.server.app import ServerInfo, create_app
    from fpcli.server.client import RemoteEngine
    from fpcli.server.state import ServerState

    sock_path = tempfile.mkdtemp() + "/engine.sock"
    info = ServerInfo(model=engine.model_name, model_path=engine.model_path, profile="bf16", profile_hash="",
                      engine="transformers", context_length=engine.context_length, precision="bf16", version="")
    server = uvicorn.Server(uvicorn.Config(create_app(engine, info), uds=sock_path, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    state = ServerState(pid=0, address=f"unix:{sock_path}", model=engine.model_name, model_path=engine.model_path,
                        profile="bf16", profile_hash="", engine="transformers", started_at=time.time(), version="")
    remote = RemoteEngine(state, {"engine": "transformers", "model": engine.model_name, "precision": "bf16",
                                  "context_length": engine.context_length, "profile": "bf16"})
    return remote, server


if __name__ == "__main__":
    main()
