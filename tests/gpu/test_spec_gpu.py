"""GPU: speculative rounds replayed from CUDA graphs (verify, accept, KDA commit, drafter draft/extend) give the
same tokens and statistics as the same graph-safe round run without capture, and every step is captured."""

import pytest
import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions

pytestmark = pytest.mark.gpu
GAMMA = 5


@pytest.fixture(scope="module")
def pair():
    cfg = KimiK3Config.tiny()
    target = KimiK3(cfg, seed=0).to("cuda").eval()  # fp32: replay and eager execution agree bit for bit
    dcfg = DSparkConfig.for_target(cfg, num_layers=1, block_size=GAMMA)
    return target, DSparkDrafter(dcfg, target, device="cuda").eval()


def _run(target, drafter, ids, mode, **opts):
    drafter.spec_options = SpecOptions(cuda_graph=mode, **opts)
    out = target.generate(ids, max_new_tokens=3 * GAMMA + 4, drafter=drafter, num_assistant_tokens=GAMMA)
    return out, drafter.last_stats


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("synthetic", [None, 5])
def test_graph_rounds_equal_static_rounds(pair, B, synthetic):
    target, drafter = pair
    ids = torch.randint(0, 256, (B, 9), generator=torch.Generator().manual_seed(B)).cuda()
    a, sa = _run(target, drafter, ids, "static", synthetic_acceptance_length=synthetic)
    b, sb = _run(target, drafter, ids, True, synthetic_acceptance_length=synthetic)
    assert sb.mode == "graph" and sb.fallback is None, (sb.graphs, sb.fallback)
    assert sb.graphs.get("round") or (sb.graphs.get("verify") and sb.graphs.get("draft")), sb.graphs
    assert torch.equal(a, b)
    assert (sa.rounds, sa.drafted, sa.accepted) == (sb.rounds, sb.drafted, sb.accepted)


@pytest.mark.parametrize("synthetic", [None, 3])
def test_kept_graph_round_serves_other_lengths_and_budgets(pair, synthetic):
    """The session's round is captured in the first call and replayed by the next ones, whose prompt lengths and
    budgets differ (device scalars, not values baked into the graph): each call equals its own static round."""
    from k3nn.spec import clear_sessions

    target, drafter = pair
    g = torch.Generator().manual_seed(5)
    calls = [(torch.randint(0, 256, (2, T0), generator=g).cuda(), n) for T0, n in [(9, 19), (5, 11), (12, 23)]]
    refs = []
    for ids, n in calls:
        drafter.spec_options = SpecOptions(cuda_graph="static", synthetic_acceptance_length=synthetic)
        refs.append((target.generate(ids, max_new_tokens=n, drafter=drafter, num_assistant_tokens=GAMMA),
                     drafter.last_stats))
    clear_sessions(drafter)
    drafter.spec_options = SpecOptions(cuda_graph=True, synthetic_acceptance_length=synthetic)
    for i, ((ids, n), (ref, rs)) in enumerate(zip(calls, refs)):
        out = target.generate(ids, max_new_tokens=n, drafter=drafter, num_assistant_tokens=GAMMA)
        st = drafter.last_stats
        assert st.mode == "graph" and st.fallback is None and st.session_calls == i + 1, st
        assert torch.equal(out, ref), (i, out, ref)
        assert (st.rounds, st.drafted, st.accepted) == (rs.rounds, rs.drafted, rs.accepted)
