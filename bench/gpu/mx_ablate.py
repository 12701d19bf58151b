#!/usr/bin/env python3
"""Where the CUDA MXFP4 GEMV's time goes: the default launch shape built from its source and from ablated copies
of it, timed side by side (K3 routed experts, 3584 → 3072 gate+up → 3584, top-16 of 128, bf16):

    source        the kernel as shipped (checked against the eager reference)
    no-compute    the loop loads every weight batch but only XOR-folds it (no decode, mma or scale step)
    no-staging    no E8M0 scales or activations staged (the loop reads whatever shared memory holds)
    stream-only   both: the kernel's loads, prologue metadata and epilogue, nothing else
    no-loads      the register loop's weight loads replaced by values made from their addresses (the arithmetic,
                  staging and epilogue without the weight stream: the SM side's time alone)

``--ablations NAMES`` picks among these (each timed with every launch shape given), and ``--layouts`` adds what a
prepared weight layout would buy (timing only: the weights are read as if
stored that way, so the outputs are wrong):

    convert-free  decode 1's bit placement, each half2 then built by a byte permute (PRMT) instead of the
                  e4m3 convert (F2FP): the convert pipe's share
    e5m2-layout   the E2M1 bits of each byte pre-placed so that one mask gives four fp16 high bytes and two
                  shifts and a mask the other four, then four byte permutes: 9 integer ops per word against
                  7 plus 4 converts (the cheapest bit-level layout found)
    tiled         each 16-row tile read group by group (a warp's 16-byte loads cover 512 contiguous bytes
                  instead of 8 rows × 64 bytes)
    tiled+e5m2    both

``--loads L2::128B,L2::256B`` times the shipped source with each L2 prefetch size on its weight loads (checked
variants: the outputs do not change). ``--occupancy NAME=FLOOR_KB,CARVEOUT`` times the shipped source with a floor
on each CTA's shared memory (to cap CTAs per SM) and a fixed L1 / shared carveout. ``--min-blocks 3,4`` compiles it
for that many resident CTAs per SM (``__launch_bounds__``'s second argument). ``--decodes 0,1`` times the shipped
source with each decode mode (``CudaGemvConfig.decode``), ``--no-ablations`` leaves the ablated copies out.
``--source NAME=PATH[@RT,KS,U,PF,DEC...]`` adds a complete kernel source (e.g. an earlier version, expanded by
``read_source``) as one more checked variant, built once with the launch shapes after its ``@``s (default: the
first ``--config``) and timed with each; a ``PATH.cpp`` beside it is built as its binding (a source with another
``Args`` layout or launch rule). ``--block-m 8,tokens`` times alignment block sizes side by side, ``--config
RT,KS,U,PF,DEC`` replaces the default launch shape for every variant; given more than once, it times each launch
shape (with each of ``--decodes``) in the same process. The ablations change timing only; their outputs are
meaningless. One GPU check:

    python3 -m bench.gpu.mx_ablate [--tokens 1,4,16] [--source base=old.cu]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch

from k3nn.kernels.moe import cuda_mx_gemv as cmx
from k3nn.kernels.moe.align import align_for
from k3nn.kernels.moe.reference import moe_expert_outputs_reference

from bench.common import device_meta, graph_bench_ms, rel_err
from bench.gpu.moe_mx import BETA, D, I, LIN, TOPK, make_weights

print = functools.partial(print, flush=True)

_LOOP_START = "  float c[NM][NR][4];\n"  # group_step's body: decode, mma and scale of one group
_LOOP_END = "\n// Step 6: quad reduction"
_FOLD = """  (void)gr;
  (void)L;
