"""Compare PDF text extractors on glued words and speed: ``python scripts/measure_pdf_text.py FILE.pdf...``.

For each file and each installed extractor (pypdf, pypdfium2, pdfminer.six) it prints the pages,
the seconds per page (best of ``--repeat`` runs, whole file, text only) and the glued-word measure
that fp warns on (``fpcli.ingest.glued_runs``: runs of ``GLUED_RUN`` or more letters in scripts that
separate words with spaces; the share is letters in such runs over all such letters). The numbers
in docs/ingest.md were made with it.
"""
from __future__ import annotations

import argparse
import time
from importlib import metadata

from fpcli.ingest import GLUED_RUN, glued_runs, glued_share


def pypdf_pages(path: str) -> list[str]:
    from pypdf import PdfReader

    return [p.extract_text() or "" for p in PdfReader(path).pages]


def pdfium_pages(path: str) -> list[str]:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(path)
    try:
        return [pdf[i].get_textpage().get_text_bounded() for i in range(len(pdf))]
    finally:
        pdf.close()


def pdfminer_pages(path: str) -> list[str]:
    from pdfminer.high_level import extract_pages
    from pdfminer.layout import LTTextContainer

    return ["".join(el.get_text() for el in page if isinstance(el, LTTextContainer)) for page in extract_pages(path)]


EXTRACTORS = {"pypdf": ("pypdf", pypdf_pages), "pypdfium2": ("pypdfium2", pdfium_pages), "pdfminer.six": ("pdfminer.six", pdfminer_pages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pdfs", nargs="+")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    versions = {}
    for key, (dist, _) in EXTRACTORS.items():
        try:
            versions[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    print("| file | pages | extractor | ms/page | glued runs (>= %d letters) | glued share | chars |" % GLUED_RUN)
    print("|---|---|---|---|---|---|---|")
    for path in args.pdfs:
        for key in versions:
            fn = EXTRACTORS[key][1]
            best = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                pages = fn(path)
                best = min(best, time.perf_counter() - t0)
            text = "\n".join(pages)
            print(f"| {path.rsplit('/', 1)[-1]} | {len(pages)} | {key} {versions[key]} | {1000 * best / max(1, len(pages)):.1f} "
                  f"| {len(glued_runs(text))} | {glued_share(text):.1%} | {len(text):,} |")


if __name__ == "__main__":
    main()
