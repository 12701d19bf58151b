"""Driver for a hardware-counter look at the Triton MLA decode next to FlashMLA (B=64 L=8K H=64 Tq=1, bf16,
paged latent cache): runs the default Triton plan (and each plan named on the command line as
``bh,bn,warps,stages,lazy,sv,ahead,opaque,tma/splits``), the CUDA warp-group kernel (sm_90), then FlashMLA's
legacy SM90 kernel when it imports — each three times (two warm-up calls, one timed).

    ncu --clock-control none --kernel-name regex:'_mla_decode_stage1|mla_wgmma_kernel|splitkv_mla' --launch-count 9 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section SchedulerStats --section SourceCounters python3 -m bench.gpu.profile_mla_decode [PLAN ...]

(suite step ``mla-decode-ncu``). ``--cases B,L,H,Tq;...`` instead profiles only the CUDA warp-group kernel at its
default split count and FlashMLA on each case (suite step ``mla-wgmma-cases-ncu``). Without a profiler it prints
the time of each call (CUDA events). What to read:
tensor-pipe utilisation and issue-slot use of stage 1 against FlashMLA's, the top warp stall reasons and the
SASS lines they sit on (waits on the tensor-memory loads, on the products, on barriers).
"""

from __future__ import annotations

import sys

import torch

from k3nn.kernels.mla import triton_decode as td

from bench.common import print_call_times as timed
from bench.gpu.mla_decode import R, SCALE, flashmla, launch, make_case


def parse_plan(text: str) -> td.Plan:
    tile, _, splits = text.partition("/")
    f = [int(x) for x in tile.split(",")]
    return td.make_plan(tuple(f[:4]) + tuple(bool(x) if i != 1 else x for i, x in enumerate(f[4:9])),
                        int(splits or 1))


def time_flashmla(name: str, fm, q, pool, bt, sl, Tq: int = 1) -> None:
    """FlashMLA's legacy SM90 kernel on the same inputs (``fm``: what :func:`flashmla` loaded)."""
    fwd, get_meta = fm
    meta = get_meta()[0]
    timed(name, lambda: fwd(q, pool.unsqueeze(2), bt, sl, R, meta, softmax_scale=SCALE, causal=Tq > 1,
                            use_legacy=True))


def profile_case(B: int, L: int, H: int, Tq: int, fm) -> None:
    from k3nn.kernels.mla import cuda_decode as cdk

    sets, sl, _, _, _ = make_case(B, L, H, Tq)
    q, pool, bt, out = sets[0]
    timed(f"k3nn CUDA wgmma B={B} L={L} H={H} Tq={Tq}",
          lambda: cdk.mla_decode_cuda(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=out))
    if fm is not None:
        time_flashmla(f"FlashMLA legacy B={B} L={L} H={H} Tq={Tq}", fm, q, pool, bt, sl, Tq)


def cases_main(spec: str) -> int:
    """The CUDA warp-group kernel (default splits) and FlashMLA legacy on each case of ``spec``."""
    fm, why = flashmla()
    if fm is None:
        print(f"FlashMLA: {why}")
    for case in spec.split(";"):
        profile_case(*(int(x) for x in case.split(",")), fm)
    return 0


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--cases":
        return cases_main(sys.argv[2])
    B, L, H = 64, 8192, 64
    sets, sl, _, _, _ = make_case(B, L, H, 1)
    q, pool, bt, out = sets[0]
    dev = q.device
    plans = [td._default_plan(B, H, dev)] + [parse_plan(a) for a in sys.argv[1:]]
    for p in plans:
        timed(f"k3nn stage 1 {p.short()} B={B} L={L} H={H}", lambda p=p: launch(p, q, pool, bt, sl, out))
    from k3nn.kernels.mla import cuda_decode as cdk

    if cdk.available() is None and torch.cuda.get_device_capability(dev) == (9, 0):
        timed("k3nn CUDA wgmma S=2", lambda: cdk.mla_decode_cuda(q[..., :R], q[..., R:], pool, bt, sl, SCALE,
                                                                 num_splits=2, out=out))
    fm, why = flashmla()
    if fm is None:
        print(f"FlashMLA: {why}")
        return 0
    time_flashmla("FlashMLA legacy", fm, q, pool, bt, sl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
