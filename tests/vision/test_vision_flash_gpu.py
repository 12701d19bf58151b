"""GPU: the vision attention's varlen flash backend against the eager fp32 reference (bf16 / fp16, MoonViT's head
widths, images of different lengths packed in one launch, empty segments), and the tower in bf16 on ``"auto"``
(flash) against the same tower on ``"eager"``; the tower's grid layout on the GPU (one copy, the CPU layout's values)
and a mixed-size forward with a CPU grid that never waits for the GPU."""

import pytest
import torch
from hypothesis import given, note, strategies as st

from k3nn import KimiK3ForConditionalGeneration, MultimodalConfig
from k3nn.vision import Segments, flash_unsupported, varlen_attention
from k3nn.vision.attention import resolve_backend
from k3nn.vision.layout import GridLayout

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@given(lengths=st.lists(st.integers(0, 1500), min_size=1, max_size=6), heads=st.sampled_from([1, 12, 16]),
       dim=st.sampled_from([72, 128, 64]), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**31 - 1))
def test_flash_varlen_matches_eager(lengths, heads, dim, dtype, seed):
    note(f"lengths={lengths} heads={heads} dim={dim} dtype={dtype}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    L = sum(lengths)
    qkv = torch.randn(L, 3, heads, dim, generator=g, device="cuda").to(dtype)
    q, k, v = qkv.unbind(1)
    assert flash_unsupported(q, k, v) is None and resolve_backend("auto", q, k, v) == "flash"
    seg = Segments.from_bounds([0, *torch.tensor(lengths).cumsum(0).tolist()], "cuda")
    out = varlen_attention(q, k, v, seg, backend="flash")
    ref = varlen_attention(q.float(), k.float(), v.float(), seg, backend="eager")
    assert out.dtype == dtype and out.shape == v.shape
    if L and max(lengths):
        assert _rel(out, ref) < 1e-2


def test_tower_bf16_flash_matches_eager():
    m = KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=0).to("cuda", torch.bfloat16).eval()
    grid = torch.tensor([[1, 8, 12], [1, 2, 2], [2, 6, 4], [1, 16, 16]])
    px = torch.randn(int(grid.prod(-1).sum()), 3, 4, 4, device="cuda").bfloat16()
    tower = m.vision_tower
    with torch.inference_mode():
        tower.attn_backend = "auto"
        fast = tower(px, grid)
        tower.attn_backend = "eager"
        ref = tower(px, grid)
        tower.attn_backend = "auto"
    assert _rel(fast, ref) < 2e-2


GRID = torch.tensor([[1, 28, 28], [1, 14, 20], [2, 32, 18], [1, 8, 8], [1, 14, 20]])


def test_layout_on_the_gpu_holds_the_cpu_layout():
    cfg = MultimodalConfig.tiny().vision_config
    cpu, gpu = GridLayout.build(GRID, cfg), GridLayout.build(GRID, cfg, "cuda")
    for name in ("pos_index", "pos_weight", "rope_pos", "rope_freqs", "merge_index", "merge_frames"):
        a, b = getattr(cpu, name), getattr(gpu, name)
        assert b.device.type == "cuda" and b.dtype == a.dtype and torch.equal(b.cpu(), a), name
    assert gpu.segments.bounds == cpu.segments.bounds and torch.equal(gpu.segments.cu_seqlens.cpu(),
                                                                      cpu.segments.cu_seqlens)


def test_a_mixed_batch_forward_with_a_cpu_grid_never_syncs():
    """grid_thw from the processor stays on the CPU: the layout goes over in one non-blocking copy and nothing in
    the forward reads the device back."""
    m = KimiK3ForConditionalGeneration(MultimodalConfig.tiny(), seed=0).to("cuda", torch.bfloat16).eval()
    tower = m.vision_tower
    px = torch.randn(int(GRID.prod(-1).sum()), 3, 4, 4, device="cuda").bfloat16()
    with torch.inference_mode():
        ref = tower(px, GRID)  # warm-up (kernel selection, caches)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = tower(px, GRID)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out, ref)
