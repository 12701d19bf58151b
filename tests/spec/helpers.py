"""Shared fixtures for the speculative-decoding tests: a tiny target and a drafter whose acceptance is set."""

from __future__ import annotations

import torch

from k3nn.config import KimiK3Config
from k3nn.layers.dspark import DraftProposal
from k3nn.model import KimiK3


def tiny_target(dtype=torch.float32, **overrides) -> KimiK3:
    # a larger init than the default makes next-token distributions peaked, so greedy argmaxes have clear margins
    kw = dict(initializer_range=0.2)
    kw.update(overrides)
    return KimiK3(KimiK3Config.tiny(**kw), dtype=dtype, backend="eager", seed=0)


def structured_target(alpha: float = 0.25) -> KimiK3:
    """A tiny target whose head is tilted towards a random token permutation: dominant transitions plus context
    effects, so even an untrained DSpark drafter (sharing embedding and lm_head) gets partial acceptance."""
    model = KimiK3(KimiK3Config.tiny(), backend="eager", seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        V, d = model.config.vocab_size, model.config.hidden_size
        E = torch.randn(V, d, generator=g)
        model.model.embed_tokens.weight.copy_(E)
        model.lm_head.weight.copy_(alpha * E[torch.randperm(V, generator=g)] + 0.5 * torch.randn(V, d, generator=g))
    return model


class OracleDrafter:
    """Drafts the target's own greedy continuation ``ref`` [B, n] but corrupts draft ``accept[b]`` (0-based) of
    every round, so row b accepts exactly min(accept[b], verified) drafts per round when decoding is correct.
    ``confidence``: optional [γ] schedule returned as the confidence of each slot."""

    target_layers: list[int] = []

    def __init__(self, ref: torch.Tensor, prompt_lengths: torch.Tensor, accept, vocab_size: int,
                 confidence=None):
        self.ref, self.prompt_lengths = ref, prompt_lengths
        self.accept = torch.as_tensor(accept, dtype=torch.long)
        self.V, self.confidence = vocab_size, confidence
        self.calls = 0

    def new_state(self, batch_size, capacity):
        return None

    def extend(self, state, taps, positions, mask=None, start=None):
        pass

    def propose(self, state, anchor, anchor_pos, n, sample_cfg=None, generator=None):
        self.calls += 1
        B = anchor.shape[0]
        emitted = anchor_pos - self.prompt_lengths + 1  # the pending token is ref[emitted - 1]
        j = emitted[:, None] + torch.arange(n)
        ref = torch.cat([self.ref, self.ref.new_zeros(B, n + 1)], 1)
        toks = ref.gather(1, j.clamp(max=ref.shape[1] - 1))
        bad = torch.arange(n)[None, :] == self.accept[:, None]
        toks = torch.where(bad, (toks + 1) % self.V, toks)
        conf = None if self.confidence is None else torch.as_tensor(self.confidence, dtype=torch.float32)[:n].expand(B, n)
        return DraftProposal(toks, None, conf)
