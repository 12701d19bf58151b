"""Expert parallelism on 2 gloo ranks == 1 rank; the QB histogram summed by one all-reduce == single process."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import k3nn.parallel.ep  # noqa: F401  (imported before forking the ranks)
import k3nn.training  # noqa: F401

pytestmark = pytest.mark.distributed

SPLITS = (9, 3)  # uneven token counts per rank


def _model(kind, mx):
    from k3nn.config import KimiK3Config
    from k3nn.layers.moe import MoE
    from k3nn.quant import mxfp4_quantize

    cfg = KimiK3Config.tiny(moe_kind=kind, mxfp4_experts=mx, num_experts=8, num_experts_per_token=3)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if mx:
        g = torch.Generator().manual_seed(1)
        for n in ("w1", "w3", "w2"):
            shape = getattr(moe.experts, f"{n}_packed").shape
            q = mxfp4_quantize(torch.randn(*shape[:-1], shape[-1] * 2, generator=g) * 0.2)
            getattr(moe.experts, f"{n}_packed").copy_(q.packed)
            getattr(moe.experts, f"{n}_scale").copy_(q.scale)
    return cfg, moe


def _worker(rank, world, init_file):
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from k3nn.parallel.ep import apply_expert_parallel
        from k3nn.training import qb_bias_histogram

        lo, hi = sum(SPLITS[:rank]), sum(SPLITS[:rank + 1])
        for kind, mx in (("latent", False), ("latent", True), ("standard", False)):
            cfg, moe = _model(kind, mx)
            x = torch.randn(sum(SPLITS), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                ref = moe(x)
                apply_expert_parallel(moe)
                assert moe.experts.num_experts == 4 and moe.experts.expert_offset == 4 * rank
                out = moe(x[lo:hi])
            torch.testing.assert_close(out, ref[lo:hi], rtol=1e-5, atol=1e-5)
            with torch.no_grad():  # a rank with a single token
                one = moe(x[lo:lo + 1])
            torch.testing.assert_close(one, ref[lo:lo + 1], rtol=1e-5, atol=1e-5)
        # Quantile Balancing histogram: per-rank counts summed by one all-reduce == the whole batch at once
        g = torch.Generator().manual_seed(3)
        s = torch.rand(400, 8, generator=g)
        b = 0.1 * torch.randn(8, generator=g)
        mine = s[:250] if rank == 0 else s[250:]
        dist_bias = qb_bias_histogram(mine, b, 2, 500)
        dist.barrier()
        torch.save(dist_bias, f"{init_file}.qb{rank}")
    finally:
        dist.destroy_process_group()


def test_ep_two_ranks_equal_one_rank():
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "pg")
        # fork: the children inherit the imported modules (spawn re-imports torch: slow on a busy CPU)
        mp.start_processes(_worker, args=(2, init), nprocs=2, join=True, start_method="fork")
        from k3nn.training import qb_bias_histogram

        g = torch.Generator().manual_seed(3)
        s = torch.rand(400, 8, generator=g)
        b = 0.1 * torch.randn(8, generator=g)
        single = qb_bias_histogram(s, b, 2, 500)  # no process group here: the whole batch in one process
        for r in range(2):
            assert torch.equal(torch.load(f"{init}.qb{r}"), single)


def test_ep_torchrun_self_check_on_gloo():
    """``python -m k3nn.parallel.ep`` under torchrun (the two-GPU NCCL check, here on 2 gloo ranks): the
    expert-parallel latent MoE (fp32 and MXFP4 experts) equals the whole layer on one rank."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, ["src", os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                        "k3nn.parallel.ep", "--dim-scale", "16", "--tokens", "8", "--experts", "8", "--topk", "4"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("rel err") == 4  # 2 ranks x (fp32, MXFP4)
