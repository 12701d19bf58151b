"""GPU: the logits pipeline around the captured decode step — processors and warpers give the same tokens with and
without the CUDA graph, host-side processors keep the graph, the NaN / Inf guard (read at the sync points) names
the step, and the speculative graph round applies the history-free processors as its uncaptured round does."""

import pytest
import torch

from k3nn import KimiK3, KimiK3Config
from k3nn.layers.dspark import DSparkConfig, DSparkDrafter
from k3nn.spec import SpecOptions

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return KimiK3(KimiK3Config.tiny(), seed=0).to("cuda").eval()


def _ids(B=3, T=8, seed=0):
    return torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=6, eos_token_id=[5, 9]),
    dict(do_sample=True, seed=1, temperature=0.8, min_p=0.05, typical_p=0.9, bad_words_ids=[[7], [3, 4]]),
    dict(do_sample=True, seed=2, num_return_sequences=2),  # top_k = 50 by default
])
def test_processors_same_tokens_with_and_without_graph(model, kw):
    ids = _ids()
    a = model.generate(ids, max_new_tokens=20, cuda_graph=False, **kw)
    b = model.generate(ids, max_new_tokens=20, cuda_graph=True, **kw)
    assert model.last_decode_info["graph"], model.last_decode_info
    assert torch.equal(a, b)


def test_host_processors_keep_the_graph(model):
    ids = _ids(2)
    seen = []

    def proc(input_ids, scores):
        seen.append(input_ids.shape[1])
        return scores

    out = model.generate(ids, max_new_tokens=10, cuda_graph=True, logits_processor=[proc],
                         stopping_criteria=[lambda input_ids, scores: input_ids.shape[1] >= 8 + 7])
    assert model.last_decode_info["graph"]
    assert out.shape[1] == 8 + 7 and seen == list(range(8, 15))
    ref = model.generate(ids, max_new_tokens=7, cuda_graph=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_nonfinite_logits_raise_at_the_sync_point(model, cuda_graph):
    calls = {"n": 0}

    def poison(mod, args, out):  # call 1: prefill (step 0), 2: first decode step, 3: the graph capture
        calls["n"] += 1
        return out.fill_(float("nan")) if calls["n"] >= 3 else out

    h = model.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(FloatingPointError, match="step 2"):
            model.generate(_ids(2), max_new_tokens=40, cuda_graph=cuda_graph)
    finally:
        h.remove()


def test_speculative_graph_round_applies_min_new_tokens(model):
    drafter = DSparkDrafter(DSparkConfig.for_target(model.config, num_layers=1, block_size=4), model,
                            device="cuda").eval()
    ids = _ids(2, 9, 4)
    g = model.generate(ids, max_new_tokens=12, cuda_graph=False, eos_token_id=[])[:, 9:]
    eos = [int(g[0, 2]), int(g[1, 4])]
    kw = dict(max_new_tokens=12, eos_token_id=eos, min_new_tokens=6, bad_words_ids=[[int(g[0, 0])]],
              num_assistant_tokens=4)
    outs = {}
    for mode in ("static", True):
        drafter.spec_options = SpecOptions(cuda_graph=mode)
        outs[mode] = model.generate(ids, drafter=drafter, **kw)
    st = drafter.last_stats
    assert st.mode == "graph" and (st.graphs.get("accept") or st.graphs.get("round")), (st.graphs, st.fallback)
    assert torch.equal(outs["static"], outs[True])
    new = outs[True][:, 9:]
    assert not torch.isin(new[:, :6], torch.tensor(eos, device="cuda")).any()  # eos masked for 6 tokens
    assert not (new[0] == int(g[0, 0])).any()
