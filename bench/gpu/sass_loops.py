#!/usr/bin/env python3
"""Instructions per loop of a CUDA kernel's SASS, read on any machine with nvcc (no GPU needed).

Compiles a torch-free ``.cu`` for sm_90 (default: the CUDA MXFP4 GEMV as shipped, bf16, ``DEFAULT_CONFIG``),
disassembles it with ``cuobjdump -sass`` (which needs ``nvdisasm`` on the PATH: both come with the CUDA toolkit,
or as the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels), and prints for every kernel its
registers and spills, then every loop (a backward branch and the instructions up to it) with at least
``--min`` instructions: its size, its ``HMMA`` count and its most frequent opcodes. A loop's instruction count
per load batch is what the GEMV's issue rate has to cover (``docs/perf.md``).

    python3 -m bench.gpu.sass_loops [--source kernel.cu] [--filter NAME] [--min 200] [--full OPCODE ...]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GUARD = re.compile(r"^@!?U?P[T\d]+\s+")


class Loop(NamedTuple):
    start: int  # address of the branch target (the loop's first instruction)
    end: int  # address of the backward branch
    ops: collections.Counter  # opcode (with modifiers when ``full``) -> count

    @property
    def size(self) -> int:
        return sum(self.ops.values())


def opcode(text: str, full: bool = False) -> str:
    """The opcode of one SASS instruction without its predicate guard (``@!P0 LDG.E ...`` -> ``LDG`` or, with
    ``full``, ``LDG.E``)."""
    op = _GUARD.sub("", text).split()[0]
    return op if full else op.split(".")[0]


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """``cuobjdump -sass`` text -> {function name: [(address, instruction text)]}."""
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = part.split("\n", 1) if "\n" in part else (part, "")
        out[name.strip()] = [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, body.splitlines()) if m]
    return out


def loops(instrs: list[tuple[int, str]], full: bool = False) -> list[Loop]:
    """Every backward branch of one function as a loop: the instructions from its target to the branch."""
    index = {a: i for i, (a, _) in enumerate(instrs)}
    found = []
    for i, (addr, text) in enumerate(instrs):
        if opcode(text) != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else None
        if target is None or target >= addr or target not in index:
            continue
        body = instrs[index[target]:i + 1]
        found.append(Loop(target, addr, collections.Counter(opcode(t, full) for _, t in body)))
    return found


def compile_sass(source: str, arch: str = "sm_90") -> tuple[str, str]:
    """(SASS text, ptxas' verbose log) of ``source`` compiled for ``arch``."""
    for tool in ("nvcc", "cuobjdump", "nvdisasm"):
        if shutil.which(tool) is None:
            raise SystemExit(f"sass_loops: {tool} is not on the PATH (CUDA toolkit; nvidia-cuda-cuobjdump and "
                             f"nvidia-cuda-nvdisasm wheels for the last two)")
    with tempfile.TemporaryDirectory() as d:
        cu, cubin = Path(d) / "k.cu", Path(d) / "k.cubin"
        cu.write_text(source)
        r = subprocess.run(["nvcc", "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o",
                            str(cubin), str(cu)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True)
        return sass.stdout, r.stderr


def resources(ptxas_log: str) -> dict[str, str]:
    """{mangled function name: "N registers, S bytes spill stores"} from ptxas' ``-v`` log."""
    out, name = {}, None
    for ln in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", ln)
        if m:
            name = m.group(1)
            continue
        if name and (m := re.search(r"(\d+) bytes spill stores", ln)):
            out[name] = f"{m.group(1)} bytes spill stores"
        if name and (m := re.search(r"Used (\d+) registers", ln)):
            out[name] = f"{m.group(1)} registers, " + out.get(name, "")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="a torch-free .cu (default: the CUDA MXFP4 GEMV, bf16, DEFAULT_CONFIG)")
    ap.add_argument("--filter", default="", help="only functions whose mangled name contains this")
    ap.add_argument("--min", type=int, default=200, help="smallest loop to list (instructions)")
    ap.add_argument("--full", action="store_true", help="opcodes with their modifiers (F2FP.F16.E4M3.UNPACK_B)")
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    if args.source:
        source = Path(args.source).read_text()
    else:
        from k3nn.kernels.moe import cuda_mx_gemv as cm

        source = cm.kernel_source((cm.DEFAULT_CONFIG,), ("bf16",))
    sass, log = compile_sass(source)
    res = resources(log)
    for name, instrs in functions(sass).items():
        if args.filter not in name:
            continue
        print(f"== {name}: {len(instrs)} instructions; {res.get(name, '?')}")
        for lp in loops(instrs, args.full):
            if lp.size >= args.min:
                top = ", ".join(f"{k} {v}" for k, v in lp.ops.most_common(args.top))
                hmma = sum(v for k, v in lp.ops.items() if k.split(".")[0] == "HMMA")
                print(f"   loop {lp.start:#x}-{lp.end:#x}: {lp.size} instructions, HMMA {hmma}: {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
