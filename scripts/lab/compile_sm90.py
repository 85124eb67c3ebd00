"""Compile the flashprefill Triton kernels for sm_90 (H200) on a machine without a GPU and print
each shipped configuration's registers, shared memory, spills and SASS hash (Triton's bundled
ptxas and cuobjdump). No device needed.

    PYTHONPATH=kernels python scripts/lab/compile_sm90.py [attn|index|fp8|int8qk] [--sass DIR] [--shard K/N]

``fp8`` compiles the FP8 attention kernel only (its SASS line counts ``QGMMA``: e4m3 wgmma);
with ``--ptxas`` each line also names ptxas' performance notes (``C7515``: every wgmma of the
kernel serialized), ``-`` when there are none.
``int8qk`` compiles precision "int8qk" (docs/fp8.md section 10): the FP8 attention kernel with
``QK_INT8`` (int8 ``k8`` / ``k_mean8``; the line's ``s8`` counts the int8 wgmma of the PTX), the
selection with ``QK_INT8`` and the pre-pass with ``K_INT8``; ``--ptxas`` applies to it too.
``index`` also compiles the FP8 index's block means (with / without the fused amax), the FP8
selection with ``HW_CVT`` and the pre-pass kernels (``quant_kernels``).
``--sass DIR`` also writes each configuration's SASS to ``DIR/<label>.sass``: compare two trees
(``diff -r``) to check that a change left the compiled kernels byte-identical. ``--shard K/N``:
only every N-th configuration from the K-th (run N processes on a machine with N cores). The
configurations are those the launchers in ``flashprefill.impl.triton.host`` produce with
``tiles.get_config``: every head dim, both 16-bit dtypes at d=128, key blocks 128 and 64, page
sizes 64 / 16 / 1, every attention mode (correction from the selection bitmask, the fallback
that subtracts, no correction, dense) with float32 or 16-bit means where the launcher uses both.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashprefill.impl.triton import attention_fp8_kernels as fk
from flashprefill.impl.triton import attention_kernels as ak
from flashprefill.impl.triton import index_kernels as ik
from flashprefill.impl.triton import quant_kernels as qk
from flashprefill.impl.triton.tiles import AttnConfig, IndexConfig, get_config

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}
MODES = ("bits", "subtract", "nomc", "dense")


def _sig(fn, ptrs: dict, consts: dict, floats=()):
    # every constexpr parameter must be in ``consts``: one left out would compile as a runtime
    # int32 (both sides of its branches, loops no longer pipelined)
    missing = [n for n, p in zip(fn.arg_names, fn.params) if p.is_constexpr and n not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: constexpr parameters without a value: {missing}")
    return {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}


def ptxas_report(ptx: str) -> dict:
    """Triton's bundled ptxas run with ``-v`` on ``ptx`` for its own target: ``regs`` (registers per
    thread, None if not reported), ``spill_bytes`` (spill stores, all functions) and
    ``ptxas_warnings`` (the distinct warning texts, 160 characters each)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
        pr = subprocess.run([os.path.join(BIN, "ptxas"), "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "k.o")],
                            capture_output=True, text=True)
    log = pr.stdout + pr.stderr
    regs = re.search(r"Used (\d+) registers", log)
    return {"ptxas_warnings": sorted({ln.split("warning :", 1)[1].strip()[:160] for ln in log.splitlines()
                                      if "warning" in ln}),
            "regs": int(regs.group(1)) if regs else None,
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))}


