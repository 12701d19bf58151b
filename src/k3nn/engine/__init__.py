"""In-process continuous batching over the paged hybrid cache (:class:`Engine`)."""

from .engine import Engine, EngineConfig
from .request import Request, RequestOutput, RequestStatus, SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "RequestOutput", "RequestStatus", "SamplingParams"]
