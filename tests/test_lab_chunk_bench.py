"""The lab's chunked-prefill benchmark inputs (``scripts/lab/chunk_bench.py``): one request of
``prefix`` cached tokens and ``chunk`` new ones, the queries being the last ``chunk`` rows of the same
synthetic sequence whose keys and values fill the cache, so the operator sees what an engine's later
prefill chunk sees. CPU, no kernel."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "lab"))
import chunk_bench  # noqa: E402  (scripts/lab is not a package)

from flashprefill import make_plan  # noqa: E402
from flashprefill.bench import synthetic_inputs  # noqa: E402


@pytest.mark.parametrize("prefix,chunk", [(0, 300), (1000, 256), (4096, 129)])
def test_a_chunk_is_the_tail_of_one_request_over_its_whole_cache(prefix, chunk):
    q, kc, vc, pt, sl, cu = chunk_bench.chunk_inputs(prefix, chunk, 4, 2, 32, torch.float32, 16, device="cpu")
    full_q, full_k, full_v, full_pt, _, _, _, _ = synthetic_inputs(prefix + chunk, 4, 2, 32, torch.float32, 16, 1,
                                                                   device="cpu")
    assert q.shape == (chunk, 4, 32) and q.is_contiguous()
    assert torch.equal(q, full_q[prefix:]) and torch.equal(kc, full_k) and torch.equal(vc, full_v)
    assert torch.equal(pt, full_pt) and pt.shape[1] * 16 >= prefix + chunk
    assert sl.tolist() == [prefix + chunk] and cu.tolist() == [0, chunk]
    plan = make_plan(sl, cu, 2, 128)
    assert list(plan.kv_lens) == [prefix + chunk] and plan.max_kv_len == prefix + chunk
    assert plan.n_tiles == -(-chunk * 2 // plan.tile_rows)


def test_an_empty_chunk_is_refused():
    with pytest.raises(ValueError, match="chunk >= 1"):
        chunk_bench.chunk_inputs(100, 0, 4, 2, 32, device="cpu")
