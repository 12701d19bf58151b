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


def test_engine_workload_with_speculation_preemption_and_aborts_matches_generate():
    """A random workload on the GPU kernels in fp32 (TF32 off): shared prefixes, a pool small enough to evict and
    preempt, aborts, a DSpark drafter on half the requests; every finished request equals generate()."""
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = KimiK3Config.tiny()
    model = KimiK3(cfg, seed=0).to("cuda").eval()
    drafter = DSparkDrafter(DSparkConfig.for_target(cfg, num_layers=1, num_heads=2, block_size=4), model,
                            device="cuda")
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, cfg.vocab_size, (200,), generator=g).tolist()
    prompts = [base[:int(torch.randint(20, 200, (1,), generator=g))] +
               torch.randint(0, cfg.vocab_size, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(40)]
    eng = Engine(model, EngineConfig(max_num_seqs=6, num_pages=8, num_snapshots=4, max_num_batched_tokens=160),
                 drafter=drafter)
    ids = [eng.add_request(p, max_new_tokens=24, num_speculative_tokens=4 * (i % 2)) for i, p in enumerate(prompts)]
    aborted = set(ids[3::9])
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 5:
            for i in aborted:
                eng.abort(i)
    for i, p in zip(ids, prompts):
        if i in aborted and eng.requests[i].finish_reason == "abort":
            continue
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=24, cuda_graph=False)[0, len(p):]
        assert eng.requests[i].output == ref.tolist(), i
    m = eng.metrics()
    assert m["spec_rounds"] > 0 and m["preemptions"] > 0
