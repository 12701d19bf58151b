"""CUDA absorbed MLA decode over the paged latent cache, split-KV (``torch.utils.cpp_extension.load_inline``,
built on first use, never at import). Sources: ``csrc/mla_decode.cu`` (stage 2, launches, dispatch; torch-free)
with ``csrc/mla_wgmma.cuh`` (stage 1), ``csrc/mla_params.cuh`` and the shared ``kernels/csrc`` helpers, and the
binding ``csrc/mla_decode.cpp``; :func:`kernel_source` is the whole ``.cu`` text the build compiles.

Same contract as :func:`k3nn.ops.mla_decode` (see :mod:`.reference`), for the K3 dims: latent r = 512, rope
dr = 64 (one 576-wide cache row per token), bf16 or fp16 inputs, fp32 accumulation.

Stage 1 is the warp-group kernel (built for sm_90a): 64 query rows of one request (rows are ``(t, h)`` pairs; all
share every key row — MQA) and one contiguous slice of its keys per CTA, grid ``[ceil(Tq·H / 64), splits, B]``, two
specialized warp groups, Q and two 64-key tiles in shared memory in the 128-byte swizzled layout that ``wgmma``
descriptors and TMA boxes share. Group 0 computes the scores of a whole tile (``wgmma m64n64k16``), the online
softmax (fp32, base 2, lazy rescale) and P, then ``O[:, :256] += P·V`` with P from its registers; group 1 loads the
key tiles (TMA into an mbarrier per buffer, or ``cp.async`` where pages are not multiples of 16 rows) and computes
``O[:, 256:] += P·V`` from a shared P tile under group 0's next scores (see ``csrc/mla_wgmma.cuh``).

With one split stage 1 writes o and lse; otherwise it writes fp32 partials (o only for rows that saw a key) and
stage 2, grid ``[Tq·H, B, 4]`` (one warp per 128 columns of a row), merges them exactly
(``lse = log Σ exp lse_s``, ``o = Σ exp(lse_s − lse) o_s``). A row that sees no key ends with o = 0 and
lse = −inf.

Cluster merge (warp-group kernel, :func:`wgmma_plan`): ``C`` consecutive splits of a row tile run as one thread-block
cluster (2 to 8 CTAs; ``cluster=`` or :attr:`KernelTuning.mla_cluster <k3nn.kernels.registry.KernelTuning>`). Each
CTA stages its normalized rows and their lse in its shared memory; after a cluster barrier, each CTA of the cluster
merges its ``ceil(64 / C)`` rows of all ``C`` tiles through distributed shared memory (the same weights as stage 2)
and writes one partial per cluster, or o and lse when the cluster holds every split. By default a call whose splits
are 2 to 8 runs them as one cluster when every row tile's cluster is resident at once, so no combine kernel runs;
more splits than one cluster holds go to the combine kernel (merging those in clusters first gained nothing).

The split count and cluster size depend only on ``B``, ``Tq·H``, the block table's width and the device (about one
wave of CTAs, one per SM; the clusters the device keeps resident, asked once per size), never on lengths read from
the device, and the launches allocate only through ``torch.empty``: calls can be captured in a CUDA graph.

Availability: an sm_90 GPU (H100 / H200) and nvcc (``CUDA_HOME`` or on PATH). ``auto`` takes the kernel except for
calls of one 64-row block per request (Tq·H ≤ 64) and fewer than :data:`MIN_ROW_CTAS` requests, which go to the
Triton kernel, faster there (:func:`auto_skip`); an explicit ``k3nn.backend("cuda")`` runs every call it supports.
Measurements: ``docs/perf.md``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..cuda_ext import load_inline_module, read_source, toolchain_reason
from ..registry import current_tuning
from ..cuda_ext import sm_count as _sm_count
from ..cuda_ext import smem_per_block as _smem_limit

__all__ = [
    "CLUSTERS",
    "MAX_SPLITS",
    "SMEM_BYTES_WGMMA",
    "WG_BLOCK_N",
    "auto_skip",
    "available",
    "build",
    "cluster_choice",
    "default_num_splits",
    "kernel_source",
    "max_clusters",
    "mla_decode_cuda",
    "supports",
    "wgmma_plan",
]

R, DR = 512, 64  # the only dims compiled
MAX_SPLITS = 256
#: under ``auto``, calls of one 64-row block per request (Tq·H ≤ 64) and fewer requests than this stay on the
#: Triton kernel, which is faster for them (with two row blocks per request the wgmma kernel is faster even at
#: B=1)
MIN_ROW_CTAS = 2
CLUSTERS = tuple(range(1, 9))  # CTAs per cluster of the wgmma kernel's cluster merge (1: none; 8: the portable limit)
#: splits a short block table may still get (two key tiles each) where the 8-tile rule leaves fewer
SHORT_SPLITS = 16
#: key tiles per split at least, with the cluster merge (its partials cost less: smaller splits pay off)
CLUSTER_MIN_TILES = 4
#: by default, a row tile's splits may shrink to this fraction of the plain rule's to fit one resident cluster
CLUSTER_SHRINK = 0.85
WG_BLOCK_N = 64  # keys per tile of the wgmma kernel (one page)
#: shared memory of the wgmma kernels: alignment slack, Q and two key tiles as 128-byte swizzle atoms, P, row
#: stats, two mbarriers
SMEM_BYTES_WGMMA = 1024 + 3 * 9 * 64 * 128 + 64 * 128 + 3 * 64 * 4 + 16

_IN_CODES = {torch.bfloat16: 0, torch.float16: 1}
_OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_LOG2E = 1.4426950408889634


def _wgmma_ops() -> str:
    """The wgmma wrappers (scores m64n64k16, K-major B; output m64n256k16, MN-major B, with A from shared memory or
    from registers; bf16 and fp16 inputs): generated, as each names every accumulator register; they take the
    ``// @generated wgmma_ops`` line of ``csrc/mla_wgmma.cuh``."""
    out = []
    for ty, ptx in (("bf16", "bf16"), ("f16", "f16")):
        k = 128
        regs = ", ".join(f"%{i}" for i in range(k))
        outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
        out.append(  # A (P) from registers: the m64k16 fragment layout of the score accumulators
            f"__device__ __forceinline__ void wg_pvr_{ty}(float (&d)[{k}], const uint32_t (&a)[4], uint64_t db) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 5}, 0;\\n"\n'
            f'               "wgmma.mma_async.sync.aligned.m64n256k16.f32.{ptx}.{ptx} {{{regs}}}, '
            f'{{%{k}, %{k + 1}, %{k + 2}, %{k + 3}}}, %{k + 4}, p, 1, 1, 1;\\n}}\\n"\n'
            f'               : {outs}\n'
            f'               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));\n'
            f"}}")
        for name, n, trans_b in (("qk", 64, 0), ("pv", 256, 1)):
            k = n // 2
            regs = ", ".join(f"%{i}" for i in range(k))
            outs = ", ".join(f'"+f"(d[{i}])' for i in range(k))
            out.append(
                f"__device__ __forceinline__ void wg_{name}_{ty}(float (&d)[{k}], uint64_t da, uint64_t db) {{\n"
                f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{k + 2}, 0;\\n"\n'
                f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{{regs}}}, %{k}, %{k + 1}, '
                f'p, 1, 1, 0, {trans_b};\\n}}\\n"\n'
                f'               : {outs}\n'
                f'               : "l"(da), "l"(db), "r"(1));\n'
                f"}}")
    return "\n".join(out)


