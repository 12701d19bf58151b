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


def _k3_tiny_engine(**config):
    cfg = KimiK3Config.tiny(**config)
    model = KimiK3(cfg, seed=0).to("cuda", torch.bfloat16).eval()
    return model, Engine(model, EngineConfig(max_num_seqs=8, num_pages=1024, num_snapshots=16,
                                             max_num_batched_tokens=8192))


def test_captured_decode_steps_equal_eager_steps_and_never_sync():
    """After warmup() the decode steps replay CUDA graphs: the tokens equal the eager engine's (same bf16
    kernels, padded batch), and a warm decode forward runs under torch.cuda.set_sync_debug_mode("error")."""
    from k3nn.engine.runner import RowWork

    model, eng = _k3_tiny_engine()
    info = eng.warmup(prompt_len=32)
    assert eng.runner.graphs.graphs and not eng.runner.graphs.failed, eng.runner.graphs.failed
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 77)]
    graphed = eng.generate(prompts, max_new_tokens=12)
    eager = Engine(model, EngineConfig(max_num_seqs=8, num_pages=1024, num_snapshots=16, cuda_graphs=False))
    assert eager.generate(prompts, max_new_tokens=12) == graphed
    ids = [eng.add_request(p, max_new_tokens=4) for p in prompts]
    eng.step()  # prefill
    reqs = [eng.requests[i] for i in ids]
    rows = [RowWork(r, r.tokens_to_feed(1), decode=True, sample=True) for r in reqs]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            out = eng.runner.forward(rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.graphed and torch.isfinite(out.logits).all()
    del info


def test_no_compile_after_warmup_on_random_lengths():
    """50 requests after warmup(): random prompt lengths (100..8K, within the model's context), random prefix
    hits, mixed concurrency. No Triton compilation on a request's path; p99 TTFT within 2x of the same requests run
    again (warm)."""
    import random

    from bench.serving import CompileCounter

    import time

    model, eng = _k3_tiny_engine(max_position_embeddings=8192 + 8)  # the preset's 4096 refuses the longest
    t0 = time.perf_counter()
    eng.warmup(prompt_len=256)
    print(f"warmup {time.perf_counter() - t0:.1f} s", flush=True)
    rng = random.Random(0)
    V = model.config.vocab_size
    base = [rng.randrange(V) for _ in range(8192)]
    work = []
    for i in range(50):
        n = rng.randrange(100, 8192)
        hit = rng.random() < 0.4
        p = base[:n] if hit else [rng.randrange(V) for _ in range(n)]
        work.append(p)

    def run():
        ttft, k = [], 0
        while k < len(work):
            c = rng.choice([1, 1, 2, 4])
            ids = [eng.add_request(p, max_new_tokens=4, ignore_eos=True) for p in work[k:k + c]]
            list(eng.stream())
            ttft += [eng.requests[i].first_token_time - eng.requests[i].arrival_time for i in ids]
            k += c
        return ttft

    t0 = time.perf_counter()
    with CompileCounter() as cc:
        first = run()
    t1 = time.perf_counter()
    again = run()
    print(f"first pass {t1 - t0:.1f} s, again {time.perf_counter() - t1:.1f} s", flush=True)
    assert cc.count == 0, (sorted(set(cc.names)), cc.reprs)
    assert not eng.runner.graphs.failed, eng.runner.graphs.failed  # no step fell back to eager
    p99 = sorted(first)[int(0.99 * len(first))]
    p99_warm = sorted(again)[int(0.99 * len(again))]
    print(f"TTFT p99 first {p99 * 1e3:.1f} ms, again {p99_warm * 1e3:.1f} ms")
    assert p99 <= 2 * p99_warm


def test_async_scheduling_equals_the_synchronous_engine():
    """EngineConfig.async_scheduling on the GPU (captured decode graphs, pinned copies of the draws): a workload
    with staggered lengths, an eos stop, seeded sampling and an abort in flight gives every request the tokens of
    the synchronous engine, and steps were launched before the previous step's tokens were read."""
    from k3nn.engine.overlap import OverlapSteps

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = KimiK3Config.tiny()
    model = KimiK3(cfg, seed=0).to("cuda").eval()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 33, 120, 5, 64)]
    lookaheads = []
    launch = OverlapSteps._launch_deferred
    OverlapSteps._launch_deferred = lambda e, b, feed=None, **kw: ((feed is not None and lookaheads.append(len(b)))
                                                                   or launch(e, b, feed, **kw))
    try:
        outs = {}
        for mode in (False, True):
            eng = Engine(model, EngineConfig(max_num_seqs=4, num_pages=64, num_snapshots=4,
                                             async_scheduling=mode))
            eng.warmup(prompt_len=32)
            ids = [eng.add_request(p, max_new_tokens=8 + 5 * i, seed=i, do_sample=bool(i % 2), temperature=0.9,
                                   eos_token_id=[7])
                   for i, p in enumerate(prompts)]
            steps = 0
            while eng.has_unfinished():
                eng.step()
                steps += 1
                if steps == 6:
                    eng.abort(ids[1])
            outs[mode] = [eng.requests[i].output for i in ids if i != ids[1]]  # the aborted one: a timing matter
            assert not eng.runner.graphs.failed, eng.runner.graphs.failed  # no step fell back to eager
    finally:
        OverlapSteps._launch_deferred = launch
    assert outs[True] == outs[False]
    assert lookaheads


