"""GPU: the engine's decode steps read MLA pages in place (ops.mla_decode, Triton) and prefill through SDPA; its
greedy tokens equal generate()'s, fp32 (where the two paths agree to rounding, far from argmax ties)."""

import pytest
import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.engine import Engine, EngineConfig
from k3nn.layers import mla

pytestmark = pytest.mark.gpu


def test_engine_paged_decode_matches_generate(monkeypatch):
    cfg = KimiK3Config.tiny()
    model = KimiK3(cfg, seed=0).to("cuda").eval()
    calls = []
    orig = mla.ops.mla_decode
    monkeypatch.setattr(mla.ops, "mla_decode", lambda *a, **k: calls.append(1) or orig(*a, **k))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 70, 33)]
    eng = Engine(model, EngineConfig(max_num_seqs=4, num_pages=64, num_snapshots=4))
    ids = [eng.add_request(p, max_new_tokens=6) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    monkeypatch.setattr(mla.ops, "mla_decode", orig)
    ref = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, cuda_graph=False)[0, len(p):].tolist()
           for p in prompts]
    assert calls, "the engine's decode steps did not go through ops.mla_decode"
    assert [eng.requests[i].output for i in ids] == ref
