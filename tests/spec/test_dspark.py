"""DSparkDrafter: visibility rules, train/inference agreement, heads, save/load, the loss and the trainer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nn.layers.dspark import DSparkConfig, DSparkDrafter, default_target_layers
from k3nn.spec import DSparkTrainer, dspark_loss

from .helpers import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=64)


def _drafter(target, **kw):
    base = dict(num_layers=2, num_heads=2, block_size=4, markov_rank=8)
    base.update(kw)
    d = DSparkDrafter(DSparkConfig.for_target(target.config, **base), target)
    d.init_weights(seed=1, std=0.2)
    return d


def _taps(target, ids, drafter):
    with torch.no_grad():
        return target(ids, output_hidden_layers=drafter.target_layers).hidden_states


def test_default_taps():
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(4, 1) == [2]
    assert all(0 <= i < 93 - 1 for i in default_target_layers(93, 5))


@given(anchor=st.integers(1, 8), seed=st.integers(0, 1000))
def test_block_sees_only_context_before_the_anchor(target, anchor, seed):
    d = _drafter(target)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 63, (1, 12), generator=g)
    taps = _taps(target, ids, d)
    anchors = torch.tensor([[anchor]])
    base = d.forward_train(taps, ids, anchors)["hidden"]
    after = [t.clone() for t in taps]
    for t in after:
        t[:, anchor:] += torch.randn(t[:, anchor:].shape, generator=g)
    torch.testing.assert_close(d.forward_train(after, ids, anchors)["hidden"], base, rtol=0, atol=0)
    before = [t.clone() for t in taps]
    before[0][:, anchor - 1] += 1.0
    assert not torch.allclose(d.forward_train(before, ids, anchors)["hidden"], base)


def test_block_is_bidirectional_unless_causal(target):
    """Slot 0 depends on the later slots' positions (bidirectional); with causal_block it does not."""
    ids = torch.randint(0, 63, (1, 10), generator=torch.Generator().manual_seed(0))
    for causal in (False, True):
        d = _drafter(target, causal_block=causal)
        taps = _taps(target, ids, d)
        h4 = d.forward_train(taps, ids, torch.tensor([[5]]))["hidden"][0, 0]
        d.config.block_size = 2  # a shorter block: slot 0's keys change only through slots 2, 3
        h2 = d.forward_train(taps, ids, torch.tensor([[5]]))["hidden"][0, 0]
        d.config.block_size = 4
        assert torch.allclose(h4[:2], h2[:2], atol=1e-5) == causal


def test_training_forward_matches_inference(target):
    """forward_train's teacher-forced block == the cached inference path at the same anchor."""
    d = _drafter(target)
    ids = torch.randint(0, 63, (2, 11), generator=torch.Generator().manual_seed(2))
    taps = _taps(target, ids, d)
    anchor = 7
    tr = d.forward_train(taps, ids, torch.tensor([[anchor], [anchor]]))
    state = d.new_state(2, 16)
    d.extend(state, [t[:, :anchor] for t in taps], torch.arange(anchor).expand(2, anchor))
    h = d.block_hidden(state, ids[:, anchor], torch.full((2,), anchor), 4)
    torch.testing.assert_close(h, tr["hidden"][:, 0], rtol=1e-5, atol=1e-5)
    # greedy propose uses the same Markov-corrected logits: its first draft is the argmax of slot 0
    prop = d.propose(state, ids[:, anchor], torch.full((2,), anchor), 4)
    assert torch.equal(prop.tokens[:, 0], tr["logits"][:, 0, 0].argmax(-1))
    assert prop.confidence.shape == (2, 4) and ((prop.confidence > 0) & (prop.confidence < 1)).all()


