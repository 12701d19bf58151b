"""What the engine tests share: the tiny fp64 model, random prompts and uncached reference generations."""

import pytest
import torch

from k3nn import KimiK3, KimiK3Config

CFG = KimiK3Config.tiny()
_REFS: dict = {}


@pytest.fixture(scope="module")
def model():
    return KimiK3(CFG, dtype=torch.float64, seed=0).eval()


def rand_ids(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, prompt, n, **sampling):
    """Uncached generation: the model's own generate() on the contiguous cache (memoised)."""
    key = (tuple(prompt), n, tuple(sorted(sampling.items())))
    if key not in _REFS:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, **sampling)
        _REFS[key] = out[0, len(prompt):].tolist()
    return _REFS[key]
