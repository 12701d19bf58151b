"""bench.gpu.sass_loops' SASS reading on a hand-written listing (no nvcc needed)."""

import shutil

import pytest

from bench.gpu import sass_loops

SASS = """
	code for sm_90
		Function : _Z6kernelPf
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   CS2R R4, SRZ ;                         /* 0x0000000000047805 */
        /*0020*/                   LDG.E.NA.128.CONSTANT R8, desc[UR4][R2.64] ;
        /*0030*/                   F2FP.F16.E4M3.UNPACK_B R12, R8 ;
        /*0040*/                   HMMA.16816.F32 R4, R12, R14, R4 ;
        /*0050*/              @!P0 BRA 0x20 ;
        /*0060*/                   LOP3.LUT R5, R5, 0x7f, RZ, 0xc0, !PT ;
        /*0070*/               @P1 BRA 0x80 ;
        /*0080*/                   EXIT ;
		Function : _Z5otherv
        /*0000*/                   EXIT ;
"""


def test_functions_and_loops():
    fns = sass_loops.functions(SASS)
    assert list(fns) == ["_Z6kernelPf", "_Z5otherv"]
    assert fns["_Z6kernelPf"][2] == (0x20, "LDG.E.NA.128.CONSTANT R8, desc[UR4][R2.64]")
    (lp,) = sass_loops.loops(fns["_Z6kernelPf"])  # the forward branch at 0x70 is no loop
    assert (lp.start, lp.end, lp.size) == (0x20, 0x50, 4)
    assert lp.ops == {"LDG": 1, "F2FP": 1, "HMMA": 1, "BRA": 1}
    (lp_full,) = sass_loops.loops(fns["_Z6kernelPf"], full=True)
    assert lp_full.ops["F2FP.F16.E4M3.UNPACK_B"] == 1 and lp_full.ops["HMMA.16816.F32"] == 1
    assert sass_loops.loops(fns["_Z5otherv"]) == []


def test_opcode_drops_the_guard():
    assert sass_loops.opcode("@!P0 BRA 0x20") == "BRA"
    assert sass_loops.opcode("@UPT LDS.U16 R3, [R2]", full=True) == "LDS.U16"


def test_resources_from_the_ptxas_log():
    log = ("ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'\n"
           "    88 bytes stack frame, 180 bytes spill stores, 320 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 88 bytes cumulative stack size\n")
    assert sass_loops.resources(log) == {"_Z6kernelPf": "128 registers, 180 bytes spill stores"}


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("nvcc", "cuobjdump", "nvdisasm")),
                    reason="needs nvcc, cuobjdump and nvdisasm (CUDA toolkit)")
def test_the_shipped_gemv_has_its_hot_loop(capsys):
    sass_loops.main(["--filter", "ELb1E", "--min", "400"])  # the GLU (up) instances
    out = capsys.readouterr().out
    assert "HMMA 32" in out and "registers" in out