def sass_of(cubin: bytes) -> str:
    """The SASS text of a compiled kernel's cubin (Triton's bundled ``cuobjdump -sass``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout


def ptxas_codes(ptx: str) -> list[str]:
    """The ptxas performance notes (``C7515`` etc.: e.g. every wgmma serialized) that Triton's own
    ptxas call does not show: its bundled ptxas run again with ``-v`` on the PTX (~1 s)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        err = subprocess.run([os.path.join(BIN, "ptxas"), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True).stderr
    return sorted(set(re.findall(r"\((C7\d\d\d)\)", err)))


def compile_one(label, fn, ptrs, consts, floats=(), num_warps=4, num_stages=2, sass_dir=None, div16=(),
                ptxas=False):
    sig = _sig(fn, ptrs, consts, floats)
    # what a real launch specializes: pointers 16-byte aligned, strides divisible by 16 get
    # tt.divisibility 16 -- without it every load compiles to 2-byte scalars; ``div16``: other
    # integer arguments a real launch passes as multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride") or n in div16))}
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=TARGET,
                       options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    # the instructions only (the header names the temporary file)
    sass = "\n".join(line for line in sass.splitlines()
                     if "Fatbin" not in line and not line.startswith("code for") and "arch = " not in line)
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        with open(os.path.join(sass_dir, label.replace(" ", "_") + ".sass"), "w") as out:
            out.write(sass)
    regs = re.search(r"REG:(\d+)", res)
    local = re.search(r"LOCAL:(\d+)", res)
    ptx = k.asm.get("ptx", "")
    print(f"{label:60s} smem {k.metadata.shared / 1024:6.1f} KiB  regs {regs.group(1) if regs else '?':>3s}  "
          f"local {local.group(1) if local else '?':>4s} B  wgmma {ptx.count('wgmma.mma_async'):3d}  "
          f"e4m3 {ptx.count('e4m3.e4m3'):3d}  " + (f"s8 {ptx.count('s8.s8'):3d}  " if "s8.s8" in ptx else "") +
          f"sass {hashlib.sha256(sass.encode()).hexdigest()[:16]}"
          + (f"  ptxas {','.join(ptxas_codes(ptx)) or '-'}" if ptxas else ""), flush=True)
    return k


def attn_cases():
    """(d, dtype, B, page size, g, mode, means) of the shipped attention configurations."""
    for d in (64, 128, 256):
        for mode in MODES:
            for means in (("fp32", "lowp") if mode in ("bits", "subtract") else ("lowp",)):
                yield d, torch.bfloat16, 128, 64, 4, mode, means
    for ps in (1, 16):
        for mode in ("bits", "subtract"):
            for means in ("fp32", "lowp"):
                yield 128, torch.bfloat16, 128, ps, 4, mode, means
    for mode in MODES:
        yield 128, torch.float16, 128, 64, 4, mode, "lowp"
        yield 128, torch.bfloat16, 64, 64, 4, mode, "lowp"
        yield 64, torch.bfloat16, 64, 16, 7, mode, "lowp"


def compile_attention(sass_dir=None, shard=(0, 1)):
    """``_attn_fwd`` as ``host.launch_attention`` launches it: float32 means cap the correction at
    2 stages; without the correction the means pointer is a 16-bit placeholder."""
    for i, (d, dtype, B, ps, g, mode, means) in enumerate(attn_cases()):
        if i % shard[1] != shard[0]:
            continue
        t = get_config(d, dtype, B).attn
        p16 = PTR[dtype]
        sparse, mc, bits = mode != "dense", mode in ("bits", "subtract"), mode == "bits"
        mc_stages = t.mc_stages or t.num_stages
        if means == "fp32":
            mc_stages = min(mc_stages, 2)
        mptr = "*fp32" if means == "fp32" else p16
        ptrs = {n: "*i32" for n in ("page_table", "seq_lens", "cu_seqlens_q", "tile_request", "tile_local",
                                    "block_ptr", "row_ptr", "col_idx", "sel_bits")}
        ptrs.update(q_ptr=p16, k_cache=p16, v_cache=p16, k_mean=mptr, v_mean=mptr, out_ptr=p16, lse_ptr="*fp32",
                    t_ptr="*fp32")
        consts = dict(GROUP=g, HEAD_DIM=d, TILE_ROWS=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_SIZE=B,
                      BLOCK_U=t.block_u, PAGE_SIZE=ps, SPARSE=sparse, MEAN_CORR=mc, MC_BITS=bits,
                      MAIN_STAGES=t.num_stages, MC_STAGES=mc_stages, PAIR_SOFTMAX=t.pair_softmax, TIMING=False)
        compile_one(f"attn d{d} {str(dtype)[6:]} B{B} ps{ps} g{g} {mode} means-{means}", ak._attn_fwd, ptrs,
                    consts, floats=("scale_log2",), num_warps=t.num_warps, num_stages=t.num_stages, sass_dir=sass_dir)


def compile_attention_fp8(sass_dir=None, shard=(0, 1), attn=None, ptxas=False, int8=False):
    """``_attn_fwd_fp8`` as ``host_fp8.launch_attention_fp8`` launches it (e4m3 pre-pass buffers).
    ``attn``: a function ``AttnConfig -> AttnConfig`` applied to each shipped config (a lab variant).
    ``ptxas``: also print ptxas' performance notes (``ptxas_codes``). ``int8``: precision "int8qk"
    (``QK_INT8``, int8 ``k8`` / ``k_mean8``, int8qk's tiles)."""
    cases = [(d, B, g, mode) for d in (64, 128, 256) for mode in ("bits", "nomc", "dense") for B, g in ((128, 4),)]
    cases += [(128, 64, 7, "bits")]
    for i, (d, B, g, mode) in enumerate(cases):
        if i % shard[1] != shard[0]:
            continue
        t = get_config(d, torch.bfloat16, B, precision="int8qk" if int8 else "fp8").attn
        if attn is not None:
            t = attn(t)
        ptrs = {n: "*i32" for n in ("cu_seqlens_k", "mean_cols", "seq_lens", "cu_seqlens_q", "tile_request", "tile_local",
                                    "block_ptr", "row_ptr", "col_idx", "sel_bits")}
        kptr = "*i8" if int8 else "*fp8e4nv"
        ptrs.update(q_ptr="*bf16", k8=kptr, v8t="*fp8e4nv", k_mean8=kptr, v_mean8t="*fp8e4nv",
                    k_scale="*fp32", v_scale="*fp32", out_ptr="*bf16", lse_ptr="*fp32")
        consts = dict(GROUP=g, HEAD_DIM=d, TILE_ROWS=128, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_SIZE=B,
                      BLOCK_U=t.block_u, SPARSE=mode != "dense", MEAN_CORR=mode == "bits",
                      MAIN_STAGES=t.num_stages, MC_STAGES=t.mc_stages or t.num_stages, EXP=fk.EXP_IMPLS.index(t.exp_impl), FOLD_SCALE=t.fold_scale,
                      PIPELINE=t.pipeline, MEAN_VEC=t.mean_vec, LOOP_GUARD=t.loop_guard, QK_INT8=int8,
                      INLINE_ASM=True)
        compile_one(f"attn {'int8qk' if int8 else 'fp8'} d{d} B{B} g{g} {mode}", fk._attn_fwd_fp8, ptrs, consts, floats=("scale_log2",),
                    num_warps=t.num_warps, num_stages=t.num_stages, sass_dir=sass_dir, ptxas=ptxas)


def compile_index(sass_dir=None, shard=(0, 1)):
    """The selection, block-means and expand kernels as ``host.build_index`` launches them."""
    t = IndexConfig()
    if shard[0] != 0:      # few and quick: all in the first shard
        return
    for d, dtype, keep in ((64, torch.bfloat16, False), (128, torch.bfloat16, False), (256, torch.bfloat16, False),
                           (128, torch.float16, False), (128, torch.bfloat16, True)):
        for B in ((128, 64) if d == 128 and dtype == torch.bfloat16 and not keep else (128,)):
            p16 = PTR[dtype]
            ptrs = {n: "*i32" for n in ("tile_request", "tile_local", "cu_seqlens_q", "seq_lens", "block_ptr",
                                        "counts", "row_ptr", "n_visible", "bits")}
            ptrs.update(q_ptr=p16, k_mean="*fp32", k_lowp=p16, scratch="*fp32", k_scale="*fp32")
            consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_SIZE=B, BLOCK_J=t.select_block_j,
                          KEEP_ALL_SCORED=keep, FP8=False, HW_CVT=False, MAX_PRUNABLE=False, ROW_MASS=False,
                          QK_INT8=False)
            compile_one(f"select d{d} {str(dtype)[6:]} B{B} keepall{int(keep)}", ik._select_kernel, ptrs, consts,
                        floats=("scale_log2", "log2_alpha"), num_warps=t.select_num_warps,
                        num_stages=t.select_num_stages, sass_dir=sass_dir)
    # the selection options of SparseConfig: threshold_max "prunable", block_score "mass", both
    for d, fp8, prunable, mass in ((128, False, True, False), (128, False, False, True), (128, False, True, True),
                                   (128, True, True, True), (64, False, False, True), (256, False, True, True)):
        ptrs = {n: "*i32" for n in ("tile_request", "tile_local", "cu_seqlens_q", "seq_lens", "block_ptr",
                                    "counts", "row_ptr", "n_visible", "bits")}
        ptrs.update(q_ptr="*bf16", k_mean="*fp32", k_lowp="*fp8e4nv" if fp8 else "*bf16", scratch="*fp32",
                    k_scale="*fp32")
        consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_SIZE=128, BLOCK_J=t.select_block_j,
                      KEEP_ALL_SCORED=False, FP8=fp8, HW_CVT=False, MAX_PRUNABLE=prunable, ROW_MASS=mass,
                      QK_INT8=False)
        compile_one(f"select{' fp8' if fp8 else ''} d{d} bfloat16 B128 prunable{int(prunable)} mass{int(mass)}",
                    ik._select_kernel, ptrs, consts, floats=("scale_log2", "log2_alpha"),
                    num_warps=t.select_num_warps, num_stages=t.select_num_stages, sass_dir=sass_dir)
    # the FP8 selection: e4m3 Q tile and k_mean8; the Q codes by the fp32 emulation, and at d 128 also
    # by the hardware cast (IndexConfig.hw_cvt)
    for d, hw in ((64, False), (128, False), (256, False), (128, True)):
        ptrs = {n: "*i32" for n in ("tile_request", "tile_local", "cu_seqlens_q", "seq_lens", "block_ptr",
                                    "counts", "row_ptr", "n_visible", "bits")}
        ptrs.update(q_ptr="*bf16", k_mean="*fp32", k_lowp="*fp8e4nv", scratch="*fp32", k_scale="*fp32")
        consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_SIZE=128, BLOCK_J=t.select_block_j,
                      KEEP_ALL_SCORED=False, FP8=True, HW_CVT=hw, MAX_PRUNABLE=False, ROW_MASS=False, QK_INT8=False)
        compile_one(f"select fp8 d{d} bfloat16 B128" + (" hwcvt" if hw else ""), ik._select_kernel, ptrs, consts,
                    floats=("scale_log2", "log2_alpha"), num_warps=t.select_num_warps,
                    num_stages=t.select_num_stages, sass_dir=sass_dir)
    for d, dtype, B, ps in ((128, torch.bfloat16, 128, 64), (128, torch.bfloat16, 128, 1), (64, torch.float16, 64, 16),
                            (256, torch.bfloat16, 128, 64)):
        p16 = PTR[dtype]
        ptrs = dict(x_ptr=p16, page_table="*i32", seq_lens="*i32", block_ptr="*i32", x_mean="*fp32", x_lowp=p16)
        compile_one(f"means d{d} {str(dtype)[6:]} B{B} ps{ps}", ik._block_means_kernel, ptrs,
                    dict(HEAD_DIM=d, BLOCK_SIZE=B, TOKENS=min(t.means_tokens, B), PAGE_SIZE=ps, WRITE_LOWP=True,
                         amax=None, AMAX=False),
                    num_warps=t.means_warps, sass_dir=sass_dir)
    # the FP8 index of bf16 caches: means without the 16-bit copy, with (IndexConfig.fused_amax)
    # and without the fused amax, then the pre-pass kernels (quant_kernels)
    for amax in (False, True):
        ptrs = dict(x_ptr="*bf16", page_table="*i32", seq_lens="*i32", block_ptr="*i32", x_mean="*fp32",
                    x_lowp="*fp32", amax="*i32")
        compile_one(f"means fp8 d128 bfloat16 B128 ps64 amax{int(amax)}", ik._block_means_kernel, ptrs,
                    dict(HEAD_DIM=128, BLOCK_SIZE=128, TOKENS=min(t.means_tokens, 128), PAGE_SIZE=64,
                         WRITE_LOWP=False, AMAX=amax, **({} if amax else {"amax": None})),
                    num_warps=t.means_warps, sass_dir=sass_dir)
    qptrs = dict(k_ptr="*bf16", v_ptr="*bf16", page_table_ptr="*i32", seq_lens_ptr="*i32", amax_ptr="*i32",
                 cu_k_ptr="*i32", inv_ptr="*fp32", k8_ptr="*fp8e4nv", v8t_ptr="*fp8e4nv")
    qconsts = dict(HKV=8, PAGE_SIZE=64, D=128, BLOCK_T=qk.BLOCK_T)
    strides = ("k_stride_page", "k_stride_slot", "k_stride_head", "v_stride_page", "v_stride_slot", "v_stride_head")
    compile_one("prepass amax d128 bfloat16 ps64", qk._kv_amax_kernel, qptrs, qconsts, sass_dir=sass_dir,
                div16=strides)
    for hw in (False, True):
        compile_one("prepass quant d128 bfloat16 ps64" + (" hwcvt" if hw else ""), qk._kv_quant_kernel, qptrs,
                    dict(qconsts, HW_CVT=hw, K_INT8=False), sass_dir=sass_dir, div16=strides + ("total_k",))
    compile_one("expand", ik._expand_kernel, dict(bits="*i32", row_ptr="*i32", n_visible="*i32", col_idx="*i32"),
                dict(WORDS=t.expand_words), sass_dir=sass_dir)


