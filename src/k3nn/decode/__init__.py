"""Decode fast paths: the graph-safe decode step and its CUDA-graph runner (:mod:`.runner`), and the opt-in
latency-specialized fused per-layer decode (:mod:`.fused`)."""

from .runner import DecodeRunner, make_decode_runner, standard_step

__all__ = ["DecodeRunner", "make_decode_runner", "standard_step"]