def test_async_rounds_equal_the_synchronous_engine(monkeypatch):
    """Greedy speculative rounds on the GPU (captured draft and round graphs, pinned copies of the draws), each
    launched before the last round's acceptance is read: the synchronous engine's tokens and plain greedy decoding's,
    with windows that accept none to all of their drafts and an eos inside a window; a follow-up turn over prompt +
    answer reuses the prefix cache as after plain decoding (the rounds exported the page-boundary state)."""
    from k3nn.engine.overlap import OverlapSteps
    from k3nn.engine.speculative import DSparkEngineDrafter
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = KimiK3Config.tiny()
    model = KimiK3(cfg, seed=0).to("cuda").eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 70, 33, 120)]
    news = [40, 25, 60, 33]
    ecfg = dict(max_num_seqs=4, num_pages=64, num_snapshots=16)

    def run(eng, **kw):
        ids = [eng.add_request(p, max_new_tokens=n, **kw) for p, n in zip(prompts, news)]
        while eng.has_unfinished():
            eng.step()
        return [eng.requests[i].output for i in ids]

    plain_engine = Engine(model, EngineConfig(**ecfg))
    plain = run(plain_engine)
    turn = prompts[2] + plain[2] + [1, 2, 3]  # a follow-up turn: the answer crosses the page boundary at 64

    def turn_cost(eng):  # prompt tokens the follow-up turn computes (the rest came from the prefix cache)
        before = eng.metrics()["computed_prompt_tokens"]
        ids = eng.add_request(turn, max_new_tokens=4)
        while eng.has_unfinished():
            eng.step()
        return eng.requests[ids].output, eng.metrics()["computed_prompt_tokens"] - before

    plain_turn = turn_cost(plain_engine)
    next_of = torch.randint(0, cfg.vocab_size, (cfg.vocab_size,), generator=g)
    for i, (p, out) in enumerate(zip(prompts, plain)):
        seq = p[-1:] + out
        for k, (a, b) in enumerate(zip(seq, seq[1:])):
            if (k + i) % 6:  # every sixth draft wrong
                next_of[a] = b
    next_of = next_of.cuda()

    class Bigram(DSparkEngineDrafter):  # greedy rounds draft from the bigram table, on the device
        def step_drafts(self, tables, cached, anchor, n, L):
            out, t = [], anchor
            for _ in range(n):
                t = next_of[t]
                out.append(t)
            return torch.stack(out, 1)

    dcfg = DSparkConfig.for_target(cfg, num_layers=1, num_heads=2, block_size=4)
    shifted = []
    launch = OverlapSteps._launch_deferred
    monkeypatch.setattr(OverlapSteps, "_launch_deferred", lambda e, b, feed=None, **kw: (
        (kw.get("shift") is not None and shifted.append(len(b))) or launch(e, b, feed, **kw)))
    outs, stats = {}, {}
    eos = plain[2][30]
    for mode in (False, True):
        drafter = Bigram(DSparkDrafter(dcfg, model, device="cuda"), 64, 64, "cuda")
        eng = Engine(model, EngineConfig(**ecfg, num_speculative_tokens=4, async_scheduling=mode), drafter=drafter)
        eng.warmup(prompt_len=32)
        outs[mode] = run(eng)
        # every round ran from a captured graph, the variants with the boundary export included
        assert not eng.runner.graphs.failed, eng.runner.graphs.failed
        assert any(k[-1] == "boundary" for k in eng.runner.graphs.graphs if isinstance(k, tuple)), mode
        # the rounds exported the answer's page-boundary state (captured variant with the export): the follow-up
        # turn reuses the prefix cache as after plain decoding
        assert turn_cost(eng) == plain_turn, mode
        outs[mode] += run(eng, eos_token_id=eos)
        m = eng.metrics()
        stats[mode] = (m["spec_rounds"], m["spec_accepted"])
    assert outs[True] == outs[False]
    assert outs[True][:4] == plain and outs[True][6] == plain[2][:plain[2].index(eos) + 1]
    assert shifted and stats[True][1] > stats[True][0], (len(shifted), stats)
