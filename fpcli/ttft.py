"""``fp bench --e2e``: time to first token through the engine, sparse profiles beside dense, on one model.

For each profile (the sparse ones, e.g. ``bf16`` and ``fp8``, then ``dense``) one SGLang engine is
started (its start-up warm-up compiles every kernel) with a context that fits the longest length
(YaRN beyond the model's native context, ``fpcli.engine.context``). At each length a synthetic
document with a planted needle (``The secret number is N.`` at mid-depth) is asked for the number:
one untimed request, then ``repeats`` timed ones, each after the prefix cache was flushed (every
request prefills its whole prompt). The prompts are built once, so every engine gets the same token
ids. ``ttft_rows`` turns the measurements into one row per (length, profile): the median TTFT, the
precision the engine reports, the density, whether the needle was answered, and the speed-ups over
the dense and the BF16 sparse rows of the same length.
"""
from __future__ import annotations

import random
import statistics
from typing import Any, Callable, Mapping, Sequence

_WORDS = (
    "river stone market lantern harvest orchard valley signal engine copper meadow harbor "
    "winter garden archive compass thunder meadow silver village canal forest bridge clock "
    "tower ledger spindle quarry beacon saddle mirror pepper timber anchor velvet candle "
    "ribbon marble cellar pocket violet walnut barley pewter falcon summit"
).split()

NEEDLE_QUESTION = "What is the secret number mentioned in the document? Answer with the number only."
ANSWER_MARGIN = 256  # tokens kept free below the context for the template and the answer
REPEATS = 3  # timed requests per (length, profile); the median is reported


def e2e_context(lengths: Sequence[int]) -> int:
    """The context in tokens the engines of ``run_ttft_bench`` run at: the longest length plus
    ``ANSWER_MARGIN``."""
    return max(lengths) + ANSWER_MARGIN


def engine_profile(profile: Any, lengths: Sequence[int], native_context: int | None = None) -> Any:
    """The profile the engine of ``profile`` runs in ``run_ttft_bench`` at ``lengths`` (tokens): at
    a context of ``e2e_context(lengths)`` (its own ``engine.context_length`` when that is larger),
    with ``min_sparse_len`` fitted to the model (``Profile.fit_to_model`` of ``native_context``,
    the model's own context in tokens, ``None`` when unknown: at most half of the smaller context),
    as ``fpcli.engine.load_engine`` fits the engines of the other commands. E.g. ``bf16``
    (min_sparse_len 8192) at ``--len 1k,8k`` on a 32K model: context 8,448, min_sparse_len 4,224.

    Raises:
        fpcli.profiles.ProfileError: a context out of range (``with_context_length``).
    """
    from fpcli.profiles import with_context_length

    context = e2e_context(lengths)
    run = profile
    if run.engine.context_length is None or run.engine.context_length < context:
        run = with_context_length(run, context)
    return run.fit_to_model(native_context)


def filler_sentences(seed: int = 0) -> Callable[[], str]:
    """A generator of random filler sentences (deterministic for ``seed``)."""
    rng = random.Random(seed)

    def sentence() -> str:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(8, 16))]
        return " ".join(words).capitalize() + "."

    return sentence


def needle_document(count_tokens: Callable[[str], int], n_tokens: int, *, depth: float = 0.5,
                    seed: int = 0, secret: int | None = None) -> tuple[str, str]:
    """A synthetic document of about ``n_tokens`` tokens with ``The secret number is N.`` planted at
    ``depth`` (0..1), followed by the question. Returns ``(user_text, secret)``."""
    rng = random.Random(seed)
    secret_s = str(secret if secret is not None else rng.randint(10000, 99999))
    needle = f"The secret number is {secret_s}. Remember it: the secret number is {secret_s}."
    make = filler_sentences(seed)
    budget = max(0, n_tokens - count_tokens(needle) - count_tokens(NEEDLE_QUESTION) - 8)
    sentences, used = [], 0
    # Tokens of sentences add up closely enough (one leading space each); the caller measures the
    # final prompt.
    while used < budget:
        s = make()
        sentences.append(s)
        used += count_tokens(" " + s)
    cut = int(len(sentences) * depth)
    body = " ".join(sentences[:cut] + [needle] + sentences[cut:])
    return f"Read the document and answer the question.\n\n{body}\n\n{NEEDLE_QUESTION}", secret_s


