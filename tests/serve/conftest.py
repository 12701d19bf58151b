"""Fixtures of the k3nn serve tests (they need the serve extra: scripts/setup.sh installs it)."""

import pytest
import torch

from serve_helpers import CFG, VOCAB, write_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-ckpt")
    write_checkpoint(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from k3nn.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint, VOCAB)


@pytest.fixture(scope="session")
def model():
    from k3nn import KimiK3

    return KimiK3(CFG, dtype=torch.float64, seed=0).eval()


@pytest.fixture(scope="session")
def chat_template(checkpoint):
    from k3nn.serve import load_chat_template

    return load_chat_template(checkpoint)
