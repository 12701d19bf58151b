"""KimiK3ForConditionalGeneration: a Kimi text model beside a MoonViT vision tower (Kimi K2.5, Kimi K3).

    pixel_values [L, C, p, p], image_grid_thw [N, 3] ──vision_tower──► [Σ n_i, kh·kw, D] ──mm_projector──► [Σ n_i, d]
    input_ids [B, T] ──embed_tokens──► [B, T, d], the Σ n_i image tokens replaced by those rows, in order
                     ──language_model (any KimiK3: KDA/MLA hybrid, or Kimi K2.5's DeepSeek-V3)──► logits

Image n takes n_i = (h_n/kh)·(w_n/kw) consecutive image tokens (``image_token_id``), as transformers' Kimi K2.5
processor writes them; images fill the image tokens in row-major order over the batch (transformers'
``masked_scatter`` convention), and one image's tokens may not straddle two rows. Each image token is one position
of the text model, in the cache as everywhere else. Video clips (``pixel_values_videos`` / ``video_grid_thw``,
``video_token_id``) go the same way, their frames averaged into one grid of tokens per clip.

The module tree is Moonshot's checkpoint layout: ``language_model.model.*``, ``language_model.lm_head``,
``vision_tower.*``, ``mm_projector.*`` (see :mod:`k3nn.checkpoint.formats.multimodal` for transformers' names).
"""

from __future__ import annotations

import json
import logging
import os
from itertools import accumulate

import torch
from torch import nn

from .config import KimiK3Config
from .generation import GenerationMixin
from .model import KimiK3, KimiK3Output
from .vision.config import MultimodalConfig, VisionConfig
from .vision.projector import PatchMergerProjector
from .vision.tower import MoonViT, check_image_inputs, num_image_tokens

log = logging.getLogger(__name__)

__all__ = ["KimiK3ForConditionalGeneration", "image_content_keys"]


