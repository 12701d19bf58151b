"""The engine's runtime: the graph-shaped (padded, static) decode step equals the eager one, seeded sampling does
not depend on the batch, a decode step's path reads nothing back to the host, stalls and pinned pages, the
prepared projections the engine runs."""

import pytest
import torch

import bench.gpu.decode_launches as dl
from k3nn import KimiK3
from k3nn.engine import Engine, EngineStalledError, RequestStatus

from engine_helpers import CFG, model, rand_ids, reference  # noqa: F401 - fixture
from test_engine_sampling import _engine
from test_engine_spec import GAMMA, OracleDrafter


@pytest.mark.parametrize("spec", [False, True])
def test_static_steps_equal_eager_steps(model, spec):
    """cuda_graphs="static" runs decode / verify rows as the captured steps do (padded to a graph batch size,
    padding rows on slot −1, metadata derived on the device) without capture: the same tokens as the eager
    steps and as generate(), greedy and seeded sampling; greedy verify windows accept through the graph-safe
    acceptance step."""
    prompts = [rand_ids(11 + 7 * i, 300 + i) for i in range(3)]
    refs = {tuple(p): reference(model, p, 9) for p in prompts}
    outs = {}
    for mode in (False, "static"):
        d = OracleDrafter(refs, 2) if spec else None
        e = _engine(model, d, cuda_graphs=mode, num_speculative_tokens=GAMMA if spec else None)
        accepts = []
        body = e.runner._greedy_accept_body
        e.runner._greedy_accept_body = lambda *a: accepts.append(1) or body(*a)
        greedy = e.generate(prompts, max_new_tokens=9)
        # greedy verify windows of the graph-shaped steps accept as the captured acceptance step does
        assert bool(accepts) == (spec and mode == "static")
        sampled = e.generate(prompts, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                             seed=5)
        outs[mode] = (greedy, sampled)
        assert greedy == [refs[tuple(p)] for p in prompts]
        if spec:
            assert e.metrics()["spec_rounds"] > 0
    assert outs[False] == outs["static"]


