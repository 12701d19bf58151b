"""Speculative generation == plain greedy generation, for every acceptance pattern, eos, budget, padding."""

from __future__ import annotations

import pytest
import torch

from k3nn.spec import SpecOptions

from k3nn.layers.dspark import DSparkConfig, DSparkDrafter

from .helpers import OracleDrafter, structured_target, tiny_target

GAMMA = 4
N_NEW = 11


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 255, (2, 6), generator=g)


@pytest.fixture(scope="module")
def reference(target, prompt):
    return target.generate(prompt, max_new_tokens=N_NEW)


def _spec(target, prompt, ref_new, accept, rollback="replay", mask=None, n_new=N_NEW, gamma=GAMMA, **kw):
    lengths = prompt.shape[1] if mask is None else mask.sum(1)
    lengths = torch.as_tensor(lengths).expand(prompt.shape[0])
    d = OracleDrafter(ref_new, lengths, accept, target.config.vocab_size, kw.pop("confidence", None))
    d.spec_options = SpecOptions(rollback=rollback, confidence_threshold=kw.pop("threshold", 0.0))
    out = target.generate(prompt, max_new_tokens=n_new, drafter=d, num_assistant_tokens=gamma,
                          attention_mask=mask, **kw)
    return out, d


@pytest.mark.parametrize("rollback", ["replay", "slots"])
@pytest.mark.parametrize("accept", [(0, 0), (GAMMA, GAMMA), (1, 3), (0, GAMMA), (GAMMA - 1, 2)])
def test_greedy_identical_for_every_acceptance(target, prompt, reference, accept, rollback):
    out, d = _spec(target, prompt, reference[:, prompt.shape[1]:], accept, rollback)
    assert torch.equal(out, reference)
    st = d.last_stats
    if accept[0] == accept[1]:
        a = accept[0]
        assert st.position_accepted[: a] == st.position_tried[: a]
        if a < GAMMA:
            assert st.position_accepted[a] == 0 and st.position_tried[a] > 0


def test_acceptance_stats_match_the_schedule(target, prompt, reference):
    out, d = _spec(target, prompt, reference[:, prompt.shape[1]:], (2, 2), n_new=1 + 3 * 3)
    st = d.last_stats
    # 9 tokens after the prefill token at 3 per round: 3 rounds, each accepting 2 of 4 drafts
    assert st.rounds == 3 and st.accepted == 2 * 2 * 3 and st.acceptance_length == 3.0
    assert st.position_acceptance[:3] == [1.0, 1.0, 0.0]


def test_eos_inside_the_window(target, prompt, reference):
    new = reference[:, prompt.shape[1]:]
    eos = int(new[0, 5])  # row 0 stops mid-window; row 1 at its own first occurrence, if any
    plain = target.generate(prompt, max_new_tokens=N_NEW, eos_token_id=eos, pad_token_id=7)
    for accept in [(GAMMA, GAMMA), (2, GAMMA), (0, 1)]:
        out, _ = _spec(target, prompt, plain[:, prompt.shape[1]:], accept, eos_token_id=eos, pad_token_id=7)
        assert torch.equal(out, plain), accept


def test_all_rows_hit_eos_trims_like_generate(target, prompt, reference):
    new = reference[:, prompt.shape[1]:]
    eos = [int(new[0, 3]), int(new[1, 2])]
    plain = target.generate(prompt, max_new_tokens=N_NEW, eos_token_id=eos)
    assert plain.shape[1] < prompt.shape[1] + N_NEW
    out, _ = _spec(target, prompt, plain[:, prompt.shape[1]:], (GAMMA, GAMMA), eos_token_id=eos)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("n_new", [1, 2, GAMMA + 2, 2 * GAMMA + 1])
def test_max_new_tokens_inside_the_window(target, prompt, reference, n_new):
    out, _ = _spec(target, prompt, reference[:, prompt.shape[1]:], (GAMMA, GAMMA), n_new=n_new)
    assert torch.equal(out, reference[:, : prompt.shape[1] + n_new])


def test_left_padded_batch(target):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 255, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=9)
    out, _ = _spec(target, ids, ref[:, 7:], (GAMMA, 1), mask=mask, n_new=9)
    assert torch.equal(out, ref)


