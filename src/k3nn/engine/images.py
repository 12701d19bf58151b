"""Images in the engine: a prompt's images checked and hashed when it is added, their prefix keys, and their
features in the forwards that feed image tokens.

The vision tower runs once per request (:func:`encode_images`), before the first forward that feeds one of its
image tokens (not at all when the prefix cache already covers every image token); an error there is that
request's alone. Every forward feeding image positions gets ``inputs_embeds``: the text embeddings with each
image position's row replaced by its image feature (:func:`image_embeds`). Prefix keys mix in a sha256 of each
image's pixels and grid for every 64-token block holding its tokens (:func:`image_block_keys`: same image ⇒ hit,
different image ⇒ miss).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

import torch

from ..cache.prefix import extra_block_keys
from .request import ImageInputs, Request

__all__ = ["check_images", "encode_images", "feeds_images", "image_block_keys", "image_embeds"]


def check_images(multimodal, model_name: str, prompt: list[int], pixel_values: torch.Tensor | None,
                 image_grid_thw: torch.Tensor | None) -> ImageInputs | None:
    """A prompt's images (``prompt``: its token ids), checked against it — ValueError naming the argument: images
    for a text-only model (``multimodal`` None; ``model_name`` names it), ``image_grid_thw`` disagreeing with
    ``pixel_values``, image tokens without images or more / fewer images than the image tokens take — with one
    content hash per image; None for a text prompt. The pixels are copied: the hash names them, later edits by
    the caller can't leak in."""
    if multimodal is None:
        if pixel_values is not None or image_grid_thw is not None:
            name = "pixel_values" if pixel_values is not None else "image_grid_thw"
            raise ValueError(f"{name}: this engine serves a text-only {model_name}, which takes no images; build "
                             f"the Engine on a k3nn.KimiK3ForConditionalGeneration")
        return None
    from ..multimodal import image_content_keys

    spans = multimodal.image_token_positions(prompt, pixel_values, image_grid_thw)
    if not spans:
        return None
    px = pixel_values.detach().clone()
    grid = image_grid_thw.detach().to("cpu", copy=True)
    return ImageInputs(px, grid, [p for sp in spans for p in sp], [len(sp) for sp in spans],
                       image_content_keys(px, grid))


def image_block_keys(images: ImageInputs | None, block_size: int) -> dict[int, bytes] | None:
    """Block index → the content keys of the images with tokens in that block (mixed into the prefix keys)."""
    if images is None:
        return None
    spans, off = [], 0
    for n, key in zip(images.sizes, images.content_keys):
        spans.append((images.positions[off:off + n], key))
        off += n
    return extra_block_keys(spans, block_size)


def _span(images: ImageInputs, lo: int, n: int) -> tuple[int, int]:
    """The image tokens among prompt positions [lo, lo + n): indices [i0, i1) into ``images.positions``."""
    return bisect_left(images.positions, lo), bisect_left(images.positions, lo + n)


def feeds_images(req: Request, n: int) -> bool:
    """Whether ``req``'s next ``n`` tokens include one of its image tokens."""
    if req.images is None:
        return False
    i0, i1 = _span(req.images, req.num_computed, n)
    return i1 > i0


def encode_images(multimodal, images: ImageInputs) -> torch.Tensor:
    """The projected features of a request's images [Σ n_i, d], running the vision tower the first time (the
    pixels are dropped then)."""
    if images.features is None:
        with torch.inference_mode():
            images.features = multimodal.image_features(images.pixel_values, images.image_grid_thw)
        images.pixel_values = None
    return images.features


def image_embeds(multimodal, embed_tokens: torch.nn.Module, reqs: Sequence[Request], num_new: Sequence[int],
                 ids: torch.Tensor) -> torch.Tensor | None:
    """``inputs_embeds`` [B, T, d] for a forward in which some row feeds image tokens: the text embeddings of
    ``ids`` [B, T] with each such position's row replaced by its image feature (a prefill chunk may begin or end
    inside an image's tokens: row b's column c is prompt position ``num_computed + c``); None when no row does."""
    rows = []
    for b, (r, n) in enumerate(zip(reqs, num_new)):
        if r.images is not None:
            i0, i1 = _span(r.images, r.num_computed, n)
            if i1 > i0:
                rows.append((b, r.images, r.num_computed, i0, i1))
    if not rows:
        return None
    h = embed_tokens(ids)
    for b, im, lo, i0, i1 in rows:
        feats = encode_images(multimodal, im)
        cols = torch.tensor(im.positions[i0:i1], device=h.device) - lo
        h[b, cols] = feats[i0:i1].to(h.dtype)
    return h