def test_seeded_samples_do_not_depend_on_the_batch(model):
    p = rand_ids(17, 310)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.0, top_p=0.95, seed=1234)
    alone = _engine(model).generate([p], **kw)[0]
    e = _engine(model)
    others = [e.add_request(rand_ids(5 + i, 320 + i), max_new_tokens=3 + i, do_sample=True) for i in range(3)]
    rid = e.add_request(p, **kw)
    list(e.stream())
    assert e.requests[rid].output == alone
    assert all(e.requests[o].status == RequestStatus.FINISHED for o in others)
    unseeded = [_engine(model).generate([p], max_new_tokens=8, do_sample=True)[0] for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # no seed: fresh randomness per request


def _k3nn_site(stack):
    """(file under k3nn/, line) of the innermost k3nn frame of ``stack``, None outside k3nn or inside its ops and
    kernels (argument checks that read CPU tensors; on a GPU the captured step runs the device kernels)."""
    for fr in reversed(stack):
        if "/k3nn/" in fr.filename:
            if "/k3nn/kernels/" in fr.filename or "/k3nn/ops/" in fr.filename:
                return None
            return fr.filename.split("/k3nn/")[-1], fr.lineno
    return None


class _Reads:
    """Counts the host reads of tensor values made by the runtime, the model, the layers and the caches while
    active: the Python methods (item / tolist / bool / int / float / nonzero) and, through a dispatch mode, the
    reads that C++ makes (``aten.item`` / ``aten._local_scalar_dense``: a tensor converted to a Python number, as
    when a 0-dim tensor indexes another). Op argument checks and eager kernels
    (``k3nn/ops``, ``k3nn/kernels``) are left out (tests/gpu checks the whole step under
    torch.cuda.set_sync_debug_mode("error"))."""

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero")

    def __enter__(self):
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        self.sites, self._orig = [], {}
        reads = self
        active = []  # a Python-level read in progress: its own _local_scalar_dense is not counted twice

        # a tensor read as a Python number: aten.item under inference mode, aten._local_scalar_dense otherwise
        scalar_ops = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)

        class Scalars(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in scalar_ops and not active:
                    site = _k3nn_site(traceback.extract_stack()[:-1])
                    if site is not None:
                        reads.sites.append(("scalar",) + site)
                return func(*args, **(kwargs or {}))

        for n in self.names:
            orig = getattr(torch.Tensor, n)
            self._orig[n] = orig

            def wrap(*a, __o=orig, __n=n, **k):
                site = _k3nn_site(traceback.extract_stack()[:-1])
                if site is not None:
                    self.sites.append((__n,) + site)
                active.append(1)
                try:
                    return __o(*a, **k)
                finally:
                    active.pop()

            setattr(torch.Tensor, n, wrap)
        self._mode = Scalars()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for n, f in self._orig.items():
            setattr(torch.Tensor, n, f)


def test_a_decode_step_reads_nothing_back(model):
    """The graph-shaped decode step (staging, metadata, the model, the LM head) has no host read: on a GPU it can
    be captured and never waits for the device. (The step's one read is the draws, after the forward.)"""
    from k3nn.engine.runner import RowWork

    e = _engine(model, cuda_graphs="static")
    ids = [e.add_request(rand_ids(9 + i, 330 + i), max_new_tokens=4) for i in range(2)]
    e.step()  # prefill
    reqs = [e.requests[i] for i in ids]
    rows = [RowWork(r, r.tokens_to_feed(1), decode=True, sample=True) for r in reqs]
    with torch.inference_mode(), _Reads() as reads:
        out = e.runner.forward(rows)
    assert reads.sites == []
    assert out.logits.shape == (2, CFG.vocab_size)


def test_prefill_steps_read_the_key_mask_only_when_a_key_can_be_masked(model):
    """MLA's prefill path reads its key mask back (to skip it when it hides nothing) only when a key can be masked:
    an engine prefill step whose rows all fill the gathered keys gets no mask from the paged cache (its host plan
    says so), and a contiguous cache that never saw padding passes none; a step that right-pads a row, and a
    left-padded contiguous cache, keep theirs."""

    def mla_reads(fn):
        with torch.inference_mode(), _Reads() as reads:
            fn()
        return [s for s in reads.sites if s[1] == "layers/mla.py"]

    for lens, masked in (((40, 40), False), ((40, 30), True)):
        e = _engine(model)
        for n in lens:
            e.add_request(rand_ids(n, 350 + n), max_new_tokens=2)
        assert bool(mla_reads(e.step)) == masked, lens
    ids = torch.tensor([rand_ids(30, 360)])
    assert not mla_reads(lambda: model(ids, cache=model.new_cache(1, 30)))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert mla_reads(lambda: model(ids, attention_mask=mask, cache=model.new_cache(1, 30)))


def test_step_reports_a_stall(model):
    """A caller looping on step() / has_unfinished() gets an error, not a spin, when nothing can progress."""
    e = _engine(model, num_pages=2)
    rid = e.add_request(rand_ids(60, 340), prefill_only=True)
    while e.requests[rid].status != RequestStatus.PREFILLED:
        e.step()
    e.add_request(rand_ids(100, 341), max_new_tokens=8)  # needs 2 pages, 1 is free while the export pins one
    with pytest.raises(EngineStalledError, match="prefilled"):
        for _ in range(5):
            if not e.has_unfinished():
                break
            e.step()
    e.release(rid)
    assert len(list(e.stream())) > 0


def test_pinned_pages_preempt_a_request_that_cannot_grow(model):
    """6 pages, 4 pinned by an exported request: a long running request that cannot grow is preempted, so a short
    one behind it still runs; the long one finishes once the export is released."""
    e = _engine(model, num_pages=6, enable_prefix_caching=False)
    pin = e.add_request(rand_ids(250, 350), prefill_only=True)  # 4 pages
    while e.requests[pin].status != RequestStatus.PREFILLED:
        e.step()
    long_p, short_p = rand_ids(100, 351), rand_ids(10, 352)
    big = e.add_request(long_p, max_new_tokens=60)
    small = e.add_request(short_p, max_new_tokens=5)
    for _ in range(200):
        e.step()
        if e.requests[small].status == RequestStatus.FINISHED:
            break
    assert e.requests[small].output == reference(model, short_p, 5)
    e.release(pin)
    list(e.stream())
    assert e.requests[big].output == reference(model, long_p, 60)


def test_speculative_tokens_are_bounded_by_the_fused_window(model):
    e = _engine(model, OracleDrafter({}, 0))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        e.add_request([1, 2, 3], max_new_tokens=4, num_speculative_tokens=e.runner.fused_max)


def test_prefill_rows_split_by_padding():
    """Prefill rows of very different lengths run as separate forwards (a short row would pad to the long rows'
    length); rows of near lengths share one; order kept within a group, groups in the order of their first row."""
    from k3nn.engine.runner import RowWork, padding_groups

    def rows(*ns):
        return [RowWork(i, [0] * n) for i, n in enumerate(ns)]

    def ids(groups):
        return [[w.req for w in g] for g in groups]

    assert ids(padding_groups(rows(2048, 2048, 2048, 4))) == [[0, 1, 2], [3]]
    assert ids(padding_groups(rows(4, 2048, 1900, 2048))) == [[0], [1, 2, 3]]
    assert ids(padding_groups(rows(100, 8000, 120, 3000))) == [[0, 2], [1], [3]]
    assert ids(padding_groups(rows(7))) == [[0]]
    assert padding_groups([]) == []
    for ns in ([5, 1, 9, 9, 2, 30, 31], [64] * 5, [1, 2, 3, 4, 5, 6]):
        groups = padding_groups(rows(*ns))
        assert sorted(w.req for g in groups for w in g) == list(range(len(ns)))  # every row once
        for g in groups:
            assert len(g) * max(w.num_new for w in g) <= 1.25 * sum(w.num_new for w in g) or len(g) == 1


def test_mixed_length_prefills_equal_generate(model):
    """Prompts of 60, 5 and 58 tokens admitted in one step run as two prefill forwards ([60, 58] and [5]) and
    decode as generate() does."""
    prompts = [rand_ids(60, 410), rand_ids(5, 411), rand_ids(58, 412)]
    e = _engine(model, cuda_graphs="static")
    ids = [e.add_request(p, max_new_tokens=5) for p in prompts]
    e.step()
    assert e.num_forwards == 2
    while e.has_unfinished():
        e.step()
    assert [e.requests[i].output for i in ids] == [reference(model, p, 5) for p in prompts]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_speculative_step_reads_the_host_once(model, asynchronous):
    """With a DSpark drafter (greedy), a decode step of verify windows in the graph-shaped mode drafts on the device,
    feeds the drafts to the verify forward there, accepts and commits, and reads the host once: the draws. With
    asynchronous scheduling the round's step reads nothing, and the next step launches the next round before it
    reads them."""
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    d = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA), model,
                      dtype=torch.float64)
    e = _engine(model, d, cuda_graphs="static", num_speculative_tokens=3, async_scheduling=asynchronous)
    prompts = [rand_ids(12 + i, 340 + i) for i in range(2)]
    ids = [e.add_request(p, max_new_tokens=12) for p in prompts]
    e.step()  # prefill
    with _Reads() as reads:
        e.step()
    if asynchronous:
        assert reads.sites == [] and e._ahead is not None and e.metrics()["spec_rounds"] == 0
        with _Reads() as reads:
            e.step()
        assert e._ahead is not None  # the next round, launched before this read
    assert e.metrics()["spec_rounds"] > 0
    where = "engine/overlap.py" if asynchronous else "engine/runner.py"
    assert [s[:2] for s in reads.sites] == [("tolist", where)], reads.sites
    while e.has_unfinished():
        e.step()
    assert [e.requests[i].output for i in ids] == [reference(model, p, 12) for p in prompts]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_rounds_that_export_a_boundary_state_read_the_host_once(model, asynchronous, monkeypatch):
    """A round whose commit exports the KDA state at the page boundary it may cross (decode-state retention) stays
    graph-safe: no step of the request reads the host beyond its draws. (On the H200 an export that could not be
    captured made every later capture fail too, and every round ran eagerly: tests/gpu asserts the captures.)"""
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    d = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA), model,
                      dtype=torch.float64)
    e = _engine(model, d, cuda_graphs="static", num_speculative_tokens=3, async_scheduling=asynchronous)
    exports = []
    export = e.runner._export_states
    monkeypatch.setattr(e.runner, "_export_states", lambda *a: exports.append(1) or export(*a))
    p = rand_ids(56, 360)
    rid = e.add_request(p, max_new_tokens=20)
    e.step()  # prefill
    draws = {("tolist", "engine/overlap.py"), ("tolist", "engine/runner.py")}  # the draws, deferred or not
    while e.has_unfinished():
        with _Reads() as reads:
            e.step()
        assert len(reads.sites) <= 1 and all(r[:2] in draws for r in reads.sites), reads.sites
    assert exports  # some rounds carried the export
    assert e.requests[rid].output == reference(model, p, 20)