def test_streamer_sees_the_same_columns(target, prompt, reference):
    class Rec:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, t):
            self.puts.append(t.clone())

        def end(self):
            self.ended = True

    plain, spec = Rec(), Rec()
    ref = target.generate(prompt, max_new_tokens=N_NEW, streamer=plain)
    out, _ = _spec(target, prompt, ref[:, prompt.shape[1]:], (3, 1), streamer=spec)
    assert torch.equal(out, ref) and spec.ended
    assert len(spec.puts) == len(plain.puts)
    for a, b in zip(spec.puts, plain.puts):
        assert torch.equal(a, b)


def test_confidence_truncation_stays_identical(target, prompt, reference):
    # confidence drops below 0.5 at slot 2: only 2 drafts per round are verified although 4 would match
    out, d = _spec(target, prompt, reference[:, prompt.shape[1]:], (GAMMA, GAMMA),
                   confidence=[0.9, 0.8, 0.3, 0.9], threshold=0.5, n_new=10)
    assert torch.equal(out, reference[:, :16])
    st = d.last_stats
    assert st.position_tried[2:] == [0, 0] and st.acceptance_length == 3.0


def test_synthetic_acceptance_length(target, prompt, reference):
    d = OracleDrafter(reference[:, prompt.shape[1]:], torch.tensor([6, 6]), (0, 0), target.config.vocab_size)
    d.spec_options = SpecOptions(synthetic_acceptance_length=3)
    out = target.generate(prompt, max_new_tokens=1 + 3 * 3, drafter=d, num_assistant_tokens=GAMMA)
    st = d.last_stats
    assert out.shape == (2, 6 + 10) and st.rounds == 3 and st.acceptance_length == 3.0
    assert st.position_acceptance[:3] == [1.0, 1.0, 0.0]


def test_zero_new_tokens_is_an_error(target, prompt):
    # transformers 5 and the Engine refuse max_new_tokens=0; generate() with a drafter too
    d = OracleDrafter(prompt, torch.tensor([6, 6]), (0, 0), target.config.vocab_size)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        target.generate(prompt, max_new_tokens=0, drafter=d)


@pytest.mark.parametrize("rollback", ["replay", "slots"])
def test_dspark_drafter_end_to_end_greedy(rollback):
    """The real drafter (target hidden states as context, Markov head) with real, partial acceptance."""
    target = structured_target()
    drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, num_heads=2, block_size=GAMMA,
                                                    markov_rank=16), target)
    drafter.spec_options = SpecOptions(rollback=rollback)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 255, (2, 6), generator=g)
    ref = target.generate(ids, max_new_tokens=14)
    out = target.generate(ids, max_new_tokens=14, drafter=drafter, num_assistant_tokens=GAMMA)
    assert torch.equal(out, ref)
    st = drafter.last_stats
    assert 0 < st.accepted < st.drafted and 1.0 < st.acceptance_length < GAMMA + 1


# -- the graph-safe ("static") round: fixed windows of γ + 1, device-side acceptance / commit ------------------
def _spec_static(target, prompt, ref_new, accept, cuda_graph="static", **kw):
    out, d = _spec(target, prompt, ref_new, accept, **kw)  # eager (cuda_graph defaults to auto → eager on CPU)
    assert d.last_stats.mode == "eager"
    lengths = prompt.shape[1] if kw.get("mask") is None else kw["mask"].sum(1)
    d2 = OracleDrafter(ref_new, torch.as_tensor(lengths).expand(prompt.shape[0]), accept,
                       target.config.vocab_size)
    d2.spec_options = SpecOptions(cuda_graph=cuda_graph)
    kw2 = {k: v for k, v in kw.items() if k not in ("mask",)}
    n_new = kw2.pop("n_new", N_NEW)
    out2 = target.generate(prompt, max_new_tokens=n_new, drafter=d2, num_assistant_tokens=kw2.pop("gamma", GAMMA),
                           attention_mask=kw.get("mask"), **kw2)
    assert d2.last_stats.mode == "static"
    return out, d, out2, d2


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("accept", [(0, 0), (GAMMA, GAMMA), (1, 3), (0, GAMMA), (GAMMA - 1, 2)])
def test_static_round_identical_to_eager_and_plain(target, prompt, reference, accept, batch):
    p, ref = prompt[:batch], reference[:batch]
    out, d, out2, d2 = _spec_static(target, p, ref[:, p.shape[1]:], accept[:batch])
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    a, b = d.last_stats, d2.last_stats
    assert (a.rounds, a.drafted, a.accepted, a.position_tried, a.position_accepted) == \
        (b.rounds, b.drafted, b.accepted, b.position_tried, b.position_accepted)


