"""The contiguous hybrid cache: its allocation (one fill per kind of KDA state, not one per layer) and reset."""

import torch

import bench.gpu.decode_launches as dl
from k3nn import KimiK3, KimiK3Config
from k3nn.cache import HybridCache
from k3nn.cache.hybrid import KDAState


def test_kda_states_share_two_buffers():
    """A fresh cache (what a short prompt's forward allocates inside the call) fills two buffers for every KDA
    layer's recurrent and conv state, two per MLA layer and two for the mask and the counters."""
    cfg = KimiK3Config.tiny(num_hidden_layers=8, mla_layers=[3, 7])
    with dl.AtenOps() as f:
        cache = HybridCache(cfg, 2, 16)
    kda = [st for st in cache.layers if isinstance(st, KDAState)]
    assert len(kda) == 6
    assert len({st.recurrent.untyped_storage().data_ptr() for st in kda}) == 1
    assert len({st.conv.untyped_storage().data_ptr() for st in kda}) == 1
    assert f.n["zeros"] == 2 + 2 * 2 + 2
    assert all(st.recurrent.is_contiguous() and st.conv.is_contiguous() for st in kda)


def test_reset_equals_a_fresh_cache():
    model = KimiK3(KimiK3Config.tiny(), seed=3)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(2, 12)
    with torch.no_grad():
        model(ids, cache=cache)
        cache.reset()
        again = model(ids, cache=cache).logits
        fresh = model(ids, cache=model.new_cache(2, 12)).logits
    assert torch.equal(again, fresh)
    assert int(cache.write_pos) == 0 and cache.valid_counts.tolist() == [9, 9]
