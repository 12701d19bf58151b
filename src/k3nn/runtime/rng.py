"""Counter-based random numbers, one stream per batch row: reproducible whatever the batch.

A value is a hash of ``(seed_b, counter_b, stream, index)``: row b's draws depend on its own seed and counter
(the request's seed and the output position being sampled), not on which rows share the batch, how the batch is
padded, or how many draws other rows made. So a seeded request gives the same tokens alone, in a batch of 64,
after a preemption, or replayed inside a CUDA graph; and the draws need no generator state (graph-safe, no host
sync).

The hash is a 32-bit integer mixer (xor-shift / multiply by 0x45d9f3b, three rounds) evaluated in int64 torch ops
whose intermediate products stay below 2**59, so it is exact and identical on every device. A uniform takes the
top 24 bits: ``u = (h >> 8 + 0.5) / 2**24`` in (0, 1), fp32's resolution.
"""

from __future__ import annotations

import torch

__all__ = ["RowRNG", "GeneratorRNG", "mix32", "TOKEN", "ACCEPT", "RESIDUAL", "DRAFT"]

_MASK = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: (x < 2**32) * _MUL < 2**59, no int64 overflow
_GOLDEN = 0x9E3779B9

#: stream ids: the sampled token, speculative acceptance uniforms, the residual / bonus token, drafter samples
TOKEN, ACCEPT, RESIDUAL, DRAFT = 0, 1, 2, 3


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32) (elementwise)."""
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    x = (((x >> 16) ^ x) * _MUL) & _MASK
    return (x >> 16) ^ x


class RowRNG:
    """Random draws for B rows: ``seed`` [B] int64 (any non-negative 63-bit value), ``counter`` [B] int64 (the
    position being sampled). ``uniform(stream, n)`` → [B, n] fp32 in (0, 1); index j of row b depends only on
    (seed_b, counter_b + offset, stream, j)."""

    def __init__(self, seed: torch.Tensor, counter: torch.Tensor):
        if seed.shape != counter.shape or seed.dim() != 1:
            raise ValueError(f"RowRNG: seed and counter must be [B], got {tuple(seed.shape)} and "
                             f"{tuple(counter.shape)}")
        self.seed, self.counter = seed.long(), counter.long()

    def _row_key(self, stream: int, offset: torch.Tensor | int = 0) -> torch.Tensor:
        c = (self.counter + offset) & _MASK
        h = mix32(c ^ ((stream * _GOLDEN) & _MASK))
        h = mix32(h ^ (self.seed & _MASK))
        return mix32(h ^ ((self.seed >> 32) & _MASK))  # [..]

    def bits(self, stream: int, n: int, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """[B, n] int64 hash values in [0, 2**32). ``offset`` (int or [B] / [B, 1] tensor) shifts the counter."""
        key = self._row_key(stream, offset if not isinstance(offset, torch.Tensor) or offset.dim() < 2
                            else offset[:, 0])
        j = torch.arange(n, device=key.device, dtype=torch.long)
        return mix32(key[:, None] ^ mix32((j[None, :] + _GOLDEN) & _MASK))

    def uniform(self, stream: int, n: int, offset: torch.Tensor | int = 0, rows: int | None = None,
                device=None) -> torch.Tensor:
        """[B, n] fp32 uniforms in (0, 1) (``rows`` / ``device``: :class:`GeneratorRNG`'s; here the seeds' own)."""
        h = self.bits(stream, n, offset)
        return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))

    def exponential(self, stream: int, n: int, offset: torch.Tensor | int = 0) -> torch.Tensor:
        """[B, n] fp32 Exp(1) draws (−log u)."""
        return -torch.log(self.uniform(stream, n, offset))

    def gumbel_argmax(self, scores: torch.Tensor, stream: int = TOKEN,
                      offset: torch.Tensor | int = 0) -> torch.Tensor:
        """scores [B, V] (log-weights, −inf allowed) → [B] indices drawn from softmax(scores): the exponential race
        argmax(p / E) = argmax(scores − log E), without a softmax."""
        e = self.exponential(stream, scores.shape[-1], offset)
        return (scores.float() - torch.log(e)).argmax(-1)


class GeneratorRNG:
    """:class:`RowRNG`'s interface over a ``torch.Generator`` (``generate()``'s seeded calls draw from one generator
    for the whole batch): ``uniform`` is ``torch.rand``, ``gumbel_argmax`` the exponential race with
    ``exponential_``; ``stream`` and ``offset`` are ignored (the generator's state orders the draws)."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def uniform(self, stream: int, n: int, offset=0, rows: int | None = None, device=None) -> torch.Tensor:
        return torch.rand(rows, n, device=device, generator=self.generator)

    def gumbel_argmax(self, scores: torch.Tensor, stream: int = TOKEN, offset=0) -> torch.Tensor:
        p = scores.float().softmax(-1)
        noise = torch.empty_like(p).exponential_(generator=self.generator)
        return (p / noise).argmax(-1)