def test_greedy_rounds_draft_on_the_device(model, monkeypatch):
    """Greedy decode rows with a DSpark drafter run as rounds: the drafter's step (from the staged step's block
    tables, cached counts and pending tokens) writes the drafts into the verify step's inputs, no host-side
    drafting; rows with fewer drafts (near their budget) or none (num_speculative_tokens=0) share the round;
    the output equals generate(). A sampling request drafts through the host path."""
    import k3nn.engine.engine as engine_mod
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    d = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA), model,
                      dtype=torch.float64)
    e = _engine(model, d, cuda_graphs="static", num_speculative_tokens=GAMMA)
    host_drafts, rounds = [], []
    host_draft = engine_mod.draft

    def counted(drafter, decodes, draft_len, *a):
        host_drafts.extend(r.request_id for r in decodes if draft_len(r))
        return host_draft(drafter, decodes, draft_len, *a)

    monkeypatch.setattr(engine_mod, "draft", counted)
    body = e.runner._draft_body
    e.runner._draft_body = lambda B, T, L: rounds.append((B, T, L)) or body(B, T, L)
    prompts = [rand_ids(15 + 6 * i, 350 + i) for i in range(3)]
    news = [11, 7, 9]
    ids = [e.add_request(p, max_new_tokens=n, num_speculative_tokens=0 if i == 2 else None)
           for i, (p, n) in enumerate(zip(prompts, news))]
    while e.has_unfinished():
        e.step()
    assert [e.requests[i].output for i in ids] == [reference(model, p, n) for p, n in zip(prompts, news)]
    assert rounds and not host_drafts
    assert {T for _, T, _ in rounds} == {1 + GAMMA}  # every round is as wide as the longest window
    assert e.requests[ids[0]].spec_rounds > 0 and e.requests[ids[2]].spec_rounds == 0
    e.generate([prompts[0]], max_new_tokens=4, do_sample=True, seed=3)
    assert host_drafts
    # warmup() captures each batch size's draft graphs for every key bucket a request can reach
    pool = e.pools.allocator.num_blocks * e.pools.block_size
    buckets = e.runner.draft_key_buckets(1)
    assert buckets[0] == e.pools.block_size and buckets[-1] >= min(pool, CFG.max_position_embeddings)
    assert all(b == 2 * a for a, b in zip(buckets, buckets[1:]))
    assert all(4 * L <= 2 * pool for L in e.runner.draft_key_buckets(4))
    assert _engine(model, cuda_graphs="static").runner.draft_key_buckets(1) == []


