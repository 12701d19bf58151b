"""Driver for a hardware-counter look at the batched KDA decode (B=64 H=96 T=1, bf16 activations, fp32 state):
runs, in this order, an elementwise copy kernel (``torch.neg(src, out=dst)``: a kernel, unlike ``copy_``'s
memcpy) over as many bytes as the state traffic (the copy-bandwidth anchor), the Triton fused decode with the
current defaults (``head`` path; or each variant of ``kda_decode.VARIANTS`` named on the command line), and fla-core's ``fused_recurrent_kda`` when importable — each three times (two
warm-up calls, one timed): nine launches that the filter below matches.

    ncu --clock-control none --kernel-name regex:'neg_kernel|_kda_decode_head|recurrent' --launch-count 9 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats python3 bench/gpu/profile_kda_decode.py [VARIANT ...]

(suite step ``kda-decode-ncu``). Without a profiler it prints the time of each call (CUDA events), so the run
also says what was profiled. What to read: DRAM throughput and read / write bytes of the decode against the
copy's; L2 hit rate of the state loads; achieved occupancy; the top warp stall reasons.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kda_decode import call, fla_args, fla_fn, inputs, use  # noqa: E402

from k3nn.bench.common import print_call_times as timed  # noqa: E402


def main():
    B, H, D = 64, 96, 128
    p, S, cs, idx = inputs(B, 1, H, torch.bfloat16, seed=7)
    kw = dict(gate_kind="lower_bound", lower_bound=-5.0, norm_eps=1e-5)
    nbytes = B * H * D * D * 4
    src = torch.empty(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    timed(f"copy kernel {nbytes / 1e6:.0f} MB", lambda: torch.neg(src, out=dst))
    for v in sys.argv[1:] or ["auto"]:  # variant names of kda_decode.VARIANTS
        be = use(v)
        timed(f"k3nn decode {v} B=64 H=96", lambda: call(be, p, S, cs, idx, kw))
    use("auto")
    fr = fla_fn()
    if fr is not None:
        fa, fkw = fla_args(p, S, B, H)
        timed("fla fused_recurrent_kda B=64 H=96", lambda: fr(*fa, **fkw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
