"""Checkpoint I/O: safetensors shards, hub resolution, one key map per format (``formats/``)."""

from .io import CheckpointError, from_pretrained, load_weights, resolve_checkpoint, save_pretrained

__all__ = ["CheckpointError", "from_pretrained", "load_weights", "resolve_checkpoint", "save_pretrained"]