def test_draft_gathers_stay_within_the_key_budget(model):
    """The drafter's context gather is [B, L, 2·H·Dh] per layer (L: the bucket of the batch's longest row). Past
    ``context.max_keys`` keys (B · L; twice the pool's tokens) the step is no device round; the host path drafts
    the rows in runs by length that fit, and the output still equals generate()."""
    from k3nn.engine.speculative import PagedDraftContext
    from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

    d = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, num_heads=2, block_size=GAMMA), model,
                      dtype=torch.float64)
    e = _engine(model, d, cuda_graphs="static", num_speculative_tokens=GAMMA)
    ctx = e.drafter.context
    assert isinstance(ctx, PagedDraftContext)
    assert ctx.max_keys == 2 * e.pools.allocator.num_blocks * e.pools.block_size
    page = e.pools.block_size
    ctx.max_keys = 2 * page  # two pages of keys per gather: three rows of one page never share one
    assert ctx.batches([5, 30]) == [[0, 1]]
    assert ctx.batches([30, 5, 20]) == [[1, 2], [0]]  # by length, runs of two one-page rows
    assert ctx.batches([page + 1, 3]) == [[1], [0]]  # a two-page row alone
    rounds, sizes = [], []
    body, one = e.runner._draft_body, e.drafter._propose
    e.runner._draft_body = lambda B, T, L: rounds.append((B, T, L)) or body(B, T, L)
    e.drafter._propose = lambda rows, n: sizes.append(len(rows)) or one(rows, n)
    prompts = [rand_ids(9 + 5 * i, 410 + i) for i in range(3)]
    ids = [e.add_request(p, max_new_tokens=8) for p in prompts]
    while e.has_unfinished():
        e.step()
    assert [e.requests[i].output for i in ids] == [reference(model, p, 8) for p in prompts]
    assert not rounds and sizes and max(sizes) <= 2  # no device round (4 padded rows x one page), gathers of <= 2
    assert all(e.requests[i].spec_rounds > 0 for i in ids)


