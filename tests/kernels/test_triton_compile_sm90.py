"""Triton kernels compiled ahead of time for sm_90 (Hopper) on a machine without a GPU: the installed Triton's
front end and ptxas run as they would on the H200, so compile errors the CPU interpreter cannot see (types of
loop-carried values, helpers returning tuples, constexpr misuse, shared-memory limits) fail here, before a GPU
run. The installed Triton may be newer than the GPU's (3.9 here, 3.6 there): some version-specific rules, like
3.6 typing a subnormal float literal as fp64, need test_triton_literals.py. Each compile runs in a fresh process
without TRITON_INTERPRET (the test session imports the kernels interpreted)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a few seconds per kernel (ptxas)

_SCRIPT = textwrap.dedent('''
    import sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import importlib
    module, name, types, constexprs, default, warps, stages = eval(sys.argv[1])
    fn = getattr(importlib.import_module(module), name)
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn  # autotuner / heuristics wrappers
    sig = {a: "constexpr" if a in constexprs else types.get(a, default) for a in fn.arg_names}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    assert "cubin" in k.asm
''')


def _compile(module, name, types, constexprs, default="i32", warps=4, stages=1):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = repr((module, name, types, constexprs, default, warps, stages))
    p = subprocess.run([sys.executable, "-c", _SCRIPT, spec], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.parametrize("module,name", [("k3nn.kernels.kda.triton_intra_g", "_g_scores_rows_kernel")])
def test_kda_intra_scores_compile(module, name):
    _compile(module, name, {"q": "*bf16", "k": "*bf16", "beta": "*bf16", "chunk_start": "*i32",
                            "chunk_len": "*i32", "G": "*fp32", "g": "*fp32", "A_out": "*fp32", "L_out": "*fp32",
                            "scale": "fp32"}, {"K": 128, "BK": 32, "SPAN": 80.0, "DOT_PREC": "tf32"},
             warps=2, stages=2)


@pytest.mark.parametrize("SUM", [True, False])
def test_mla_merge_compiles(SUM):
    _compile("k3nn.kernels.mla.merge", "_lse_merge_kernel",
             {"lse_ptr": "*fp32", "o_ptr": "*fp32", "out_ptr": "*fp32", "lse_out_ptr": "*fp32"},
             {"SUM": SUM, "BLOCK_S": 2, "BLOCK_M": 16, "BLOCK_R": 128})


@pytest.mark.parametrize("order_hb,ld_ev,st_ev,bv", [(True, "evict_first", "evict_first", 64),
                                                     (False, "evict_first", "", 64), (True, "evict_first", "", 32)])
def test_kda_decode_head_variants_compile(order_hb, ld_ev, st_ev, bv):
    """The head kernel as the plan launches it: [128, 64] chunks, heads first or batch first (> 65535 requests),
    with and without the store hint; [128, 32] chunks."""
    _compile("k3nn.kernels.kda.triton_decode", "_kda_decode_head",
             {"qkv": "*bf16", "f": "*bf16", "bl": "*bf16", "gate": "*bf16", "conv_w": "*bf16", "A_log": "*fp32",
              "dt_bias": "*fp32", "norm_w": "*fp32", "S_ptr": "*fp32", "cs_ptr": "*bf16", "idx": "*i32",
              "nt": "*i32", "wm": "*i32", "y": "*bf16", "scale": "fp32", "lower_bound": "fp32", "eps": "fp32"},
             {"H": 96, "D": 128, "BD": 128, "BV": bv, "NC": 128 // bv, "W": 4, "SOFTPLUS": False, "HAS_IDX": True,
              "HAS_NT": False, "HAS_WM": False, "T1": True, "EVEN": True, "HEADS_FIRST": order_hb, "LD_EV": ld_ev,
              "ST_EV": st_ev})


@pytest.mark.parametrize("bn,stages,tma,sv", [(64, 2, True, 1), (32, 4, True, 1), (32, 4, False, 1), (64, 2, True, 2)])
def test_mla_decode_stage1_compiles(bn, stages, tma, sv):
    """The 64-row split-score tile, with whole key tiles through tensor descriptors (one box per column half
    with sv = 2) or through pointers."""
    desc = {"KV_DESC": f"tensordesc<bf16[{bn},{512 // sv}]>", "KR_DESC": f"tensordesc<bf16[{bn},64]>"} if tma else {
        "KV_DESC": "*bf16", "KR_DESC": "*bf16"}
    _compile("k3nn.kernels.mla.triton_decode", "_mla_decode_stage1",
             {"Q_lat": "*bf16", "Q_rope": "*bf16", "KV": "*bf16", "BT": "*i32", "SEQ": "*i32", "VIS": "*i32",
              "O_part": "*fp32", "LSE_part": "*fp32", "O": "*bf16", "LSE": "*fp32", "qk_scale_log2": "fp32", **desc},
             {"R": 512, "DR": 64, "PAGE": 64, "BLOCK_R": 512, "BLOCK_DR": 64, "HAS_ROPE": True, "HAS_VIS": False,
              "FINAL": False, "IEEE": False, "LAZY": False, "BLOCK_H": 64, "BLOCK_N": bn, "SPLIT_V": sv,
              "AHEAD": True, "OPAQUE": True, "TMA": tma}, warps=8, stages=stages)


@pytest.mark.parametrize("dot", [False, True])
def test_skinny_as_programmatic_dependent_compiles(dot):
    """The skinny GEMM launched with PDL: trigger, L2 prefetch of its first weight tiles (inline PTX), grid
    dependency wait."""
    _compile("k3nn.kernels.linear.triton_skinny", "_skinny_kernel",
             {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "R": "*bf16", "Y": "*bf16", "WS": "*fp32"},
             {"BM": 16 if dot else 1, "BN": 64 if dot else 16, "BK": 128 if dot else 512, "DOT": dot,
              "DOT_PREC": "ieee", "SPLIT": 1, "HAS_BIAS": False, "HAS_RES": True, "EVEN_K": True, "PDL": True,
              "PRE_LINES": 16, "LINE": 64}, warps=4, stages=3)


@pytest.mark.parametrize("name", ["_kda_decode_split", "_kda_decode_head"])
def test_kda_decode_as_programmatic_dependent_compiles(name):
    """The fused KDA decode launched with PDL: the state load before the grid dependency wait."""
    c = {"H": 96, "D": 128, "BD": 128, "BV": 32, "W": 4, "SOFTPLUS": True, "HAS_IDX": True, "HAS_NT": False,
         "HAS_WM": False, "T1": True, "EVEN": True, "HEADS_FIRST": True, "PDL": True, "LD_EV": "evict_first",
         "ST_EV": "evict_first"}
    c.update({"NS": 4} if name == "_kda_decode_split" else {"NC": 4})
    _compile("k3nn.kernels.kda.triton_decode", name,
             {a: "*bf16" for a in ("qkv", "f", "bl", "gate", "conv_w", "dt_bias", "norm_w", "cs_ptr", "y")}
             | {"A_log": "*fp32", "S_ptr": "*fp32", "idx": "*i32", "nt": "*i32", "wm": "*i32", "counter": "*i32",
                "scale": "fp32", "lower_bound": "fp32", "eps": "fp32"}, c)


@pytest.mark.parametrize("module,name,types,constexprs", [
    ("k3nn.kernels.glu.triton_glu", "_glu_kernel", {"gu_ptr": "*bf16", "y_ptr": "*bf16", "beta": "fp32",
                                                    "linear_beta": "fp32"}, {"ACT": 1, "CAP": True, "BLOCK": 1024}),
    ("k3nn.kernels.norm.triton_rms", "_rms_norm_fwd", {"X": "*bf16", "Wt": "*bf16", "Y": "*bf16", "eps": "fp32"},
     {"D": 7168, "BD": 8192, "BR": 1}),
    ("k3nn.kernels.moe.triton_route", "_route_kernel", {"logit_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64",
                                                        "w_ptr": "*fp32", "ok_ptr": "*i1", "scaling": "fp32"},
     {"K": 16, "RENORM": True, "BLOCK_E": 128, "BLOCK_K": 16, "S": 4}),
])
def test_short_kernels_as_programmatic_dependents_compile(module, name, types, constexprs):
    """The short decode kernels with PDL: the grid dependency wait first, the trigger after their loads."""
    _compile(module, name, types, {**constexprs, "PDL": True})
