"""``fp bench --e2e``: time to first token, FlashPrefill vs dense prefill, on one model, side by side.

For each profile (the sparse one, then ``dense``) one SGLang engine is started (its start-up
warm-up compiles every kernel) with a context that fits the longest length (YaRN beyond the
model's native context, ``fpcli.engine.context``). At each length a synthetic document with a
planted needle (``The secret number is N.`` at mid-depth) is asked for the number: one untimed
request, then ``repeats`` timed ones, each after the prefix cache was flushed (every request
prefills its whole prompt). A row holds the median TTFTs, the speed-up, the sparse prefill's
density, and whether each engine answered the needle.
"""
from __future__ import annotations

import random
import statistics
from typing import Any, Callable, Sequence

_WORDS = (
    "river stone market lantern harvest orchard valley signal engine copper meadow harbor "
    "winter garden archive compass thunder meadow silver village canal forest bridge clock "
    "tower ledger spindle quarry beacon saddle mirror pepper timber anchor velvet candle "
    "ribbon marble cellar pocket violet walnut barley pewter falcon summit"
).split()

NEEDLE_QUESTION = "What is the secret number mentioned in the document? Answer with the number only."
ANSWER_MARGIN = 256  # tokens kept free below the context for the template and the answer


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
    "prompt_tokens": int}``."""
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
    }


def run_ttft_bench(lengths: Sequence[int], model_path: str, sparse: Any, dense: Any,
                   progress: Callable[..., None] | None = None, *, repeats: int = 3,
                   max_new_tokens: int = 16, start_engine: Callable[[str, Any], Any] | None = None) -> list[dict]:
    """TTFT of ``sparse`` vs ``dense`` (``fpcli.profiles.Profile``) at each length (tokens).

    ``start_engine(model_path, profile)`` starts an engine (default ``SGLangEngine``); ``progress``
    gets ``(message,)`` lines and ``()`` after each measured length.

    Returns one dict per length: ``target_len``, ``prompt_tokens``, ``ttft_dense_s``,
    ``ttft_sparse_s``, ``speedup`` (dense / sparse), ``density``, ``needle_dense``, ``needle_sparse``.

    Raises:
        fpcli.engine.context.ContextError: a length beyond what the model can be extended to.
    """
    from fpcli.profiles import with_context_length

    if start_engine is None:
        from fpcli.engine.sglang_engine import SGLangEngine as start_engine
    say = progress or (lambda *a: None)
    context = max(lengths) + ANSWER_MARGIN
    rows = {n: {"target_len": n} for n in lengths}
    prompts: dict[int, tuple[list[int], str]] = {}  # one tokenizer for both engines: built once
    for label, profile in (("sparse", sparse), ("dense", dense)):
        if profile.engine.context_length is None or profile.engine.context_length < context:
            profile = with_context_length(profile, context)
        say(f"starting the {label} engine ({profile.name})")
        with start_engine(model_path, profile) as eng:
            for n in lengths:
                if n not in prompts:
                    prompts[n] = needle_prompt(eng, n)
                ids, secret = prompts[n]
                m = measure(eng, ids, secret, repeats, max_new_tokens)
                row = rows[n]
                row["prompt_tokens"] = m["prompt_tokens"]
                row[f"ttft_{label}_s"] = m["ttft_s"]
                row[f"needle_{label}"] = m["needle"]
                if label == "sparse":
                    row["density"] = m["density"]
                say(f"{label} {n}: TTFT {m['ttft_s']:.4f} s, needle {'answered' if m['needle'] else 'missed'}")
                say()
    for row in rows.values():
        d, s = row.get("ttft_dense_s"), row.get("ttft_sparse_s")
        row["speedup"] = (d / s) if d and s else None
    return [rows[n] for n in lengths]
