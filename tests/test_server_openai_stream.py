"""The OpenAI-compatible stream of the resident engine's app (``fpcli.server.app``) while the
real transformers engine prefills: its per-layer progress must not starve the stream of keep-alive
comments (an SSE client with a read timeout hears nothing else before the first token)."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")


def test_an_openai_stream_hears_the_prefill_even_when_progress_outpaces_the_heartbeat(smollm2):
    from fastapi.testclient import TestClient

    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.profiles import load_profile
    from fpcli.server.app import ServerInfo, create_app

    engine = TransformersEngine(smollm2, load_profile("dense"), device="cpu")
    info = ServerInfo(model=engine.model_name, model_path=str(smollm2), profile="dense", profile_hash="x",
                      engine=engine.name, context_length=engine.context_length, precision=engine.precision,
                      version="test", device="cpu")
    # a heartbeat far longer than the prefill: only the prefill's own progress can reach the client
    app = create_app(engine, info, heartbeat_s=3600.0)
    body = {"messages": [{"role": "user", "content": "Name three colours of the rainbow. " * 8}],
            "max_tokens": 2, "stream": True}
    with TestClient(app) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert lines[data[0]].startswith("data: {") and '"role": "assistant"' in lines[data[0]]
    comments = [line for line in lines[data[0] + 1:data[1]] if line.startswith(":")]
    assert len(comments) == engine.n_layers, lines[:5]  # one per decoder layer of the prefill
    assert comments[-1] == f": prefill {engine.n_layers}/{engine.n_layers}"
    assert lines[-1] == "data: [DONE]"
