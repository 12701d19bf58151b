"""The OpenAI-compatible HTTP application of ``k3nn serve`` (FastAPI on uvicorn).

Routes:

* ``POST /v1/completions``: ``prompt`` a string, a list of token ids, or a batch of either; one engine request per
  prompt with ``n`` samples each; choice ``i = prompt_index · n + sample``.
* ``POST /v1/chat/completions``: ``messages`` rendered by the checkpoint's chat template (:mod:`.chat`), encoded
  without added special tokens (the template writes them).
* ``GET /v1/models``, ``GET /health`` (200 once the warmup finished, 503 before and when shutting down),
  ``GET /metrics`` (Prometheus, :mod:`.metrics`).

Requests are validated before anything is queued (:mod:`.protocol`; bad input → 400 with OpenAI's error JSON naming
the parameter; a wrong or missing ``--api-key`` bearer token on ``/v1/*`` → 401). Streaming is Server-Sent Events:
one chunk per choice per engine step that produced tokens for it (a speculative verify window adds several tokens
to one chunk), then ``data: [DONE]``; with ``stream_options.include_usage`` a last chunk carries ``usage``. A
client that disconnects — mid-stream or while waiting for a non-streamed answer — has its request aborted, which
frees its rows and pages. A request that fails inside the engine ends with an error chunk (streaming) or a 500;
the server goes on serving the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import RequestOutput, SamplingParams, TokenLogprobs
from .async_engine import AsyncEngine, EngineNotReadyError, RequestStream
from .chat import ChatTemplate, ChatTemplateError, normalize_messages
from .metrics import CONTENT_TYPE, ServeMetrics, engine_stats
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, error_param, parse_json, parse_request,
                       sampling_params)

__all__ = ["OpenAIServer", "run_server"]

log = logging.getLogger("k3nn.serve")

_DONE = "data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (as OpenAI and vLLM report it)


def _sse(obj: dict[str, Any]) -> str:
    # ASCII: a line separator inside the text (U+2028, U+0085, ...) must not split the event for line-based readers
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def _lp(x: float) -> float | None:
    if math.isnan(x):
        return None
    return max(x, _MIN_LOGPROB)


@dataclass
class _Choice:
    index: int
    prompt_index: int
    prefix: str = ""  # echo: the prompt text, sent before the output
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    first: float | None = None
    last: float | None = None
    started: bool = False  # a chunk was sent for it


@dataclass
class _Delta:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    lps: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Job:
    """One HTTP generation request in flight."""

    id: str
    chat: bool
    model: str
    created: int
    stream: RequestStream
    prompts: list[list[int]]
    choices: list[_Choice]
    logprobs: int | None  # top alternatives per token (None: no logprobs)
    return_token_ids: bool
    include_usage: bool
    streaming: bool
    open: int = 0
    outcome: str | None = None
    end: float | None = None
    recorded: bool = False

    def usage(self) -> dict[str, int]:
        p = sum(len(x) for x in self.prompts)
        c = sum(len(ch.token_ids) for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _EventStream(StreamingResponse):
    """Server-Sent Events; ``on_close`` runs however the response ends — also when the client was gone before the
    first chunk, when the body iterator never started (and its own ``finally`` never runs)."""

    media_type = "text/event-stream"

    def __init__(self, content, on_close):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body was read before: only ``http.disconnect`` remains)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """The HTTP front of an :class:`AsyncEngine` (not started: the app's lifespan starts and stops it).

    ``tokenizer``: ``encode(text) -> ids`` and ``decode(ids) -> str`` (the Engine detokenises with the same one);
    ``served_model_names``: the names ``model`` may take (the first is reported); ``max_model_len``: prompt + output
    tokens a request may hold; ``chat_template``: the :class:`~k3nn.serve.chat.ChatTemplate` (None: chat requests
    get a 400); ``api_key``: the bearer token ``/v1/*`` requires (None: open); ``root``: the checkpoint path reported
    by ``/v1/models``; ``shutdown_timeout``: seconds :meth:`AsyncEngine.shutdown` waits for the engine thread."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, *, served_model_names: Sequence[str],
                 max_model_len: int, chat_template: ChatTemplate | None = None, api_key: str | None = None,
                 root: str | None = None, shutdown_timeout: float = 60.0):
        if not served_model_names or not all(isinstance(n, str) and n for n in served_model_names):
            raise ValueError(f"served_model_names must be non-empty strings, got {served_model_names!r}")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
        if api_key is not None and not (isinstance(api_key, str) and api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self.engine, self.tokenizer = engine, tokenizer
        self.model_names = list(served_model_names)
        self.max_model_len = max_model_len
        self.chat_template, self.api_key, self.root = chat_template, api_key, root
        self.vocab_size = engine.engine.model.config.vocab_size
        self.shutdown_timeout = shutdown_timeout
        self.metrics = ServeMetrics()
        self.created = int(time.time())
        self._token_strs: dict[int, str] = {}
        self.app = self._build()

    # -- the application ------------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start(asyncio.get_running_loop())
            try:
                yield
            finally:
                await self.engine.shutdown(self.shutdown_timeout)

        app = FastAPI(title="k3nn serve", description="OpenAI-compatible server over k3nn's Engine",
                      lifespan=lifespan)

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request, exc: StarletteHTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return JSONResponse(APIError(f"{request.method} {request.url.path}: {exc.detail}",
                                         status=exc.status_code, type=kind).body(), status_code=exc.status_code)

        @app.exception_handler(Exception)
        async def server_error(request, exc: Exception):
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            return JSONResponse(APIError(f"internal server error: {type(exc).__name__}: {exc}", status=500,
                                         type="server_error").body(), status_code=500)

        @app.get("/health")
        async def health():
            if self.engine.ready:
                return Response(status_code=200)
            why = (f"the engine failed to start: {self.engine.error!r}" if self.engine.error is not None
                   else "the engine is warming up" if self.engine.running else "the engine is not running")
            return JSONResponse(APIError(why, status=503, type="service_unavailable").body(), status_code=503)

        @app.get("/metrics")
        async def metrics():
            stats = None
            if self.engine.ready:
                stats = await self.engine.call(engine_stats)
            return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models(request: Request):
            self._auth(request)
            return {"object": "list", "data": [
                {"id": name, "object": "model", "created": self.created, "owned_by": "k3nn", "root": self.root,
                 "parent": None, "max_model_len": self.max_model_len} for name in self.model_names]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        return app

    # -- checks ---------------------------------------------------------------------------------------------------
    def _auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError("missing or incorrect API key: send the header 'Authorization: Bearer <key>' with the "
                           "key given to --api-key", status=401, type="authentication_error",
                           code="invalid_api_key")

    def _model(self, name: str | None) -> str:
        if name is None:
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(f"the model {name!r} does not exist here; this server serves {self.model_names}",
                           param="model", code="model_not_found")
        return name

    def _fit(self, n_prompt: int, max_tokens: int, prompt_param: str, tokens_param: str) -> None:
        L = self.max_model_len
        if n_prompt >= L:
            raise APIError(f"this model's maximum context length is {L} tokens, and the {prompt_param} has "
                           f"{n_prompt} tokens: no room for output", param=prompt_param,
                           code="context_length_exceeded")
        if n_prompt + max_tokens > L:
            raise APIError(f"this model's maximum context length is {L} tokens, but {n_prompt + max_tokens} were "
                           f"requested ({n_prompt} in the {prompt_param}, {max_tokens} for the output): lower "
                           f"{tokens_param}", param=tokens_param, code="context_length_exceeded")

    def _ids(self, ids: list, where: str) -> list[int]:
        if not ids:
            raise APIError(f"{where} is empty: a prompt needs at least one token", param=where)
        for i, t in enumerate(ids):
            if type(t) is not int:
                raise APIError(f"{where}[{i}] must be a token id (an int), got {t!r}", param=where)
            if not 0 <= t < self.vocab_size:
                raise APIError(f"{where}[{i}] = {t} is outside the vocabulary [0, {self.vocab_size})", param=where)
        return list(ids)

    def _encode(self, text: str, where: str, add_special_tokens: bool = True) -> list[int]:
        tok = self.tokenizer
        if not add_special_tokens and hasattr(getattr(tok, "tok", None), "encode"):  # an HF tokenizers.Tokenizer
            ids = tok.tok.encode(text, add_special_tokens=False).ids
        else:
            ids = tok.encode(text)
        if not ids:
            raise APIError(f"{where} is empty: it encodes to no tokens", param=where)
        return list(ids)

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._encode(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(x, str) for x in prompt):
                return [self._encode(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
            if all(type(x) is int for x in prompt):
                return [self._ids(prompt, "prompt")]
            if all(isinstance(x, list) for x in prompt):
                return [self._ids(x, f"prompt[{i}]") for i, x in enumerate(prompt)]
        raise APIError("prompt must be a non-empty string, a list of strings, a list of token ids, or a list of "
                       f"lists of token ids; got {type(prompt).__name__}"
                       + ("" if not isinstance(prompt, list) else " (empty)" if not prompt else " of mixed types"),
                       param="prompt")

    def _sampling(self, req, max_tokens: int, logprobs: int | None, names: dict[str, str]) -> SamplingParams:
        params = sampling_params(req, max_tokens, logprobs)
        try:
            params.validate(self.tokenizer)
        except (TypeError, ValueError) as e:
            raise APIError(str(e), param=error_param(str(e), **names)) from None
        return params

    # -- generation -------------------------------------------------------------------------------------------------
    async def _generate(self, request: Request, chat: bool):
        arrival = time.perf_counter()
        try:
            self._auth(request)
            if not self.engine.ready:
                raise APIError("the engine is not ready (warming up or shutting down); poll GET /health",
                               status=503, type="service_unavailable")
            body = parse_json(await request.body())
            if chat:
                job, num_spec, params, names = self._chat_job(body)
            else:
                job, num_spec, params, names = self._completion_job(body)
            try:
                job.stream = await self.engine.add(job.id, job.prompts, params, num_spec)
            except EngineNotReadyError as e:
                raise APIError(str(e), status=503, type="service_unavailable") from None
            except (TypeError, ValueError) as e:  # Engine.add_request's checks (CacheFullError included)
                raise APIError(str(e), param=error_param(str(e), **names)) from None
        except APIError as e:
            if e.status != 401:
                self.metrics.requests.labels("rejected").inc()
            raise
        job.stream.arrival = arrival
        job.open = len(job.choices)
        self.metrics.prompt_tokens.inc(sum(len(p) for p in job.prompts))
        if job.streaming:
            return _EventStream(self._sse(job), on_close=lambda: self._finish(job))
        return await self._respond(request, job)

    def _completion_job(self, body: dict):
        req = parse_request(CompletionRequest, body)
        model = self._model(req.model)
        prompts = self._completion_prompts(req.prompt)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for i, p in enumerate(prompts):
            self._fit(len(p), max_tokens, "prompt" if len(prompts) == 1 else f"prompt[{i}]", "max_tokens")
        names = {"prompt_param": "prompt", "logprobs_param": "logprobs", "max_tokens_param": "max_tokens"}
        params = self._sampling(req, max_tokens, req.logprobs, names)
        choices = []
        for p, ids in enumerate(prompts):
            prefix = ""
            if req.echo:
                prefix = req.prompt[p] if isinstance(req.prompt, list) and isinstance(req.prompt[p], str) \
                    else req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(ids)
            choices += [_Choice(p * req.n + k, p, prefix=prefix) for k in range(req.n)]
        job = _Job(id=f"cmpl-{uuid.uuid4().hex}", chat=False, model=model, created=int(time.time()), stream=None,
                   prompts=prompts, choices=choices, logprobs=req.logprobs, return_token_ids=req.return_token_ids,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   streaming=req.stream)
        return job, req.num_speculative_tokens, params, names

    def _chat_job(self, body: dict):
        req = parse_request(ChatCompletionRequest, body)
        model = self._model(req.model)
        if self.chat_template is None:
            raise APIError("this model has no chat template (its checkpoint has neither chat_template.jinja nor a "
                           "chat_template in tokenizer_config.json, and the server was started without "
                           "--chat-template): use /v1/completions, or restart with --chat-template FILE",
                           param="messages", code="chat_template_missing")
        messages = normalize_messages(req.messages)
        try:
            text = self.chat_template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                             variables=req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None
        ids = self._encode(text, "messages", add_special_tokens=False)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"the rendered messages encode to token ids outside the model's vocabulary "
                           f"[0, {self.vocab_size}): {bad[:8]}", param="messages")
        tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            self._fit(len(ids), 1, "messages", tokens_param)
            max_tokens = self.max_model_len - len(ids)
        self._fit(len(ids), max_tokens, "messages", tokens_param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        names = {"prompt_param": "messages", "logprobs_param": "top_logprobs", "max_tokens_param": tokens_param}
        params = self._sampling(req, max_tokens, logprobs, names)
        choices = [_Choice(k, 0) for k in range(req.n)]
        job = _Job(id=f"chatcmpl-{uuid.uuid4().hex}", chat=True, model=model, created=int(time.time()), stream=None,
                   prompts=[ids], choices=choices, logprobs=logprobs, return_token_ids=req.return_token_ids,
                   include_usage=bool(req.stream_options and req.stream_options.include_usage),
                   streaming=req.stream)
        return job, req.num_speculative_tokens, params, names

    def _apply(self, job: _Job, items: list[tuple[int, RequestOutput, float]]) -> dict[int, _Delta]:
        """Fold engine events into the choices; the change of each choice that moved."""
        deltas: dict[int, _Delta] = {}
        for index, out, t in items:
            ch = job.choices[index]
            d = deltas.setdefault(index, _Delta())
            if out.new_token_ids:
                if ch.first is None:
                    ch.first = t
                ch.last = t
                ch.token_ids.extend(out.new_token_ids)
                d.ids.extend(out.new_token_ids)
                if out.logprobs:
                    ch.logprobs.extend(out.logprobs)
                    d.lps.extend(out.logprobs)
            if out.text is not None and len(out.text) > len(ch.text):
                d.text += out.text[len(ch.text):]
                ch.text = out.text
            if out.finished and ch.finish_reason is None:
                ch.finish_reason, ch.stop_reason, ch.error = out.finish_reason, out.stop_reason, out.error
                d.finished = True
                job.open -= 1
                job.end = t
        return deltas

    def _token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id])
        return s

    def _completion_logprobs(self, ch: _Choice, lps: list[TokenLogprobs]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            s = self._token_str(lp.token_id)
            top: dict[str, float | None] = {}
            for t, v in lp.top.items():  # tokens whose text is the same (e.g. partial UTF-8) keep the largest
                top.setdefault(self._token_str(t), _lp(v))
            top.setdefault(s, _lp(lp.logprob))
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(len(ch.prefix) + ch.text_offset)
            ch.text_offset += len(s)
        return out

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict[str, list]:
        def entry(t: int, v: float) -> dict[str, Any]:
            s = self._token_str(t)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top.items()]} for lp in lps]}

    def _error(self, job: _Job, ch: _Choice) -> APIError:
        log.warning("request %s choice %d failed in the engine: %s", job.id, ch.index, ch.error)
        return APIError(f"the request failed in the engine: {ch.error}", status=500, type="server_error",
                        code="engine_error")

    # -- streaming ----------------------------------------------------------------------------------------------------
    def _chunk(self, job: _Job, ch: _Choice, d: _Delta) -> list[dict[str, Any]]:
        head = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                "created": job.created, "model": job.model}
        tail = {"usage": None} if job.include_usage else {}
        chunks = []
        if job.chat:
            if not ch.started:
                first = {"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                extra = {"prompt_token_ids": job.prompts[0]} if job.return_token_ids else {}
                chunks.append({**head, **extra, "choices": [first], **tail})
            choice: dict[str, Any] = {"index": ch.index, "delta": {"content": d.text} if d.text or not d.finished
                                      else {},
                                      "logprobs": self._chat_logprobs(d.lps) if job.logprobs is not None else None,
                                      "finish_reason": ch.finish_reason if d.finished else None}
        else:
            text = d.text if ch.started else ch.prefix + d.text
            choice = {"index": ch.index, "text": text,
                      "logprobs": self._completion_logprobs(ch, d.lps) if job.logprobs is not None else None,
                      "finish_reason": ch.finish_reason if d.finished else None}
            if job.return_token_ids and not ch.started:
                choice["prompt_token_ids"] = job.prompts[ch.prompt_index]
        if d.finished:
            choice["stop_reason"] = ch.stop_reason
        if job.return_token_ids:
            choice["token_ids"] = d.ids
        ch.started = True
        chunks.append({**head, "choices": [choice], **tail})
        return chunks

    async def _sse(self, job: _Job) -> AsyncIterator[str]:
        try:
            while job.open:
                for item in await job.stream.get():  # one chunk per engine step and choice, even when behind
                    ((index, d),) = self._apply(job, [item]).items()
                    ch = job.choices[index]
                    if ch.error is not None or ch.finish_reason == "error":
                        job.outcome = "error"
                        yield _sse(self._error(job, ch).body())
                        yield _DONE
                        return
                    for chunk in self._chunk(job, ch, d):
                        yield _sse(chunk)
            if job.include_usage:
                yield _sse({"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                            "created": job.created, "model": job.model, "choices": [], "usage": job.usage()})
            yield _DONE
        finally:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """The request ended (completed, failed, or its client went away): abort what still runs, record it (once)."""
        if job.recorded:
            return
        job.recorded = True
        if job.open:
            self.engine.abort(job.id)
            job.outcome = job.outcome or "abort"
        if job.outcome is None:
            reasons = [ch.finish_reason for ch in job.choices]
            job.outcome = ("error" if "error" in reasons else "abort" if "abort" in reasons
                           else reasons[0] if reasons[0] in ("stop", "length") else "stop")
        self.metrics.observe_request(job.outcome, job.stream.arrival, job.end,
                                     [(ch.first, ch.last, len(ch.token_ids)) for ch in job.choices])

    # -- non-streaming ------------------------------------------------------------------------------------------------
    async def _collect(self, job: _Job) -> None:
        while job.open:
            self._apply(job, await job.stream.get())

    async def _respond(self, request: Request, job: _Job):
        collect = asyncio.ensure_future(self._collect(job))
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (collect, watch):
                if not t.done():
                    t.cancel()
            if not collect.done() or collect.cancelled() or collect.exception() is not None:
                self._finish(job)  # the client went away (or this task was cancelled): abort
        if not collect.done() or collect.cancelled():  # nobody reads the answer
            return Response(status_code=499)
        collect.result()  # a failure while collecting: a 500
        failed = [ch for ch in job.choices if ch.error is not None or ch.finish_reason == "error"]
        if failed:
            job.outcome = "error"
            self._finish(job)
            raise self._error(job, failed[0])
        self._finish(job)
        return JSONResponse(self._body(job))

    def _body(self, job: _Job) -> dict[str, Any]:
        choices = []
        for ch in job.choices:
            if job.chat:
                c: dict[str, Any] = {"index": ch.index, "message": {"role": "assistant", "content": ch.text},
                                     "logprobs": self._chat_logprobs(ch.logprobs) if job.logprobs is not None
                                     else None,
                                     "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
            else:
                c = {"index": ch.index, "text": ch.prefix + ch.text,
                     "logprobs": self._completion_logprobs(ch, ch.logprobs) if job.logprobs is not None else None,
                     "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason}
                if job.return_token_ids:
                    c["prompt_token_ids"] = job.prompts[ch.prompt_index]
            if job.return_token_ids:
                c["token_ids"] = ch.token_ids
            choices.append(c)
        body = {"id": job.id, "object": "chat.completion" if job.chat else "text_completion",
                "created": job.created, "model": job.model, "choices": choices, "usage": job.usage(),
                "system_fingerprint": None}
        if job.chat and job.return_token_ids:
            body["prompt_token_ids"] = job.prompts[0]
        return body


def run_server(server: OpenAIServer, *, host: str = "127.0.0.1", port: int = 8000, sock=None,
               log_level: str = "info", access_log: bool = True, shutdown_timeout: float = 30.0) -> int:
    """Serve ``server.app`` with uvicorn until Ctrl-C / SIGTERM (then: stop accepting, let requests in flight
    finish for up to ``shutdown_timeout`` seconds, abort the rest, stop the engine). ``sock``: an already bound
    socket to serve on instead of ``host``/``port``. Returns the exit status: 0, or 1 when the engine failed to
    start (its warmup raised)."""
    import uvicorn

    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    userver = uvicorn.Server(config)

    def fatal(exc: BaseException) -> None:
        log.error("stopping the server: the engine failed to start (%s: %s)", type(exc).__name__, exc)
        userver.should_exit = True

    server.engine.on_fatal = fatal
    userver.run(sockets=[sock] if sock is not None else None)
    return 1 if server.engine.error is not None else 0
