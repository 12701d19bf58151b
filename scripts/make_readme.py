#!/usr/bin/env python3
"""Regenerate README.md's generated blocks from committed data. Run from anywhere:

    python scripts/make_readme.py                          # both blocks, from the committed data
    python scripts/make_readme.py --demo ~/.cache/k3nn/demo/results.json   # import a demo run first
    python scripts/make_readme.py --check                  # exit 1 if README.md is out of date

1. The performance table (between the ``perf-table`` markers) and docs/perf.png, from ``bench/results/*.json``
   (``bench/report.py``, loaded by path).
2. The demo block (between the ``demo`` markers): the figures, machine and timings of the newest recorded demo run
   (``docs/demo/results.json``, the ``results.json`` that ``k3nn demo`` writes) and the range over every recorded
   run (``docs/demo/runs.json``). ``--demo RESULTS`` records a new run: it copies RESULTS (and the ``loss.png``
   beside it, to docs/demo_loss.png) and appends the run's summary to runs.json.

Runs on any Python 3.10+ (matplotlib only for the perf plot; no torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "docs" / "demo"
DEMO_BEGIN, DEMO_END = "<!-- demo:begin -->", "<!-- demo:end -->"

GREEDY_LINES = 12  # lines of the run's greedy text the README shows

# the figures a run summary keeps (the range line and the table of runs read these)
SUMMARY_KEYS = ("plain_tokens_per_s", "speedup_greedy", "acceptance_length_prompt",
                "acceptance_length_heldout_greedy", "acceptance_length_heldout_sampled", "total_seconds")


def load_report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    report = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = report  # dataclasses look the module up while the class body runs
    spec.loader.exec_module(report)
    return report


def summarize(results: dict, source: str) -> dict:
    """One line of runs.json: when, where, the headline figures."""
    m = results.get("machine") or {}
    return {"date": results.get("date"), "source": source,
            "machine": {k: m.get(k) for k in ("cpu", "cores", "threads", "load_average_1min",
                                              "load_average_1min_end", "python", "torch", "commit")},
            "reused_checkpoint": results.get("reused_checkpoint"),
            **{k: results.get(k) for k in SUMMARY_KEYS}}


def import_run(path: Path, demo_dir: Path, docs: Path) -> None:
    results = json.loads(path.read_text())
    missing = [k for k in ("figures", "machine", "total_seconds") if k not in results]
    if missing:
        raise SystemExit(f"{path}: not a results.json of this k3nn demo (no {', '.join(missing)}): run k3nn demo "
                         f"again with the current code")
    demo_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, demo_dir / "results.json")
    png = path.parent / "loss.png"
    if png.is_file():
        shutil.copyfile(png, docs / "demo_loss.png")
    runs_path = demo_dir / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else []
    runs.append(summarize(results, "k3nn demo results.json, imported by scripts/make_readme.py --demo"))
    runs_path.write_text(json.dumps(runs, indent=2, ensure_ascii=False) + "\n")


def _fmt(v, spec: str, unit: str = "") -> str:
    return "–" if not isinstance(v, (int, float)) or isinstance(v, bool) else f"{format(v, spec)}{unit}"


def _span(runs: list[dict], key: str, spec: str, unit: str = "") -> str:
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return _fmt(lo, spec, unit) if lo == hi else f"{_fmt(lo, spec)}–{_fmt(hi, spec, unit)}"


def _machine(m: dict) -> str:
    parts = [m.get("cpu") or "unknown CPU"]
    if m.get("cores"):
        parts.append(f"{m['cores']} cores")
    if m.get("threads"):
        parts.append(f"{m['threads']} torch thread{'s' if m['threads'] != 1 else ''}")
    load = [f"{m[k]:.1f}" for k in ("load_average_1min", "load_average_1min_end") if isinstance(m.get(k), (int, float))]
    if load:
        parts.append("load average " + " at the start, ".join(load) + (" at the end" if len(load) == 2 else " at the start"))
    return ", ".join(parts)


def render_demo(demo_dir: Path) -> str:
    """The README's demo block (markdown) from results.json and runs.json."""
    res_path, runs_path = demo_dir / "results.json", demo_dir / "runs.json"
    if not res_path.is_file():
        return ("_No demo run is recorded yet: run `k3nn demo`, then `python scripts/make_readme.py --demo "
                "~/.cache/k3nn/demo/results.json`._")
    r = json.loads(res_path.read_text())
    runs = json.loads(runs_path.read_text()) if runs_path.is_file() else [summarize(r, "docs/demo/results.json")]
    m = r.get("machine") or {}
    versions = ", ".join(x for x in (f"Python {m['python']}" if m.get("python") else None,
                                     f"torch {m['torch']}" if m.get("torch") else None,
                                     f"k3nn commit {m['commit']}" if m.get("commit") else None) if x)
    reused = " (the trained checkpoint was reused from an earlier run)" if r.get("reused_checkpoint") else ""
    lines = [
        f"What the newest recorded run printed ({(r.get('date') or '')[:10]}; {_machine(m)}; {versions}): "
        f"**{r['total_seconds']:.0f} s** for training and generation{reused}, of which "
        f"{r.get('train_seconds', float('nan')):.0f} s training the target. From "
        f"[`docs/demo/results.json`](docs/demo/results.json):",
        "",
        "```",
        *r["figures"],
        "```",
    ]
    if r.get("greedy_text") is not None and r.get("prompt") is not None:
        text = (r["prompt"] + r["greedy_text"]).rstrip("\n").splitlines()
        shown = text[:GREEDY_LINES]
        more = f" (the first {GREEDY_LINES} of {len(text)} lines)" if len(text) > GREEDY_LINES else ""
        lines += ["", f"Its greedy continuation of the prompt{more}:", "", "```python", *shown, "```"]
    lines += [
        "",
        "**These figures depend on the machine and on what else runs on it** (torch's intra-op threads spin-wait, "
        f"so a shared CPU slows decoding a lot). Over the {len(runs)} runs recorded in "
        "[`docs/demo/runs.json`](docs/demo/runs.json): plain greedy "
        f"{_span(runs, 'plain_tokens_per_s', '.1f', ' tokens/s')}, speculative greedy "
        f"{_span(runs, 'speedup_greedy', '.2f', '×')} plain, acceptance length "
        f"{_span(runs, 'acceptance_length_prompt', '.2f')} on the prompt and "
        f"{_span(runs, 'acceptance_length_heldout_greedy', '.2f')} on held-out files (greedy), "
        f"{_span(runs, 'total_seconds', '.0f', ' s')} in all.",
        "",
        "| run | machine | plain greedy | speculative greedy | acceptance (prompt) | acceptance (held-out, greedy) "
        "| total |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        rm = run.get("machine") or {}
        lines.append(" | ".join([
            "| " + ", ".join(x for x in ((run.get("date") or "")[:10], run.get("note")) if x),
            _machine(rm).replace("|", "/"), _fmt(run.get("plain_tokens_per_s"), ".1f", " tok/s"),
            _fmt(run.get("speedup_greedy"), ".2f", "×"), _fmt(run.get("acceptance_length_prompt"), ".2f"),
            _fmt(run.get("acceptance_length_heldout_greedy"), ".2f"), _fmt(run.get("total_seconds"), ".0f", " s")])
            + " |")
    return "\n".join(lines)


def update_block(text: str, begin: str, end: str, body: str, what: str) -> str:
    block = f"{begin}\n<!-- generated by scripts/make_readme.py from {what}; do not edit -->\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/make_readme.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", type=Path, metavar="RESULTS_JSON",
                   help="record a demo run (the results.json k3nn demo wrote) before regenerating")
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    p.add_argument("--check", action="store_true", help="exit 1 if README.md is out of date; change nothing")
    args, rest = p.parse_known_args(argv)
    root = args.root.resolve()
    demo_dir, docs = root / "docs" / "demo", root / "docs"
    if args.demo is not None:
        if args.check:
            p.error("--demo and --check do not go together")
        if not args.demo.is_file():
            p.error(f"--demo: no such file: {args.demo}")
        import_run(args.demo, demo_dir, docs)
    rc = load_report().main(["--root", str(root), *(["--check"] if args.check else []), *rest])
    readme = root / "README.md"
    old = readme.read_text() if readme.exists() else ""
    new = update_block(old, DEMO_BEGIN, DEMO_END, render_demo(demo_dir), "docs/demo/*.json")
    if args.check:
        if new != old:
            print("README.md's demo block is out of date: run python scripts/make_readme.py", file=sys.stderr)
            return 1
        return rc
    if new != old:
        readme.write_text(new)
    return rc


if __name__ == "__main__":
    sys.exit(main())
