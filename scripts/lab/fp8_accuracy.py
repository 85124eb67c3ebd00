"""FP8 (e4m3) attention error on a real model's activations, per layer, for a few scale schemes (CPU lab).

    PYTHONPATH=kernels:. python scripts/lab/fp8_accuracy.py [--model DIR] [--tokens 3072] [--json FILE]

Loads the embedded SmolLM2-135M (``fpcli.models.model_path()``, pulled by ``fp models pull``;
``--model`` for another Hugging Face folder) in float32 on the CPU, runs one prefill of this
repository's README.md and docs/*.md (the first ``--tokens`` tokens) with an attention function that
records each layer's q, k, v (RoPE applied) and attends with SDPA (the model itself runs dense, in
float32, so every layer sees the same activations whatever the scheme). Then, per layer, the dense
causal attention of those q / k / v in float64 ("exact") against:

- ``bf16``: q, k, v rounded to bfloat16, fp32 softmax and products (the BF16 path's input rounding);
- ``shipped``: docs/fp8.md's rules (``flashprefill.quant``): K and V one scale per KV head over all
  tokens, Q one scale per 128-row GQA-packed tile, P cast as ``e4m3(p * 256)`` against the row max,
  the denominator summing the unquantised p;
- ``ksmooth``: as shipped, K minus its per-(KV head, channel) mean over the tokens before the scale
  and the cast (SageAttention's K smoothing: ``q·k̄`` is a per-row constant of the softmax);
- ``ksmooth_vsmooth``: also V minus its per-(KV head, channel) mean, added back after the division
  (``P (v - v̄) / l + v̄``, rows of ``P / l`` sum to 1);
- ``kvblock``: K and V one scale per 128-token block (no smoothing);
- ``ksmooth_qtoken``: K smoothing and one Q scale per packed row instead of per tile;
- ``ksmooth_migrate``: K smoothing and a per-(KV head, channel) migration ``q / c``, ``k * c``,
  ``c = sqrt(amax_q / amax_k)`` (SmoothQuant, alpha 1/2; exact in real arithmetic);
- ``int8qk`` / ``int8qk_ksmooth``: ``Q K^T`` on symmetric int8 (``amax / 127``; Q per tile, K per KV
  head, without / with K smoothing), ``P V`` on e4m3 as shipped (SageAttention's split).

Dense causal attention isolates the quantisation error (the sparse selection is the same for every
scheme; the mean keys follow the same scales). Prints, per layer, the relative L2 of each scheme's
output against exact (over all heads) and the worst query head's, then the median and mean over
layers. CPU only, ~8 minutes for 3072 tokens and every scheme on 2 shared cores (``--layers``,
``--schemes`` narrow it). ``--breakdown``: one operand of the shipped rules quantised at a time.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from flashprefill import quant

TILE_ROWS = 128
SCHEMES = ("bf16", "shipped", "ksmooth", "ksmooth_vsmooth", "kvblock", "ksmooth_qtoken", "ksmooth_migrate",
           "int8qk", "int8qk_ksmooth")
# Diagnostics (``--breakdown``): one operand of the shipped rules quantised, the others exact.
BREAKDOWN = ("q_only", "k_only", "ksmooth_k_only", "v_only", "p_only")


def capture(model_dir: str, tokens: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]], int]:
    """One float32 prefill; returns per layer ``(q [Hq, L, d], k [Hkv, L, d], v [Hkv, L, d], τ)`` and L."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    root = Path(__file__).resolve().parents[2]
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    layers: dict[int, tuple] = {}

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layers[int(module.layer_idx)] = (query[0].detach().clone(), key[0].detach().clone(),
                                         value[0].detach().clone(), float(scaling))
        g = query.shape[1] // key.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("fp8_capture", record)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="fp8_capture").eval()
    with torch.no_grad():
        model(ids)
    return [layers[i] for i in sorted(layers)], ids.shape[1]


