"""Remote tokenization against the engine stub's real /tokenize (uvicorn on 127.0.0.1), through the
gateway's one HTTP client (`Proxy.call`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest

from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.core.policy.breaker import Breakers
from router.edge.proxy import Proxy, ProxySettings
from router.prepare.remote_tokenize import RemoteTokenizeError, RemoteTokenizer, tokenize_payload
from router.prepare.served_models import Models
from router.settings.config import ModelConfig, RouterConfig
from tests.stub_helpers import live_stub
from tokenization import BuiltinTokenizer
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import request_tokens

CHAT = {
    "model": "kvrouter-stub",
    "messages": [{"role": "user", "content": "hello there " * 10}],
    "cache_salt": "s",
    "max_tokens": 3,
    "temperature": 0.5,
}
HASHER = KeyHasher(b"remote")
E = EngineId("e1")


@asynccontextmanager
async def started_proxy() -> AsyncIterator[Proxy]:
    proxy = Proxy(ProxySettings(connect_s=1.0), Breakers(failure_threshold=2, open_seconds=60.0))
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


def test_the_payload_keeps_only_what_tokenize_reads() -> None:
    payload = msgspec.json.decode(tokenize_payload(msgspec.json.encode(CHAT)))
    assert payload == {"model": "kvrouter-stub", "messages": CHAT["messages"]}
    with pytest.raises(RemoteTokenizeError):
        tokenize_payload(b"{nope")


async def test_remote_ids_give_the_same_prepared_request_as_local_tokenization() -> None:
    body = msgspec.json.encode(CHAT)
    models = Models(RouterConfig(models=[ModelConfig(name="kvrouter-stub")]), HASHER)
    async with live_stub() as (server, _), started_proxy() as proxy:
        assert server.info is not None
        tokens = await RemoteTokenizer(proxy.call).tokenize(E, server.info.url, body)
        with pytest.raises(RemoteTokenizeError, match="HTTP 404"):
            await RemoteTokenizer(proxy.call).tokenize(E, server.info.url + "/nothing", body)
    assert tokens == list(request_tokens(body, Endpoint.CHAT, cached_encoder(BuiltinTokenizer())).tokens)
    remote = models.prepare_tokens(body, Endpoint.CHAT, tokens)
    local = models.prepare(body, Endpoint.CHAT)
    assert (remote.keys, remote.cache_salt, remote.endpoint) == (local.keys, "s", Endpoint.CHAT)
    assert remote.prompt_tokens == local.prompt_tokens and not models.needs_remote("kvrouter-stub")


async def test_an_unreachable_engine_is_a_remote_tokenize_error() -> None:
    async with started_proxy() as proxy:
        with pytest.raises(RemoteTokenizeError, match="cannot connect to engine e1"):
            await RemoteTokenizer(proxy.call, timeout_s=1.0).tokenize(
                E, "http://127.0.0.1:9", b'{"prompt": "x"}'
            )


MESSAGES = {
    "model": "kvrouter-stub",
    "max_tokens": 3,
    "system": [{"type": "text", "text": "You are an agent. " * 8}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there " * 10}]}],
}
RESPONSES = {"model": "kvrouter-stub", "instructions": "You are an agent. " * 8, "input": "hello there " * 10}


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [(Endpoint.MESSAGES, MESSAGES), (Endpoint.RESPONSES, RESPONSES)],
    ids=["messages", "responses"],
)
async def test_agent_bodies_are_rendered_by_the_engine_as_it_would_run_them(
    endpoint: Endpoint, body: object
) -> None:
    raw = msgspec.json.encode(body)
    models = Models(RouterConfig(models=[ModelConfig(name="kvrouter-stub")]), HASHER)
    async with live_stub() as (server, _), started_proxy() as proxy:
        assert server.info is not None
        tokens = await RemoteTokenizer(proxy.call).tokenize(E, server.info.url, raw, endpoint)
    assert tokens == list(request_tokens(raw, endpoint, cached_encoder(BuiltinTokenizer())).tokens)
    remote = models.prepare_tokens(raw, endpoint, tokens)
    local = models.prepare(raw, endpoint)
    assert remote.keys == local.keys and remote.tokenizer == "remote_render"