def needle_prompt(engine: Any, n_tokens: int, *, depth: float = 0.5, seed: int = 0) -> tuple[list[int], str]:
    """Chat-template token ids of a needle prompt of about ``n_tokens`` tokens, and the secret."""
    text, secret = needle_document(engine.count_tokens, n_tokens - 24, depth=depth, seed=seed)
    return engine.encode_chat(None, text), secret


def answered(answer: str, secret: str) -> bool:
    """Whether ``answer`` contains ``secret`` (commas and spaces ignored)."""
    return secret in answer.replace(",", "").replace(" ", "")


def measure(engine: Any, ids: list[int], secret: str, repeats: int, max_new_tokens: int) -> dict:
    """One untimed request, then ``repeats`` timed ones, each after ``engine.flush_cache()``.

    Returns ``{"ttft_s": median seconds, "density": float, "needle": bool, "answer": str,
    "prompt_tokens": int, "precision": str}`` (``precision``: what the engine reports it ran,
    ``GenerationResult.precision``, e.g. ``"fp8 (sparse layers)"``, ``"int8qk (sparse layers)"``)."""
    engine.flush_cache()
    engine.generate(ids, max_new_tokens=2)  # this length's allocations, outside the timing
    runs = []
    for _ in range(max(1, repeats)):
        engine.flush_cache()
        runs.append(engine.generate(ids, max_new_tokens=max_new_tokens))
    last = runs[-1]
    return {
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "density": last.stats.density,
        "needle": answered(last.text, secret),
        "answer": last.text.strip()[:80],
        "prompt_tokens": last.prompt_tokens,
        "precision": last.precision,
    }


def check_profiles(profiles: Sequence[Any]) -> None:
    """What ``run_ttft_bench`` needs of its profiles: at least one, names unique (they key the rows).

    Raises:
        ValueError: no profile, or two with the same name.
    """
    names = [p.name for p in profiles]
    if not names:
        raise ValueError("run_ttft_bench: no profile to measure")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"run_ttft_bench: profile names must be unique (they name the rows), got {', '.join(twice)} twice")


def ttft_rows(lengths: Sequence[int], profiles: Sequence[Any], measured: Mapping[tuple[str, int], dict]) -> list[dict]:
    """The rows of the end-to-end table: one per (length, profile), lengths in order, the profiles of
    each length in the order given. A pure function of ``measure``'s results.

    Args:
        lengths: target prompt lengths in tokens.
        profiles: ``fpcli.profiles.Profile`` each (``name``, ``precision``, ``is_dense``).
        measured: ``measure``'s dict per ``(profile name, length)``.

    Returns:
        dicts with ``length`` (target tokens), ``prompt_tokens``, ``profile``, ``precision`` (what
        the engine ran), ``ttft_s`` (median seconds), ``density`` (1.0 for dense), ``needle``
        (answered), ``answer``, ``x_dense`` (the dense row's TTFT / this row's, the speed-up over
        dense; ``None`` without a dense profile) and ``x_bf16`` (the BF16 sparse row's TTFT / this
        row's; ``None`` unless an 8-bit sparse profile, ``fp8`` or ``int8qk``, is measured beside a
        BF16 one).

    Raises:
        KeyError: a ``(profile, length)`` missing from ``measured``.
    """
    from fpcli.engine.base import eight_bit

    dense = next((p.name for p in profiles if p.is_dense), None)
    sparse = [p for p in profiles if not p.is_dense]
    bf16 = next((p.name for p in sparse if p.precision == "bf16"), None)
    bf16 = bf16 if any(eight_bit(p.precision) for p in sparse) else None

    def over(ref: str | None, n: int, ttft: float) -> float | None:
        if ref is None:
            return None
        t = measured[(ref, n)]["ttft_s"]
        return t / ttft if t and ttft else None

    rows = []
    for n in lengths:
        for p in profiles:
            m = measured[(p.name, n)]
            rows.append({
                "length": n,
                "prompt_tokens": m["prompt_tokens"],
                "profile": p.name,
                "precision": m["precision"],
                "ttft_s": m["ttft_s"],
                "density": m["density"],
                "needle": m["needle"],
                "answer": m["answer"],
                "x_dense": over(dense, n, m["ttft_s"]),
                "x_bf16": over(bf16, n, m["ttft_s"]),
            })
    return rows