#pragma unroll
  for (int m = 0; m < NM; ++m)
    acc[m][0][0] += __uint_as_float((w[m][0].x ^ w[m][0].y ^ w[m][0].z ^ w[m][0].w ^ w[m][1].x ^ w[m][1].y ^
                                     w[m][1].z ^ w[m][1].w) & 0x3F7FFFFFu);
}
"""
_CVT = ('    asm("{.reg .b16 l, h;\\n mov.b32 {l, h}, %2;\\n cvt.rn.f16x2.e4m3x2 %0, l;\\n cvt.rn.f16x2.e4m3x2 %1, h;\\n}"\n'
        '        : "=r"(x[I]), "=r"(x[J]) : "r"(V));\n')
_PRMT = "    x[I] = __byte_perm(V, 0u, 0x1404);\n    x[J] = __byte_perm(V, 0u, 0x3424);\n"
_PLACE = ("    const uint32_t ev = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);  // e0 e2 e4 e6\n"
          "    const uint32_t od = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);         // e1 e3 e5 e7\n")
_E5M2 = ("    const uint32_t ev = w & 0x8E8E8E8Eu, raw = w & 0x71717171u;\n"
         "    const uint32_t od = ((raw << 1) | (raw >> 2)) & 0x8E8E8E8Eu;\n")
_TILED = (("ld_stream(wr[m][0] + b)", "ld_stream(wr[m][0] + ((b - q) << 4) + q)"),
          ("ld_stream(wr[m][1] + b)", "ld_stream(wr[m][1] + ((b - q) << 4) + q)"),
          ("(b0 + (long long)r0 * p.wsn)", "(b0 + (long long)(n0 + rt * 16) * p.wsn + 64 * g)"),
          ("(b0 + (long long)r1 * p.wsn)", "(b0 + (long long)(n0 + rt * 16) * p.wsn + 512 + 64 * g)"),
          ("(b3 + (long long)r0 * p.wsn)", "(b3 + (long long)(n0 + rt * 16) * p.wsn + 64 * g)"),
          ("(b3 + (long long)r1 * p.wsn)", "(b3 + (long long)(n0 + rt * 16) * p.wsn + 512 + 64 * g)"))
LAYOUTS = ("convert-free", "e5m2-layout", "tiled", "tiled+e5m2")
_STAGE_SCALES = ("  // 2. E8M0 bytes", "  if constexpr (!GLU) pdl_wait();")
_STAGE_ACT = ("  // 3. activations of the staged rows", "  // 5-6. stream the weights")


class _Source(str):
    """A kernel source that brings its own binding (``.cpp``)."""

    cpp: str = ""


def _cut(src: str, start: str, end: str, new: str) -> str:
    """``src`` with the text from ``start`` up to (not including) ``end`` replaced by ``new``; each marker once."""
    if src.count(start) != 1 or src.count(end) != 1:
        raise ValueError(f"mx_ablate: the source no longer has exactly one {start!r} / {end!r}")
    a = src.index(start)
    b = src.index(end, a)
    return src[:a] + new + src[b:]


def _swap(src: str, old: str, new: str) -> str:
    if src.count(old) != 1:
        raise ValueError(f"mx_ablate: the source no longer has exactly one {old!r}")
    return src.replace(old, new)


def layout(src: str, name: str) -> str:
    """``src`` reading its weights as a prepared layout would (``LAYOUTS``; timing only)."""
    if name not in LAYOUTS:
        raise ValueError(f"mx_ablate: layout must be one of {LAYOUTS}, got {name!r}")
    if name != "tiled":
        for i, j, v in ((0, 1, "ev"), (2, 3, "od")):
            src = _swap(src, *(t.replace("[I]", f"[{i}]").replace("[J]", f"[{j}]").replace("(V", f"({v}")
                               for t in (_CVT, _PRMT)))
    if name in ("e5m2-layout", "tiled+e5m2"):
        src = _swap(src, _PLACE, _E5M2)
    if name.startswith("tiled"):
        for old, new in _TILED:
            src = _swap(src, old, new)
    return src


#: name -> (compute, staging, loads) kept
_ABLATIONS = {"no-compute": (False, True, True), "no-staging": (True, False, True), "stream-only": (False, False, True),
              "no-loads": (True, True, False)}
_LOAD = "ld_stream(wr[m][{}] + b)"
_FAKE = """__device__ __forceinline__ uint4 fake_load(const uint4* p) {  // mx_ablate no-loads: no memory access
  const uint32_t a = (uint32_t)reinterpret_cast<uintptr_t>(p);
  return make_uint4(a, a * 3u, a ^ 0x5A5A5A5Au, a + 0x01234567u);
}

