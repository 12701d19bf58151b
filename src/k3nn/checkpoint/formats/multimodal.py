"""Multimodal checkpoint layouts: a text model beside ``vision_tower`` and ``mm_projector``.

k3nn's own names (``KimiK3ForConditionalGeneration.state_dict()``) are Moonshot's: ``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower.patch_embed.*``, ``vision_tower.encoder.blocks.{i}.wqkv`` …,
``mm_projector.pre_norm`` / ``proj.0`` / ``proj.2`` / ``post_norm``; text experts stacked as in every k3nn model.

Read (every spelling, told apart key by key):

* ``"moonshot"``: Moonshot's checkpoints (Kimi K2.5, Kimi K3): the names above, the text part in its own layout
  (K3: ``block_sparse_moe.experts.{j}.w1``; K2.5: DeepSeek's ``mlp.experts.{j}.gate_proj``);
* transformers' default ``save_pretrained`` of ``Kimi_K25ForConditionalGeneration``, which writes Moonshot's names
  back with three slips of its converter (``language_model.model.blocks.{i}`` for ``layers.{i}``,
  ``vision_tower.encoder.patch_embed`` for ``vision_tower.patch_embed``, ``model.mm_projector.pre_norm``);
* ``"transformers"``: transformers' runtime names (``save_original_format=False``): ``model.language_model.*``,
  ``lm_head.weight``, ``model.vision_tower.layers.{i}.attn.q_proj / k_proj / v_proj`` (q and k rows of each head in
  halves order, see :mod:`k3nn.vision.rope`), ``norm1 / norm2``, ``mlp.fc1 / fc2``,
  ``model.mm_projector.in_proj / out_proj``, the text MoE fused (``mlp.experts.gate_up_proj``).

Written: ``"moonshot"`` or ``"transformers"`` (both load in transformers for a Kimi K2.5-shaped model).
"""

from __future__ import annotations

import re

import torch

from . import FORMATS, detect as detect_text

NAME = "multimodal"
LAYOUTS = ("moonshot", "transformers")

_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")
_TEXT_PREFIXES = ("language_model.", "model.language_model.", "lm_head.")


def is_vision_key(key: str) -> bool:
    return key.startswith(_VISION_PREFIXES)


def is_multimodal(keys) -> bool:
    """Whether a checkpoint's keys are a multimodal model's (a vision tower, or a wrapped language model)."""
    return any(k.startswith(_VISION_PREFIXES) or k.startswith(("language_model.", "model.language_model."))
               for k in keys)


def layout_of(keys) -> str:
    return "transformers" if any(k.startswith(("model.language_model.", "model.vision_tower.")) for k in keys) \
        else "moonshot"


def text_key(key: str) -> str | None:
    """A checkpoint key of the language model in the text model's own names (``model.*``, ``lm_head.weight``),
    or None for a key of another part."""
    if key.startswith("language_model.model.blocks."):  # transformers' write-back of `layers`
        return "model.layers." + key[len("language_model.model.blocks."):]
    if key.startswith("language_model."):
        return key[len("language_model."):]
    if key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    if key == "lm_head.weight":
        return key
    return None


