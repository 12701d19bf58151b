"""Float literals inside Triton kernels must be fp32 values: Triton types a Python float outside fp32's normal
range (e.g. 1e-38, a subnormal) as fp64, which silently promotes whatever it touches and breaks loop-carried
fp32 accumulators at compile time on the GPU (the CPU interpreter does not notice)."""

import ast
import pathlib

import pytest

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "src" / "k3nn" / "kernels"
FP32_MIN_NORMAL, FP32_MAX = 2.0 ** -126, (2 - 2 ** -23) * 2.0 ** 127


def _jit_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) or "autotune" in ast.unparse(d) for d in node.decorator_list):
            yield node


@pytest.mark.parametrize("path", sorted(KERNELS.rglob("triton_*.py")) + sorted(KERNELS.rglob("merge.py")),
                         ids=lambda p: str(p.relative_to(KERNELS)))
def test_float_literals_in_kernels_are_fp32(path):
    bad = []
    for fn in _jit_functions(ast.parse(path.read_text())):
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and isinstance(node.value, float):
                v = abs(node.value)
                if v != 0.0 and v == v and v != float("inf") and not FP32_MIN_NORMAL <= v <= FP32_MAX:
                    bad.append(f"{fn.name}:{node.lineno} {node.value!r}")
    assert not bad, f"float literals Triton types as fp64: {bad}"
