"""Tensor parallelism: 2 ranks (gloo) == 1 rank — logits of prefill and decode steps, greedy tokens of
generate() on the standard and the latency-specialized decode paths, for K3 (latent MoE, MXFP4 experts,
AttnRes) and Kimi Linear (standard MoE, low-rank gate, RoPE MLA) tiny configs."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3nn import KimiK3, KimiK3Config
from k3nn.parallel.tp import apply_tensor_parallel, default_plan

CONFIGS = {
    "k3": dict(mxfp4_experts=True, moe_intermediate_size=64),
    "kimi_linear": dict(use_attn_res=False, kda_gate="softplus", use_full_rank_gate=False, moe_kind="standard",
                        routed_expert_hidden_size=None, mla_use_output_gate=False, q_lora_rank=None,
                        mla_use_nope=False, hidden_act="silu"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(model, ids, decode_backend):
    out = model(ids, cache=None).logits
    gen = model.generate(ids, max_new_tokens=5, cuda_graph=False, decode_backend=decode_backend)
    return out, gen, model.last_decode_info["path"]


def _worker(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {}
        ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
        for key, over in CONFIGS.items():
            cfg = KimiK3Config.tiny(**over)
            ref = KimiK3(cfg, seed=5)
            single = {b: _run(ref, ids, b) for b in ("auto", "latency_specialized")}
            tp = apply_tensor_parallel(KimiK3(cfg, seed=5))
            assert tp.model.layers[0].self_attn.num_heads == cfg.kda_num_heads // world
            assert tp.config.kda_num_heads == cfg.kda_num_heads // world
            assert tp.tp_global_config == cfg
            sharded = {b: _run(tp, ids, b) for b in ("auto", "latency_specialized")}
            for b in single:
                torch.testing.assert_close(sharded[b][0], single[b][0], atol=2e-5, rtol=1e-4)
                assert torch.equal(sharded[b][1], single[b][1]), (key, b)
                assert sharded[b][2] == single[b][2] == ("standard" if b == "auto" else b)
            pre = apply_tensor_parallel(KimiK3(cfg, seed=5).prepare_decode())  # packed before sharding
            with torch.no_grad():  # the packed GEMMs run without autograd
                torch.testing.assert_close(pre(ids, cache=None).logits, single["auto"][0], atol=2e-5, rtol=1e-4)
            res[key] = True
        q.put((rank, "ok", res))
    except Exception as e:  # report to the parent instead of hanging it
        import traceback

        q.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_tp2_equals_tp1():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for rank, status, payload in results:
        assert status == "ok", f"rank {rank}:\n{payload}"


def test_plan_and_errors():
    plan = default_plan(KimiK3Config.tiny())
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.*.block_sparse_moe.experts"] == "experts_inter"
    with pytest.raises(RuntimeError, match="not initialised"):
        apply_tensor_parallel(KimiK3(KimiK3Config.tiny(num_hidden_layers=2, mla_layers=[1]), device="meta"))
