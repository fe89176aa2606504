"""Which stub served each request of a router that names none (an external one), from the stubs' own
records (`GET /debug/served`: engine_stub.runtime.served_log).

The load test sends requests in arrival order at least `--min-gap-ms` apart, so the stubs' records of
one policy's run, merged in time order, pair one to one with its requests in arrival order; each pair
must agree on the prompt tokens (the answer's usage is the stub's own count), and the whole run is
attributed or none of it (a record missing or extra, a pair that disagrees: the engines stay unknown).
An engine that does not serve the route (a real vLLM) leaves them unknown too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp
import msgspec

from engine_stub.runtime.served_log import Served
from kvrouter.loadtest.oracle import StubEndpoint
from kvrouter.loadtest.results import RequestResult

__all__ = ["attribute", "read_served"]

_SERVED = msgspec.json.Decoder(list[Served])


def attribute(
    results: Sequence[RequestResult], served: Mapping[str, Sequence[Served]]
) -> list[RequestResult] | None:
    """`results` with each one's `engine` the stub whose record pairs with it (see the module
    docstring), in their order; None when the records do not pair with them."""
    records = sorted((s.time, name, s.prompt_tokens) for name, entries in served.items() for s in entries)
    if len(records) != len(results):
        return None
    by_arrival = sorted(range(len(results)), key=lambda i: results[i].arrival_s)
    engines: dict[int, str] = {}
    for i, (_, name, tokens) in zip(by_arrival, records, strict=True):
        r = results[i]
        if r.error is None and r.prompt_tokens != tokens:
            return None
        engines[i] = name
    return [msgspec.structs.replace(r, engine=engines[i]) for i, r in enumerate(results)]


async def read_served(
    session: aiohttp.ClientSession, stubs: Sequence[StubEndpoint], since: float
) -> dict[str, list[Served]] | None:
    """Every stub's records since wall-clock `since`, by stub name; None if one does not serve them."""
    out: dict[str, list[Served]] = {}
    for stub in stubs:
        async with session.get(f"{stub.url}/debug/served", params={"since": repr(since)}) as r:
            if r.status != 200:
                return None
            out[stub.name] = _SERVED.decode(await r.read())
    return out
