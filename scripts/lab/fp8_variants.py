"""FP8 attention kernel variants against BF16 sparse on the GPU (lab, H200): one run, <= ~200 s cold.

    PYTHONPATH=kernels:. python scripts/lab/fp8_variants.py [--lens 32k,128k] [--variants NAME,...] [--out DIR]

For each length (32 query / 8 KV heads, d 128, bf16, page 64, ``flashprefill.bench``'s synthetic
inputs, default ``SparseConfig``): BF16 sparse total, index and attention-only time, then for each
FP8 variant (a ``KernelConfig``: the e4m3 kernel's ``AttnConfig`` and the ``IndexConfig``) its
total (index + pre-pass + attention, as ``host.attention``), its index alone (``host.build_index``),
its pre-pass alone (``host_fp8.kv_operands`` as ``sparse_attention`` calls it, with the index's
``kv_amax``), its attention alone (pre-pass buffers and index built beforehand: the time where an
FP8 KV cache already exists), the same attention without the mean correction (``noMC ms``; ``MC ms``
= the correction's share, also for BF16), the total with the BF16 index instead of the FP8 one
(``bf16idx ms``) and the relative L2 of its output against the BF16 sparse output; the
shipped pre-pass once per length (the ``bf16`` line's "pre ms"). Variants: the
shipped tiles (``get_config``'s default); ``plain`` (every optional field off: the FP8 kernel before the
tenth session, and each variant's base); ``exp_impl="f16"`` (``ex2.approx.f16x2``); ``exp_impl="poly_half"`` (half the exp2
on the FMA pipes); ``fold_scale`` (logit scale fused into the exp2 argument's FFMA); the last two
together, with 2 and 3 stages; ``pipeline`` (the hand software-pipelined exact-key loop) alone
(``pipe``), with ``fold_scale`` (``pipe_fold``) and with 3 stages (``pipe_fold_st3``); ``mean_vec``
(``meanvec``: the mean-correction loop's V-mean tile as 16-byte copies); ``IndexConfig.fused_amax``
(``fusedidx``: ``IndexConfig.fused_amax`` -- the K / V amax reduced by the block-means kernels, no
amax launch in the selection or the pre-pass -- and ``IndexConfig.hw_cvt`` -- the selection's Q codes
and the pre-pass's K / V codes by the hardware cast, no fp32 rounding emulation); ``fusedamax``
(``fused_amax`` alone); ``pipe_fold_meanvec`` and all of them (``pipe_fold_meanvec_fusedidx``);
``loop_guard`` (``guard``: the exact-key loops inside an explicit trip-count check, which takes the
sparse kernel out of ptxas' wgmma serialization, C7515) alone, with ``mean_vec`` (``guard_meanvec``),
with ``fold_scale`` too (``guard_fold_meanvec``) and with ``fusedidx`` (``guard_fold_meanvec_fusedidx``);
``pipeline`` already runs its loop under such a check (``loop_guard`` changes nothing there). ``--variants``
narrows the set (timed in the order given), ``--lens`` the lengths; e.g. ``--lens 128k --variants
shipped,fold,pipe,pipe_fold`` compiles four attention kernels (<= 100 s with a cold Triton cache).
Medians of ``triton.testing.do_bench``. Prints a table and writes ``fp8_variants.json`` into ``--out`` (default ``$OUT``, else the current
directory). Each variant compiles once (the kernel for each variant and mode).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import torch

from flashprefill import SparseConfig, make_plan
from flashprefill.bench import synthetic_inputs, time_ms
from flashprefill.impl.triton import host, host_fp8
from flashprefill.impl.triton.tiles import get_config
from flashprefill.lengths import parse_length

HQ, HKV, D = 32, 8, 128


def variants(block_size: int, d: int = D) -> dict:
    """name -> ``KernelConfig`` of the FP8 kernel at head dim ``d``; ``shipped`` is ``get_config``'s default,
    ``plain`` (and every other variant's starting point) its ``variant="plain"``: every optional field off."""
    base = get_config(d, torch.bfloat16, block_size, precision="fp8", variant="plain")
    a = base.attn
    attn = {
        "plain": a,
        "exp_f16": dataclasses.replace(a, exp_impl="f16"),
        "poly_half": dataclasses.replace(a, exp_impl="poly_half"),
        "fold": dataclasses.replace(a, fold_scale=True),
        "poly_fold": dataclasses.replace(a, exp_impl="poly_half", fold_scale=True),
        "poly_fold_st3": dataclasses.replace(a, exp_impl="poly_half", fold_scale=True, num_stages=3, mc_stages=3),
        "pipe": dataclasses.replace(a, pipeline=True),
        "pipe_fold": dataclasses.replace(a, pipeline=True, fold_scale=True),
        "pipe_fold_st3": dataclasses.replace(a, pipeline=True, fold_scale=True, num_stages=3, mc_stages=3),
        "meanvec": dataclasses.replace(a, mean_vec=True),
        "fusedidx": a,
        "fusedamax": a,
        "pipe_fold_meanvec": dataclasses.replace(a, pipeline=True, fold_scale=True, mean_vec=True),
        "pipe_fold_meanvec_fusedidx": dataclasses.replace(a, pipeline=True, fold_scale=True, mean_vec=True),
        "guard": dataclasses.replace(a, loop_guard=True),
        "guard_meanvec": dataclasses.replace(a, loop_guard=True, mean_vec=True),
        "guard_fold_meanvec": dataclasses.replace(a, loop_guard=True, fold_scale=True, mean_vec=True),
        "guard_fold_meanvec_fusedidx": dataclasses.replace(a, loop_guard=True, fold_scale=True, mean_vec=True),
    }
    index = {"fusedidx": dataclasses.replace(base.index, fused_amax=True, hw_cvt=True),
             "fusedamax": dataclasses.replace(base.index, fused_amax=True)}
    out = {k: dataclasses.replace(base, attn=v, index=index.get(k.rsplit("_", 1)[-1], base.index))
           for k, v in attn.items()}
    return {"shipped": get_config(d, torch.bfloat16, block_size, precision="fp8"), **out}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run_length(L: int, config: SparseConfig, names: list[str], shape: tuple[int, int, int] = (HQ, HKV, D)) -> dict:
    """One length's row: ``shape`` = (query heads, KV heads, head dim)."""
    hq, hkv, d = shape
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, hq, hkv, d, torch.bfloat16, 64, 1)
    scale = 1.0 / math.sqrt(d)
    plan = make_plan(sl, cu, hq // hkv, config.block_size)
    row = {"L": L, "heads": f"{hq}/{hkv}", "d": d}
    index16 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
    row["bf16_density"] = index16.nnz / max(1, int(index16.n_visible.sum()))
    out16 = host.attention(q, kc, vc, pt, sl, cu, config, scale, plan)[0]
    row["bf16_total_ms"] = time_ms(lambda: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan))
    row["bf16_attn_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index16))
    no_mc = dataclasses.replace(config, mean_correction=False)
    row["bf16_attn_nomc_ms"] = time_ms(lambda: host.sparse_attention(q, kc, vc, pt, sl, cu, no_mc, scale, plan, index16))
    row["bf16_index_ms"] = time_ms(lambda: host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan))
    row["prepass_ms"] = time_ms(lambda: host_fp8.kv_operands(kc, vc, pt, sl, plan))
    row["fp8"] = {}
    all_variants = variants(config.block_size, d)
    for name in names:
        kcfg = all_variants[name]
        r = {"attn_config": dataclasses.asdict(kcfg.attn)}
        try:
            index8 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
            kv = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax, hw_cvt=kcfg.index.hw_cvt)

            def attn_only(mean_correction=config.mean_correction):
                return host_fp8.launch_attention_fp8(q, kv, sl, cu, scale, plan, kcfg.attn, sparse=True,
                                                     mean_correction=mean_correction,
                                                     block_size=config.block_size, index=index8)

            out8 = host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")[0]
            r["density"] = index8.nnz / max(1, int(index8.n_visible.sum()))
            r["rel_l2_vs_bf16"] = rel_l2(out8, out16)
            r["finite"] = bool(torch.isfinite(out8).all())
            r["total_ms"] = time_ms(lambda: host.attention(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg,
                                                           precision="fp8"))
            r["attn_ms"] = time_ms(attn_only)
            r["attn_nomc_ms"] = time_ms(lambda: attn_only(False))
            # the FP8 index includes the pre-pass and the means' codes since the twentieth session
            # (BlockIndex.fp8_operands): index_ms overlaps prepass_ms
            r["index_ms"] = time_ms(lambda: host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg,
                                                             precision="fp8"))
            r["prepass_ms"] = time_ms(lambda: host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax,
                                                                   hw_cvt=kcfg.index.hw_cvt))
            r["speedup_total"] = row["bf16_total_ms"] / r["total_ms"]
            r["bf16idx_total_ms"] = _bf16_index_total(q, kc, vc, pt, sl, cu, config, scale, plan, kcfg)
            r["speedup_attn"] = row["bf16_attn_ms"] / r["attn_ms"]
        except Exception as e:  # a variant that does not fit (shared memory) is reported, not fatal
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        row["fp8"][name] = r
        print(f"  L={L} {name}: {r}", flush=True)
    del q, kc, vc, index16
    torch.cuda.empty_cache()
    return row


