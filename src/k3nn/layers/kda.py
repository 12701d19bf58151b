"""KimiDeltaAttention: the linear-attention mixer of Kimi Linear and Kimi K3.

Per token (heads H, head dim D = K = V)::

    q, k, v = SiLU(ShortConv4(W_q x)), SiLU(ShortConv4(W_k x)), SiLU(ShortConv4(W_v x))
    q, k    = L2Norm(q), L2Norm(k)                       (eps 1e-6 inside the sqrt)
    β       = sigmoid(W_b x)                              one scalar per head
    g       = -exp(A_log) · softplus(f + dt_bias)         Kimi Linear ("softplus")
            | lower_bound · sigmoid(exp(A_log) · (f + dt_bias))   K3 ("lower_bound"), f = W_f↑ W_f↓ x
    S_t     = (I − β k kᵀ) Diag(e^{g}) S_{t−1} + β k vᵀ,   o_t = S_tᵀ (D^-½ q_t)
    y       = o_proj(RMSNorm_D(o) · sigmoid(gate)),        gate = g_b(g_a(x)) (low rank) | g_proj(x) (full rank)

Cache state per sequence (:class:`k3nn.cache.KDAState`): recurrent ``[N, H, D, D]`` fp32 and conv
``[N, W-1, 3·H·D]`` in the activation dtype: the last W-1 pre-conv inputs, token-major, channels ordered
q (H·D), k (H·D), v (H·D).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import ops
from ..config import KimiK3Config
from ..kernels.kda.prologue import kda_gate, l2norm, short_conv  # the eager math, re-exported
from ..kernels.registry import backend
from ..utils import records_grad, upcast
from .linear import Linear, project_onto
from .norm import GatedRMSNorm
from .packed import Packed, pack_linears, plain, unpack

__all__ = ["KimiDeltaAttention", "kda_gate", "l2norm", "short_conv"]


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention, the linear-attention token mixer (the math is in the module docstring).

    ``forward(x [B, T, d], state=None, attention_mask=None, checkpoint_positions=None) → [B, T, d]`` in x's dtype.
    Without ``state`` the call starts from a zero state; with a :class:`k3nn.cache.KDAState` it continues it and
    updates it in place (one token or a short window: the fused decode path; more: the chunked kernel).
    ``attention_mask`` [B, T] zeroes padded inputs (left padding). ``checkpoint_positions`` exports the recurrent state
    at chosen token positions from the same pass (prefix caching).

    Parameters: ``q_proj`` / ``k_proj`` / ``v_proj`` [H·D, d], their depthwise short convolutions (kernel
    ``short_conv_kernel_size``), the decay ``f_a_proj`` / ``f_b_proj`` (low rank), ``A_log`` [H] and ``dt_bias``
    [H·D] (fp32), ``b_proj`` [H, d] for β, the output gate (``g_a_proj`` / ``g_b_proj``, or ``g_proj`` with
    ``use_full_rank_gate``), the gated RMSNorm ``o_norm`` and ``o_proj`` [d, H·D]. The gate follows
    ``config.kda_gate``: Kimi Linear's softplus form or K3's lower-bounded sigmoid.

    Example::

        kda = KimiDeltaAttention(KimiK3Config.tiny())
        y = kda(torch.randn(2, 128, 64))          # [2, 128, 64]; trains through autograd
    """

    def __init__(self, config: KimiK3Config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        d, H, D = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.num_heads, self.head_dim, self.conv_size = H, D, config.short_conv_kernel_size
        self.gate_kind, self.lower_bound = config.kda_gate, config.gate_lower_bound
        C = H * D
        self.q_proj = Linear(d, C, bias=False)
        self.k_proj = Linear(d, C, bias=False)
        self.v_proj = Linear(d, C, bias=False)
        W = config.short_conv_kernel_size
        self.q_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.k_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.v_conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.f_a_proj = Linear(d, D, bias=False)
        self.f_b_proj = Linear(D, C, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(C, dtype=torch.float32))
        self.b_proj = Linear(d, H, bias=False)
        self.full_rank_gate = config.use_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = Linear(d, C, bias=False)
        else:
            self.g_a_proj = Linear(d, D, bias=False)
            self.g_b_proj = Linear(D, C, bias=False)
        self.o_norm = GatedRMSNorm(D, eps=config.rms_norm_eps)
        self.o_proj = Linear(C, d, bias=False)
        # with a cache and at most this many new tokens, forward uses the fused decode op (0 disables it)
        self.fused_decode_max_tokens = 16
        self._decode_in: Packed | None = None  # prepare_decode(): q|k|v|gate|f_a|b as one GEMM
        self._decode_conv: Packed | None = None

    def prepare_decode(self, on: bool = True) -> None:
        """Pack the input projections into one GEMM weight and the three conv kernels into one (see
        :mod:`k3nn.layers.packed`; kept when already packed); ``on=False`` drops them."""
        if not on:
            unpack(self._decode_in, self._decode_conv)
            self._decode_in = self._decode_conv = None
        elif self._decode_in is None and self._decode_conv is None:
            gate = [self.g_proj] if self.full_rank_gate else [self.g_a_proj]
            self._decode_in = pack_linears([[self.q_proj, self.k_proj, self.v_proj], gate, [self.f_a_proj],
                                            [self.b_proj]])
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            if all(plain(c.weight) for c in convs):
                self._decode_conv = Packed(lambda: [c.weight for c in convs])  # [3·H·D, W]

    @torch.no_grad()
    def reset_gate_parameters(self, generator: torch.Generator | None = None) -> None:
        """fla / Megatron init: A_log = log U[1, 16] (0 for the bounded gate), dt_bias = softplus⁻¹(dt)."""
        # drawn where the generator lives (the CPU by default), then copied to the parameters' device
        where = generator.device if generator is not None else "cpu"

        def uniform(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
            return torch.empty(t.shape, dtype=torch.float32, device=where).uniform_(lo, hi, generator=generator).to(t.device)

        if self.gate_kind == "softplus":
            self.A_log.copy_(uniform(self.A_log, 1, 16).log())
        else:
            self.A_log.zero_()
        dt = uniform(self.dt_bias, math.log(1e-3), math.log(1e-1)).exp()
        dt = dt.clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def conv_weight(self) -> torch.Tensor:
        """The three depthwise kernels concatenated: [3·H·D, W] (q, k, v)."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0).squeeze(1)

    def inputs(self, x: torch.Tensor):
        """The projections of x the layer starts from: ``(q|k|v, f_a(x), b_proj(x), gate_in, conv weight)``, where
        ``gate_in`` is ``g_a(x)`` (``g_proj(x)`` with the full-rank gate; :meth:`gate_from` finishes it). With the
        weights prepared (:meth:`prepare_decode`) and no autograd, one GEMM over the packed weight gives all four
        (views of its output) and the conv kernels come packed too; otherwise one GEMM each."""
        if self._decode_in is not None and not torch.is_grad_enabled():
            qkv, g, fa, b = self._decode_in.split(x)
            return qkv, fa, b, g, self._conv_weight()
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        g = self.g_proj(x) if self.full_rank_gate else self.g_a_proj(x)
        return qkv, self.f_a_proj(x), self.b_proj(x), g, self.conv_weight()

    def gate_from(self, gate_in: torch.Tensor) -> torch.Tensor:
        """The output gate's pre-activation from :meth:`inputs`' ``gate_in``."""
        return gate_in if self.full_rank_gate else self.g_b_proj(gate_in)

    def project(self, x: torch.Tensor, conv_prev: torch.Tensor | None):
        """Everything before the recurrence: returns q, k (L2-normed), v, g (fp32), beta (fp32), new conv state."""
        return self._project(x, conv_prev)[:6]

    def _project(self, x: torch.Tensor, conv_prev: torch.Tensor | None):
        """:meth:`project`'s tensors and the output gate's ``gate_in`` (see :meth:`inputs`).

        One ``ops.short_conv`` pass gives the conv + SiLU of q | k | v and the L2 norm of q and k. Its kernels and
        ``ops.kda_gate``'s are forward only: while autograd records, both run their eager math (which trains)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv, fa, b, gate_in, w = self.inputs(x)
        f = self.f_b_proj(fa)
        with backend("eager" if records_grad(qkv, w, conv_prev, f, self.A_log, self.dt_bias) else None):
            qkv, conv_new = ops.short_conv(qkv, w, conv_prev, l2norm_channels=2 * H * D, head_dim=D)
            g = ops.kda_gate(f, self.A_log, self.dt_bias, self.gate_kind, self.lower_bound, D)
        q, k, v = (t.reshape(B, T, H, D) for t in qkv.split(H * D, dim=-1))
        beta = torch.sigmoid(upcast(b))
        return q, k, v, g, beta, conv_new, gate_in

    def forward(self, x: torch.Tensor, state=None, attention_mask: torch.Tensor | None = None,
                checkpoint_positions=None, *, residual: torch.Tensor | None = None):
        """x [B, T, d]; state: :class:`k3nn.cache.KDAState` view for these B rows (updated in place) or None;
        attention_mask [B, T] (1 = token, 0 = padding: padded inputs are zeroed so they leave no trace when
        the state starts at zero, as with left padding). The state is shown the layer's (masked) input first
        (:meth:`~k3nn.cache.KDAState.observe_input`): the engine's paged state exports conv checkpoints from it,
        speculative rollback records verify windows with it. ``residual`` [B, T, d]: returned ``residual + kda(x)``,
        the add inside ``o_proj``'s GEMM."""
        if attention_mask is not None:
            x = x * attention_mask[..., None].to(x.dtype)
        if state is not None:
            state.observe_input(self, x)
        B, T, _ = x.shape
        if state is not None and 0 < T <= self.fused_decode_max_tokens and checkpoint_positions is None:
            return self._fused_decode(x, state, residual)
        conv_prev, init = (None, None) if state is None else state.read()
        q, k, v, g, beta, conv_new, gate_in = self._project(x, conv_prev)
        fn = ops.kda_recurrent if (state is not None and T == 1) else ops.kda_chunk
        res = fn(q, k, v, g, beta, initial_state=init, output_final_state=state is not None,
                 checkpoint_positions=checkpoint_positions)
        o, final = res[0], res[1]
        if state is not None:
            state.update(final, conv_new, res[2] if checkpoint_positions is not None else None)
        y = self.o_norm(o, self.gate_from(gate_in).reshape(B, T, self.num_heads, self.head_dim))
        return project_onto(self.o_proj, y.reshape(B, T, -1), residual)

    def commit_window(self, qkv: torch.Tensor, f: torch.Tensor, b: torch.Tensor, recurrent: torch.Tensor,
                      conv: torch.Tensor, state_indices: torch.Tensor, accepted: torch.Tensor) -> None:
        """Fold the first ``accepted[b]`` tokens of a verify window into the cached state of row b: the fused
        decode op over the window's recorded inputs (``qkv``, ``f``, ``b`` as :meth:`record_decode` saw them)
        with ``num_tokens = accepted``; rows with ``state_indices`` −1 are left alone. Graph-safe."""
        ops.kda_fused_decode(qkv, f, b, f, self._conv_weight(), self.A_log, self.dt_bias, self.o_norm.weight,
                             recurrent, conv, state_indices, gate_kind=self.gate_kind, lower_bound=self.lower_bound,
                             norm_eps=self.o_norm.eps, num_tokens=accepted)

    def _conv_weight(self) -> torch.Tensor:
        return self._decode_conv.get() if self._decode_conv is not None else self.conv_weight()

    def _fused_decode(self, x: torch.Tensor, state, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Decode / verify-window path: the projections, then one ``ops.kda_fused_decode`` (conv update, gate,
        β, L2 norm, recurrence, gated RMSNorm) that updates the cache in place, then ``o_proj``. The state's
        ``state_indices`` / ``num_tokens`` / ``write_state`` (see :class:`~k3nn.cache.KDAState`) go to the op."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv, fa, b, gate_in, conv_w = self.inputs(x)
        gate = self.gate_from(gate_in)
        rec, conv = state.recurrent, state.conv
        f = self.f_b_proj(fa)
        state.record_decode(qkv, f, b)
        y = ops.kda_fused_decode(qkv, f, b, gate, conv_w, self.A_log, self.dt_bias, self.o_norm.weight, rec, conv,
                                 state.state_indices, gate_kind=self.gate_kind, lower_bound=self.lower_bound,
                                 norm_eps=self.o_norm.eps, num_tokens=state.num_tokens,
                                 write_state=state.write_state)
        state.update(rec, conv, None)  # a no-op for states updated in place; gathered copies write back
        return project_onto(self.o_proj, y.reshape(B, T, H * D), residual)
