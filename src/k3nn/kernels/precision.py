"""Precision of the Triton kernels' fp32 products: the exact fp32 mode follows torch's TF32 setting.

torch computes fp32 matmuls in IEEE fp32 unless TF32 is allowed (``torch.backends.cuda.matmul.allow_tf32 =
True``, ``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.fp32_precision = "tf32"``).
The Triton kernels do the same: every ``tl.dot`` that can see fp32 operands takes ``input_precision=DOT_PREC``,
a ``tl.constexpr`` argument that the launcher sets from :func:`dot_precision` at each launch (never cached), so

* fp32 inputs with TF32 off (torch's own default): IEEE fp32 products (CUDA-core FMA, fp32 rounding only);
* fp32 inputs with TF32 on: TF32 tensor-core products, the kernels compiled exactly as before this mode existed;
* fp16 / bf16 inputs: unchanged (their products run on the input dtype; fp32 products inside them, such as KDA's
  diagonal score blocks, stay TF32).

Each value compiles its own kernel (constexprs are part of Triton's cache key) and the autotuned kernels list
``DOT_PREC`` in their keys, so an IEEE run tunes its own tiles and never changes the TF32 run's choice.
Triton's ``default_dot_input_precision`` launch option is no substitute: ``tl.dot`` fills in ``"tf32"`` for an
unspecified precision before that option is consulted (Triton 3.x), so the option leaves fp32 products on TF32.
Products pinned to ``input_precision="ieee"`` (the KDA ``(I + L)⁻¹`` blocks, whatever the dtype) stay IEEE.
"""

from __future__ import annotations

__all__ = ["DOT_PRECISIONS", "tf32_allowed", "dot_precision"]

#: the values :func:`dot_precision` returns (both valid ``tl.dot`` input precisions on NVIDIA GPUs and under the
#: interpreter, which ignores them)
DOT_PRECISIONS = ("ieee", "tf32")


def tf32_allowed() -> bool:
    """Whether torch allows TF32 for fp32 CUDA matmuls, read now: the matmul ``fp32_precision`` where torch has it
    (2.9+; ``"none"`` defers to ``torch.backends.fp32_precision`` and then to ``allow_tf32``), else ``allow_tf32``."""
    import torch

    m = torch.backends.cuda.matmul
    p = getattr(m, "fp32_precision", None)
    if isinstance(p, str) and p not in ("", "none"):
        return p == "tf32"
    try:
        return bool(m.allow_tf32)
    except RuntimeError:  # torch refuses to answer after a mix of its old and new precision APIs
        return False


def dot_precision(dtype) -> str:
    """``tl.dot`` input precision for a kernel on ``dtype`` activations: ``"ieee"`` for fp32 while torch does not
    allow TF32, else ``"tf32"`` (also for fp16 / bf16, whose own products ignore it)."""
    import torch

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dot_precision: dtype must be a torch.dtype, got {type(dtype).__name__}")
    return "ieee" if dtype == torch.float32 and not tf32_allowed() else "tf32"
