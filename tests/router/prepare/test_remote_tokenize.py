"""Remote tokenization against the engine stub's real /tokenize (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest

from router.core.keys.block_key import KeyHasher
from router.prepare.remote_tokenize import RemoteTokenizeError, RemoteTokenizer, tokenize_payload
from router.prepare.served_models import Models
from router.settings.config import ModelConfig, RouterConfig
from tests.stub_helpers import live_stub
from tokenization import BuiltinTokenizer
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


def test_the_payload_keeps_only_what_tokenize_reads() -> None:
    payload = msgspec.json.decode(tokenize_payload(msgspec.json.encode(CHAT)))
    assert payload == {"model": "kvrouter-stub", "messages": CHAT["messages"]}
    with pytest.raises(RemoteTokenizeError):
        tokenize_payload(b"{nope")


async def test_remote_ids_give_the_same_prepared_request_as_local_tokenization() -> None:
    body = msgspec.json.encode(CHAT)
    models = Models(RouterConfig(models=[ModelConfig(name="kvrouter-stub")]), HASHER)
    async with live_stub() as (server, _), aiohttp.ClientSession() as session:
        assert server.info is not None
        tokens = await RemoteTokenizer(session).tokenize(server.info.url, body)
        with pytest.raises(RemoteTokenizeError, match="HTTP 404"):
            await RemoteTokenizer(session).tokenize(server.info.url + "/nothing", body)
    assert tokens == list(request_tokens(body, Endpoint.CHAT, BuiltinTokenizer()).tokens)
    remote = models.prepare_tokens(body, Endpoint.CHAT, tokens)
    local = models.prepare(body, Endpoint.CHAT)
    assert (remote.keys, remote.cache_salt, remote.endpoint) == (local.keys, "s", Endpoint.CHAT)
    assert remote.prompt_tokens == local.prompt_tokens and not models.needs_remote("kvrouter-stub")


async def test_an_unreachable_engine_is_a_remote_tokenize_error() -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RemoteTokenizeError):
            await RemoteTokenizer(session, timeout_s=1.0).tokenize("http://127.0.0.1:9", b'{"prompt": "x"}')