def _bf16_index_total(q, kc, vc, pt, sl, cu, config, scale, plan, kcfg) -> float | str:
    """ms of the BF16 index (16-bit selection, shipped tiles) + this variant's FP8 attention (pre-pass
    with its own amax launch), or the error: what a BF16 selection would save of the FP8 index's time."""
    def run():
        index = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
        return host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index, kernels=kcfg, precision="fp8")
    try:
        run()
        return time_ms(run)
    except Exception as e:  # reported in the table, not fatal
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def table(rows: list[dict]) -> str:
    lines = [f"{'L':>7} {'heads/d':>9} {'variant':>26} {'total ms':>9} {'x bf16':>7} {'attn ms':>8} {'x bf16':>7} "
             f"{'index ms':>8} {'pre ms':>7} {'relL2':>7} {'density':>8} {'noMC ms':>8} {'MC ms':>6} {'bf16idx ms':>10}"]
    for row in rows:
        sh = f"{row['heads']}/{row['d']}"
        lines.append(f"{row['L']:>7} {sh:>9} {'bf16':>26} {row['bf16_total_ms']:9.3f} {'':>7} {row['bf16_attn_ms']:8.3f} "
                     f"{'':>7} {row['bf16_index_ms']:8.3f} {row['prepass_ms']:7.3f} {'':>7} {row['bf16_density']:8.4f} "
                     f"{row['bf16_attn_nomc_ms']:8.3f} {row['bf16_attn_ms'] - row['bf16_attn_nomc_ms']:6.3f}")
        for name, r in row["fp8"].items():
            if "error" in r:
                lines.append(f"{row['L']:>7} {sh:>9} {name:>26} {r['error']}")
                continue
            lines.append(f"{row['L']:>7} {sh:>9} {name:>26} {r['total_ms']:9.3f} {r['speedup_total']:7.2f} "
                         f"{r['attn_ms']:8.3f} {r['speedup_attn']:7.2f} {r['index_ms']:8.3f} {r['prepass_ms']:7.3f} "
                         f"{r['rel_l2_vs_bf16']:7.4f} {r['density']:8.4f} {r['attn_nomc_ms']:8.3f} {r['attn_ms'] - r['attn_nomc_ms']:6.3f} "
                         f"{_ms(r.get('bf16idx_total_ms')):>10}")
    return "\n".join(lines)


