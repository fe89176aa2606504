"""/v1/completions, /v1/chat/completions, /v1/messages, /v1/responses: body -> engine requests -> JSON or SSE.

The body is tokenized by the shared `tokenization.request_tokens` (the router uses the same code). Each prompt
becomes one engine request on one rank; tokens come back through a shared sink queue. A request that
ends early (client gone, stream closed) is aborted in a `finally`, never in a background task. Each
request is logged (INFO) with the `x-request-id` it came with, as the router's access log names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine_stub.core.request import SubmitParams
from engine_stub.runtime.output_streams import Emitted, RequestStream
from engine_stub.runtime.rank_runtime import EngineRuntime
from engine_stub.runtime.stub_runtime import Stub
from engine_stub.server.agent_io import AgentShape, Counts, MessagesShape, ResponsesShape, ResponseStore
from engine_stub.server.openai_io import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionChunk,
    Delta,
    FinishReason,
    PromptTokensDetails,
    Usage,
    encode,
    sse,
)
from tokenization.openai_request import Endpoint, RequestError
from tokenization.request_tokens import ReportMode, RequestTokens, request_tokens

__all__ = ["ModelNotFound", "serve_openai"]

log = logging.getLogger(__name__)

T = TypeVar("T")
DONE: Final = b"data: [DONE]\n\n"
RANK_HEADER: Final = "x-data-parallel-rank"


class ModelNotFound(LookupError):
    """The body names a model this stub does not serve (HTTP 404)."""


class StreamOptions(msgspec.Struct):
    """OpenAI's `stream_options`."""

    include_usage: bool = False


class _StreamFields(msgspec.Struct):
    stream_options: StreamOptions | None = None


_STREAM_FIELDS: Final = msgspec.json.Decoder(_StreamFields)


@dataclass
class _Job:
    """One HTTP request's engine requests on one rank."""

    id: str
    created: int
    model: str
    engine: EngineRuntime
    sink: asyncio.Queue[Emitted]
    streams: list[RequestStream]
    include_usage: bool
    aborted: set[int] = field(default_factory=set)
    """Indexes the server ended early (it is stopping): their finish reason is "abort"."""

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            self.engine.abort(stream.rid)

    async def tokens(self) -> AsyncIterator[Emitted]:
        pending = len(self.streams)
        while pending:
            item = await self.sink.get()
            pending -= item.finished
            if item.aborted:
                self.aborted.add(item.index)
            yield item

    def reason(self, index: int) -> FinishReason:
        """The finish reason of a finished choice."""
        return "abort" if index in self.aborted else "length"


async def serve_openai(
    stub: Stub, request: Request, endpoint: Endpoint, store: ResponseStore | None = None
) -> Response:
    """Answer one completions, chat, Messages or Responses request (a Responses one stored in and
    continued from `store`); RequestError (400), ModelNotFound (404), RankError (400), UnknownResponse
    (404)."""
    arrived = time.time()  # before the body is read: the order requests reached the stub in
    body = await request.body()
    history = None
    if store is not None and endpoint is Endpoint.RESPONSES:
        body, history = store.continued(body)
    tokens = request_tokens(body, endpoint, stub.encoder, effort=stub.effort)
    if tokens.model is not None and tokens.model != stub.config.model:
        raise ModelNotFound(f"The model `{tokens.model}` does not exist.")
    try:
        options = _STREAM_FIELDS.decode(body).stream_options
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from exc
    engine = stub.pick(request.headers.get(RANK_HEADER))
    stub.served.add(arrived, sum(len(p) for p in tokens.prompts))
    log.info(  # the request id a router sent joins this line to the router's access log
        "request received",
        extra={
            "request_id": request.headers.get("x-request-id"),
            "endpoint": endpoint.value,
            "prompt_tokens": sum(len(p) for p in tokens.prompts),
            "stream": tokens.stream,
        },
    )
    chat = endpoint is not Endpoint.COMPLETIONS
    job = _submit(stub, engine, tokens, chat, options is not None and options.include_usage)
    if endpoint is Endpoint.MESSAGES:
        return await _serve_agent(stub, request, job, MessagesShape(job.model), tokens.stream)
    if endpoint is Endpoint.RESPONSES:
        shape = ResponsesShape(job.model)
        if store is None or history is None:
            return await _serve_agent(stub, request, job, shape, tokens.stream)
        kept, responses = history, store  # (the closure's own names: mypy narrows them)

        def done(text: str, counts: Counts) -> None:
            responses.put(shape.id, kept, text, shape.result(text, counts))

        return await _serve_agent(stub, request, job, shape, tokens.stream, done)
    if tokens.stream:
        events = _chat_events(stub, job) if chat else _completion_events(stub, job)
        return StreamingResponse(events, media_type="text/event-stream")
    counts = await _until_disconnect(request, _collect(job))
    if counts is None:
        return Response(status_code=499)
    result = _chat_result(stub, job, counts) if chat else _completion_result(stub, job, counts)
    return Response(encode(result), media_type="application/json")


async def _serve_agent(
    stub: Stub,
    request: Request,
    job: _Job,
    shape: AgentShape,
    stream: bool,
    done: Callable[[str, Counts], None] | None = None,
) -> Response:
    """A Messages or Responses answer (engine_stub.server.agent_io) to one prompt's job; `done` is
    given the answer's text and usage once it is whole (to store it)."""
    if stream:
        return StreamingResponse(_agent_events(stub, job, shape, done), media_type="text/event-stream")
    counts = await _until_disconnect(request, _collect(job))
    if counts is None:
        return Response(status_code=499)
    text = stub.text.text(counts[0])
    usage = _counts(stub, job)
    if done is not None:
        done(text, usage)
    return Response(shape.result(text, usage), media_type="application/json")


