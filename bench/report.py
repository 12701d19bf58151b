"""The README's performance table and plot, generated from committed benchmark results.

Reads every ``bench/results/*.json`` (schema in docs/perf.md: ``meta`` with gpu / torch / triton / commit /
copy_tbps / bf16_tflops, and ``rows`` with ``case``, ``k3nn_ms`` and, where they apply, ``anchor``,
``anchor_ms``, ``speedup``, ``tbps``, ``frac_copy_bw``, ``tflops``). A file's suite is its name up to the
date (``mla-decode-2026-11-30-004507.json`` → ``mla-decode``); the newest file of each suite (by
``meta.date``, then file name) is the one reported. Unreadable files and missing fields are skipped, not fatal.

Writes the markdown table between ``<!-- perf-table:begin -->`` and ``<!-- perf-table:end -->`` in README.md
(appending a section when the markers are absent) and a PNG of the speedups (needs matplotlib).

    python -m bench.report                  # or: python scripts/make_readme.py
    python -m bench.report --check          # exit 1 if README.md is out of date
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Result", "load_results", "latest_per_suite", "render_table", "update_readme", "plot_results", "main"]

BEGIN, END = "<!-- perf-table:begin -->", "<!-- perf-table:end -->"
_SUITE_RE = re.compile(r"^(?P<suite>.+?)-(?P<date>\d{4}-\d{2}-\d{2}(?:[-T_]?\d+)?)$")


@dataclass
class Result:
    suite: str
    path: Path
    meta: dict
    rows: list[dict] = field(default_factory=list)

    @property
    def sort_key(self) -> tuple[str, str]:
        return (str(self.meta.get("date", "")), self.path.name)


def suite_of(path: Path) -> str:
    m = _SUITE_RE.match(path.stem)
    return m.group("suite") if m else path.stem


def load_results(directory: str | Path, warn=print) -> list[Result]:
    """Every parseable result file under ``directory`` (non-recursive), in name order."""
    out = []
    d = Path(directory)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            warn(f"skipping {p}: not valid JSON ({e})")
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            warn(f"skipping {p}: no 'rows' list (see docs/perf.md for the schema)")
            continue
        rows = [r for r in data["rows"] if isinstance(r, dict) and "case" in r]
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        out.append(Result(suite_of(p), p, meta, rows))
    return out


def latest_per_suite(results: list[Result]) -> list[Result]:
    best: dict[str, Result] = {}
    for r in results:
        if r.suite not in best or r.sort_key > best[r.suite].sort_key:
            best[r.suite] = r
    return [best[s] for s in sorted(best)]


def _num(x, fmt: str) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return "–"
    return format(x, fmt)


def _ms(x) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return "–"
    return f"{x:.3f} ms" if x >= 0.1 else f"{x * 1000:.1f} µs"


def _cell(s) -> str:
    return "–" if s is None or s == "" else str(s).replace("|", "\\|").replace("\n", " ")


def render_table(results: list[Result], root: Path | None = None) -> str:
    """Markdown: one section per suite (the newest file of each), one row per result row."""
    latest = latest_per_suite(results)
    if not latest:
        return ("_No benchmark results are committed yet: run `k3nn bench <suite>` on a GPU, commit "
                "`bench/results/*.json`, then `python scripts/make_readme.py`._")
    lines = []
    for r in latest:
        m = r.meta
        older = sum(1 for x in results if x.suite == r.suite) - 1
        rel = r.path.relative_to(root) if root and r.path.is_relative_to(root) else r.path
        info = ", ".join(str(x) for x in (m.get("gpu"), m.get("date"), f"commit {m['commit']}" if m.get("commit") not in (None, "", "unknown")
                                           else None, f"torch {m['torch']}" if m.get("torch") else None,
                                           f"triton {m['triton']}" if m.get("triton") else None) if x)
        ceil = []
        if isinstance(m.get("copy_tbps"), (int, float)):
            ceil.append(f"copy {m['copy_tbps']:.2f} TB/s")
        if isinstance(m.get("bf16_tflops"), (int, float)):
            ceil.append(f"bf16 matmul {m['bf16_tflops']:.0f} TFLOP/s")
        lines.append(f"**{r.suite}** ({info}; ceilings measured in the same run: {', '.join(ceil) or 'not recorded'}) "
                     f"from [`{rel}`]({rel})" + (f", newest of {older + 1} runs" if older else ""))
        lines.append("")
        lines.append("| case | anchor | k3nn | anchor time | speedup | TB/s | % of copy BW | TFLOP/s |")
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for row in r.rows:
            sp = row.get("speedup")
            if not isinstance(sp, (int, float)) and isinstance(row.get("anchor_ms"), (int, float)) \
                    and isinstance(row.get("k3nn_ms"), (int, float)) and row["k3nn_ms"] > 0:
                sp = row["anchor_ms"] / row["k3nn_ms"]
            frac = row.get("frac_copy_bw")
            lines.append("| " + " | ".join([
                _cell(row.get("case")), _cell(row.get("anchor")), _ms(row.get("k3nn_ms")),
                _ms(row.get("anchor_ms")), _num(sp, ".2f") + ("×" if isinstance(sp, (int, float)) else ""),
                _num(row.get("tbps"), ".2f"), _num(frac * 100 if isinstance(frac, (int, float)) else None, ".0f"),
                _num(row.get("tflops"), ".0f")]) + " |")
        lines.append("")
    lines.append("Speedup = anchor ms / k3nn ms (> 1: k3nn is faster), both measured side by side in one run; "
                 "protocol in [docs/perf.md](docs/perf.md).")
    return "\n".join(lines)


def update_readme(readme: Path, table: str, plot_rel: str | None = None) -> tuple[str, str]:
    """(old text, new text) of ``readme`` with ``table`` (and the plot link) between the markers."""
    old = readme.read_text() if readme.exists() else ""
    body = table + (f"\n\n![speedups vs anchors]({plot_rel})" if plot_rel else "")
    block = f"{BEGIN}\n<!-- generated by scripts/make_readme.py from bench/results/*.json; do not edit -->\n{body}\n{END}"
    if BEGIN in old and END in old:
        a, rest = old.split(BEGIN, 1)
        _, b = rest.split(END, 1)
        new = a + block + b
    else:
        new = old.rstrip("\n") + "\n\n## Performance (H200)\n\n" + block + "\n"
    return old, new


def plot_results(results: list[Result], path: Path) -> bool:
    """Horizontal bars of speedup vs each anchor (log scale, 1× marked), one panel per suite."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    panels = []
    for r in latest_per_suite(results):
        bars = []
        for row in r.rows:
            sp = row.get("speedup")
            if isinstance(sp, (int, float)) and not isinstance(sp, bool) and sp > 0 and math.isfinite(sp):
                anchor = str(row.get("anchor") or "?")
                anchor = anchor if len(anchor) <= 48 else anchor[:47] + "…"
                bars.append((f"{row.get('case', '')}\nvs {anchor}", float(sp)))
        if bars:
            panels.append((r, bars))
    if not panels:
        return False
    heights = [max(1.5, 0.42 * len(b) + 0.8) for _, b in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (r, bars) in zip(axes[:, 0], panels):
        labels, vals = zip(*bars)
        y = range(len(vals))
        # bars grow from 1× (parity): right = k3nn faster, left = slower
        ax.barh(list(y), [v - 1 for v in vals], left=1.0, color=["C2" if v >= 1 else "C3" for v in vals])
        ax.set_yticks(list(y), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        fmt = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×")
        lo, hi = min(min(vals), 1.0), max(max(vals), 1.0)
        ax.set_xlim(lo / 1.25, hi * 1.35)
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(fmt)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.tick_params(axis="x", which="both", labelsize=7)
        ax.axvline(1.0, color="k", lw=0.8)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}× ", va="center", ha="left" if v >= 1 else "right", fontsize=7)
        ax.set_title(f"{r.suite}: speedup of k3nn vs anchor ({r.meta.get('gpu', '?')}, {r.meta.get('date', '')})",
                     fontsize=9)
        ax.grid(axis="x", alpha=0.3, which="both")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report",
                                description="Regenerate README.md's performance table and docs/perf.png from "
                                            "bench/results/*.json.")
    p.add_argument("--root", type=Path, default=Path("."), help="repository root")
    p.add_argument("--results", type=Path, default=None, help="results directory (default ROOT/bench/results)")
    p.add_argument("--readme", type=Path, default=None, help="README to update (default ROOT/README.md)")
    p.add_argument("--plot", type=Path, default=None, help="PNG to write (default ROOT/docs/perf.png)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the README table is stale")
    a = p.parse_args(argv)
    root = a.root.resolve()
    results_dir = a.results or root / "bench" / "results"
    readme = a.readme or root / "README.md"
    plot = a.plot or root / "docs" / "perf.png"
    results = load_results(results_dir, warn=lambda m: print(m, file=sys.stderr))
    table = render_table(results, root)
    has_plot = plot.exists() if a.check else plot_results(results, plot)
    plot_rel = None
    if has_plot:
        try:
            plot_rel = plot.resolve().relative_to(readme.resolve().parent).as_posix()
        except ValueError:
            plot_rel = plot.as_posix()
    old, new = update_readme(readme, table, plot_rel)
    if a.check:
        if old != new:
            print(f"{readme} is out of date: run python scripts/make_readme.py", file=sys.stderr)
            return 1
        return 0
    if old != new:
        readme.write_text(new)
    n = len(latest_per_suite(results))
    print(f"{readme}: table from {n} suite(s), {len(results)} result file(s)"
          + (f"; plot {plot}" if has_plot else "; no plot (no speedups, or matplotlib missing)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
