"""The rope dims of MLA in DeepSeek-V3 checkpoints (``rope_interleave``) vs k3nn's.

DeepSeek-V3 (and so Kimi K2 / K2.5) stores each head's dr rope dims of q and the shared rope key k_r as interleaved
pairs ``(x0, x1), (x2, x3), …`` rotated by one angle each; k3nn's :func:`k3nn.layers.mla.apply_rope` rotates halves
``(x_i, x_{i+dr/2})``. Since q_rope and k_r are linear in the input, permuting the rows that produce them (evens
first, then odds) turns one form into the other exactly: every rope dot product is the same sum over the same pairs.
The loader applies the permutation after reading a checkpoint whose text config says ``rope_interleave``, and
``save_pretrained`` applies the inverse, so the files keep DeepSeek's layout.
"""

from __future__ import annotations

import torch

from ..layers.mla import MultiHeadLatentAttention

__all__ = ["deinterleave_rope_", "interleave_rope", "text_config_of"]


def text_config_of(model):
    cfg = model.config
    return getattr(cfg, "text_config", cfg)


def _rows(mla: MultiHeadLatentAttention, which: str) -> torch.Tensor:
    """Row index ``idx`` with ``halves = interleaved[idx]`` for the q or kv_a weight of this layer."""
    dr = mla.dr
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
    if which == "q":
        dq = mla.dn + mla.dr
        head = torch.arange(dq)
        head[mla.dn:] = mla.dn + perm
        return (torch.arange(mla.num_heads)[:, None] * dq + head).reshape(-1)
    idx = torch.arange(mla.kv_lora_rank + dr)
    idx[mla.kv_lora_rank:] = mla.kv_lora_rank + perm
    return idx


def _targets(model):
    for name, mod in model.named_modules():
        if isinstance(mod, MultiHeadLatentAttention) and mod.dr:
            q = "q_proj" if mod.q_lora_rank is None else "q_b_proj"
            yield name, mod, ((f"{q}.weight", "q"), ("kv_a_proj_with_mqa.weight", "kv"))


@torch.no_grad()
def deinterleave_rope_(model) -> None:
    """In place: rows of every MLA layer's q and kv_a weights from DeepSeek's interleaved pairs to k3nn's halves."""
    for _, mod, parts in _targets(model):
        for pname, which in parts:
            w = mod.get_parameter(pname)
            w.copy_(w[_rows(mod, which).to(w.device)])


def interleave_rope(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse on a state dict of ``model`` (k3nn names): rows back to interleaved pairs, for saving."""
    out = dict(state_dict)
    for name, mod, parts in _targets(model):
        for pname, which in parts:
            key = f"{name}.{pname}" if name else pname
            if key in out:
                idx = _rows(mod, which)
                out[key] = out[key][torch.argsort(idx).to(out[key].device)]
    return out
