"""Why a sparse profile loses multi-key needles: attention-level diagnosis on one prompt (CPU lab).

    PYTHONPATH=kernels:. python scripts/lab/needle_recall.py [--len 7168] [--index 0] [--seed 0]
        [--configs base,alpha=0.02,...] [--json FILE]

Builds one ``niah_multikey`` sample with ``fp eval``'s generator (``fpcli.ruler``: the same prompt as
``fp eval --len 7k --task niah_multikey``), loads the embedded SmolLM2-135M in float32 on the CPU and:

1. runs one dense prefill recording q / k / v per layer (RoPE applied), then greedy-decodes the answer;
2. per configuration (the ``bf16`` profile's sparse knobs, one knob changed at a time, ``--configs``):
   - **isolated error**: in every sparse layer, the operator on the dense run's q / k / v against dense
     attention on them: relative L2 of the output over the needle sentences' rows and over the other
     (haystack) rows, the dense tail left out (it is dense by construction);
   - **selection**: for each needle (``*`` the asked one, the others distractors), the share of the
     query tiles that see its block(s) completely, outside their window and the dense tail, and keep
     them; and the dense attention mass of the needle's own rows that lands on pruned blocks (what
     the mean correction must stand in for);
   - **end to end**: the model run with the configuration (``integrations.transformers``, as the
     transformers engine runs it), its greedy answer, the relative L2 of each layer's K and V at
     the needle rows against the dense run (the cache the answer reads), and at the decode step that
     emits the first digit, the attention mass of the last 8 layers on each needle's value tokens.

Configurations: ``base`` is ``fpcli/builtin_profiles/bf16.yaml``'s sparse section and dense_layers,
with ``min_sparse_len`` fitted to SmolLM2's 8K context as the product fits it (4,096);
``knob=value`` changes one knob (``alpha``, ``window_tokens``, ``sink_tokens``, ``dense_tail_tokens``,
``mean_correction``, ``block_size``, ``dense_layers``); ``+`` joins several (``alpha=0.02+dense_layers=4``).
On 2 shared CPU cores at 7K tokens: ~5 min for the dense run, ~3 min per configuration, ~8 min more
per configuration for the isolated per-layer diagnosis (``--no-layers`` skips it).
"""
from __future__ import annotations

import argparse
import json
import re

import torch

from flashprefill import SparseConfig, flashprefill_attention
from flashprefill.integrations import transformers as fpt
from flashprefill.impl.reference import _csr_to_mask

NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
DEFAULT_CONFIGS = ("base", "alpha=0.02", "alpha=0.01", "window_tokens=2048", "sink_tokens=1024",
                   "dense_tail_tokens=1024", "mean_correction=false", "dense_layers=4", "dense_layers=8")
DECODE_TOKENS = 24
LAST_LAYERS = 8
CONTEXT = 8192  # SmolLM2-135M's context: the product fits min_sparse_len to it (profiles.fit_to_context)


class ChatTokenizer:
    """``encode_chat`` over a Hugging Face tokenizer (what ``fpcli.ruler.make_sample`` needs)."""

    def __init__(self, tok):
        self.tok = tok

    def messages(self, system, user):
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def encode_chat(self, system, user):
        ids = self.tok.apply_chat_template(self.messages(system, user), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]


def profile_base() -> tuple[SparseConfig, int]:
    from fpcli.profiles import load_profile

    prof = load_profile("bf16").fit_to_context(CONTEXT)
    return prof.sparse, prof.dense_layers


def parse_config(spec: str, base: SparseConfig, base_dense: int) -> tuple[SparseConfig, int]:
    cfg, dense = base, base_dense
    if spec == "base":
        return cfg, dense
    for part in spec.split("+"):
        key, _, val = part.partition("=")
        if key == "dense_layers":
            dense = int(val)
        elif key == "mean_correction":
            cfg = cfg.replace(mean_correction=val.lower() in ("1", "true", "on"))
        elif key == "alpha":
            cfg = cfg.replace(alpha=float(val))
        else:
            cfg = cfg.replace(**{key: int(val)})
    return cfg, dense


