"""The demo pipeline at toy size (corpus → BPE → K3 training → drafter → plain and speculative generation),
its cache reuse, and the pieces it is built from."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from k3nn import demo

STDLIB = Path(sysconfig.get_paths()["stdlib"])
needs_stdlib = pytest.mark.skipif(not any(STDLIB.glob("*.py")), reason="no Python standard library source here")
pytest.importorskip("tokenizers")


def _run(out: Path, *extra: str) -> int:
    n = torch.get_num_threads()
    try:
        return demo.main(["--size", "toy", "--out", str(out), "-q", "--threads", str(n),
                          "--max-new-tokens", "6", *extra])
    finally:
        torch.set_num_threads(n)


@needs_stdlib
def test_demo_end_to_end_and_reuse(tmp_path, capsys):
    assert _run(tmp_path) == 0
    first = capsys.readouterr().out
    for f in ("model/config.json", "model/tokenizer.json", "model/demo.json", "drafter/dspark_config.json",
              "results.json"):
        assert (tmp_path / f).is_file(), f
    assert list((tmp_path / "model").glob("*.safetensors"))
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["unigram_loss"] > 0 and res["heldout_loss"] > 0
    assert res["identical"] is True  # greedy speculative == plain greedy
    assert res["acceptance_length_heldout_greedy"] >= 1.0 and res["acceptance_length_heldout_sampled"] >= 1.0
    assert "[3/5] target: KimiK3" in first and "speculative greedy:" in first and "speculative sampled:" in first
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (tmp_path / "loss.png").stat().st_size > 1000

    # second run: same settings → the cached model and drafter are reused, not retrained
    assert _run(tmp_path) == 0
    second = capsys.readouterr().out
    assert "target: cached" in second and "drafter: cached" in second

    # the checkpoint is an ordinary one: k3nn generate finds its tokenizer.json
    from k3nn import cli

    assert cli.main(["generate", "--model", str(tmp_path / "model"), "--offline", "--prompt", "import os",
                     "--max-new-tokens", "3", "--drafter", str(tmp_path / "drafter")]) == 0
    err = capsys.readouterr().err
    assert "Generation: 3 tokens" in err and "acceptance length" in err


@needs_stdlib
def test_demo_without_drafter(tmp_path, capsys):
    assert _run(tmp_path, "--drafter-steps", "0", "--steps", "1") == 0
    out = capsys.readouterr().out
    assert "without speculative decoding" in out and not (tmp_path / "drafter").exists()


def test_reuse_without_cache_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no cached checkpoint"):
        _run(tmp_path, "--reuse")


@needs_stdlib
def test_corpus_split_is_by_file_and_stable():
    c = demo.load_corpus(max_train_mb=0.3, max_heldout_mb=0.1)
    train, held = {p for p, _ in c.train}, {p for p, _ in c.heldout}
    assert train and held and not train & held
    assert all(demo.is_heldout(p) for p in held) and not any(demo.is_heldout(p) for p in train)
    assert not any(part in ("test", "tests", "site-packages") for p in train | held for part in Path(p).parts)


def test_unigram_baseline():
    train = torch.tensor([0, 0, 0, 1])
    # add-one smoothing over a vocab of 2: p(0) = 4/6
    assert demo.unigram_loss(train, torch.tensor([0]), 2) == pytest.approx(-torch.tensor(4 / 6).log().item())