def _group_rt(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """e4m3 round trip of ``x`` (float32) with scales from ``amax`` (broadcastable to ``x``)."""
    s, inv = quant.amax_scales(amax)
    return quant.round_trip(x, s, inv, torch.float32)


def _int8_rt(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 round trip (scale ``amax / 127``, round to nearest even), float32."""
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / s).clamp(-127, 127) * s


def operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: str):
    """The operands a scheme's GEMMs stand for, float32, plus V's mean to add back (or None).

    q: ``[Hq, L, d]``; k, v: ``[Hkv, L, d]`` (float32). Q tiles: 128 GQA-packed rows of one KV head
    (token-major, the g heads of a token adjacent), as the kernels pack them.
    """
    hq, L, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    if scheme == "bf16":
        return q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), None
    if scheme in BREAKDOWN:
        one = {"q_only": 0, "k_only": 1, "ksmooth_k_only": 1, "v_only": 2, "p_only": 3}[scheme]
        full = operands(q, k, v, "ksmooth" if scheme == "ksmooth_k_only" else "shipped")
        return tuple(full[i] if i == one else x for i, x in enumerate((q, k, v))) + (None,)
    if scheme == "ksmooth_migrate":
        # Per-channel migration (SmoothQuant, alpha 1/2) after K smoothing: q_c / c, (k - k̄)_c * c with
        # c = sqrt(amax_q / amax_k) per (KV head, channel); q·k unchanged in exact arithmetic.
        kc = k - k.mean(1, keepdim=True)
        aq = quant.abs_max(q.view(hkv, g, L, d), (1, 2)).clamp_min(1e-6)
        ak = quant.abs_max(kc, (1,)).clamp_min(1e-6)
        c = (aq / ak).sqrt()[:, None, :]                                # [Hkv, 1, d]
        q = (q.view(hkv, g, L, d) / c[:, None]).reshape(hq, L, d)
        k = kc * c
        scheme = "shipped"
    rows = L * g
    n_t = -(-rows // TILE_ROWS)
    qp = q.new_zeros(hkv, n_t * TILE_ROWS, d)
    qp[:, :rows] = q.view(hkv, g, L, d).permute(0, 2, 1, 3).reshape(hkv, rows, d)
    qp = qp.view(hkv, n_t, TILE_ROWS, d)
    if scheme in ("int8qk", "int8qk_ksmooth"):
        # SageAttention's split: Q K^T on int8 (Q per tile, K (- k̄) per KV head), P V on e4m3 as shipped.
        qp = _int8_rt(qp, quant.abs_max(qp, (-2, -1))[..., None, None])
        q8 = qp.view(hkv, -1, d)[:, :rows].reshape(hkv, L, g, d).permute(0, 2, 1, 3).reshape(hq, L, d)
        kc = k - k.mean(1, keepdim=True) if scheme == "int8qk_ksmooth" else k
        return q8, _int8_rt(kc, quant.abs_max(kc, (1, 2))[:, None, None]), operands(q, k, v, "shipped")[2], None
    if scheme == "ksmooth_qtoken":                                     # one scale per packed row
        qp = _group_rt(qp, quant.abs_max(qp, (-1,))[..., None])
        scheme = "ksmooth"
    else:
        qp = _group_rt(qp, quant.abs_max(qp, (-2, -1))[..., None, None])
    q8 = qp.view(hkv, -1, d)[:, :rows].reshape(hkv, L, g, d).permute(0, 2, 1, 3).reshape(hq, L, d)
    v_mean = None
    if scheme in ("shipped", "ksmooth", "ksmooth_vsmooth"):
        kk = k - k.mean(1, keepdim=True) if scheme != "shipped" else k
        vv = v
        if scheme == "ksmooth_vsmooth":
            v_mean = v.mean(1, keepdim=True)
            vv = v - v_mean
        k8 = _group_rt(kk, quant.abs_max(kk, (1, 2))[:, None, None])
        v8 = _group_rt(vv, quant.abs_max(vv, (1, 2))[:, None, None])
    elif scheme == "kvblock":
        nb = -(-L // TILE_ROWS)

        def blk(x):
            xp = x.new_zeros(hkv, nb * TILE_ROWS, d)
            xp[:, :L] = x
            xp = xp.view(hkv, nb, TILE_ROWS, d)
            return _group_rt(xp, quant.abs_max(xp, (-2, -1))[..., None, None]).view(hkv, -1, d)[:, :L]

        k8, v8 = blk(k), blk(v)
    else:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    return q8, k8, v8, v_mean


def attend(q, k, v, tau: float, dt: torch.dtype, fp8_p: bool, v_mean=None, chunk: int = 1024) -> torch.Tensor:
    """Dense causal attention ``[Hq, L, d]`` in ``dt``; ``fp8_p``: P as ``e4m3(p * 256)`` in ``P V``."""
    hq, L, d = q.shape
    g = hq // k.shape[0]
    kk = k.to(dt).repeat_interleave(g, 0)
    vv = v.to(dt).repeat_interleave(g, 0)
    out = torch.empty(hq, L, d, dtype=dt)
    pos = torch.arange(L)
    for r0 in range(0, L, chunk):
        r1 = min(L, r0 + chunk)
        s = torch.matmul(q[:, r0:r1].to(dt), kk[:, :r1].transpose(1, 2)) * tau
        s.masked_fill_(pos[None, :r1] > pos[r0:r1, None], -math.inf)
        p = (s - s.amax(-1, keepdim=True)).exp()
        den = p.sum(-1, keepdim=True)
        if fp8_p:
            o = torch.matmul(quant.p_round_trip(p), vv[:, :r1]) / quant.P_SCALE
        else:
            o = torch.matmul(p, vv[:, :r1])
        out[:, r0:r1] = o / den
    if v_mean is not None:
        out = out + v_mean.to(dt).repeat_interleave(g, 0)
    return out


def rel(a: torch.Tensor, ref: torch.Tensor, dims=None) -> torch.Tensor:
    a, ref = a.double(), ref.double()
    if dims is None:
        return ((a - ref).square().sum() / ref.square().sum()).sqrt()
    return ((a - ref).square().sum(dims) / ref.square().sum(dims)).sqrt()


def measure(layers, schemes=SCHEMES, numbers=None) -> list[dict]:
    """Per layer (numbered by ``numbers``, default 0..), each scheme's relative L2 against exact."""
    rows = []
    for i, (q, k, v, tau) in zip(numbers or range(len(layers)), layers):
        q, k, v = q.float(), k.float(), v.float()
        exact = attend(q.double(), k.double(), v.double(), tau, torch.float64, False)
        row = {"layer": i, "k_bias": float((k.mean(1).norm(dim=-1) / k.std(1).norm(dim=-1)).mean())}
        for sc in schemes:
            q8, k8, v8, vm = operands(q, k, v, sc)
            fp8_p = sc not in ("bf16", *BREAKDOWN) or sc == "p_only"
            out = attend(q8, k8, v8, tau, torch.float32, fp8_p, vm)
            row[sc] = float(rel(out, exact))
            row[sc + "_head_max"] = float(rel(out, exact, (1, 2)).max())
        rows.append(row)
        print(" ".join([f"L{i:02d} bias {row['k_bias']:5.2f}"] +
                       [f"{sc} {100 * row[sc]:5.2f}% ({100 * row[sc + '_head_max']:5.2f})" for sc in schemes]), flush=True)
    return rows


def summary(rows, schemes=SCHEMES) -> str:
    import statistics

    lines = ["| scheme | median layer % | mean layer % | worst layer % | worst head % |", "|---|---|---|---|---|"]
    for sc in schemes:
        v = [r[sc] * 100 for r in rows]
        h = [r[sc + "_head_max"] * 100 for r in rows]
        lines.append(f"| {sc} | {statistics.median(v):.2f} | {statistics.mean(v):.2f} | {max(v):.2f} | {max(h):.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Hugging Face folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--layers", default=None, help="comma-separated layer numbers (default: all)")
    ap.add_argument("--schemes", default=None, help=f"comma-separated, of {', '.join(SCHEMES)}")
    ap.add_argument("--breakdown", action="store_true",
                    help=f"measure one quantised operand at a time instead: {', '.join(BREAKDOWN)}")
    ap.add_argument("--json", default=None, help="write the per-layer rows here")
    args = ap.parse_args()
    if args.model is None:
        from fpcli.models import model_path

        args.model = str(model_path())
    torch.set_grad_enabled(False)
    layers, n = capture(args.model, args.tokens)
    print(f"{len(layers)} layers, {n} tokens, q {tuple(layers[0][0].shape)} k {tuple(layers[0][1].shape)}")
    keep = [int(x) for x in args.layers.split(",")] if args.layers else list(range(len(layers)))
    layers = [layers[i] for i in keep]
    schemes = ("shipped", *BREAKDOWN) if args.breakdown else SCHEMES
    if args.schemes:
        schemes = tuple(args.schemes.split(","))
    rows = measure(layers, schemes, keep)
    print(summary(rows, schemes))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
