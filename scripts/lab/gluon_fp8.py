"""Lab harness of the warp-specialised Gluon FP8 attention (``attention_fp8_ws_kernels``,
``AttnConfig.impl = "gluon_ws"``, ``docs/fp8.md`` section 11; ``docs/lab/kernel-notes.md`` "Version 7"):
compiles it for sm_90 anywhere and times it against the shipped kernels on the H200.

    PYTHONPATH=kernels:. python scripts/lab/gluon_fp8.py compile [--sass DIR]
    PYTHONPATH=kernels:. python scripts/lab/gluon_fp8.py time --lens 32k,128k --shapes 32/8/128,14/2/64
    PYTHONPATH=kernels:. python scripts/lab/gluon_fp8.py phases --lens 32k,128k   # TIMING stamps

Why the kernel exists: at 128K (32 / 8 heads, d 128) the Triton FP8 exact-key loop was 1.22x of
BF16's (12.3 vs 15.0 ms, ninth session) where issue 13 needs ~1.65x; Triton 3.6 waits each
``Q Kᵀ`` wgmma where it is issued, and its automatic warp specialisation lost (0.88-0.91x).

``compile`` (no GPU): each configuration (ring stages, ping-pong) at d 128 / 64, with and without the
mean correction: registers and spills (ptxas ``-v``), shared memory, the ``USETMAXREG`` values, the
e4m3 wgmma (``QGMMA``) and wgmma-wait counts of the SASS.

``time`` (H200): ``flashprefill.bench``'s synthetic inputs (page 64, one request), the default
``SparseConfig``: the operator totals in BF16 and FP8 on the Triton kernel (``variant="triton_fp8"``)
and their attention with / without the correction (index and pre-pass built beforehand), then per
configuration of the Gluon kernel its attention with /
without the correction (relative L2 of the output, max |ΔLSE| against the Triton FP8 kernel in the
same mode) and its operator total (FP8 index + pre-pass + this kernel). Medians of ``do_bench``;
writes ``gluon_fp8.json``.

``phases`` (H200): the shipped Gluon launch with its ``TIMING`` stamps (``launch_attention_fp8_ws(timing=)``):
per phase (setup, exact-key steps, correction chunks, epilogue) the summed program time over the SM
count, the time per exact step and per correction chunk, the steps of each kind, the span and the
least / most busy SM (``phase_summary``); the output equal to the untimed launch's. Writes
``gluon_fp8_phases.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re

import torch
import triton

from flashprefill.impl.triton import attention_fp8_ws_kernels as wk
from flashprefill.impl.triton import host_fp8


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """One configuration of the kernel: ``AttnConfig.ws_stages`` / ``ws_pingpong``."""

    stages: int = 4
    pingpong: bool = False

    @property
    def name(self) -> str:
        return f"ws_s{self.stages}{'_pp' if self.pingpong else ''}"


def gluon_configs() -> dict[str, GluonConfig]:
    out = [GluonConfig(4), GluonConfig(3), GluonConfig(3, True), GluonConfig(2)]
    return {c.name: c for c in out}


def launch(q, kv, seq_lens, cu_seqlens_q, plan, index, softmax_scale: float, cfg: GluonConfig, block_size: int,
           mean_correction: bool = True, means=None):
    """``host_fp8.launch_attention_fp8_ws`` with the FP8 tiles of d and ``cfg``'s ring (``means``: its
    correction operands made beforehand, ``host_fp8.index_correction_operands``)."""
    from flashprefill.impl.triton.tiles import get_config

    tiles = get_config(q.shape[2], q.dtype, block_size, precision="fp8", variant="gluon_ws").attn
    tiles = dataclasses.replace(tiles, ws_stages=cfg.stages, ws_pingpong=cfg.pingpong)
    return host_fp8.launch_attention_fp8_ws(q, kv, seq_lens, cu_seqlens_q, softmax_scale, plan, tiles,
                                            mean_correction=mean_correction, block_size=block_size, index=index,
                                            means=means)


# ------------------------------------------------------------------------------------------ compile

def compile_config(cfg: GluonConfig, sass_dir: str | None = None, mean_correction: bool = True,
                   head_dim: int = 128, timing: bool = False, v_perm: bool = True) -> dict:
    """Compile ``cfg`` for sm_90 on this machine (GQA group 4): registers and spills (ptxas ``-v``),
    shared memory, ``SETMAXNREG`` values and the SASS count of e4m3 wgmma (``QGMMA``); or ``error``.
    ``timing``: the lab's ``TIMING`` stamps on (``t_ptr`` an int64 pointer), else as shipped
    (``t_ptr=None``). ``v_perm``: V in the wgmma order (``Fp8KV.v_perm``, what ``host_fp8.prepare`` makes
    for this kernel), else token order (a layout conversion of ``P8`` each step); the SASS files of
    token order end in ``_tokord``."""
    import compile_sm90 as cs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    def _desc(t2, box):
        return TensorDescriptor.from_tensor(t2, box, gl.NVMMASharedLayout.get_default_for(box, gl.float8e4nv))

    d = head_dim
    kd = _desc(torch.zeros(8 * 256, d, dtype=torch.float8_e4m3fn), [128, d])
    vd = _desc(torch.zeros(8 * d, 256, dtype=torch.float8_e4m3fn), [d, 128])
    fn = wk._attn_fwd_fp8_ws
    ptrs = {n: "*i32" for n in ("cu_seqlens_k", "seq_lens", "cu_seqlens_q", "tile_request", "tile_local", "row_ptr",
                                "col_idx", "block_ptr", "mean_cols", "sel_bits")}
    ptrs.update(q_ptr="*bf16", out_ptr="*bf16", k_scale="*fp32", v_scale="*fp32", lse_ptr="*fp32",
                k_desc=mangle_type(kd), v_desc=mangle_type(vd), km_desc=mangle_type(kd), vm_desc=mangle_type(vd))
    consts = dict(GROUP=4, HEAD_DIM=d, TILE_ROWS=128, BLOCK_SIZE=128, STAGES=cfg.stages, PINGPONG=cfg.pingpong,
                  MEAN_CORR=mean_correction, CONSUMER_REGS=host_fp8.WS_CONSUMER_REGS,
                  PRODUCER_REGS=host_fp8.WS_PRODUCER_REGS, TIMING=timing, V_PERM=v_perm)
    if timing:
        ptrs["t_ptr"] = "*i64"
    else:
        consts["t_ptr"] = None
    sig = cs._sig(fn, ptrs, consts, floats=("scale_log2",))
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride") or n == "total_k"))}
    res = {"config": cfg.name, "mean_correction": mean_correction, "d": d}
    try:
        k = triton.compile(GluonASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "maxnreg": host_fp8.WS_MAXNREG})
    except Exception as e:   # the compiler's message is the result
        res["error"] = " | ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())[:3000] or type(e).__name__
        return res
    res["smem_kib"] = round(k.metadata.shared / 1024, 1)
    res.update(cs.ptxas_report(k.asm["ptx"]))
    sass = cs.sass_of(k.asm["cubin"])
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
        tag = f"{cfg.name}_d{d}{'' if mean_correction else '_nomc'}{'_timing' if timing else ''}{'' if v_perm else '_tokord'}"
        with open(os.path.join(sass_dir, tag + ".sass"), "w") as f:
            f.write(sass)
        with open(os.path.join(sass_dir, tag + ".ttgir"), "w") as f:
            f.write(k.asm["ttgir"])
    res["setmaxnreg"] = sorted({f"{op.lower()} {int(n, 16)}" for op, n in
                               re.findall(r"USETMAXREG\.(\w+)\.CTAPOOL(?: UP\d,)? (0x[0-9a-f]+)", sass)})
    res["qgmma"] = len(re.findall(r"\bQGMMA\b", sass))
    res["warpgroup_wait"] = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    res["byte_moves"] = len(re.findall(r"\b(?:PRMT|SHFL)\b", sass))      # P8's conversion shows here
    return res


# ------------------------------------------------------------------------------------------ time

def run_length(L: int, names: list[str], shape: tuple[int, int, int] = (32, 8, 128)) -> dict:
    """One length on the GPU (``shape`` = query heads, KV heads, d; page 64, default ``SparseConfig``): the
    operator totals (index + pre-pass + attention) in BF16 and FP8 on the Triton kernel, their attention alone with and
    without the mean correction (index and pre-pass built beforehand), then per Gluon
    configuration its attention with / without the correction (rel L2 of the output and max |ΔLSE|
    against the shipped FP8 kernel of the same mode) and its operator total (the shipped FP8 index
    and pre-pass, then ``launch``). Medians of ``do_bench`` (ms)."""
    from fp8_variants import rel_l2

    from flashprefill import SparseConfig, make_plan
    from flashprefill.bench import synthetic_inputs, time_ms
    from flashprefill.impl.triton import host, host_fp8
    from flashprefill.impl.triton.tiles import get_config

    HQ, HKV, D = shape
    config = SparseConfig()
    no_mc = dataclasses.replace(config, mean_correction=False)
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, HQ, HKV, D, torch.bfloat16, 64, 1)
    scale = 1.0 / math.sqrt(D)
    plan = make_plan(sl, cu, HQ // HKV, config.block_size)
    # the Triton FP8 kernel (the default FP8 kernel before the twentieth session): what each Gluon
    # configuration is compared against
    kcfg = get_config(D, torch.bfloat16, config.block_size, precision="fp8", variant="triton_fp8")
    index16 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
    index8 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
    kv = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax, hw_cvt=kcfg.index.hw_cvt)
    # the Gluon kernel's operands as host_fp8.prepare makes them for it: V in the wgmma order
    kv_ws = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax, hw_cvt=kcfg.index.hw_cvt, v_perm=True)

    def fp8_attn(mc):
        return host_fp8.launch_attention_fp8(q, kv, sl, cu, scale, plan, kcfg.attn, sparse=True, mean_correction=mc,
                                             block_size=config.block_size, index=index8)

    ms = {
        "bf16_total": time_ms(lambda: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan)),
        "fp8_total": time_ms(lambda: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg,
                                                    precision="fp8")),
        "bf16_attn": time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index16)),
        "bf16_attn_nomc": time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, no_mc, scale, plan, index16)),
        "fp8_attn": time_ms(lambda: fp8_attn(True)),
        "fp8_attn_nomc": time_ms(lambda: fp8_attn(False)),
    }
    ms["means_prep"] = time_ms(lambda: host_fp8.index_correction_operands(
        index8, kv_ws, plan, mean_correction=True, block_size=config.block_size, ws=True))
    ms["host_launch_fp8"] = host_launch_ms(lambda: fp8_attn(True))
    row = {"L": L, "shape": f"{HQ}/{HKV}/{D}", "density8": index8.nnz / max(1, int(index8.n_visible.sum())), "shipped_ms": ms}
    print(f"  L={L} shipped {ms} density {row['density8']:.4f}", flush=True)
    refs = {True: fp8_attn(True), False: fp8_attn(False)}
    row["probe"] = {}
    for name in names:
        cfg = gluon_configs()[name]
        r = {}
        try:
            for mc, tag in ((True, ""), (False, "_nomc")):
                out, lse = launch(q, kv_ws, sl, cu, plan, index8, scale, cfg, config.block_size, mc)
                torch.cuda.synchronize()
                ref_out, ref_lse = refs[mc]
                fin = torch.isfinite(ref_lse)
                r["rel_l2" + tag] = rel_l2(out, ref_out)
                r["lse_max_abs" + tag] = float((lse[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
                r["lse_inf_mismatch" + tag] = int((torch.isfinite(lse) != fin).sum())
                r["nonfinite_out" + tag] = int((~torch.isfinite(out)).sum())
                r["attn" + tag] = time_ms(lambda: launch(q, kv_ws, sl, cu, plan, index8, scale, cfg, config.block_size,
                                                         mc))

            means = host_fp8.index_correction_operands(index8, kv_ws, plan, mean_correction=True,
                                                       block_size=config.block_size, ws=True)
            r["attn_kernel"] = time_ms(lambda: launch(q, kv_ws, sl, cu, plan, index8, scale, cfg, config.block_size,
                                                      True, means))
            r["host_launch"] = host_launch_ms(lambda: launch(q, kv_ws, sl, cu, plan, index8, scale, cfg,
                                                             config.block_size, True))

            def total():
                idx = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
                kvx = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=idx.kv_amax, hw_cvt=kcfg.index.hw_cvt,
                                           v_perm=True)
                return launch(q, kvx, sl, cu, plan, idx, scale, cfg, config.block_size, True)

            r["total"] = time_ms(total)
            r["x_bf16_total"] = ms["bf16_total"] / r["total"]
            r["x_bf16_attn"] = ms["bf16_attn"] / r["attn"]
            r["x_fp8_attn"] = ms["fp8_attn"] / r["attn"]
        except Exception as e:  # a configuration that does not compile or launch is reported, not fatal
            r["error"] = f"{type(e).__name__}: {' | '.join(str(e).splitlines())[:600]}"
        row["probe"][name] = r
        print(f"  L={L} {name}: {r}", flush=True)
    del q, kc, vc, kv, kv_ws
    torch.cuda.empty_cache()
    return row


def phase_summary(stamps: torch.Tensor, n_sm: int) -> dict:
    """Where the Gluon kernel's programs spend their time, from ``launch_attention_fp8_ws(timing=)``'s
    int64 ``[n_programs, 8]`` rows (ns stamps: start, consumer start, first correction step, loop
    end, stores end; SM id; exact steps; correction steps). Per phase the summed program time over
    ``n_sm`` (ms: comparable with the kernel time at one program per SM): ``setup`` (Q tile, the
    split), ``exact`` (the exact-key steps), ``correction`` (the mean-key chunks), ``epilogue``;
    ``exact_us_per_step`` / ``correction_us_per_step`` (one program's time per step of each kind,
    over all programs); the launch's span, and the least / most busy SM (ms). The loop is pipelined
    (step ``t`` issues ``S_t`` and ``P_{t-1} V_{t-1}``), so the phases split at a step's start: the
    last exact step's ``P V`` counts in ``correction``."""
    t = stamps.to(torch.float64)
    phase = {name: float((t[:, b] - t[:, a]).sum() / n_sm / 1e6)
             for name, a, b in (("setup", 0, 1), ("exact", 1, 2), ("correction", 2, 3), ("epilogue", 3, 4))}
    steps_exact, steps_corr = float(t[:, 6].sum()), float(t[:, 7].sum())
    phase["exact_us_per_step"] = float((t[:, 2] - t[:, 1]).sum() / max(steps_exact, 1.0) / 1e3)
    phase["correction_us_per_step"] = float((t[:, 3] - t[:, 2]).sum() / max(steps_corr, 1.0) / 1e3)
    phase["steps_exact"], phase["steps_correction"] = int(steps_exact), int(steps_corr)
    busy = t[:, 4] - t[:, 0]
    sm = stamps[:, 5].long()
    per_sm = torch.zeros(int(sm.max()) + 1, dtype=torch.float64).index_add_(0, sm, busy)
    per_sm = per_sm[per_sm > 0]
    phase.update(span_ms=float((t[:, 4].max() - t[:, 0].min()) / 1e6), sm_busy_min_ms=float(per_sm.min() / 1e6),
                 sm_busy_max_ms=float(per_sm.max() / 1e6), n_sm_used=int(per_sm.numel()))
    return phase


