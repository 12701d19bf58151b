"""Device math shared by the Triton kernels, written with ``tl.*`` only (no libdevice, so the interpreter runs it)."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # sign(x)·(1 − e^{−2|x|}) / (1 + e^{−2|x|}): no overflow for large |x|
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def sigmoid(x):
    # e^{−|x|} never overflows; both branches are exact to rounding
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def log1p(x):
    # Goldberg's log1p: log(u)·x/(u−1) with u = 1 + x cancels the rounding of u, so small x keeps its precision
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def softplus(x):
    # torch.nn.functional.softplus(x, beta=1, threshold=20): x above the threshold, log1p(e^x) below
    return tl.where(x > 20.0, x, log1p(tl.exp(tl.minimum(x, 20.0))))
