"""Every flag of every ``k3nn`` command, driven with bad values: each error is one line
``k3nn <command>: error: ...`` on stderr naming the flag, exit status 2, no traceback, and stdout (when a prompt was
echoed) ends its line first. Runs ``cli.main`` in-process (a subprocess per case would take minutes)."""

from __future__ import annotations

import sys

import pytest
import torch

from k3nn import cli

pytest.importorskip("tokenizers")  # the demo rows reach its import check

HERE = __file__  # a file, where a directory is expected


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Commands set torch's thread count and HF_HUB_OFFLINE (--offline): restore both; an empty hub cache."""
    n = torch.get_num_threads()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    yield
    torch.set_num_threads(n)


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse: --help, or a usage error it printed
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_one_line_error(rc: int, out: str, err: str, cmd: str, *needles: str) -> str:
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    errors = [ln for ln in err.splitlines() if ": error:" in ln]
    assert len(errors) == 1, err
    line = errors[0]
    assert line.startswith(f"k3nn {cmd}: error: " if cmd else "k3nn: error: "), line
    assert err.rstrip("\n").splitlines()[-1] == line, err  # nothing after the error
    for n in needles:
        assert n in line, (n, line)
    assert not out or out.endswith("\n"), repr(out)  # an echoed prompt ends its line before the error
    return line


NO_CUDA = not torch.cuda.is_available()
T = ["--preset", "tiny"]  # rows that get past parsing build the tiny random model (fast)

GENERATE = [
    (["--model", ""], "--model"),
    (["--model", "/nonexistent/k3nn/ckpt"], "--model"),
    (["--model", HERE], "--model"),
    (["--model", "nosuch/model", "--offline"], "--model"),
    (["--model", "x", "--preset", "tiny"], "--preset"),
    (["--preset", "huge"], "--preset"),
    (["--prompt", ""], "--prompt"),
    (["--prompt", "a", "--input-ids", "1"], "--input-ids"),
    (["--input-ids", "1,x"], "--input-ids"),
    (["--input-ids", "-1"], "--input-ids"),
    (["--input-ids", ""], "--input-ids"),
    ([*T, "--input-ids", "5,999"], "--input-ids"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens"),
    ([*T, "--prompt", "hi", "--max-new-tokens", "100000"], "--max-new-tokens"),
    (["--temperature", "0"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--temperature", "warm"], "--temperature"),
    (["--top-k", "-1"], "--top-k"),
    (["--top-k", "1.5"], "--top-k"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "x"], "--top-p"),
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "x"], "--seed"),
    (["--eos-token-id", "abc"], "--eos-token-id"),
    (["--eos-token-id", "1,,2"], "--eos-token-id"),
    (["--eos-token-id", "-5"], "--eos-token-id"),
    ([*T, "--input-ids", "1", "--eos-token-id", "999"], "--eos-token-id"),
    (["--dtype", "bogus"], "--dtype"),
    (["--dtype", "int8"], "--dtype"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:x"], "--device"),
    (["--device", ""], "--device"),
    (["--device", "meta"], "--device"),
    (["--device", "cuda:99"], "--device"),
    pytest.param(["--device", "cuda"], "--device", marks=pytest.mark.skipif(not NO_CUDA, reason="has CUDA")),
    pytest.param(["--device", "mps"], "--device",
                 marks=pytest.mark.skipif(torch.backends.mps.is_available(), reason="has MPS")),
    (["--backend", "fast"], "--backend"),
    pytest.param([*T, "--backend", "cuda", "--prompt", "hi", "--max-new-tokens", "2"], "--backend",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="the CUDA backend may run here")),
    (["--drafter", "/nonexistent/drafter"], "--drafter"),
    (["--drafter", HERE], "--drafter"),
    (["--num-assistant-tokens", "0"], "--num-assistant-tokens"),
    (["--num-assistant-tokens", "x"], "--num-assistant-tokens"),
    (["--num-assistant-tokens", "3"], "--num-assistant-tokens"),  # without --drafter: would be ignored
    (["--revision", "main"], "--revision"),  # without --model: would be ignored
    (["--revision", ""], "--revision"),
    (["--threads", "0"], "--threads"),
    (["--threads", "many"], "--threads"),
    (["--bogus"], "--bogus"),
    (["stray"], "stray"),
]


