"""Small fused kernels of the latency-specialized decode path (each replaces a chain of eager launches).

* ``rmsnorm``: ``w · (x · rsqrt(mean(x²) + eps))`` with :class:`~k3nn.layers.norm.RMSNorm`'s rounding (fp32
  normalisation, cast to x's dtype, then the gain) — one launch instead of ~7.
* ``glu``: ``act(gate, up)`` over a fused ``[N, 2I]`` gate|up projection (SiLU-GLU or K3's SiTU-GLU, fp32 math)
  — one launch instead of ~10.
* ``sigmoid_gate``: ``(o · σ(g))`` in fp32, cast back (MLA output gate) — one launch instead of ~4.
* ``route``: sigmoid router scores, bias-corrected top-k selection, raw-score weights, renormalisation and
  scaling (:func:`k3nn.layers.moe.route` without expert groups) — one launch instead of ~10.

``impl``: ``"triton"`` forces the kernel (CPU tensors need ``TRITON_INTERPRET=1``: how the tests check them);
``"eager"`` the plain-PyTorch form (the reference); ``"auto"`` Triton on CUDA tensors, eager elsewhere; None →
``decode_kernels`` of the current :class:`~k3nn.kernels.registry.KernelTuning` (default ``"eager"``;
``k3nn.kernels.registry.tuning(decode_kernels="auto")`` turns them on, as the e2e benchmark's
``latency_specialized+kernels`` mode does).
"""

from __future__ import annotations

import torch

from ..kernels.registry import current_tuning
from ..layers.mlp import glu_activation
from ..layers.moe import route as route_reference

__all__ = ["rmsnorm", "glu", "sigmoid_gate", "route"]

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton missing
    triton = None


def _use_triton(t: torch.Tensor, impl: str | None) -> bool:
    impl = impl or current_tuning().decode_kernels
    if impl not in ("auto", "triton", "eager"):
        raise ValueError(f"impl must be None, 'auto', 'triton' or 'eager', got {impl!r}")
    if impl == "auto":
        return triton is not None and t.is_cuda
    return impl == "triton"


