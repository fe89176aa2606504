"""No client ever gets another client's answer through the gateway and the real engine stub (issue
#33's item 0): a request sent with `Expect: 100-continue` once made the engine answer an interim 100
that the upstream client took for the final answer, leaving the real one on the pooled connection for
the next client."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.settings.config import EngineConfig
from tests.gateway_helpers import engine_of, gateway_config, running_gateway, running_stubs

PATHS = ("/v1/completions", "/v1/chat/completions")


def _body(path: str, words: int) -> dict[str, object]:
    text = "tenant " * words
    if path == "/v1/completions":
        return {"model": "kvrouter-stub", "prompt": text, "max_tokens": 2}
    return {"model": "kvrouter-stub", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def _prompt_tokens(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens"])


@pytest.mark.parametrize("path", PATHS)
async def test_an_expect_100_continue_request_never_hands_its_answer_to_others(path: str) -> None:
    """Each request's prompt has its own length, so an answer tells whose it is by its prompt tokens:
    the attacker's requests (Expect: 100-continue, sequential and among concurrent victims) get their
    own answers and so does every victim, over one engine's pooled connections."""
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        sizes = list(range(5, 45, 2))
        own = {words: _prompt_tokens(await gw.client.post(path, json=_body(path, words))) for words in sizes}
        assert len(set(own.values())) == len(sizes)  # each answer names its request

        expect = {"Expect": "100-continue"}
        for words in sizes[:5]:  # one after another: each reuses the connection the one before left
            assert (
                _prompt_tokens(await gw.client.post(path, json=_body(path, words), headers=expect))
                == own[words]
            )

        async def one(words: int) -> tuple[int, int]:
            headers = expect if words % 4 == 1 else {}
            return words, _prompt_tokens(await gw.client.post(path, json=_body(path, words), headers=headers))

        for _ in range(3):
            answers = await asyncio.gather(*(one(words) for words in sizes))
            assert {words: tokens for words, tokens in answers} == own


class _OddEngine(asyncio.Protocol):
    """An engine that answers every request with `answer` and keeps the connection open."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:  # the gateway writes each request whole
            self.transport.write(self.answer)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\n{}", 502),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n", 502),
        (b"HTTP/1.1 700 Odd\r\nContent-Length: 2\r\n\r\n{}", 502),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
            200,
        ),
        (b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", 204),
    ],
)
@pytest.mark.parametrize("path", [*PATHS, "/v1/embeddings"])
async def test_impossible_engine_answers_are_a_502_or_their_sound_part(
    answer: bytes, status: int, path: str
) -> None:
    """Status lines outside 100-599 and a 101 (never asked for) give the client a 502; an answer with
    a second one behind it, or a 204 with bytes after it, gives its sound first answer. Every client
    gets an answer (none is left hanging), on the hot routes and a passed-through one alike."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _OddEngine(answer), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        config = gateway_config([EngineConfig(name="odd", url=url, model="kvrouter-stub")])
        async with running_gateway(config) as gw:
            for _ in range(3):  # the same engine connection is never trusted after a doubt
                got = await gw.client.post(path, json={**_body(path, 3), "input": "x"})
                assert got.status_code == status, got.text
    finally:
        server.close()
