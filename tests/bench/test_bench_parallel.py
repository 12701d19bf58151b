"""The two-rank benchmarks of bench/ (``bench.dcp``, ``bench.ep``) under torchrun on 2 gloo ranks: they run, time
both sides and report the rows they would write on CUDA (a smoke test of the code path; CPU times mean nothing)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(*argv: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", *argv],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


@pytest.mark.parametrize("heads", ["replicated", "sharded"])
def test_dcp_bench_on_gloo(heads):
    out = _torchrun("bench.dcp", "--cases", "2,256,4;1,300,4", "--heads", heads, "--interleave", "2")
    rows = [ast.literal_eval(r) for r in re.findall(r"\[dcp bench\] (\{[^{}]*\})", out)]
    assert [r["case"] for r in rows] == [f"B=2 L=256 H=4 Tq=1 W=2 I=2 float32 heads={heads}",
                                         f"B=1 L=300 H=4 Tq=1 W=2 I=2 float32 heads={heads}"]  # rank 0 only
    for r in rows:
        assert r["k3nn_ms"] > 0 and r["anchor_ms"] > 0
        assert r["tpot_ratio"] == pytest.approx(r["k3nn_ms"] / r["anchor_ms"], rel=1e-2)  # of the unrounded times
        assert r["kv_bytes_per_rank"] < r["kv_bytes_one_device"]


def test_ep_bench_on_gloo():
    out = _torchrun("bench.ep", "--dim-scale", "16", "--tokens", "8", "--experts", "8", "--topk", "4")
    # the ranks print concurrently: their lines may run together, each report stays whole
    found = re.findall(r"\[ep bench rank (\d)/2 (\w+) E=8 k=4 gloo\] rel err (\S+)  ep (\S+) ms vs one rank (\S+) ms",
                       out)
    assert sorted((rank, kind) for rank, kind, *_ in found) == [("0", "fp32"), ("0", "mxfp4"),
                                                                ("1", "fp32"), ("1", "mxfp4")]  # 2 ranks x 2 layers
    for *_, err, ms, one in found:
        assert float(err) < 1e-5 and float(ms) > 0 and float(one) > 0
