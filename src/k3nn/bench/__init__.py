"""Benchmark suites (``k3nn bench <suite>``). Each suite is a module ``k3nn.bench.<suite_with_underscores>``
exposing ``run(args: list[str]) -> (rows, meta_extra)``; :mod:`k3nn.bench.common` measures the ceilings and
writes ``bench/results/<suite>-<date>.json`` in the schema of PERF.md."""
