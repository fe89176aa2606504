"""A churn of distinct prompts through the stub's HTTP API leaves it holding a bounded amount of state.

Under a churn (new prompts, short outputs) the stub grew without a plateau while its block pool was
fixed: the tokenizer's segment cache kept up to 8,192 whole prompts and each rank's replay buffer up to
10,000 batches, both bounded by a count whatever their size. Counted here in entries and bytes, not RSS.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import msgspec

from engine_stub.server.launch import running_stub
from tests.stub_helpers import stub_config
from tokenization import BuiltinTokenizer, SegmentCache

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
MAX_TOKENS = 4000
BUFFER_BYTES = 6000


def prompt(rng: random.Random, i: int) -> str:
    return f"conversation {i}: " + " ".join(rng.choice(WORDS) for _ in range(40))


async def churn(client: httpx.AsyncClient, n: int) -> None:
    """`n` requests with distinct prompts, JSON, streamed and chat, 8 at a time."""
    rng = random.Random(7)
    gate = asyncio.Semaphore(8)

    async def one(i: int) -> None:
        text = prompt(rng, i)
        async with gate:
            if i % 3 == 2:
                body = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
                reply = await client.post("/v1/chat/completions", json=body)
            else:
                reply = await client.post(
                    "/v1/completions", json={"prompt": text, "max_tokens": 2, "stream": i % 3 == 1}
                )
            assert reply.status_code == 200, reply.text

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_a_prompt_churn_leaves_bounded_caches_and_no_request_behind() -> None:
    config = msgspec.structs.replace(stub_config(), replay_buffer_bytes=BUFFER_BYTES)
    async with running_stub(config, BuiltinTokenizer()) as server:
        assert server.info is not None
        server.stub.encoder = BuiltinTokenizer().cached_encoder(SegmentCache(max_tokens=MAX_TOKENS))
        async with httpx.AsyncClient(base_url=server.info.url, timeout=30.0) as client:
            await churn(client, 150)
            metrics = (await client.get("/metrics")).text
        stub = server.stub
        for engine in stub.engines:
            assert engine.open_requests == 0 and engine.scheduler.requests == {}
            assert engine.load == (0, 0)
        cache = stub.encoder.view()
        assert 0 < cache.piece_tokens <= MAX_TOKENS and cache.pieces < 150
        for publisher in stub.publishers:
            assert publisher.stats.batches > len(publisher.buffered_seqs) > 0
            assert publisher.buffer_bytes <= BUFFER_BYTES
    assert metrics.count("vllm:time_to_first_token_seconds_count{") == 1  # one series per rank only


def test_the_defaults_bound_the_stub_in_bytes() -> None:
    config = stub_config()
    assert 0 < config.replay_buffer_bytes <= 64 << 20
    assert 0 < BuiltinTokenizer().cached_encoder().view().max_piece_tokens <= 1 << 20
