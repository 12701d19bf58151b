"""Decode steps of ``generate()``: the graph-safe decode step and its CUDA-graph runner (:mod:`.runner`)."""

from .runner import DecodeRunner, latency_unsupported, make_decode_runner, standard_step

__all__ = ["DecodeRunner", "latency_unsupported", "make_decode_runner", "standard_step"]
