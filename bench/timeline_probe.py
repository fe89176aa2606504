"""Run `python -m kvrouter ARGS` with each request's path stamped; the median of every step when it stops.

Run: ``.venv/bin/python bench/first_chunk_bench.py --timeline`` (at c=1, which this assumes: one
request at a time). Wrappers put around the gateway's own methods stamp `time.perf_counter()` when a
request arrives, its body is in, it is prepared, forwarded, written upstream, when the engine's head
and first body bytes come in, the relay starts, its first body bytes are written to the client and
the request ends. On stop one line ``TIMELINE {"a->b": median us, ...} (tree)`` goes to stderr (the first
fifth of the requests, the warm-up, left out). The wrappers cost a few us each: read the steps
against each other, not as absolute costs.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import runpy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from router.edge import client_writes, gateway, http1, http1_connection, proxy, relay

_rows: list[dict[str, float]] = []
_now: dict[str, float] = {}


def _stamp_async(cls: type, name: str, before: str | None = None, after: str | None = None) -> None:
    real: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(real)
    async def stamped(*args: Any, **kwargs: Any) -> Any:
        if before:
            _now.setdefault(before, time.perf_counter())
        result = await real(*args, **kwargs)
        if after:
            _now.setdefault(after, time.perf_counter())
        return result

    setattr(cls, name, stamped)


def _stamp_sync(cls: type, name: str, mark: str) -> None:
    real: Callable[..., Any] = getattr(cls, name)

    @functools.wraps(real)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        _now.setdefault(mark, time.perf_counter())
        return real(*args, **kwargs)

    setattr(cls, name, stamped)


def _install() -> None:
    handle: Callable[..., Any] = gateway.Gateway.handle

    async def whole(*args: Any, **kwargs: Any) -> None:
        _now.clear()
        _now["0 arrived"] = time.perf_counter()
        await handle(*args, **kwargs)
        _now["9 ended"] = time.perf_counter()
        _rows.append(dict(_now))

    gateway.Gateway.handle = whole  # type: ignore[method-assign]
    _stamp_async(gateway.Gateway, "_admit", after="1 body in")
    _stamp_async(gateway.Gateway, "prepare", after="2 prepared")
    _stamp_async(proxy.Proxy, "forward", before="3 forwarding")
    _stamp_sync(http1.Http1Client, "_send", "4 written upstream")
    _stamp_sync(http1_connection.Connection, "on_headers_complete", "5 engine head in")
    _stamp_sync(http1_connection.Connection, "on_body", "6 engine body in")
    _stamp_async(relay.RelayResponse, "stream_to", before="7 relay starts")
    write: Callable[..., None] = client_writes.HeadHold.write

    def body_write(self: client_writes.HeadHold, data: bytes) -> None:
        if self._held is not None or not self._first:  # not the head alone
            _now.setdefault("8 client body written", time.perf_counter())
        write(self, data)

    client_writes.HeadHold.write = body_write  # type: ignore[method-assign,assignment]


def _summary() -> None:
    rows = _rows[len(_rows) // 5 :]
    steps = sorted({k for row in rows for k in row})
    out: dict[str, float] = {}
    for a, b in itertools.pairwise(steps):
        spans = [(row[b] - row[a]) * 1e6 for row in rows if a in row and b in row]
        if spans:
            out[f"{a} -> {b}"] = round(statistics.median(spans), 1)
    # The tree the gateway runs (its working directory), so the lines of a `--base` run tell apart.
    print("TIMELINE " + json.dumps(out) + f" ({os.getcwd()})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _install()
    atexit.register(_summary)
    sys.argv = ["kvrouter", *sys.argv[1:]]
    runpy.run_module("kvrouter", run_name="__main__", alter_sys=True)
