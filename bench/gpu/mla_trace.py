"""Where a CTA of the CUDA warp-group MLA decode spends its life: builds the kernel with ``K3MLA_TRACE`` (the global
timer stamped at fixed points by the first thread of each warp group, see ``K3MLA_STAMP`` in
``k3nn.kernels.mla.cuda_decode``), runs each case a few times and prints, per stamp, the time since the grid's first
CTA started (CTA 0, and the median and max over CTAs) for the last call. The global timer is coarse (a tick is a
fraction of a microsecond) and ptxas may read it before the instruction it stamps, so a stamp can come out ahead
of the event it follows (group 0's "tile 0 full" before group 1's "tile 0 landed"): read group 0's first
products from "g1 tile 0 landed" on.

    python3 -m bench.gpu.mla_trace [--cases B,L,H,S;...]
"""

from __future__ import annotations

import argparse
import sys

import torch

from k3nn.kernels import cuda_ext
from k3nn.kernels.mla import cuda_decode as cdk

from bench.gpu.mla_decode import R, SCALE, make_case

STAMPS = 24
NAMES = {
    0: "g0 entry", 1: "g0 key range", 2: "g0 tile 0 full", 3: "g0 QK(0) done", 4: "g0 P(0) ready", 5: "g0 PV(0) done",
    6: "g0 loop done", 7: "g0 store start", 9: "g0 staged", 10: "g0 staged, synced", 8: "g0 store done",
    12: "g1 entry", 13: "g1 key range", 14: "g1 loader start", 15: "g1 Q + tile 0 issued", 16: "g1 Q landed",
    17: "g1 tile 0 landed", 18: "g1 P(0) ready seen", 19: "g1 PV(0) done", 20: "g1 loop done", 21: "g1 store start",
    23: "g1 staged", 11: "g1 staged, synced", 22: "g1 store done",
}
_CPP_TRACE = """
cudaError_t k3mla_trace_copy(void* dst, size_t bytes);
void mla_trace_read(torch::Tensor dst) {
  TORCH_CHECK(k3mla_trace_copy(dst.data_ptr(), dst.numel() * 8) == cudaSuccess, "mla_trace_read failed");
}
"""


def build_traced():
    mod, secs = cuda_ext.load_inline_module("k3nn_mla_trace", "#define K3MLA_TRACE 1\n" + cdk.CUDA_SOURCE,
                                            cdk._CPP_SOURCE + "\n" + cdk._DECL + "\n" + _CPP_TRACE,
                                            ["mla_decode_launch", "mla_max_clusters", "mla_trace_read"], cdk._arch_flags())
    print(f"traced build {secs:.1f} s", flush=True)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1,64,64,1;1,2048,64,32;1,32768,64,64;1,32768,64,132;64,8192,64,2")
    args = ap.parse_args()
    mod = build_traced()
    cdk.build = lambda: mod  # mla_decode_cuda launches through the traced module
    buf = torch.zeros(1024, STAMPS, dtype=torch.int64, device="cuda")
    for spec in args.cases.split(";"):
        B, L, H, S = (int(x) for x in spec.split(","))
        sets, sl, _, _, _ = make_case(B, L, H, 1, copies=2)
        for i in range(4):
            q, pool, bt, o = sets[i % len(sets)]
            cdk.mla_decode_cuda(q[..., :R], q[..., R:], pool, bt, sl, SCALE, out=o, num_splits=S)
        torch.cuda.synchronize()
        mod.mla_trace_read(buf)
        ctas = ((H + 63) // 64) * S * B
        t = buf[:min(ctas, 1024)].cpu().double()
        t0 = t[:, 0].min()
        rel = (t - t0) / 1e3  # µs since the first CTA's entry
        end = rel[:, [8, 22]].max().item()
        print(f"\nB={B} L={L} H={H} S={S}: {ctas} CTAs, last stamp {end:.2f} us after the first entry "
              f"(entries spread over {rel[:, 0].max().item():.2f} us)")
        print(f"{'stamp':24s} {'CTA 0':>8s} {'median':>8s} {'max':>8s}")
        for k, name in NAMES.items():
            col = rel[:, k]
            print(f"{name:24s} {col[0].item():8.2f} {col.median().item():8.2f} {col.max().item():8.2f}")
        sets.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