@pytest.mark.parametrize("argv,flag", GENERATE, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_generate_bad_flags(capsys, argv, flag):
    assert_one_line_error(*run(capsys, ["generate", *argv]), "generate", flag)


def test_generate_bad_drafter_directory_names_the_flag(capsys, tmp_path):
    assert_one_line_error(*run(capsys, ["generate", *T, "--drafter", str(tmp_path)]), "generate", "--drafter",
                          "dspark_config.json")


def test_generate_model_directory_without_config_names_the_flag(capsys, tmp_path):
    assert_one_line_error(*run(capsys, ["generate", "--model", str(tmp_path)]), "generate", "--model",
                          "config.json")


def test_generate_hub_miss_online_says_what_happened(capsys, monkeypatch):
    # no network here (or a repo that does not exist): never "downloads are off" when they are not
    from huggingface_hub.utils import LocalEntryNotFoundError

    def unreachable(*a, **k):
        try:
            raise ConnectionError("Name or service not known")
        except ConnectionError as e:
            raise LocalEntryNotFoundError("cannot find the requested files in the local cache") from e

    monkeypatch.setattr("huggingface_hub.snapshot_download", unreachable)
    line = assert_one_line_error(*run(capsys, ["generate", "--model", "nosuch/model"]), "generate", "--model")
    assert "could not be reached" in line and "ConnectionError" in line and "downloads are off" not in line


def test_generate_hub_miss_offline_names_the_switch(capsys):
    line = assert_one_line_error(*run(capsys, ["generate", "--model", "nosuch/model", "--offline"]), "generate")
    assert "downloads are off (HF_HUB_OFFLINE=1" in line


def test_generate_bad_omp_num_threads(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert_one_line_error(*run(capsys, ["generate", *T, "--input-ids", "1"]), "generate", "OMP_NUM_THREADS")


def test_error_after_the_echoed_prompt_starts_a_new_line(capsys, monkeypatch):
    from k3nn.model import KimiK3

    def fails_midway(self, input_ids, streamer=None, **kw):
        streamer.put(input_ids)
        streamer.put(torch.tensor([104]))  # "h" streamed after the prompt
        raise FloatingPointError("the model's logits contain NaN or Inf at step 1")

    monkeypatch.setattr(KimiK3, "generate", fails_midway)
    rc, out, err = run(capsys, ["generate", *T, "--prompt", "def f(x):", "--max-new-tokens", "4"])
    assert out == "def f(x):h\n"
    assert_one_line_error(rc, out, err, "generate", "NaN")


def test_sampling_flags_without_do_sample_warn_in_one_line(capsys):
    rc, out, err = run(capsys, ["generate", *T, "--input-ids", "1,2", "--max-new-tokens", "2", "--temperature",
                                "0.7", "--top-p", "0.9", "--threads", "1"])
    assert rc == 0
    warn = [ln for ln in err.splitlines() if "warning" in ln]
    assert warn == ["k3nn generate: warning: --temperature, --top-p only apply when sampling; without --do-sample "
                    "the decoding is greedy and they are ignored"]


def test_threads_flag_sets_torch_threads(capsys):
    rc, _, err = run(capsys, ["generate", *T, "--input-ids", "1", "--max-new-tokens", "1", "--threads", "1"])
    assert rc == 0 and torch.get_num_threads() == 1 and "1 CPU thread(s)" in err


DEMO = [
    (["--size", "huge"], "--size"),
    (["--steps", "0"], "--steps"),
    (["--steps", "x"], "--steps"),
    (["--drafter-steps", "-1"], "--drafter-steps"),
    (["--out", HERE], "--out"),
    (["--retrain", "--reuse"], "--reuse"),
    (["--prompt", ""], "--prompt"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--seed", "-1"], "--seed"),
    (["--threads", "0"], "--threads"),
    (["--corpus", "/nonexistent/corpus"], "--corpus"),
    (["--corpus", HERE], "--corpus"),
    (["--bogus"], "--bogus"),
]


@pytest.mark.parametrize("argv,flag", DEMO, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_demo_bad_flags(capsys, argv, flag):
    assert_one_line_error(*run(capsys, ["demo", *argv]), "demo", flag)


def test_demo_reuse_without_a_cache(capsys, tmp_path):
    assert_one_line_error(*run(capsys, ["demo", "--size", "toy", "--reuse", "--out", str(tmp_path), "--threads",
                                        "1"]), "demo", "--reuse", "no cached checkpoint")


def test_demo_without_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert_one_line_error(*run(capsys, ["demo", "--size", "toy", "--out", str(tmp_path)]), "demo", "k3nn[demo]")


@pytest.mark.parametrize("argv,needle", [
    ([], "a SUITE is required"),
    (["no-such-suite"], "unknown suite"),
    (["--bogus"], "--bogus"),
    pytest.param(["e2e"], "no CUDA device", marks=pytest.mark.skipif(not NO_CUDA, reason="has CUDA")),
])
def test_bench_bad_arguments(capsys, argv, needle):
    assert_one_line_error(*run(capsys, ["bench", *argv]), "bench", needle)


@pytest.mark.parametrize("argv", [["--bogus"], ["extra"]])
def test_info_bad_arguments(capsys, argv):
    assert_one_line_error(*run(capsys, ["info", *argv]), "info", argv[0])


@pytest.mark.parametrize("argv,needle", [([], "COMMAND"), (["nosuch"], "nosuch"), (["--bogus"], "COMMAND")])
def test_top_level_bad_arguments(capsys, argv, needle):
    assert_one_line_error(*run(capsys, argv), "", needle)


def test_every_generate_and_demo_flag_is_in_the_table():
    """A flag added later gets a row here: the table covers every option of the parsers."""
    from k3nn import demo

    _, subs = cli.build_parser()
    covered = {a for row in GENERATE for a in (row.values[0] if hasattr(row, "values") else row[0])
               if a.startswith("--")}
    flags = {s for a in subs["generate"]._actions for s in a.option_strings if s.startswith("--")}
    no_value = {"--help", "--do-sample", "--offline"}  # switches: nothing to get wrong
    assert flags - no_value - covered == set()
    covered = {a for argv, _ in DEMO for a in argv if a.startswith("--")}
    flags = {s for a in demo.build_parser()._actions for s in a.option_strings if s.startswith("--")}
    assert flags - {"--help", "--quiet"} - covered == set()


SERVE_BASE = ["--model", "/nonexistent/k3nn/model", "--port", "0"]  # a row's bad flag fails before any loading
SERVE = [
    ([], "--model"),
    ([*SERVE_BASE, "--port", "x"], "--port"),
    ([*SERVE_BASE, "--port", "70000"], "--port"),
    ([*SERVE_BASE, "--host", "no such host!"], "--host"),
    ([*SERVE_BASE, "--max-num-seqs", "0"], "--max-num-seqs"),
    ([*SERVE_BASE, "--num-pages", "0"], "--num-pages"),
    ([*SERVE_BASE, "--cache-memory", "lots"], "--cache-memory"),
    ([*SERVE_BASE, "--num-pages", "8", "--cache-memory", "1GiB"], "--cache-memory"),
    ([*SERVE_BASE, "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ([*SERVE_BASE, "--max-model-len", "0"], "--max-model-len"),
    ([*SERVE_BASE, "--num-speculative-tokens", "-1"], "--num-speculative-tokens"),
    ([*SERVE_BASE, "--num-speculative-tokens", "2"], "--num-speculative-tokens"),  # without --drafter
    ([*SERVE_BASE, "--served-model-name", ""], "--served-model-name"),
    ([*SERVE_BASE, "--api-key", ""], "--api-key"),
    ([*SERVE_BASE, "--dtype", "bogus"], "--dtype"),
    ([*SERVE_BASE, "--device", "tpu"], "--device"),
    pytest.param([*SERVE_BASE, "--device", "cuda"], "--device", marks=pytest.mark.skipif(not NO_CUDA, reason="has CUDA")),
    ([*SERVE_BASE, "--backend", "fast"], "--backend"),
    ([*SERVE_BASE, "--shutdown-timeout", "-1"], "--shutdown-timeout"),
    ([*SERVE_BASE, "--log-level", "loud"], "--log-level"),
    ([*SERVE_BASE, "--drafter", "/nonexistent/drafter"], "--drafter"),
    ([*SERVE_BASE, "--threads", "0"], "--threads"),
    ([*SERVE_BASE, "--bogus"], "--bogus"),
]


@pytest.mark.parametrize("argv,flag", SERVE, ids=lambda v: " ".join(v[4:] or v) if isinstance(v, list) else None)
def test_serve_bad_flags(capsys, argv, flag):
    for m in ("fastapi", "uvicorn", "prometheus_client", "jinja2"):  # the serve extra (scripts/setup.sh installs it)
        pytest.importorskip(m)
    assert_one_line_error(*run(capsys, ["serve", *argv]), "serve", flag)


def test_every_serve_flag_is_in_the_table():
    _, subs = cli.build_parser()
    covered = {a for row in SERVE for a in (row.values[0] if hasattr(row, "values") else row[0]) if a.startswith("--")}
    flags = {s for a in subs["serve"]._actions for s in a.option_strings if s.startswith("--")}
    # switches, and values only the loaded checkpoint can judge (a hub revision, a chat template file or text)
    assert flags - {"--help", "--offline", "--no-access-log", "--revision", "--chat-template"} - covered == set()