def needles(text: str, offsets: list[tuple[int, int]], asked_value: str) -> list[dict]:
    """Each needle sentence: key, value, token range of the sentence and of its value."""
    out = []
    starts = torch.tensor([a for a, _ in offsets])
    ends = torch.tensor([b for _, b in offsets])

    def span(a, b):
        idx = torch.nonzero((ends > a) & (starts < b)).flatten()
        return int(idx[0]), int(idx[-1]) + 1

    for m in NEEDLE_RE.finditer(text):
        out.append({"key": m.group(1), "value": m.group(2), "asked": m.group(2) == asked_value,
                    "tokens": span(m.start(), m.end()), "value_tokens": span(m.start(2), m.end(2))})
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))


def run_model(model, ids, runtime, want_decode_mass, needle_list):
    """Prefill with ``runtime`` (None: dense), greedy decode. Returns (answer ids, k/v per layer, q/k/v
    of the prefill per layer, mass per needle at the first digit step)."""
    recorded: dict[int, tuple] = {}
    decode_q: list[dict[int, tuple]] = []

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        layer = int(module.layer_idx)
        if query.shape[2] > 1:
            recorded[layer] = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone(),
                               float(scaling))
        elif want_decode_mass:
            if not decode_q or layer in decode_q[-1]:
                decode_q.append({})
            decode_q[-1][layer] = (query[0, :, 0].detach().clone(), key[0].detach(), float(scaling))
        return fpt.flashprefill_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    from transformers import AttentionInterface

    AttentionInterface.register(fpt.ATTN_NAME, attn)
    fpt.install_flashprefill(model, runtime or fpt.FlashPrefillRuntime(config=None))
    AttentionInterface.register(fpt.ATTN_NAME, attn)  # install registers the plain function again
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        res = model(x, use_cache=True)
        past = res.past_key_values
        nxt = int(res.logits[0, -1].argmax())
        for _ in range(DECODE_TOKENS):
            out.append(nxt)
            res = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
    return out, recorded, decode_q


def decode_mass(decode_q, out_ids, tok, needle_list, n_layers):
    """Attention mass (mean over query heads and the last LAST_LAYERS layers) on each needle's value
    tokens at the step whose output is the first digit. The query of step s (s >= 1) is the token
    out_ids[s-1]; step 0's query is the prompt's last token (inside the prefill): use step s where
    out_ids[s] is the first digit, s >= 1."""
    first = next((s for s, t in enumerate(out_ids) if tok.decode([t]).strip()[:1].isdigit()), None)
    if first is None or first == 0 or first - 1 >= len(decode_q):
        return None
    step = decode_q[first - 1]
    masses = []
    for nd in needle_list:
        a, b = nd["value_tokens"]
        tot = 0.0
        for layer in range(n_layers - LAST_LAYERS, n_layers):
            q, k, scale = step[layer]
            g = q.shape[0] // k.shape[0]
            p = torch.softmax((q.view(k.shape[0], g, -1) @ k.transpose(-1, -2)).float() * scale, -1)
            tot += float(p[..., a:b].sum(-1).mean())
        masses.append(tot / LAST_LAYERS)
    return masses


