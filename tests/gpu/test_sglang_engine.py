"""GPU tests of the ``flashprefill`` SGLang backend and the embedded engine (run on the device).

Skips unless CUDA, SGLang and the staged models (``$FPDEV_MODELS``) are present.

1. Backend alone, on SGLang's own mock model runner (``sglang.test.kits.attention_unittest``):
   extend and extend with a prefix, page_size 1 and 16, shuffled pages, vs the torch-native backend
   and the float32 reference; the operator path with ``alpha = 0`` must equal dense attention.
2. The embedded engine (SmolLM2-135M, Qwen2.5-Coder-0.5B): greedy equality with the dense backend
   below ``min_sparse_len``, needles at ~6K (SmolLM2) and ~28K (Qwen), chunked prefill 2048 vs
   one-shot first-token log-probabilities, page sizes 1/16/64, concurrent requests, a radix-cache
   prefix hit, streaming and sampling, and a subprocess that must exit promptly with decode CUDA
   graphs on. ``FP_GPU_SLOW=1`` adds Qwen + YaRN at ~120K.

Engines are shared (``ENGINES``: built once per configuration, at most three alive).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
sglang = pytest.importorskip("sglang")
MODELS = Path(os.environ.get("FPDEV_MODELS", "/nonexistent"))
SMOL = MODELS / "smollm2-135m-instruct"
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct"
if not (SMOL / "config.json").is_file():
    pytest.skip(f"staged models not found under FPDEV_MODELS={MODELS}", allow_module_level=True)

from flashprefill.config import SparseConfig  # noqa: E402
from fpcli.bench_e2e import answered, needle_document, needle_prompt  # noqa: E402
from fpcli.engine.sglang_engine import SGLangEngine  # noqa: E402
from fpcli.profiles import load_profile  # noqa: E402
from fpcli.sglang_backend import plugin  # noqa: E402
from fpcli.sglang_backend.settings import BackendSettings, set_settings_override  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
log = logging.getLogger("test_sglang_engine")
SLOW = os.environ.get("FP_GPU_SLOW") == "1"


# ------------------------------------------------------------------------------------------------
# 1. the backend alone, on SGLang's mock model runner
# ------------------------------------------------------------------------------------------------

kit = pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.dense_attention")
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

_TESTCASE = SimpleNamespace(skipTest=lambda msg: pytest.skip(msg))


def _run_case(backend: str, page_size: int, prefix: tuple, extend: tuple, name: str):
    case = kit.DenseAttentionCase(name=name, backend=backend, forward_mode=ForwardMode.EXTEND, num_heads=8,
                                  num_kv_heads=2, page_size=page_size, prefix_lens=prefix, extend_lens=extend)
    fx = kit.build_dense_attention_fixture(_TESTCASE, case, head_dim=64, hidden_size=256, max_context_len=1024,
                                           dtype=torch.bfloat16)
    return fx, kit.run_dense_fixture_eager(fx), kit.expected_dense_fixture_output(fx)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix,extend", [((0, 0), (517, 200)), ((300, 129), (200, 1)), ((640,), (300,))])
def test_backend_alpha0_equals_dense_on_mock_runner(page_size, prefix, extend):
    """Operator path (dense_layers 0, alpha 0 keeps every block) == torch_native == fp32 reference."""
    plugin.register()
    set_settings_override(BackendSettings(sparse=SparseConfig(alpha=0.0, block_size=64, min_sparse_len=0),
                                          dense_layers=0, debug_checks=True, collect_stats=True))
    try:
        name = f"fp_p{page_size}_{'_'.join(map(str, prefix + extend))}"
        fx, out, ref = _run_case("flashprefill", page_size, prefix, extend, name)
        meta = fx.backend.forward_metadata
        assert meta is not None and meta.sparse, f"batch went dense: {meta and meta.dense_reason}"
        _, out_native, _ = _run_case("torch_native", page_size, prefix, extend, name)  # same name -> same seed
        torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(out, out_native, atol=3e-2, rtol=3e-2)
    finally:
        set_settings_override(None)


def test_backend_sparse_config_runs_and_records_stats(tmp_path):
    plugin.register()
    set_settings_override(BackendSettings(sparse=SparseConfig(block_size=64, sink_tokens=64, window_tokens=128,
                                                              dense_tail_tokens=64, alpha=0.3),
                                          stats_dir=str(tmp_path), debug_checks=True))
    try:
        fx, out, ref = _run_case("flashprefill", 16, (256,), (700,), "fp_sparse_stats")
        assert torch.isfinite(out).all()
        err = (out.float() - ref.float()).abs().max().item()
        log.info("sparse (alpha 0.3) vs dense on random data: max abs err %.4f", err)
        fx.backend.writer.close()
        lines = [json.loads(x) for p in tmp_path.glob("stats-*.jsonl") for x in p.read_text().splitlines()]
        assert lines and lines[0]["layers"] == ["sparse"] and lines[0]["q_len"] == 700 and lines[0]["kv_len"] == 956
        assert lines[0]["prefill_ms"] is not None and lines[0]["prefill_ms"] > 0
    finally:
        set_settings_override(None)


# ------------------------------------------------------------------------------------------------
# 2. the embedded engine
# ------------------------------------------------------------------------------------------------

BF16 = load_profile("bf16")
DENSE = BF16.replace(attention="dense")
BASE_OVERRIDES = {"mem_fraction_static": 0.08, "cuda_graph_max_bs_decode": 8}


class Engines:
    """Engines by configuration key, built on first use, at most ``max_alive`` alive."""

    def __init__(self, max_alive: int = 3):
        self.max_alive = max_alive
        self.alive: OrderedDict[str, SGLangEngine] = OrderedDict()

    def get(self, key: str, model: Path, profile=BF16, *, overrides=None, settings=None, **kw) -> SGLangEngine:
        if key in self.alive:
            self.alive.move_to_end(key)
            return self.alive[key]
        while len(self.alive) >= self.max_alive:
            old_key, old = self.alive.popitem(last=False)
            log.info("closing engine %s", old_key)
            old.close()
        t0 = time.perf_counter()
        eng = SGLangEngine(model, profile, server_overrides={**BASE_OVERRIDES, **(overrides or {})},
                           settings_overrides=settings, **kw)
        log.info("engine %s started in %.1f s: %s", key, time.perf_counter() - t0, eng.server_kwargs)
        eng.generate(eng.encode_chat(None, "Say hello."), max_new_tokens=4)  # JIT warm-up
        self.alive[key] = eng
        return eng

    def close(self):
        while self.alive:
            self.alive.popitem()[1].close()


@pytest.fixture(scope="module")
def engines():
    pool = Engines()
    yield pool
    pool.close()


SHORT_SPARSE = {"sparse": BF16.sparse_config().replace(min_sparse_len=4096)}


def smol_sparse(engines, page_size=64, chunk=8192):
    return engines.get(f"smol-p{page_size}-c{chunk}", SMOL, overrides={"page_size": page_size, "chunked_prefill_size": chunk},
                       settings=SHORT_SPARSE)


@pytest.fixture(scope="module")
def smol_needle():
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(SMOL))
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    text, secret = needle_document(count, 6000, seed=3)
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids, secret


def test_short_prompt_equals_dense_backend(engines):
    sparse = smol_sparse(engines)
    ids = sparse.encode_chat(None, "Write three sentences about rivers, stones and markets. " * 40)
    assert len(ids) < 4096
    a = sparse.generate(ids, max_new_tokens=32)
    dense = engines.get("smol-dense", SMOL, DENSE, overrides={"page_size": 64, "chunked_prefill_size": 8192})
    b = dense.generate(ids, max_new_tokens=32)
    assert a.text == b.text, f"flashprefill {a.text!r} != dense {b.text!r}"
    assert a.stats.density == 1.0 and a.prompt_tokens == len(ids)


def test_needle_smol_6k(engines, smol_needle):
    ids, secret = smol_needle
    eng = smol_sparse(engines)
    r = eng.generate(ids, max_new_tokens=24)
    log.info("smol 6K: %d tokens, ttft %.4f s, prefill %.4f s, density %.3f, per layer %s, answer %r",
             r.prompt_tokens, r.ttft_s, r.prefill_s, r.stats.density,
             [round(x, 3) for x in r.stats.density_per_layer], r.text)
    assert answered(r.text, secret), f"needle {secret} not in {r.text!r}"
    assert len(r.stats.density_per_layer) == 30 and r.stats.density_per_layer[:2] == [1.0, 1.0]
    assert 0.0 < r.stats.density <= 1.0 and r.prefill_s > 0


def test_page_sizes_same_greedy(engines, smol_needle):
    ids, _ = smol_needle
    outs = {}
    for ps in (64, 16, 1):
        eng = smol_sparse(engines, page_size=ps)
        eng.flush_cache()  # a full prefill, not a radix hit of an earlier test
        outs[ps] = eng.generate(ids, max_new_tokens=16).text
    assert outs[64] == outs[16] == outs[1], outs


def test_chunked_prefill_matches_one_shot(engines, smol_needle):
    ids, _ = smol_needle  # ~6K tokens: one chunk at 8192, three at 2048
    e_one, e_chunked = smol_sparse(engines), smol_sparse(engines, chunk=2048)
    e_one.flush_cache()
    e_chunked.flush_cache()
    one = e_one.first_token_logprobs(ids, k=10)
    chunked = e_chunked.first_token_logprobs(ids, k=10)
    log.info("one-shot top5 %s\nchunked  top5 %s", one[:5], chunked[:5])
    assert one[0][1] == chunked[0][1], f"argmax differs: {one[0]} vs {chunked[0]}"
    a, b = dict((t, lp) for lp, t in one), dict((t, lp) for lp, t in chunked)
    common = [t for _, t in one[:5] if t in b]
    assert len(common) >= 3
    diff = max(abs(a[t] - b[t]) for t in common)
    assert diff < 0.3, f"log-prob difference {diff:.3f} on the top tokens"


def test_concurrent_requests_of_different_lengths(engines, smol_needle):
    ids, secret = smol_needle
    eng = smol_sparse(engines)
    short = eng.encode_chat(None, "Name three colours.")
    solo = eng.generate(short, max_new_tokens=16).text
    long_r, short_r = eng.generate_batch([ids, short], max_new_tokens=16)
    assert answered(long_r.text, secret), long_r.text
    assert short_r.text == solo


def test_radix_prefix_hit(engines, smol_needle):
    ids, secret = smol_needle
    eng = smol_sparse(engines)
    eng.flush_cache()
    first = eng.generate(ids, max_new_tokens=4)
    assert getattr(first, "cached_tokens", 0) == 0
    follow = ids[:-8] + eng.tokenizer("Reply with the digits only.", add_special_tokens=False)["input_ids"] + ids[-8:]
    r = eng.generate(follow, max_new_tokens=24)
    log.info("radix: cached %s of %d tokens, answer %r", getattr(r, "cached_tokens", None), r.prompt_tokens, r.text)
    assert getattr(r, "cached_tokens", 0) >= 4000
    assert answered(r.text, secret), r.text


def test_streaming_and_sampling(engines):
    eng = smol_sparse(engines)
    ids = eng.encode_chat(None, "Count from one to ten in words.")
    pieces = []
    r = eng.generate(ids, max_new_tokens=24, on_text=pieces.append)
    assert "".join(pieces) == r.text and r.ttft_s <= r.total_s and r.output_tokens > 0
    s = eng.generate(ids, max_new_tokens=24, temperature=0.8, top_p=0.9)
    assert s.output_tokens > 0


@pytest.mark.skipif(not (QWEN / "config.json").is_file(), reason="Qwen not staged")
def test_needle_qwen_28k(engines):
    eng = engines.get("qwen-p64-c8192", QWEN, overrides={"page_size": 64, "chunked_prefill_size": 8192,
                                                          "mem_fraction_static": 0.12})
    ids, secret = needle_prompt(eng, 28000, seed=5)
    r = eng.generate(ids, max_new_tokens=24)
    log.info("qwen 28K: %d tokens, ttft %.3f s, prefill %.3f s, density %.3f, answer %r",
             r.prompt_tokens, r.ttft_s, r.prefill_s, r.stats.density, r.text)
    assert answered(r.text, secret), f"needle {secret} not in {r.text!r}"
    assert r.stats.density < 1.0


@pytest.mark.slow
@pytest.mark.skipif(not SLOW or not (QWEN / "config.json").is_file(), reason="set FP_GPU_SLOW=1 (Qwen + YaRN 120K)")
def test_needle_qwen_yarn_120k(engines):
    eng = engines.get("qwen-yarn4", QWEN, overrides={"page_size": 64, "mem_fraction_static": 0.15},
                      rope_scaling_factor=4.0)
    ids, secret = needle_prompt(eng, 120000, seed=7)
    r = eng.generate(ids, max_new_tokens=24)
    log.info("qwen YaRN 120K: %d tokens, ttft %.3f s, density %.3f, answer %r", r.prompt_tokens, r.ttft_s,
             r.stats.density, r.text)
    assert answered(r.text, secret), r.text


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time
    from fpcli.engine.sglang_engine import SGLangEngine
    from fpcli.profiles import load_profile

    def main():
        prof = load_profile("bf16")
        assert prof.engine.cuda_graph_decode
        with SGLangEngine(sys.argv[1], prof, server_overrides={"mem_fraction_static": 0.08,
                                                                "cuda_graph_max_bs_decode": 4}) as eng:
            cfg = eng._engine.server_args.cuda_graph_config
            print("DECODE_GRAPH", cfg.decode.backend, flush=True)
            r = eng.generate(eng.encode_chat(None, "Say hello."), max_new_tokens=8)
            print("ANSWER", repr(r.text), flush=True)
        print("CLOSED", time.time(), flush=True)

    if __name__ == "__main__":
        main()
""")


def test_engine_with_decode_cuda_graphs_exits_promptly(tmp_path):
    script = tmp_path / "run_engine.py"
    script.write_text(EXIT_SCRIPT)
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(script), str(SMOL)], capture_output=True, text=True, timeout=300,
                          cwd=str(Path(__file__).resolve().parents[2]))
    t_exit = time.time()
    log.info("subprocess stdout:\n%s\nstderr tail:\n%s", proc.stdout, proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "DECODE_GRAPH" in proc.stdout and "disabled" not in proc.stdout.split("DECODE_GRAPH")[1].splitlines()[0].lower()
    closed = float(proc.stdout.split("CLOSED")[1].split()[0])
    assert t_exit - closed < 30, f"process took {t_exit - closed:.1f} s to exit after close()"
    log.info("engine subprocess: %.1f s total, exit %.1f s after close", t_exit - t0, t_exit - closed)
