"""The one translation of the transport's exceptions (`upstream_error`), as a table, and the
hot paths' plain `except` that use it without a context manager per exchange and per chunk."""

from __future__ import annotations

import pytest

from router.core.errors import UpstreamBroken, UpstreamConnectError, UpstreamError, UpstreamTimeout
from router.core.ids import EngineId
from router.edge import http1
from router.edge.upstream import (
    UPSTREAM_FAILURES,
    Target,
    UpstreamResponse,
    map_upstream_errors,
    upstream_error,
)

E = EngineId("e1")
REFUSED = ConnectionRefusedError(111, "Connection refused")

TABLE: list[tuple[BaseException, type[UpstreamError], str]] = [
    (http1.ConnectTimedOut("slow"), UpstreamTimeout, "timed out connecting to engine e1"),
    (http1.TimedOut("read"), UpstreamTimeout, "engine e1 went silent (read timeout)"),
    (http1.TimedOut("first byte"), UpstreamTimeout, "engine e1: first byte timeout"),
    (http1.ConnectFailed(REFUSED), UpstreamConnectError, f"cannot connect to engine e1: {REFUSED}"),
    (TimeoutError(), UpstreamTimeout, "engine e1: total timeout"),
    (http1.ServerDisconnected("gone"), UpstreamBroken, "engine e1: connection broke (ServerDisconnected)"),
    (http1.ResponseCut("cut"), UpstreamBroken, "engine e1: connection broke (ResponseCut)"),
    (ConnectionResetError(), UpstreamBroken, "engine e1: connection broke (ConnectionResetError)"),
    (http1.BadResponse("bad"), UpstreamBroken, "engine e1: connection broke (BadResponse)"),
]


@pytest.mark.parametrize(("exc", "kind", "message"), TABLE)
def test_each_client_failure_maps_to_its_upstream_error(
    exc: BaseException, kind: type[UpstreamError], message: str
) -> None:
    assert isinstance(exc, UPSTREAM_FAILURES)
    error = upstream_error(E, "total", exc)
    assert type(error) is kind and error.message == message and error.engine == E
    with pytest.raises(kind) as raised, map_upstream_errors(E, "total"):
        raise exc
    assert raised.value.message == message and raised.value.__cause__ is exc


class _Broken:
    """An `Answer` stand-in whose body read fails as the client's would."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def next_chunk(self) -> bytes:
        raise self.exc

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("exc", "kind", "message"), TABLE)
async def test_a_failed_chunk_is_translated_and_reported_broken(
    exc: BaseException, kind: type[UpstreamError], message: str
) -> None:
    answer = UpstreamResponse(Target(E, "http://e1"), 200, [], [])
    broken: list[bool] = []
    answer.response = _Broken(exc)  # type: ignore[assignment]
    answer._on_broken = lambda: broken.append(True)
    with pytest.raises(kind) as raised:
        await answer.next_chunk()
    assert raised.value.message == message and raised.value.__cause__ is exc and broken == [True]
