"""The load-test client: drives a workload open-loop against an OpenAI-compatible URL.

Open loop: each request is sent at its arrival time whether or not earlier ones finished, so a slow
policy shows up as queueing, not as a lower offered load. Every request streams
(`stream_options.include_usage`), which gives the time to first token from the first content chunk
(counted from when it is sent: a gateway's routing is inside that time, an oracle's questions to
the stubs before it are not, since an oracle is a bound on routing, not a router)
and the engine's `cached_tokens` from the final usage chunk. The prompt goes to `/v1/completions` as
token ids, or as its text when the request carries one (`--prompt-format text`: the same ids once
tokenized), so every policy and engine sees exactly the same tokens. With `--api chat|messages|responses`
the same requests go to that endpoint as conversations (`api_bodies.py`), streamed or not (not
streamed, an answer has no time to first token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import aiohttp
import msgspec

from kvrouter.loadtest.api_bodies import ApiShape, Tokens, answer_of, request_body
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec

__all__ = [
    "POOL_KEEPALIVE_S", "Choose", "DriverSettings", "Started", "Target", "pooled_session", "run_open_loop",
    "send_in_turn",
]  # fmt: skip

POOL_KEEPALIVE_S: Final = 2.0
"""How long the harness reuses an idle pooled connection: well under the 5 s after which uvicorn (the
stub's server, and vLLM's `--timeout-keep-alive`) closes it, so no request goes out on a connection
the server is closing at that moment ("Server disconnected", "Connection reset by peer")."""


def pooled_session(
    timeout: aiohttp.ClientTimeout = aiohttp.client.DEFAULT_TIMEOUT, limit: int = 100
) -> aiohttp.ClientSession:
    """An aiohttp session pooling at most `limit` connections, none reused after `POOL_KEEPALIVE_S` idle."""
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=POOL_KEEPALIVE_S)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


class Target(msgspec.Struct, frozen=True):
    """Where a request goes: the policy label, a base URL, the engine when known, extra headers."""

    label: str
    base_url: str
    engine: str | None = None
    headers: dict[str, str] = {}


class DriverSettings(msgspec.Struct, frozen=True):
    """How the driver sends: the model name, concurrency cap, per-request timeout, API and streaming."""

    model: str = "kvrouter-stub"
    max_in_flight: int = 1024
    timeout_s: float = 300.0
    session_header: str = "x-session-id"
    shape: ApiShape = ApiShape()


Choose = Callable[[int, RequestSpec], Awaitable[Target]]
Started = Callable[[int], None]
"""Called with a request's index once its response headers arrived (the engine has it)."""


async def _read_stream(response: aiohttp.ClientResponse, sent: float) -> tuple[float | None, Tokens | None]:
    ttft: float | None = None
    usage: Tokens | None = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue  # event names, blank lines, the OpenAI end marker
        answer = answer_of(line[5:])
        if ttft is None and answer.first_token:
            ttft = time.perf_counter() - sent
        if answer.tokens is not None:
            usage = answer.tokens
    return ttft, usage


async def _read_answer(
    response: aiohttp.ClientResponse, sent: float, stream: bool
) -> tuple[float | None, Tokens | None]:
    """The time to first token (streamed only) and the usage of an answer."""
    if stream:
        return await _read_stream(response, sent)
    return None, answer_of(await response.read()).tokens


async def _one(
    session: aiohttp.ClientSession,
    index: int,
    spec: RequestSpec,
    target: Target,
    settings: DriverSettings,
    start: float,
    on_started: Started | None = None,
) -> RequestResult:
    headers = {"content-type": "application/json", settings.session_header: spec.session, **target.headers}
    sent = time.perf_counter()
    base = RequestResult(policy=target.label, index=index, session=spec.session, arrival_s=sent - start)
    try:
        body = request_body(spec, settings.model, settings.shape)
        async with session.post(f"{target.base_url}{settings.shape.path}", data=body, headers=headers) as r:
            if on_started is not None:
                on_started(index)
            if r.status != 200:
                text = (await r.text())[:200]
                return msgspec.structs.replace(base, error=f"HTTP {r.status}: {text}")
            engine = r.headers.get("x-kvrouter-engine") or target.engine
            predicted = r.headers.get("x-kvrouter-predicted-cached-tokens")
            request_id = r.headers.get("x-request-id")
            ttft, usage = await _read_answer(r, sent, settings.shape.stream)
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        return msgspec.structs.replace(base, error=f"{type(exc).__name__}: {exc}")
    return msgspec.structs.replace(
        base,
        engine=engine,
        ttft_s=ttft,
        e2e_s=time.perf_counter() - sent,
        prompt_tokens=usage.prompt if usage else len(spec.prompt),
        cached_tokens=usage.cached if usage else 0,
        output_tokens=usage.output if usage else 0,
        predicted_cached_tokens=int(predicted) if predicted is not None and predicted.isdigit() else None,
        request_id=request_id,
    )


async def run_open_loop(
    requests: Sequence[RequestSpec],
    choose: Choose,
    settings: DriverSettings,
    on_done: Callable[[RequestResult], None] | None = None,
    on_started: Started | None = None,
) -> list[RequestResult]:
    """Send every request at its arrival time to `choose(spec)`; return results in request order."""
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    gate = asyncio.Semaphore(settings.max_in_flight)
    async with pooled_session(timeout, settings.max_in_flight) as session:
        start = time.perf_counter()

        async def fire(index: int, spec: RequestSpec) -> RequestResult:
            delay = start + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the workload, not synchronisation
            async with gate:
                target = await choose(index, spec)
                result = await _one(session, index, spec, target, settings, start, on_started)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(fire(i, s) for i, s in enumerate(requests))))


async def send_in_turn(
    requests: Sequence[RequestSpec], target: Target, settings: DriverSettings
) -> list[RequestResult]:
    """Send each request to `target` once the one before it answered (no pacing): the results in order."""
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    async with pooled_session(timeout, 1) as session:
        start = time.perf_counter()
        return [await _one(session, i, spec, target, settings, start) for i, spec in enumerate(requests)]
