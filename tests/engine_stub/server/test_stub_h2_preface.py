"""A client opening HTTP/2 with prior knowledge (sglang-router probes every worker so, for gRPC)
gets HTTP/2's own refusal, not an uvicorn "Invalid HTTP request received." warning; real sockets."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from engine_stub.server.h2_preface import GOAWAY_HTTP_1_1_REQUIRED, PREFACE, SETTINGS_EMPTY
from tests.gateway_helpers import running_stubs

# what sglang-router 0.3.2 sent after the preface: an HTTP/2 SETTINGS frame (then its HEADERS)
CLIENT_SETTINGS = bytes.fromhex("00001804000000000000020000000000040000ffff000500004000000600004000")


async def _exchange(port: int, *chunks: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
        async with asyncio.timeout(10):
            return await reader.read()  # until the stub closes the connection
    finally:
        writer.close()


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split preface"])
async def test_an_http2_prior_knowledge_connection_is_refused_the_http2_way(
    split: bool, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_stubs(1) as stubs:
        port = stubs[0].port
        chunks = [PREFACE[:10], PREFACE[10:] + CLIENT_SETTINGS] if split else [PREFACE + CLIENT_SETTINGS]
        with caplog.at_level(logging.INFO):
            answer = await _exchange(port, *chunks)
        assert answer == SETTINGS_EMPTY + GOAWAY_HTTP_1_1_REQUIRED
        assert not [r for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
        assert [r for r in caplog.records if "HTTP/2" in r.getMessage() and r.levelno == logging.INFO]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/health")).status_code == 200  # HTTP/1.1 on the same port as before
            metrics = (await client.get("/metrics")).text
        assert "kvrouter_stub_http2_refused_total 1.0" in metrics


async def test_bytes_that_only_start_like_the_preface_are_still_http1() -> None:
    async with running_stubs(1) as stubs:
        answer = await _exchange(stubs[0].port, b"PRI * HTTP/1.1\r\nHost: x\r\n\r\n")
        assert not answer.startswith(SETTINGS_EMPTY)  # not a preface: uvicorn answers (or drops) it as before
