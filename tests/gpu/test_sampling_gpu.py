"""GPU: a RequestSampler's processed scores (penalties from its device count tensors, min_tokens, warpers) and
verify windows run without a host sync and equal the CPU ones; choose() gives the CPU token for greedy requests
and repeats itself for a seed."""

import pytest
import torch

from k3nn.engine.request import SamplingParams
from k3nn.engine.sampling import RequestSampler

pytestmark = pytest.mark.gpu

V = 4096
KW = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=6, stop_token_ids=[7],
          max_new_tokens=32, logprobs=5)


def make(device, **kw):
    g = torch.Generator(device=device).manual_seed(1) if kw.get("do_sample") else None
    prompt = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    return RequestSampler(SamplingParams(**{**KW, **kw}), prompt, vocab_size=V, eos_ids=[3], device=device,
                          generator=g)


@pytest.mark.parametrize("do_sample", [False, True])
def test_scores_and_windows_without_host_syncs(do_sample):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    out = torch.randint(0, V, (9,), generator=g).tolist()
    drafts = torch.randint(0, V, (4,), generator=g)
    kw = dict(do_sample=do_sample, temperature=0.8, top_k=50, top_p=0.9)
    cpu, gpu = make("cpu", **kw), make("cuda", **kw)
    dl, dd = logits.cuda(), drafts.cuda()
    gpu.scores(dl[0], out[:4])  # warm-up: the first calls may allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s = [gpu.scores(dl[0], out[:i]) for i in (4, 5, 8)]  # one token, then several appended
        w = gpu.window_scores(dl, out, dd)
        w_list = gpu.window_scores(dl, out, drafts.tolist())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x, i in zip(s, (4, 5, 8)):
        torch.testing.assert_close(x.cpu(), cpu.scores(logits[0], out[:i]), rtol=1e-5, atol=1e-5)
    ref = cpu.window_scores(logits, out, drafts)
    torch.testing.assert_close(w.cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w_list.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_choose_on_the_gpu():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=g) * 4
    out = torch.randint(0, V, (10,), generator=g).tolist()
    tok, lp = make("cuda").choose(logits.cuda(), out)
    want, want_lp = make("cpu").choose(logits, out)
    assert tok == want and lp.rank == want_lp.rank and list(lp.top) == list(want_lp.top)
    assert lp.logprob == pytest.approx(want_lp.logprob, abs=1e-5)

    def run():
        s, seq = make("cuda", do_sample=True, temperature=0.9), []
        for i in range(16):
            seq.append(s.choose(logits.cuda() + i, seq)[0])
        return seq

    assert run() == run()
