"""The OpenAI wire protocol of ``k3nn serve``: request schemas, their validation, and the error JSON.

Requests are parsed strictly (pydantic, ``extra="forbid"``, strict types): a field k3nn does not implement is a 400
that names it, a wrong type or a value out of range is a 400 that names the parameter, and nothing is queued.
Fields follow the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) plus vLLM's extra sampling
fields under vLLM's names (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids``, ``include_stop_str_in_output``, ``return_token_ids``) and k3nn's ``num_speculative_tokens``.

:func:`sampling_params` maps a validated request onto the Engine's :class:`~k3nn.engine.SamplingParams`
(``temperature=0`` is greedy, as in vLLM; ``max_tokens`` is ``max_new_tokens``; ``top_k=-1`` is off).

Errors are :class:`APIError`; :meth:`APIError.body` is OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import SamplingParams

__all__ = ["APIError", "CompletionRequest", "ChatCompletionRequest", "StreamOptions", "parse_json", "parse_request",
           "sampling_params", "error_param", "MAX_N", "MAX_LOGPROBS"]

MAX_N = 16  # choices per request (n)
MAX_LOGPROBS = 20  # completions `logprobs` / chat `top_logprobs` (vLLM's default max_logprobs)


class APIError(Exception):
    """An error answered with OpenAI's error JSON. ``status``: the HTTP status; ``type``: OpenAI's error type
    (``invalid_request_error``, ``authentication_error``, ``server_error``, ...); ``param``: the request parameter
    at fault (None when none is); ``code``: a short machine-readable code or None."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """The fields both endpoints share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)  # 0: greedy; None: 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None  # a string or a list of strings (checked by _stop)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict | None = None  # refused unless empty
    user: str | None = None  # an end-user identifier: it has no effect on generation
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # k3nn's extra: drafts per verify window with a drafter (0: plain decoding; None: the engine's default)
    num_speculative_tokens: int | None = Field(None, ge=0)


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a batch (a list) of either."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)  # only None or n (k3nn returns every sample it draws)
    suffix: str | None = None  # refused unless None (no insertion models)


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``messages``: a non-empty list of ``{"role", "content"[, "name"]}`` rendered
    by the checkpoint's chat template (:mod:`k3nn.serve.chat`)."""

    messages: Any
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's chat extras
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


def _param(loc: tuple) -> str:
    """A pydantic error location as a parameter path: ``("messages", 0, "role")`` → ``messages[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; malformed JSON (or NaN / Infinity, or not an object) is a 400."""
    def bad_constant(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        obj = json.loads(raw, parse_constant=bad_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(f"the request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    return obj


def parse_request(cls: type[_GenerationRequest], body: dict[str, Any]) -> _GenerationRequest:
    """Validate ``body`` as ``cls``; the first problem becomes a 400 naming its parameter (an unknown field:
    "not supported"). Checks across fields (``stream_options`` without ``stream``, ``logit_bias``, ``suffix``,
    ``best_of``, ``top_logprobs`` without ``logprobs``, ``stop``) follow."""
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(f"{param}: this field is not supported by k3nn serve", param=param,
                           code="unsupported_parameter") from None
        if err["type"] == "missing":
            raise APIError(f"{param} is required", param=param, code="missing_required_parameter") from None
        raise APIError(f"{param}: {err['msg']} (got {err.get('input')!r})", param=param,
                       code="invalid_value") from None
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options can only be given when stream is true", param="stream_options")
    if req.logit_bias:
        raise APIError("logit_bias is not supported by k3nn serve", param="logit_bias", code="unsupported_parameter")
    req.stop = _stop(req.stop)
    if isinstance(req, CompletionRequest):
        if req.suffix is not None:
            raise APIError("suffix is not supported by k3nn serve (no insertion models)", param="suffix",
                           code="unsupported_parameter")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(f"best_of must equal n ({req.n}) or be null: k3nn serve returns every sample it draws",
                           param="best_of", code="unsupported_parameter")
        if req.echo and req.logprobs is not None:
            raise APIError("echo with logprobs needs the prompt's log-probabilities, which k3nn's Engine does not "
                           "compute; drop one of them", param="echo", code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return req


def _stop(stop: Any) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(f"stop must be a string or a list of strings, got {stop!r}", param="stop")
    if any(s == "" for s in stops):
        raise APIError("stop must not contain the empty string", param="stop")
    return stops or None


def sampling_params(req: _GenerationRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The Engine's sampling parameters of a validated request (``max_tokens`` and ``logprobs`` resolved by the
    endpoint). ``temperature`` 0 (or below 1e-5) is greedy; unset it is 1.0 (sampling), as in the OpenAI API."""
    temperature = 1.0 if req.temperature is None else float(req.temperature)
    do_sample = temperature >= 1e-5
    kw: dict[str, Any] = dict(
        max_new_tokens=max_tokens, do_sample=do_sample, temperature=temperature if do_sample else 1.0,
        top_p=1.0 if req.top_p is None else float(req.top_p), top_k=max(0, req.top_k or 0),
        min_p=float(req.min_p or 0.0), n=req.n,
        seed=None if req.seed is None else req.seed % 2**64, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
        presence_penalty=float(req.presence_penalty or 0.0), frequency_penalty=float(req.frequency_penalty or 0.0),
        logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output)
    if req.min_tokens > max_tokens:
        raise APIError(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    if not math.isfinite(kw["temperature"]):
        raise APIError("temperature must be finite", param="temperature")
    return SamplingParams(**kw)


# Engine argument names → request parameter names (SamplingParams.validate and add_request name their argument
# first in the message)
_ENGINE_PARAMS = {"max_new_tokens": "max_tokens", "do_sample": "temperature", "prompt": "prompt",
                  "prompts": "prompt", "num_speculative_tokens": "num_speculative_tokens", "stop": "stop",
                  "stop_token_ids": "stop_token_ids", "logprobs": "logprobs", "min_tokens": "min_tokens",
                  "seed": "seed", "top_k": "top_k", "top_p": "top_p", "temperature": "temperature",
                  "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "n": "n", "min_p": "min_p", "request": "max_tokens"}


def error_param(message: str, prompt_param: str = "prompt", logprobs_param: str = "logprobs",
                max_tokens_param: str = "max_tokens") -> str | None:
    """The request parameter an Engine error message is about (its first word names the Engine argument), in the
    endpoint's terms: ``prompt_param`` for the prompt (``messages`` in chat), ``logprobs_param`` for the
    log-probability count (``top_logprobs`` in chat)."""
    word = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":,")
    p = _ENGINE_PARAMS.get(word)
    return {"prompt": prompt_param, "logprobs": logprobs_param, "max_tokens": max_tokens_param}.get(p, p)