def layer_diagnosis(rec, cfg: SparseConfig, dense_layers: int, needle_list, lq: int):
    """Isolated per-layer error (needle rows vs haystack rows) and needle-block selection."""
    B = cfg.block_size
    needle_rows = torch.zeros(lq, dtype=torch.bool)
    for nd in needle_list:
        needle_rows[nd["tokens"][0]:nd["tokens"][1]] = True
    body = torch.arange(lq) < lq - cfg.dense_tail_tokens
    hay_rows = body & ~needle_rows
    per_layer = []
    for layer in sorted(rec):
        if layer < dense_layers:
            continue
        q, k, v, scale = rec[layer]                       # [Hq, L, d], [Hkv, L, d]
        hq, hkv = q.shape[0], k.shape[0]
        g = hq // hkv
        dense = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)  # [L, Hq, d]
        kc, vc = fpt._paged(k[None]), fpt._paged(v[None])
        pt = torch.arange(kc.shape[0], dtype=torch.int32)[None]
        sl = torch.tensor([lq], dtype=torch.int32)
        cu = torch.tensor([0, lq], dtype=torch.int32)
        out, index = flashprefill_attention(q.transpose(0, 1).contiguous(), kc, vc, pt, sl, cu, config=cfg,
                                            softmax_scale=scale, return_index=True, backend="reference")
        sel_h, vis = index.head_counts()
        n_tiles = int(index.tile_ptr[-1])
        nb = -(-lq // B)
        mask = _csr_to_mask(index, hkv, n_tiles, nb)      # [Hkv, T, nb]
        rows = lq * g
        tr = index.tile_rows
        t_first = torch.arange(n_tiles) * tr // g
        t_last = (torch.clamp(torch.arange(n_tiles) * tr + tr, max=rows) - 1) // g
        tail = t_last >= lq - cfg.dense_tail_tokens
        win_lo = torch.clamp(t_first - cfg.window_tokens + 1, min=0) // B
        # dense probabilities of the needle rows (for the mass on pruned blocks)
        sel_share, pruned_mass = [], []
        for nd in needle_list:
            a, b = nd["tokens"]
            blocks = list(range(a // B, (b - 1) // B + 1))
            sees = (torch.tensor([(bl + 1) * B for bl in blocks]).max() <= t_last + 1) & ~tail & \
                (win_lo > max(blocks)) & (torch.tensor(min(blocks)) * B >= cfg.sink_tokens)
            if sees.any():
                kept = mask[:, sees][:, :, blocks].any(-1).float().mean()
                sel_share.append(float(kept))
            else:
                sel_share.append(None)
            # rows a..b: the tile of each row; mass of dense softmax on blocks its tile pruned
            qs = q[:, a:b]                                 # [Hq, n, d]
            kk = k.repeat_interleave(g, 0)
            logits = (qs @ kk.transpose(-1, -2)) * scale
            pos = torch.arange(lq)
            logits = logits.masked_fill(pos[None, None, :] > torch.arange(a, b)[None, :, None], -float("inf"))
            p = torch.softmax(logits, -1)                  # [Hq, n, L]
            pb = torch.nn.functional.pad(p, (0, nb * B - lq)).view(hq, b - a, nb, B).sum(-1)  # [Hq, n, nb]
            lost = 0.0
            for i, t in enumerate(range(a, b)):
                tile = (t * g) // tr
                for h in range(hq):
                    lost += float(pb[h, i][~mask[h // g, tile]].sum())
            pruned_mass.append(lost / ((b - a) * hq))
        o = out.view(lq, hq, -1)
        per_layer.append({
            "layer": layer,
            "density": float(sel_h.sum()) / float(vis.sum()),
            "err_needle": rel(o[needle_rows], dense[needle_rows]),
            "err_haystack": rel(o[hay_rows], dense[hay_rows]),
            "needle_block_kept": sel_share,
            "needle_rows_pruned_mass": pruned_mass,
        })
    return per_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--len", type=int, default=7168)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--no-layers", action="store_true", help="skip the isolated per-layer diagnosis")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fpcli.models import model_path
    from fpcli.ruler.haystack import GeneratedHaystack
    from fpcli.ruler.tasks import TASKS, make_sample

    mdir = args.model or str(model_path())
    tok = AutoTokenizer.from_pretrained(mdir)
    ct = ChatTokenizer(tok)
    ctx = CONTEXT
    sample = make_sample(TASKS["niah_multikey"], args.len, args.index, args.seed, GeneratedHaystack(), ct, ctx)
    text = tok.apply_chat_template(ct.messages(sample.system, sample.user), add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == sample.ids, "chat text does not re-tokenize to the sample's ids"
    nl = needles(text, enc["offset_mapping"], sample.expected[0])
    lq = len(sample.ids)
    print(f"sample {sample.id}: {lq} tokens; question: {sample.question}")
    for i, nd in enumerate(nl):
        print(f"  needle {i}{'*' if nd['asked'] else ' '} {nd['key']:>20} = {nd['value']} tokens {nd['tokens']}"
              f" (block {nd['tokens'][0] // 128})")
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers

    out_d, rec_d, dq = run_model(model, sample.ids, None, True, nl)
    ans_d = tok.decode(out_d, skip_special_tokens=True)
    mass_d = decode_mass(dq, out_d, tok, nl, n_layers)
    print(f"dense: answer {ans_d!r} mass on needle values {mass_d}")
    base, base_dense = profile_base()
    report = {"sample": sample.id, "tokens": lq, "needles": nl, "dense": {"answer": ans_d, "mass": mass_d},
              "configs": []}
    for spec in args.configs.split(","):
        cfg, dl = parse_config(spec, base, base_dense)
        rt = fpt.FlashPrefillRuntime(config=cfg, dense_layers=dl, backend="reference")
        out_s, rec_s, sq = run_model(model, sample.ids, rt, True, nl)
        summ = [s for s in rt.summary(n_layers) if s is not None and s.sparse]
        density = sum(s.selected_blocks for s in summ) / max(1, sum(s.visible_blocks for s in summ))
        ans = tok.decode(out_s, skip_special_tokens=True)
        mass = decode_mass(sq, out_s, tok, nl, n_layers)
        kv_err = []
        for layer in range(n_layers):
            row = {}
            for name, idx in (("k", 1), ("v", 2)):
                a = rec_s[layer][idx]
                b = rec_d[layer][idx]
                nr = torch.zeros(lq, dtype=torch.bool)
                for nd in nl:
                    nr[nd["value_tokens"][0]:nd["value_tokens"][1]] = True
                row[name] = rel(a[:, nr], b[:, nr])
            kv_err.append(row)
        entry = {"config": spec, "dense_layers": dl, "density": density, "answer": ans,
                 "correct": sample.expected[0] in ans, "mass": mass, "kv_err_needle_values": kv_err}
        if not args.no_layers:
            entry["layers"] = layer_diagnosis(rec_d, cfg, dl, nl, lq)
        report["configs"].append(entry)
        last_k = sum(r["k"] for r in kv_err[-LAST_LAYERS:]) / LAST_LAYERS
        last_v = sum(r["v"] for r in kv_err[-LAST_LAYERS:]) / LAST_LAYERS
        msg = (f"{spec:>24}: density {density:6.1%} answer {'OK ' if entry['correct'] else 'BAD'} {ans.strip()[:40]!r}"
               f" needle-value K/V err (last {LAST_LAYERS} layers) {last_k:.3f}/{last_v:.3f}"
               f" mass {['%.3f' % m for m in mass] if mass else None}")
        if "layers" in entry:
            L = entry["layers"]
            en = sorted(x["err_needle"] for x in L)[len(L) // 2]
            eh = sorted(x["err_haystack"] for x in L)[len(L) // 2]
            pm = [sum(x["needle_rows_pruned_mass"][i] for x in L) / len(L) for i in range(len(nl))]
            ks = [[x["needle_block_kept"][i] for x in L] for i in range(len(nl))]
            ks = [sum(v for v in s if v is not None) / max(1, sum(v is not None for v in s)) for s in ks]
            msg += (f"\n{'':>26}isolated err median needle {en:.3f} haystack {eh:.3f}; needle rows' dense mass on"
                    f" pruned blocks {['%.3f' % m for m in pm]}; needle blocks kept by later tiles {['%.2f' % s for s in ks]}")
        print(msg, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
