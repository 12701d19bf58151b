"""bench.decode_roofline on the CPU: the kernel classes, the alignment of a replay's kernels to the labelled eager
run, the bytes each op call is charged, and a smoke run of the suite on the tiny preset (CPU times mean nothing)."""

import json

import torch

from bench import decode_roofline as dr
from k3nn import KimiK3, KimiK3Config
from k3nn.cache.hybrid import HybridCache


def test_class_by_name():
    assert dr.class_by_name("void k3mx::mx_gemv_kernel<__nv_bfloat16, 4>") == dr.EXPERTS
    assert dr.class_by_name("_route_kernel") == dr.ROUTING
    assert dr.class_by_name("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT") == dr.DENSE
    assert dr.class_by_name("_skinny_kernel") == dr.DENSE
    assert dr.class_by_name("_kda_decode_head") == dr.KDA
    assert dr.class_by_name("mla_wgmma_kernel") == dr.MLA
    assert dr.class_by_name("_attnres_phase2_kernel") == dr.NORMS


def test_exposed_spans_partition_overlapping_kernels():
    """A programmatic dependent launched early overlaps the kernel before it: it counts only past that kernel's end;
    gaps count for nothing; without overlap each span is the kernel's duration."""
    spans = [("b", 5.0, 12.0), ("a", 0.0, 10.0), ("c", 11.0, 11.5), ("d", 20.0, 23.0)]
    assert dr.exposed_spans(spans) == [("a", 10.0), ("b", 2.0), ("c", 0.0), ("d", 3.0)]
    assert dr.exposed_spans([("x", 0.0, 2.0), ("y", 2.0, 5.0)]) == [("x", 2.0), ("y", 3.0)]
    assert dr.exposed_spans([]) == []


def test_align_classes_takes_labels_where_names_agree():
    eager = [("a", 1.0, dr.DENSE), ("isfinite", 1.0, dr.ROUTING), ("_route_kernel", 1.0, dr.ROUTING),
             ("nvjet_x", 1.0, dr.LM_HEAD)]
    replay = ["a", "_route_kernel", "nvjet_x", "memset"]  # the eager-only finite check is absent from the graph
    assert dr.align_classes(replay, eager) == [dr.DENSE, dr.ROUTING, dr.LM_HEAD, dr.NORMS]


def test_op_bytes_special_cases():
    from k3nn.quant.mxfp4 import MXFP4Weight

    info = {}
    pool = torch.zeros(10, 64, 8, dtype=torch.bfloat16)
    q = torch.zeros(2, 1, 4, 6, dtype=torch.bfloat16)
    n = dr.op_bytes("mla_decode", (q, q[..., :2], pool, torch.zeros(2, 3, dtype=torch.int32),
                                   torch.tensor([5, 7])), {}, (q, torch.zeros(2, 1, 4)), info)
    assert n >= 12 * 8 * 2 and n < pool.numel() * 2  # pages up to each length, not the whole pool
    w = MXFP4Weight(torch.zeros(8, 32, 16, dtype=torch.uint8), torch.zeros(8, 32, 1, dtype=torch.uint8))
    ids = torch.tensor([[0, 3], [3, 5]])
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    n = dr.op_bytes("moe_expert_outputs", (x, w, w, w, ids), {}, torch.zeros(2, 2, 32, dtype=torch.bfloat16), info)
    assert info["distinct_experts"] == [3]
    assert n >= 3 * 3 * (32 * 16 + 32)
    rec, conv = torch.zeros(1, 2, 4, 4), torch.zeros(1, 3, 24)
    args = [torch.zeros(1)] * 8 + [rec, conv]
    assert dr.op_bytes("kda_fused_decode", tuple(args), {}, torch.zeros(1), {}) >= 2 * (rec.numel() + conv.numel()) * 4


def _tiny():
    cfg = KimiK3Config.tiny(num_hidden_layers=4, mla_layers=[1, 3], attn_res_block_size=2, num_experts=8,
                            num_experts_per_token=2, mxfp4_experts=True, num_shared_experts=1)
    return KimiK3(cfg, seed=0).eval()


def test_labelled_step_charges_every_class():
    """One tiny decode step under the labels: every op call is recorded with its class; the classes cover the
    projections, lm_head, routing, experts, both mixers and the norms; the ops are restored on exit."""
    m = _tiny()
    ids = torch.randint(0, m.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    records = []
    with torch.no_grad():
        cache = HybridCache(m.config, 2, 8, m.dtype, m.device)
        m(ids[:, :4], cache=cache)
        m.prepare_decode()
        with dr.labelled(m, records):
            m(ids[:, 4:], cache=cache)
    got = {r["cls"] for r in records}
    assert {dr.DENSE, dr.LM_HEAD, dr.ROUTING, dr.EXPERTS, dr.KDA, dr.MLA, dr.NORMS} <= got, got
    head = [r for r in records if r["cls"] == dr.LM_HEAD]
    assert head and head[0]["bytes"] >= m.lm_head.weight.numel() * 4
    assert all(r["bytes"] > 0 for r in records)
    import k3nn.ops as ops_pkg

    assert ops_pkg.linear.__module__ == "k3nn.ops.linear"


def test_suite_smoke_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("K3NN_RESULTS_DIR", str(tmp_path))
    rows = dr.main(["--allow-cpu", "--config", "tiny", "--batches", "1", "--ctx", "6", "--replays", "1",
                    "--variants", "default"])
    step = [r for r in rows if r["case"] == "tiny B=1 step"]
    assert step and step[0]["bytes"] > 0 and step[0]["distinct_experts_per_moe_layer"]
    assert {r.get("class") for r in rows if "class" in r} == set(dr.CLASSES)
    (f,) = tmp_path.glob("decode-roofline-*.json")
    data = json.loads(f.read_text())
    assert data["meta"]["suite"] == "decode-roofline" and data["rows"]


def test_lm_head_tail():
    names = ["_skinny_kernel", "_attnres_kernel", "add", "_skinny_kernel"]
    got = dr.lm_head_tail(names, [dr.DENSE, dr.NORMS, dr.NORMS, dr.DENSE])
    assert got == [dr.DENSE, dr.NORMS, dr.NORMS, dr.LM_HEAD]
    assert dr.lm_head_tail(names, [dr.DENSE, dr.NORMS, dr.NORMS, dr.LM_HEAD])[3] == dr.LM_HEAD


def test_labelled_kernels_by_launch_time():
    """A kernel's class is the innermost labelled range around its launch call (matched by correlation id)."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    def ev(name, t0, t1, dev=DeviceType.CPU, id=0, linked=0):
        return NS(name=name, time_range=NS(start=t0, end=t1), device_type=dev, id=id, linked_correlation_id=linked,
                  cpu_parent=None)

    evs = [ev(f"{dr._LABEL}{dr.MLA}|MultiHeadLatentAttention", 0, 100),
           ev(f"{dr._LABEL}{dr.DENSE}|linear", 10, 20), ev("cuLaunchKernelEx", 12, 13, id=7, linked=3),
           ev("cudaLaunchKernel", 30, 31, id=8, linked=4), ev("cudaLaunchKernel", 200, 201, id=9, linked=5),
           ev("_skinny_kernel", 40, 45, DeviceType.CUDA, id=7), ev("bmm", 50, 52, DeviceType.CUDA, id=8),
           ev("x", 300, 301, DeviceType.CUDA, id=9)]
    prof = NS(events=lambda: evs)
    assert dr.labelled_kernels(prof) == [("_skinny_kernel", 5.0, dr.DENSE), ("bmm", 2.0, dr.MLA), ("x", 1.0, None)]
