"""Vision tower benchmark: k3nn's MoonViT + projector against transformers' Kimi K2.5 vision tower + projector
(``Kimi_K25VisionModel`` + ``Kimi_K25MultimodalProjection``) on the same weights, bf16, images/s.

    python3 -m bench.gpu.vision_tower [--batch-448 32] [--batch-1024 8] [--reps 10]
    python3 -m bench.gpu.vision_tower --tiny --device cpu        # the CPU parts, in seconds

1. transformers' ``Kimi_K25ForConditionalGeneration`` at Kimi K2.5's vision dims (transformers' ``Kimi_K25VisionConfig``
   defaults: MoonViT, 27 layers of 1152, 16 heads of 72, MLP 4304, patch 14, merge 2×2, a 64×64 learned position
   grid; the projector 4·1152 → 7168) beside a one-layer DeepSeek-V3 text model of K2.5's width, random weights
   (seeded, every vision parameter perturbed so norms and biases matter), built in fp32 on the device.
2. ``save_pretrained`` to a temporary directory, then ``k3nn.KimiK3ForConditionalGeneration.from_pretrained`` of that
   directory (the path users take), in fp32 and in bf16.
3. Inputs from transformers' own ``Kimi_K25ImageProcessor`` on random RGB images (it needs torchvision; without it,
   tensors of its layout: each side padded up to a multiple of patch·merge = 28 px, one [3, 14, 14] patch per row,
   raster order, grid (1, h, w); the image sizes here need no resizing, so the grids are the processor's).
4. Checks, on a mixed batch of different sizes: projected features of k3nn vs transformers in fp32 (TF32 off; ≤ 1e-4
   relative), and in bf16 (k3nn's error against transformers' fp32 within 1.5× transformers' own bf16 error, or
   ≤ 5e-3); k3nn's bf16 attention (the varlen flash kernel on CUDA) against its eager reference (the same bound,
   both against transformers' fp32).
5. Timing of ``image_features`` (k3nn) and ``model.get_image_features`` (transformers, its default SDPA attention),
   bf16, ``torch.inference_mode()``: CUDA events, warm-up calls, median of N; a batch of 448×448 images, a batch of
   1024×1024 images (74×74 patches each after the processor's padding) and a mixed batch. Reported: ms per batch,
   images/s, peak memory above what was allocated before the call, achieved TFLOP/s, speedup (transformers ms / k3nn
   ms).

Writes ``vision-<timestamp>.json`` (``meta`` + ``rows``, bench.common's schema) to $K3NN_RESULTS_DIR (default
bench/results) and prints a table; exits 1 when a check fails (after writing the file).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import device_meta, median_call_ms, write_results

T0 = time.time()

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, PAD_ID = 250, 251, 252


def text_config(hidden: int) -> dict:
    """One DeepSeek-V3 layer (dense MLP) of width ``hidden``: only its width matters here (the projector's output)."""
    return dict(model_type="deepseek_v3", vocab_size=256, hidden_size=hidden, intermediate_size=128,
                moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                n_shared_experts=1, n_routed_experts=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=512, pad_token_id=PAD_ID, bos_token_id=0,
                eos_token_id=1, rope_parameters={"rope_theta": 1000.0, "rope_type": "default"})


#: the tiny tower of the CPU tests (patch 4, 2 layers of 32, 2 heads of 16, an 8×8 position grid)
TINY_VISION = dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2,
                   num_hidden_layers=2, hidden_size=32, intermediate_size=64, merge_kernel_size=[2, 2])

#: the mixed batches, (height, width) px per image (the equal-size batches' sizes come from the command line)
MIXED = [(1024, 1024), (448, 448), (768, 1024), (1024, 576), (336, 336), (640, 480), (224, 896), (896, 672)]
TINY_MIXED = [(32, 32), (64, 64), (20, 28), (48, 16)]


