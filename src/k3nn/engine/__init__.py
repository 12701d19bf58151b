"""In-process continuous batching over the paged hybrid cache (:class:`Engine`)."""

from .engine import Engine, EngineConfig, EngineStalledError, RequestFailedError
from .request import Request, RequestOutput, RequestStatus, SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStalledError", "Request", "RequestFailedError", "RequestOutput",
           "RequestStatus", "SamplingParams"]