def test_warmup_prompt_lengths_cover_every_step_size_bucket():
    """warmup() on CUDA runs one prompt per power of two up to the step budget (the MoE kernels specialise on the
    power-of-two bucket of a step's pairs), within the model's context."""
    from k3nn.engine.warmup import warmup_prompt_lengths

    assert warmup_prompt_lengths(8192, 8200) == [1 << i for i in range(14)]
    assert warmup_prompt_lengths(8192, 4096)[-2:] == [2048, 4088]  # room for the warm-up's decode steps
    assert warmup_prompt_lengths(100, 10 ** 6) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert warmup_prompt_lengths(8192, 8) == []
    for budget in range(1, 300):
        lens = warmup_prompt_lengths(budget, 10 ** 6)
        # every step size n <= budget has a warmed length in its power-of-two bucket
        assert all(any(n <= m < 2 * n for m in lens) for n in range(1, budget + 1))
    # the page pool bounds them too (a longer prompt could never be admitted)
    assert warmup_prompt_lengths(8192, 8200, pool_tokens=45 * 64)[-2:] == [2048, 45 * 64 - 8]


def test_warmup_prompt_lengths_meet_every_moe_kernel_specialisation():
    """The MoE kernels also specialise on the alignment block size and on one-launch vs chunked alignment, whose
    boundaries are not powers of two: k3-tiny (8 experts, top-2) steps of 257-384 tokens take the chunked
    alignment with 32-row blocks, which no power-of-two step reaches (a compile on a request's path, seen on the
    GPU). The warm-up lengths include one step of every specialisation."""
    from k3nn.engine.warmup import warmup_prompt_lengths
    from k3nn.kernels.moe.align import ONE_LAUNCH_PAIRS
    from k3nn.kernels.moe.triton_fused import block_m_for, use_gemv

    for E, k, mx in [(8, 2, False), (128, 16, True), (896, 16, True), (64, 6, False)]:
        lens = warmup_prompt_lengths(8192, 10 ** 6, moe=(E, k, mx))
        assert lens == sorted(set(lens)) and lens[-1] == 8192

        def key(t):
            P = t * k
            return use_gemv(P, mx), block_m_for(P, E, mx), P <= ONE_LAUNCH_PAIRS, 1 << (P - 1).bit_length()

        warmed = {key(t) for t in lens}
        assert all(key(t) in warmed for t in range(1, 8193)), (E, k, mx)
    assert any(257 <= t <= 384 for t in warmup_prompt_lengths(8192, 10 ** 6, moe=(8, 2, False)))


def test_the_engine_prepares_the_model():
    """The Engine packs the model's projections (no copy): a decode step of K3's structure launches about half of
    what the unprepared layers did (the CPU proxy of bench/gpu/decode_launches.py: 37 per layer before), and the
    tokens are the same."""
    m = KimiK3(dl.k3_like_tiny(), seed=0).eval()
    launches, tokens = {}, {}
    for prepared in (False, True):
        eng = Engine(m, max_num_seqs=2, num_pages=32)
        assert m.decode_prepared
        if not prepared:
            m.prepare_decode(False)
        rid = eng.add_request(list(range(1, 40)), max_new_tokens=12, ignore_eos=True)
        for _ in range(4):
            eng.step()
        with torch.no_grad():
            launches[prepared] = sum(dl.count(eng.step, torch.device("cpu")).values())
        list(eng.stream())
        tokens[prepared] = eng.requests[rid].output
    L = m.config.num_hidden_layers
    assert launches[True] / L <= 22 < launches[False] / L
    assert tokens[True] == tokens[False]
