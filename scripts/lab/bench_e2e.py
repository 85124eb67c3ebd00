"""End-to-end TTFT: FlashPrefill vs the same SGLang engine with a dense prefill backend (``triton``).

Same process, same settings, radix cache off (every request prefills its whole prompt), a warm-up
request per engine and per length first (JIT compiles, autotuning), then the median of
``repeats`` timed requests. A planted needle (a number in the middle of a synthetic document)
checks that the answer survives the sparsity. Lengths above ``yarn_above`` run with YaRN
(factor 4 over the model's native context, ``fpcli.engine.sglang_engine.yarn_override``).

    python scripts/lab/bench_e2e.py --model PATH --lens 4k,8k,16k,32k,64k,120k --json out.json

A lab tool (variants, YaRN regimes, needle depths) beside ``fp bench --e2e``, whose small driver
(``fpcli.ttft``) it shares the needle prompts with.

Prints a table last; ``--json`` writes the rows (one dict per length).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from flashprefill.lengths import parse_lengths
from fpcli.ttft import answered, needle_document, needle_prompt

def parse_lens(text: str) -> list[int]:
    """``"4k,8k,32000"`` -> ``[4096, 8192, 32000]`` (``flashprefill.lengths.parse_lengths``)."""
    return parse_lengths(text)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _measure(engine: Any, ids: list[int], secret: str | None, repeats: int, max_new_tokens: int) -> dict:
    engine.generate(ids, max_new_tokens=2)  # warm-up at this length (autotune, allocator)
    runs = [engine.generate(ids, max_new_tokens=max_new_tokens) for _ in range(repeats)]
    last = runs[-1]
    return {
        "ttft_s": _median([r.ttft_s for r in runs]),
        "ttft_all_s": [round(r.ttft_s, 5) for r in runs],
        "prefill_s": _median([r.prefill_s for r in runs]),
        "density": last.stats.density,
        "density_per_layer": [round(x, 4) for x in last.stats.density_per_layer],
        "answer": last.text.strip()[:80],
        "needle": answered(last.text, secret) if secret else None,
        "prompt_tokens": last.prompt_tokens,
    }


def run_e2e_bench(
    lens: list[int],
    model_path: str,
    profile_sparse: Any,
    profile_dense: Any,
    needle: bool = True,
    yarn_above: int = 32768,
    progress: Callable[[str], None] | None = None,
    *,
    repeats: int = 3,
    yarn_factor: float = 4.0,
    max_new_tokens: int = 16,
    server_overrides: dict | None = None,
    on_rows: Callable[[list[dict]], None] | None = None,
    variants: Sequence[tuple] = (),
    depths: Sequence[float] = (),
) -> list[dict]:
    """TTFT of FlashPrefill vs dense prefill at each length (see the module docstring).

    Returns one dict per length: ``target_len``, ``prompt_tokens``, ``yarn`` (factor or None),
    ``ttft_dense_s``, ``ttft_sparse_s``, ``speedup``, ``prefill_sparse_s``, ``density``,
    ``needle_dense``, ``needle_sparse``, the answers and the individual TTFTs.

    ``variants``: extra ``(label, profile)`` or ``(label, profile, engine_kwargs)`` sparse engines
    run like ``sparse`` (keys ``ttft_<label>_s``, ``needle_<label>``, ``density_<label>``,
    ``speedup_<label>``); ``engine_kwargs`` go to ``SGLangEngine`` (e.g. ``timing=True``).
    ``depths``: extra needle depths (0..1) answered once per engine and length, besides the timed
    one at 0.5 (``needles_<label>``: one bool per depth, 0.5 first).
    """
    from fpcli.engine.sglang_engine import SGLangEngine, native_context_length

    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    native = native_context_length(model_path) or 32768
    regimes: dict[float | None, list[int]] = {}
    for n in sorted(lens):
        regimes.setdefault(yarn_factor if n > yarn_above else None, []).append(n)
    rows: dict[int, dict] = {}
    prompts: dict[int, tuple[list[int], str | None]] = {}  # same tokenizer for every engine: build once

    def _run_engine(label: str, profile: Any, engine_kwargs: dict, overrides: dict, factor: float | None,
                    group: list[int], limit: int) -> None:
        """Start one engine, measure every length of ``group`` on it, fill ``rows``."""
        t0 = time.perf_counter()
        say(f"[bench] starting {label} engine (profile {getattr(profile, 'name', '?')}, yarn {factor}"
            f"{', SGLang ' + str(overrides) if overrides else ''})")
        # SGLangEngine warms up at start (a dummy prefill over the sparse path, radix cache
        # flushed), so no JIT compilation lands in a measured TTFT.
        with SGLangEngine(model_path, profile, rope_scaling_factor=factor,
                          server_overrides={"disable_radix_cache": True, **(overrides or {})}, **engine_kwargs) as eng:
            say(f"[bench] {label} engine up in {time.perf_counter() - t0:.1f} s (warm-up {eng.warmup_s:.1f} s)")
            for n in group:
                target = min(n, limit - max_new_tokens - 256)
                ids, secret = _cached_prompt(eng, prompts, n, target, limit, max_new_tokens, needle=needle)
                reps = max(1, repeats if n <= 32768 else min(repeats, 2))
                m = _measure(eng, ids, secret, reps, max_new_tokens)
                row = rows.setdefault(n, {"target_len": n, "yarn": factor})
                row["prompt_tokens"] = m["prompt_tokens"]
                for key in ("ttft_s", "ttft_all_s", "prefill_s", "answer", "needle"):
                    row[f"{key.replace('_s', '')}_{label}_s" if key.endswith("_s") else f"{key}_{label}"] = m[key]
                if label == "sparse":
                    row["density"] = m["density"]
                    row["density_per_layer"] = m["density_per_layer"]
                elif label != "dense":
                    row[f"density_{label}"] = m["density"]
                if needle and depths:
                    row[f"needles_{label}"] = [m["needle"]] + [
                        _needle_at(eng, prompts, n, target, d, limit, max_new_tokens) for d in depths]
                dens = "n/a" if m["density"] is None else f"{m['density']:.3f}"
                say(f"[bench] {label} {n}: {m['prompt_tokens']} tokens, TTFT {m['ttft_s']:.4f} s, "
                    f"prefill {m['prefill_s']:.4f} s, density {dens}, needle {m['needle']} "
                    f"({m['answer']!r})")
                if on_rows is not None:
                    on_rows(_finish_rows(rows))

    for factor, group in regimes.items():
        limit = int(native * factor) if factor else native
        engines = [("dense", profile_dense, {}), ("sparse", profile_sparse, {})]
        engines += [(v[0], v[1], v[2] if len(v) > 2 else {}) for v in variants]
        for label, profile, engine_kwargs in engines:
            engine_kwargs = dict(engine_kwargs)
            overrides = {**(server_overrides or {}), **engine_kwargs.pop("server_overrides", {})}
            try:
                _run_engine(label, profile, engine_kwargs, overrides, factor, group, limit)
            except Exception as exc:
                if label in ("dense", "sparse"):
                    raise
                # an experiment's engine raising (a bad option, a failed request) costs only its
                # row; a scheduler process dying at start-up still ends the run: SGLang's SIGQUIT
                # handler kills the parent's process tree (seen with a missing FA3, 2026-11-30)
                say(f"[bench] {label} engine failed: {type(exc).__name__}: {exc}")
                for n in group:   # the lengths it had not measured yet
                    row = rows.setdefault(n, {"target_len": n, "yarn": factor})
                    if f"ttft_{label}_s" not in row:
                        row[f"error_{label}"] = f"{type(exc).__name__}: {exc}"[:500]
                if on_rows is not None:
                    on_rows(_finish_rows(rows))
    return _finish_rows(rows)


def _cached_prompt(engine: Any, prompts: dict, key: Any, target: int, limit: int, max_new_tokens: int, *,
                   needle: bool = True, depth: float = 0.5, seed: int = 0) -> tuple[list[int], str | None]:
    """Prompt ids (and the secret, or None without a needle) of about ``target`` tokens, built once
    per ``key`` (every engine shares the tokenizer) and cut to fit ``limit`` with the answer."""
    if key not in prompts:
        if needle:
            ids, secret = needle_prompt(engine, target, depth=depth, seed=seed)
        else:
            text, _ = needle_document(engine.count_tokens, target)
            ids, secret = engine.encode_chat(None, text), None
        if len(ids) > limit - max_new_tokens:
            ids = ids[-(limit - max_new_tokens - 1):]
        prompts[key] = (ids, secret)
    return prompts[key]


def _needle_at(engine: Any, prompts: dict, n: int, target: int, depth: float, limit: int,
               max_new_tokens: int) -> bool:
    """Answer the needle planted at ``depth`` once (prompt built once per length and depth)."""
    ids, secret = _cached_prompt(engine, prompts, (n, depth), target, limit, max_new_tokens, depth=depth,
                                 seed=1 + int(depth * 1000))
    return answered(engine.generate(ids, max_new_tokens=max_new_tokens).text, secret)


def _num(x: float | None) -> float:
    return float("nan") if x is None else x


def _speedup(d: float | None, s: float | None) -> float | None:
    return (d / s) if d and s and not math.isnan(d) and not math.isnan(s) else None


def _finish_rows(rows: dict[int, dict]) -> list[dict]:
    out = []
    for n in sorted(rows):
        r = rows[n]
        r["speedup"] = _speedup(r.get("ttft_dense_s"), r.get("ttft_sparse_s"))
        for key in [k for k in r if k.startswith("ttft_") and k.endswith("_s")]:
            label = key[len("ttft_"):-len("_s")]
            if label not in ("dense", "sparse") and not label.startswith("all_"):
                r[f"speedup_{label}"] = _speedup(r.get("ttft_dense_s"), r[key])
        out.append(r)
    return out


def variant_labels(rows: list[dict]) -> list[str]:
    """The extra sparse engines' labels present in ``rows`` (``run_e2e_bench(variants=...)``)."""
    seen: list[str] = []
    for r in rows:
        for k in r:
            if k.startswith("speedup_") and k[len("speedup_"):] not in seen:
                seen.append(k[len("speedup_"):])
    return seen