#: the complete ``.cu`` text: ``csrc/mla_decode.cu`` with its includes and the generated wgmma wrappers
CUDA_SOURCE = read_source("mla/csrc/mla_decode.cu", wgmma_ops=_wgmma_ops())
#: the binding, compiled by the host compiler with the torch headers
_CPP_SOURCE = read_source("mla/csrc/mla_decode.cpp")

_DECL = ("void mla_decode_launch(torch::Tensor q_lat, torch::Tensor q_rope, torch::Tensor kv, torch::Tensor bt, "
         "torch::Tensor seq, std::optional<torch::Tensor> vis, torch::Tensor out, torch::Tensor lse, "
         "std::optional<torch::Tensor> o_part, std::optional<torch::Tensor> lse_part, double scale_log2, "
         "int64_t splits, int64_t in_dt, int64_t out_dt, int64_t cluster);\n"
         "int64_t mla_max_clusters(int64_t device, int64_t cluster, int64_t in_dt);")


def kernel_source() -> str:
    """The complete ``.cu`` text (torch-free: compiles with plain nvcc)."""
    return CUDA_SOURCE


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """None when the kernel can be built and run on this machine, else the reason."""
    why = toolchain_reason((9, 0), "wgmma, TMA, thread-block clusters")
    if why:
        return why
    if torch.cuda.get_device_capability() != (9, 0):
        return "the warp-group (wgmma) kernel is built for sm_90 (H100 / H200) only"
    return None


