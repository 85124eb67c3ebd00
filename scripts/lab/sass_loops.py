"""Per-loop instruction counts of a SASS file written by ``compile_sm90.py --sass`` (lab, no GPU).

    python scripts/lab/sass_loops.py DIR/attn_fp8_d128_B128_g4_bits.sass [...]

A loop is a backward branch (``BRA`` to a lower address); for each, the instructions in its body
and how many are MUFU (``MUFU.EX2`` etc.), QGMMA / HGMMA (wgmma), ``WARPGROUP.DEPBAR`` (wgmma
waits), ``F2FP`` (packing conversions), ``SHFL``, global loads (``LDG``), ``LDGSTS`` (cp.async),
and the instruction index of each wait relative to the body's start (where the wgmma results are
waited for).
"""
from __future__ import annotations

import re
import sys

KINDS = ("MUFU", "GMMA", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "F2FP", "SHFL", "LDG.", "LDGSTS", "HADD2", "FFMA",
         "FADD", "FMUL", "BAR.SYNC", "SYNCS")
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def loops(path: str):
    insns = []
    for line in open(path):
        m = INSN.search(line)
        if m:
            insns.append((int(m.group(1), 16), m.group(2).strip()))
    addr_idx = {a: i for i, (a, _) in enumerate(insns)}
    for i, (a, text) in enumerate(insns):
        b = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not b:
            continue
        target = int(b.group(1), 16)
        if target < a and target in addr_idx:
            body = insns[addr_idx[target]:i + 1]
            counts = {k: sum(k in t for _, t in body) for k in KINDS}
            waits = [j for j, (_, t) in enumerate(body) if "WARPGROUP.DEPBAR" in t]
            gmma = [j for j, (_, t) in enumerate(body) if "GMMA" in t]
            yield hex(target), len(body), counts, waits, gmma


def main(argv):
    for path in argv:
        print(path)
        for start, n, counts, waits, gmma in loops(path):
            c = " ".join(f"{k.rstrip('.')}={v}" for k, v in counts.items() if v)
            print(f"  loop @{start}: {n} insns; {c}; wgmma at {gmma}; waits at {waits}")


if __name__ == "__main__":
    main(sys.argv[1:])