def image_content_keys(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[bytes]:
    """One sha256 digest per image: its patch rows of ``pixel_values`` (bytes, dtype and shape) and its (t, h, w)
    grid, the prefix cache's key of the image's content. Costs a host copy of a device tensor and one pass of
    sha256 over the pixels (~1-2 GB/s per core: a few ms for a 1024² image in fp32)."""
    import hashlib

    px = pixel_values.detach().to("cpu").contiguous()
    out, off = [], 0
    for t, h, w in image_grid_thw.tolist():
        n = t * h * w
        part = px[off:off + n]
        off += n
        d = hashlib.sha256()
        d.update(f"{part.dtype}|{tuple(part.shape)}|{(t, h, w)}|".encode())
        d.update(part.reshape(-1).view(torch.uint8).numpy())
        out.append(d.digest())
    return out


class _PromptEmbedsLM(GenerationMixin):
    """The text model as ``generate()`` sees it for one call: its first forward (the prefill) reads the prompt's
    embeddings, image features in place, instead of embedding ``input_ids``; every other attribute, the decode step
    included, is the text model's own."""

    def __init__(self, lm: KimiK3, embeds: torch.Tensor):
        self._lm, self._embeds = lm, embeds

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_lm", "_embeds"):
            raise AttributeError(name)
        return getattr(self._lm, name)

    def __call__(self, input_ids, cache=None, **kwargs):
        embeds, self._embeds = self._embeds, None
        if embeds is None:
            return self._lm(input_ids, cache=cache, **kwargs)
        B, T = input_ids.shape
        if embeds.shape[1] != T or B % embeds.shape[0]:
            raise RuntimeError("generate: the prompt embeddings do not match input_ids")
        if B != embeds.shape[0]:  # num_return_sequences: each prompt repeated, copies adjacent
            embeds = embeds.repeat_interleave(B // embeds.shape[0], dim=0)
        return self._lm(inputs_embeds=embeds, cache=cache, **kwargs)


class KimiK3ForConditionalGeneration(nn.Module):
    """Kimi's multimodal model: ``language_model`` (:class:`KimiK3`), ``vision_tower`` (:class:`MoonViT`) and
    ``mm_projector`` (:class:`PatchMergerProjector`); ``config.vision_config`` None makes a text-only wrapper
    (images are then refused)."""

    def __init__(self, config: MultimodalConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, backend: str | None = None, seed: int | None = None):
        super().__init__()
        if not isinstance(config, MultimodalConfig):
            raise TypeError(f"config must be a MultimodalConfig, got {type(config).__name__}")
        self.config = config
        self.language_model = KimiK3(config.text_config, device=device, dtype=dtype, backend=backend, seed=seed)
        v = config.vision_config
        if v is None:
            self.vision_tower = self.mm_projector = None
            return
        with torch.device("meta"):
            self.vision_tower = MoonViT(v)
            self.mm_projector = PatchMergerProjector(v)
        if self.language_model.device.type == "meta":
            return
        for m in (self.vision_tower, self.mm_projector):
            m.to_empty(device=self.language_model.device)
            m.to(self.language_model.dtype)
        self.init_vision_weights(seed)

    # -- weights ---------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of the language model's weights (the vision tower lives on the same one)."""
        return self.language_model.device

    @property
    def dtype(self) -> torch.dtype:
        """The language model's weight dtype."""
        return self.language_model.dtype

    @property
    def has_vision(self) -> bool:
        """The config has a ``vision_config``: a vision tower and projector were built (else text only)."""
        return self.vision_tower is not None

    @torch.no_grad()
    def init_vision_weights(self, seed: int | None = None) -> None:
        """Fresh random weights for the vision tower and projector (normal with the text config's
        ``initializer_range``), drawn from a CPU generator seeded with ``seed + 1`` (0 + 1 when None), so a
        seeded model is the same on every device."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed((0 if seed is None else seed) + 1)
        std = self.config.text_config.initializer_range
        self.vision_tower.init_weights(gen, std)
        self.mm_projector.init_weights(gen, std)

    def num_parameters(self, active: bool = False) -> int:
        """Parameters of the language model (``active``: those one token uses, as
        :meth:`KimiK3.num_parameters <k3nn.model.KimiK3.num_parameters>`) plus all of the vision tower and
        projector."""
        n = self.language_model.num_parameters(active=active)
        if self.has_vision:
            n += sum(p.numel() for m in (self.vision_tower, self.mm_projector) for p in m.parameters())
        return n

    # -- images ----------------------------------------------------------------------------------------------
    def _check_vision(self, pixels_name: str, pixel_values) -> VisionConfig:
        if not self.has_vision:
            raise ValueError(f"{pixels_name}: this model has no vision tower (vision_config is None), so it takes no "
                             f"images")
        return self.config.vision_config

    def image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, *,
                       pixels_name: str = "pixel_values", grid_name: str = "image_grid_thw") -> torch.Tensor:
        """pixel_values [L, C, p, p] + grid [N, 3] → projected features [Σ n_i, d] in image order (the text
        embeddings of the image tokens)."""
        v = self._check_vision(pixels_name, pixel_values)
        if isinstance(image_grid_thw, torch.Tensor):
            image_grid_thw = image_grid_thw.cpu()  # read once: the checks and the tower's layout are host work
        check_image_inputs(pixel_values, image_grid_thw, v, pixels_name, grid_name)
        px = pixel_values.to(self.device, self.vision_tower.patch_embed.proj.weight.dtype)
        merged = self.vision_tower(px, image_grid_thw)
        return self.mm_projector(merged)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Per-image projected features ``[n_i, d]`` (transformers' ``get_image_features().pooler_output``)."""
        f = self.image_features(pixel_values, image_grid_thw)
        return list(f.split(num_image_tokens(image_grid_thw, self.config.vision_config.merge_kernel_size)))

    @staticmethod
    def _check_token_count(n_tok: int, token_id: int, sizes: list[int], what: str, names: str,
                           ids_name: str = "input_ids") -> None:
        if n_tok != sum(sizes):
            more = "more" if len(sizes) and n_tok < sum(sizes) else "fewer"
            raise ValueError(
                f"{ids_name} has {n_tok} {what} tokens (token id {token_id}) but {names} give {len(sizes)} "
                f"{what}s of {sizes} tokens = {sum(sizes)} ({more} {what}s than {what} tokens): the processor writes "
                f"(h/kh)·(w/kw) tokens for each")

    def _place(self, ids, h, token_id, feats, sizes, what: str, names: str):
        mask = ids == token_id
        self._check_token_count(int(mask.sum()), token_id, sizes, what, names)
        bounds = {0, *accumulate(sizes)}
        for row, end in enumerate(accumulate(mask.sum(1).tolist())):
            if end not in bounds:
                raise ValueError(f"input_ids row {row}: its {what} tokens end inside one {what}'s tokens ({names} "
                                 f"sizes {sizes}); each {what}'s tokens must lie in one row")
        return h.masked_scatter(mask[..., None], feats.to(h.dtype))

    def embed_inputs(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                     image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                     video_grid_thw: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                     cache=None) -> torch.Tensor:
        """input_ids [B, T] (image / video tokens as the processor wrote them) → inputs_embeds [B, T, d]."""
        cfg = self.config
        lm = self.language_model
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point:
            lm._check_inputs(input_ids, attention_mask, cache)  # raises the text model's error
        specials = [(cfg.image_token_id, "image", "pixel_values / image_grid_thw", pixel_values, image_grid_thw,
                     "pixel_values", "image_grid_thw")]
        if cfg.video_token_id is not None:
            specials.append((cfg.video_token_id, "video", "pixel_values_videos / video_grid_thw", pixel_values_videos,
                             video_grid_thw, "pixel_values_videos", "video_grid_thw"))
        elif pixel_values_videos is not None:
            raise ValueError("pixel_values_videos: this model has no video_token_id")
        placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
        for tid, *_ in specials:
            placeholder |= input_ids == tid
        safe = input_ids.masked_fill(placeholder, 0)  # placeholders may lie outside the vocabulary (K2.5's video id)
        lm._check_inputs(safe, attention_mask, cache)
        h = lm.model.embed_tokens(safe)
        for tid, what, names, px, grid, pname, gname in specials:
            if px is None and grid is None:
                if bool((input_ids == tid).any()):
                    self._place(input_ids, h, tid, None, [], what, names)  # raises: tokens without images
                continue
            feats = self.image_features(px, grid, pixels_name=pname, grid_name=gname)
            sizes = num_image_tokens(grid, cfg.vision_config.merge_kernel_size)
            h = self._place(input_ids, h, tid, feats, sizes, what, names)
        return h

    def image_token_positions(self, prompt, pixel_values: torch.Tensor | None = None,
                              image_grid_thw: torch.Tensor | None = None, *, prompt_name: str = "prompt"
                              ) -> list[list[int]]:
        """One prompt's token ids (a list) + its images → the positions of each image's tokens, in image order
        (the order :meth:`embed_inputs` fills them). Checks what :meth:`embed_inputs` checks, without running the
        tower: images on a model without a vision tower, ``image_grid_thw`` against ``pixel_values``, as many
        image tokens as the images take (each error names the argument); video tokens are refused (no
        ``pixel_values_videos`` here)."""
        cfg = self.config
        ids = [int(t) for t in prompt]
        if cfg.video_token_id is not None and cfg.video_token_id in ids:
            raise ValueError(f"{prompt_name} has video tokens (token id {cfg.video_token_id}): video clips "
                             f"(pixel_values_videos) are not supported here")
        pos = [i for i, t in enumerate(ids) if t == cfg.image_token_id]
        names = "pixel_values / image_grid_thw"
        if pixel_values is None and image_grid_thw is None:
            self._check_token_count(len(pos), cfg.image_token_id, [], "image", names, prompt_name)
            return []
        if pixel_values is not None:
            self._check_vision("pixel_values", pixel_values)
        else:
            self._check_vision("image_grid_thw", image_grid_thw)
        check_image_inputs(pixel_values, image_grid_thw, cfg.vision_config)
        sizes = num_image_tokens(image_grid_thw, cfg.vision_config.merge_kernel_size)
        self._check_token_count(len(pos), cfg.image_token_id, sizes, "image", names, prompt_name)
        return [pos[a:b] for a, b in zip([0, *accumulate(sizes)], accumulate(sizes))]

    # -- forward ---------------------------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_length: int, dtype: torch.dtype | None = None):
        """The language model's :meth:`~k3nn.model.KimiK3.new_cache` (each image token takes one position)."""
        return self.language_model.new_cache(batch_size, max_length, dtype)

    def forward(self, input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, cache=None, attention_mask: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int = 0, *,
                pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                output_hidden_layers: list[int] | None = None, prefill_chunk_size: int | None = None) -> KimiK3Output:
        """input_ids [B, T] with image tokens + the processor's ``pixel_values`` / ``image_grid_thw`` → logits
        [B, T, vocab] (see :meth:`KimiK3.forward` for ``cache``, ``attention_mask``, ``logits_to_keep``)."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_inputs(input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                                              video_grid_thw, attention_mask, cache)
        elif input_ids is not None or pixel_values is not None or pixel_values_videos is not None:
            raise ValueError("inputs_embeds: give inputs_embeds alone, or input_ids (+ images), not both")
        return self.language_model(cache=cache, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                   logits_to_keep=logits_to_keep, output_hidden_layers=output_hidden_layers,
                                   prefill_chunk_size=prefill_chunk_size)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, *,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 drafter=None, **kwargs) -> torch.Tensor:
        """:meth:`KimiK3.generate` over a prompt with images: ``model.generate(**processor(text=..., images=...),
        max_new_tokens=...)``. The prompt's embeddings (image features at the image tokens) feed the prefill;
        decoding is the text model's (CUDA graphs, fused decode, streamers, stopping: every generate() argument)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError("input_ids must be a [batch, seq_len] LongTensor")
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        if drafter is not None:
            if pixel_values is not None or pixel_values_videos is not None:
                raise ValueError("drafter: speculative decoding of prompts with images is not supported")
            self.embed_inputs(input_ids, attention_mask=attention_mask)  # rejects stray image tokens
            return self.language_model.generate(input_ids, attention_mask=attention_mask, drafter=drafter, **kwargs)
        embeds = self.embed_inputs(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                   attention_mask)
        runner = _PromptEmbedsLM(self.language_model, embeds)
        out = runner.generate(input_ids, attention_mask=attention_mask, **kwargs)
        self.last_decode_info = runner.__dict__.get("last_decode_info")
        return out

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory: str | os.PathLike, max_shard_size: int | str = "5GB",
                        format: str | None = None) -> None:
        """config.json + sharded safetensors in ``format`` ``"moonshot"`` (Moonshot's names; the text part in its
        own layout: DeepSeek's for Kimi K2.5, Kimi's for K3) or ``"transformers"`` (transformers'
        ``Kimi_K25ForConditionalGeneration`` names; Kimi K2.5-shaped models only). Default: the layout the
        config was read in."""
        from .checkpoint.formats.multimodal import LAYOUTS, MultimodalFormat
        from .checkpoint.io import _tied_aliases, write_safetensors
        from .checkpoint.rope_layout import interleave_rope

        layout = format or self.config.config_form
        if layout not in LAYOUTS:
            raise ValueError(f"format must be one of {LAYOUTS}, got {format!r}")
        if self.device.type == "meta":
            raise RuntimeError("cannot save a model whose weights are on the meta device")
        cfg_json = self.config.to_dict(layout)  # raises when the layout cannot express the model
        text = self.config.text_config
        text_format = "transformers" if layout == "transformers" else ("deepseek" if self.config.is_kimi_k25
                                                                        else "moonshot")
        sd = {k: v.detach() for k, v in self.state_dict().items()}
        for k in _tied_aliases(self):
            sd.pop(k, None)
        if text.tie_word_embeddings:
            sd.pop("language_model.lm_head.weight", None)
        if text.rope_interleave:
            sd = interleave_rope(self, sd)
        sd = MultimodalFormat(self.config, text_format, layout).from_native(sd)
        os.makedirs(save_directory, exist_ok=True)
        write_safetensors(sd, save_directory, max_shard_size, {"k3nn_format": f"multimodal-{layout}"})
        cfg_json["dtype"] = str(self.dtype).replace("torch.", "")
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(cfg_json, f, indent=2, sort_keys=True)
        gc = getattr(self.language_model, "generation_config", None)
        if gc is not None:
            gc.save_pretrained(save_directory)

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                        device: torch.device | str = "cpu", backend: str | None = None, revision: str | None = None,
                        cache_dir: str | None = None, local_files_only: bool | None = None,
                        token: str | bool | None = None, config: MultimodalConfig | None = None,
                        torch_dtype: torch.dtype | str | None = None,
                        device_map=None) -> "KimiK3ForConditionalGeneration":
        """Load a multimodal checkpoint (Moonshot's Kimi K2.5 / K3 layout, or transformers' ``kimi_k25`` in either
        of its layouts), strictly: every tensor of the model read once, none left over. Arguments as
        :meth:`KimiK3.from_pretrained`."""
        from .checkpoint.formats.multimodal import MultimodalFormat
        from .checkpoint.io import (CheckpointError, _keep_fp32, checkpoint_keys, load_weights, resolve_dtype,
                                    resolve_loading)

        d, device, dtype = resolve_loading(path_or_repo_id, dtype, torch_dtype, device, device_map, revision,
                                           cache_dir, local_files_only, token)
        if config is None:
            path = d / "config.json"
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"config.json at {path} is not valid JSON: {e}") from None
            if not MultimodalConfig.is_multimodal_dict(raw):
                raise CheckpointError(f"{d} is a text-only checkpoint (its config.json has no text_config / "
                                      f"vision_config): load it with k3nn.KimiK3.from_pretrained")
            try:
                config = MultimodalConfig.from_dict(raw)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{path}: {e}") from None
        dtype = resolve_dtype("auto" if dtype is None else dtype, d)
        model = cls(config, device="meta", backend=backend)
        model.to_empty(device=device)
        model.language_model.tie_weights()
        model.to(dtype)
        _keep_fp32(model)
        if model.has_vision:
            model.vision_tower.reset_buffers()
        fmt = MultimodalFormat.for_checkpoint(config, checkpoint_keys(d))
        load_weights(model, d, fmt)
        model.load_format = f"{fmt.layout} (text: {fmt.text.NAME})"
        if (d / "generation_config.json").exists():
            from .generation import GenerationConfig

            model.language_model.generation_config = GenerationConfig.from_pretrained(d)
        model.eval()
        return model


# a text config is a KimiK3Config; re-exported for `from k3nn.multimodal import ...`
__all__ += ["MultimodalConfig", "VisionConfig", "KimiK3Config"]