def auto_skip(q_lat, q_rope=None, *args, **kwargs) -> str | None:
    """The registry's ``auto_skip``: why ``auto`` takes the Triton kernel for a call this one could run: a single
    request of one 64-row block (Tq·H ≤ 64, fewer than :data:`MIN_ROW_CTAS` requests). ``k3nn.backend("cuda")``
    runs it here anyway."""
    if not isinstance(q_lat, torch.Tensor) or q_lat.dim() != 4:
        return None  # not a call for this kernel at all: supports() says why
    B, M = q_lat.shape[0], q_lat.shape[1] * q_lat.shape[2]
    if M <= 64 and B < MIN_ROW_CTAS:
        return (f"small batch (B = {B} < {MIN_ROW_CTAS} with Tq·H = {M} ≤ 64): the Triton split-KV kernel is faster "
                "(k3nn.backend('cuda') runs the CUDA kernel anyway)")
    return None


#: seconds the last :func:`build` spent compiling or loading (0 once the module is loaded in this process)
last_build_seconds = 0.0
#: (splits, cluster) of the latest :func:`mla_decode_cuda` call
LAST_CALL: tuple[int, int] | None = None


def _arch_flags() -> tuple[str, ...]:
    """Targets of the build: sm_90a on a Hopper GPU (the warp-group kernel needs the arch-specific features);
    elsewhere torch's choice (the kernel then compiles to a trap; :func:`available` refuses such a GPU)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return ("-gencode=arch=compute_90a,code=sm_90a",)
    return ()


@functools.lru_cache(maxsize=1)
def build():
    """Compile (once per process; cached on disk by torch under a source hash) and return the module."""
    global last_build_seconds
    mod, last_build_seconds = load_inline_module("k3nn_mla_decode", CUDA_SOURCE, _CPP_SOURCE + "\n" + _DECL,
                                                 ["mla_decode_launch", "mla_max_clusters"], _arch_flags())
    return mod


def _build_reason() -> str | None:
    """None once the extension is built and loaded, else why not: building is not started inside a CUDA-graph
    capture, and a failed build (an nvcc without sm_90a, say) is reported once and not retried in this process."""
    if build.cache_info().currsize:
        return None
    if _BUILD_FAILED:
        return _BUILD_FAILED[0]
    if torch.cuda.is_current_stream_capturing():
        return "the CUDA extension is not built yet (first call inside a CUDA-graph capture)"
    try:
        build()
    except Exception as e:  # noqa: BLE001 - any compiler or loader failure: auto takes another backend
        _BUILD_FAILED.append(f"the CUDA extension failed to build: {type(e).__name__}: {str(e)[-300:]}")
        return _BUILD_FAILED[0]
    return None


_BUILD_FAILED: list[str] = []


def default_num_splits(B: int, M: int, max_tokens: int, sm_count: int, ctas_per_sm: int = 1, rows: int = 64,
                       block_n: int = WG_BLOCK_N, min_tiles: int = 8) -> int:
    """Splits per request: about one wave of stage-1 CTAs (``ctas_per_sm`` resident per SM; one CTA of ``rows``
    query rows per row tile), at least ``min_tiles`` ``block_n``-key tiles per split of the longest possible request
    (``max_tokens``: the block table's width in tokens), at most :data:`MAX_SPLITS`. Depends on shapes only
    (graph-safe). At least 8 tiles per split (more split partials cost more than the wave they fill), except that a
    short table still gets up to :data:`SHORT_SPLITS` splits of two tiles: a CTA's fixed cost (its first tile)
    dominates there (``bench/gpu/mla_splits.py``; the numbers are in ``docs/perf.md``)."""
    per = B * math.ceil(M / rows)
    by_wave = (ctas_per_sm * sm_count) // per
    by_len = math.ceil(max(1, max_tokens) / (min_tiles * block_n))
    short = min(SHORT_SPLITS, math.ceil(max(1, max_tokens) / (2 * block_n)))
    return max(1, min(MAX_SPLITS, by_wave, max(by_len, short)))


def cluster_choice(cluster: int | None = None) -> int | None:
    """CTAs per cluster of the wgmma kernel's cluster merge: ``cluster`` when given, else ``mla_cluster`` of the
    current :class:`~k3nn.kernels.registry.KernelTuning` (read per call); None (neither set): :func:`wgmma_plan`
    decides. Raises ``ValueError`` for anything not in :data:`CLUSTERS`."""
    if cluster is None:
        return current_tuning().mla_cluster  # checked by KernelTuning
    if isinstance(cluster, bool) or cluster not in CLUSTERS:
        raise ValueError(f"mla_decode_cuda: cluster must be one of {CLUSTERS}, got {cluster!r}")
    return int(cluster)


@functools.cache
def max_clusters(device_index: int, cluster: int, in_code: int = 0) -> int:
    """Clusters of ``cluster`` wgmma stage-1 CTAs the device runs at once (``cudaOccupancyMaxActiveClusters``)."""
    return int(build().mla_max_clusters(device_index, cluster, in_code))


def wgmma_plan(B: int, M: int, max_tokens: int, sm_count: int, cluster: int | None = None,
               num_splits: int | None = None, resident: Callable[[int], int] | None = None) -> tuple[int, int]:
    """``(splits, cluster)`` of a wgmma call; ``resident(c)``: how many clusters of ``c`` CTAs run at once (default
    ``sm_count // c``).

    * ``cluster`` None (the default): ``num_splits`` or :func:`default_num_splits`, and the splits of a row tile as
      one cluster where they are 2 to 8 and every row tile's cluster is resident at once; the cluster merge then
      writes o and lse and no combine kernel runs. Without ``num_splits``, where the clusters of the rule's splits
      do not all fit, one split fewer (down to :data:`CLUSTER_SHRINK` of them) may: B=14 L=8K H=64 on 132 SMs
      takes 8 splits as clusters of 8 rather than 9 and a combine.
    * ``cluster`` c: with ``num_splits``, those splits and the largest cluster size up to c that divides them; else
      about one wave of resident clusters, at least :data:`CLUSTER_MIN_TILES` 64-key tiles per split, a multiple
      of c (none where that leaves fewer than c splits: the plain rule, no cluster)."""
    resident = resident or (lambda c: sm_count // c)
    tiles = B * math.ceil(M / 64)
    if cluster is None:
        if num_splits:
            S = max(1, min(MAX_SPLITS, int(num_splits)))
            return S, S if 2 <= S <= max(CLUSTERS) and tiles <= resident(S) else 1
        S = default_num_splits(B, M, max_tokens, sm_count)
        for s in range(min(S, max(CLUSTERS)), max(2, math.ceil(CLUSTER_SHRINK * S)) - 1, -1):
            if tiles <= resident(s):
                return s, s
        return S, 1
    if num_splits:
        S = max(1, min(MAX_SPLITS, int(num_splits)))
        return S, max(c for c in CLUSTERS if c <= cluster and S % c == 0)
    if cluster > 1:
        by_wave = resident(cluster) * cluster // tiles
        by_len = math.ceil(max(1, max_tokens) / (CLUSTER_MIN_TILES * WG_BLOCK_N))
        S = min(MAX_SPLITS, by_wave, by_len) // cluster * cluster
        if S >= cluster:
            return S, cluster
    return default_num_splits(B, M, max_tokens, sm_count), 1


def supports(q_lat, q_rope, kv_pool, block_table, seq_lens, scale=None, visible_lens=None, num_splits=None,
             out_dtype=None, out=None) -> str | None:
    """None when :func:`mla_decode_cuda` takes this call, else the reason (inputs already checked by
    ``check_mla_decode_inputs``). Which calls ``auto`` leaves to the Triton kernel: :func:`auto_skip`."""
    if not isinstance(q_lat, torch.Tensor) or q_lat.device.type != "cuda":
        return "inputs are not CUDA tensors"
    if q_lat.dtype not in _IN_CODES:
        return f"dtype {q_lat.dtype} is not supported (bf16, fp16)"
    if q_lat.shape[-1] != R or q_rope.shape[-1] != DR:
        return f"compiled for kv_lora_rank {R} and rope dim {DR}, got {q_lat.shape[-1]} and {q_rope.shape[-1]}"
    want = out_dtype if out_dtype is not None else (out[0].dtype if out is not None else q_lat.dtype)
    if want not in (q_lat.dtype, torch.float32):
        return f"out dtype {want} must be the input dtype {q_lat.dtype} or fp32"
    if out is not None and out[0].dtype != want:
        return f"out[0] dtype {out[0].dtype} differs from out_dtype {want}"
    if kv_pool.stride(-1) != 1 or kv_pool.stride(0) % 8 or kv_pool.stride(1) % 8 or kv_pool.data_ptr() % 16:
        return "kv_pool rows must be contiguous and 16-byte aligned (cp.async)"
    if num_splits is not None and not 1 <= int(num_splits) <= MAX_SPLITS:
        return f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    if q_lat.shape[0] > 65535:
        return f"batch {q_lat.shape[0]} > 65535 (grid z)"
    if block_table.shape[1] * kv_pool.shape[1] >= 2 ** 31:
        return "block table covers more than 2^31 tokens"
    if torch.cuda.get_device_capability(q_lat.device) != (9, 0):
        return "the warp-group (wgmma) kernel needs an sm_90 GPU (H100 / H200)"
    lim = _smem_limit(q_lat.device)
    if SMEM_BYTES_WGMMA > lim:
        return f"the wgmma kernel needs {SMEM_BYTES_WGMMA} bytes of shared memory per CTA (limit {lim})"
    return _build_reason()


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """``t`` when every row is 16-byte aligned (the wgmma kernel copies Q in 16-byte chunks), else a contiguous
    copy."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in t.stride()[:-1])
    return t if ok else t.contiguous()


def mla_decode_cuda(q_lat, q_rope, kv_pool, block_table, seq_lens, scale, visible_lens=None, num_splits=None,
                    out_dtype=None, out=None, cluster=None):
    """``k3nn.ops.mla_decode`` on the CUDA kernel (inputs as checked by ``check_mla_decode_inputs`` and
    :func:`supports`). ``cluster``: as in :func:`cluster_choice`. Returns ``(o [B, Tq, H, 512], lse [B, Tq, H]
    fp32)``."""
    B, Tq, H, r = q_lat.shape
    M = Tq * H
    dev = q_lat.device
    C = cluster_choice(cluster)
    q_lat, q_rope = _rows16(q_lat), _rows16(q_rope)
    bt = block_table if block_table.dtype == torch.int32 and block_table.stride(-1) == 1 else \
        block_table.to(torch.int32).contiguous()
    sl = seq_lens.to(torch.int32).contiguous()
    vis = None if visible_lens is None else visible_lens.to(torch.int32).contiguous()
    if out is None:
        o = torch.empty(B, Tq, H, r, dtype=out_dtype or q_lat.dtype, device=dev)
        lse = torch.empty(B, Tq, H, dtype=torch.float32, device=dev)
    else:
        o, lse = out
    max_tokens, sms, dix = bt.shape[1] * kv_pool.shape[1], _sm_count(dev.index or 0), dev.index or 0
    S, C = wgmma_plan(B, M, max_tokens, sms, C, num_splits, lambda c: max_clusters(dix, c, _IN_CODES[q_lat.dtype]))
    o_part = lse_part = None
    if S // C > 1:
        o_part = torch.empty(B, M, S // C, r, dtype=torch.float32, device=dev)
        lse_part = torch.empty(B, M, S // C, dtype=torch.float32, device=dev)
    global LAST_CALL
    LAST_CALL = (S, C)
    build().mla_decode_launch(q_lat, q_rope, kv_pool, bt, sl, vis, o, lse, o_part, lse_part,
                              float(scale) * _LOG2E, S, _IN_CODES[q_lat.dtype], _OUT_CODES[o.dtype], C)
    return o, lse
