"""Compile the flashprefill Triton kernels for sm_90 (H200) on a machine without a GPU and print
each variant's registers, shared memory and spills (Triton's bundled ptxas). No device needed.

    PYTHONPATH=kernels python scripts/compile_sm90.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, "kernels")
from flashprefill.impl import triton_attention as ta  # noqa: E402
from flashprefill.impl import triton_backend as tb  # noqa: E402
from flashprefill.impl import triton_index as ti  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _sig(fn, ptrs: dict, consts: dict, floats=()):
    # every constexpr parameter must be in ``consts``: one left out would compile as a runtime
    # int32 (both sides of its branches, loops no longer pipelined)
    missing = [n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr and n not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: constexpr parameters without a value: {missing}")
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_one(label, fn, ptrs, consts, floats=(), num_warps=4, num_stages=2):
    sig = _sig(fn, ptrs, consts, floats)
    # what a real launch specializes: pointers 16-byte aligned, ints divisible by 16 (strides,
    # counts) get tt.divisibility 16 -- without it every load compiles to 2-byte scalars
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n.startswith("stride"))}
    src = ASTSource(fn, sig, consts, attrs)
    try:
        k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as e:  # report and go on
        print(f"{label:60s} FAILED: {type(e).__name__}: {str(e)[:300]}")
        return None
    md = k.metadata
    ptx = k.asm.get("ptx", "")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    regs = int(regs.group(1)) if regs else -1
    per_sm = min(65536 // max(1, regs * 32 * num_warps), (228 * 1024) // max(1, md.shared + 1024),
                 64 // num_warps)
    print(f"{label:60s} smem {md.shared / 1024:6.1f} KiB  regs {regs:3d}  local {local.group(1) if local else '?':>4s} B"
          f"  progs/SM {per_sm}  wgmma {ptx.count('wgmma.mma_async')}  cp.async {ptx.count('cp.async')}")
    return k


def main():
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    bf = "*bf16"
    if only in ("", "attn"):
        _attn(bf)
    if only in ("", "index"):
        _index(bf)


def _attn(bf):
    """The attention kernel as launched: the default config of each head dim (page 64 = the bench,
    128 and 1), both mean dtypes (float32 up to 32K tokens, where ``launch_attention`` caps the
    correction at 2 stages; 16-bit copies beyond, with the config's full depth), then each named
    variant of ``ATTN_VARIANTS`` at d=128."""
    import dataclasses

    import torch

    configs = [(f"d{d}", d, ta.get_config(d, torch.bfloat16, 128)) for d in (128, 64, 256)]
    configs += [(f"d128 variant {name}", 128, dataclasses.replace(ta.get_config(128, torch.bfloat16, 128), **over))
                for name, over in ta.ATTN_VARIANTS.items()]
    for label, d, cfg in configs:
        for ps in (64, 128, 1):
            for sparse, mc, sub, bits in ((True, True, False, False), (True, True, True, False),
                                          (True, True, False, True), (True, False, False, False),
                                          (False, False, False, False)):
                if ps != 64 and not (sparse and mc):
                    continue
                for means in (("*fp32", bf) if (sparse and mc) else ("*fp32",)):
                    mc_stages = cfg.mc_stages or cfg.num_stages
                    if means == "*fp32":
                        mc_stages = min(mc_stages, 2)
                    ptrs = {n: "*i32" for n in ta._attn_fwd.arg_names if n in (
                        "page_table", "seq_lens", "cu_seqlens_q", "tile_request", "tile_local", "block_ptr",
                        "row_ptr", "col_idx", "sel_bits")}
                    ptrs["t_ptr"] = "*i64"
                    ptrs.update({"q_ptr": bf, "k_cache": bf, "v_cache": bf, "k_mean": means, "v_mean": means,
                                 "out_ptr": bf, "lse_ptr": "*fp32"})
                    consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                  BLOCK_SIZE=128, BLOCK_U=cfg.block_u, BLOCK_S=cfg.block_s, PAGE_SIZE=ps,
                                  SPARSE=sparse, MEAN_CORR=mc, MC_SUBTRACT=sub, MC_BITS=bits,
                                  MAIN_STAGES=cfg.num_stages, MC_STAGES=mc_stages,
                                  MERGE_LOOPS=cfg.merge_loops, FLAT_STEPS=cfg.flat_steps,
                                  PAIR_SOFTMAX=cfg.pair_softmax, TIMING=False)
                    name = (f"attn {label} ps{ps} sparse={sparse} mc={mc}{' subtract' if sub else ''}"
                            f"{' bits' if bits else ''}")
                    if sparse and mc:
                        name += f" means {means[1:]}"
                    compile_one(name, ta._attn_fwd, ptrs, consts, floats=("scale_log2",),
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            if d != 128 or "variant" in label:
                break


def _index(bf):
    # selection
    for exact in (False, True):
        ptrs = {n: "*i32" for n in ("tile_request", "tile_local", "cu_seqlens_q", "seq_lens", "block_ptr",
                                    "counts", "row_ptr", "n_visible", "bits")}
        ptrs.update({"q_ptr": bf, "k_mean": "*fp32", "k_lowp": bf, "scratch": "*fp32"})
        for pipe in sorted({tb.SELECT_PIPE_STAGES, 2, 3}):
            consts = dict(GROUP=4, HEAD_DIM=128, TILE_ROWS=128, BLOCK_SIZE=128, BLOCK_J=tb.SELECT_BLOCK_J,
                          KEEP_ALL_SCORED=False, EXACT=exact, PIPE_STAGES=pipe)
            compile_one(f"select exact={exact} BJ{tb.SELECT_BLOCK_J} w{tb.SELECT_NUM_WARPS} pipe{pipe}",
                        ti._select_kernel, ptrs, consts, floats=("scale_log2", "log2_alpha"),
                        num_warps=tb.SELECT_NUM_WARPS, num_stages=tb.SELECT_NUM_STAGES)
    ptrs = {"x_ptr": bf, "page_table": "*i32", "seq_lens": "*i32", "block_ptr": "*i32",
            "x_mean": "*fp32", "x_lowp": bf}
    for tokens, warps in ((tb.MEANS_TOKENS, tb.MEANS_WARPS), (128, 8)):
        compile_one(f"block means T{tokens} w{warps}", ti._block_means_kernel, ptrs,
                    dict(HEAD_DIM=128, BLOCK_SIZE=128, TOKENS=tokens, PAGE_SIZE=64, WRITE_LOWP=True),
                    num_warps=warps)
    compile_one("expand", ti._expand_kernel, {"bits": "*i32", "row_ptr": "*i32", "n_visible": "*i32",
                                              "col_idx": "*i32"}, dict(WORDS=tb.EXPAND_WORDS))


if __name__ == "__main__":
    main()