@pytest.mark.parametrize("batch", [1, 2])
def test_static_round_eos_inside_the_window(target, prompt, reference, batch):
    p = prompt[:batch]
    new = reference[:batch, p.shape[1]:]
    eos = int(new[0, 5])
    plain = target.generate(p, max_new_tokens=N_NEW, eos_token_id=eos, pad_token_id=7)
    for accept in [(GAMMA, GAMMA), (2, GAMMA), (0, 1)]:
        out, _, out2, _ = _spec_static(target, p, plain[:, p.shape[1]:], accept[:batch], eos_token_id=eos,
                                       pad_token_id=7)
        assert torch.equal(out, plain) and torch.equal(out2, plain), accept


def test_static_round_all_rows_hit_eos(target, prompt, reference):
    new = reference[:, prompt.shape[1]:]
    eos = [int(new[0, 3]), int(new[1, 2])]
    plain = target.generate(prompt, max_new_tokens=N_NEW, eos_token_id=eos)
    _, _, out2, _ = _spec_static(target, prompt, plain[:, prompt.shape[1]:], (GAMMA, 1), eos_token_id=eos)
    assert torch.equal(out2, plain)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("n_new", [1, 2, GAMMA + 2, 2 * GAMMA + 1])
def test_static_round_max_new_tokens_inside_the_window(target, prompt, reference, n_new, batch):
    p = prompt[:batch]
    _, _, out2, _ = _spec_static(target, p, reference[:batch, p.shape[1]:], (GAMMA, 2)[:batch], n_new=n_new)
    assert torch.equal(out2, reference[:batch, : p.shape[1] + n_new])


def test_static_round_left_padded_batch_and_streamer(target):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 255, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=9)
    _, _, out2, _ = _spec_static(target, ids, ref[:, 7:], (GAMMA, 1), mask=mask, n_new=9)
    assert torch.equal(out2, ref)

    class Rec:
        def __init__(self):
            self.puts = []

        def put(self, t):
            self.puts.append(t.clone())

        def end(self):
            pass

    a, b = Rec(), Rec()
    target.generate(ids, attention_mask=mask, max_new_tokens=9, streamer=a)
    d = OracleDrafter(ref[:, 7:], mask.sum(1), (3, 1), target.config.vocab_size)
    d.spec_options = SpecOptions(cuda_graph="static")
    target.generate(ids, attention_mask=mask, max_new_tokens=9, drafter=d, num_assistant_tokens=GAMMA, streamer=b)
    assert len(a.puts) == len(b.puts) and all(torch.equal(x, y) for x, y in zip(a.puts, b.puts))


def test_static_round_confidence_and_synthetic_acceptance(target, prompt, reference):
    d = OracleDrafter(reference[:, prompt.shape[1]:], torch.tensor([6, 6]), (GAMMA, GAMMA),
                      target.config.vocab_size, confidence=[0.9, 0.8, 0.3, 0.9])
    d.spec_options = SpecOptions(confidence_threshold=0.5, cuda_graph="static")
    out = target.generate(prompt, max_new_tokens=10, drafter=d, num_assistant_tokens=GAMMA)
    assert torch.equal(out, reference[:, :16])
    assert d.last_stats.position_tried[2:] == [0, 0] and d.last_stats.acceptance_length == 3.0
    d = OracleDrafter(reference[:, prompt.shape[1]:], torch.tensor([6, 6]), (0, 0), target.config.vocab_size)
    d.spec_options = SpecOptions(synthetic_acceptance_length=3, cuda_graph="static")
    out = target.generate(prompt, max_new_tokens=1 + 3 * 3, drafter=d, num_assistant_tokens=GAMMA)
    st = d.last_stats
    assert out.shape == (2, 16) and st.rounds == 3 and st.acceptance_length == 3.0


