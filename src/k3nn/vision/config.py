"""VisionConfig (MoonViT tower + patch-merger projector) and MultimodalConfig (text_config + vision_config).

Two config.json spellings are read and written:

* ``"moonshot"``: Moonshot's remote-code configs (Kimi K2.5, Kimi K3): ``vision_config`` with ``vt_hidden_size``,
  ``vt_num_attention_heads``, ``init_pos_emb_height``, ``mm_projector_type`` ..., the image placeholder as
  ``media_placeholder_token_id``.
* ``"transformers"``: transformers' ``kimi_k25`` (``Kimi_K25Config``): ``vision_config`` with ``hidden_size``,
  ``num_attention_heads``, ``pos_emb_height`` ..., ``projection_hidden_size`` / ``projection_layer_norm_eps`` and
  ``image_token_id`` at the top.

Kimi K2.5 (MoonViT, ``patchmerger``): LayerNorms, biases everywhere, bicubic resampling of the learned positions,
LayerNorm before the projector MLP. Kimi K3 (MoonViT-V2, ``patchmergerv2``): RMSNorms, no biases, an attention width
(``qkv_hidden_size``) different from the residual width, bilinear resampling, RMSNorm after the projector MLP.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from ..config import KimiK3Config, check_field_types

__all__ = ["VisionConfig", "MultimodalConfig"]

NormType = Literal["layernorm", "rmsnorm"]
ProjectorType = Literal["patchmerger", "patchmergerv2"]


@dataclass
class VisionConfig:
    """The vision tower (MoonViT) and projector of a multimodal Kimi model.

    Fields: the patch embedding (``patch_size`` p, ``num_channels`` C; pixels arrive as patches [L, C, p, p]), the
    learned position grid resampled to each image (``pos_emb_*``), the encoder (widths, heads, activation, norm), the
    patch merge (``merge_kernel_size`` [kh, kw]: each kh×kw block of patches becomes one text token) and the projector
    into the text model's width (``projector_type`` "patchmerger" for Kimi K2.5, "patchmergerv2" for K3;
    ``text_hidden_size``). Presets: :meth:`kimi_k25`, :meth:`kimi_k3`, :meth:`tiny`; :meth:`from_dict` and
    :meth:`to_dict` read and write both Moonshot's (``vt_*``) and transformers' spellings.
    """

    # --- patch embedding --------------------------------------------------------------------------------
    patch_size: int = 14
    num_channels: int = 3
    patch_embed_bias: bool = True
    pos_emb_height: int = 64  # learned position grid, resampled to each image's patch grid
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # frames with a sin/cos temporal embedding (video clips)
    pos_emb_interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    # --- encoder ------------------------------------------------------------------------------------------
    hidden_size: int = 1152
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    qkv_hidden_size: int | None = None  # attention width (H · head_dim); None: hidden_size
    intermediate_size: int = 4304
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    norm_type: NormType = "layernorm"
    norm_eps: float | None = 1e-5  # None: torch.finfo(dtype).eps (nn.RMSNorm's default)
    attn_bias: bool = True
    mlp_bias: bool = True
    rope_theta: float = 10000.0
    # --- patch merge + projector -------------------------------------------------------------------------
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])
    projector_type: ProjectorType = "patchmerger"
    projector_hidden_act: Literal["gelu", "gelu_pytorch_tanh"] = "gelu"
    projector_eps: float = 1e-5
    text_hidden_size: int = 7168  # the projector's output width (the text model's hidden size)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.merge_kernel_size, tuple):
            self.merge_kernel_size = list(self.merge_kernel_size)
        check_field_types(self)  # also makes the float fields floats
        self.validate()

    def validate(self) -> None:
        """Check ranges and consistency (run on construction); a ValueError starting ``VisionConfig:``."""
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"VisionConfig: {msg}")

        for k in ("patch_size", "num_channels", "pos_emb_height", "pos_emb_width", "pos_emb_time", "hidden_size",
                  "num_hidden_layers", "num_attention_heads", "intermediate_size", "text_hidden_size"):
            need(getattr(self, k) > 0, f"{k} must be positive, got {getattr(self, k)}")
        need(len(self.merge_kernel_size) == 2 and all(k > 0 for k in self.merge_kernel_size),
             f"merge_kernel_size must be two positive ints, got {self.merge_kernel_size}")
        need(self.attn_width % self.num_attention_heads == 0,
             f"the attention width {self.attn_width} must be divisible by num_attention_heads "
             f"{self.num_attention_heads}")
        need(self.head_dim % 4 == 0, f"head_dim {self.head_dim} must be divisible by 4 (2D rotary: two axes of "
                                     f"rotated pairs)")

    @property
    def attn_width(self) -> int:
        """The attention width H · head_dim: ``qkv_hidden_size``, else ``hidden_size``."""
        return self.qkv_hidden_size or self.hidden_size

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``attn_width // num_attention_heads``."""
        return self.attn_width // self.num_attention_heads

    @property
    def merge_size(self) -> int:
        """Patches merged into one text token: kh · kw of ``merge_kernel_size``."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged token: kh·kw patches side by side."""
        return self.hidden_size * self.merge_size

    def replace(self, **changes: Any) -> "VisionConfig":
        """A copy with ``changes`` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    # --- presets ----------------------------------------------------------------------------------------
    @classmethod
    def kimi_k25(cls, **overrides: Any) -> "VisionConfig":
        """Kimi K2.5's MoonViT: 27 layers of 1152 (16 heads of 72), MLP 4304, patch 14, merge 2×2."""
        return cls(**overrides)

    @classmethod
    def kimi_k3(cls, **overrides: Any) -> "VisionConfig":
        """Kimi K3's MoonViT-V2: 27 layers of 1024, attention 12 heads of 128 (1536 wide), MLP 4096, RMSNorm,
        no biases, bilinear position resampling, ``patchmergerv2`` projector."""
        base = dict(hidden_size=1024, num_hidden_layers=27, num_attention_heads=12, qkv_hidden_size=1536,
                    intermediate_size=4096, norm_type="rmsnorm", norm_eps=None, attn_bias=False, mlp_bias=False,
                    patch_embed_bias=False, pos_emb_interpolation="bilinear", projector_type="patchmergerv2")
        base.update(overrides)
        return cls(**base)

    @classmethod
    def tiny(cls, **overrides: Any) -> "VisionConfig":
        """For CPU tests: patch 4, 2 layers of 32 (2 heads of 16), an 8×8 position grid."""
        base = dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, text_hidden_size=64)
        base.update(overrides)
        return cls(**base)

    # --- (de)serialisation -------------------------------------------------------------------------------
    _MOONSHOT = {  # Moonshot key -> field
        "vt_hidden_size": "hidden_size", "vt_intermediate_size": "intermediate_size",
        "vt_num_hidden_layers": "num_hidden_layers", "vt_num_attention_heads": "num_attention_heads",
        "qkv_hidden_size": "qkv_hidden_size", "patch_size": "patch_size", "num_channels": "num_channels",
        "merge_kernel_size": "merge_kernel_size", "mm_projector_type": "projector_type",
        "text_hidden_size": "text_hidden_size", "projector_hidden_act": "projector_hidden_act",
        "projector_ln_eps": "projector_eps", "init_pos_emb_height": "pos_emb_height",
        "init_pos_emb_width": "pos_emb_width", "init_pos_emb_time": "pos_emb_time",
        "pos_emb_interpolation_mode": "pos_emb_interpolation", "norm_type": "norm_type", "attn_bias": "attn_bias",
        "linear_bias": "mlp_bias", "patch_embed_proj_bias": "patch_embed_bias", "rope_theta": "rope_theta",
        "activation_func": "hidden_act",
    }
    #: Moonshot keys whose only supported value is checked, then dropped
    _MOONSHOT_FIXED = {"merge_type": "sd2_tpool", "pos_emb_type": "divided_fixed", "video_attn_type": "spatial_temporal",
                       "mlp_type": "mlp2"}
    _TRANSFORMERS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                     "num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
                     "patch_size": "patch_size", "merge_kernel_size": "merge_kernel_size",
                     "pos_emb_height": "pos_emb_height", "pos_emb_width": "pos_emb_width",
                     "pos_emb_time": "pos_emb_time", "hidden_act": "hidden_act"}
    _IGNORED = frozenset({"model_type", "_attn_implementation", "max_pos_emb_height", "max_pos_emb_width", "dtype",
                          "torch_dtype", "transformers_version", "architectures", "_name_or_path", "mm_hidden_size",
                          "initializer_range", "return_dict", "output_hidden_states", "output_attentions"})

    @classmethod
    def form_of(cls, d: dict[str, Any]) -> str:
        """Which spelling a ``vision_config`` dict uses: ``"moonshot"`` (``vt_*`` keys) or ``"transformers"``."""
        return "moonshot" if any(k.startswith("vt_") or k.startswith("init_pos_emb") for k in d) else "transformers"

    @classmethod
    def from_dict(cls, d: dict[str, Any], text_hidden_size: int | None = None,
                  projector: dict[str, Any] | None = None) -> "VisionConfig":
        """Read a ``vision_config`` dict in either form. ``projector``: transformers' top-level
        ``projection_hidden_size`` / ``projection_layer_norm_eps``."""
        if not isinstance(d, dict):
            raise TypeError(f"vision_config must be a dict, got {type(d).__name__}")
        form = cls.form_of(d)
        names = cls._MOONSHOT if form == "moonshot" else cls._TRANSFORMERS
        kw: dict[str, Any] = {}
        extra, unknown = {}, []
        for k, v in d.items():
            if k in names:
                kw[names[k]] = v
            elif form == "moonshot" and k in cls._MOONSHOT_FIXED:
                if v != cls._MOONSHOT_FIXED[k]:
                    raise ValueError(f"vision_config: {k} = {v!r} is not supported (only "
                                     f"{cls._MOONSHOT_FIXED[k]!r})")
            elif k == "rope_parameters" and isinstance(v, dict):
                if v.get("rope_type", "axial") != "axial":
                    raise ValueError(f"vision_config: rope_parameters.rope_type {v.get('rope_type')!r} is not "
                                     f"supported (only 'axial')")
                if "rope_theta" in v:
                    kw["rope_theta"] = v["rope_theta"]
            elif k not in cls._IGNORED:
                extra[k] = v
                unknown.append(k)
        mm_hidden = d.get("mm_hidden_size") if form == "moonshot" else (projector or {}).get("projection_hidden_size")
        hidden = kw.get("hidden_size", cls.hidden_size)
        if mm_hidden is not None and mm_hidden != hidden:
            raise ValueError(f"vision_config: the projector's input width ({mm_hidden}) must equal the tower's "
                             f"hidden size ({hidden})")
        if form == "transformers" and projector and projector.get("projection_layer_norm_eps") is not None:
            kw["projector_eps"] = projector["projection_layer_norm_eps"]
        if text_hidden_size is not None:
            kw.setdefault("text_hidden_size", text_hidden_size)
        if kw.get("norm_type") == "rmsnorm":
            kw.setdefault("norm_eps", None)  # Moonshot's MoonViT-V2: nn.RMSNorm with its default eps
        if unknown:
            warnings.warn(f"vision_config: unknown key(s) {unknown} are kept in extra but not used", UserWarning,
                          stacklevel=3)
        kw["extra"] = extra
        return cls(**kw)

    def to_dict(self, form: str = "moonshot") -> dict[str, Any]:
        """The ``vision_config`` dict in Moonshot's (``"moonshot"``) or transformers' (``"transformers"``)
        spelling."""
        if form == "moonshot":
            inv = {v: k for k, v in self._MOONSHOT.items()}
            d = {inv[f]: getattr(self, f) for f in inv}
            d.update(self._MOONSHOT_FIXED)
            d["mm_hidden_size"] = self.hidden_size
            if d["qkv_hidden_size"] is None:
                d.pop("qkv_hidden_size")
            out = dict(self.extra)
            out.update(d)
            return out
        if form == "transformers":
            bad = self.transformers_incompatibility()
            if bad:
                raise ValueError(f"transformers' Kimi K2.5 vision tower cannot express this one: {bad}")
            inv = {v: k for k, v in self._TRANSFORMERS.items()}
            d = {inv[f]: getattr(self, f) for f in inv}
            d["model_type"] = "kimi_k25_vision"
            d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "axial"}
            return d
        raise ValueError(f"form must be 'moonshot' or 'transformers', got {form!r}")

    def transformers_incompatibility(self) -> str | None:
        """None when transformers' ``Kimi_K25VisionModel`` + projector implement this tower exactly, else why not."""
        checks = [
            (self.projector_type == "patchmerger", f"projector_type is {self.projector_type!r}"),
            (self.norm_type == "layernorm" and self.norm_eps == 1e-5, "not LayerNorm(eps=1e-5)"),
            (self.attn_bias and self.mlp_bias and self.patch_embed_bias, "linear layers without bias"),
            (self.qkv_hidden_size in (None, self.hidden_size), "attention width differs from hidden_size"),
            (self.pos_emb_interpolation == "bicubic", "bilinear position resampling"),
            (self.pos_emb_height == self.pos_emb_width, "a non-square learned position grid"),
            (self.projector_hidden_act == "gelu", f"projector_hidden_act is {self.projector_hidden_act!r}"),
            (self.num_channels == 3, f"num_channels is {self.num_channels}"),
        ]
        bad = [why for ok, why in checks if not ok]
        return "; ".join(bad) if bad else None


