"""Training a DSpark drafter: the loss and an online trainer (target hidden states captured on the fly).

Loss per block slot k (0-based), weight ``w_k = exp(−k / decay)`` × validity (validity is a cumulative product
along k: once a slot's label is outside the sequence or masked, later slots are too)::

    L_ce   = Σ w · CE(z, x*) / Σ w                            x* = token at anchor + k + 1
    L_tv   = Σ w · ‖p_d − p_t‖₁ / Σ w                          p_t = target's distribution for that token
    L_conf = Σ w · BCE(conf_logit, clamp(1 − ½‖p_d − p_t‖₁, 0, 1)) / Σ w   (label detached)
    L      = ce_weight · L_ce + tv_weight · L_tv + conf_weight · L_conf

Defaults 0.1 / 0.9 / 1.0 and decay 4 follow the released DSpark training configs (their distance term is the
unhalved L1 distance, i.e. 2 × total variation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["dspark_loss", "DSparkTrainer", "sample_anchors"]


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, confidence_logits: torch.Tensor,
                labels: torch.Tensor, valid: torch.Tensor | None = None, decay: float = 4.0,
                ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """draft_logits, target_logits [..., γ, V]; confidence_logits, labels, valid [..., γ] → dict with ``loss``
    and its parts (``ce``, ``tv`` (L1 distance), ``conf``) plus ``accept`` [γ] (mean analytic acceptance
    1 − TV per slot over valid slots) and ``tau`` (expected acceptance length 1 + Σ_k Π_{i≤k} c*_i)."""
    G = draft_logits.shape[-2]
    if valid is None:
        valid = torch.ones(labels.shape, dtype=torch.bool, device=labels.device)
    valid = valid.long().cumprod(-1).bool()
    k = torch.arange(G, device=draft_logits.device, dtype=torch.float32)
    w = torch.exp(-k / decay) * valid.float()
    wsum = w.sum().clamp_min(1e-8)
    z = draft_logits.float()
    pd = z.softmax(-1)
    pt = target_logits.detach().float().softmax(-1)
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    l1 = (pd - pt).abs().sum(-1)
    c_star = (1 - 0.5 * l1).clamp(0, 1).detach()
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none")
    L_ce, L_tv, L_conf = (w * ce).sum() / wsum, (w * l1).sum() / wsum, (w * bce).sum() / wsum
    loss = ce_weight * L_ce + tv_weight * L_tv + conf_weight * L_conf
    vf = valid.float()
    flat_c, flat_v = c_star.reshape(-1, G), vf.reshape(-1, G)
    accept = (flat_c * flat_v).sum(0) / flat_v.sum(0).clamp_min(1)
    tau = (1 + (flat_c * flat_v).cumprod(-1).sum(-1)).mean()
    return {"loss": loss, "ce": L_ce.detach(), "tv": L_tv.detach(), "conf": L_conf.detach(),
            "accept": accept.detach(), "tau": tau.detach()}


def sample_anchors(lengths: torch.Tensor, L: int, num_anchors: int, gamma: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchor positions per row among p with p + 1 < length (at least one label), sorted.

    lengths [B] valid tokens per row (right padding). Returns anchors [B, N] and a label-validity mask
    [B, N, γ] (label position anchor + k + 1 < length)."""
    B = lengths.shape[0]
    dev = lengths.device
    anchors = torch.zeros(B, num_anchors, dtype=torch.long)
    for b in range(B):
        n_cand = max(1, int(lengths[b]) - 1)
        perm = torch.randperm(n_cand, generator=generator)
        pick = perm[:num_anchors]
        pick = torch.cat([pick, pick[:1].expand(num_anchors - pick.numel())]) if pick.numel() < num_anchors else pick
        anchors[b] = pick.sort().values
    anchors = anchors.to(dev)
    k = torch.arange(gamma, device=dev)
    valid = (anchors[:, :, None] + k + 1) < lengths[:, None, None].to(dev)
    return anchors, valid


@dataclass
class DSparkTrainer:
    """Online drafter training: every step runs the frozen target on the batch (capturing the drafter's tap
    layers and its logits), samples anchors, and takes one optimizer step on the DSpark loss."""

    target: torch.nn.Module
    drafter: torch.nn.Module
    optimizer: torch.optim.Optimizer
    num_anchors: int = 16
    decay: float = 4.0
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        self.generator = torch.Generator().manual_seed(self.seed)
        for p in self.target.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor):
        """Target forward: (tap hidden states, logits [B, L, V])."""
        out = self.target(input_ids, output_hidden_layers=self.drafter.target_layers)
        return out.hidden_states, out.logits

    def loss(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The DSpark loss parts (:func:`dspark_loss`: ``loss`` and its components) on input_ids [B, L] long
        (``lengths`` [B]: valid tokens per row, default L): the frozen target runs once, ``num_anchors`` anchors
        per row are sampled, the drafter drafts a block from each."""
        B, L = input_ids.shape
        G = self.drafter.config.block_size
        if lengths is None:
            lengths = torch.full((B,), L, dtype=torch.long, device=input_ids.device)
        taps, tlogits = self.capture(input_ids)
        anchors, valid = sample_anchors(lengths, L, self.num_anchors, G, self.generator)
        out = self.drafter.forward_train(taps, input_ids, anchors)
        pos = (anchors[:, :, None] + torch.arange(G, device=input_ids.device)).clamp(max=L - 1)  # rows scoring k+1
        V = tlogits.shape[-1]
        t = tlogits.gather(1, pos.reshape(B, -1, 1).expand(B, pos.numel() // B, V)).view(B, -1, G, V)
        return dspark_loss(out["logits"], t, out["confidence"], out["labels"], valid, decay=self.decay)

    def step(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step on :meth:`loss` (gradient clipping at ``grad_clip``); returns the loss parts as
        floats (lists for per-position parts).

        Example::

            trainer = DSparkTrainer(model, drafter, torch.optim.AdamW(drafter.parameters(), lr=2e-3))
            for batch in batches:                  # [B, L] token ids
                parts = trainer.step(batch)        # {"loss": ..., "tau": ..., ...}
        """
        self.drafter.train()
        parts = self.loss(input_ids, lengths)
        self.optimizer.zero_grad(set_to_none=True)
        parts["loss"].backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.grad_clip)
        self.optimizer.step()
        return {k: (v.detach().tolist() if v.dim() else float(v.detach())) for k, v in parts.items()}