def format_variants(rows: list[dict]) -> str:
    """One line per (length, engine): TTFT, prefill time (the backend's statistics; TTFT where it
    has none), speed-up over dense, density, needles answered; and a line per failed engine."""
    labels = ["dense", "sparse"] + variant_labels(rows)
    head = (f"{'len':>7} {'engine':>16} {'TTFT s':>8} {'prefill s':>9} {'speedup':>8} {'density':>8} "
            f"{'needles':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        for lab in labels:
            t = r.get(f"ttft_{lab}_s")
            if t is None:
                continue
            sp = r.get("speedup") if lab == "sparse" else (1.0 if lab == "dense" else r.get(f"speedup_{lab}"))
            dens = r.get("density") if lab == "sparse" else (1.0 if lab == "dense" else r.get(f"density_{lab}"))
            nd = [x for x in (r.get(f"needles_{lab}") or [r.get(f"needle_{lab}")]) if x is not None]
            ok = f"{sum(bool(x) for x in nd)}/{len(nd)}" if nd else "-"
            lines.append(f"{r['target_len']:>7} {lab:>16} {t:>8.4f} {_num(r.get(f'prefill_{lab}_s')):>9.4f} "
                         f"{(f'{sp:.2f}x' if sp else '-'):>8} {_num(dens):>8.3f} {ok:>8}")
        for key in [k for k in r if k.startswith("error_")]:
            lines.append(f"{r['target_len']:>7} {key[len('error_'):]:>16} FAILED: {r[key][:90]}")
    return "\n".join(lines)


# Engine options a variant may set: ``timing`` (SGLangEngine argument).
ENGINE_VARIANT_KEYS = ("timing",)


def _parse_value(raw: str, strings: bool = False) -> Any:
    """``"true"``/``"false"`` -> bool, else int, else float; with ``strings``, ``"none"`` /
    ``"null"`` -> ``None`` and anything else the stripped string; else ``ValueError``. (Values
    cannot contain ``,``: it separates the keys.)"""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if strings and text.lower() in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if strings and text:
        return text
    raise ValueError(f"{raw!r} is not a number or bool")


def parse_variant(text: str, base: Any) -> tuple[str, Any, dict]:
    """``"LABEL:key=value,key=value"`` -> ``(LABEL, base profile with those settings, engine kwargs)``.

    Keys: ``dense_layers``, ``attention`` (``flashprefill`` | ``dense``), any
    ``flashprefill.SparseConfig`` field (``alpha``, ``window_tokens``, ``sink_tokens``,
    ``dense_tail_tokens``, ``block_size``, ...), an engine option of ``ENGINE_VARIANT_KEYS``
    (``timing=true``: per-layer index / attention CUDA events, to measure what they cost), or
    ``sgl.<ServerArgs field>`` passed to SGLang as is (``sgl.decode_attention_backend=fa3``).
    Values are parsed as int, float or bool (``sgl.*`` and ``attention`` also take strings).
    Raises ``ValueError`` naming a bad key or value.
    """
    label, sep, body = text.partition(":")
    if not sep or not label or not body:
        raise ValueError(f"variant {text!r}: expected LABEL:key=value[,key=value...]")
    if label in ("dense", "sparse") or label.startswith("all_") or not label.replace("_", "").isalnum():
        raise ValueError(f"variant {text!r}: LABEL must be letters/digits, not 'dense', 'sparse' or 'all_...'")
    op_fields = set(base.sparse.field_names())
    top: dict[str, Any] = {}
    op: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for item in body.split(","):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"variant {label}: {item!r} is not key=value")
        low = raw.strip().lower()
        if key == "attention":
            if low not in ("flashprefill", "dense"):
                raise ValueError(f"variant {label}: attention={raw!r}: expected 'flashprefill' or 'dense'")
            top[key] = low
            continue
        if key.startswith("sgl."):
            name = key[4:]
            if not name.isidentifier():
                raise ValueError(f"variant {label}: {key!r} does not name a ServerArgs field")
            engine.setdefault("server_overrides", {})[name] = _parse_value(raw, strings=True)
            continue
        try:
            value = _parse_value(raw)
        except ValueError:
            raise ValueError(f"variant {label}: {key}={raw!r} is not a number or bool") from None
        if key == "dense_layers":
            top[key] = value
        elif key in ENGINE_VARIANT_KEYS:
            engine[key] = value
        elif key in op_fields:
            op[key] = value
        else:
            raise ValueError(f"variant {label}: unknown key {key!r} (dense_layers, attention, a SparseConfig "
                             f"field, sgl.<ServerArgs field> or one of {', '.join(ENGINE_VARIANT_KEYS)})")
    prof = base.replace(**top) if top else base
    if op:
        prof = prof.replace(sparse=prof.sparse.replace(**op))
    return label, prof.replace(name=f"{base.name}+{label}"), engine