def say(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return ((o - r).norm() / r.norm().clamp_min(1e-30)).item()


# -- models ------------------------------------------------------------------------------------------------------

def build_transformers(tiny: bool, layers: int | None, device: str, seed: int = 0):
    """transformers' Kimi_K25ForConditionalGeneration (fp32, on ``device``), vision weights perturbed (seeded)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    vision = dict(TINY_VISION) if tiny else {}  # {}: transformers' Kimi_K25VisionConfig defaults (Kimi K2.5's)
    if layers is not None:
        vision["num_hidden_layers"] = layers
    cfg = Kimi_K25Config(text_config=text_config(64 if tiny else 7168), vision_config=vision,
                         image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID, tie_word_embeddings=False)
    cfg.projection_hidden_size = cfg.vision_config.hidden_size
    torch.manual_seed(seed)
    with torch.device(device):
        hf = Kimi_K25ForConditionalGeneration(cfg)
    hf = hf.to(device=device, dtype=torch.float32).eval()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for mod in (hf.model.vision_tower, hf.model.mm_projector):
            for p in mod.parameters():
                noise = torch.randn(p.shape, generator=g, device=device)
                p.add_(noise * (0.02 if p.dim() > 1 else 0.2))
    return hf


def load_k3nn(checkpoint: Path, dtype: torch.dtype, device: str):
    from k3nn import KimiK3ForConditionalGeneration

    return KimiK3ForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype, device=device)


def vision_dims(hf) -> dict:
    c = hf.config.vision_config
    return {k: getattr(c, k) for k in ("patch_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "intermediate_size", "pos_emb_height", "pos_emb_width", "pos_emb_time")} | {
        "merge_kernel_size": list(c.merge_kernel_size), "text_hidden_size": hf.config.text_config.hidden_size}


# -- inputs ------------------------------------------------------------------------------------------------------

def make_inputs(sizes, patch: int, merge: int, seed: int = 0):
    """(pixel_values [L, 3, p, p] fp32, image_grid_thw [N, 3] int64, source) for random RGB images of ``sizes``."""
    g = torch.Generator().manual_seed(seed)
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    try:
        from transformers.models.kimi_k25 import Kimi_K25ImageProcessor

        enc = Kimi_K25ImageProcessor(patch_size=patch, merge_size=merge)(images=images, return_tensors="pt")
        return enc["pixel_values"], enc["image_grid_thw"], "transformers Kimi_K25ImageProcessor"
    except Exception as e:  # no torchvision (the processor's backend): the same layout built here
        line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        why = f"{type(e).__name__}: {line[:120]}" if line else type(e).__name__
    f = patch * merge
    pixels, grid = [], []
    for img in images:
        x = img.float() / 127.5 - 1.0  # rescale + normalise with mean = std = 0.5, as the processor does
        H, W = x.shape[1:]
        Hp, Wp = math.ceil(H / f) * f, math.ceil(W / f) * f
        x = torch.nn.functional.pad(x, (0, Wp - W, 0, Hp - H))
        h, w = Hp // patch, Wp // patch
        pixels.append(x.view(3, h, patch, w, patch).permute(1, 3, 0, 2, 4).reshape(h * w, 3, patch, patch))
        grid.append([1, h, w])
    return torch.cat(pixels), torch.tensor(grid, dtype=torch.long), f"synthetic, processor layout ({why})"


# -- calls -------------------------------------------------------------------------------------------------------

def hf_features(hf, px, grid) -> torch.Tensor:
    out = hf.model.get_image_features(px, grid)
    parts = getattr(out, "pooler_output", out)
    return torch.cat(list(parts)) if isinstance(parts, (list, tuple)) else parts


def k3nn_features(model, px, grid) -> torch.Tensor:
    return model.image_features(px, grid)


def flops(dims: dict, grid: torch.Tensor) -> float:
    """Multiply-adds ×2 of the tower and projector for these images (attention: QKᵀ and PV over each image)."""
    D, I, n_layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    p, (kh, kw), T = dims["patch_size"], dims["merge_kernel_size"], dims["text_hidden_size"]
    n = grid.prod(-1).double()
    L = float(n.sum())
    per_patch = 2 * 3 * p * p * D + n_layers * 2 * (3 * D * D + D * D + 2 * D * I)
    attn = n_layers * 4 * float((n * n).sum()) * D
    tokens = L / (kh * kw)
    proj = tokens * 2 * (kh * kw * D * kh * kw * D + kh * kw * D * T)
    return L * per_patch + attn + proj


def timed(fn, warmup: int, reps: int, device: str) -> tuple[float, float | None]:
    """(median ms over ``reps`` calls after ``warmup`` calls, peak memory in GiB above the allocation before)."""
    ms, peak = median_call_ms(fn, reps, warmup, device)
    return ms, None if peak is None else peak / 2**30


# -- the run -----------------------------------------------------------------------------------------------------

def run(args) -> tuple[Path, bool]:
    import transformers

    from k3nn.vision.attention import resolve_backend

    dev = args.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 check compares IEEE products
        torch.backends.cudnn.allow_tf32 = False
        device_meta()  # the ceilings first, on an idle GPU (cached for the result file)
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}")

    hf = build_transformers(args.tiny, args.layers, dev, seed=args.seed)
    dims = vision_dims(hf)
    p, (kh, kw) = dims["patch_size"], dims["merge_kernel_size"]
    say(f"transformers model built: vision {dims}")
    hf_attn = getattr(hf.model.vision_tower.config, "_attn_implementation", None) or "default"
    with tempfile.TemporaryDirectory(prefix="k3nn-vision-") as d:
        hf.save_pretrained(d)
        k32 = load_k3nn(Path(d), torch.float32, dev)
        k16 = load_k3nn(Path(d), torch.bfloat16, dev)
    say(f"saved and loaded into k3nn (fp32 and bf16; {k32.load_format})")

    small, large = (32, 64) if args.tiny else (448, 1024)
    b_small = args.batch_448 if args.batch_448 is not None else (4 if args.tiny else 32)
    b_large = args.batch_1024 if args.batch_1024 is not None else (2 if args.tiny else 8)
    mixed = args.mixed or (TINY_MIXED if args.tiny else MIXED)
    cases = [(f"{small}x{small} x{b_small}", [(small, small)] * b_small),
             (f"{large}x{large} x{b_large}", [(large, large)] * b_large),
             (f"mixed x{len(mixed)}", mixed)]
    inputs = {}
    source = None
    for name, sizes in cases:
        px, grid, source = make_inputs(sizes, p, kh, seed=args.seed)
        inputs[name] = (px.to(dev), grid.to(dev))
    say(f"inputs: {source}; grids " + ", ".join(f"{n}: {tuple(g[0].tolist())}.." for n, (_, g) in inputs.items()))

    # -- checks (mixed batch) --------------------------------------------------------------------------------
    checks: dict = {}
    px, grid = inputs[cases[-1][0]]
    with torch.inference_mode():
        ref32 = hf_features(hf, px, grid).float()
        checks["fp32_rel_err"] = rel_err(k3nn_features(k32, px, grid), ref32)
        checks["fp32_ok"] = checks["fp32_rel_err"] <= 1e-4
        del k32
        hf = hf.to(torch.bfloat16)
        px16 = px.to(torch.bfloat16)
        hf16 = hf_features(hf, px16, grid)
        try:
            out16 = k3nn_features(k16, px16, grid)
        except (RuntimeError, ValueError) as e:  # the fast attention path failing: say so, time the SDPA path
            checks["attention_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            say(f"k3nn's attention backend 'auto' failed ({checks['attention_error']}); timing with 'sdpa'")
            k16.vision_tower.attn_backend = "sdpa"
            out16 = k3nn_features(k16, px16, grid)
        checks["bf16_k3nn_vs_fp32"] = rel_err(out16, ref32)
        checks["bf16_transformers_vs_fp32"] = rel_err(hf16, ref32)
        checks["bf16_k3nn_vs_transformers_bf16"] = rel_err(out16, hf16)
        checks["bf16_ok"] = checks["bf16_k3nn_vs_fp32"] <= max(1.5 * checks["bf16_transformers_vs_fp32"], 5e-3)
        tower = k16.vision_tower
        timed_backend = tower.attn_backend
        tower.attn_backend = "eager"
        eager16 = k3nn_features(k16, px16, grid)
        tower.attn_backend = timed_backend
        checks["bf16_attention_vs_eager"] = rel_err(out16, eager16)
        # bf16 noise grows through 27 layers, so the two bf16 runs are each compared with the fp32 reference
        checks["bf16_eager_attention_vs_fp32"] = rel_err(eager16, ref32)
        checks["attention_ok"] = "attention_error" not in checks and \
            checks["bf16_k3nn_vs_fp32"] <= max(1.5 * checks["bf16_eager_attention_vs_fp32"], 5e-3)
    del ref32, hf16, out16, eager16
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    Dh = dims["hidden_size"] // dims["num_attention_heads"]
    probe = torch.empty(1, dims["num_attention_heads"], Dh, device=dev, dtype=torch.bfloat16)
    k3nn_attn = resolve_backend(k16.vision_tower.attn_backend, probe, probe, probe)
    ok = checks["fp32_ok"] and checks["bf16_ok"] and checks["attention_ok"]
    say("checks: " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in checks.items()))

    # -- timing --------------------------------------------------------------------------------------------
    rows = []
    anchor = f"transformers {transformers.__version__} Kimi_K25 get_image_features (attn {hf_attn})"
    for name, _ in cases:
        px, grid = inputs[name]
        px16 = px.to(torch.bfloat16)
        n_img, L = grid.shape[0], int(grid.prod(-1).sum())
        fl = flops(dims, grid.cpu())
        with torch.inference_mode():
            k_ms, k_mem = timed(lambda: k3nn_features(k16, px16, grid), args.warmup, args.reps, dev)
            h_ms, h_mem = timed(lambda: hf_features(hf, px16, grid), args.warmup, args.reps, dev)
        row = dict(case=name, images=n_img, patches=L, tokens=L // (kh * kw), k3nn_ms=round(k_ms, 3),
                   anchor=anchor, anchor_ms=round(h_ms, 3), k3nn_images_per_s=round(n_img / k_ms * 1e3, 2),
                   anchor_images_per_s=round(n_img / h_ms * 1e3, 2), tflops=round(fl / k_ms / 1e9, 2),
                   anchor_tflops=round(fl / h_ms / 1e9, 2),
                   k3nn_peak_mem_gib=None if k_mem is None else round(k_mem, 3),
                   anchor_peak_mem_gib=None if h_mem is None else round(h_mem, 3),
                   image_sizes=sorted({f"{h}x{w}" for h, w in dict(cases)[name]}))
        rows.append(row)
        say(f"{name}: k3nn {k_ms:.2f} ms ({row['k3nn_images_per_s']} img/s) · transformers {h_ms:.2f} ms "
            f"({row['anchor_images_per_s']} img/s) · {h_ms / k_ms:.2f}×")

    meta = dict(suite="vision", transformers=transformers.__version__, dtype="bfloat16", device=dev, tiny=args.tiny,
                vision_config=dims, inputs=source, k3nn_attention=k3nn_attn, transformers_attention=hf_attn,
                warmup=args.warmup, reps=args.reps, checks=checks, checks_ok=ok,
                timing="CUDA events, median" if dev.startswith("cuda") else "perf_counter, median")
    path = write_results("vision", rows, meta, out_dir=args.out)
    print_table(rows)
    say(f"wrote {path}")
    return path, ok


def print_table(rows) -> None:
    head = f"{'case':<18}{'images':>7}{'patches':>9}{'k3nn ms':>10}{'hf ms':>10}{'k3nn img/s':>12}{'hf img/s':>10}" \
           f"{'speedup':>9}{'k3nn GiB':>10}{'hf GiB':>8}{'TFLOP/s':>9}"
    print(head)
    for r in rows:
        mem = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"{r['case']:<18}{r['images']:>7}{r['patches']:>9}{r['k3nn_ms']:>10.2f}{r['anchor_ms']:>10.2f}"
              f"{r['k3nn_images_per_s']:>12.1f}{r['anchor_images_per_s']:>10.1f}{r['speedup']:>8.2f}×"
              f"{mem(r['k3nn_peak_mem_gib']):>10}{mem(r['anchor_peak_mem_gib']):>8}{r['tflops']:>9.1f}")


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        out = [tuple(int(v) for v in item.lower().split("x")) for item in text.split(",") if item.strip()]
    except ValueError:
        out = []
    if not out or any(len(s) != 2 or min(s) < 1 for s in out):
        raise argparse.ArgumentTypeError(f"--mixed takes HxW,HxW,... (positive pixel sizes), got {text!r}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny test tower (patch 4, 2 layers of 32): seconds on CPU")
    ap.add_argument("--layers", type=int, default=None, help="override the tower's depth (default: the config's)")
    ap.add_argument("--batch-448", type=int, default=None, help="images in the small-image batch (default 32)")
    ap.add_argument("--batch-1024", type=int, default=None, help="images in the large-image batch (default 8)")
    ap.add_argument("--mixed", type=_sizes, default=None,
                    help="the mixed batch as HxW,HxW,... pixels (default: 8 sizes from 224x896 to 1024x1024)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="result directory (default $K3NN_RESULTS_DIR or bench/results)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    path, ok = run(parse_args(argv))
    if not ok:
        print(f"CHECK FAILED: {json.loads(path.read_text())['meta']['checks']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
