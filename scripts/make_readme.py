#!/usr/bin/env python3
"""Regenerate README.md's performance table (between its perf-table markers) and docs/perf.png from the
committed bench/results/*.json. Run from anywhere: python scripts/make_readme.py [--check].

The report module is loaded by path, so this runs on any Python 3.10+ (matplotlib only for the plot; no torch).
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report  # dataclasses look the module up while the class body runs
spec.loader.exec_module(report)

if __name__ == "__main__":
    sys.exit(report.main(["--root", str(ROOT), *sys.argv[1:]]))
