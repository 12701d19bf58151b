"""MXFP4 quantize / dequantize against the OCP MX v1.0 value table (bit-exact), packing, scales, edge cases."""

import math

import pytest
import torch
from hypothesis import given, note, strategies as st

from k3nn import ops
from k3nn.quant import MXFP4Weight, bits_per_weight, mxfp4_dequantize, mxfp4_quantize

# OCP MX v1.0, FP4 E2M1 (bias 1): code → value, written out from the spec table (not from the implementation)
SPEC_E2M1 = {0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0,
             0b0111: 6.0, 0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0,
             0b1110: -4.0, 0b1111: -6.0}
GRID = sorted({abs(v) for v in SPEC_E2M1.values()})  # 0 .5 1 1.5 2 3 4 6


def _oracle_block(block: list[float]) -> tuple[int, list[int]]:
    """Independent scalar OCP quantizer for one 32-block: (scale byte, codes)."""
    if any(not math.isfinite(v) for v in block):
        return 255, None
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0, [0] * 32
    e = math.frexp(amax)[1] - 1 - 2
    e = max(-127, min(127, e))
    codes = []
    for v in block:
        a = min(abs(v) / 2.0 ** e, 6.0)
        best = min(range(8), key=lambda c: (abs(GRID[c] - a), c % 2))  # nearest, ties to the even code
        codes.append(best + (8 if v < 0 and best > 0 else 0))
    return e + 127, codes


def _codes(q: MXFP4Weight) -> torch.Tensor:
    return torch.stack([q.packed & 0xF, q.packed >> 4], -1).flatten(-2)


def test_every_byte_decodes_per_spec_table():
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat_interleave(1, 0)  # 16 rows of 16 bytes
    packed = packed.reshape(8, 32)  # 8 rows × 64 elements = 2 blocks each
    scale = torch.full((8, 2), 127, dtype=torch.uint8)
    out = mxfp4_dequantize(packed, scale)
    for b in range(256):
        r, c = divmod(b, 32)
        lo, hi = out[r, 2 * c].item(), out[r, 2 * c + 1].item()
        assert lo == SPEC_E2M1[b & 0xF] and hi == SPEC_E2M1[b >> 4], b
        assert math.copysign(1, lo) == math.copysign(1, SPEC_E2M1[b & 0xF])


@pytest.mark.parametrize("s", [0, 1, 100, 126, 127, 128, 200, 254])
def test_scale_values(s):
    packed = torch.full((1, 16), 0x71, dtype=torch.uint8)  # low 0.5, high 6
    out = mxfp4_dequantize(packed, torch.tensor([[s]], dtype=torch.uint8), torch.float64)
    assert out[0, 0].item() == 0.5 * 2.0 ** (s - 127)
    assert out[0, 1].item() == 6.0 * 2.0 ** (s - 127)
    f32 = mxfp4_dequantize(packed, torch.tensor([[s]], dtype=torch.uint8))
    assert f32[0, 0].item() == 0.5 * 2.0 ** (s - 127)  # 2^-128 is an fp32 subnormal: still exact
    assert f32[0, 1].item() == (6.0 * 2.0 ** (s - 127) if s < 254 else float("inf"))


def test_nan_scale_poisons_only_its_block():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)
    scale = torch.tensor([[255, 127], [127, 127]], dtype=torch.uint8)
    out = mxfp4_dequantize(packed, scale)
    assert out[0, :32].isnan().all() and (out[0, 32:] == 1).all() and (out[1] == 1).all()


def test_packing_even_index_in_low_nibble():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 1.0, 6.0, -0.5, 3.0  # amax 6 → scale 2^0
    q = mxfp4_quantize(w)
    assert q.scale.item() == 127
    assert q.packed[0, 0].item() == 0x72 and q.packed[0, 1].item() == 0x59
    assert q.packed.shape == (1, 16) and q.scale.shape == (1, 1)


def test_rounding_ties_to_even_and_saturation():
    # scale 2^0 (amax in [4, 8)); midpoints go to the even code, just off a midpoint goes nearest
    vals = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, 0.2500001, 2.4999, 5.0001, 6.9, 0.1, 6.0]
    vals = vals + [-v for v in vals] + [4.0, 4.0, 4.0, 4.0]
    w = torch.tensor(vals, dtype=torch.float32)[None]
    q = mxfp4_quantize(w)
    assert q.scale.item() == 127
    got = mxfp4_dequantize(q.packed, q.scale)[0].tolist()
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.5, 2.0, 6.0, 6.0, 0.0, 6.0]
    want = want + [-v for v in want] + [4.0] * 4
    assert got == want


