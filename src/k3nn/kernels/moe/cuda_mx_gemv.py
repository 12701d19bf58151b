"""MXFP4 expert GEMV in CUDA for decode-sized MoE batches (``torch.utils.cpp_extension``, built on first use,
never at import). Same contract as :func:`.triton_mx_gemv.mx_gemv_experts`; the default decode GEMV where
it builds (``KernelTuning.moe_gemv="auto"``; ``"cuda"`` insists, ``"triton"`` opts out); checked against the
eager reference by ``tests/gpu/test_moe_gpu.py`` on the H200.

Weights: packed u8 [E, N, K/2] (two E2M1 per byte, low nibble = even k), E8M0 scales u8 [E, N, K/32]; x, h, y
bf16 or fp16. One CTA computes 16·RT output rows of one expert for the valid rows of one alignment block
(``align.py``, ``block_m`` ∈ {1, 2, 4, 8}, at most 2·NT rows: NT = ceil(block_m/2) n8 tiles is a template
parameter that sizes shared memory); its RT·KS warps split the rows (RT tiles of 16) and K (KS slices of whole
128-k groups = four MX blocks). Each CTA runs only NR ∈ {1, 2, 4} ≤ NT n8 tiles, picked at run time from the
block's last valid row, and stages only those 2·NR activation rows: with :func:`cuda_block_m` sizing blocks to
hold a whole expert (one read of its weights), a block of one or two pairs costs one mma per 16 k, not four.

Per CTA::

    prologue   first weight loads in flight; E8M0 bytes of the CTA's rows → shared memory (raw bytes, decoded
               at use: 0 → 2^-127, 255 → NaN); [down with PDL: griddepcontrol.wait]; the block's 2·NR activation
               rows → shared memory as fp16, each row scaled by 2^(BIAS − e) with 2^e ≤ max|a| < 2^(e+1)
               (bf16/fp16 values stay exact), in the decode's pair order
    loop       per lane and group: one 16-byte load (= one MX block, 32 E2M1) per row and matrix, U groups per
               batch (PF: the next batch is loaded before the current one is used)
    decode     per 32-bit word (8 E2M1) four half2, exact:
               DEC 0  bit placement into fp16 (value · 2^-14; code 1 is the fp16 subnormal 2^-15)
                      x_m = ((w << s_m) & 0x0E000E00) | ((w << s_m + 3) & 0x80008000), s = 9, 5, 1, -3
               DEC 1  bit placement into e4m3 bytes (value · 2^-6), then the sm_89+ e4m3x2 → f16x2 convert
    mma        m16n8k16 f16 → f32 (tensor cores, exact products): A = rows g and g+8 of the warp's tile, the
               k-slots of quad lane q hold block q of the group; B column 4t + j = token t, block j, non-zero only
               on lanes with q = g mod 4 — so each accumulator column is the dot product of ONE MX block
    scale      after the group's 8 mmas (per matrix and token pair): one fp32 FMA per accumulator with its block's
               2^(s−127); a shuffle adds the lane pair's other two blocks. A CTA whose staged E8M0 bytes hold no
               0 (2^-127) or 255 (NaN), i.e. every real checkpoint's, takes 2^(s−127) as the byte shifted into an
               fp32 exponent (``__syncthreads_or`` over the staging decides per CTA; at most two n8 tiles);
               the others decode each byte with its two special cases
    epilogue   K slices summed in shared memory, · 2^e per token (NaN when the row holds Inf/NaN), GLU
               (SiLU/SiTU, ``triton_common._act``) → h in sorted-row order; down: y scattered to flat pair ids

The fp16 activation rounding is exact for bf16 inputs (8 significant bits) and for fp16 inputs, apart from values
below 2^-14 · 2^-(BIAS+1) of the row's max (subnormal in fp16). Products are exact in fp32, each block's sum
is accumulated in fp32 by the tensor core and scaled in fp32.

Launch shape ``CudaGemvConfig(row_tiles, k_split, unroll, prefetch, decode)``; ``mx_gemv_experts_cuda`` and
``mx_gemv_linear_cuda`` take one (default ``DEFAULT_CONFIG``). Every config used must be in the built set:
:func:`build` compiles a set of configs (bf16/fp16, NT ∈ {1, 2, 4}, GLU on/off as template instances) into one
module, the kernels in a torch-free ``.cu`` (nvcc: ``csrc/mx_gemv.cu`` with ``csrc/mx_gemv_args.cuh`` and the
shared ``kernels/csrc/pdl.cuh``, then the generated instance table) and the binding in a ``.cpp`` (host compiler:
``csrc/mx_gemv.cpp``) so the two compile in parallel. Launches are CUDA-graph capturable: no host syncs, no
allocation except the ``h`` buffer.

Weight ring (``CudaGemvConfig.ring`` > 0, sm_90+, ``prefetch`` off, ``unroll`` ≤ 4): instead of register loads,
each warp streams its 16 rows through ``ring`` shared-memory slots of ``unroll`` groups per matrix. Lane 0 fills a
slot with one 2D tile copy per matrix (``cp.async.bulk.tensor`` from a ``cuTensorMap`` of the packed weights,
encoded at launch; zeros past N and K), the slot completes on its own mbarrier, and the warp refills it as soon
as its lanes have read it. The group's decode, mma and scale step is the register loop's. A ring launch stages
min(block_m, tokens) rows per block (:func:`instance_rows`).

Programmatic dependent launch (sm_90+, ``KernelTuning.moe_cuda_pdl``, default True): every up CTA executes
``griddepcontrol.launch_dependents`` first, and the down kernel goes through ``cudaLaunchKernelEx`` with
programmatic stream serialization, so its CTAs start as up CTAs retire, issue their first weight loads and stage
their scales, and only then ``griddepcontrol.wait`` (returns once the whole up grid has completed and its h
writes are visible) before reading h. The alignment arrays they read before the wait were written by a kernel
that completed before the up kernel started. Registers: at most 128 per thread (two 256-thread CTAs per SM); the
four-tile branch of the NT = 4 instance runs without prefetch to fit (a few spill bytes in the GLU kernel).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os
import time
from typing import NamedTuple

import torch

from ...quant.mxfp4 import MXFP4Weight
from ..cuda_ext import clear_stale_build_lock, read_source, toolchain_reason
from ..cuda_ext import smem_per_block as _smem_limit
from ..registry import current_tuning

__all__ = ["CudaGemvConfig", "DEFAULT_CONFIG", "RING_CONFIG", "RING_MAX_TOKENS", "CUDA_SOURCE", "available",
           "supports", "build", "cuda_block_m", "default_configs", "launch_config", "instance_rows", "pdl_enabled",
           "mx_gemv_experts_cuda", "mx_gemv_linear_cuda", "last_build_seconds"]


class CudaGemvConfig(NamedTuple):
    """Launch shape: ``row_tiles`` 16-row tiles per CTA, ``k_split`` warps sharing each tile's K (CTA =
    row_tiles·k_split warps), ``unroll`` 128-k groups per load batch (per ring slot), ``prefetch`` (next batch
    loaded into registers before the current one is decoded), ``decode`` 0 (fp16 bit placement) or 1 (e4m3 bytes +
    hardware convert, sm_89+), ``ring`` 0 (weights loaded into registers) or the shared-memory slots per warp that
    bulk copies fill (sm_90+; ``prefetch`` False)."""

    row_tiles: int = 1
    k_split: int = 2
    unroll: int = 2
    prefetch: bool = True
    decode: int = 0
    ring: int = 0

    def name(self) -> str:
        return (f"r{16 * self.row_tiles} ks{self.k_split} u{self.unroll}{' pf' if self.prefetch else ''}"
                f"{' e4m3' if self.decode else ''}{f' ring{self.ring}' if self.ring else ''}")


#: 64 rows and two K slices per CTA, two groups per batch with prefetch, e4m3 decode: the best of the launch shapes
#: measured at 1, 4 and 16 tokens (``docs/perf.md``). Below sm_89 (no e4m3 convert) :func:`supports` declines
#: decode 1 and the Triton GEMV runs.
DEFAULT_CONFIG = CudaGemvConfig(row_tiles=4, k_split=2, unroll=2, prefetch=True, decode=1)
#: The weight ring for steps of at most ``RING_MAX_TOKENS`` tokens on sm_90+: DEFAULT_CONFIG's CTA with two slots of
#: two groups per warp. The fastest launch shape measured at one and four tokens on the H200 and the H100 (the pair
#: 0.4-1.5% / 4.6-5% faster than DEFAULT_CONFIG on the H200, 4% / 3.7% on the H100); from 16 tokens the staged
#: activations leave room for one CTA per SM and it runs 20% behind (``docs/perf.md``).
RING_CONFIG = CudaGemvConfig(row_tiles=4, k_split=2, unroll=2, prefetch=False, decode=1, ring=2)
RING_MAX_TOKENS = 4

_NTS = (1, 2, 4)  # n8 tiles of the mma = ceil(block_m / 2)
_DTYPES = {torch.bfloat16: ("bf16", "__nv_bfloat16"), torch.float16: ("fp16", "__half")}

#: the kernels: ``csrc/mx_gemv.cu`` with its includes (torch-free; :func:`kernel_source` adds the dispatch table)
CUDA_SOURCE = read_source("moe/csrc/mx_gemv.cu")
#: the binding, compiled by the host compiler with the torch headers
_CPP_SOURCE = read_source("moe/csrc/mx_gemv.cpp")

_DECL = ("void mx_gemv_launch(int64_t cfg, bool glu, torch::Tensor a, torch::Tensor w1, torch::Tensor s1, "
         "torch::Tensor w3, torch::Tensor s3, torch::Tensor out, torch::Tensor sorted, torch::Tensor eid, "
         "torch::Tensor num_rows, int64_t bm, int64_t rows, int64_t top_k, int64_t num_pairs, bool a_by_token, "
         "int64_t act, bool cap, bool scale_vec, double beta, double linear_beta, bool pdl);")


def _dispatch_source(configs: tuple[CudaGemvConfig, ...], dtypes: tuple[str, ...]) -> str:
    """Explicit instances and the (config, dtype, NT, GLU) → launcher table."""
    lines = ["namespace k3mx {", "using LaunchFn = cudaError_t (*)(const Args&, int, cudaStream_t);",
             f"static const LaunchFn kTable[{len(configs)}][2][3][2] = {{"]
    for c in configs:
        dts = []
        for tname, ctype in (("bf16", "__nv_bfloat16"), ("fp16", "__half")):
            nts = []
            for nt in _NTS:
                if tname in dtypes:
                    f = [f"&launch<{ctype}, {nt}, {c.row_tiles}, {c.k_split}, {c.unroll}, {int(c.prefetch)}, "
                         f"{c.decode}, {c.ring}, {glu}>" for glu in ("false", "true")]
                else:
                    f = ["nullptr", "nullptr"]
                nts.append("{" + ", ".join(f) + "}")
            dts.append("{" + ", ".join(nts) + "}")
        lines.append("  {" + ", ".join(dts) + "},")
    lines += ["};",
              "cudaError_t dispatch(int cfg, int dtype, int nt, int glu, const Args& p, int E, cudaStream_t stream) {",
              f"  if (cfg < 0 || cfg >= {len(configs)}) return cudaErrorNotSupported;",
              "  const LaunchFn f = kTable[cfg][dtype][nt][glu];",
              "  return f ? f(p, E, stream) : cudaErrorNotSupported;", "}", "}  // namespace k3mx"]
    return "\n".join(lines) + "\n"


def kernel_source(configs=(DEFAULT_CONFIG,), dtypes=("bf16", "fp16")) -> str:
    """The complete ``.cu`` text for a config set (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE + _dispatch_source(tuple(configs), tuple(dtypes))


def _check_config(cfg: CudaGemvConfig) -> None:
    if not (cfg.row_tiles in (1, 2, 4) and cfg.k_split in (1, 2, 3, 4, 8) and 1 <= cfg.unroll <= 8
            and cfg.row_tiles * cfg.k_split <= 16 and cfg.decode in (0, 1) and 0 <= cfg.ring <= 8
            and not (cfg.ring and (cfg.prefetch or cfg.unroll > 4))):
        raise ValueError(f"mx_gemv_cuda: bad config {cfg} (row_tiles 1/2/4, k_split 1-4/8, unroll 1-8, "
                         f"≤ 16 warps, decode 0/1, ring 0-8 and then no prefetch and unroll ≤ 4)")


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the CUDA GEMV can be built and run here, else the reason."""
    return toolchain_reason((8, 0), "mma.sync m16n8k16")


#: seconds the last :func:`build` spent compiling (0 when the module was already loaded)
last_build_seconds = 0.0


@functools.cache
def _build(configs: tuple[CudaGemvConfig, ...], dtypes: tuple[str, ...]):
    global last_build_seconds
    from torch.utils.cpp_extension import load_inline

    cu = kernel_source(configs, dtypes)
    tag = hashlib.sha1((cu + _CPP_SOURCE).encode()).hexdigest()[:12]
    t0 = time.perf_counter()
    kw = {}
    if "no_implicit_headers" in inspect.signature(load_inline).parameters:  # keep torch headers out of the .cu
        kw["no_implicit_headers"] = True
    clear_stale_build_lock(f"k3nn_mx_gemv_{tag}")
    mod = load_inline(name=f"k3nn_mx_gemv_{tag}", cpp_sources=[_CPP_SOURCE + "\n" + _DECL], cuda_sources=[cu],
                      functions=["mx_gemv_launch"], extra_cflags=["-O2"], extra_cuda_cflags=["-O3"],
                      verbose=os.environ.get("K3NN_BUILD_VERBOSE") == "1", **kw)
    last_build_seconds = time.perf_counter() - t0
    return mod


def build(configs=(DEFAULT_CONFIG,), dtypes=("bf16", "fp16")):
    """Compile (once per process and set; cached on disk by torch) the kernels of ``configs`` for ``dtypes``
    ('bf16', 'fp16'); returns the module. A launch must pass the same ``configs`` tuple (or the default)."""
    configs = tuple(CudaGemvConfig(*c) for c in configs)
    for c in configs:
        _check_config(c)
    bad = [d for d in dtypes if d not in ("bf16", "fp16")]
    if bad:
        raise ValueError(f"mx_gemv_cuda: dtypes must be 'bf16'/'fp16', got {bad}")
    return _build(configs, tuple(dtypes))


def smem_bytes(cfg: CudaGemvConfig, block_m: int, K: int, glu: bool) -> int:
    """Dynamic shared memory of one CTA whose blocks hold up to ``block_m`` rows (mirrors ``Smem`` in the CUDA
    source; the launch sizes it for min(block_m, tokens) rows)."""
    nt = 1 if block_m <= 2 else (2 if block_m == 4 else 4)
    G, bmx, nm, rows = (K + 127) // 128, 2 * nt, 2 if glu else 1, 16 * cfg.row_tiles
    warps = cfg.k_split * cfg.row_tiles
    base = bmx * (G * 128 + 8) * 2 + nm * rows * 4 * (G | 1) + 4 * (warps * nm * bmx * 16 + bmx)
    if not cfg.ring:
        return base
    return -(-base // 128) * 128 + warps * cfg.ring * (nm * 16 * cfg.unroll * 64 + 8)


def _aligned16(t: torch.Tensor, dims=(0, 1)) -> bool:
    return t.data_ptr() % 16 == 0 and all(t.stride(d) % 16 == 0 for d in dims)


def _poisson_tail(lam: float, b: int) -> float:
    """P(X > b) for X ~ Poisson(lam)."""
    term = total = math.exp(-lam)
    for i in range(1, b + 1):
        term *= lam / i
        total += term
    return max(0.0, 1.0 - total)


BLOCK_RULES = ("one-block", "poisson", "mean")


def cuda_block_m(num_pairs: int, num_experts: int, rule: str = "one-block") -> int:
    """Alignment rows per CTA for the CUDA GEMV, from the launch sizes only (CUDA-graph capturable).

    ``one-block`` (the default): 8, so an expert with up to 8 pairs is ONE block and its weights are read once;
    the kernel runs only the n8 tiles a block's valid rows need, so the padding costs no mma work. ``poisson``:
    the smallest of 2, 4, 8 that holds every touched expert's pairs in one block unless the routing is far from
    uniform (E·P(Poisson(P/E) > block_m) ≤ 1/4). ``mean``: the earlier rule, ≈ pairs per touched expert (2 at 16
    tokens, where 3–6 pair experts then take 2–3 blocks and re-read their weights)."""
    if rule == "one-block":
        return 8
    if rule == "mean":
        per = num_pairs / max(1, min(num_experts, num_pairs))
        return 2 if per <= 2.5 else (4 if per <= 4.5 else 8)
    if rule != "poisson":
        raise ValueError(f"cuda_block_m: rule must be one of {BLOCK_RULES}, got {rule!r}")
    lam = num_pairs / max(1, num_experts)
    for bm in (2, 4):
        if num_experts * _poisson_tail(lam, bm) <= 0.25:
            return bm
    return 8


def supports(x, w1, w3, w2, *rest, cfg: CudaGemvConfig | None = None, block_m: int = 8, **kw) -> str | None:
    """None when ``mx_gemv_experts_cuda`` takes these inputs, else the reason (checked before the alignment)."""
    cfg = cfg or DEFAULT_CONFIG
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if x.dtype not in _DTYPES:
        return f"x dtype {x.dtype} is not bf16/fp16"
    if not all(isinstance(w, MXFP4Weight) for w in (w1, w3, w2)):
        return "expert weights are not MXFP4"
    for w in (w1, w3, w2):
        if w.packed.dim() != 3 or w.packed.stride(-1) != 1 or w.scale.stride(-1) != 1:
            return "packed weights and scales must be [E, N, K/2] / [E, N, K/32], contiguous in the last dim"
        if not _aligned16(w.packed):
            return "packed weights need 16-byte aligned rows (base and expert/row strides)"
    if w1.packed.stride() != w3.packed.stride() or w1.scale.stride() != w3.scale.stride():
        return "w1 and w3 must share strides"
    if cfg.decode == 1 and torch.cuda.get_device_capability(x.device) < (8, 9):
        return "decode=1 (e4m3 convert) needs sm_89+"
    if cfg.ring and torch.cuda.get_device_capability(x.device) < (9, 0):
        return "ring > 0 (bulk copies into shared memory) needs sm_90+"
    return _smem_reason(cfg, block_m, x.device, w1.shape[2], w2.shape[2])


def _smem_reason(cfg: CudaGemvConfig, block_m: int, dev, k_up: int, k_down: int) -> str | None:
    """None when both kernels' CTAs fit the device's shared memory, else the reason."""
    lim = _smem_limit(dev)
    for K, glu in ((k_up, True), (k_down, False)):
        need = smem_bytes(cfg, block_m, K, glu)
        if need > lim:
            return f"K={K} needs {need} bytes of shared memory per CTA (limit {lim})"
    return None


def _launch(mod_cfg, cfg, glu, a, w, w3, out, al, top_k, num_pairs, a_by_token, act, cap, beta, linear_beta,
            pdl=False):
    configs, dtypes = mod_cfg
    mod = build(configs, dtypes)
    idx = configs.index(cfg)
    svec = (w.shape[2] // 32) % 16 == 0 and _aligned16(w.scale) and _aligned16(w3.scale)
    mod.mx_gemv_launch(idx, glu, a, w.packed, w.scale, w3.packed, w3.scale, out, al.sorted_ids, al.expert_ids,
                       al.num_rows, al.block_m, instance_rows(cfg, al.block_m, num_pairs, top_k), top_k, num_pairs,
                       a_by_token, act, cap, svec, beta, linear_beta, pdl)


def instance_rows(cfg: CudaGemvConfig, block_m: int, num_pairs: int, top_k: int) -> int:
    """Rows per block that the launched instance stages (it runs ceil(rows / 2) n8 tiles at most). The register
    loop takes ``block_m``: on the H200 its one- and two-tile instances ran 4-15% slower at 1-4 tokens than the
    four-tile instance running one or two tiles (``docs/perf.md``). The ring takes min(block_m, tokens), since a
    token routes to an expert once: its slots need the shared memory that fewer staged rows free. A block that holds
    more (duplicate experts in one token) comes back NaN."""
    if not cfg.ring:
        return block_m
    return max(1, min(block_m, -(-num_pairs // max(1, top_k))))


def default_configs(dev) -> tuple[CudaGemvConfig, ...]:
    """The launch shapes :func:`mx_gemv_experts_cuda` builds into one module on this device when given none:
    ``DEFAULT_CONFIG``, and ``RING_CONFIG`` on sm_90+."""
    if torch.cuda.get_device_capability(dev) >= (9, 0):
        return (DEFAULT_CONFIG, RING_CONFIG)
    return (DEFAULT_CONFIG,)


def launch_config(x, w1, w2, tokens: int, block_m: int) -> CudaGemvConfig:
    """The launch shape for ``tokens`` rows per expert at most (tokens, or rows when ``top_k`` is 1):
    ``RING_CONFIG`` up to ``RING_MAX_TOKENS`` where it runs (sm_90+, its shared memory), else ``DEFAULT_CONFIG``.
    Decided from shapes only (CUDA-graph capturable); the checks the two share are :func:`supports`'."""
    if (tokens <= RING_MAX_TOKENS and RING_CONFIG in default_configs(x.device)
            and _smem_reason(RING_CONFIG, block_m, x.device, w1.shape[2], w2.shape[2]) is None):
        return RING_CONFIG
    return DEFAULT_CONFIG


def pdl_enabled(dev) -> bool:
    """Whether the down GEMV is launched as a programmatic dependent of the up GEMV:
    ``KernelTuning.moe_cuda_pdl`` (read at each call; default True) on sm_90+."""
    return current_tuning().moe_cuda_pdl and torch.cuda.get_device_capability(dev) >= (9, 0)


def _module_for(cfg: CudaGemvConfig, configs, dtypes):
    if configs is None:
        configs = (DEFAULT_CONFIG,) if cfg == DEFAULT_CONFIG else (DEFAULT_CONFIG, cfg)
    configs = tuple(CudaGemvConfig(*c) for c in configs)
    if cfg not in configs:
        raise ValueError(f"mx_gemv_cuda: config {cfg} is not in the built set {configs}")
    return configs, tuple(dtypes)


def mx_gemv_experts_cuda(x: torch.Tensor, w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight, al, y2: torch.Tensor,
                         num_pairs: int, top_k: int, act: int, cap: bool, beta: float, linear_beta: float,
                         cfg_up: CudaGemvConfig | None = None, cfg_down: CudaGemvConfig | None = None,
                         configs=None, dtypes=("bf16", "fp16"), pdl: bool | None = None) -> None:
    """Up (w1/w3 + GLU, act 0 SiLU / 1 SiTU, ``cap``: linear_beta·tanh(u/linear_beta)) and down (w2) over the
    alignment ``al`` (block_m ∈ {1, 2, 4, 8}); writes y2 [P, D] at flat pair ids (x.dtype). A config not given
    is :func:`launch_config`'s for the step's tokens. ``configs``: the built set the two configs belong to
    (default: :func:`default_configs` and the two configs). ``pdl``: launch the down kernel as a programmatic
    dependent of the up kernel (default :func:`pdl_enabled`); two launches, no other work."""
    bm = al.block_m
    if bm not in (1, 2, 4, 8):
        raise ValueError(f"mx_gemv_cuda: block_m must be 1, 2, 4 or 8, got {bm}")
    auto = None if cfg_up and cfg_down else launch_config(x, w1, w2, -(-num_pairs // max(1, top_k)), bm)
    cu, cd = CudaGemvConfig(*(cfg_up or auto)), CudaGemvConfig(*(cfg_down or auto))
    if configs is None:
        configs = tuple(dict.fromkeys(default_configs(x.device) + (cu, cd)))
    mc = _module_for(cu, configs, dtypes)
    _module_for(cd, configs, dtypes)
    why = supports(x, w1, w3, w2, cfg=cu, block_m=bm)
    if why:
        raise ValueError(f"mx_gemv_cuda: {why}")
    if x.data_ptr() % 16 or x.stride(-1) != 1 or x.stride(0) % 8:
        x = x.contiguous()
    nb = al.expert_ids.numel()
    I = w1.packed.shape[1]
    h = torch.empty(nb * bm, I, dtype=x.dtype, device=x.device)
    _launch(mc, cu, True, x, w1, w3, h, al, top_k, num_pairs, True, act, cap, beta, linear_beta)
    if pdl is None:
        pdl = pdl_enabled(x.device)
    pdl = bool(pdl) and torch.cuda.get_device_capability(x.device) >= (9, 0)
    _launch(mc, cd, False, h, w2, w2, y2, al, top_k, num_pairs, False, act, cap, beta, linear_beta, pdl)


def mx_gemv_linear_cuda(a: torch.Tensor, w: MXFP4Weight, cfg: CudaGemvConfig | None = None, block_m: int = 2,
                        configs=None, dtypes=("bf16", "fp16")) -> torch.Tensor:
    """``a @ W.T`` for one MXFP4 matrix W [N, K] (a [M, K] bf16/fp16) through the down kernel (mirrors
    ``triton_mx_gemv.mx_gemv_linear``): the decode/accumulate path on its own, for tests and micro-benchmarks."""
    from .align import MoEAlignment

    cfg = CudaGemvConfig(*(cfg or DEFAULT_CONFIG))
    if configs is None:
        configs = tuple(dict.fromkeys((DEFAULT_CONFIG, cfg)))
    mc = _module_for(cfg, configs, dtypes)
    if block_m not in (1, 2, 4, 8):
        raise ValueError(f"mx_gemv_cuda: block_m must be 1, 2, 4 or 8, got {block_m}")
    p, s = w.packed[None], w.scale[None]
    W3 = MXFP4Weight(p, s)
    why = supports(a, W3, W3, W3, cfg=cfg, block_m=block_m)
    if why:
        raise ValueError(f"mx_gemv_cuda: {why}")
    if a.data_ptr() % 16 or a.stride(-1) != 1 or a.stride(0) % 8:
        a = a.contiguous()
    M, N = a.shape[0], p.shape[1]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M == 0:
        return out
    nb = -(-M // block_m)
    dev = a.device
    sorted_ids = torch.full((nb * block_m,), M, dtype=torch.int32, device=dev)
    sorted_ids[:M] = torch.arange(M, dtype=torch.int32, device=dev)
    al = MoEAlignment(sorted_ids, torch.zeros(nb, dtype=torch.int32, device=dev),
                      torch.tensor([nb * block_m], dtype=torch.int32, device=dev), block_m)
    _launch(mc, cfg, False, a, W3, W3, out, al, 1, M, False, 0, False, 1.0, 1.0)
    return out