#: text model types of Kimi K2.5 / K2 checkpoints (DeepSeek-V3 architecture)
DEEPSEEK_TEXT_TYPES = ("deepseek_v3", "kimi_k2")


@dataclass
class MultimodalConfig:
    """A text model (any :class:`KimiK3Config`) beside a vision tower (None: a text-only wrapper)."""

    text_config: KimiK3Config
    vision_config: VisionConfig | None = None
    image_token_id: int = 163605
    video_token_id: int | None = 163840
    vision_start_token_id: int | None = 163602
    vision_end_token_id: int | None = 163604
    model_type: str = "kimi_k3"
    #: the config.json spelling this config was read from (and ``save_pretrained``'s default layout)
    config_form: Literal["moonshot", "transformers"] = "moonshot"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.text_config, KimiK3Config):
            raise TypeError(f"text_config must be a KimiK3Config, got {type(self.text_config).__name__}")
        if self.vision_config is not None and not isinstance(self.vision_config, VisionConfig):
            raise TypeError(f"vision_config must be a VisionConfig or None, got {type(self.vision_config).__name__}")
        v = self.vision_config
        if v is not None and v.text_hidden_size != self.text_config.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size ({v.text_hidden_size}) must equal the text model's "
                             f"hidden_size ({self.text_config.hidden_size})")
        V = self.text_config.vocab_size
        if not 0 <= self.image_token_id < V:
            raise ValueError(f"image_token_id {self.image_token_id} is outside the vocabulary [0, {V})")

    @property
    def tie_word_embeddings(self) -> bool:
        """The text model's ``tie_word_embeddings``."""
        return self.text_config.tie_word_embeddings

    @property
    def is_kimi_k25(self) -> bool:
        """The text model is DeepSeek-V3-shaped (Kimi K2.5) rather than a KDA hybrid."""
        return self.text_config.model_type in DEEPSEEK_TEXT_TYPES

    @classmethod
    def tiny(cls, text: KimiK3Config | None = None, **vision_overrides: Any) -> "MultimodalConfig":
        """The tiny K3 text model (KDA + MLA, AttnRes, LatentMoE) beside the tiny vision tower."""
        text = text or KimiK3Config.tiny()
        return cls(text, VisionConfig.tiny(text_hidden_size=text.hidden_size, **vision_overrides),
                   image_token_id=250, video_token_id=251, vision_start_token_id=None, vision_end_token_id=None)

    @staticmethod
    def is_multimodal_dict(d: dict[str, Any]) -> bool:
        """``d`` (a parsed config.json) is a multimodal config: it has a ``text_config`` dict."""
        return isinstance(d, dict) and isinstance(d.get("text_config"), dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MultimodalConfig":
        """Read a Moonshot (Kimi K2.5 / K3 remote code) or transformers (``kimi_k25``) multimodal config.json."""
        if not cls.is_multimodal_dict(d):
            raise ValueError("a multimodal config.json has a text_config dict (and a vision_config)")
        text = KimiK3Config.from_dict(d)  # reads text_config, with the wrapper's tie / special-token keys
        vd = d.get("vision_config")
        form = "transformers" if d.get("model_type") == "kimi_k25" and (
            vd is None or VisionConfig.form_of(vd) == "transformers") else "moonshot"
        vision = None
        if vd is not None:
            proj = {k: d[k] for k in ("projection_hidden_size", "projection_layer_norm_eps") if k in d}
            vision = VisionConfig.from_dict(vd, text_hidden_size=text.hidden_size, projector=proj)
        img = d.get("image_token_id", d.get("media_placeholder_token_id", 163605))
        known = {"text_config", "vision_config", "image_token_id", "media_placeholder_token_id", "video_token_id",
                 "vision_start_token_id", "vision_end_token_id", "model_type", "projection_hidden_size",
                 "projection_layer_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                 "architectures", "auto_map", "dtype", "torch_dtype", "transformers_version", "_name_or_path"}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(text, vision, image_token_id=img, video_token_id=d.get("video_token_id", 163840),
                   vision_start_token_id=d.get("vision_start_token_id", 163602),
                   vision_end_token_id=d.get("vision_end_token_id", 163604),
                   model_type=d.get("model_type") or ("kimi_k25" if text.model_type in DEEPSEEK_TEXT_TYPES
                                                      else "kimi_k3"),
                   config_form=form, extra=extra)

    def to_dict(self, form: str | None = None) -> dict[str, Any]:
        """config.json in the ``"moonshot"`` or ``"transformers"`` spelling (default: the one it was read from)."""
        form = form or self.config_form
        text = self.text_config.to_dict(form="transformers" if form == "transformers" else "moonshot")
        d: dict[str, Any] = dict(self.extra)
        if form == "transformers":
            if not self.is_kimi_k25:
                raise ValueError(f"transformers' multimodal Kimi (kimi_k25) needs a DeepSeek-V3 text model; this one "
                                 f"is {self.text_config.model_type!r}")
            d.update(model_type="kimi_k25", architectures=["Kimi_K25ForConditionalGeneration"], text_config=text,
                     image_token_id=self.image_token_id, tie_word_embeddings=self.tie_word_embeddings)
            for k in ("video_token_id", "vision_start_token_id", "vision_end_token_id"):
                if getattr(self, k) is not None:
                    d[k] = getattr(self, k)
            if self.vision_config is not None:
                d["vision_config"] = self.vision_config.to_dict("transformers")
                d["projection_hidden_size"] = self.vision_config.hidden_size
                d["projection_layer_norm_eps"] = self.vision_config.projector_eps
            return d
        if form != "moonshot":
            raise ValueError(f"form must be 'moonshot' or 'transformers', got {form!r}")
        arch = "KimiK25ForConditionalGeneration" if self.model_type == "kimi_k25" else "KimiK3ForConditionalGeneration"
        d.update(model_type=self.model_type, architectures=[arch], text_config=text,
                 media_placeholder_token_id=self.image_token_id, tie_word_embeddings=self.tie_word_embeddings)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(self.text_config, k) is not None:
                d[k] = getattr(self.text_config, k)
        if self.video_token_id is not None:
            d["video_token_id"] = self.video_token_id
        if self.vision_config is not None:
            d["vision_config"] = self.vision_config.to_dict("moonshot")
        return d
