"""Speculative sampling preserves the target distribution (chi-square against exact marginals)."""

from __future__ import annotations

import pytest
import torch

from k3nn.generation import process_logits
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions, rejection_accept

from .helpers import tiny_target

V = 16
N_ROWS = 1200


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(vocab_size=V)
    drafter = DSparkDrafter(DSparkConfig.for_target(target.config, num_layers=1, num_heads=2, block_size=2,
                                                    markov_rank=8), target)
    with torch.no_grad():  # a drafter whose q clearly differs from p, so both accept and reject paths run
        g = torch.Generator().manual_seed(0)
        drafter.markov_proj.weight.normal_(0, 2.0, generator=g)
        drafter.confidence.weight.normal_(0, 1.0, generator=g)  # confidences spread around 0.5
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    return target, drafter, prompt


def _exact_marginals(target, prompt, temperature, top_k):
    """p(x1), p(x2), p(x3) of sampling after ``prompt`` (full forwards, every prefix enumerated)."""
    def probs(ids):
        lg = target(ids).logits[:, -1]
        return process_logits(lg, temperature, top_k).softmax(-1).double()

    with torch.no_grad():
        p1 = probs(prompt)[0]
        x1 = torch.arange(V)[:, None]
        p2c = probs(torch.cat([prompt.expand(V, -1), x1], 1))  # [x1, x2]
        p2 = (p1[:, None] * p2c).sum(0)
        x12 = torch.cartesian_prod(torch.arange(V), torch.arange(V))
        p3c = probs(torch.cat([prompt.expand(V * V, -1), x12], 1)).view(V, V, V)
        p3 = (p1[:, None, None] * p2c[:, :, None] * p3c).sum((0, 1))
    return p1, p2, p3


def _chi2_pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=V).double()
    exp = p * samples.numel()
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]]) if (~big).any() else counts[big]
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]]) if (~big).any() else exp[big]
    keep = exp_c > 0
    stat = ((obs_c[keep] - exp_c[keep]) ** 2 / exp_c[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("temperature,top_k,threshold", [(1.0, 0, 0.0), (0.7, 6, 0.0), (1.0, 0, 0.5)])
def test_speculative_sampling_matches_target_marginals(setup, temperature, top_k, threshold):
    """threshold > 0: the verify length stops at the first draft whose confidence (which depends on the sampled
    previous draft through the Markov embedding) is below it — still lossless."""
    target, drafter, prompt = setup
    drafter.spec_options = SpecOptions(confidence_threshold=threshold)
    out = target.generate(prompt.expand(N_ROWS, -1), max_new_tokens=4, do_sample=True, temperature=temperature,
                          top_k=top_k, seed=123, drafter=drafter, num_assistant_tokens=2)
    drafter.spec_options = None
    st = drafter.last_stats
    assert 0.05 < st.acceptance_rate < 0.95  # both the accept and the residual paths were exercised
    assert st.position_tried[1] > 0 and 0 < st.position_accepted[1] < st.position_tried[1]
    if threshold:  # the confidence cut removed some verifications at each position
        assert st.drafted < 2 * st.row_rounds and st.position_tried[1] < st.position_accepted[0]
    p1, p2, p3 = _exact_marginals(target, prompt, temperature, top_k)
    new = out[:, prompt.shape[1]:]
    for i, p in enumerate((p1, p2, p3)):
        assert _chi2_pvalue(new[:, i], p) > 1e-3, f"token {i + 1}"


def test_chi_square_detects_a_biased_sampler(setup):
    """The same check rejects blind acceptance of drafts (the draft distribution, not the target's)."""
    target, drafter, prompt = setup
    drafter.spec_options = SpecOptions(synthetic_acceptance_length=3)
    out = target.generate(prompt.expand(N_ROWS, -1), max_new_tokens=3, do_sample=True, seed=123,
                          drafter=drafter, num_assistant_tokens=2)
    drafter.spec_options = None
    _, p2, _ = _exact_marginals(target, prompt, 1.0, 0)
    assert _chi2_pvalue(out[:, prompt.shape[1] + 1], p2) < 1e-6


def test_rejection_rule_on_a_known_pair():
    """Target (0.7, 0.3), draft (0.5, 0.5): one verified draft; the emitted token is target-distributed, and
    accepting the draft happens with probability Σ min(p, q) = 0.8."""
    n = 200_000
    g = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([0.7, 0.3]).log().expand(n, 2, 2).clone()
    q = torch.tensor([0.5, 0.5]).expand(n, 1, 2).clone()
    drafts = torch.multinomial(q[:, 0], 1, generator=g)

    class Cfg:
        temperature, top_k, top_p = 1.0, 0, 1.0

    m, nxt = rejection_accept(p_logits, drafts, q, torch.ones(n, dtype=torch.long), Cfg, g)
    first = torch.where(m == 1, drafts[:, 0], nxt)
    assert abs(first.float().mean().item() - 0.3) < 0.005
    assert abs(m.float().mean().item() - 0.8) < 0.005