def test_static_round_dspark_drafter_and_slots_fallback():
    target = structured_target()
    drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, num_heads=2, block_size=GAMMA,
                                                    markov_rank=16), target)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 255, (2, 6), generator=g)
    ref = target.generate(ids, max_new_tokens=14)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    assert torch.equal(target.generate(ids, max_new_tokens=14, drafter=drafter, num_assistant_tokens=GAMMA), ref)
    assert drafter.last_stats.mode == "static" and 0 < drafter.last_stats.accepted
    drafter.spec_options = SpecOptions(cuda_graph="static", rollback="slots")
    assert torch.equal(target.generate(ids, max_new_tokens=14, drafter=drafter, num_assistant_tokens=GAMMA), ref)
    assert drafter.last_stats.mode == "eager" and "slots" in drafter.last_stats.fallback
    drafter.spec_options = SpecOptions(cuda_graph="bogus")
    with pytest.raises(ValueError):
        target.generate(ids, max_new_tokens=3, drafter=drafter, num_assistant_tokens=GAMMA)


def test_graph_round_control_flow_with_emulated_capture(target, prompt, reference, monkeypatch):
    """The CUDA-graph round's control flow on the CPU with an emulated capture (see :func:`_emulate_capture`); a
    drafter without the graph-safe methods keeps drafting eagerly."""
    _emulate_capture(monkeypatch)
    p, ref = prompt[:2], reference[:2]
    d = OracleDrafter(ref[:, p.shape[1]:], torch.as_tensor(p.shape[1]).expand(2), (1, 3), target.config.vocab_size)
    out = target.generate(p, max_new_tokens=N_NEW, drafter=d, num_assistant_tokens=GAMMA)
    assert torch.equal(out, ref)
    st = d.last_stats
    assert st.mode == "graph" and st.fallback is None and st.graphs["verify"] and st.graphs["accept"], st
    assert "draft" not in st.graphs and "extend" not in st.graphs


class _EagerDrafter:
    """Wraps a DSparkDrafter behind the plain drafter interface only (no graph-safe methods): the static round
    then runs its eager propose / extend."""

    def __init__(self, drafter, options):
        self.d, self.spec_options, self.last_stats = drafter, options, None
        self.target_layers = drafter.target_layers

    def new_state(self, batch_size, capacity):
        return self.d.new_state(batch_size, capacity)

    def extend(self, *a, **kw):
        return self.d.extend(*a, **kw)

    def propose(self, *a, **kw):
        return self.d.propose(*a, **kw)


def _dspark(target):
    return DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, num_heads=2, block_size=GAMMA,
                                                 markov_rank=16), target)


def _stats_tuple(st):
    return (st.rounds, st.row_rounds, st.drafted, st.accepted, st.position_tried, st.position_accepted)


def _padded_ids(batch):
    ids = torch.randint(0, 255, (2, 7), generator=torch.Generator().manual_seed(8))[:batch]
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("sample", [False, True])
def test_static_round_graph_safe_drafter_matches_its_eager_calls(batch, sample):
    """The static round with the graph-safe drafter steps (draft_logits / markov_draft / extend_at on persistent
    buffers) drafts exactly what the eager propose / extend draft: same tokens, same acceptance pattern."""
    target = structured_target()
    drafter = _dspark(target)
    ids, mask = _padded_ids(batch)
    kw = dict(max_new_tokens=15, num_assistant_tokens=GAMMA, attention_mask=mask)
    if sample:
        kw.update(do_sample=True, temperature=0.7, seed=11)
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=15)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    out = target.generate(ids, drafter=drafter, **kw)
    wrapped = _EagerDrafter(drafter, SpecOptions(cuda_graph="static"))
    out2 = target.generate(ids, drafter=wrapped, **kw)
    assert torch.equal(out, out2)
    if not sample:
        assert torch.equal(out, ref)
    a, b = drafter.last_stats, wrapped.last_stats
    assert a.mode == b.mode == "static" and _stats_tuple(a) == _stats_tuple(b)
    assert 0 < a.accepted < a.drafted


def _emulate_capture(monkeypatch):
    """CUDA-graph capture emulated on the CPU: the capture pass runs the function once, a replay re-runs it and
    copies into the captured outputs, as a replay rewrites a graph's static outputs."""
    import k3nn.spec.generate as G
    import k3nn.spec.session as S

    def copy_into(dst, src):
        if dst is None:  # a step without outputs (the KDA commits, the drafter's extend)
            return
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
        else:
            for a, b in zip(dst, src):
                copy_into(a, b)

    def call(self):
        self.calls += 1
        if not self.capture or self.fallback_reason is not None:
            return self.fn()
        if self.graph is not None:
            copy_into(self.out, self.fn())
            return self.out
        if self.calls == 1:
            return self.fn()
        self.out, self.graph = self.fn(), "emulated"
        return self.out

    monkeypatch.setattr(S.GraphStep, "__call__", call)
    monkeypatch.setattr(G, "_resolve_mode", lambda want, dev: "graph" if want is not False and want != "static"
                        else "static")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("sample", [False, True])
