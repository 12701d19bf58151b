"""MoonViT: the vision tower of Kimi K2.5 (MoonViT3d) and Kimi K3 (MoonViT-V2), over variable-resolution images.

Shapes: L patches of all images packed end to end (no padding), C channels, p the patch size, D the tower width,
H heads of width Dh (H·Dh may differ from D: K3), N images or clips with grids (t, h, w) in patches.

    pixel_values [L, C, p, p] ──Conv2d(p, stride p)──► x [L, D]                   (one patch → one vector)
    x += P(h, w) ⊕ T(t)                           learned grid P [H0, W0, D] resampled (bicubic / bilinear) to
                                                  each image's h×w; for clips (t > 1) a fixed sin/cos T per frame
    block ×num_hidden_layers:
        x += W_o · Attn(RoPE2D(q), RoPE2D(k), v),   [q; k; v] = W_qkv Norm0(x)      (varlen over cu_seqlens)
        x += fc1 · act(fc0 · Norm1(x))
    x = FinalNorm(x)                              [L, D] patch features
    merge: each kh×kw block of a frame → one token; clips averaged over their t frames
                                                  → [Σ_n (h_n/kh)(w_n/kw), kh·kw, D]

Parameter names follow Moonshot's checkpoints (``vision_tower.patch_embed.proj``, ``…pos_emb.weight``,
``vision_tower.encoder.blocks.{i}.wqkv``, ``.wo``, ``.norm0``, ``.norm1``, ``.mlp.fc0``, ``.mlp.fc1``,
``vision_tower.encoder.final_layernorm``); the q/k rows of ``wqkv`` are in Moonshot's rotary-pair order
(:mod:`k3nn.vision.rope`). Matches transformers' ``Kimi_K25VisionModel`` (``pooler_output``) on converted weights.

Everything that depends on the grids (the resampling taps of P, the frame rows of T, the rotary positions, the
segments, the merge order) is built on the host once per forward as a :class:`~k3nn.vision.layout.GridLayout` and
sent to the device in one copy: each step above is one op over the whole packed batch, whatever the image sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import BACKENDS, Segments, varlen_attention
from .config import VisionConfig
from .init import init_standard_
from .layout import GridLayout, merge_index, merge_patches
from .rope import rope_2d_angles_at, rope_2d_cis, rotate_pairs

__all__ = ["MoonViT", "PatchEmbed", "LearnedPosEmb", "VisionBlock", "VisionEncoder", "patch_merge",
           "check_image_inputs", "num_image_tokens"]


def _activation(name: str):
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unknown activation {name!r}")


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    if cfg.norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=1e-5 if cfg.norm_eps is None else cfg.norm_eps)
    return nn.RMSNorm(dim, eps=cfg.norm_eps)


def sincos_table(num_frames: int, dim: int) -> torch.Tensor:
    """[num_frames, dim] fp32: frame f → [sin(f·ω), cos(f·ω)], ω_i = 10000^(-2i/dim)."""
    omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ang = torch.arange(num_frames, dtype=torch.float32)[:, None] * omega
    return torch.cat([ang.sin(), ang.cos()], -1)


def check_image_inputs(pixel_values, grid_thw, cfg: VisionConfig, pixels_name: str = "pixel_values",
                       grid_name: str = "image_grid_thw") -> None:
    """Raise a ValueError naming the argument when ``pixel_values`` [L, C, p, p] and ``grid_thw`` [N, 3] disagree
    with each other or with the tower."""
    if (pixel_values is None) != (grid_thw is None):
        given, missing = (pixels_name, grid_name) if grid_thw is None else (grid_name, pixels_name)
        raise ValueError(f"{given} was given without {missing}: pass both (the processor returns both)")
    if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
        raise ValueError(f"{pixels_name} must be a floating-point tensor, got "
                         f"{getattr(pixel_values, 'dtype', type(pixel_values).__name__)}")
    p, C = cfg.patch_size, cfg.num_channels
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (C, p, p):
        raise ValueError(f"{pixels_name} must be patches [num_patches, {C}, {p}, {p}] (as the Kimi K2.5 processor "
                         f"makes them), got shape {tuple(pixel_values.shape)}")
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dtype.is_floating_point or grid_thw.dim() != 2 \
            or grid_thw.shape[-1] != 3:
        raise ValueError(f"{grid_name} must be an integer tensor [num_images, 3] of (t, h, w) patch grids, got "
                         f"{getattr(grid_thw, 'shape', type(grid_thw).__name__)}")
    g = grid_thw.tolist()
    if not g:
        raise ValueError(f"{grid_name} is empty (no images)")
    kh, kw = cfg.merge_kernel_size
    for n, (t, h, w) in enumerate(g):
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"{grid_name}[{n}] = {(t, h, w)}: every entry must be positive")
        if h % kh or w % kw:
            raise ValueError(f"{grid_name}[{n}] = {(t, h, w)}: h and w must be multiples of the merge kernel "
                             f"{(kh, kw)}")
        if t > cfg.pos_emb_time:
            raise ValueError(f"{grid_name}[{n}] = {(t, h, w)}: a clip has at most pos_emb_time = {cfg.pos_emb_time} "
                             f"frames")
    total = sum(t * h * w for t, h, w in g)
    if total != pixel_values.shape[0]:
        raise ValueError(f"{grid_name} describes {total} patches (Σ t·h·w over {len(g)} images) but {pixels_name} "
                         f"holds {pixel_values.shape[0]}")


def num_image_tokens(grid_thw: torch.Tensor, merge_kernel_size) -> list[int]:
    """Tokens each image or clip takes in the text: (h/kh)·(w/kw) (a clip's frames are averaged into one)."""
    kh, kw = merge_kernel_size
    return [(h // kh) * (w // kw) for _, h, w in grid_thw.tolist()]


class LearnedPosEmb(nn.Module):
    """``weight`` [H0, W0, D] learned; resampled to each image's grid; sin/cos per frame for clips.

    ``forward`` adds both through the layout's taps as one weighted gather (``F.embedding_bag``, fp32) over all
    patches; ``grid`` is the reference it matches (``F.interpolate`` per image size)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))
        self.mode = cfg.pos_emb_interpolation
        self.register_buffer("time_weight", sincos_table(cfg.pos_emb_time, cfg.hidden_size), persistent=False)

    def grid(self, h: int, w: int) -> torch.Tensor:
        """[h·w, D]: the learned grid itself when the sizes match, else resampled (align_corners=False)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        g = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.mode, align_corners=False)
        return g[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, x: torch.Tensor, layout: GridLayout) -> torch.Tensor:
        """x [L, D] + (the resampled grid, + the frame's row of the sin/cos table in a clip), summed in fp32."""
        table = self.weight.flatten(0, 1)
        if layout.has_clips:
            table = torch.cat([table, self.time_weight.to(table.dtype)])
        pos = F.embedding_bag(layout.pos_index, table.float(), per_sample_weights=layout.pos_weight, mode="sum")
        return x + pos.to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size,
                              bias=cfg.patch_embed_bias)
        self.pos_emb = LearnedPosEmb(cfg)

    def forward(self, pixel_values: torch.Tensor, layout: GridLayout) -> torch.Tensor:
        """pixel_values [L, C, p, p] → [L, D]. A p×p convolution at stride p over one p×p patch is one matrix
        product over the patch's C·p·p values: computed as that GEMM (``proj`` keeps the checkpoint's Conv2d
        layout)."""
        w = self.proj.weight
        x = F.linear(pixel_values.to(w.dtype).flatten(1), w.flatten(1), self.proj.bias)
        return self.pos_emb(x, layout)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.fc1 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(self.act(self.fc0(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: varlen bidirectional attention with 2D RoPE, then the MLP."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.norm0 = _norm(cfg, cfg.hidden_size)
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.attn_width, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.attn_width, cfg.hidden_size, bias=cfg.attn_bias)
        self.norm1 = _norm(cfg, cfg.hidden_size)
        self.mlp = VisionMLP(cfg)
        #: one of :data:`k3nn.vision.attention.BACKENDS` (see :func:`k3nn.vision.attention.varlen_attention`):
        #: "auto" runs the varlen flash kernel where it can (CUDA, fp16 / bf16) and SDPA elsewhere
        self.attn_backend = "auto"

    def attention(self, x: torch.Tensor, segments: Segments, cis: torch.Tensor) -> torch.Tensor:
        """x [L, D] → [L, D]; ``cis`` [L, 1, Dh/2] the rotations (:func:`k3nn.vision.rope.rope_2d_cis`)."""
        qkv = self.wqkv(x).unflatten(-1, (3, self.num_heads, self.head_dim))  # [L, 3, H, Dh]
        q, k = rotate_pairs(qkv[:, :2].transpose(0, 1), cis)  # q and k rotated in one pass, each [L, H, Dh] dense
        o = varlen_attention(q, k, qkv[:, 2], segments, self.head_dim ** -0.5, backend=self.attn_backend)
        return self.wo(o.flatten(1))

    def forward(self, x: torch.Tensor, segments: Segments, cis: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm0(x), segments, cis)
        return x + self.mlp(self.norm1(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = _norm(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, layout: GridLayout) -> torch.Tensor:
        """The rotations are computed once here for every block from the layout's positions (no host reads)."""
        cis = rope_2d_cis(rope_2d_angles_at(layout.rope_pos, layout.rope_freqs))
        for blk in self.blocks:
            x = blk(x, layout.segments, cis)
        return self.final_layernorm(x)


def patch_merge(x: torch.Tensor, grid_thw: torch.Tensor, merge_kernel_size) -> torch.Tensor:
    """x [Σ t·h·w, D] (raster order per frame) → [Σ (h/kh)·(w/kw), kh·kw, D]: each kh×kw block of patches becomes one
    token, its patches in raster order within the block; a clip's t frames are averaged (fp32). One gather over all
    images (:func:`k3nn.vision.layout.merge_index`)."""
    kh, kw = merge_kernel_size
    index, frames = merge_index(grid_thw.cpu(), (kh, kw))
    frames = None if frames is None else frames.to(x.device)
    return merge_patches(x, index.to(x.device), frames, kh * kw)


class MoonViT(nn.Module):
    """The vision tower: ``forward(pixel_values, grid_thw)`` → merged patch features [Σ tokens, kh·kw, D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    @property
    def attn_backend(self) -> str:
        """The encoder's attention implementation (:func:`~k3nn.vision.attention.varlen_attention`'s
        ``backend``): "auto" (default), "eager", "sdpa" or "flash"; setting it sets every block's."""
        return self.encoder.blocks[0].attn_backend if len(self.encoder.blocks) else "auto"

    @attn_backend.setter
    def attn_backend(self, value: str) -> None:
        if value not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {value!r}")
        for blk in self.encoder.blocks:
            blk.attn_backend = value

    def layout(self, grid_thw: torch.Tensor) -> GridLayout:
        """The batch's index tensors on the tower's device (:class:`~k3nn.vision.layout.GridLayout`); grid_thw is
        read on the host once here (a copy back if it lives on the device), never in the layers."""
        return GridLayout.build(grid_thw.cpu(), self.config, self.patch_embed.proj.weight.device)

    def patch_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[L, C, p, p] → [L, D] after the final norm (before merging)."""
        return self.encode(pixel_values, self.layout(grid_thw))

    def encode(self, pixel_values: torch.Tensor, layout: GridLayout) -> torch.Tensor:
        """:meth:`patch_features` on a layout built already."""
        return self.encoder(self.patch_embed(pixel_values, layout), layout)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [L, C, p, p] (the processor's patches, images one after another) and grid_thw [N, 3] int
        (each image's (t, h, w) patch grid) → merged features [Σ_n (h/kh)(w/kw), kh·kw, D] in the tower's dtype,
        ready for the projector. Bad inputs raise a ValueError naming the argument."""
        if isinstance(grid_thw, torch.Tensor):
            grid_thw = grid_thw.cpu()  # the one host read of the grid (the processor's grid is on the CPU already)
        check_image_inputs(pixel_values, grid_thw, self.config)
        layout = self.layout(grid_thw)
        x = self.encode(pixel_values, layout)
        return merge_patches(x, layout.merge_index, layout.merge_frames, layout.merge_size)

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator, std: float = 0.02) -> None:
        """normal(0, std) weights, zero biases, unit norms; the learned grid normal(0, 1) like Moonshot's."""
        for mod in self.modules():
            if init_standard_(mod, gen, std):
                continue
            if isinstance(mod, LearnedPosEmb):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen))
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the derived (non-persistent) buffers: needed after building on the meta device."""
        t = self.patch_embed.pos_emb.time_weight
        t.copy_(sincos_table(*t.shape).to(t.device, t.dtype))
