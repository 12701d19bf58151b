"""Quantile Balancing: exact and histogram estimators, convergence on a skewed router, frozen bias at inference."""

import pytest
import torch
from hypothesis import given, note, strategies as st

from k3nn.config import KimiK3Config
from k3nn.layers.moe import MoE, route
from k3nn.training import QuantileBalancer, qb_bias_exact, qb_bias_histogram, topk_cutoffs


def _skewed_scores(m, n, g, skew=2.5):
    logits = torch.randn(m, n, generator=g) + torch.linspace(-skew, skew, n)  # expert n-1 is hugely favoured
    return logits.sigmoid()


def _loads(scores, bias, k):
    ids = (scores + bias).topk(k, -1)[1]
    return torch.bincount(ids.reshape(-1), minlength=scores.shape[1]).float()


def test_cutoffs_and_margins_definition():
    s = torch.tensor([[0.9, 0.8, 0.1, 0.5]])
    b = torch.tensor([0.0, -0.5, 0.0, 0.0])
    ids, alpha = topk_cutoffs(s, b, 2)
    assert sorted(ids[0].tolist()) == [0, 3] and alpha.item() == pytest.approx(0.3)  # biased: .9 .3 .1 .5


def test_exact_update_is_the_q_plus_1_largest_margin():
    g = torch.Generator().manual_seed(0)
    m, n, k = 64, 8, 2
    s, b = torch.rand(m, n, generator=g), 0.1 * torch.randn(n, generator=g)
    _, alpha = topk_cutoffs(s, b, k)
    M = s - alpha[:, None]
    q = m * k // n  # 16
    want = torch.stack([-M[:, j].sort(descending=True).values[q] for j in range(n)])
    assert torch.allclose(qb_bias_exact(s, b, k), want - want.mean())
    # with the cutoffs held fixed, each expert would now take exactly q tokens (s_ij + b̂_j > α_i ⇔ M_ij > −b̂_j)
    # (ties are real: every token whose (k+1)-th expert is j has margin exactly −b_j)
    assert ((M > -want[None, :]).sum(0) <= q).all() and ((M >= -want[None, :]).sum(0) >= q + 1).all()


@given(m=st.integers(40, 400), n=st.integers(3, 12), k=st.integers(1, 3), bins=st.sampled_from([200, 1000]),
       seed=st.integers(0, 2**31 - 1))
def test_histogram_within_one_bin_of_exact(m, n, k, bins, seed):
    k = min(k, n - 1)
    note(f"m={m} n={n} k={k} bins={bins}")
    g = torch.Generator().manual_seed(seed)
    s, b = _skewed_scores(m, n, g), 0.2 * torch.randn(n, generator=g)
    exact, hist = qb_bias_exact(s, b, k), qb_bias_histogram(s, b, k, bins)
    width = (2.0 + b.max().item() - b.min().item()) / bins
    assert (hist - exact).abs().max().item() <= 2 * width + 1e-6  # ≤ one bin, doubled by mean-centring


@pytest.mark.parametrize("mode", ["exact", "histogram"])
def test_skewed_router_converges_in_a_few_steps(mode):
    g = torch.Generator().manual_seed(1)
    m, n, k = 4096, 16, 2
    bias = torch.zeros(n)
    ratios = []
    for step in range(8):
        s = _skewed_scores(m, n, g)  # a fresh batch each step: route with the old bias, then update
        loads = _loads(s, bias, k)
        ratios.append((loads.max() / loads.min().clamp_min(1)).item())
        bias = qb_bias_exact(s, bias, k) if mode == "exact" else qb_bias_histogram(s, bias, k, 1000)
        assert abs(bias.mean().item()) < 1e-6
    assert ratios[0] > 50  # badly skewed to begin with (starved experts)
    assert ratios[1] < 3 and max(ratios[5:]) < 1.3, ratios  # 2615 → ~2 → … → ~1.2 (sampling noise)


def test_quantile_balancer_on_moe_layers_and_frozen_bias_at_inference():
    cfg = KimiK3Config.tiny(num_experts=8, num_experts_per_token=2)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        moe.gate.weight[0] += 0.5  # skew the router toward expert 0
    qb = QuantileBalancer([moe])
    x = torch.randn(512, cfg.hidden_size)
    before = moe.gate.e_score_correction_bias.clone()
    ids0, _ = moe.gate(x)
    moe(x)
    assert torch.equal(moe.gate.e_score_correction_bias, before)  # the forward itself never moves the bias
    qb.step()
    after = moe.gate.e_score_correction_bias.clone()
    assert not torch.equal(after, before) and abs(after.mean().item()) < 1e-6
    l0 = torch.bincount(ids0.reshape(-1), minlength=8)
    l1 = torch.bincount(moe.gate(x)[0].reshape(-1), minlength=8)
    assert l1.max() < l0.max()
    # inference: detach the balancer; the frozen bias changes no routing and is never updated
    qb.detach()
    moe.eval()
    full_ids, _ = route(moe.gate.logits(x), after, 2, True, 1.0)
    for _ in range(2):
        moe(x)
    qb.step()  # nothing recorded → nothing changes
    assert torch.equal(moe.gate.e_score_correction_bias, after)
    single = torch.cat([moe.gate(x[i:i + 1])[0] for i in range(0, 512, 37)])
    assert torch.equal(single.sort(-1).values, full_ids[::37].sort(-1).values)  # batch-independent routing


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k < num_experts"):
        qb_bias_exact(torch.rand(4, 3), torch.zeros(3), 3)
    with pytest.raises(ValueError, match="mode"):
        QuantileBalancer([], mode="ema")
