"""CPU decode speed of the transformers engine at two prompt lengths (a script, not a test).

Loads the embedded model (``fp model pull`` first), builds prompts of about ``--lengths`` tokens
from the sample document repeated, runs one prefill + ``--new`` greedy decode steps each, and
prints decode tokens/s (answer tokens after the first / time after the first token), the median
of ``--repeats`` runs. Use it to compare commits::

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_decode.py --lengths 800 7800 --new 32
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[800, 7800])
    ap.add_argument("--new", type=int, default=32, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from fpcli.engine.transformers_engine import TransformersEngine
    from fpcli.models import resolve_model
    from fpcli.profiles import load_profile

    text = (ROOT / "examples" / "harbor-report.md").read_text(encoding="utf-8")
    with TransformersEngine(resolve_model(None), load_profile("dense"), device="cpu", timing=False) as eng:
        for n in args.lengths:
            starts = eng.token_starts(text * (n // max(1, eng.count_tokens(text)) + 1))
            body = (text * (n // max(1, eng.count_tokens(text)) + 1))[: starts[n - 40]]
            ids = eng.encode_chat(None, body + "\n\nSummarize.")
            speeds = []
            for _ in range(args.repeats):
                r = eng.generate(ids, max_new_tokens=args.new)
                eos_free = r.output_tokens == args.new
                speeds.append(r.decode_tokens_per_s)
            print(f"prompt {len(ids):>5} tokens: decode {statistics.median(speeds):.2f} tokens/s "
                  f"({args.new} steps{'' if eos_free else ', stopped early'}; runs {', '.join(f'{s:.2f}' for s in speeds)})",
                  flush=True)


if __name__ == "__main__":
    main()
