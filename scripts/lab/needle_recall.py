"""Why a sparse profile loses multi-key needles: attention-level diagnosis on one prompt (lab; CPU or GPU).

    PYTHONPATH=kernels:. python scripts/lab/needle_recall.py [--len 7168] [--index 0] [--seed 0]
        [--model NAME_OR_FOLDER] [--device cpu|cuda] [--context 128k] [--dtype auto|bfloat16|float32]
        [--chunk N] [--configs dense,base,alpha=0.02,...] [--no-layers] [--json FILE]

Builds one ``niah_multikey`` sample with ``fp eval``'s generator (``fpcli.ruler``: the same prompt as
``fp eval --len L --task niah_multikey``, sample ``--index`` of seed ``--seed``; on ``--device cuda`` the
prompt leaves SGLang's context reserve free, as ``fp eval`` on the SGLang engine builds it), loads the
model as the transformers engine loads it (``fpcli.engine.transformers_engine.TransformersEngine``: the
model named as ``fp ask --model`` names it (``fpcli.models.resolve_model``; default: the engine's default
model of the device, Qwen2.5-Coder-0.5B at 131,072 tokens on CUDA, SmolLM2-135M on the CPU), YaRN when
``--context`` exceeds its native context, ``--dtype``) and:

1. runs one dense one-shot prefill, then greedy-decodes the answer. During that prefill, while each
   layer's q / k / v are live, it runs the **isolated per-layer diagnosis** (below) for every
   configuration, so nothing of size ``L`` is kept past its layer; it keeps only K / V at the needle
   value tokens' rows;
2. per configuration (the ``bf16`` profile's sparse knobs, one knob changed at a time, ``--configs``;
   ``dense`` = no sparse layer, the numerical floor of a chunked run):
   - **isolated error** (``layers``): in every sparse layer, the operator on the dense run's q / k / v
     against dense attention on them: relative L2 of the output over the needle sentences' rows and
     over the other (haystack) rows, dense tails left out (dense by construction);
     **selection**: for each needle (``*`` the asked one, the others distractors), the share of the
     query tiles that see its block(s) completely, outside their window and the dense tail, and keep
     them; and the dense attention mass of the needle's own rows that lands on pruned blocks (those
     rows' logits against all keys: ``[Hq, rows, L]``). With ``--chunk N`` the same again with the
     index built chunk by chunk as SGLang builds it (``layers_chunked``: ``Lq`` = the chunk, ``Lk`` =
     prefix + chunk, each chunk's last ``dense_tail_tokens`` rows dense, a chunk shorter than
     ``min_sparse_len`` dense);
   - **end to end** (one-shot, and with ``--chunk N`` also ``chunked``: the prompt prefilled ``N``
     tokens at a time through the model's KV cache, each chunk's attention called with ``Lq = N <
     Lk``, as the transformers engine prefills after a cached prefix): the greedy answer, the relative
     L2 of each layer's K and V at the needle value tokens against the dense one-shot run (the cache
     the answer reads), and at the decode step that emits the first digit, the attention mass of the
     last 8 layers on each needle's value tokens.

Configurations: ``base`` is ``fpcli/builtin_profiles/bf16.yaml``'s sparse section and dense_layers,
with ``min_sparse_len`` fitted to the run's context as the product fits it (4,096 for SmolLM2's 8K);
``knob=value`` changes one knob (``alpha``, ``window_tokens``, ``sink_tokens``, ``dense_tail_tokens``,
``mean_correction``, ``block_size``, ``dense_layers``, ``min_sparse_len``, ``threshold_max``, ``block_score``, ``global_keys``); ``+`` joins several
(``alpha=0.02+dense_layers=4``).

Cost. CPU, SmolLM2-135M float32 at 7K tokens on 2 shared cores: ~5 min for the dense run, ~3 min per
configuration end to end, ~8 min more per configuration for the isolated diagnosis (``--no-layers``
skips it). GPU, Qwen2.5-Coder-0.5B bfloat16 at 131,072 tokens (estimated, not measured): peak GPU
memory ~10-15 GB (weights 1 GB; KV cache 1.6 GB, twice while a chunk's cache is concatenated; the
MLP's ``[L, 4864]`` activations ~4 GB; per layer of the diagnosis the dense and sparse outputs
``[L, Hq, d]`` 0.24 GB each and the needle rows' float32 probabilities ``[Hq, rows, L]`` ~0.2 GB per
needle; logits for the last position only); no q is kept, K / V at ~30 rows per layer.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import torch

from flashprefill import SparseConfig, flashprefill_attention
from flashprefill.impl.reference import _csr_to_mask
from flashprefill.integrations import transformers as fpt

NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
DEFAULT_CONFIGS = ("base", "alpha=0.02", "alpha=0.01", "window_tokens=2048", "sink_tokens=1024",
                   "dense_tail_tokens=1024", "mean_correction=false", "dense_layers=4", "dense_layers=8")
DECODE_TOKENS = 24
LAST_LAYERS = 8
CONTEXT = 8192  # SmolLM2-135M's context: the product fits min_sparse_len to it (profiles.fit_to_context)


class ChatTokenizer:
    """``encode_chat`` over a Hugging Face tokenizer (what ``fpcli.ruler.make_sample`` needs).
    ``reserve``: ``"sglang"`` adds SGLang's ``context_reserve`` (the prompt ``fp eval`` builds on the
    SGLang engine), ``None`` none (the transformers engine's)."""

    def __init__(self, tok, reserve: str | None = None):
        self.tok = tok
        if reserve == "sglang":
            from fpcli.engine.sglang_engine import context_reserve

            self.context_reserve = context_reserve

    def messages(self, system, user):
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def encode_chat(self, system, user):
        ids = self.tok.apply_chat_template(self.messages(system, user), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(x) for x in ids]


def profile_base(context: int = CONTEXT) -> tuple[SparseConfig, int]:
    """The ``bf16`` profile's sparse section fitted to ``context`` tokens, and its dense layers."""
    from fpcli.profiles import load_profile

    prof = load_profile("bf16").fit_to_context(context)
    return prof.sparse, prof.dense_layers


def parse_config(spec: str, base: SparseConfig, base_dense: int) -> tuple[SparseConfig | None, int]:
    """``base`` / ``dense`` / ``knob=value[+knob=value]`` -> (config, dense layers); ``dense``: (None, 0)."""
    cfg, dense = base, base_dense
    if spec == "dense":
        return None, 0
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
        elif key in ("threshold_max", "block_score"):
            cfg = cfg.replace(**{key: val})
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


def value_rows(needle_list) -> list[int]:
    """Token positions of every needle's value (the K / V rows compared end to end)."""
    return sorted({t for nd in needle_list for t in range(*nd["value_tokens"])})


def spans(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` of each prefill chunk of an ``n``-token prompt (one span without ``chunk``)."""
    step = chunk or n
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm().clamp_min(1e-30))


def run_model(model, ids, runtime, needle_list, chunk: int | None = None, on_layer=None):
    """Prefill ``ids`` with ``runtime`` (None: dense) in one call, or ``chunk`` tokens at a time
    through the model's KV cache (each later chunk's attention gets ``Lq < Lk``), then greedy-decode
    ``DECODE_TOKENS`` tokens. The KV cache is the transformers engine's (``fpcli.engine.kv_cache.
    reserved_cache``: reserved for the prompt and the answer, each chunk written in place).

    ``on_layer(layer, q [Hq, L, d], k, v [Hkv, L, d], scale)``: called in each layer's attention of a
    one-shot prefill with the live tensors (the isolated diagnosis; nothing is kept).

    Returns a dict: ``answer`` (token ids), ``kv`` (layer -> (K, V) ``[Hkv, rows, d]`` at
    ``value_rows(needle_list)``, from the full cache after the last chunk), ``calls`` (``(layer, Lq,
    Lk)`` of every prefill attention call), ``mass`` (per decode step, layer -> ``[needles]`` float32
    tensor: the step's attention mass on each needle's value tokens, mean over query heads; last
    ``LAST_LAYERS`` layers only), ``density`` (selected / visible key blocks over the sparse layers of
    every chunk; 1.0 without a sparse layer)."""
    n_layers = model.config.num_hidden_layers
    rows = torch.tensor(value_rows(needle_list), dtype=torch.long)
    kv: dict[int, tuple] = {}
    calls: list[tuple[int, int, int]] = []
    mass: list[dict[int, torch.Tensor]] = []
    blocks = [0, 0]  # selected, visible key blocks over every chunk's sparse layers

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        layer = int(module.layer_idx)
        lq, lk = query.shape[2], key.shape[2]
        if lq > 1:
            calls.append((layer, lq, lk))
            r = rows[rows < lk].to(key.device)
            kv[layer] = (key[0][:, r].detach().clone(), value[0][:, r].detach().clone())
            if on_layer is not None and lq == lk:
                on_layer(layer, query[0], key[0], value[0], float(scaling))
        elif layer >= n_layers - LAST_LAYERS:
            if not mass or layer in mass[-1]:
                mass.append({})
            q, k = query[0, :, 0], key[0]
            g = q.shape[0] // k.shape[0]
            p = torch.softmax((q.view(k.shape[0], g, -1).float() @ k.float().transpose(-1, -2)) * float(scaling), -1)
            mass[-1][layer] = torch.stack([p[..., a:b].sum(-1).mean() for a, b in (nd["value_tokens"] for nd in needle_list)])
        return fpt.flashprefill_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    from transformers import AttentionInterface

    fpt.install_flashprefill(model, runtime or fpt.FlashPrefillRuntime(config=None))
    AttentionInterface.register(fpt.ATTN_NAME, attn)  # install registers the plain function again
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    out = []
    # the transformers engine's cache (reserved for the prompt and the answer) under its argument name
    from fpcli.engine.kv_cache import reserved_cache
    from fpcli.engine.transformers_engine import cache_argument

    ckw = {cache_argument(model): reserved_cache(n_layers, len(ids) + DECODE_TOKENS + 1)}
    try:
        with torch.inference_mode():
            for s, e in spans(len(ids), chunk):
                if runtime is not None:
                    runtime.reset()
                res = model(x[:, s:e], use_cache=True, logits_to_keep=1, **ckw)
                if runtime is not None:  # the chunk's sparse layers: selected / visible blocks
                    for row in runtime.summary(n_layers):
                        if row is not None and row.sparse:
                            blocks[0] += row.selected_blocks
                            blocks[1] += row.visible_blocks
            nxt = int(res.logits[0, -1].argmax())
            for _ in range(DECODE_TOKENS):
                out.append(nxt)
                res = model(torch.tensor([[nxt]], device=dev), use_cache=True, **ckw)
                nxt = int(res.logits[0, -1].argmax())
    finally:
        fpt.register_attention()
    return {"answer": out, "kv": kv, "calls": calls, "mass": mass,
            "density": blocks[0] / blocks[1] if blocks[1] else 1.0}


def decode_mass(mass, out_ids, tok, n_needles):
    """Attention mass (mean over query heads and the last LAST_LAYERS layers) on each needle's value
    tokens at the step whose output is the first digit. The query of step s (s >= 1) is the token
    out_ids[s-1]; step 0's query is the prompt's last token (inside the prefill): use step s where
    out_ids[s] is the first digit, s >= 1."""
    first = next((s for s, t in enumerate(out_ids) if tok.decode([t]).strip()[:1].isdigit()), None)
    if first is None or first == 0 or first - 1 >= len(mass):
        return None
    step = mass[first - 1]
    tot = torch.stack([step[layer].cpu() for layer in sorted(step)]).mean(0)
    return [float(x) for x in tot[:n_needles]]


def layer_diagnosis(q, k, v, scale, cfg: SparseConfig, needle_list, chunk: int | None = None,
                    backend: str = "auto") -> dict:
    """Isolated error of one layer (needle rows vs haystack rows) and needle-block selection.

    Args:
        q: ``[Hq, L, d]`` (RoPE applied); k, v: ``[Hkv, L, d]``; the dense one-shot prefill's.
        scale: softmax scale.
        chunk: build the index chunk by chunk (``Lq`` = chunk, ``Lk`` = prefix + chunk, as SGLang's
            chunked prefill); ``None``: one call over the whole prompt.

    Returns ``density``, ``err_needle``, ``err_haystack``, ``needle_block_kept`` (per needle, share
    of the later tiles keeping its blocks, ``None`` where no tile qualifies),
    ``needle_rows_pruned_mass`` (per needle, mean over rows and query heads of the dense attention
    mass on blocks the row's tile pruned).
    """
    B = cfg.block_size
    hq, lq, d = q.shape
    hkv = k.shape[0]
    g = hq // hkv
    dev = q.device
    nb = -(-lq // B)
    needle_rows = torch.zeros(lq, dtype=torch.bool, device=dev)
    for nd in needle_list:
        needle_rows[nd["tokens"][0]:nd["tokens"][1]] = True
    body = torch.zeros(lq, dtype=torch.bool, device=dev)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)  # [L, Hq, d]
    out = dense.clone()
    masks, firsts, lasts, tails, tile_span = [], [], [], [], []  # tile_span: (start, tile rows, first tile)
    n_before = 0
    sel = vis = 0
    for s, e in spans(lq, chunk):
        n = e - s
        tr = 128
        n_tiles = -(-n * g // tr)
        if n >= cfg.min_sparse_len:
            kc, vc = fpt._paged(k[None, :, :e]), fpt._paged(v[None, :, :e])
            pt = torch.arange(kc.shape[0], dtype=torch.int32, device=dev)[None]
            sl = torch.tensor([e], dtype=torch.int32, device=dev)
            cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
            o, index = flashprefill_attention(q[:, s:e].transpose(0, 1).contiguous(), kc, vc, pt, sl, cu, config=cfg,
                                              softmax_scale=scale, return_index=True, backend=backend)
            out[s:e] = o.view(n, hq, d)
            tr = index.tile_rows
            n_tiles = int(index.tile_ptr[-1])
            m = _csr_to_mask(index, hkv, n_tiles, -(-e // B))
            m = torch.nn.functional.pad(m, (0, nb - m.shape[-1]))
            hs, hv = index.head_counts()
            sel, vis = sel + int(hs.sum()), vis + int(hv.sum())
            body[s:max(s, e - cfg.dense_tail_tokens)] = True
        else:  # a chunk below min_sparse_len runs dense: every visible block kept
            m = torch.ones(hkv, n_tiles, nb, dtype=torch.bool, device=dev)
        t = torch.arange(n_tiles, device=dev)
        firsts.append(s + t * tr // g)
        last_local = (torch.clamp(t * tr + tr, max=n * g) - 1) // g
        lasts.append(s + last_local)
        tails.append((last_local >= n - cfg.dense_tail_tokens) | (n < cfg.min_sparse_len))
        masks.append(m)
        tile_span.append((s, tr, n_before))
        n_before += n_tiles
    mask = torch.cat(masks, 1)                              # [Hkv, T, nb]
    t_first, t_last, tail = torch.cat(firsts), torch.cat(lasts), torch.cat(tails)
    win_lo = torch.clamp(t_first - cfg.window_tokens + 1, min=0) // B
    span_starts = torch.tensor([s for s, _, _ in tile_span], device=dev)
    sel_share, pruned_mass = [], []
    for nd in needle_list:
        a, b = nd["tokens"]
        blocks = list(range(a // B, (b - 1) // B + 1))
        sees = ((max(blocks) + 1) * B <= t_last + 1) & ~tail & (win_lo > max(blocks)) & (min(blocks) * B >= cfg.sink_tokens)
        sel_share.append(float(mask[:, sees][:, :, blocks].any(-1).float().mean()) if bool(sees.any()) else None)
        # rows a..b: dense softmax against all keys, mass on the blocks each row's tile pruned
        n = b - a
        qs = q[:, a:b].float().reshape(hkv, g * n, d)
        logits = (qs @ k.float().transpose(-1, -2)).view(hq, n, lq) * scale
        pos = torch.arange(lq, device=dev)
        logits = logits.masked_fill(pos[None, None, :] > torch.arange(a, b, device=dev)[None, :, None], -float("inf"))
        p = torch.softmax(logits, -1)
        pb = torch.nn.functional.pad(p, (0, nb * B - lq)).view(hq, n, nb, B).sum(-1)  # [Hq, n, nb]
        rows = torch.arange(a, b, device=dev)
        sp = torch.searchsorted(span_starts, rows, right=True) - 1
        tile = torch.tensor([tile_span[i][2] for i in sp.tolist()], device=dev) + \
            ((rows - span_starts[sp]) * g) // torch.tensor([tile_span[i][1] for i in sp.tolist()], device=dev)
        kept = mask[torch.arange(hq, device=dev) // g][:, tile]  # [Hq, n, nb]
        pruned_mass.append(float((pb * ~kept).sum(-1).mean()))
    hay_rows = body & ~needle_rows
    return {
        "density": sel / vis if vis else 1.0,
        "err_needle": rel(out[needle_rows & body], dense[needle_rows & body]),
        "err_haystack": rel(out[hay_rows], dense[hay_rows]),
        "needle_block_kept": sel_share,
        "needle_rows_pruned_mass": pruned_mass,
    }


def load(args):
    """(engine, context) for ``--model / --device / --context / --dtype``: the transformers engine's
    own loading (``TransformersEngine``: YaRN, dtype, attention implementation)."""
    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.models import default_model, model_display_name, resolve_model
    from fpcli.profiles import load_profile, with_context_length

    spec, context = args.model, args.context
    if spec is None:
        d = default_model("transformers", args.device)
        spec, context = d.name, context or d.context_length
    path = resolve_model(spec, progress=False)
    prof = load_profile("bf16")
    if context:
        prof = with_context_length(prof, context)
    prof = dataclasses.replace(prof, engine=dataclasses.replace(prof.engine, dtype=args.dtype))
    eng = TransformersEngine(path, prof, model_name=model_display_name(spec, path), device=args.device,
                             reuse_cache=False)
    return eng, int(eng.context_length)


def summarise_layers(L: list[dict], n_needles: int) -> str:
    en = sorted(x["err_needle"] for x in L)[len(L) // 2]
    eh = sorted(x["err_haystack"] for x in L)[len(L) // 2]
    pm = [sum(x["needle_rows_pruned_mass"][i] for x in L) / len(L) for i in range(n_needles)]
    ks = [[x["needle_block_kept"][i] for x in L] for i in range(n_needles)]
    ks = [sum(v for v in s if v is not None) / max(1, sum(v is not None for v in s)) for s in ks]
    return (f"isolated err median needle {en:.3f} haystack {eh:.3f}; needle rows' dense mass on pruned blocks"
            f" {['%.3f' % m for m in pm]}; needle blocks kept by later tiles {['%.2f' % s for s in ks]}")


def main(argv=None) -> dict:
    from fpcli.commands.bench import parse_lengths

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model name or folder, as fp ask --model")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--context", default=None, help="context in tokens (128k): YaRN beyond the model's own")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    ap.add_argument("--chunk", type=int, default=0, help="also prefill in chunks of N tokens (0: one-shot only)")
    ap.add_argument("--len", default="7168")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--no-layers", action="store_true", help="skip the isolated per-layer diagnosis")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        length = parse_lengths(args.len)[0]
        args.context = parse_lengths(args.context, "--context")[0] if args.context else None
    except ValueError as exc:
        ap.error(str(exc))
    if args.chunk < 0:
        ap.error(f"--chunk: expected a token count >= 0, got {args.chunk}")
    torch.manual_seed(0)

    from fpcli.ruler.haystack import GeneratedHaystack
    from fpcli.ruler.tasks import TASKS, make_sample

    eng, ctx = load(args)
    tok, model = eng.tokenizer, eng.model
    ct = ChatTokenizer(tok, reserve="sglang" if args.device == "cuda" else None)
    sample = make_sample(TASKS["niah_multikey"], length, args.index, args.seed, GeneratedHaystack(), ct, ctx)
    text = tok.apply_chat_template(ct.messages(sample.system, sample.user), add_generation_prompt=True, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == sample.ids, "chat text does not re-tokenize to the sample's ids"
    nl = needles(text, enc["offset_mapping"], sample.expected[0])
    lq = len(sample.ids)
    chunk = args.chunk or None
    base, base_dense = profile_base(ctx)
    print(f"{eng.model_name} ({eng.dtype}, {eng.device}, context {ctx:,}); sample {sample.id}: {lq} tokens;"
          f" question: {sample.question}")
    for i, nd in enumerate(nl):
        print(f"  needle {i}{'*' if nd['asked'] else ' '} {nd['key']:>20} = {nd['value']} tokens {nd['tokens']}"
              f" (block {nd['tokens'][0] // base.block_size}; chunk {nd['tokens'][0] // chunk if chunk else 0})")
    n_layers = model.config.num_hidden_layers
    specs = args.configs.split(",")
    parsed = {spec: parse_config(spec, base, base_dense) for spec in specs}
    diag: dict[str, dict[str, list]] = {spec: {"layers": [], "layers_chunked": []} for spec in specs}

    def on_layer(layer, q, k, v, scale):
        if args.no_layers:
            return
        for spec, (cfg, dl) in parsed.items():
            if cfg is None or layer < dl:
                continue
            diag[spec]["layers"].append({"layer": layer, **layer_diagnosis(q, k, v, scale, cfg, nl)})
            if chunk:
                diag[spec]["layers_chunked"].append({"layer": layer, **layer_diagnosis(q, k, v, scale, cfg, nl, chunk)})

    dense = run_model(model, sample.ids, None, nl, on_layer=on_layer)
    ans_d = tok.decode(dense["answer"], skip_special_tokens=True)
    mass_d = decode_mass(dense["mass"], dense["answer"], tok, len(nl))
    print(f"dense one-shot: answer {ans_d!r} mass on needle values {mass_d}", flush=True)
    report = {"model": eng.model_name, "device": str(eng.device), "dtype": str(eng.dtype), "context": ctx,
              "chunk": chunk, "sample": sample.id, "tokens": lq, "needles": nl,
              "dense": {"answer": ans_d, "correct": sample.expected[0] in ans_d, "mass": mass_d}, "configs": []}
    for spec in specs:
        cfg, dl = parsed[spec]
        for mode in ("one-shot", "chunked") if chunk else ("one-shot",):
            if cfg is None and mode == "one-shot":
                continue  # the reference run itself
            rt = fpt.FlashPrefillRuntime(config=cfg, dense_layers=dl)
            run = run_model(model, sample.ids, rt, nl, chunk=chunk if mode == "chunked" else None)
            density = run["density"]
            ans = tok.decode(run["answer"], skip_special_tokens=True)
            mass = decode_mass(run["mass"], run["answer"], tok, len(nl))
            kv_err = [{name: rel(run["kv"][layer][i].float(), dense["kv"][layer][i].float())
                       for i, name in enumerate("kv")} for layer in range(n_layers)]
            entry = {"config": spec, "mode": mode, "dense_layers": dl, "density": density,
                     "answer": ans, "correct": sample.expected[0] in ans, "mass": mass,
                     "kv_err_needle_values": kv_err, "calls": run["calls"]}
            if cfg is not None and not args.no_layers:
                entry["layers"] = diag[spec]["layers_chunked" if mode == "chunked" else "layers"]
            report["configs"].append(entry)
            last_k = sum(r["k"] for r in kv_err[-LAST_LAYERS:]) / LAST_LAYERS
            last_v = sum(r["v"] for r in kv_err[-LAST_LAYERS:]) / LAST_LAYERS
            msg = (f"{spec:>24} {mode:>8}: density {density:6.1%} answer {'OK ' if entry['correct'] else 'BAD'}"
                   f" {ans.strip()[:40]!r} needle-value K/V err (last {LAST_LAYERS} layers) {last_k:.3f}/{last_v:.3f}"
                   f" mass {['%.3f' % m for m in mass] if mass else None}")
            if entry.get("layers"):
                msg += f"\n{'':>35}" + summarise_layers(entry["layers"], len(nl))
            print(msg, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
