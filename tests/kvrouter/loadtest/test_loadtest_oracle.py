"""The load-test oracle routes by the stubs' true caches: a warm stub wins, pending work spreads load."""

from __future__ import annotations

import aiohttp

from engine_stub.server.launch import running_stub
from kvrouter.loadtest.oracle import CacheOracle, StubEndpoint
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec, block_token_ids
from tests.stub_helpers import stub_config


async def test_oracle_prefers_the_true_cache_then_spreads_pending_work() -> None:
    prefix = block_token_ids(7, 64)
    async with running_stub(stub_config()) as a, running_stub(stub_config()) as b:
        assert a.info is not None and b.info is not None
        stubs = [StubEndpoint("a", a.info.url), StubEndpoint("b", b.info.url)]
        async with aiohttp.ClientSession() as session:
            warm = {"model": "kvrouter-stub", "prompt": prefix, "max_tokens": 1}
            async with session.post(f"{b.info.url}/v1/completions", json=warm) as r:
                assert r.status == 200
            oracle = CacheOracle(stubs, session, "kvrouter-stub")
            shared = RequestSpec(0.0, [*prefix, *block_token_ids(8, 16)], 1, "s")
            first = await oracle.choose(0, shared)
            assert (first.engine, first.headers) == ("b", {"x-data-parallel-rank": "0"})
            assert oracle.pending == {("b", 0): 80 - 64}
            cold = RequestSpec(0.0, block_token_ids(9, 200), 1, "t")
            second = await oracle.choose(1, cold)
            assert second.engine == "a"  # equal hits (none): the stub with less pending work
            sibling = RequestSpec(0.0, [*block_token_ids(9, 200), *block_token_ids(10, 40)], 1, "u")
            third = await oracle.choose(2, sibling)  # `cold` is still in flight on a: its prefix counts
            assert third.engine == "a" and oracle.pending[("a", 0)] == 200 + (240 - 192)
            oracle.done(RequestResult(policy="oracle", index=0, session="s", arrival_s=0.0))
            assert oracle.pending[("b", 0)] == 0
