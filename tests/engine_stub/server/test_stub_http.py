"""The stub's HTTP API through real uvicorn on 127.0.0.1: JSON and SSE, the openai client, cached_tokens,
/tokenize, /metrics, /reset_prefix_cache, /kv_event_sources, data-parallel ranks and client disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import msgspec
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_stub.runtime.cost_model import CostModel
from engine_stub.runtime.pseudo_text import PseudoText
from engine_stub.server.openai_io import (
    ChatChunk,
    ChatCompletion,
    Completion,
    CompletionChunk,
    ErrorBody,
    ModelList,
    TokenizeResponse,
)
from events.config import KVEventsConfig
from events.decode import BatchDecoder
from events.frames import Frame
from events.wire import AllBlocksCleared, BlockStored, KVEventBatch
from tests.port_helpers import free_port_run
from tests.stub_helpers import BS, SOURCES, RawSub, live_stub, stub_config
from tests.zmq_helpers import TrackedContext, tracked_context, wait_until
from tokenization import BuiltinTokenizer
from tokenization.loading import cached_encoder
from tokenization.request_tokens import request_tokens

TOK = BuiltinTokenizer()
TEXT = PseudoText(TOK)
COMPLETION = msgspec.json.Decoder(Completion)
CHAT = msgspec.json.Decoder(ChatCompletion)
ERROR = msgspec.json.Decoder(ErrorBody)
BATCH = BatchDecoder(KVEventBatch)


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def sse_payloads(body: str) -> list[str]:
    lines = [line for line in body.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line.removeprefix("data: ") for line in lines]


def metric(text: str, name: str, engine: str = "0") -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("engine") == engine:
                assert sample.labels["model_name"] == "kvrouter-stub"
                return sample.value
    raise AssertionError(f"no sample {name} for engine {engine}")


async def test_models_and_health() -> None:
    async with live_stub() as (_, client):
        models = msgspec.json.decode((await client.get("/v1/models")).content, type=ModelList)
        assert [m.id for m in models.data] == ["kvrouter-stub"]
        assert (await client.get("/health")).status_code == 200


async def test_completion_json_for_each_prompt_form() -> None:
    async with live_stub() as (_, client):
        reply = await client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 6})
        body = COMPLETION.decode(reply.content)
        assert body.object == "text_completion" and body.id.startswith("cmpl-")
        assert [(c.index, c.text, c.finish_reason) for c in body.choices] == [(0, TEXT.text(6), "length")]
        prompt_len = len(TOK.encode("hello there"))
        assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (prompt_len, 6)
        assert body.usage.total_tokens == prompt_len + 6
        ids = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert COMPLETION.decode(ids.content).usage.prompt_tokens == 3
        many = await client.post("/v1/completions", json={"prompt": ["a", "bb"], "max_tokens": 2})
        body = COMPLETION.decode(many.content)
        assert [c.index for c in body.choices] == [0, 1]
        assert body.usage.prompt_tokens == len(TOK.encode("a")) + len(TOK.encode("bb"))


async def test_completion_sse_with_a_final_usage_chunk() -> None:
    async with live_stub() as (_, client):
        payload = {
            "prompt": "x" * 40,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        reply = await client.post("/v1/completions", json=payload)
        assert reply.headers["content-type"].startswith("text/event-stream")
        data = sse_payloads(reply.text)
        assert data[-1] == "[DONE]"
        chunks = [msgspec.json.decode(d, type=CompletionChunk) for d in data[:-1]]
        assert "".join(c.choices[0].text for c in chunks[:-1]) == TEXT.text(4)
        assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, None, "length"]
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4


async def test_a_shared_prefix_reports_the_block_aligned_cached_tokens() -> None:
    async with live_stub() as (_, client):
        first = await client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 1})
        details = COMPLETION.decode(first.content).usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == 0
        second = await client.post("/v1/completions", json={"prompt": "x" * 40 + "y" * 20, "max_tokens": 1})
        details = COMPLETION.decode(second.content).usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == (41 // BS) * BS  # BOS + 40 shared tokens
        salted = {"prompt": "x" * 40, "max_tokens": 1, "cache_salt": "tenant-a"}
        usage = COMPLETION.decode((await client.post("/v1/completions", json=salted)).content).usage
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0


async def test_the_openai_client_streams_chat_sync_and_async() -> None:
    async with live_stub() as (server, _):
        assert server.info is not None
        base = server.info.url + "/v1"
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]

        def sync_stream() -> str:
            with openai.OpenAI(base_url=base, api_key="x") as client:
                stream = client.chat.completions.create(
                    model="kvrouter-stub", messages=messages, max_tokens=5, stream=True
                )
                return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

        assert await asyncio.to_thread(sync_stream) == TEXT.text(5)
        async with openai.AsyncOpenAI(base_url=base, api_key="x") as aclient:
            stream = await aclient.completions.create(
                model="kvrouter-stub",
                prompt="hello",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT.text(3)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
            chat = await aclient.chat.completions.create(
                model="kvrouter-stub", messages=messages, max_tokens=2
            )
            assert chat.choices[0].message.content == TEXT.text(2)


async def test_chat_json_and_sse_shapes() -> None:
    async with live_stub() as (_, client):
        body = {"messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 3}
        reply = CHAT.decode((await client.post("/v1/chat/completions", json=body)).content)
        assert reply.object == "chat.completion" and reply.choices[0].message.content == TEXT.text(3)
        expected = request_tokens(
            msgspec.json.encode(body), "/v1/chat/completions", cached_encoder(TOK)
        ).tokens
        assert reply.usage.prompt_tokens == len(expected)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        data = sse_payloads(streamed.text)
        chunks = [msgspec.json.decode(d, type=ChatChunk) for d in data[:-1]]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEXT.text(3)
        assert chunks[-1].choices[0].finish_reason == "length" and data[-1] == "[DONE]"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": 5}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0]"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, 400, None),
        ("/v1/completions", {"prompt": "a", "model": "other"}, 404, None),
        (
            "/v1/completions",
            {"prompt": "a", "stream_options": {"include_usage": 3}},
            400,
            "stream_options.include_usage",
        ),
    ],
)
async def test_bad_bodies_get_openai_errors_naming_the_field(
    path: str, body: dict[str, object], status: int, param: str | None
) -> None:
    async with live_stub() as (_, client):
        reply = await client.post(path, json=body)
        assert reply.status_code == status
        error = ERROR.decode(reply.content).error
        assert (error.code, error.param) == (status, param)
        bad_rank = await client.post(
            "/v1/completions", json={"prompt": "a"}, headers={"X-data-parallel-rank": "3"}
        )
        assert (
            bad_rank.status_code == 400
            and "X-data-parallel-rank" in ERROR.decode(bad_rank.content).error.message
        )


async def test_tokenize_matches_the_shared_request_tokens() -> None:
    async with live_stub() as (_, client):
        reply = msgspec.json.decode(
            (await client.post("/tokenize", json={"prompt": "hey"})).content, type=TokenizeResponse
        )
        assert reply.tokens == TOK.encode("hey") and reply.count == len(reply.tokens)
        assert reply.max_model_len == 4096 and reply.token_strs is None
        chat = {"messages": [{"role": "user", "content": "hey"}], "return_token_strs": True}
        reply = msgspec.json.decode(
            (await client.post("/tokenize", json=chat)).content, type=TokenizeResponse
        )
        assert (
            tuple(reply.tokens)
            == request_tokens(msgspec.json.encode(chat), "/v1/chat/completions", cached_encoder(TOK)).tokens
        )
        assert reply.token_strs is not None and len(reply.token_strs) == reply.count


async def test_metrics_move_with_requests() -> None:
    async with live_stub() as (_, client):
        before = (await client.get("/metrics")).text
        assert metric(before, "vllm:prefix_cache_queries_total") == 0
        assert metric(before, "vllm:time_to_first_token_seconds_count") == 0
        for _ in range(2):
            await client.post("/v1/completions", json={"prompt": "z" * 40, "max_tokens": 1})
        after = (await client.get("/metrics")).text
        assert metric(after, "vllm:prefix_cache_queries_total") == 2 * 41
        assert metric(after, "vllm:prefix_cache_hits_total") == 32
        assert metric(after, "vllm:time_to_first_token_seconds_count") == 2
        assert metric(after, "vllm:num_requests_running") == metric(after, "vllm:num_requests_waiting") == 0
        assert metric(after, "vllm:kv_cache_usage_perc") == 0


async def test_reset_prefix_cache_publishes_all_blocks_cleared(ctx: TrackedContext) -> None:
    async with live_stub() as (_, client):
        sources = SOURCES.decode((await client.get("/kv_event_sources")).content)
        assert list(sources) == [0] and sources[0].endpoint.startswith("tcp://127.0.0.1:")
        sub = RawSub(ctx, sources[0].endpoint)
        try:
            await warm_up(client, sub)
            reply = await client.post("/reset_prefix_cache")
            assert reply.json() == {"success": True}
            batch = BATCH.decode((await sub.next()).payload)
            assert batch is not None and batch.events == [AllBlocksCleared()]
        finally:
            sub.close()


async def warm_up(client: httpx.AsyncClient, sub: RawSub, rank: int = 0) -> int:
    """Send distinct prompts until the SUB socket sees a live frame (ZeroMQ's slow joiner); its seq."""
    for i in range(100):
        body = {"prompt": f"warm-up {i} " + "w" * 32, "max_tokens": 1}
        await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
        try:
            return (await sub.next(timeout=0.2)).seq
        except TimeoutError:
            continue
    raise AssertionError("the subscriber never joined")


async def test_data_parallel_ranks_publish_on_offset_ports(ctx: TrackedContext) -> None:
    port = free_port_run(2)  # rank r publishes on the configured port + r, as vLLM does
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    async with live_stub(stub_config(data_parallel_size=2, kv_events=events)) as (_, client):
        sources = SOURCES.decode((await client.get("/kv_event_sources")).content)
        assert {r: s.endpoint for r, s in sources.items()} == {0: f"tcp://*:{port}", 1: f"tcp://*:{port + 1}"}
        for rank in (0, 1):
            sub = RawSub(ctx, f"tcp://127.0.0.1:{port + rank}")
            try:
                await warm_up(client, sub, rank)
                batch = BATCH.decode((await one_batch(client, sub, rank)).payload)
                assert batch is not None and batch.data_parallel_rank == rank
            finally:
                sub.close()
        loads = [
            await client.post("/v1/completions", json={"prompt": "q", "max_tokens": 1}) for _ in range(2)
        ]
        assert all(r.status_code == 200 for r in loads)


async def one_batch(client: httpx.AsyncClient, sub: RawSub, rank: int) -> Frame:
    """Send a new prompt pinned to `rank` and return the live frame it produced."""
    body = {"prompt": "v" * 48, "max_tokens": 1}
    await client.post("/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
    return await sub.next()


async def test_a_stopping_stub_ends_open_requests_and_any_that_arrive_with_abort() -> None:
    config = stub_config(cost=CostModel(speed_factor=0.05))  # 120 ms per token: the stream stays open
    async with live_stub(config) as (server, client):
        body = {"prompt": "a long answer", "max_tokens": 1000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            server.stub.abort_all()  # what the server does as its shutdown begins
            rest = [line async for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = msgspec.json.decode(rest[-2].removeprefix("data: "), type=CompletionChunk)
        assert last.choices[0].finish_reason == "abort" and last.choices[0].text == ""
        late_reply = await client.post("/v1/completions", json=body | {"stream": False})
        late = COMPLETION.decode(late_reply.content)
        assert late.choices[0].finish_reason == "abort" and late.usage.completion_tokens == 0
        assert all(e.open_requests == 0 and not e.scheduler.requests for e in server.stub.engines)


async def test_a_client_disconnect_aborts_the_request() -> None:
    slow = CostModel(speed_factor=1.0)
    async with live_stub(stub_config(cost=slow)) as (server, client):
        engine = server.stub.engines[0]
        body = {"prompt": "d" * 40, "max_tokens": 3000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            async for _ in reply.aiter_bytes():
                break
            assert engine.scheduler.requests
        await wait_until(lambda: not engine.scheduler.requests, what="the streamed request to be aborted")
        task = asyncio.create_task(client.post("/v1/completions", json={**body, "stream": False}))
        await wait_until(lambda: bool(engine.scheduler.requests), what="the JSON request to start")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: not engine.scheduler.requests, what="the JSON request to be aborted")


async def test_full_report_mode_and_prompt_logprobs_reach_the_engine(ctx: TrackedContext) -> None:
    async with live_stub() as (_, client):
        source = SOURCES.decode((await client.get("/kv_event_sources")).content)[0]
        sub = RawSub(ctx, source.endpoint)
        try:
            await warm_up(client, sub)
            body = {"prompt": "r" * 40, "max_tokens": 1}
            await client.post("/v1/completions", json=body)
            first = BATCH.decode((await sub.next()).payload)
            full = {**body, "vllm_xargs": {"kv_cache_report_mode": "full"}}
            usage = COMPLETION.decode((await client.post("/v1/completions", json=full)).content).usage
            assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 32
            again = BATCH.decode((await sub.next()).payload)  # the reused blocks, re-announced from block 0
            assert first is not None and again is not None
            assert isinstance(again.events[0], BlockStored) and again.events[0].parent_block_hash is None
            assert again.events[0].block_hashes == [
                h for e in first.events if isinstance(e, BlockStored) for h in e.block_hashes
            ]
            skip = {**body, "prompt_logprobs": 1}
            usage = COMPLETION.decode((await client.post("/v1/completions", json=skip)).content).usage
            assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 0
        finally:
            sub.close()


async def test_unpinned_requests_go_to_the_least_loaded_rank() -> None:
    slow = CostModel(speed_factor=1.0)
    async with live_stub(stub_config(data_parallel_size=2, cost=slow)) as (server, client):
        engines = server.stub.engines
        body = {"prompt": "l" * 20, "max_tokens": 3000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as first:
            chunks = first.aiter_bytes()  # kept: dropping the iterator would close the stream
            await anext(chunks)
            async with client.stream("POST", "/v1/completions", json=body) as second:
                more = second.aiter_bytes()
                await anext(more)
                assert [e.load for e in engines] == [(0, 1), (0, 1)]


async def test_cache_hit_peek_predicts_the_next_admission_without_side_effects() -> None:
    async with live_stub() as (_, client):
        await client.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 1})
        body = {"prompt": "x" * 40 + "y" * 20, "max_tokens": 1}
        peeks = [
            msgspec.json.decode((await client.post("/debug/cache_hit", json=body)).content) for _ in range(2)
        ]
        assert peeks[0] == peeks[1]  # peeking changes nothing
        (rank0,) = peeks[0]
        assert (rank0["rank"], rank0["hit_tokens"], rank0["shared_prefix_boundary"]) == (
            0,
            (41 // BS) * BS,
            0,
        )
        details = COMPLETION.decode((await client.post("/v1/completions", json=body)).content).usage
        assert details.prompt_tokens_details is not None
        assert details.prompt_tokens_details.cached_tokens == rank0["hit_tokens"]
        skip = {**body, "prompt_logprobs": 1}
        (skipped,) = msgspec.json.decode((await client.post("/debug/cache_hit", json=skip)).content)
        assert skipped["hit_tokens"] == 0
