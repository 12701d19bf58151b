"""Parallelism over ``torch.distributed``: decode context parallelism for MLA (:mod:`.dcp`).

Names are loaded lazily so that ``torchrun -m k3nn.parallel.dcp`` runs the module cleanly."""

__all__ = ["DCPContext", "dcp_attention", "dcp_gather_context", "dcp_mla_decode_layer", "dcp_visible_lens",
           "dcp_write_latents"]


def __getattr__(name):
    if name in __all__:
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