def test_graph_round_captures_the_drafter_steps(monkeypatch, batch, sample):
    """Emulated capture with the DSpark drafter: greedy, the whole round is one captured step (Markov heads,
    acceptance, fused KDA commit and extension included); sampling, the draft backbone, verify and extend steps are
    captured, the heads and the acceptance eager. The round gives the static round's tokens and stats."""
    _emulate_capture(monkeypatch)
    target = structured_target()
    drafter = _dspark(target)
    ids, mask = _padded_ids(batch)
    kw = dict(max_new_tokens=15, num_assistant_tokens=GAMMA, attention_mask=mask)
    if sample:
        kw.update(do_sample=True, temperature=0.7, seed=11)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    ref = target.generate(ids, drafter=drafter, **kw)
    ref_stats = drafter.last_stats
    drafter.spec_options = SpecOptions(cuda_graph=True)
    out = target.generate(ids, drafter=drafter, **kw)
    st = drafter.last_stats
    assert torch.equal(out, ref) and _stats_tuple(st) == _stats_tuple(ref_stats)
    assert st.mode == "graph" and st.fallback is None, st
    if sample:  # the drafter's backbone and extension captured, the heads and the acceptance eager
        assert st.graphs == {"draft": True, "verify": True, "extend": True}, st.graphs
    else:  # greedy: draft, verify, acceptance, KDA commit and extension are one captured step
        assert st.graphs == {"round": True}, st.graphs
    assert st.rounds >= 4  # the drafter steps are replayed, not only captured
    if not sample:
        assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=15))


def test_eager_backend_runs_the_graph_round_uncaptured(monkeypatch):
    """The eager kernels cannot be captured: on CUDA, asking for graphs with the eager backend runs the same
    graph-safe round without capture (no capture attempt that could leave the CUDA context unusable)."""
    import k3nn
    import k3nn.spec.generate as G

    cuda = torch.device("cuda")
    m = structured_target()  # eager backend
    assert G.eager_backend_on_cuda(m, cuda) and not G.eager_backend_on_cuda(m, torch.device("cpu"))
    m.backend = None
    with k3nn.backend("triton"):
        assert not G.eager_backend_on_cuda(m, cuda)
    _emulate_capture(monkeypatch)
    monkeypatch.setattr(G, "eager_backend_on_cuda", lambda model, dev: True)
    target = structured_target()
    drafter = _dspark(target)
    ids, mask = _padded_ids(1)
    kw = dict(max_new_tokens=12, num_assistant_tokens=GAMMA, attention_mask=mask)
    drafter.spec_options = SpecOptions(cuda_graph="static")
    ref = target.generate(ids, drafter=drafter, **kw)
    drafter.spec_options = SpecOptions(cuda_graph=True)
    out = target.generate(ids, drafter=drafter, **kw)
    st = drafter.last_stats
    assert torch.equal(out, ref)
    assert st.mode == "static" and "not capturable" in st.fallback and not any(st.graphs.values()), st


@pytest.mark.parametrize("accept", [(0, GAMMA), (1, 3)])
def test_batched_rounds_reclaim_the_holes_of_rejected_drafts(target, accept):
    """Rows that keep fewer window tokens than the longest row leave masked holes; the eager loop packs them away
    (the cache holds prompt + answer + one window + a fixed slack, not (γ + 1)× the answer) and the tokens stay
    those of plain greedy decoding."""
    from k3nn.spec.generate import HOLE_SLACK

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 255, (2, 5), generator=g)
    n_new = 160
    ref = target.generate(prompt, max_new_tokens=n_new)
    made = []
    orig = target.new_cache
    target.new_cache = lambda B, L: made.append(L) or orig(B, L)
    try:
        out, d = _spec(target, prompt, ref[:, 5:], accept, n_new=n_new, cuda_graph=False)
    finally:
        del target.new_cache
    assert torch.equal(out, ref)
    assert d.last_stats.compactions > 0
    assert made == [5 + n_new + GAMMA + 2 + HOLE_SLACK]