def _pairs_from_halves(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from halves order (transformers) to rotary-pair order (Moonshot)."""
    return t.reshape(heads, 2, -1, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _halves_from_pairs(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, -1, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


_TF_BLOCK = {"norm1": "norm0", "norm2": "norm1", "attn.proj": "wo", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1"}
_TF_PROJ = {"in_proj": "proj.0", "out_proj": "proj.2", "pre_norm": "pre_norm", "post_norm": "post_norm"}


class MultimodalFormat:
    """The key map of one multimodal model: ``to_native(key, load, model_keys)`` / ``from_native(state_dict)``
    (the protocol of :mod:`k3nn.checkpoint.formats`), built for a config (vision heads, text layout)."""

    NAME = NAME

    def __init__(self, config, text_format: str, layout: str = "moonshot"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if text_format not in FORMATS:
            raise ValueError(f"unknown text format {text_format!r}; known: {sorted(FORMATS)}")
        self.config, self.layout = config, layout
        self.text = FORMATS[text_format]
        v = config.vision_config
        self.heads = v.num_attention_heads if v is not None else 0
        self.attn_width = v.attn_width if v is not None else 0

    @classmethod
    def for_checkpoint(cls, config, keys) -> "MultimodalFormat":
        keys = set(keys)
        text_keys = {t for t in map(text_key, keys) if t is not None}
        return cls(config, detect_text(text_keys), layout_of(keys))

    # -- reading ----------------------------------------------------------------------------------------------
    def to_native(self, key, load, model_keys):
        t = text_key(key)
        if t is not None:
            text_model_keys = {k[len("language_model."):] for k in model_keys if k.startswith("language_model.")}
            return [("language_model." + n, j, x) for n, j, x in self.text.to_native(t, load, text_model_keys)]
        return self._vision_to_native(key, load)

    def _vision_to_native(self, key, load):
        # transformers' write-back slips
        if key.startswith("vision_tower.encoder.patch_embed."):
            return [("vision_tower.patch_embed." + key[len("vision_tower.encoder.patch_embed."):], None, load())]
        if key.startswith("model.mm_projector."):
            rest = key[len("model.mm_projector."):]
            name, _, leaf = rest.partition(".")
            return [(f"mm_projector.{_TF_PROJ.get(name, name)}.{leaf}", None, load())]
        if not key.startswith("model.vision_tower."):
            return [(key, None, load())]  # Moonshot's own names (unknown ones are reported by the loader)
        rest = key[len("model.vision_tower."):]
        if rest == "patch_embed.pos_emb.position_embeddings":
            return [("vision_tower.patch_embed.pos_emb.weight", None, load())]
        if rest.startswith("patch_embed."):
            return [("vision_tower." + rest, None, load())]
        if rest.startswith("final_layernorm."):
            return [("vision_tower.encoder." + rest, None, load())]
        m = re.match(r"^layers\.(\d+)\.(.*)\.(weight|bias)$", rest)
        if m:
            i, name, leaf = m.groups()
            base = f"vision_tower.encoder.blocks.{i}"
            qkv = {"attn.q_proj": 0, "attn.k_proj": 1, "attn.v_proj": 2}
            if name in qkv:
                n, A = qkv[name], self.attn_width
                t = load()
                if n < 2:
                    t = _pairs_from_halves(t, self.heads)
                return [(f"{base}.wqkv.{leaf}", slice(n * A, (n + 1) * A), t)]
            if name in _TF_BLOCK:
                return [(f"{base}.{_TF_BLOCK[name]}.{leaf}", None, load())]
        return [(key, None, load())]

    # -- writing ----------------------------------------------------------------------------------------------
    def from_native(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = {k[len("language_model."):]: v for k, v in state_dict.items() if k.startswith("language_model.")}
        rest = {k: v for k, v in state_dict.items() if not k.startswith("language_model.")}
        out = {}
        for k, v in self.text.from_native(text).items():
            if self.layout == "moonshot":
                out["language_model." + k] = v
            else:
                out["model.language_model." + k[len("model."):] if k.startswith("model.") else k] = v
        for k, v in rest.items():
            out.update(self._vision_from_native(k, v))
        return out

    def _vision_from_native(self, key, t):
        if self.layout == "moonshot":
            return {key: t}
        if key == "vision_tower.patch_embed.pos_emb.weight":
            return {"model.vision_tower.patch_embed.pos_emb.position_embeddings": t}
        if key.startswith("vision_tower.patch_embed."):
            return {"model." + key: t}
        if key.startswith("vision_tower.encoder.final_layernorm."):
            return {"model.vision_tower." + key[len("vision_tower.encoder."):]: t}
        if key.startswith("mm_projector."):
            name, _, leaf = key[len("mm_projector."):].rpartition(".")
            inv = {v: k for k, v in _TF_PROJ.items()}
            return {f"model.mm_projector.{inv.get(name, name)}.{leaf}": t}
        m = re.match(r"^vision_tower\.encoder\.blocks\.(\d+)\.(.*)\.(weight|bias)$", key)
        if m:
            i, name, leaf = m.groups()
            base = f"model.vision_tower.layers.{i}"
            if name == "wqkv":
                q, k, v = t.split(self.attn_width, 0)
                return {f"{base}.attn.q_proj.{leaf}": _halves_from_pairs(q, self.heads).clone(),
                        f"{base}.attn.k_proj.{leaf}": _halves_from_pairs(k, self.heads).clone(),
                        f"{base}.attn.v_proj.{leaf}": v.clone()}
            inv = {v: k for k, v in _TF_BLOCK.items()}
            if name in inv:
                return {f"{base}.{inv[name]}.{leaf}": t}
        raise ValueError(f"no transformers name for the vision tensor {key!r}")


class LanguageModelOnly:
    """The language-model part of a multimodal checkpoint, for a text-only ``KimiK3``: the text keys in the text
    model's own names; vision tower and projector tensors skipped (counted in ``skipped``)."""

    NAME = "language_model_only"

    def __init__(self, text_format: str):
        self.text = FORMATS[text_format]
        self.skipped: list[str] = []

    @classmethod
    def for_checkpoint(cls, keys) -> "LanguageModelOnly":
        return cls(detect_text({t for t in map(text_key, keys) if t is not None}))

    def to_native(self, key, load, model_keys):
        if is_vision_key(key):
            self.skipped.append(key)
            return []
        t = text_key(key)
        return self.text.to_native(key if t is None else t, load, model_keys)
