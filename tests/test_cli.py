"""The k3nn command as a new user meets it: help texts, and errors that say what to do (no tracebacks)."""

import pytest
import torch

from k3nn import cli


def run(capsys, *argv):
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # argparse --help / usage errors, and SystemExit(message) from commands
        rc = e.code if isinstance(e.code, int) else (1 if e.code else 0)
        if isinstance(e.code, str):
            print(e.code, file=__import__("sys").stderr)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv", [[], ["info"], ["generate"], ["bench"], ["demo"]])
def test_help_reads_well(capsys, argv):
    rc, out, _ = run(capsys, *argv, "--help")
    assert rc == 0
    assert "usage: k3nn" in out
    assert "--help" in out or "-h" in out
    if argv == ["demo"]:
        for flag in ("--size", "--steps", "--out", "--retrain", "--reuse", "--drafter-steps"):
            assert flag in out
    if argv == ["generate"]:
        for flag in ("--model", "--prompt", "--max-new-tokens", "--drafter", "--offline", "--backend"):
            assert flag in out
    if argv == []:
        for cmd in ("info", "generate", "bench", "demo"):
            assert cmd in out


def test_info_runs(capsys):
    rc, out, _ = run(capsys, "info")
    assert rc == 0
    assert "kda_chunk" in out and "eager" in out
    assert "MXFP4 decode GEMV" in out
    assert "MLA paged decode under auto: " in out
    if not torch.cuda.is_available():
        assert "MLA paged decode under auto: triton split-KV (the CUDA kernel does not run here" in out


def test_info_names_the_mxfp4_gemv(capsys):
    from k3nn.kernels.registry import tuning

    with tuning(moe_gemv="triton"):
        _, out, _ = run(capsys, "info")
    assert "MXFP4 decode GEMV inside the triton MoE backend: triton (KernelTuning.moe_gemv='triton')" in out
    _, out, _ = run(capsys, "info")
    assert "MXFP4 decode GEMV inside the triton MoE backend: " in out and "KernelTuning.moe_gemv='auto'" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_what_to_do(capsys):
    rc, _, err = run(capsys, "bench", "kda-prefill")
    assert rc != 0
    assert "CUDA" in err and "GPU" in err and "bench/results" in err


def test_bench_unknown_suite(capsys):
    rc, _, err = run(capsys, "bench", "no-such-suite")
    assert rc != 0 and "suites:" in err and "kda-prefill" in err


def test_bench_without_suite_is_a_one_line_error(capsys):
    rc, out, err = run(capsys, "bench")
    assert rc == 2 and not out and err == "k3nn bench: error: a SUITE is required; 'k3nn bench --help' lists them\n"


def test_bench_help_lists_the_checkouts_suites(capsys):
    import bench

    rc, out, _ = run(capsys, "bench", "--help")
    assert rc == 0 and "python -m bench.SUITE" in out
    listed = out.split("suites:\n", 1)[1].splitlines()
    assert [ln.split()[0] for ln in listed] == list(bench.SUITES)


def test_bench_runs_the_suites_own_help(capsys):
    rc, out, _ = run(capsys, "bench", "e2e", "--help")
    assert rc == 0 and "usage: k3nn bench e2e" in out and "--batches" in out


def test_bench_outside_a_checkout_says_where_the_suites_are(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_checkout_root", lambda: tmp_path)  # an installed k3nn: no bench/ beside src/
    rc, _, err = run(capsys, "bench", "e2e")
    assert rc != 0 and "bench/ folder of the k3nn repository" in err and "pip install -e" in err
    rc, out, _ = run(capsys, "bench", "--help")
    assert rc == 0 and "No suites here" in out


def test_generate_missing_dir_is_a_message(capsys):
    rc, _, err = run(capsys, "generate", "--model", "/nonexistent/k3nn/ckpt")
    assert rc == 2
    assert "k3nn generate: error:" in err and "Traceback" not in err


def test_generate_offline_hub_miss_is_a_message(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rc, _, err = run(capsys, "generate", "--model", "nobody/not-a-k3nn-model", "--offline")
    assert rc == 2
    assert "offline" in err.lower() or "downloads are off" in err
    assert "local directory" in err


def test_generate_random_tiny(capsys):
    rc, _, err = run(capsys, "generate", "--preset", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "3")
    assert rc == 0
    assert "random weights" in err and "Generation: 3 tokens" in err


@pytest.mark.parametrize("ids,match", [("5,6,999", "outside [0, vocab_size=256)"),
                                       ("5,x", "argument --input-ids: expected comma-separated integers")])
def test_generate_bad_input_ids_is_one_line(capsys, ids, match):
    rc, _, err = run(capsys, "generate", "--preset", "tiny", "--input-ids", ids, "--max-new-tokens", "2")
    assert rc == 2 and match in err and "Traceback" not in err
    assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1


# ----------------------------------------------------------------------- README performance table generator
def test_perf_report_is_robust(tmp_path):
    import json

    from bench import report

    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Performance\n\n<!-- perf-table:begin -->\nold\n<!-- perf-table:end -->\n\ntail\n")
    argv = ["--root", str(tmp_path), "--plot", str(tmp_path / "docs" / "perf.png")]
    assert report.main(argv) == 0  # no results yet: a note, not a crash
    assert "No benchmark results" in readme.read_text() and "tail" in readme.read_text()

    row = {"case": "B=1 | T=8", "k3nn_ms": 0.05, "anchor": "fla", "anchor_ms": 0.1, "speedup": 2.0, "tbps": 3.1,
           "frac_copy_bw": 0.73}
    (res / "kda-decode-2026-11-01.json").write_text(json.dumps({"meta": {"gpu": "H200", "date": "2026-11-01"},
                                                                "rows": [dict(row, speedup=1.0)]}))
    (res / "kda-decode-2026-11-02-120000.json").write_text(json.dumps(
        {"meta": {"gpu": "H200", "date": "2026-11-02", "copy_tbps": 4.25},
         "rows": [row, {"case": "no anchor", "k3nn_ms": 1.5, "anchor": None}, {"no": "case"}]}))
    (res / "moe-2026-11-02.json").write_text("{not json")
    (res / "attnres-2026-11-02.json").write_text(json.dumps({"meta": {}, "rows": "oops"}))
    assert report.main(argv) == 0
    text = readme.read_text()
    assert text.count("<!-- perf-table:begin -->") == 1 and "old" not in text and text.endswith("tail\n")
    assert "**kda-decode**" in text and "2026-11-02-120000" in text and "newest of 2 runs" in text
    assert "B=1 \\| T=8" in text and "50.0 µs" in text and "2.00×" in text and "| 73 |" in text
    assert "| no anchor | – | 1.500 ms |" in text
    assert report.main(argv + ["--check"]) == 0
    readme.write_text(readme.read_text().replace("2.00×", "9.99×"))
    assert report.main(argv + ["--check"]) == 1


def test_demo_without_the_demo_extra_says_what_to_install(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if `tokenizers` were not installed
    rc, _, err = run(capsys, "demo", "--size", "toy", "--out", str(tmp_path))
    assert rc != 0 and "k3nn[demo]" in err and "tokenizers" in err


def test_kda_prefill_cases_parse_and_reject():
    from bench.kda_prefill import _parse_case
    assert _parse_case(" 65536:96:lower_bound") == (1, 65536, 96, "lower_bound")
    for bad in ("65536:96", "x:96:softplus", "4096:32:relu", "0:32:softplus"):
        with pytest.raises(SystemExit, match="--cases"):
            _parse_case(bad)
