"""Vision for the multimodal Kimi models: MoonViT tower, patch merge, projector (see :mod:`k3nn.multimodal`).

``VisionConfig`` / ``MultimodalConfig`` (config.py), ``MoonViT`` and ``patch_merge`` (tower.py), ``GridLayout``
(layout.py: the batch's position taps, rotary positions, segments and merge order, built from grid_thw on the host
once per forward), 2D rotary (rope.py), varlen attention over packed patches with ``cu_seqlens`` (attention.py: eager
reference, SDPA per image length, one varlen flash launch on CUDA), ``PatchMergerProjector`` (projector.py).
"""

from .attention import Segments, cu_seqlens_from_grid, flash_unsupported, varlen_attention
from .config import MultimodalConfig, VisionConfig
from .layout import GridLayout
from .projector import PatchMergerProjector
from .rope import apply_rope_2d, rope_2d_angles, rope_2d_cis, rotate_pairs
from .tower import MoonViT, check_image_inputs, num_image_tokens, patch_merge

__all__ = ["VisionConfig", "MultimodalConfig", "MoonViT", "PatchMergerProjector", "patch_merge", "varlen_attention",
           "cu_seqlens_from_grid", "Segments", "flash_unsupported", "rope_2d_angles", "apply_rope_2d", "rope_2d_cis",
           "rotate_pairs", "check_image_inputs", "num_image_tokens", "GridLayout"]
