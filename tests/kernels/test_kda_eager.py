"""The eager kda_chunk (chunk-parallel PyTorch) against the per-token reference, checkpoints and varlen included."""

import torch
from hypothesis import given, note
from hypothesis import strategies as st

from k3nn import backend, ops
from k3nn.kernels.kda.reference import kda_recurrent_reference


@given(lens=st.lists(st.integers(0, 40), min_size=1, max_size=3), H=st.integers(1, 2), K=st.sampled_from([4, 8]),
       V=st.sampled_from([4, 6]), varlen=st.booleans(), ncut=st.integers(0, 3), gate=st.sampled_from([0.1, 8.0]),
       seed=st.integers(0, 2**16))
def test_eager_chunk_matches_recurrent_reference(lens, H, K, V, varlen, ncut, gate, seed):
    g_ = torch.Generator().manual_seed(seed)
    if not varlen:
        lens = [max(1, lens[0])] * len(lens)
    note(dict(lens=lens, H=H, K=K, V=V, varlen=varlen))
    B, T = (1, sum(lens)) if varlen else (len(lens), lens[0])
    if T == 0:
        return
    r = lambda *s: torch.randn(*s, generator=g_, dtype=torch.float64)  # noqa: E731
    q, v = r(B, T, H, K), r(B, T, H, V)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, K, generator=g_, dtype=torch.float64) * gate  # gate 8: large decay
    beta = torch.rand(B, T, H, generator=g_, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist()) if varlen else None
    h0 = r(len(lens), H, K, V)
    cps = [sorted(torch.randint(0, L + 1, (ncut,), generator=g_).tolist()) for L in lens]
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, checkpoint_positions=cps)
    with backend("eager"):
        got = ops.kda_chunk(q, k, v, g, beta, **kw)
    want = kda_recurrent_reference(q, k, v, g, beta, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