def run_phases(L: int, shape: tuple[int, int, int] = (32, 8, 128), out: str | None = None) -> dict:
    """The shipped Gluon launch at one length with ``TIMING`` stamps (the operands the index prepared),
    its output equal to the untimed launch's; ``phase_summary`` of the second of two timed runs. With
    ``out``, the raw stamps go to ``out/gluon_fp8_stamps_<L>_<HQ>-<HKV>-<D>.pt`` (int64 [n_programs, 8])."""
    from flashprefill import SparseConfig, make_plan
    from flashprefill.bench import synthetic_inputs
    from flashprefill.impl.triton import host
    from flashprefill.impl.triton.tiles import get_config

    HQ, HKV, D = shape
    config = SparseConfig()
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, HQ, HKV, D, torch.bfloat16, 64, 1)
    scale = 1.0 / math.sqrt(D)
    plan = make_plan(sl, cu, HQ // HKV, config.block_size)
    kcfg = get_config(D, torch.bfloat16, config.block_size, precision="fp8", variant="gluon_ws")
    index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
    ops = index.fp8_operands
    stamps = torch.zeros(plan.n_tiles * HKV, 8, dtype=torch.int64, device=q.device)

    def run(timing=None):
        return host_fp8.launch_attention_fp8_ws(q, ops.kv, sl, cu, scale, plan, kcfg.attn, mean_correction=True,
                                                block_size=config.block_size, index=index, means=ops.means,
                                                timing=timing)

    want = run()
    run(stamps)
    got = run(stamps)
    torch.cuda.synchronize()
    n_sm = torch.cuda.get_device_properties(q.device).multi_processor_count
    if out is not None:
        torch.save(stamps.cpu(), os.path.join(out, f"gluon_fp8_stamps_{L}_{HQ}-{HKV}-{D}.pt"))
    row = {"L": L, "shape": f"{HQ}/{HKV}/{D}", "same_output": bool(torch.equal(got[0], want[0])),
           **phase_summary(stamps.cpu(), n_sm)}
    print(f"  {row}", flush=True)
    return row


def host_launch_ms(fn, n: int = 20) -> float:
    """Host milliseconds per call of ``fn`` (the launch path: Python, argument binding, descriptor
    encoding, host-side preparation and any synchronising copy in it), the GPU drained before and
    after (``n`` calls after one warm-up)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        m = row["shipped_ms"]
        lines.append(f"L={row['L']} heads/d {row['shape']} density {row['density8']:.4f}: shipped BF16 total {m['bf16_total']:.3f} attn "
                     f"{m['bf16_attn']:.3f} (noMC {m['bf16_attn_nomc']:.3f}); FP8 total {m['fp8_total']:.3f} "
                     f"({m['bf16_total'] / m['fp8_total']:.2f}x) attn {m['fp8_attn']:.3f} (noMC {m['fp8_attn_nomc']:.3f}); "
                     f"means prep {m['means_prep']:.3f}; host per FP8 attention call {m['host_launch_fp8']:.3f}")
        lines.append(f"{'kernel':>12} {'total':>8} {'x bf16':>6} {'attn':>8} {'x bf16':>6} {'x fp8':>6} {'noMC':>8} "
                     f"{'kernel':>8} {'host':>7} {'relL2':>8} {'dLSE':>7} {'relL2 nMC':>9} {'dLSE nMC':>8}")
        for name, r in row["probe"].items():
            if "error" in r:
                lines.append(f"{name:>12} {r['error'][:300]}")
            else:
                lines.append(f"{name:>12} {r['total']:8.3f} {r['x_bf16_total']:6.2f} {r['attn']:8.3f} "
                             f"{r['x_bf16_attn']:6.2f} {r['x_fp8_attn']:6.2f} {r['attn_nomc']:8.3f} {r['attn_kernel']:8.3f} "
                             f"{r['host_launch']:7.3f} {r['rel_l2']:8.5f} "
                             f"{r['lse_max_abs']:7.4f} {r['rel_l2_nomc']:9.5f} {r['lse_max_abs_nomc']:8.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from flashprefill.lengths import parse_length

    known = gluon_configs()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("compile", help="compile every configuration for sm_90 (no GPU)")
    c.add_argument("--sass", default=None, help="write each configuration's SASS and TTGIR into this directory")
    c.add_argument("--configs", default=",".join(known), help="comma-separated configuration names")
    t = sub.add_parser("time", help="time the configurations against the shipped kernels (H200)")
    t.add_argument("--lens", default="32k,128k", help="comma-separated lengths (e.g. 32k,128k)")
    t.add_argument("--configs", default=",".join(known), help="comma-separated configuration names")
    t.add_argument("--shapes", default="32/8/128", help="comma-separated query heads/KV heads/d (d 64 or 128)")
    t.add_argument("--out", default=".", help="directory of gluon_fp8.json")
    ph = sub.add_parser("phases", help="per-phase time of the shipped Gluon launch from TIMING stamps (H200)")
    ph.add_argument("--lens", default="32k,128k", help="comma-separated lengths (e.g. 32k,128k)")
    ph.add_argument("--shapes", default="32/8/128", help="comma-separated query heads/KV heads/d (d 64 or 128)")
    ph.add_argument("--configs", default="ws_s4", help=argparse.SUPPRESS)
    ph.add_argument("--out", default=".", help="directory of gluon_fp8_phases.json and the raw stamps")
    a = ap.parse_args(argv)
    names = [n for n in a.configs.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"--configs: expected names from {sorted(known)}, got {a.configs!r}")
    if a.mode == "compile":
        for n in names:
            for d in (128, 64):
                for mc in (True, False):
                    print(compile_config(known[n], a.sass, mean_correction=mc, head_dim=d), flush=True)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit(f"gluon_fp8.py {a.mode} needs a CUDA GPU with TMA and FP8 tensor cores (sm_90)")
    from fp8_variants import write_rows

    shapes = [tuple(int(v) for v in sh.split("/")) for sh in a.shapes.split(",") if sh]
    if a.mode == "phases":
        rows = [run_phases(parse_length(x), sh, a.out) for sh in shapes for x in a.lens.split(",") if x]
        print(f"{'L':>7} {'shape':>9} {'setup':>7} {'exact':>7} {'corr':>7} {'epi':>6} {'us/exact':>8} "
              f"{'us/corr':>8} {'n exact':>8} {'n corr':>7} {'span':>7} {'SM min':>7} {'SM max':>7} same")
        for r in rows:
            print(f"{r['L']:>7} {r['shape']:>9} {r['setup']:7.3f} {r['exact']:7.3f} {r['correction']:7.3f} "
                  f"{r['epilogue']:6.3f} {r['exact_us_per_step']:8.3f} {r['correction_us_per_step']:8.3f} "
                  f"{r['steps_exact']:8d} {r['steps_correction']:7d} {r['span_ms']:7.3f} {r['sm_busy_min_ms']:7.3f} "
                  f"{r['sm_busy_max_ms']:7.3f} {r['same_output']}")
        write_rows(a.out, "gluon_fp8_phases.json", rows)
        return 0
    rows = [run_length(parse_length(x), names, sh) for sh in shapes for x in a.lens.split(",") if x]
    print(table(rows))
    write_rows(a.out, "gluon_fp8.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