def compile_index_int8(sass_dir=None, shard=(0, 1)):
    """Precision "int8qk"'s index and pre-pass (``docs/fp8.md`` section 10): the selection with
    ``QK_INT8`` (int8 Q tile and ``k_mean8``) and the quantise pass with ``K_INT8`` (int8 ``k8``)."""
    t = IndexConfig()
    if shard[0] != 0:
        return
    for d, prunable, mass in ((64, False, False), (128, False, False), (256, False, False), (128, True, True)):
        ptrs = {n: "*i32" for n in ("tile_request", "tile_local", "cu_seqlens_q", "seq_lens", "block_ptr",
                                    "counts", "row_ptr", "n_visible", "bits")}
        ptrs.update(q_ptr="*bf16", k_mean="*fp32", k_lowp="*i8", scratch="*fp32", k_scale="*fp32")
        consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_SIZE=128, BLOCK_J=t.select_block_j,
                      KEEP_ALL_SCORED=False, FP8=True, HW_CVT=False, MAX_PRUNABLE=prunable, ROW_MASS=mass,
                      QK_INT8=True)
        compile_one(f"select int8qk d{d} bfloat16 B128 prunable{int(prunable)} mass{int(mass)}", ik._select_kernel,
                    ptrs, consts, floats=("scale_log2", "log2_alpha"), num_warps=t.select_num_warps,
                    num_stages=t.select_num_stages, sass_dir=sass_dir)
    qptrs = dict(k_ptr="*bf16", v_ptr="*bf16", page_table_ptr="*i32", seq_lens_ptr="*i32", amax_ptr="*i32",
                 cu_k_ptr="*i32", inv_ptr="*fp32", k8_ptr="*i8", v8t_ptr="*fp8e4nv")
    strides = ("k_stride_page", "k_stride_slot", "k_stride_head", "v_stride_page", "v_stride_slot", "v_stride_head")
    for hw in (False, True):
        compile_one("prepass quant int8qk d128 bfloat16 ps64" + (" hwcvt" if hw else ""), qk._kv_quant_kernel, qptrs,
                    dict(HKV=8, PAGE_SIZE=64, D=128, BLOCK_T=qk.BLOCK_T, HW_CVT=hw, K_INT8=True), sass_dir=sass_dir,
                    div16=strides + ("total_k",))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="?", default="", choices=["", "attn", "index", "fp8", "int8qk"])
    ap.add_argument("--sass", default=None, help="write each configuration's SASS into this directory")
    ap.add_argument("--shard", default="0/1", help="K/N: this process compiles configurations K, K+N, ...")
    ap.add_argument("--fp8-set", default="", metavar="FIELD=INT,...",
                    help="fp8 / int8qk only: AttnConfig fields replaced in every configuration (a lab variant), "
                         "e.g. exp_impl=poly_half,num_stages=3")
    ap.add_argument("--ptxas", action="store_true",
                    help="fp8 / int8qk only: also print ptxas' performance notes (C7515: every wgmma serialized)")
    a = ap.parse_args(argv)
    fields = dict(kv.split("=") for kv in a.fp8_set.split(",") if kv)
    bad = set(fields) - {f.name for f in dataclasses.fields(AttnConfig)}
    if bad:
        raise SystemExit(f"--fp8-set: unknown AttnConfig fields {sorted(bad)}")
    k, n = (int(x) for x in a.shard.split("/"))
    if a.only in ("", "attn"):
        compile_attention(a.sass, (k, n))
    if a.only in ("", "index"):
        compile_index(a.sass, (k, n))
    variant = lambda t: dataclasses.replace(    # noqa: E731
        t, **{f: v if isinstance(getattr(t, f), str) else type(getattr(t, f))(int(v)) for f, v in fields.items()})
    if a.only in ("", "fp8"):
        compile_attention_fp8(a.sass, (k, n), ptxas=a.ptxas, attn=variant)
    if a.only in ("", "int8qk"):
        compile_attention_fp8(a.sass, (k, n), ptxas=a.ptxas, attn=variant, int8=True)
        compile_index_int8(a.sass, (k, n))


if __name__ == "__main__":
    main()