def test_zero_block_nan_inf_blocks():
    w = torch.zeros(3, 32)
    w[1, 5] = float("nan")
    w[2, 0] = float("-inf")
    q = mxfp4_quantize(w)
    assert q.scale[:, 0].tolist() == [0, 255, 255]
    assert (q.packed[0] == 0).all()
    d = q.dequantize()
    assert (d[0] == 0).all() and d[1:].isnan().all()


def test_scale_clamps_and_extremes():
    w = torch.zeros(2, 32)
    w[0, 0] = 2.0 ** -140  # below the smallest scale: clamps to 2^-127 and flushes to code 0
    w[1, 0] = torch.finfo(torch.float32).max
    q = mxfp4_quantize(w)
    assert q.scale[0, 0].item() == 0 and q.packed[0, 0].item() == 0
    assert q.scale[1, 0].item() == 127 + 127 - 2
    assert q.dequantize()[1, 0].item() == 6.0 * 2.0 ** 125  # 1.99·2^127 saturates to 6·2^125


def test_even_scale_rule_matches_compressed_tensors():
    w = torch.zeros(2, 32)
    w[0, 0] = 7.0  # mantissa 1.75 → amax rounds up to 8: scale 2^1, 7/2 = 3.5 ties to 4 → 8
    w[1, 0] = 6.5  # mantissa 1.625 → no bump: scale 2^0, saturates at 6
    ocp, even = mxfp4_quantize(w), mxfp4_quantize(w, scale_rule="even")
    assert ocp.scale[:, 0].tolist() == [127, 127] and even.scale[:, 0].tolist() == [128, 127]
    assert even.dequantize()[:, 0].tolist() == [8.0, 6.0] and ocp.dequantize()[:, 0].tolist() == [6.0, 6.0]


@given(rows=st.integers(1, 4), blocks=st.integers(1, 3), log_mag=st.integers(-130, 120), seed=st.integers(0, 2**31 - 1))
def test_quantize_bit_exact_vs_scalar_oracle(rows, blocks, log_mag, seed):
    note(f"rows={rows} blocks={blocks} log_mag={log_mag}")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 32 * blocks, generator=g) * 2.0 ** log_mag
    # sprinkle exact ties and zeros
    w[:, ::7] = (torch.randint(0, 15, (rows, w[:, ::7].shape[1]), generator=g).float() * 0.25 - 1.75) * 2.0 ** log_mag
    q = mxfp4_quantize(w)
    codes = _codes(q)
    for r in range(rows):
        for b in range(blocks):
            s, c = _oracle_block(w[r, 32 * b:32 * (b + 1)].tolist())
            assert q.scale[r, b].item() == s
            assert codes[r, 32 * b:32 * (b + 1)].tolist() == c


@given(n=st.integers(1, 5), blocks=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_dequant_requant_roundtrip_is_value_exact(n, blocks, seed):
    note(f"n={n} blocks={blocks}")
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, 16 * blocks), generator=g, dtype=torch.uint8)
    scale = torch.randint(10, 245, (n, blocks), generator=g, dtype=torch.uint8)
    v = mxfp4_dequantize(packed, scale)
    v2 = mxfp4_dequantize(*mxfp4_quantize(v))
    assert torch.equal(v.abs(), v2.abs()) and torch.equal(v, v2 + 0.0)  # -0 may come back as +0


def test_memory_is_4_25_bits_per_weight():
    q = mxfp4_quantize(torch.randn(3, 64, 256))
    assert bits_per_weight(q) == 4.25
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (3, 64, 128) and q.scale.shape == (3, 64, 8)


def test_bf16_dequant_exact_and_ops_dispatch():
    w = torch.randn(8, 64)
    q = ops.mxfp4_quantize(w)
    assert torch.equal(ops.mxfp4_dequantize(q, dtype=torch.bfloat16).float(), ops.mxfp4_dequantize(q.packed, q.scale))
    assert torch.equal(ops.mxfp4_dequantize(q), q.dequantize())


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.mxfp4_quantize(torch.randn(4, 33))
    with pytest.raises(TypeError, match="floating-point"):
        ops.mxfp4_quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scale_rule"):
        ops.mxfp4_quantize(torch.randn(4, 32), scale_rule="up")
    p = torch.zeros(4, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="disagree"):
        ops.mxfp4_dequantize(p, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="disagree"):
        ops.mxfp4_dequantize(p, torch.zeros(3, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        ops.mxfp4_dequantize(p.int(), torch.zeros(4, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale is required"):
        ops.mxfp4_dequantize(p)