def format_table(rows: list[dict]) -> str:
    head = f"{'len':>7} {'tokens':>7} {'yarn':>5} {'dense s':>9} {'sparse s':>9} {'speedup':>8} {'density':>8} {'needle d/s':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        nd = f"{r.get('needle_dense')!s:.1}/{r.get('needle_sparse')!s:.1}"
        lines.append(
            f"{r['target_len']:>7} {r.get('prompt_tokens', 0):>7} {str(r.get('yarn') or '-'):>5} "
            f"{r.get('ttft_dense_s', float('nan')):>9.4f} {r.get('ttft_sparse_s', float('nan')):>9.4f} "
            f"{sp:>8} {_num(r.get('density')):>8.3f} {nd:>11}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/lab/bench_e2e.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model folder")
    ap.add_argument("--lens", default="4k,8k,16k,32k", help="prompt lengths, e.g. 4k,8k,16k,32k,64k,120k")
    ap.add_argument("--profile", default="bf16", help="FlashPrefill profile (name or YAML path)")
    ap.add_argument("--dense-profile", default=None,
                    help="dense profile; default: the FlashPrefill profile with attention: dense (same engine settings)")
    ap.add_argument("--no-needle", action="store_true")
    ap.add_argument("--yarn-above", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-fraction", type=float, default=None, help="override mem_fraction_static")
    ap.add_argument("--json", default=None, help="write the rows here (rewritten after every length)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL:key=val,...",
                    help="an extra sparse engine, e.g. dl4:dense_layers=4 or a05:alpha=0.05 (repeatable)")
    ap.add_argument("--depths", default="", help="extra needle depths answered once per engine, e.g. 0.1,0.9")
    ap.add_argument("--preset", choices=("issue3",), default=None,
                    help="issue3: Qwen 4k,8k,16k,32k native and 64k,120k with YaRN x4 in one run, one warm-up "
                         "and three measurements per length (two above 32K; about 5 minutes on an H200)")
    args = ap.parse_args(argv)
    if args.preset == "issue3":
        args.lens, args.repeats, args.yarn_above = "4k,8k,16k,32k,64k,120k", 3, 32768

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from fpcli.profiles import load_profile

    sparse = load_profile(args.profile)
    dense = load_profile(args.dense_profile) if args.dense_profile else sparse.replace(attention="dense")
    overrides = {"cuda_graph_max_bs_decode": 16}  # TTFT only: a short decode-graph capture at start
    if args.mem_fraction:
        overrides["mem_fraction_static"] = args.mem_fraction
    t_start = time.perf_counter()

    def write(rows: list[dict], done: bool = False) -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({"model": args.model, "profile": sparse.name, "lens": args.lens, "repeats": args.repeats,
                           "complete": done, "wall_s": round(time.perf_counter() - t_start, 1), "rows": rows,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S")}, fh, indent=2)

    try:
        variants = [parse_variant(v, sparse) for v in args.variant]
        depths = [float(x) for x in args.depths.split(",") if x.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    rows = run_e2e_bench(parse_lens(args.lens), args.model, sparse, dense, needle=not args.no_needle,
                         yarn_above=args.yarn_above, repeats=args.repeats, server_overrides=overrides, on_rows=write,
                         variants=variants, depths=depths)
    write(rows, done=True)
    print(f"e2e bench: {time.perf_counter() - t_start:.0f} s", flush=True)
    print(format_table(rows), flush=True)
    if variants or depths:
        print(format_variants(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
