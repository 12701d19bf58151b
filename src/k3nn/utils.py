"""Small shared helpers."""

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (fp64 stays fp64, so eager paths can be checked in double precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and one of ``tensors`` requires grad (a forward-only kernel cannot run)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
