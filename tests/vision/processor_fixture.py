"""Inputs made by transformers' Kimi K2.5 processor, for the vision tests.

``Kimi_K25ImageProcessor`` needs torchvision, which the CPU test machine does not have (PyPI ships only CUDA builds
of it). So the processor's outputs for a few deterministic images and prompts are stored in
``data/k25_processor.safetensors``; the tests read them from there and, where torchvision is installed, run the
processor again and check it still gives exactly these tensors. Regenerate with
``python tests/vision/processor_fixture.py`` on a machine with torchvision.

The processor is configured for the tiny test models: patch 4, merge 2, so an image of H×W pixels is padded to
multiples of 8 and becomes (H/4)·(W/4) patches and a quarter as many image tokens. The image sizes need padding but
no resizing, so the tensors do not depend on the resampling filter's version.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

DATA = Path(__file__).parent / "data" / "k25_processor.safetensors"

IMAGE_TOKEN = "<|media_pad|>"
IMAGE_TOKEN_ID = 250
VIDEO_TOKEN_ID = 251
PAD_ID = 252
PATCH, MERGE = 4, 2

#: (height, width) of each test image, in pixels
IMAGE_SIZES = {"a": (20, 28), "b": (36, 12), "c": (8, 8), "d": (16, 16)}

#: case name -> (prompts, images per prompt): one image; several images of different sizes over a left-padded batch
CASES = {
    "one": (["w1 w2 <|media_pad|> w3 w4"], [["a"]]),
    "batch": (["w5 <|media_pad|> w6",
               "w7 w8 <|media_pad|> w9 <|media_pad|> w10 w11",
               "w12 <|media_pad|> w13 w14 w15 <|media_pad|> w16 w17 w18 w19"],
              [["b"], ["c", "a"], ["d", "b"]]),
}

KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")


def images():
    """Deterministic RGB PIL images (numpy's PCG64 stream is stable across versions)."""
    from PIL import Image

    rng = np.random.default_rng(1234)
    return {k: Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for k, (h, w) in IMAGE_SIZES.items()}


def tokenizer():
    """A word-level tokenizer over ``w0..w239`` plus the image / video placeholders and a pad token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(240)}
    vocab.update({IMAGE_TOKEN: IMAGE_TOKEN_ID, "<|kimi_k25_video_placeholder|>": VIDEO_TOKEN_ID, "<pad>": PAD_ID,
                  "<unk>": 253})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                   extra_special_tokens={"image_token": IMAGE_TOKEN})


def processor():
    """transformers' ``Kimi_K25Processor`` (raises ImportError without torchvision)."""
    from transformers.models.kimi_k25 import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    return Kimi_K25Processor(image_processor=Kimi_K25ImageProcessor(patch_size=PATCH, merge_size=MERGE),
                             tokenizer=tokenizer(),
                             video_processor=Kimi_K25VideoProcessor(patch_size=PATCH, merge_size=MERGE))


def run_processor(proc=None) -> dict[str, dict[str, torch.Tensor]]:
    proc = proc or processor()
    imgs = images()
    out = {}
    for name, (prompts, per_prompt) in CASES.items():
        enc = proc(text=prompts, images=[[imgs[k] for k in ks] for ks in per_prompt], return_tensors="pt",
                   padding=True)
        out[name] = {k: enc[k] for k in KEYS}
    return out


def load() -> dict[str, dict[str, torch.Tensor]]:
    """The stored processor outputs: ``{case: {input_ids, attention_mask, pixel_values, image_grid_thw}}``."""
    from safetensors.torch import load_file

    flat = load_file(str(DATA))
    return {name: {k: flat[f"{name}.{k}"] for k in KEYS} for name in CASES}


if __name__ == "__main__":
    from safetensors.torch import save_file

    DATA.parent.mkdir(parents=True, exist_ok=True)
    res = run_processor()
    save_file({f"{n}.{k}": v.contiguous() for n, d in res.items() for k, v in d.items()}, str(DATA))
    for n, d in res.items():
        print(n, {k: tuple(v.shape) for k, v in d.items()}, d["image_grid_thw"].tolist())
