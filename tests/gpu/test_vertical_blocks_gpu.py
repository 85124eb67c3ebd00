"""The lab's vertical-blocks analysis (``scripts/lab/vertical_blocks.py``) on CUDA gives the CPU's
float64 numbers: the same rows' dense and sparse outputs and shares under the same selection, and
``analyse_layer`` end to end on the device (tensors stay there; the operator check passes).

Run on the device: ``PYTHONPATH=kernels:. pytest tests/gpu/test_vertical_blocks_gpu.py -q -x``.
The selection itself is built in float32 by the reference index on each device, so a block at the
threshold may flip: block counts are compared within 1% of the visible blocks, outputs exactly (to
float64 rounding) only under one shared mask.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS.parent / "scripts" / "lab"))
sys.path.insert(0, str(_TESTS))
import test_lab_vertical_blocks as cpu_case  # noqa: E402  (its synthetic layer: vertical keys, CFG, TOKENS)
import vertical_blocks as vb  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

F64 = {"rtol": 1e-10, "atol": 1e-13}  # float64 on two devices: the reductions' order differs


def test_rows_on_cuda_give_the_cpu_numbers_under_one_mask():
    q, k, v, vert = cpu_case._layer()
    dev = torch.device("cuda")
    mask = vb.selection(q, k, v, 0.3, cpu_case.CFG)
    ks = torch.zeros(2, q.shape[1], dtype=torch.bool)
    ks[:, vert] = True
    rc = vb.Rows(q, k, v, 0.3, 64, cpu_case.TOKENS)
    rg = vb.Rows(q.to(dev), k.to(dev), v.to(dev), 0.3, 64, cpu_case.TOKENS)      # tokens moved inside
    assert rg.dense.device.type == "cuda" and rg.dense.dtype == torch.float64
    torch.testing.assert_close(rg.dense.cpu(), rc.dense, **F64)
    torch.testing.assert_close(rg.out(mask.to(dev)).cpu(), rc.out(mask), **F64)
    torch.testing.assert_close(rg.out(mask.to(dev), ks.to(dev)).cpu(), rc.out(mask, ks), **F64)
    pc = vb.peakedness(rc, mask, {"vert": ks})
    pg = vb.peakedness(rg, mask.to(dev), {"vert": ks.to(dev)})
    for name, x in pc.items():
        torch.testing.assert_close(pg[name].cpu(), x, **F64)
    assert float(pc["vert"].sum()) > 0.3 * float(pc["pruned"].sum()) > 0      # not a vacuous comparison


def test_analyse_layer_runs_on_cuda():
    q, k, v, _ = cpu_case._layer()
    dev = torch.device("cuda")
    args = (0.3, cpu_case.CFG, cpu_case.TOKENS, [0.3, 0.1], [4], [0.3], [8], 64)
    cpu = vb.analyse_layer(q, k, v, *args, check=True, global_keys=[8])
    gpu = vb.analyse_layer(q.to(dev), k.to(dev), v.to(dev), *args, check=True, global_keys=[8], row_chunk=2)
    assert gpu["ref_err"] < 1e-5                                        # the operator's output, on CUDA
    assert gpu["dense"].device.type == "cuda"
    torch.testing.assert_close(gpu["dense"].cpu(), cpu["dense"], **F64)
    assert list(gpu["configs"]) == list(cpu["configs"])
    for name, c in cpu["configs"].items():
        g = gpu["configs"][name]
        assert g["visible"] == c["visible"], name
        assert abs(g["selected"] - c["selected"]) <= 0.01 * c["visible"], name
        assert g["out"].device.type == "cuda" and g["out"].shape == c["out"].shape
        e_c = vb.nr.rel(c["out"], cpu["dense"])
        e_g = vb.nr.rel(g["out"].cpu(), cpu["dense"])
        assert abs(e_g - e_c) <= 0.05 * e_c + 1e-12, (name, e_g, e_c)
