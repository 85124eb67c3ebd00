"""Lab probe: the sparse exact-key loop (no mean correction) with TMA tensor descriptors and
Triton's warp specialisation on sm_90, in FP8 (e4m3) and BF16 (``docs/lab/kernel-notes.md``
"Version 6 probe").

    PYTHONPATH=kernels:. python scripts/lab/ws_probe.py compile [--sass DIR]
    PYTHONPATH=kernels:. python scripts/lab/ws_probe.py time --lens 32k,128k [--out DIR]

``compile`` (no GPU needed): compiles every probe configuration for sm_90 with Triton's bundled
ptxas (as ``compile_sm90.py``) and prints, per configuration, whether the loop was warp-specialised
(``ttg.warp_specialize`` in the TTGIR), its partitions, registers, shared memory, spills, the
``SETMAXNREG`` count and the per-loop SASS counts of ``sass_loops.py`` (wgmma and their waits), and
the ptxas warnings; a configuration that does not compile prints the pass's error.

``time`` (H200): for each length (32 query / 8 KV heads, d 128, ``flashprefill.bench``'s synthetic
inputs, ``SparseConfig(mean_correction=False)``, index and FP8 pre-pass built beforehand): the
shipped BF16 and FP8 attention alone, each probe configuration's time, its x-factor against the
shipped kernel of its precision and the relative L2 of its output against it. Medians of
``triton.testing.do_bench``; writes ``ws_probe.json`` into ``--out``.

The probe kernel ``_ws_fwd`` packs a Q tile as ``_attn_fwd_fp8`` does (``_tile_geometry``: one
program per (tile, KV head), heaviest tiles first, ``BLOCK_M == TILE_ROWS`` GQA-packed rows) and
walks the tile's CSR row ``col_idx[row_ptr[seg]:row_ptr[seg+1]]`` (``host.build_index``) in two
loops: the blocks every row sees whole (no mask), then the diagonal blocks (causal mask and
``pos < Lk``). Each loop runs over steps ``t`` of ``BLOCK_N`` keys, the block id loaded inside the
loop (``col_idx[lo + t // SUBS]``); the unmasked loop is the one ``tl.range(...,
warp_specialize=WS)`` marks. Keys are read through ``tl.make_tensor_descriptor`` (TMA) on one KV
head's 2-D slice:

- FP8: ``k8[h]`` ``[total_k, d]`` and ``v8t[h]`` ``[d, total_k]`` (the pre-pass buffers, request
  ``b`` from ``cu_seqlens_k[b]``), Q quantised per tile, products and scales as ``_attn_fwd_fp8``
  (``_fp8_step``: ``P8 = e4m3(p·256)``, ``lse = m + log2 l - 8``);
- BF16: ``k16[h]`` / ``v16[h]`` ``[total_k, d]`` (``bf16_operands``: the paged caches gathered into
  the same layout), the softmax of ``_attn_fwd`` (``_softmax_step``).

Keys past ``Lk`` read the next request's slots or TMA's zero fill; their logits are ``-inf``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tempfile

import torch
import triton
import triton.language as tl

from flashprefill.impl.triton import attention_fp8_kernels as fk
from flashprefill.impl.triton import attention_kernels as ak
from flashprefill.impl.triton.index_kernels import _tile_geometry
from flashprefill.impl.triton.quant_kernels import _quantize_tile

LN2 = ak.LN2
P_SCALE_LOG2 = fk.P_SCALE_LOG2


@triton.jit
def _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, lo, hi, jd, P, lk, kv0, tok, scale2,
             BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASK: tl.constexpr, FP8: tl.constexpr,
             WS: tl.constexpr, STAGES: tl.constexpr):
    """Exact keys of blocks ``col_idx[lo:hi]`` in steps of ``BLOCK_N`` keys; ``MASK``: the causal
    mask ``p <= P + t`` and ``p < Lk`` on every step. ``kv0``: the request's first slot (int32);
    ``scale2``: the log2-unit logit per unit of ``q kᵀ`` (FP8: ``τ log2e s_q s_k``).

    The mask's key positions come from the loop index, not from ``col_idx``: entry ``e`` is masked
    as block ``jd + e`` (``jd = n_vis - end``). The CSR row ends with the partially visible blocks
    ``n_full .. n_vis-1`` in order (always selected: the local window), so this is the block itself
    where the mask bites, and a block below ``n_full`` (fully visible) for every earlier entry,
    where the mask keeps every key as the real block's would. The consumer warps then need no
    value loaded by the producer (Triton 3.6's Hopper pass only passes TMA-loaded buffers from the
    producer partition to the consumers)."""
    SUBS: tl.constexpr = BLOCK_SIZE // BLOCK_N
    n_steps = (hi - lo) * SUBS
    for t in tl.range(0, n_steps, num_stages=STAGES, warp_specialize=WS):
        e = lo + t // SUBS
        sub = t % SUBS
        j = tl.load(col_idx + e)
        first = j * BLOCK_SIZE + sub * BLOCK_N
        k = k_desc.load([kv0 + first, 0])
        s = tl.dot(q, tl.trans(k))
        if FP8:
            vt = v_desc.load([0, kv0 + first])
            s = s * scale2
        else:
            v = v_desc.load([kv0 + first, 0])
        if MASK:
            pos = (jd + e) * BLOCK_SIZE + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            allowed = (pos[None, :] <= P + tok[:, None]) & (pos < lk)[None, :]
            s = tl.where(allowed, s, float("-inf"))
        if FP8:
            acc, m_i, l_i = fk._fp8_step(acc, m_i, l_i, s, vt, scale2, 0, False, False)
        else:
            acc, m_i, l_i = ak._softmax_step(acc, m_i, l_i, s, v, scale2)
    return acc, m_i, l_i


@triton.jit
def _ws_fwd(qp_ptr, k_ptr, v_ptr, k_scale, v_scale, cu_seqlens_k, seq_lens, cu_seqlens_q, tile_request,
            tile_local, block_ptr, row_ptr, col_idx, out_ptr, lse_ptr,
            stride_ot, stride_oh, stride_lt, stride_lh,
            total_k, total_q, n_tiles, n_programs, n_kv_heads, scale_log2,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, WS: tl.constexpr,
            STAGES: tl.constexpr, ONE_LOOP: tl.constexpr):
    tl.static_assert(BLOCK_M == TILE_ROWS)
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    pid = tl.program_id(0)
    h = pid % n_kv_heads
    tile = n_programs - 1 - pid // n_kv_heads
    b, i, q_start, lq, lk, P, t_first, t_last, n_vis, blk0 = _tile_geometry(
        tile, h, n_tiles, tile_request, tile_local, cu_seqlens_q, seq_lens, block_ptr,
        GROUP, TILE_ROWS, BLOCK_SIZE)
    n_rows = lq * GROUP
    n_full = (P + t_first + 1) // BLOCK_SIZE
    rows = i * TILE_ROWS + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    tok = rows // GROUP
    head = h * GROUP + rows % GROUP
    dims = tl.arange(0, HEAD_DIM)
    # the Q tile by TMA from the GQA-packed copy ``qp [Hkv, total_q * GROUP, d]`` (``pack_q``):
    # request rows from q_start * GROUP, the tile's rows contiguous; the next request's rows (past
    # n_rows) are zeroed as the shipped kernel's masked load does
    q_desc = tl.make_tensor_descriptor(qp_ptr + h.to(tl.int64) * total_q * GROUP * HEAD_DIM,
                                       shape=[total_q * GROUP, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    q = q_desc.load([q_start * GROUP + i * TILE_ROWS, 0])
    q = tl.where(row_ok[:, None], q, 0.0)
    kv0 = tl.load(cu_seqlens_k + b)
    head_base = h.to(tl.int64) * total_k * HEAD_DIM
    k_desc = tl.make_tensor_descriptor(k_ptr + head_base, shape=[total_k, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    if FP8:
        q, s_q = _quantize_tile(q.to(tl.float32))
        s_k = tl.load(k_scale + b * n_kv_heads + h)
        s_v = tl.load(v_scale + b * n_kv_heads + h)
        scale2 = scale_log2 * s_q * s_k
        v_desc = tl.make_tensor_descriptor(v_ptr + head_base, shape=[HEAD_DIM, total_k], strides=[total_k, 1],
                                           block_shape=[HEAD_DIM, BLOCK_N])
    else:
        s_v = 1.0
        scale2 = scale_log2
        v_desc = tl.make_tensor_descriptor(v_ptr + head_base, shape=[total_k, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
    seg = h * n_tiles + tile
    start = tl.load(row_ptr + seg)
    end = tl.load(row_ptr + seg + 1)
    split = tl.maximum(end - (n_vis - n_full), start)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if ONE_LOOP:
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, start, end, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 1, FP8, WS, STAGES)
    else:
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, start, split, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 0, FP8, WS, STAGES)
        acc, m_i, l_i = _ws_loop(acc, m_i, l_i, q, k_desc, v_desc, col_idx, split, end, n_vis - end, P, lk, kv0, tok, scale2,
                                 BLOCK_N, BLOCK_SIZE, 1, FP8, False, STAGES)
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc * (s_v / l_safe)[:, None]
    if FP8:
        lse = tl.where(has, (m_i + tl.log2(l_safe) - P_SCALE_LOG2) * LN2, float("-inf"))
    else:
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    l_off = (q_start + tok).to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
    tl.store(lse_ptr + l_off, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------ host

@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    """One compiled form of ``_ws_fwd``: ``fp8`` operands, ``ws`` (the key loop marked
    ``warp_specialize``: Triton's Hopper pass needs ``num_warps == 4`` and then runs 3 warp groups),
    keys per step ``block_n``, ``num_warps``, ``num_stages`` (the loop's TMA buffers), ``one_loop``
    (every CSR entry in one masked loop; else the unmasked entries, then the diagonal ones)."""

    fp8: bool
    ws: bool
    block_n: int
    num_warps: int
    num_stages: int
    one_loop: bool = True

    @property
    def name(self) -> str:
        return (f"{'fp8' if self.fp8 else 'bf16'}_{'ws' if self.ws else 'nows'}_n{self.block_n}_w{self.num_warps}"
                f"_s{self.num_stages}{'' if self.one_loop else '_2loops'}")


def probe_configs() -> dict[str, ProbeConfig]:
    """The configurations ``compile`` tries: WS with 4 warps (BLOCK_N 64 / 128, 2 / 3 stages, one
    loop; the two-loop form once), and the same TMA loop without WS at 8 warps (the shipped kernels'
    warps) as the control."""
    out = []
    for fp8 in (True, False):
        for bn in (128, 64):
            for st in (2, 3):
                out.append(ProbeConfig(fp8, True, bn, 4, st))
        out.append(ProbeConfig(fp8, True, 128, 4, 2, one_loop=False))
        out.append(ProbeConfig(fp8, False, 128 if fp8 else 64, 8, 2))
        out.append(ProbeConfig(fp8, False, 128 if fp8 else 64, 8, 2, one_loop=False))
    return {c.name: c for c in out}


def pack_q(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``q [total_q, Hq, d]`` -> GQA-packed ``[Hkv, total_q * g, d]`` (row ``t * g + r`` = token ``t``,
    query head ``h * g + r``): each tile's ``128`` rows contiguous for one TMA box. A copy of Q
    (at 128K, 32 heads, d 128: 1 GiB read and written)."""
    total_q, hq, d = q.shape
    g = hq // n_kv_heads
    return q.view(total_q, n_kv_heads, g, d).permute(1, 0, 2, 3).reshape(n_kv_heads, total_q * g, d).contiguous()


def bf16_operands(k_cache, v_cache, page_table, seq_lens, cu_seqlens_k: torch.Tensor, total_k: int):
    """The paged 16-bit caches ``[pages, page_size, Hkv, d]`` gathered into ``(k16, v16)``, each
    ``[Hkv, total_k, d]`` in the FP8 pre-pass buffers' layout (request ``b`` from
    ``cu_seqlens_k[b]``, zero gaps). Host loop over requests (lab)."""
    _, ps, hkv, d = k_cache.shape
    k16 = torch.zeros(hkv, total_k, d, dtype=k_cache.dtype, device=k_cache.device)
    v16 = torch.zeros_like(k16)
    for b, (L, c0) in enumerate(zip(seq_lens.tolist(), cu_seqlens_k.tolist())):
        pages = page_table[b, :-(-L // ps)].long()
        k16[:, c0:c0 + L] = k_cache[pages].reshape(-1, hkv, d)[:L].transpose(0, 1)
        v16[:, c0:c0 + L] = v_cache[pages].reshape(-1, hkv, d)[:L].transpose(0, 1)
    return k16, v16


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for the kernel-built TMA descriptors (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_probe(qp, k_op, v_op, k_scale, v_scale, cu_seqlens_k, seq_lens, cu_seqlens_q, plan, index,
                 softmax_scale: float, cfg: ProbeConfig, block_size: int, hq: int):
    """``_ws_fwd`` over a batch: ``qp`` from ``pack_q``; FP8: ``k_op = k8 [Hkv, total_k, d]``,
    ``v_op = v8t [Hkv, d, total_k]`` (e4m3) and their ``[batch, Hkv]`` float32 scales; BF16: ``k16``
    / ``v16 [Hkv, total_k, d]`` (``bf16_operands``), scales unused. ``index``: the ``BlockIndex`` of
    the same precision. Returns ``(out [total_q, Hq, d] bf16, lse [total_q, Hq] float32, natural log)``.
    Raises ``ValueError`` when ``plan.tile_rows`` is not a multiple of the GQA group."""
    hkv, total_qg, d = qp.shape
    g = hq // hkv
    total_q = total_qg // g
    if plan.tile_rows % g:
        raise ValueError(f"ws_probe: tile_rows {plan.tile_rows} is not a multiple of the GQA group {g}")
    if qp.is_cuda:
        triton.set_allocator(_tma_scratch)
    out = torch.empty(total_q, hq, d, dtype=qp.dtype, device=qp.device)
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=qp.device)
    total_k = k_op.shape[1]
    n_prog = plan.n_tiles
    _ws_fwd[(n_prog * hkv,)](
        qp, k_op, v_op, k_scale, v_scale, cu_seqlens_k, seq_lens, cu_seqlens_q, plan.tile_request, plan.tile_local,
        plan.block_ptr, index.row_ptr, index.col_idx, out, lse,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        total_k, total_q, plan.n_tiles, n_prog, hkv, float(softmax_scale) * ak.LOG2E,
        GROUP=g, HEAD_DIM=d, TILE_ROWS=plan.tile_rows, BLOCK_M=plan.tile_rows, BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size, FP8=cfg.fp8, WS=cfg.ws, STAGES=cfg.num_stages, ONE_LOOP=cfg.one_loop,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


# ------------------------------------------------------------------------------------------ compile

def compile_probe(cfg: ProbeConfig, sass_dir: str | None = None) -> dict:
    """Compile ``cfg`` for sm_90 (GQA group 4, d 128, key blocks 128) on this machine: a dict with
    ``ws`` (``ttg.warp_specialize`` in the TTGIR), ``partitions``, ``regs``, ``smem_kib``,
    ``spill_bytes`` (ptxas ``-v`` on the PTX), ``setmaxnreg`` (SASS count), ``loops`` (per loop:
    instructions, wgmma, their waits' positions: ``sass_loops``), ``ptxas_warnings``; or ``error``
    (the pass's message)."""
    import compile_sm90 as cs
    import sass_loops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    e8 = "*fp8e4nv" if cfg.fp8 else "*bf16"
    ptrs = {n: "*i32" for n in ("cu_seqlens_k", "seq_lens", "cu_seqlens_q", "tile_request", "tile_local",
                                "block_ptr", "row_ptr", "col_idx")}
    ptrs.update(qp_ptr="*bf16", k_ptr=e8, v_ptr=e8, k_scale="*fp32", v_scale="*fp32", out_ptr="*bf16",
                lse_ptr="*fp32")
    consts = dict(GROUP=4, HEAD_DIM=128, TILE_ROWS=128, BLOCK_M=128, BLOCK_N=cfg.block_n, BLOCK_SIZE=128,
                  FP8=cfg.fp8, WS=cfg.ws, STAGES=cfg.num_stages, ONE_LOOP=cfg.one_loop)
    fn = _ws_fwd
    sig = cs._sig(fn, ptrs, consts, floats=("scale_log2",))
    # as a real launch specializes: pointers 16-byte aligned; strides and total_k multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and (n.startswith("stride") or n == "total_k"))}
    res = {"config": cfg.name}
    try:
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    except Exception as e:   # the pass's failure is the result
        msg = str(e)
        res["error"] = " | ".join(ln.strip() for ln in msg.splitlines() if ln.strip())[-400:] or type(e).__name__
        return res
    ttgir = k.asm["ttgir"]
    res["ws"] = "ttg.warp_specialize" in ttgir
    res["partitions"] = len(re.findall(r"partition\d+\(", ttgir))
    res["smem_kib"] = round(k.metadata.shared / 1024, 1)
    res.update(cs.ptxas_report(k.asm["ptx"]))
    sass = cs.sass_of(k.asm["cubin"])
    with tempfile.TemporaryDirectory() as tmp:
        spath = os.path.join(sass_dir or tmp, cfg.name + ".sass")
        if sass_dir:
            os.makedirs(sass_dir, exist_ok=True)
        with open(spath, "w") as f:
            f.write(sass)
        res["setmaxnreg"] = sorted(set(re.findall(r"SETMAXNREG\.\w+(?:\.\w+)*\s+(\d+)", sass)))
        res["loops"] = [{"at": start, "insns": n, "gmma": c["GMMA"], "waits": waits, "gmma_at": gmma,
                         "mufu": c["MUFU"], "syncs": c["SYNCS"]}
                        for start, n, c, waits, gmma in sass_loops.loops(spath) if c["GMMA"] or n >= 64]
    return res


def print_compile(res: dict) -> None:
    if "error" in res:
        print(f"{res['config']:28s} ERROR {res['error']}")
        return
    print(f"{res['config']:28s} ws={int(res['ws'])} partitions={res['partitions']} regs={res['regs']} "
          f"smem={res['smem_kib']}KiB spill={res['spill_bytes']}B setmaxnreg={res['setmaxnreg']}")
    for lp in res["loops"]:
        print(f"    loop @{lp['at']}: {lp['insns']} insns, wgmma {lp['gmma']} at {lp['gmma_at']}, "
              f"waits at {lp['waits']}, MUFU {lp['mufu']}, SYNCS {lp['syncs']}")
    for w in res["ptxas_warnings"]:
        print(f"    ptxas: {w}")


# ------------------------------------------------------------------------------------------ time

def run_length(L: int, names: list[str]) -> dict:
    """One length on the GPU: shipped BF16 / FP8 attention alone (``mean_correction=False``, index
    and pre-pass built beforehand) and each probe configuration: ms, x against the shipped kernel of
    its precision, relative L2 of its output against that kernel's."""
    from fp8_variants import D, HKV, HQ, rel_l2, variants

    from flashprefill import SparseConfig, make_plan
    from flashprefill.bench import synthetic_inputs, time_ms
    from flashprefill.impl.triton import host, host_fp8

    config = SparseConfig(mean_correction=False)
    q, kc, vc, pt, sl, cu, _, _ = synthetic_inputs(L, HQ, HKV, D, torch.bfloat16, 64, 1)
    scale = 1.0 / math.sqrt(D)
    plan = make_plan(sl, cu, HQ // HKV, config.block_size)
    kcfg = variants(config.block_size)["plain"]  # the kernel the probe mirrors
    index16 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan)
    index8 = host.build_index(q, kc, vc, pt, sl, cu, config, scale, plan, kernels=kcfg, precision="fp8")
    kv = host_fp8.kv_operands(kc, vc, pt, sl, plan, amax=index8.kv_amax)
    k16, v16 = bf16_operands(kc, vc, pt, sl, kv.cu_seqlens_k, kv.k8.shape[1])
    qp = pack_q(q, HKV)

    def bf16_shipped():
        return host.sparse_attention(q, kc, vc, pt, sl, cu, config, scale, plan, index16)

    def fp8_shipped():
        return host_fp8.launch_attention_fp8(q, kv, sl, cu, scale, plan, kcfg.attn, sparse=True, mean_correction=False,
                                             block_size=config.block_size, index=index8)

    row = {"L": L, "density16": index16.nnz / max(1, int(index16.n_visible.sum())),
           "density8": index8.nnz / max(1, int(index8.n_visible.sum()))}
    ref = {"bf16": bf16_shipped()[0], "fp8": fp8_shipped()[0]}
    row["shipped_ms"] = {"bf16": time_ms(bf16_shipped), "fp8": time_ms(fp8_shipped)}
    row["probe"] = {}
    for name in names:
        cfg = probe_configs()[name]
        prec = "fp8" if cfg.fp8 else "bf16"
        if cfg.fp8:
            args = (qp, kv.k8, kv.v8t, kv.k_scale.contiguous(), kv.v_scale.contiguous(), kv.cu_seqlens_k, sl, cu, plan,
                    index8)
        else:
            args = (qp, k16, v16, kv.k_scale, kv.v_scale, kv.cu_seqlens_k, sl, cu, plan, index16)

        def probe():
            return launch_probe(*args, scale, cfg, config.block_size, HQ)

        r = {}
        try:
            out = probe()[0]
            r["rel_l2"] = rel_l2(out, ref[prec])
            r["ms"] = time_ms(probe)
            r["x"] = row["shipped_ms"][prec] / r["ms"]
        except Exception as e:  # a configuration that does not compile or launch is reported, not fatal
            r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["probe"][name] = r
        print(f"  L={L} {name}: {r}", flush=True)
    del q, kc, vc, k16, v16, qp, kv
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'L':>7} {'kernel':>28} {'ms':>8} {'x shipped':>9} {'relL2':>8}"]
    for row in rows:
        for prec in ("bf16", "fp8"):
            lines.append(f"{row['L']:>7} {'shipped ' + prec:>28} {row['shipped_ms'][prec]:8.3f}")
        for name, r in row["probe"].items():
            if "error" in r:
                lines.append(f"{row['L']:>7} {name:>28} {r['error']}")
            else:
                lines.append(f"{row['L']:>7} {name:>28} {r['ms']:8.3f} {r['x']:9.2f} {r['rel_l2']:8.5f}")
    return "\n".join(lines)


# The configurations timed by default: those the compile step showed warp-specialised, and the
# same TMA loop without WS at the shipped kernels' 8 warps.
TIMED = ("fp8_ws_n128_w4_s2", "fp8_ws_n64_w4_s2", "fp8_nows_n128_w8_s2",
         "bf16_ws_n128_w4_s2", "bf16_ws_n64_w4_s2", "bf16_nows_n64_w8_s2")


def main(argv=None) -> int:
    from flashprefill.lengths import parse_length

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("compile", help="compile every probe configuration for sm_90 (no GPU)")
    c.add_argument("--sass", default=None, help="write each configuration's SASS into this directory")
    c.add_argument("--configs", default=",".join(probe_configs()), help="comma-separated configuration names")
    t = sub.add_parser("time", help="time the probe against the shipped kernels (H200)")
    t.add_argument("--lens", default="32k,128k", help="comma-separated lengths (e.g. 32k,128k)")
    t.add_argument("--configs", default=",".join(TIMED), help="comma-separated configuration names")
    t.add_argument("--out", default=".", help="directory of ws_probe.json")
    a = ap.parse_args(argv)
    known = probe_configs()
    names = [n for n in a.configs.split(",") if n]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(f"--configs: expected names from {sorted(known)}, got {a.configs!r}")
    if a.mode == "compile":
        results = [compile_probe(known[n], a.sass) for n in names]
        for r in results:
            print_compile(r)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("ws_probe.py time needs a CUDA GPU with TMA and FP8 tensor cores (sm_90)")
    lens = [parse_length(x) for x in a.lens.split(",") if x]
    from fp8_variants import write_rows

    rows = [run_length(L, names) for L in lens]
    print(table(rows))
    write_rows(a.out, "ws_probe.json", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
