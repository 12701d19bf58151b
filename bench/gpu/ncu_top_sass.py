"""Top SASS lines by sampled warp stalls from ``ncu --page source --csv --print-source sass`` (read on stdin):
the columns ncu gives, then the ``--top`` lines with the most samples (instruction text, samples and the share
of all samples), so a profile of a kernel fits in a short log.

    ncu --kernel-name regex:NAME --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats \\
        --page source --csv --print-source sass python3 DRIVER.py | python3 -m bench.gpu.ncu_top_sass --top 40
"""

from __future__ import annotations

import argparse
import csv
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    lines = sys.stdin.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"') and "Source" in ln), None)
    if start is None:
        print("no source table in the input; its first lines:\n" + "\n".join(lines[:20]))
        return 1
    rows = list(csv.reader(lines[start:]))
    head, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    print("columns:", " | ".join(head))
    col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    src = head.index("Source") if "Source" in head else 1
    if col is None:
        print("no stall-sampling column")
        return 1

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[col]) for r in body) or 1.0
    extra = [i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (Not")]
    for r in sorted(body, key=lambda r: -num(r[col]))[:args.top]:
        more = " ".join(f"not-issued {num(r[i]):.0f}" for i in extra)
        print(f"{num(r[col]):8.0f} {num(r[col]) / total:6.1%} {more:18s} {r[0]:>6s} {r[src][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