def test_markov_head_biases_the_next_draft(target):
    """A Markov table that maps token t to t+1 with a large bias makes greedy drafts count upwards."""
    d = _drafter(target)
    with torch.no_grad():
        V, r = 64, 8
        d.markov_proj.weight.zero_()
        code = torch.arange(V) % r  # W1[t] = one-hot(t mod r); W2 puts +100 on every v with v ≡ t + 1 (mod r)
        d.markov_embed.weight.zero_()
        d.markov_embed.weight[torch.arange(V), code] = 1.0
        d.markov_proj.weight[torch.arange(V), (torch.arange(V) - 1) % r] = 100.0
    ids = torch.randint(0, 63, (1, 9), generator=torch.Generator().manual_seed(3))
    state = d.new_state(1, 16)
    d.extend(state, [t[:, :6] for t in _taps(target, ids, d)], torch.arange(6)[None])
    toks = d.propose(state, torch.tensor([16]), torch.tensor([6]), 4).tokens[0]
    assert toks[0] % r == (16 + 1) % r and all(int(toks[k + 1]) % r == (int(toks[k]) + 1) % r for k in range(3))


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_graph_safe_extend_and_propose_match_the_eager_ones(target, batch, causal):
    """Several speculative-like rounds: ``extend_at`` (device write position, no host sync) and the split
    ``draft_logits`` + ``markov_draft`` give bit-identical caches, drafts, probs and confidence to ``extend`` /
    ``propose`` (left-padded prompt, partial keeps, rejected tails overwritten by the next round)."""
    d = _drafter(target, causal_block=causal)
    G, cap, T0 = 4, 48, 6
    g = torch.Generator().manual_seed(5 + batch)
    ids = torch.randint(0, 63, (2, T0), generator=g)[:batch]
    m0 = torch.ones_like(ids, dtype=torch.bool)
    if batch == 2:
        m0[1, :2] = False  # left padding
    pos0 = (m0.long().cumsum(1) - 1).clamp_min(0)
    taps = _taps(target, ids, d)
    se, ss = d.new_state(batch, cap), d.new_state(batch, cap)
    d.extend(se, taps, pos0, m0, start=0)
    d.extend_at(ss, taps, pos0, m0, torch.tensor(0))
    start, valid = T0, m0.sum(1)
    anchor = ids[:, -1]
    sample = type("Cfg", (), dict(do_sample=True, temperature=0.8, top_k=0, top_p=1.0))()
    for r in range(5):
        eg = d.propose(se, anchor, valid.clone(), G)
        h, base = d.draft_logits(ss, anchor, valid.clone(), G)
        st = d.markov_draft(h, base, anchor)
        assert torch.equal(eg.tokens, st.tokens) and torch.equal(eg.confidence, st.confidence), r
        assert eg.probs is None and st.probs is None
        nc = d.markov_draft(h, base, anchor, confidence=False)  # no confidence head: the same drafts
        assert torch.equal(nc.tokens, st.tokens) and nc.confidence is None
        ge, gs = (torch.Generator().manual_seed(r) for _ in range(2))
        pe = d.propose(se, anchor, valid.clone(), G, sample, ge)
        ps = d.markov_draft(h, base, anchor, sample, gs)
        assert torch.equal(pe.tokens, ps.tokens) and torch.equal(pe.probs, ps.probs)
        assert torch.equal(pe.confidence, ps.confidence)
        # verify window [anchor, drafts]: each row keeps a different prefix
        keep = torch.randint(1, G + 2, (batch,), generator=g)
        j = torch.arange(G + 1)
        win_taps = [torch.randn(batch, G + 1, t.shape[-1], generator=g) for t in taps]
        pos, mask = valid[:, None] + j, j[None, :] < keep[:, None]
        d.extend(se, win_taps, pos, mask, start=start)
        d.extend_at(ss, win_taps, pos, mask, torch.tensor(start))
        for a, b in zip(se.k + se.v + [se.key_mask], ss.k + ss.v + [ss.key_mask]):
            assert torch.equal(a, b), r
        start += int(keep.max())
        assert se.length == start
        valid = valid + keep
        anchor = eg.tokens[torch.arange(batch), (keep - 1).clamp(max=G - 1)]


def test_block_attends_only_to_committed_context(target):
    """Full-capacity attention: keys past the committed context (stale rejected rows, never-written rows) do not
    change the block (bit for bit), and it matches attending over the committed prefix only."""
    d = _drafter(target)
    ids = torch.randint(0, 63, (2, 8), generator=torch.Generator().manual_seed(6))
    taps = _taps(target, ids, d)
    state = d.new_state(2, 24)
    d.extend(state, taps, torch.arange(8).expand(2, 8))
    anchor, apos = ids[:, -1], torch.full((2,), 8)
    h = d.block_hidden(state, anchor, apos, 4)
    for t in state.k + state.v:
        t[:, 8:] = torch.randn(t[:, 8:].shape) * 50  # masked garbage
    assert torch.equal(d.block_hidden(state, anchor, apos, 4), h)
    short = d.new_state(2, 8)
    d.extend(short, taps, torch.arange(8).expand(2, 8))
    torch.testing.assert_close(d.block_hidden(short, anchor, apos, 4), h, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(target, tmp_path):
    d = _drafter(target)
    d.save_pretrained(tmp_path)
    keys = set(d.state_dict())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    d2 = DSparkDrafter.from_pretrained(tmp_path, target)
    assert d2.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(v, d2.state_dict()[k]), k
    with pytest.raises(FileNotFoundError):
        DSparkDrafter.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="hidden"):
        DSparkDrafter(DSparkConfig(hidden_size=32, vocab_size=64, target_layers=[1]), target)


def test_loss_terms():
    g = torch.Generator().manual_seed(0)
    B, N, G, V = 2, 3, 4, 10
    t = torch.randn(B, N, G, V, generator=g)
    labels = torch.randint(0, V, (B, N, G), generator=g)
    conf = torch.randn(B, N, G, generator=g)
    out = dspark_loss(t, t, conf, labels)
    assert out["tv"] == 0 and torch.allclose(out["accept"], torch.ones(G))  # a perfect draft
    d = torch.randn(B, N, G, V, generator=g)
    valid = torch.ones(B, N, G, dtype=torch.bool)
    valid[0, 0, 1] = False  # invalidates slots 1.. of that block (cumulative)
    out = dspark_loss(d, t, conf, labels, valid)
    w = torch.exp(-torch.arange(G) / 4.0).expand(B, N, G).clone()
    w[0, 0, 1:] = 0
    l1 = (d.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    ce = torch.nn.functional.cross_entropy(d.reshape(-1, V), labels.reshape(-1), reduction="none").view(B, N, G)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf, (1 - l1 / 2).clamp(0, 1), reduction="none")
    exp = (0.1 * (w * ce).sum() + 0.9 * (w * l1).sum() + (w * bce).sum()) / w.sum()
    torch.testing.assert_close(out["loss"], exp)


def test_trainer_reduces_the_loss(target):
    torch.manual_seed(0)
    d = _drafter(target, num_layers=1)
    d.init_weights(seed=0)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    tr = DSparkTrainer(target, d, opt, num_anchors=6)
    ids = torch.randint(0, 63, (2, 16), generator=torch.Generator().manual_seed(4))
    first = tr.step(ids)["loss"]
    for _ in range(15):
        last = tr.step(ids)["loss"]
    assert last < 0.8 * first
    assert all(p.grad is None for p in target.parameters())