def _ms(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "err" if x else "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lens", default="32k,128k", help="comma-separated lengths (e.g. 128k)")
    ap.add_argument("--variants", default=",".join(variants(SparseConfig().block_size)),
                    help="comma-separated variant names (default: all)")
    ap.add_argument("--shapes", default=f"{HQ}/{HKV}/{D}",
                    help="comma-separated query heads/KV heads/head dim, e.g. 32/8/128,14/2/64 (Qwen2.5-0.5B)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of fp8_variants.json")
    a = ap.parse_args(argv)
    config = SparseConfig()
    known = variants(config.block_size)
    names = [n for n in a.variants.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"--variants: expected names from {sorted(known)}, got {a.variants!r}")
    lens = [parse_length(x) for x in a.lens.replace(" ", ",").split(",") if x]
    try:
        shapes = [tuple(int(x) for x in sh.split("/")) for sh in a.shapes.split(",") if sh]
        if not shapes or any(len(sh) != 3 or sh[0] % sh[1] or sh[2] not in (64, 128, 256) for sh in shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shapes: expected HQ/HKV/D with HQ a multiple of HKV and D in 64/128/256, got {a.shapes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("fp8_variants.py needs a CUDA GPU with FP8 tensor cores (sm_89+)")
    rows = [run_length(L, config, names, sh) for sh in shapes for L in lens]
    print(table(rows))
    write_rows(a.out, "fp8_variants.json", rows)
    return 0


def write_rows(out: str, name: str, rows: list[dict]) -> None:
    """``{"gpu": ..., "rows": rows}`` as ``out/name`` (JSON), and say where."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
