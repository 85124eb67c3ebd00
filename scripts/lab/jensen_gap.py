"""The mean key's Jensen gap: how much of a pruned block's attention mass the folded mean logit keeps,
and whether a second-order (variance) term on that logit helps (lab; CPU).

    PYTHONPATH=kernels:. python scripts/lab/jensen_gap.py [--len 7168] [--index 0] [--seed 0]
        [--layers 2-29] [--hay-rows 192] [--clamp 1,2] [--json FILE]

Same prompt, model and dense prefill as ``scripts/lab/needle_recall.py`` (``niah_multikey`` sample
``--index`` of seed ``--seed``, SmolLM2-135M float32 on the CPU, the ``bf16`` profile's sparse section
fitted to the model's 8K context); its per-layer hook hands this script each layer's q / k / v.

In each sparse layer (``--layers``, default every layer past the profile's ``dense_layers``) the
``bf16`` profile's selection is built (``flashprefill_attention(..., return_index=True)``, reference
backend), and for a set of query rows (every (token, query head) of the needle sentences, and
``--hay-rows`` haystack tokens drawn at random among the body tokens that have pruned context,
``t >= sink + window + B``, all query heads; dense-tail tokens excluded) this script recomputes the
sparse softmax of section 4 of ``docs/method.md`` itself, in float64, with the folded block ``j`` of
the row's tile (``U``) given the logit

    mean      τ q·k̄_j + ln n_j                                  (today's; checked against the operator)
    diag      mean + ½ τ² Σ_c q_c² σ²_{j,c}                      (per-channel key variance of block j)
    iso       mean + ½ τ² ||q||² · mean_c σ²_{j,c}               (one scalar per block)
    diag<=c   mean + min(c, diag term)                           (``--clamp``)
    full*     mean + ½ τ² qᵀ Σ_j q                               (full key covariance; oracle of the Gaussian form)
    exact*    ln Σ_{i∈j} exp(τ q·k_i)                            (the block's true mass; oracle; value still v̄_j)
    X+tilt*   logit X (mean, full*, exact*), value v̄_j + Cov(v, k)_j τq instead of v̄_j (the value a
              jointly Gaussian block takes under the weights exp(τ q·k); a d x d matrix per block)
    drop      no folded key (``mean_correction: false``)

(* oracles a kernel cannot afford: they bound what any logit correction can do). Per row it
reports ``ratio = estimated mass on the folded blocks / true (dense) mass on the pruned blocks`` and
the output's error against dense attention: relative L2 over the needle rows and over the haystack
rows of each layer (``||o - o_dense|| / ||o_dense||``, rows and heads pooled). The ratio's
distribution is over the rows whose true pruned mass is >= 1% (the rows where it matters); ``agg``
is ``Σ est / Σ true`` over all rows.

Cost (2 shared CPU cores): ~6 min in all for the 28 sparse layers with the defaults (the dense prefill
and 24 decode steps, ~5 s per analysed layer). Nothing of size ``L`` outlives its layer but the
sampled rows' outputs; each layer holds the rows' logits ``[Hq, rows, L]`` in float64 (~0.15 GB).

Result (``docs/eval.md`` "The mean key's Jensen gap"): the folded mean logit keeps ~4% of the pruned
mass in layers 2-9, but every logit correction, even the exact block mass, raises the output error:
the folded value ``v̄_j`` is the wrong value for that mass.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import needle_recall as nr  # noqa: E402  (the lab's machinery: load, prompt, dense run with a per-layer hook)

from flashprefill import flashprefill_attention  # noqa: E402
from flashprefill.impl.reference import _csr_to_mask  # noqa: E402
from flashprefill.integrations import transformers as fpt  # noqa: E402

MIN_TRUE_MASS = 0.01  # rows whose pruned mass is below this are left out of the ratio's distribution
TILE_ROWS = 128


def _blocks(x: torch.Tensor, B: int) -> torch.Tensor:
    """``[Hkv, L, d]`` -> float64 ``[Hkv, nb, B, d]``, zero padded, on ``x``'s device."""
    hkv, L, d = x.shape
    nb = -(-L // B)
    xp = torch.zeros(hkv, nb * B, d, dtype=torch.float64, device=x.device)
    xp[:, :L] = x.double()
    return xp.view(hkv, nb, B, d)


def block_stats(k: torch.Tensor, v: torch.Tensor, B: int):
    """Per-block statistics over each block's valid tokens, float64: ``k_mean, v_mean [Hkv, nb, d]``,
    ``var [Hkv, nb, d]`` (keys' per-channel variance, clamped at 0), ``cov [Hkv, nb, d, d]`` (keys'
    covariance), ``cvk [Hkv, nb, d, d]`` (``Cov(v, k)``: rows v channels, columns k channels), ``n [nb]``;
    on ``k``'s device."""
    L = k.shape[1]
    kp, vp = _blocks(k, B), _blocks(v, B)
    nb = kp.shape[1]
    j = torch.arange(nb, device=k.device)
    n = (torch.clamp((j + 1) * B, max=L) - j * B).double()
    mean = kp.sum(2) / n[None, :, None]
    vmean = vp.sum(2) / n[None, :, None]
    m2 = (kp * kp).sum(2) / n[None, :, None]
    var = (m2 - mean * mean).clamp_min(0)
    cov = torch.einsum("hjbc,hjbe->hjce", kp, kp) / n[None, :, None, None] - mean[..., :, None] * mean[..., None, :]
    cvk = torch.einsum("hjbc,hjbe->hjce", vp, kp) / n[None, :, None, None] - vmean[..., :, None] * mean[..., None, :]
    return mean, vmean, var, cov, cvk, n


def variants(clamps) -> list[str]:
    return (["mean", "diag", "iso"] + [f"diag<={c:g}" for c in clamps]
            + ["full*", "exact*", "full+tilt*", "exact+tilt*", "mean+tilt*", "drop"])


def analyse_layer(q, k, v, scale, cfg, tokens: torch.Tensor, clamps) -> dict:
    """Rows = every query head of each token in ``tokens`` (int64 ``[R]``).

    Returns per variant: ``ratio [Hq, R]`` (nan where nothing is pruned), ``out [Hq, R, d]``; plus
    ``true [Hq, R]`` (dense mass on pruned blocks), ``dense [Hq, R, d]``, ``ref_err`` (the
    operator's output vs this script's ``mean`` variant, relative L2) and ``density``."""
    hq, L, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    B = cfg.block_size
    nb = -(-L // B)
    kc, vc = fpt._paged(k[None]), fpt._paged(v[None])
    pt = torch.arange(kc.shape[0], dtype=torch.int32)[None]
    o_ref, index = flashprefill_attention(
        q.transpose(0, 1).contiguous(), kc, vc, pt, torch.tensor([L], dtype=torch.int32),
        torch.tensor([0, L], dtype=torch.int32), config=cfg, softmax_scale=scale, return_index=True,
        backend="reference")
    n_tiles = int(index.tile_ptr[-1])
    mask = _csr_to_mask(index, hkv, n_tiles, nb)                       # [Hkv, T, nb]
    hs, hv = index.head_counts()

    kmean, vmean, kvar, kcov, cvk, n = block_stats(k, v, B)
    R = tokens.numel()
    h_ = torch.arange(hq)
    rho = tokens[None, :] * g + (h_ % g)[:, None]                      # packed row of (head, token)
    tile = rho // TILE_ROWS                                            # [Hq, R]
    t_first = (tile * TILE_ROWS) // g
    kept = mask[(h_ // g)[:, None], tile]                              # [Hq, R, nb]
    j = torch.arange(nb)
    e = torch.clamp((j + 1) * B, max=L)
    U = ~kept & (e[None, None, :] <= (t_first + 1)[..., None])         # folded blocks of the row's tile

    qs = q[:, tokens].double() * scale                                 # τ q, [Hq, R, d]
    kh = k.double()[h_ // g]                                           # [Hq, L, d]
    vh = v.double()[h_ // g]
    logits = qs @ kh.transpose(1, 2)                                   # [Hq, R, L]
    pos = torch.arange(L)
    causal = pos[None, None, :] <= tokens[None, :, None]
    logits = logits.masked_fill(~causal, -math.inf)
    p_dense = torch.softmax(logits, -1)
    dense = p_dense @ vh                                               # [Hq, R, d]
    blk = pos // B
    pruned_key = ~kept.gather(2, blk.expand(hq, R, L)) & causal        # keys of pruned blocks
    true = (p_dense * pruned_key).sum(-1)
    folded_key = U.gather(2, blk.expand(hq, R, L))
    assert bool((pruned_key <= folded_key).all()), "a pruned block outside U (window < tile span?)"

    exact_logits = logits.masked_fill(pruned_key, -math.inf)           # kept keys, causal
    base = qs @ kmean[h_ // g].transpose(1, 2) + torch.log(n)          # τ q·k̄_j + ln n_j, [Hq, R, nb]
    qsq = qs * qs
    diag = 0.5 * qsq @ kvar[h_ // g].transpose(1, 2)                   # ½ τ² Σ q_c² σ²_c
    iso = 0.5 * qsq.sum(-1, keepdim=True) * kvar[h_ // g].mean(-1)[:, None, :]
    full = 0.5 * torch.einsum("hrc,hjce,hre->hrj", qs, kcov[h_ // g], qs)
    lp = torch.nn.functional.pad(logits, (0, nb * B - L), value=-math.inf).view(hq, R, nb, B)
    exact_blk = torch.logsumexp(lp, -1)
    folded = {"mean": base, "diag": base + diag, "iso": base + iso, "full*": base + full, "exact*": exact_blk,
              "full+tilt*": base + full, "exact+tilt*": exact_blk, "mean+tilt*": base, "drop": None}
    for c in clamps:
        folded[f"diag<={c:g}"] = base + diag.clamp(max=c)

    res = {"true": true, "dense": dense, "density": int(hs.sum()) / int(hv.sum()),
           "variants": {}}
    vm = vmean[h_ // g]                                                # [Hq, nb, d]
    # The Gaussian tilt of the value: under weights exp(τ q·k) a jointly Gaussian block's mean value
    # is v̄_j + Cov(v, k)_j τq (per row and block: [Hq, R, nb, d]).
    v_tilt = vm[:, None] + torch.einsum("hjce,hre->hrjc", cvk[h_ // g], qs)
    for name in variants(clamps):
        fl = folded[name]
        if fl is None:
            cols = exact_logits
            m = cols.amax(-1)
            pe = torch.exp(cols - m[..., None])
            out = (pe @ vh) / pe.sum(-1, keepdim=True)
            est = torch.zeros_like(true)
        else:
            fl = fl.masked_fill(~U, -math.inf)
            m = torch.maximum(exact_logits.amax(-1), fl.amax(-1))
            pe = torch.exp(exact_logits - m[..., None])
            pf = torch.exp(fl - m[..., None])
            den = pe.sum(-1) + pf.sum(-1)
            folded_v = (torch.einsum("hrj,hrjc->hrc", pf, v_tilt) if name.endswith("tilt*") else pf @ vm)
            out = (pe @ vh + folded_v) / den[..., None]
            est = pf.sum(-1) / den
        ratio = torch.where(true > 0, est / true.clamp_min(1e-300), torch.full_like(true, math.nan))
        res["variants"][name] = {"ratio": ratio, "est": est, "out": out}
    ref_rows = o_ref.double()[tokens].transpose(0, 1)                  # [Hq, R, d]
    res["ref_err"] = nr.rel(res["variants"]["mean"]["out"], ref_rows)
    return res


def quantiles(x: torch.Tensor) -> dict:
    x = x[torch.isfinite(x)]
    if not x.numel():
        return {"n": 0}
    qs = torch.quantile(x, torch.tensor([0.1, 0.5, 0.9], dtype=x.dtype)).tolist()
    return {"n": int(x.numel()), "p10": qs[0], "median": qs[1], "p90": qs[2]}


def parse_layers(spec: str | None, n_layers: int, first: int) -> list[int]:
    if not spec:
        return list(range(first, n_layers))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def niah_prompt(tok, ct, length: int, index: int, seed: int, context: int):
    """``fp eval``'s ``niah_multikey`` sample ``index`` of ``seed`` at ``length`` tokens (chat template
    of ``ct``, ``needle_recall.ChatTokenizer``) and its needles (``needle_recall.needles``):
    ``(sample, needles)``. Shared by this script and ``vertical_blocks.py`` (the same prompt)."""
    from fpcli.ruler.haystack import GeneratedHaystack
    from fpcli.ruler.tasks import TASKS, make_sample

    sample = make_sample(TASKS["niah_multikey"], length, index, seed, GeneratedHaystack(), ct, context)
    text = tok.apply_chat_template(ct.messages(sample.system, sample.user), add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == sample.ids
    return sample, nr.needles(text, enc["offset_mapping"], sample.expected[0])


def needle_rows(L: int, cfg, needles: list[dict], hay_rows: int, seed: int):
    """The query tokens the diagnosis measures: every needle-sentence token before the dense tail,
    then ``hay_rows`` haystack tokens drawn (``seed``) from ``[lo, body_end)``, ``lo`` = sink +
    window + one block (rows with pruned context). Returns ``(tokens int64 [R], is_needle bool [R],
    needle_tok list, hay_tok int64, lo, body_end)``. Shared with ``vertical_blocks.py``."""
    body_end = L - cfg.dense_tail_tokens
    needle_tok = sorted({t for nd in needles for t in range(*nd["tokens"]) if t < body_end})
    lo = cfg.sink_tokens + cfg.window_tokens + cfg.block_size
    pool = torch.tensor([t for t in range(lo, body_end) if t not in set(needle_tok)])
    gen = torch.Generator().manual_seed(seed)
    hay_tok = pool[torch.randperm(pool.numel(), generator=gen)[:hay_rows]].sort().values
    tokens = torch.cat([torch.tensor(needle_tok), hay_tok])
    is_needle = torch.zeros(tokens.numel(), dtype=torch.bool)
    is_needle[:len(needle_tok)] = True
    return tokens, is_needle, needle_tok, hay_tok, lo, body_end


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--len", default="7168")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", default=None, help="sparse layers to analyse, e.g. 2-9,18 (default: all sparse)")
    ap.add_argument("--hay-rows", type=int, default=192, help="haystack tokens sampled per layer (all heads)")
    ap.add_argument("--clamp", default="1,2", help="caps c of the diag<=c variants (comma list; empty: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from fpcli.commands.bench import parse_lengths

    length = parse_lengths(args.len)[0]
    clamps = [float(c) for c in args.clamp.split(",") if c]
    torch.manual_seed(0)
    ns = argparse.Namespace(model=None, device="cpu", context=None, dtype="float32")
    eng, ctx = nr.load(ns)
    tok, model = eng.tokenizer, eng.model
    ct = nr.ChatTokenizer(tok)
    sample, nl = niah_prompt(tok, ct, length, args.index, args.seed, ctx)
    L = len(sample.ids)
    cfg, dense_layers = nr.profile_base(ctx)
    n_layers = model.config.num_hidden_layers
    layers = parse_layers(args.layers, n_layers, dense_layers)
    tokens, is_needle, needle_tok, hay_tok, lo, body_end = needle_rows(L, cfg, nl, args.hay_rows, args.seed)
    print(f"{eng.model_name} ({eng.dtype}); {L} tokens; {cfg}; dense_layers {dense_layers}; layers {layers}\n"
          f"needle tokens {len(needle_tok)} ({[nd['tokens'] for nd in nl]}), haystack tokens {hay_tok.numel()}"
          f" from [{lo}, {body_end})", flush=True)
    names = variants(clamps)
    per_layer = []

    def on_layer(layer, q, k, v, scale):
        if layer not in layers:
            return
        r = analyse_layer(q.float(), k.float(), v.float(), scale, cfg, tokens, clamps)
        row = {"layer": layer, "density": r["density"], "ref_err": r["ref_err"], "variants": {}}
        true = r["true"]
        for grp, sel in (("needle", is_needle), ("haystack", ~is_needle)):
            t = true[:, sel]
            row[f"true_{grp}"] = quantiles(t.flatten())
            for name in names:
                vr = r["variants"][name]
                big = t >= MIN_TRUE_MASS
                d = row["variants"].setdefault(name, {})
                d[f"ratio_{grp}"] = quantiles(vr["ratio"][:, sel][big])
                d[f"agg_{grp}"] = float(vr["est"][:, sel].sum() / t.sum().clamp_min(1e-300))
                d[f"err_{grp}"] = nr.rel(vr["out"][:, sel], r["dense"][:, sel])
                d[f"ratio_all_{grp}"] = vr["ratio"][:, sel][big].tolist()
        per_layer.append(row)
        v_ = row["variants"]
        print(f"layer {layer:2d} density {r['density']:.2f} ref-check {r['ref_err']:.1e} true mass needle med "
              f"{row['true_needle'].get('median', 0):.3f} hay med {row['true_haystack'].get('median', 0):.3f} | err needle/hay "
              + " ".join(f"{nm} {v_[nm]['err_needle']:.3f}/{v_[nm]['err_haystack']:.3f}" for nm in names)
              + " | ratio med needle " + " ".join(f"{nm} {v_[nm]['ratio_needle'].get('median', math.nan):.2f}" for nm in names
                                                   if nm != "drop"), flush=True)

    nr.run_model(model, sample.ids, None, nl, on_layer=on_layer)

    groups = {"all": [r["layer"] for r in per_layer],
              "early (2-9)": [r["layer"] for r in per_layer if r["layer"] <= 9]}
    print("\nsummary (ratio = folded-block mass estimate / true pruned mass, rows with true >= 1%, pooled over "
          "layers and heads; err = relative L2 vs dense, mean over layers)")
    summary = {}
    for gname, ls in groups.items():
        rows = [r for r in per_layer if r["layer"] in ls]
        if not rows:
            continue
        print(f"-- layers {gname}: {len(rows)}")
        print(f"{'variant':>10} | {'ratio needle p10/med/p90':>26} | {'ratio hay p10/med/p90':>24} | "
              f"{'agg needle':>10} {'agg hay':>8} | {'err needle':>10} {'err hay':>8}")
        for nm in names:
            vals = {}
            for grp in ("needle", "haystack"):
                xs = [x for r in rows for x in r["variants"][nm][f"ratio_all_{grp}"]]
                vals[grp] = quantiles(torch.tensor(xs, dtype=torch.float64)) if xs else {"n": 0}
            agg = {grp: sum(r["variants"][nm][f"agg_{grp}"] for r in rows) / len(rows) for grp in ("needle", "haystack")}
            err = {grp: sum(r["variants"][nm][f"err_{grp}"] for r in rows) / len(rows) for grp in ("needle", "haystack")}
            summary.setdefault(gname, {})[nm] = {"ratio": vals, "agg": agg, "err": err}

            def fq(x):
                return f"{x.get('p10', math.nan):6.2f}/{x.get('median', math.nan):6.2f}/{x.get('p90', math.nan):7.2f}"
            print(f"{nm:>10} | {fq(vals['needle']):>26} | {fq(vals['haystack']):>24} | {agg['needle']:10.3f} "
                  f"{agg['haystack']:8.3f} | {err['needle']:10.4f} {err['haystack']:8.4f}")
    report = {"tokens": L, "config": str(cfg), "needles": nl, "layers": per_layer, "summary": summary,
              "needle_tokens": len(needle_tok), "hay_tokens": int(hay_tok.numel())}
    if args.json:
        for row in report["layers"]:
            for d in row["variants"].values():
                for key in [k_ for k_ in d if k_.startswith("ratio_all_")]:
                    del d[key]
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
