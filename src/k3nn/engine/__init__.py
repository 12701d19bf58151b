"""In-process continuous batching over the paged hybrid cache (:class:`Engine`)."""

from .engine import Engine, EngineConfig, EngineStalledError, RequestFailedError
from .request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs
from .sampling import RequestSampler
from .speculative import DraftRow, EngineDrafter

__all__ = ["DraftRow", "Engine", "EngineConfig", "EngineDrafter", "EngineStalledError", "Request", "RequestFailedError",
           "RequestOutput", "RequestSampler", "RequestStatus", "SamplingParams", "TokenLogprobs"]
