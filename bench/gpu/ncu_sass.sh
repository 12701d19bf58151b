#!/usr/bin/env bash
# ncu_sass.sh KERNEL_REGEX -m bench.gpu.DRIVER [ARGS...] (what python3 runs; from the repository root): the third
# launch of the kernel under ncu's source page (SASS with sampled warp stalls), reduced to its top lines by
# ncu_top_sass.py, then the per-reason stall averages of the same launch (raw page). Used by the suite's *-sass steps.
set -u
k=$1; shift
ncu --clock-control none --kernel-name "regex:$k" --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --page source --csv --print-source sass python3 "$@" 2>/dev/null \
  | python3 "$(dirname "$0")/ncu_top_sass.py" --top 45
ncu --clock-control none --kernel-name "regex:$k" --launch-skip 2 --launch-count 1 --section WarpStateStats \
    --page raw --csv python3 "$@" 2>/dev/null \
  | python3 -c "
import csv, sys
rows = [r for r in csv.reader(sys.stdin) if r]
head = next((r for r in rows if 'Kernel Name' in r), None)
if head is None:
    sys.exit('no raw page')
vals = rows[rows.index(head) + 2] if len(rows) > rows.index(head) + 2 else rows[-1]
pairs = [(h, v) for h, v in zip(head, vals) if 'issue_stalled' in h and 'ratio' in h]
def f(v):
    try: return float(v.replace(',', ''))
    except ValueError: return 0.0
for h, v in sorted(pairs, key=lambda p: -f(p[1]))[:14]:
    print(f'{f(v):8.3f}  {h}')
"