if triton is not None:

    from ..kernels.tl_math import tanh as _tanh

    @triton.jit
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=m, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        xn = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32)  # RMSNorm: cast back, then the gain
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * D + offs, (xn * w).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _glu_kernel(gu_ptr, y_ptr, I, beta, linear_beta, ACT: tl.constexpr, CAP: tl.constexpr,
                    BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < I
        g = tl.load(gu_ptr + row * 2 * I + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * I + I + offs, mask=m, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        if ACT == 0:
            y = g * sig * u
        else:
            a = beta * _tanh(g / beta) * sig
            if CAP:
                u = linear_beta * _tanh(u / linear_beta)
            y = a * u
        tl.store(y_ptr + row * I + offs, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _sigmoid_gate_kernel(o_ptr, g_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        o = tl.load(o_ptr + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (o / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _route_kernel(logit_ptr, bias_ptr, ids_ptr, w_ptr, E, scaling, K: tl.constexpr, RENORM: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        x = tl.load(logit_ptr + row * E + offs, mask=m, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-x))
        choice = tl.where(m, s + tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32), float("-inf"))
        ks = tl.arange(0, BLOCK_K)
        ids = tl.zeros([BLOCK_K], dtype=tl.int64)
        w = tl.zeros([BLOCK_K], dtype=tl.float32)
        for j in tl.static_range(K):
            best = tl.max(choice, 0)
            idx = tl.min(tl.where(choice == best, offs, BLOCK_E), 0)
            sj = tl.sum(tl.where(offs == idx, s, 0.0), 0)
            ids = tl.where(ks == j, idx.to(tl.int64), ids)
            w = tl.where(ks == j, sj, w)
            choice = tl.where(offs == idx, float("-inf"), choice)
        if RENORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        km = ks < K
        tl.store(ids_ptr + row * K + ks, ids, mask=km)
        tl.store(w_ptr + row * K + ks, w * scaling, mask=km)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str | None = None) -> torch.Tensor:
    """x [..., D] → [..., D] (x.dtype)."""
    if not _use_triton(x, impl):
        xf = x.float() if x.dtype != torch.float64 else x
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    y = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, weight.dtype))
    _rmsnorm_kernel[(x2.shape[0],)](x2, weight, y, D, float(eps), BLOCK=triton.next_power_of_2(D),
                                    num_warps=8 if D >= 4096 else 4)
    return y.view(*x.shape[:-1], D)


def glu(gu: torch.Tensor, act: str, beta: float = 4.0, linear_beta: float | None = 25.0,
        impl: str | None = None) -> torch.Tensor:
    """gu [..., 2I] (gate | up) → act(gate, up) [..., I] in gu's dtype."""
    I = gu.shape[-1] // 2
    if not _use_triton(gu, impl):
        g, u = gu.split(I, -1)
        return glu_activation(g, u, act, beta, linear_beta)
    if act not in ("silu", "situ"):
        raise ValueError(f"unknown activation {act!r}; expected 'silu' or 'situ'")
    g2 = gu.reshape(-1, 2 * I).contiguous()
    y = torch.empty(g2.shape[0], I, dtype=gu.dtype, device=gu.device)
    BLOCK = min(1024, triton.next_power_of_2(I))
    _glu_kernel[(g2.shape[0], triton.cdiv(I, BLOCK))](g2, y, I, float(beta), float(linear_beta or 1.0),
                                                      ACT=0 if act == "silu" else 1, CAP=linear_beta is not None,
                                                      BLOCK=BLOCK)
    return y.view(*gu.shape[:-1], I)


def sigmoid_gate(o: torch.Tensor, g: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """(o · σ(g)) in fp32, o's dtype; o and g of one shape."""
    if not _use_triton(o, impl):
        return (o.float() * torch.sigmoid(g.float())).to(o.dtype)
    o2, g2 = o.contiguous(), g.contiguous()
    y = torch.empty_like(o2)
    n = o2.numel()
    _sigmoid_gate_kernel[(triton.cdiv(n, 1024),)](o2, g2, y, n, BLOCK=1024)
    return y


def route_supported(router) -> bool:
    return (router.score_func == "sigmoid" and (router.num_group <= 1 or router.topk_group >= router.num_group)
            and router.weight.shape[0] <= 4096)


def _route_eager(logits: torch.Tensor, router) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`k3nn.layers.moe.route` (sigmoid, no expert groups) in fewer launches: no NaN/Inf check (the
    standard step skips it under graph capture too), an unsorted top-k, no multiply when the scaling is 1."""
    K = router.top_k
    if not 1 <= K <= logits.shape[-1]:
        raise ValueError(f"route: top_k={K} must be in [1, num_experts={logits.shape[-1]}]")
    s = logits.sigmoid()
    ids = torch.topk(s + router.e_score_correction_bias, K, -1, sorted=False)[1]
    w = s.gather(1, ids)
    if router.renormalize and K > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, (w * router.scaling if router.scaling != 1.0 else w)


def route(logits: torch.Tensor, router, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32 → (ids [N, k] int64, weights [N, k] fp32), as :func:`k3nn.layers.moe.route`."""
    if not _use_triton(logits, impl) or not route_supported(router):
        if router.score_func != "sigmoid" or (router.num_group > 1 and router.topk_group < router.num_group):
            return route_reference(logits, router.e_score_correction_bias, router.top_k, router.renormalize,
                                   router.scaling, router.num_group, router.topk_group, router.score_func)
        return _route_eager(logits, router)
    N, E = logits.shape
    K = router.top_k
    ids = torch.empty(N, K, dtype=torch.int64, device=logits.device)
    w = torch.empty(N, K, dtype=torch.float32, device=logits.device)
    _route_kernel[(N,)](logits.contiguous(), router.e_score_correction_bias, ids, w, E, float(router.scaling), K=K,
                        RENORM=bool(router.renormalize and K > 1), BLOCK_E=triton.next_power_of_2(E),
                        BLOCK_K=triton.next_power_of_2(K))
    return ids, w