def ttft_notes(rows: list[dict], profiles: Sequence[Any], native_context: int | None = None) -> list[str]:
    """One line per length where a sparse profile's prompt was below the ``min_sparse_len`` its
    engine ran (``engine_profile`` of the rows' lengths and the model's ``native_context``, tokens),
    so that it prefilled it dense (density 100%, like dense): "at 4096 tokens bf16, fp8 ran dense:
    prompts below min_sparse_len 8,192"."""
    lengths = [r["length"] for r in rows]
    threshold = {p.name: int(engine_profile(p, lengths, native_context).sparse.min_sparse_len)
                 for p in profiles if not p.is_dense}
    notes = []
    for n in dict.fromkeys(r["length"] for r in rows):
        short = [r for r in rows if r["length"] == n and r["profile"] in threshold
                 and r["prompt_tokens"] < threshold[r["profile"]]]
        if short:
            msl = ", ".join(f"{v:,}" for v in dict.fromkeys(threshold[r["profile"]] for r in short))
            notes.append(f"at {n} tokens {', '.join(r['profile'] for r in short)} ran dense: prompts below "
                         f"min_sparse_len {msl}")
    return notes


TTFT_COLS = [("length", "length", "{:d}"), ("prompt_tokens", "prompt tokens", "{:d}"), ("profile", "profile", "{}"),
             ("precision", "precision", "{}"), ("ttft_s", "TTFT s", "{:.4f}"), ("density", "density", "{:.1%}"),
             ("needle", "needle", lambda v: "answered" if v else "missed"), ("x_dense", "x dense", "{:.2f}"),
             ("x_bf16", "x bf16", "{:.2f}")]


def format_ttft_table(rows: list[dict], meta: Mapping[str, Any]) -> str:
    """Plain-text table (fixed-width, no truncation) of ``ttft_rows``, under a header line from
    ``meta`` (``model``, ``gpu``, ``repeats``): the columns of ``TTFT_COLS``, ``x bf16`` only when
    an 8-bit profile (``fp8``, ``int8qk``) ran beside BF16."""
    from flashprefill.bench import plain_table

    if not rows:
        return "(no rows)"
    head = (f"end-to-end TTFT: {meta.get('model')}" + (f"  {meta['gpu']}" if meta.get("gpu") else "")
            + f"  median of {meta.get('repeats')} requests per length and profile, each after a cache flush; "
              "needle at mid-depth")
    return "\n".join([head] + plain_table(rows, TTFT_COLS, always=("length", "x_dense")))


def run_ttft_bench(lengths: Sequence[int], model_path: str, profiles: Sequence[Any],
                   progress: Callable[..., None] | None = None, *, repeats: int = REPEATS,
                   max_new_tokens: int = 16, start_engine: Callable[[str, Any], Any] | None = None) -> list[dict]:
    """TTFT of each of ``profiles`` (``fpcli.profiles.Profile``: the sparse ones and ``dense``, one
    engine each, started in this order, each running ``engine_profile`` with the native context
    of ``model_path``) at each length (tokens), on the same prompts.

    ``start_engine(model_path, profile)`` starts an engine (default ``SGLangEngine``), a context
    manager with ``encode_chat``, ``count_tokens``, ``flush_cache`` and ``generate``; ``progress``
    gets ``(message,)`` lines and ``()`` after each measured (profile, length).

    Returns ``ttft_rows``: one dict per (length, profile).

    Raises:
        ValueError: no profile, or two with the same name (``check_profiles``).
        fpcli.engine.context.ContextError: a length beyond what the model can be extended to.
    """
    from fpcli.models import known_context_length

    check_profiles(profiles)
    if start_engine is None:
        from fpcli.engine.sglang_engine import SGLangEngine as start_engine
    say = progress or (lambda *a: None)
    native = known_context_length(model_path)
    measured: dict[tuple[str, int], dict] = {}
    prompts: dict[int, tuple[list[int], str]] = {}  # one tokenizer for every engine: built once
    for profile in profiles:
        run = engine_profile(profile, lengths, native)
        say(f"starting the {profile.name} engine")
        with start_engine(model_path, run) as eng:
            for n in lengths:
                if n not in prompts:
                    prompts[n] = needle_prompt(eng, n)
                ids, secret = prompts[n]
                m = measured[(profile.name, n)] = measure(eng, ids, secret, repeats, max_new_tokens)
                say(f"{profile.name} {n}: TTFT {m['ttft_s']:.4f} s, needle {'answered' if m['needle'] else 'missed'}")
                say()
    return ttft_rows(lengths, profiles, measured)
