"""In-process continuous batching over the paged hybrid cache (:class:`Engine`)."""

from .engine import Engine, EngineConfig, EngineStalledError, RequestFailedError
from .request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprobs
from .sampling import RequestSampler
from .speculative import DraftRow, EngineDrafter
from .transfer import (Lease, RequestState, export_request_state, import_request_state, recv_request_state,
                       send_request_state)

__all__ = ["DraftRow", "Engine", "EngineConfig", "EngineDrafter", "EngineStalledError", "Request", "RequestFailedError",
           "RequestOutput", "RequestSampler", "RequestStatus", "SamplingParams", "TokenLogprobs", "Lease",
           "RequestState", "export_request_state", "import_request_state", "send_request_state",
           "recv_request_state"]
