"""Are the pruned keys "vertical" (the same few keys for every row), and do global blocks chosen by the
last queries beat a lower alpha at equal density? (lab; CPU or GPU)

    PYTHONPATH=kernels:. python scripts/lab/vertical_blocks.py [--len 7168] [--index 0] [--seed 0]
        [--model NAME_OR_FOLDER] [--device cpu|cuda] [--context 32k] [--dtype auto|bfloat16|float32]
        [--layers 2-29] [--hay-rows 192] [--last-q 64] [--alphas 0.05,0.03,...] [--globals 4,8,16,32]
        [--global-alphas 0.05,0.1] [--row-chunk N] [--json FILE]

Same prompt, model, dense prefill and rows as ``scripts/lab/jensen_gap.py`` (``niah_multikey`` sample
``--index`` of seed ``--seed``, SmolLM2-135M float32; rows: every query head of the needle sentences'
tokens and of ``--hay-rows`` random haystack tokens with pruned context). ``--model / --device /
--context / --dtype`` load another model as ``scripts/lab/needle_recall.py`` does (its ``load``: the
transformers engine's loading, YaRN beyond the model's context; on ``--device cuda`` the prompt of
``fp eval`` on the SGLang engine); the defaults are the CPU run above, whose output they leave as it
was. ``--len`` takes ``32k``. The analysis runs on the device of the layer's q / k / v, the rows in
float64 there too (``--row-chunk N``: N row tokens at a time, the same numbers). In each sparse layer:

1. Peakedness and verticality of the pruned mass. With the ``bf16`` selection (alpha 0.05), of the
   rows' dense attention mass on pruned blocks, the share on
   (a) the top-1 / top-4 keys of each pruned block (per row),
   (b) the global top-K keys of the KV head (K in ``--topk``), ranked by the dense column mass summed
       over every query row of the layer and the head's query heads (oracle, ``dense*``),
   (c) the same top-K ranked by the last ``--last-q`` queries' attention (``lastq``: the softmax of
       the last tokens' q against all keys, summed over those rows and the group's query heads).
   Both rankings leave out the keys no row could gain: the sink blocks and the blocks in the local
   window of the last sparse tile (kept anyway, or invisible to every earlier tile).
2. Global blocks. Per KV head, the G blocks (``--globals``) with the largest score, outside the
   sink / last window as above, are ORed into every tile's selection where the tile sees the block
   completely (block end <= the tile's first token + 1). Scores: ``lastq-sum`` (the last queries'
   mass summed per block), ``lastq-max`` (the block's largest key, i.e. the blocks of the per-key
   top-K), ``strided-sum`` (the strided queries' mass per block), ``dense-sum*`` (oracle: the dense column mass summed per block). Applied on top of the
   selection at each alpha of ``--global-alphas``. Also global KEYS instead of blocks
   (``--global-keys`` K): each source's top-K keys attended exactly by every row that sees them, the
   folded blocks then standing for their other keys; density counts them as K_t / B blocks. Against the alpha frontier (``--alphas``: the same
   selection at lower alphas), compared at equal density by linear interpolation of the frontier's
   error between the two alphas whose densities bracket the candidate's.

The output of every configuration is the operator's section-4 sparse softmax (``mean_correction``:
unkept, fully seen blocks folded back as ``τ q·k̄_j + ln n_j`` with ``v̄_j``), recomputed here in
float64 (checked against the operator on the first analysed layer); error: relative L2 against dense
over the needle rows and over the haystack rows (rows and heads pooled), mean over layers. Density:
selected / causally visible key blocks over all tiles, pooled over the layers of a group.

Cost (2 shared CPU cores): the dense prefill, then ~20 s per analysed layer (the oracle's dense
column mass over all 7K rows is a full attention per layer); ``--layers`` limits it
(``--layers 2-9,12,16,20,24,28``: ~6 min).

GPU (ESTIMATED, not measured): ``--device cuda --model qwen2.5-coder-0.5b-instruct --context 32k
--dtype bfloat16 --len 32k --layers 2-23`` (Hq 14, Hkv 2, d 64, B 128; R ~ 90 needle + 192 haystack
tokens, L ~ 32K). Memory: per layer the rows' float64 logits and probabilities ``[Hq, R, L]``,
8·Hq·R·L bytes = ~1.0 GB each, ~3 more of that size while the outputs and shares run (the base
selection's pruned mass, the masked logits, their exponentials), the column masses' float32
``[Hq, 512, L]`` chunks (~1 GB each, ~3 at once, before the rows), the model (1 GB of weights, a
0.4 GB KV cache, ~1 GB of prefill activations): peak ~8-10 GB of the H200's 139 GB; ``--row-chunk``
divides the rows' part (only needed far beyond 128K). Time: loading ~0.5-1 min; per layer 8
reference selections (``build_index`` on CUDA, chunked, ~0.1-0.5 s each), three column masses (the
``dense*`` one a full attention, <1 s) and ~30 float64 sparse outputs (~1 GB of traffic each, tens of
ms), the first layer also the reference operator (~2 s): ~3-8 s per layer, ~2-4 min for the 22 layers.

Result (``docs/eval.md`` "Vertical keys"): 64 keys per KV head hold ~85% of the needle rows' pruned
mass; global BLOCKS from the last queries gain nothing on the needle rows at equal density (those
blocks are late, invisible to the needles), global KEYS (last 256 / 64 strided queries' top keys,
kept exactly) cut the needle-row error by ~50-60% for +0.6..1.1 points of density.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jensen_gap as jg  # noqa: E402  (rows, block statistics, layer parsing)
import needle_recall as nr  # noqa: E402  (the lab's machinery: load, prompt, dense run with a per-layer hook)

from flashprefill import flashprefill_attention  # noqa: E402
from flashprefill.impl.reference import _csr_to_mask, _tile_geometry, build_index  # noqa: E402
from flashprefill.integrations import transformers as fpt  # noqa: E402

TILE_ROWS = jg.TILE_ROWS
RANKINGS = ("lastq-sum", "lastq-max", "strided-sum", "dense-sum*")
SOURCES = ("dense*", "lastq", "strided")
DEFAULT_ALPHAS = (0.05, 0.03, 0.02, 0.01, 0.005, 0.002, 0.001, 0.0003)


def selection(q, k, v, scale, cfg) -> torch.Tensor:
    """The operator's selection (reference ``build_index``) as ``[Hkv, n_tiles, nb]`` bool.
    q ``[Hq, L, d]``, k / v ``[Hkv, L, d]``."""
    L, dev = q.shape[1], q.device
    kc, vc = fpt._paged(k[None]), fpt._paged(v[None])
    pt = torch.arange(kc.shape[0], dtype=torch.int32, device=dev)[None]
    index = build_index(q.transpose(0, 1).contiguous(), kc, vc, pt, torch.tensor([L], dtype=torch.int32, device=dev),
                        torch.tensor([0, L], dtype=torch.int32, device=dev), config=cfg, softmax_scale=scale)
    return _csr_to_mask(index, k.shape[0], int(index.tile_ptr[-1]), -(-L // cfg.block_size))


def geometry(L: int, g: int, cfg, device: torch.device | str = "cpu"):
    """``(visible [T, nb], seen [T, nb], excluded [nb])`` bool on ``device``: causally visible blocks of
    each tile, blocks every row of the tile sees completely (the blocks a global set may add), and the
    blocks no global set takes (sink, and the local window of the last sparse tile: kept by every tile
    that sees them)."""
    B = cfg.block_size
    nb = -(-L // B)
    t_first, t_last = _tile_geometry(L, g, TILE_ROWS, torch.device(device))
    j = torch.arange(nb, device=device)
    e = torch.clamp((j + 1) * B, max=L)
    visible = j[None, :] <= (t_last // B)[:, None]
    seen = e[None, :] <= (t_first + 1)[:, None]
    sparse_tiles = torch.nonzero(t_last < L - cfg.dense_tail_tokens).flatten()
    last = int(sparse_tiles[-1]) if sparse_tiles.numel() else 0
    win_lo = max(0, int(t_first[last]) - cfg.window_tokens + 1) // B
    excluded = (j * B < cfg.sink_tokens) | (j >= win_lo)
    return visible, seen, excluded


def density(mask: torch.Tensor, visible: torch.Tensor) -> tuple[int, int]:
    """(selected, visible) block counts of ``mask [Hkv, T, nb]`` (the operator's head_counts)."""
    return int((mask & visible).sum()), int(visible.sum()) * mask.shape[0]


def column_mass(q, k, scale, rows: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Each key's attention mass summed over the query tokens ``rows`` (int64) and the query heads of
    each KV head, causal: float64 ``[Hkv, L]`` on q's device. q ``[Hq, L, d]``, k ``[Hkv, L, d]``; the
    logits in float32, ``chunk`` rows at a time (``[Hq, chunk, L]``: 0.94 GB at Hq 14, L 32K)."""
    hq, L, _ = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    dev = q.device
    rows = rows.to(dev)
    kh = k.float()[torch.arange(hq, device=dev) // g]
    pos = torch.arange(L, device=dev)
    out = torch.zeros(hq, L, dtype=torch.float64, device=dev)
    for c0 in range(0, rows.numel(), chunk):
        r = rows[c0:c0 + chunk]
        s = (q.float()[:, r] * scale) @ kh.transpose(1, 2)                 # [Hq, c, L]
        s = s.masked_fill(pos[None, None, :] > r[None, :, None], -math.inf)
        out += torch.softmax(s, -1).sum(1).double()
    return out.view(hkv, g, L).sum(1)


def global_blocks(score: torch.Tensor, B: int, G: int, excluded: torch.Tensor, how: str) -> torch.Tensor:
    """The ``G`` blocks of each KV head with the largest per-block score (``how``: ``sum`` or ``max``
    of the per-key ``score [Hkv, L]``), never an ``excluded [nb]`` block: ``[Hkv, nb]`` bool."""
    hkv, L = score.shape
    nb = excluded.numel()
    sp = torch.zeros(hkv, nb * B, dtype=score.dtype, device=score.device)
    sp[:, :L] = score
    per = sp.view(hkv, nb, B)
    s = per.sum(-1) if how == "sum" else per.amax(-1)
    s = s.masked_fill(excluded[None], -math.inf)
    G = min(G, int((~excluded).sum()))
    out = torch.zeros(hkv, nb, dtype=torch.bool, device=score.device)
    if G > 0:
        out.scatter_(1, s.topk(G, -1).indices, True)
    return out


def add_global(mask: torch.Tensor, glob: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """``mask [Hkv, T, nb]`` with ``glob [Hkv, nb]`` ORed into every tile that sees the block completely."""
    return mask | (glob[:, None, :] & seen[None])


def top_keys(score: torch.Tensor, K: int, excluded_key: torch.Tensor) -> torch.Tensor:
    """The ``K`` keys of each KV head with the largest ``score [Hkv, L]`` outside ``excluded_key [L]``."""
    s = score.masked_fill(excluded_key[None], -math.inf)
    out = torch.zeros_like(score, dtype=torch.bool)
    out.scatter_(1, s.topk(min(K, int((~excluded_key).sum())), -1).indices, True)
    return out


class Rows:
    """The dense attention of a set of rows (every query head of ``tokens``) and the sparse output
    under any selection mask, in float64 on q's device. q ``[Hq, L, d]``, k / v ``[Hkv, L, d]``,
    ``tokens [R]`` int64. Memory: the logits and probabilities ``[Hq, R, L]`` (2 x 8 Hq R L bytes)
    live with the object, ``out`` and ``peakedness`` add ~3 more of that size while they run."""

    def __init__(self, q, k, v, scale, B: int, tokens: torch.Tensor):
        hq, L, _ = q.shape
        dev = q.device
        tokens = tokens.to(dev)
        self.g = g = hq // k.shape[0]
        self.B, self.L, self.tokens = B, L, tokens
        self.h = torch.arange(hq, device=dev)
        self.hk = self.h // g
        km, vm, _, _, _, n = jg.block_stats(k, v, B)
        self.nb = n.numel()
        self.tile = (tokens[None, :] * g + (self.h % g)[:, None]) // TILE_ROWS     # [Hq, R]
        t_first = (self.tile * TILE_ROWS) // g
        e = torch.clamp((torch.arange(self.nb, device=dev) + 1) * B, max=L)
        self.foldable = e[None, None, :] <= (t_first + 1)[..., None]                # [Hq, R, nb]
        qs = q[:, tokens].double() * scale
        kh, self.vh = k.double()[self.hk], v.double()[self.hk]
        pos = torch.arange(L, device=dev)
        self.causal = pos[None, None, :] <= tokens[None, :, None]
        self.logits = (qs @ kh.transpose(1, 2)).masked_fill(~self.causal, -math.inf)   # [Hq, R, L]
        self.p = torch.softmax(self.logits, -1)
        self.dense = self.p @ self.vh
        self.fold = qs @ km[self.hk].transpose(1, 2) + torch.log(n)                   # τ q·k̄_j + ln n_j
        self.vm = vm[self.hk]
        self.qs, self.k, self.v, self.n = qs, k, v, n

    def kept(self, mask: torch.Tensor) -> torch.Tensor:
        """Per row, the kept blocks ``[Hq, R, nb]`` of its tile."""
        return mask[self.hk[:, None], self.tile]

    def pruned_keys(self, mask: torch.Tensor) -> torch.Tensor:
        kept = self.kept(mask).repeat_interleave(self.B, 2)[..., :self.L]
        return ~kept & self.causal

    def out(self, mask: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """The section-4 sparse softmax (mean correction on) of the rows: float64 ``[Hq, R, d]``.
        ``extra [Hkv, L]`` bool: keys attended exactly besides the kept blocks (global keys); a
        folded block then stands for its other keys only (their mean, their count)."""
        kept = self.kept(mask)
        pruned = self.pruned_keys(mask)
        fold, vm = self.fold, self.vm
        if extra is not None:
            pruned = pruned & ~extra[self.hk][:, None, :]
            B, nb = self.B, self.nb
            x = torch.zeros(extra.shape[0], nb * B, dtype=torch.float64, device=extra.device)
            x[:, :self.L] = extra.double()
            cnt = x.view(-1, nb, B).sum(-1)                                           # [Hkv, nb]
            ks = jg._blocks(self.k * (~extra)[..., None], B).sum(2)                  # the other keys' sums
            vs = jg._blocks(self.v * (~extra)[..., None], B).sum(2)
            n_o = self.n[None] - cnt
            km_o, vm_o = ks / n_o.clamp_min(1)[..., None], vs / n_o.clamp_min(1)[..., None]
            fold = (self.qs @ km_o[self.hk].transpose(1, 2) + torch.log(n_o[self.hk].clamp_min(1))[:, None]
                    ).masked_fill((n_o[self.hk] == 0)[:, None], -math.inf)
            vm = vm_o[self.hk]
        exact = self.logits.masked_fill(pruned, -math.inf)
        fl = fold.masked_fill(kept | ~self.foldable, -math.inf)
        m = torch.maximum(exact.amax(-1), fl.amax(-1))
        pe, pf = torch.exp(exact - m[..., None]), torch.exp(fl - m[..., None])
        return (pe @ self.vh + pf @ vm) / (pe.sum(-1) + pf.sum(-1))[..., None]


def peakedness(rows: Rows, mask, key_sets: dict) -> dict:
    """Per row, the dense mass on pruned keys (``pruned [Hq, R]``) and, for each name, the part of it
    on the top-1 / top-4 keys of each pruned block and on each ``key_sets`` name's keys (``[Hkv, L]``)."""
    pm = rows.p * rows.pruned_keys(mask)
    nb, B = rows.nb, rows.B
    pp = torch.zeros(*pm.shape[:2], nb * B, dtype=pm.dtype, device=pm.device)
    pp[..., :rows.L] = pm
    top = pp.view(*pm.shape[:2], nb, B).topk(4, -1).values                         # [Hq, R, nb, 4]
    res = {"pruned": pm.sum(-1), "top1/block": top[..., 0].sum(-1), "top4/block": top.sum((-1, -2))}
    for name, ks in key_sets.items():
        res[name] = (pm * ks[rows.hk][:, None, :]).sum(-1)
    return res


def analyse_layer(q, k, v, scale, cfg, tokens, alphas, globals_, global_alphas, topk, last_q: int,
                  check: bool = False, global_keys=(), row_chunk: int | None = None) -> dict:
    """Everything of one layer for the rows of ``tokens``: per configuration its block counts and the
    rows' sparse outputs, the peakedness shares (step 1), and (``check``) the operator's output.

    q ``[Hq, L, d]``, k / v ``[Hkv, L, d]`` (float32, any device: the analysis runs on q's device, the
    rows in float64); ``tokens [R]`` int64, R >= 1. ``row_chunk``: build ``Rows`` for at most that many
    tokens at a time (its ``[Hq, R, L]`` float64 tensors are the layer's peak memory; None: all at
    once); the per-row results are the same either way, concatenated along R.

    Returns ``configs`` (name -> ``selected``, ``visible``, ``out [Hq, R, d]``, ``recovered [Hq, R]``),
    ``peak`` (name -> ``[Hq, R]``), ``dense [Hq, R, d]``, ``picked``, ``top_keys`` and, with ``check``,
    ``ref_err``."""
    hq, L, _ = q.shape
    R = tokens.numel()
    if R < 1:
        raise ValueError(f"tokens: expected at least one token, got {R}")
    dev = q.device
    tokens = tokens.to(dev)
    g = hq // k.shape[0]
    B = cfg.block_size
    visible, seen, excluded = geometry(L, g, cfg, dev)
    masks = {a: selection(q, k, v, scale, cfg.replace(alpha=a)) for a in sorted(set(alphas) | set(global_alphas))}
    base = masks[cfg.alpha] if cfg.alpha in masks else selection(q, k, v, scale, cfg)

    body_end = L - cfg.dense_tail_tokens
    # on the CPU, then moved: the same rows whatever the device
    strided = torch.linspace(cfg.sink_tokens + cfg.window_tokens, body_end - 1, last_q).round().long().to(dev)
    score = {"lastq": column_mass(q, k, scale, torch.arange(L - last_q, L, device=dev)),
             "strided": column_mass(q, k, scale, strided),
             "dense*": column_mass(q, k, scale, torch.arange(L, device=dev))}
    excl_key = excluded.repeat_interleave(B)[:L]
    key_sets = {f"{src} top{K}": top_keys(score[src], K, excl_key) for src in SOURCES for K in topk}

    configs = {}
    for a in alphas:
        configs[f"alpha {a:g}"] = masks[a]
    glob_sets = {}
    for rk in RANKINGS:
        src, how = rk.rstrip("*").split("-")
        for G in globals_:
            glob_sets[(rk, G)] = global_blocks(score["dense*" if src == "dense" else src], B, G, excluded, how)
    for a in global_alphas:
        for (rk, G), gb in glob_sets.items():
            configs[f"alpha {a:g} + {rk} G{G}"] = add_global(masks[a], gb, seen)
    # Global keys instead of blocks: the top-K keys of a ranking attended exactly by every row that
    # sees them; density counts them as K_t / B blocks (K_t: those in the tile's unkept, fully seen blocks).
    keyed = {}
    for a in global_alphas:
        for src in SOURCES:
            for K in global_keys:
                ks = top_keys(score[src], K, excl_key)                                # [Hkv, L]
                x = torch.zeros(ks.shape[0], -(-L // B) * B, device=dev)
                x[:, :L] = ks.float()
                per_blk = x.view(ks.shape[0], -1, B).sum(-1)                          # [Hkv, nb]
                add = float(((~masks[a] & seen[None]) * per_blk[:, None, :]).sum()) / B
                keyed[f"alpha {a:g} + {src} keys K{K}"] = (masks[a], ks, add)
    gmax = max(globals_) if globals_ else 8
    res = {"configs": {},
           "picked": {rk: [torch.nonzero(b).flatten().tolist() for b in glob_sets[(rk, gmax)]] for rk in RANKINGS}
           if globals_ else {},
           "top_keys": {src: score[src].masked_fill(excl_key[None], -math.inf).topk(16, -1).indices.tolist()
                        for src in SOURCES}}
    for name, m in configs.items():
        sel, vis = density(m, visible)
        res["configs"][name] = {"selected": sel, "visible": vis}
    for name, (m, _, add) in keyed.items():
        sel, vis = density(m, visible)
        res["configs"][name] = {"selected": sel + add, "visible": vis}

    parts = []
    step = row_chunk or R
    for c0 in range(0, R, step):
        rows = Rows(q, k, v, scale, B, tokens[c0:c0 + step])
        part = {"peak": peakedness(rows, base, key_sets), "dense": rows.dense, "out": {}, "recovered": {}}
        pm = rows.p * rows.pruned_keys(base)                                          # base's pruned mass
        for name, m in configs.items():
            part["out"][name] = rows.out(m)
            part["recovered"][name] = (pm * rows.kept(m).repeat_interleave(B, 2)[..., :L]).sum(-1)
        for name, (m, ks, _) in keyed.items():
            part["out"][name] = rows.out(m, ks)
            part["recovered"][name] = (pm * (rows.kept(m).repeat_interleave(B, 2)[..., :L]
                                             | ks[rows.hk][:, None, :])).sum(-1)
        if check:
            part["base_out"] = rows.out(base)
        parts.append(part)
        del rows, pm

    def cat(get):
        return torch.cat([get(p) for p in parts], 1)

    res["peak"] = {n: cat(lambda p: p["peak"][n]) for n in parts[0]["peak"]}
    res["dense"] = cat(lambda p: p["dense"])
    for name, c in res["configs"].items():
        c["out"] = cat(lambda p: p["out"][name])
        c["recovered"] = cat(lambda p: p["recovered"][name])
    if check:
        kc, vc = fpt._paged(k[None]), fpt._paged(v[None])
        pt = torch.arange(kc.shape[0], dtype=torch.int32, device=dev)[None]
        o_ref = flashprefill_attention(q.transpose(0, 1).contiguous(), kc, vc, pt,
                                       torch.tensor([L], dtype=torch.int32, device=dev),
                                       torch.tensor([0, L], dtype=torch.int32, device=dev), config=cfg,
                                       softmax_scale=scale, backend="reference")
        res["ref_err"] = nr.rel(cat(lambda p: p["base_out"]), o_ref.double()[tokens].transpose(0, 1))
    return res


def frontier_at(points: list[tuple[float, float]], d: float) -> float:
    """The alpha frontier's error at density ``d``: linear between the two points (density, error)
    that bracket it; nan outside the frontier's range."""
    pts = sorted(points)
    for (d0, e0), (d1, e1) in zip(pts, pts[1:]):
        if d0 <= d <= d1:
            return e0 if d1 == d0 else e0 + (e1 - e0) * (d - d0) / (d1 - d0)
    return math.nan


def floats(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked (exit 2 naming the option): ``len`` and ``context`` parsed to tokens, the
    comma lists to lists (``alphas``, ``global_alphas``: float; ``globals_``, ``topk``,
    ``global_keys``: int)."""
    from fpcli.commands.bench import parse_lengths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model name or folder, as fp ask --model (default: the "
                    "transformers engine's default model of the device)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--context", default=None, help="context in tokens (32k): YaRN beyond the model's own")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="the model's dtype (auto: float32 on the CPU, bfloat16 on CUDA)")
    ap.add_argument("--row-chunk", type=int, default=0,
                    help="analyse at most N row tokens at a time (bounds the [Hq, N, L] float64 tensors; 0: all)")
    ap.add_argument("--len", default="7168")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default=None, help="sparse layers to analyse, e.g. 2-9,18 (default: all sparse)")
    ap.add_argument("--hay-rows", type=int, default=192, help="haystack tokens sampled per layer (all heads)")
    ap.add_argument("--last-q", type=int, default=64, help="last query tokens whose attention ranks keys/blocks")
    ap.add_argument("--alphas", default=",".join(f"{a:g}" for a in DEFAULT_ALPHAS), help="the alpha frontier")
    ap.add_argument("--globals", default="4,8,16,32", help="G: global blocks per KV head")
    ap.add_argument("--global-alphas", default="0.05", help="alphas the global blocks are added to")
    ap.add_argument("--topk", default="16,64,256", help="K of the global top-K keys (step 1)")
    ap.add_argument("--global-keys", default="64,256", help="K: global keys per KV head attended exactly")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        args.length = parse_lengths(args.len)[0]
        args.context = parse_lengths(args.context, "--context")[0] if args.context else None
        args.alphas, args.global_alphas = floats(args.alphas), floats(args.global_alphas)
        args.globals_ = [int(x) for x in args.globals.split(",") if x]
        args.topk = [int(x) for x in args.topk.split(",") if x]
        args.global_keys = [int(x) for x in args.global_keys.split(",") if x]
    except ValueError as exc:
        ap.error(str(exc))
    if args.row_chunk < 0:
        ap.error(f"--row-chunk: expected a token count >= 0, got {args.row_chunk}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    alphas, global_alphas = args.alphas, args.global_alphas
    globals_, topk, global_keys, length = args.globals_, args.topk, args.global_keys, args.length
    torch.manual_seed(0)
    eng, ctx = nr.load(args)
    tok, model = eng.tokenizer, eng.model
    # on CUDA the prompt fp eval builds on the SGLang engine (needle_recall.py's)
    ct = nr.ChatTokenizer(tok, reserve="sglang" if args.device == "cuda" else None)
    sample, nl = jg.niah_prompt(tok, ct, length, args.index, args.seed, ctx)
    L = len(sample.ids)
    cfg, dense_layers = nr.profile_base(ctx)
    if cfg.alpha not in alphas:
        alphas = [cfg.alpha] + alphas
    layers = jg.parse_layers(args.layers, model.config.num_hidden_layers, dense_layers)
    tokens, is_needle, needle_tok, hay_tok, lo, body_end = jg.needle_rows(L, cfg, nl, args.hay_rows, args.seed)
    where = "" if args.device == "cpu" else f", {eng.device}, context {ctx:,}"
    print(f"{eng.model_name} ({eng.dtype}{where}); {L} tokens; {cfg}; dense_layers {dense_layers}; layers {layers}\n"
          f"needle tokens {len(needle_tok)}, haystack tokens {hay_tok.numel()}; last-q {args.last_q}", flush=True)
    per_layer = []

    def on_layer(layer, q, k, v, scale):
        if layer not in layers:
            return
        t0 = time.perf_counter()
        r = analyse_layer(q.float(), k.float(), v.float(), scale, cfg, tokens, alphas, globals_, global_alphas,
                          topk, args.last_q, check=not per_layer, global_keys=global_keys,
                          row_chunk=args.row_chunk or None)
        row = {"layer": layer, "ref_err": r.get("ref_err"), "configs": {}, "peak": {}, "picked": r["picked"],
               "top_keys": r["top_keys"], "seconds": time.perf_counter() - t0}
        for grp, sel in (("needle", is_needle.to(q.device)), ("haystack", ~is_needle.to(q.device))):
            pk = r["peak"]
            row["peak"][grp] = {name: float(x[:, sel].sum()) for name, x in pk.items()}
            for name, c in r["configs"].items():
                d = row["configs"].setdefault(name, {"selected": c["selected"], "visible": c["visible"]})
                d[f"err_{grp}"] = nr.rel(c["out"][:, sel], r["dense"][:, sel])
                d[f"recovered_{grp}"] = float(c["recovered"][:, sel].sum())
        per_layer.append(row)
        c = row["configs"]
        pk = row["peak"]["needle"]
        tot = max(pk["pruned"], 1e-300)
        print(f"layer {layer:2d} ({row['seconds']:.0f} s) picked (head 0): "
              + " ".join(f"{rk} {v_[0]}" for rk, v_ in row["picked"].items())
              + "\n   top keys (head 0): " + " ".join(f"{src} {[(t, tok.decode([sample.ids[t]])) for t in v_[0][:8]]}"
                                                   for src, v_ in row["top_keys"].items()) + "\n  ", flush=True)
        print(f"layer {layer:2d}" + (f" ref-check {row['ref_err']:.1e}" if row["ref_err"] is not None else "")
              + " | needle pruned-mass shares " + " ".join(f"{n} {v_ / tot:.2f}" for n, v_ in pk.items() if n != "pruned")
              + " | dens/err needle/hay " + " ".join(f"[{n}] {v_['selected'] / v_['visible']:.2f} "
                                                      f"{v_['err_needle']:.3f}/{v_['err_haystack']:.3f}"
                                                      for n, v_ in c.items()), flush=True)

    nr.run_model(model, sample.ids, None, nl, on_layer=on_layer)

    groups = {f"{lo_}-{hi_}": [r for r in per_layer if lo_ <= r["layer"] <= hi_]
              for lo_, hi_ in ((dense_layers, 9), (dense_layers, max(layers)))}
    summary = {}
    for gname, rows in groups.items():
        if not rows:
            continue
        s = {"peak": {}, "configs": {}}
        for grp in ("needle", "haystack"):
            tot = sum(r["peak"][grp]["pruned"] for r in rows)
            s["peak"][grp] = {n: sum(r["peak"][grp][n] for r in rows) / max(tot, 1e-300)
                              for n in rows[0]["peak"][grp] if n != "pruned"}
            s["peak"][grp]["pruned mass / row"] = tot / len(rows) / (int((is_needle if grp == "needle" else ~is_needle).sum())
                                                                       * model.config.num_attention_heads)
        for name in rows[0]["configs"]:
            cs = [r["configs"][name] for r in rows]
            d = sum(c["selected"] for c in cs) / sum(c["visible"] for c in cs)
            s["configs"][name] = {"density": d, **{f"err_{grp}": sum(c[f"err_{grp}"] for c in cs) / len(cs)
                                                   for grp in ("needle", "haystack")},
                                  **{f"recovered_{grp}": sum(c[f"recovered_{grp}"] for c in cs)
                                     / max(sum(r["peak"][grp]["pruned"] for r in rows), 1e-300)
                                     for grp in ("needle", "haystack")}}
        front = {grp: [(s["configs"][f"alpha {a:g}"]["density"], s["configs"][f"alpha {a:g}"][f"err_{grp}"])
                       for a in alphas] for grp in ("needle", "haystack")}
        for name, c in s["configs"].items():
            for grp in ("needle", "haystack"):
                e = frontier_at(front[grp], c["density"])
                c[f"alpha_err_{grp}"] = e
                c[f"gain_{grp}"] = 1 - c[f"err_{grp}"] / e if e == e and e > 0 else math.nan
        summary[gname] = s
        print(f"\n-- layers {gname} ({len(rows)}): shares of the bf16 selection's pruned dense mass (pooled)")
        for grp in ("needle", "haystack"):
            print(f"  {grp:>8}: " + " ".join(f"{n} {v_:.3f}" for n, v_ in s["peak"][grp].items()))
        print(f"{'config':>32} | {'density':>7} | {'err needle':>10} {'@alpha':>7} {'gain':>6} | "
              f"{'err hay':>8} {'@alpha':>7} {'gain':>6} | {'recov needle':>12} {'hay':>6}")
        for name, c in s["configs"].items():
            print(f"{name:>32} | {c['density']:7.3f} | {c['err_needle']:10.4f} {c['alpha_err_needle']:7.4f} "
                  f"{c['gain_needle']:+6.2f} | {c['err_haystack']:8.4f} {c['alpha_err_haystack']:7.4f} "
                  f"{c['gain_haystack']:+6.2f} | {c['recovered_needle']:12.3f} {c['recovered_haystack']:6.3f}")
    report = {"tokens": L, "config": str(cfg), "needles": nl, "layers": per_layer, "summary": summary,
              "needle_tokens": len(needle_tok), "hay_tokens": int(hay_tok.numel()), "last_q": args.last_q}
    if (args.device, args.model, args.context, args.dtype) != ("cpu", None, None, "auto"):
        # (the CPU default run keeps its earlier report, key for key)
        report["run"] = {"model": eng.model_name, "device": str(eng.device), "dtype": str(eng.dtype), "context": ctx}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