def _counts(stub: Stub, job: _Job) -> Counts:
    """The job's (one prompt's) usage, for an agent answer."""
    usage = _usage(stub, job)
    cached = sum(s.cached_tokens or 0 for s in job.streams)
    details = stub.config.enable_prompt_tokens_details
    return Counts(usage.prompt_tokens, usage.completion_tokens, cached, details, bool(job.aborted))


async def _agent_events(
    stub: Stub, job: _Job, shape: AgentShape, done: Callable[[str, Counts], None] | None
) -> AsyncIterator[bytes]:
    try:
        yield shape.start(job.streams[0].num_prompt_tokens)
        count = 0
        async for item in job.tokens():
            if not item.aborted:
                count += 1
                yield shape.delta(_delta(stub, item))
        text, usage = stub.text.text(count), _counts(stub, job)
        if done is not None:
            done(text, usage)  # stored before the last event: a client that read it may continue at once
        yield shape.end(text, usage)
    finally:
        job.abort_unfinished()


def _submit(stub: Stub, engine: EngineRuntime, tokens: RequestTokens, chat: bool, usage: bool) -> _Job:
    prefix = "chatcmpl" if chat else "cmpl"
    job = _Job(
        id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=stub.config.model,
        engine=engine,
        sink=asyncio.Queue(),
        streams=[],
        include_usage=usage,
    )
    try:
        for index, prompt in enumerate(tokens.prompts):
            params = _params(stub, tokens, len(prompt))
            job.streams.append(engine.submit(prompt, params, job.sink, index))
    except ValueError as exc:
        job.abort_unfinished()
        raise RequestError(str(exc)) from exc
    return job


def _params(stub: Stub, tokens: RequestTokens, prompt_len: int) -> SubmitParams:
    max_len = stub.config.engine.cache.max_model_len
    max_tokens = tokens.max_tokens
    if max_tokens is None:
        max_tokens = max_len - prompt_len
        if stub.config.default_max_tokens is not None:
            max_tokens = min(max_tokens, stub.config.default_max_tokens)
    if prompt_len + max_tokens > max_len or max_tokens < 1:
        raise RequestError(
            f"This model's maximum context length is {max_len} tokens. However, you requested "
            f"{max_tokens} output tokens and your prompt contains {prompt_len} input tokens "
            f"(`max_tokens` must be >= 1 and fit)."
        )
    return SubmitParams(
        max_tokens=max_tokens,
        extras=tokens.extras,
        report_mode=ReportMode(tokens.report_mode.value),
        skip_cache_read=tokens.skip_cache,
    )


def _usage(stub: Stub, job: _Job) -> Usage:
    prompt = sum(s.num_prompt_tokens for s in job.streams)
    completion = sum(s.num_output_tokens for s in job.streams)
    details = None
    if stub.config.enable_prompt_tokens_details:
        details = PromptTokensDetails(sum(s.cached_tokens or 0 for s in job.streams))
    return Usage(prompt, prompt + completion, completion, details)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (work cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watch, task):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    return task.result() if not task.cancelled() else None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(job: _Job) -> dict[int, int]:
    counts = {s.index: 0 for s in job.streams}
    try:
        async for item in job.tokens():
            counts[item.index] += not item.aborted
    finally:
        job.abort_unfinished()
    return counts


def _completion_result(stub: Stub, job: _Job, counts: dict[int, int]) -> Completion:
    choices = [CompletionChoice(i, stub.text.text(n), finish_reason=job.reason(i)) for i, n in counts.items()]
    return Completion(
        id=job.id, created=job.created, model=job.model, choices=choices, usage=_usage(stub, job)
    )


def _chat_result(stub: Stub, job: _Job, counts: dict[int, int]) -> ChatCompletion:
    choices = [
        ChatChoice(i, ChatMessageOut(stub.text.text(n)), finish_reason=job.reason(i))
        for i, n in counts.items()
    ]
    return ChatCompletion(
        id=job.id, created=job.created, model=job.model, choices=choices, usage=_usage(stub, job)
    )


async def _completion_events(stub: Stub, job: _Job) -> AsyncIterator[bytes]:
    try:
        async for item in job.tokens():
            choice = CompletionChoice(item.index, _delta(stub, item), finish_reason=_finish(job, item))
            yield sse(CompletionChunk(job.id, job.created, job.model, [choice]))
        if job.include_usage:
            yield sse(CompletionChunk(job.id, job.created, job.model, [], usage=_usage(stub, job)))
        yield DONE
    finally:
        job.abort_unfinished()


async def _chat_events(stub: Stub, job: _Job) -> AsyncIterator[bytes]:
    try:
        role_sent = False
        async for item in job.tokens():
            if not role_sent:  # vLLM sends the role chunk with its first output, after the prefill
                role_sent = True
                first = ChatChunkChoice(0, Delta(role="assistant", content=""))
                yield sse(ChatChunk(job.id, job.created, job.model, [first]))
            delta = Delta(content=_delta(stub, item))
            choice = ChatChunkChoice(item.index, delta, finish_reason=_finish(job, item))
            yield sse(ChatChunk(job.id, job.created, job.model, [choice]))
        if job.include_usage:
            yield sse(ChatChunk(job.id, job.created, job.model, [], usage=_usage(stub, job)))
        yield DONE
    finally:
        job.abort_unfinished()


def _delta(stub: Stub, item: Emitted) -> str:
    return "" if item.aborted else stub.text.delta_at(item.output_index)


def _finish(job: _Job, item: Emitted) -> FinishReason | None:
    return job.reason(item.index) if item.finished else None