"""


def layout_variant(src: str, name: str) -> str:
    """A ``--layouts`` entry: a layout of ``LAYOUTS``, optionally with one ablation after a ``+`` (e.g.
    ``tiled+no-compute``: how fast that layout's loads stream without the arithmetic)."""
    base, _, abl = name.rpartition("+")
    if abl not in _ABLATIONS:
        return layout(src, name)
    return ablated(layout(src, base), *_ABLATIONS[abl])


def _label(name: str, cfg, shapes) -> str:
    """A variant's name, with its launch shape when several are timed."""
    return name if len(shapes) == 1 else f"{name} {_shape(cfg)}"


def _shape(cfg) -> str:
    """A launch shape as given on the command line: RT,KS,U,PF,DEC,..."""
    return ",".join(str(int(v)) for v in cfg)


def ablated(src: str, compute: bool, staging: bool, loads: bool = True) -> str:
    if not loads:
        for r in (0, 1):
            src = _swap(src, _LOAD.format(r), _LOAD.format(r).replace("ld_stream", "fake_load"))
        word = "__device__ __forceinline__ uint32_t word("
        src = _swap(src, word, _FAKE + word)
    if not compute:
        src = _cut(src, _LOOP_START, _LOOP_END, _FOLD)
    if not staging:
        src = _cut(src, *_STAGE_SCALES, "  if (tid < BMX) amx[tid] = 0u;\n  bool special = false;\n")
        src = _cut(src, *_STAGE_ACT, "  __syncthreads();\n")
    return src


_LDG = "ld.global.nc.L1::no_allocate.v4.u32"
LOAD_HINTS = ("L2::64B", "L2::128B", "L2::256B")


def load_hint(src: str, hint: str) -> str:
    """``src`` whose weight loads ask L2 for ``hint`` (``LOAD_HINTS``) bytes around each access."""
    if hint not in LOAD_HINTS:
        raise ValueError(f"mx_ablate: load hint must be one of {LOAD_HINTS}, got {hint!r}")
    return _swap(src, _LDG, _LDG.replace(".v4", f".{hint}.v4"))


_SMEM_LINE = "  const size_t smem = S::total(G, RING, Ring<S::NM, U, RING>::SLOT);\n"
_KERN_LINE = "  auto kern = mx_gemv_kernel<T, NT, RT, KS, U, PF, DEC, RING, GLU>;\n"


def occupancy(src: str, floor_kb: int, carveout: int) -> str:
    """``src`` whose launches ask for at least ``floor_kb`` KB of shared memory per CTA (fewer CTAs per SM) and,
    with ``carveout`` ≥ 0, that percentage of the unified L1 / shared memory as shared (set once per kernel)."""
    new = _SMEM_LINE
    if floor_kb > 0:
        new = _SMEM_LINE.replace("const size_t smem = ", "const size_t need = ") + (
            f"  const size_t smem = need > {floor_kb * 1024}u ? need : (size_t){floor_kb * 1024};\n")
    src = _cut(src, _SMEM_LINE, _KERN_LINE, new)
    if carveout >= 0:
        src = src.replace(_KERN_LINE, _KERN_LINE + f"""  static bool carve = false;
  if (!carve) {{
    const cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, {carveout});
    if (e != cudaSuccess) return e;
    carve = true;
  }}
""")
    return src


_MIN_BLOCKS = "MinBlocks<32 * RT * KS>::value"


def min_blocks(src: str, n: int) -> str:
    """``src`` whose kernels ask ptxas for ``n`` resident CTAs per SM (``__launch_bounds__``'s second argument:
    at most 65536 / (n · threads) registers per thread) instead of ``MinBlocks``' 512 threads per SM."""
    if n < 1:
        raise ValueError(f"mx_ablate: --min-blocks takes positive CTA counts, got {n}")
    return _swap(src, _MIN_BLOCKS, str(n))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--source", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--config", action="append", default=[], metavar="RT,KS,U,PF,DEC",
                    help="launch shape of every variant (default: DEFAULT_CONFIG); repeat it to time several")
    ap.add_argument("--decodes", default="", help="decode modes of the shipped source to time side by side "
                    "(e.g. 0,1; default: the launch shape's)")
    ap.add_argument("--no-ablations", action="store_true", help="the checked variants only")
    ap.add_argument("--ablations", default=",".join(_ABLATIONS), help="which ablated copies to time, comma-separated")
    ap.add_argument("--layouts", default="", help=f"prepared-layout timings to add, comma-separated: {LAYOUTS}, "
                    f"each optionally with +ABLATION ({', '.join(_ABLATIONS)})")
    ap.add_argument("--loads", default="", help=f"L2 prefetch sizes of the weight loads to time as checked "
                    f"variants, comma-separated: {LOAD_HINTS}")
    ap.add_argument("--occupancy", action="append", default=[], metavar="NAME=FLOOR_KB,CARVEOUT",
                    help="the shipped source with at least FLOOR_KB of shared memory per CTA and CARVEOUT %% of "
                    "L1 as shared memory (-1: the driver's choice), as one more checked variant; repeatable")
    ap.add_argument("--min-blocks", default="", help="resident CTAs per SM to compile the shipped source for, "
                    "comma-separated (e.g. 3,4); each timed with every launch shape")
    ap.add_argument("--block-m", default="", help="alignment rows per block to time side by side: numbers, or "
                    "'tokens' (the smallest of 2, 4, 8 that holds T; default: cuda_block_m's)")
    args = ap.parse_args()
    t0 = time.time()
    dev, E = "cuda", args.experts
    meta = device_meta()
    copy = meta["copy_tbps"]
    print(f"{meta['gpu']} torch {meta['torch']}: copy {copy} TB/s")
    shipped, shipped_cpp = cmx.CUDA_SOURCE, cmx._CPP_SOURCE
    bases = [cmx.CudaGemvConfig(*(int(v) for v in c.split(","))) for c in args.config] or [cmx.DEFAULT_CONFIG]
    base = bases[0]
    decodes = [int(d) for d in args.decodes.split(",") if d]
    shapes = [b._replace(decode=d) for b in bases for d in decodes or [b.decode]]  # of the shipped source
    variants = []
    for cfg in shapes:
        if len(bases) > 1:
            name = _shape(cfg)
        else:
            name = f"source d{cfg.decode}" if len(decodes) > 1 else "source"
        variants.append((name, shipped, True, cfg))
    for spec in args.source:
        name, path = spec.split("=", 1)
        path, *given = path.split("@")
        text = open(path).read()
        if os.path.exists(path + ".cpp"):  # the source's own binding (e.g. an earlier Args layout)
            text = _Source(text)
            text.cpp = open(path + ".cpp").read()
        for c in given or [_shape(base)]:
            variants.append((f"{name} {c}" if given else name, text, True,
                             cmx.CudaGemvConfig(*(int(v) for v in c.split(",")))))
    for hint in (h for h in args.loads.split(",") if h):
        text = load_hint(shipped, hint)
        for b in (b for b in bases if not b.ring):  # a ring's weights arrive by tensor copies, not these loads
            name = hint if len(bases) == 1 else f"{hint} {_shape(b)}"
            variants.append((name, text, True, b))
    for spec in args.occupancy:
        name, vals = spec.split("=", 1)
        floor_kb, carveout = (int(v) for v in vals.split(","))
        variants.append((name, occupancy(shipped, floor_kb, carveout), True, base))
    for n in (int(v) for v in args.min_blocks.split(",") if v):
        text = min_blocks(shipped, n)
        for cfg in shapes:
            variants.append((_label(f"min{n}", cfg, shapes), text, True, cfg))
    for name in (n for n in args.layouts.split(",") if n):
        variants.append((name, layout_variant(shipped, name), False, base))
    if not args.no_ablations:
        for name in (n for n in args.ablations.split(",") if n):
            if name not in _ABLATIONS:
                raise SystemExit(f"mx_ablate: --ablations takes {', '.join(_ABLATIONS)}, got {name!r}")
            text = ablated(shipped, *_ABLATIONS[name])
            for cfg in shapes:  # with every launch shape timed above
                variants.append((_label(name, cfg, shapes), text, False, cfg))
    q1, q3, q2 = make_weights(dev, E)
    up_b, dn_b = q1[0].nbytes() + q3[0].nbytes(), q2[0].nbytes()
    g = torch.Generator(device=dev).manual_seed(1)
    cases = []
    for T in (int(t) for t in args.tokens.split(",")):
        z = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randn(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices
        P = T * TOPK
        ref = moe_expert_outputs_reference(z, q1, q3, q2, ids, "situ", BETA, LIN).float().reshape(P, D)
        touched = torch.unique(ids).numel()
        for bm in args.block_m.split(",") if args.block_m else [str(cmx.cuda_block_m(P, E))]:
            bm = min(b for b in (2, 4, 8) if b >= min(T, 8)) if bm == "tokens" else int(bm)
            cases.append((T, bm, z, align_for(ids, E, bm), P, touched, ref))
    built = None
    for name, src, check, cfg in variants:
        configs = tuple(dict.fromkeys(c for _, s, _, c in variants if s is src))  # one build per source text
        if built is None or built[0] is not src or built[1] != configs:  # by identity: equal texts, other bindings
            cmx.CUDA_SOURCE = src
            cmx._CPP_SOURCE = getattr(src, "cpp", "") or shipped_cpp
            cmx._build.cache_clear()
            cmx.build(configs, ("bf16",))
            built = (src, configs)
            print(f"-- {name}: built ({len(configs)} launch shapes) in {cmx.last_build_seconds:.1f}s  "
                  f"[t={time.time() - t0:.0f}s]")
        else:
            print(f"-- {name}")
        for T, bm, z, al, P, touched, ref in cases:
            h = torch.empty(al.expert_ids.numel() * al.block_m, I, dtype=z.dtype, device=dev)
            y = torch.full((P, D), float("nan"), dtype=z.dtype, device=dev)
            mc = (configs, ("bf16",))

            def up():
                cmx._launch(mc, cfg, True, z, q1, q3, h, al, TOPK, P, True, 1, True, BETA, LIN)

            def down():
                cmx._launch(mc, cfg, False, h, q2, q2, y, al, TOPK, P, False, 1, True, BETA, LIN, False)

            def pair():
                cmx.mx_gemv_experts_cuda(z, q1, q3, q2, al, y, P, TOPK, 1, True, BETA, LIN, cfg, cfg,
                                         configs=configs, dtypes=("bf16",))

            pair()
            torch.cuda.synchronize()
            err = f"rel_err {rel_err(y.float(), ref):.1e}" if check else "(ablated)"
            us = [graph_bench_ms(f, inner=20, rep=10) * 1e3 for f in (up, down, pair)]
            fu, fd = touched * up_b / us[0] / 1e6 / copy, touched * dn_b / us[1] / 1e6 / copy
            fp = touched * (up_b + dn_b) / us[2] / 1e6 / copy
            print(f"   T={T:2d} bm={bm} {name:12s} up {us[0]:6.1f} us {fu:6.1%} | down {us[1]:6.1f} us {fd:6.1%} | "
                  f"pair {us[2]:6.1f} us {fp:6.1%} | {err}")
    cmx.CUDA_SOURCE, cmx._CPP_SOURCE = shipped, shipped_cpp
    cmx._build.cache_clear()
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
