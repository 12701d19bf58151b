"""KDA kernels: eager reference and Triton backends; the prologue ops (short convolution, decay gate) with their
eager math in :mod:`.prologue`."""

from __future__ import annotations

from ..registry import register
from .api import check_kda_inputs, normalise_checkpoints
from .decode import kda_fused_decode_reference
from .chunk_torch import kda_chunk_eager
from .prologue import kda_gate, short_conv_reference
from .reference import kda_recurrent_reference

# eager prefill runs the chunk-parallel PyTorch form; the per-token loop stays the reference (and the
# eager decode-shaped op), which every backend, this one included, is tested against
register("kda_chunk", "eager")(kda_chunk_eager)
register("kda_recurrent", "eager")(kda_recurrent_reference)
register("kda_fused_decode", "eager")(kda_fused_decode_reference)
register("short_conv", "eager")(short_conv_reference)
register("kda_gate", "eager")(kda_gate)

try:  # Triton backends (registration is cheap: nothing compiles until first call)
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is a hard dependency on Linux
    pass
else:
    from .chunk_torch import kda_chunk_triton
    from .triton_chunk import supports_kda_chunk
    from .triton_decode import kda_fused_decode_triton, supports_fused_decode
    from .triton_prologue import kda_gate_triton, short_conv_triton, supports_kda_gate, supports_short_conv

    register("kda_chunk", "triton", supports=supports_kda_chunk)(kda_chunk_triton)
    register("kda_recurrent", "triton", supports=supports_kda_chunk)(kda_chunk_triton)
    register("kda_fused_decode", "triton", supports=supports_fused_decode)(kda_fused_decode_triton)
    register("short_conv", "triton", supports=supports_short_conv)(short_conv_triton)
    register("kda_gate", "triton", supports=supports_kda_gate)(kda_gate_triton)
