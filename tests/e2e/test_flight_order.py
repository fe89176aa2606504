"""The order of the request path: the preparation's stores, the decision and its counts, the write.

A request's counts (in-flight load, per-engine admission, pending prefix) and its debug record are
done as its attempt is chosen (router.edge.decider.Exchange.choose), before the proxy awaits
anything: a second request routed while the first one's engine is still computing must see the
first one on its engine, and the first one's record must be whole by then. So must the stores its
preparation made for later ones (router.prepare.served_models): a second request prepared then
reuses the first one's keys; a refused request's stores are kept too. Both hold for token-id
prompts, whose keys go through the key cache, and for text prompts, whose keys a later text extending
them takes through the tokenizer's carry link (`CarryLink.own`, written at preparation)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from aiohttp import web

from router.core.ids import EngineId
from router.ops.debug import DecisionEntry
from router.settings.config import EngineConfig, Limits
from tests.gateway_helpers import Gateway, fake_engine, gateway_config, running_gateway
from tokenization import BuiltinTokenizer

WAIT = 10.0  # a bound on every wait for an event; none is expected to come close
MODEL = "kvrouter-stub"
PREFIX = "the quick brown fox jumps over the lazy dog " * 24  # many full blocks, shared
ANSWER = {"id": "x", "object": "text_completion", "model": MODEL, "choices": []}


class HeldEngines:
    """Fake engines that hold every request whose prompt says "hold" until `release` is set."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.bodies: list[bytes] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.bodies.append(body)
        if b"hold" in body:
            self.arrived.set()
            await asyncio.wait_for(self.release.wait(), WAIT)
        return web.json_response(ANSWER)


@asynccontextmanager
async def held_gateway(
    engines: int, limits: Limits | None = None
) -> AsyncIterator[tuple[Gateway, HeldEngines]]:
    held = HeldEngines()
    async with fake_engine(held.handle) as a, fake_engine(held.handle) as b:
        urls = [a, b][:engines]
        configs = [EngineConfig(name=f"e{i}", url=url, model=MODEL) for i, url in enumerate(urls)]
        config = gateway_config(configs, limits=limits or Limits())
        async with running_gateway(config) as gw:
            yield gw, held


def body(suffix: str) -> dict[str, object]:
    return {"model": MODEL, "prompt": PREFIX + suffix, "max_tokens": 4}


def ids_body(suffix: str) -> dict[str, object]:
    """`body` with the prompt as token ids (the built-in tokenizer's), so its keys are the key cache's:
    a text prompt extending one the tokenizer has seen takes that one's keys through the tokenizer's
    carry link instead (`spec_keys`' ``prior``). The suffix rides in ``user`` for `HeldEngines`."""
    ids = BuiltinTokenizer().encode(PREFIX + suffix)
    return {"model": MODEL, "prompt": ids, "max_tokens": 4, "user": suffix}


def reused_tokens(gw: Gateway) -> int:
    """Token ids the gateway's tokenizers copied from earlier texts (prefix reuse), so far."""
    return sum(s.reused_tokens for s in gw.parts.models.tokenizer_stats())


def entry_of(gw: Gateway, rid: str) -> DecisionEntry:
    entry = gw.parts.ring.get(rid)
    assert entry is not None, f"{rid} is not in the decision ring"
    return entry


async def test_a_request_routed_while_the_first_is_computing_sees_it_on_its_engine() -> None:
    async with held_gateway(2) as (gw, held):
        fleet = gw.parts.fleet
        first = asyncio.ensure_future(
            gw.client.post("/v1/completions", json=body("hold"), headers={"x-request-id": "first"})
        )
        await asyncio.wait_for(held.arrived.wait(), WAIT)  # written, the engine "computing"
        one = entry_of(gw, "first")  # the record is whole while the engine computes
        assert one.engine is not None and one.status is None
        engine = EngineId(one.engine)
        assert len(one.decisions) == 1 and one.decisions[0].engine == engine
        assert {"tokenize", "hash", "lookup", "score"} <= set(one.timings_s)
        assert one.predicted_cached_tokens == one.decisions[0].predicted_cached_tokens
        now = fleet.clock()
        assert fleet.load.snapshot(engine, now).in_flight == 1
        assert fleet.admission.in_flight(engine) == 1
        assert fleet.pending.holds(engine)

        second = await gw.client.post(
            "/v1/completions", json=body("next"), headers={"x-request-id": "second"}
        )
        assert second.status_code == 200, second.text
        two = entry_of(gw, "second")
        seen = {c.engine: c for c in two.decisions[0].candidates}
        assert seen[engine].load.in_flight == 1  # the first one, still in flight there
        assert seen[engine].pending_tokens > 0  # and its prefix, pending there
        others = [c for e, c in seen.items() if e != engine]
        assert [c.load.in_flight for c in others] == [0] and [c.pending_tokens for c in others] == [0]
        assert two.status == 200 and {"tokenize", "lookup", "score"} <= set(two.timings_s)

        held.release.set()
        answer = await asyncio.wait_for(first, WAIT)
        assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == engine
        assert entry_of(gw, "first").status == 200
        assert fleet.load.snapshot(engine, fleet.clock()).in_flight == 0
        assert fleet.admission.in_flight(engine) == 0


async def test_a_request_prepared_while_the_first_is_computing_reuses_what_it_stored() -> None:
    async with held_gateway(1) as (gw, held):
        models = gw.parts.models
        first = asyncio.ensure_future(gw.client.post("/v1/completions", json=ids_body("hold")))
        await asyncio.wait_for(held.arrived.wait(), WAIT)  # written, the engine "computing"
        assert len(models.key_cache) == 1  # its prompt's keys, kept for the next prompts
        reused = models.key_cache.reused_blocks
        second = await gw.client.post("/v1/completions", json=ids_body("next"))
        assert second.status_code == 200, second.text
        shared = len(PREFIX) // 16  # the builtin tokenizer: a BOS, then a token per byte
        assert models.key_cache.reused_blocks - reused >= shared  # found, not hashed again
        held.release.set()
        assert (await asyncio.wait_for(first, WAIT)).status_code == 200


async def test_a_text_prepared_while_the_first_is_computing_carries_its_keys() -> None:
    """A text extending the held one reuses its ids and its keys (the carry link the first one's
    preparation filled), so the key cache is neither read nor written for it."""
    async with held_gateway(1) as (gw, held):
        cache = gw.parts.models.key_cache
        first = asyncio.ensure_future(gw.client.post("/v1/completions", json=body("hold")))
        await asyncio.wait_for(held.arrived.wait(), WAIT)
        assert len(cache) == 1  # the first text's keys were hashed: nothing to extend yet
        stored, reused, copied = len(cache), cache.reused_blocks, reused_tokens(gw)
        second = await gw.client.post("/v1/completions", json=body("next"))
        assert second.status_code == 200, second.text
        assert reused_tokens(gw) - copied >= len(PREFIX)  # its ids extended the held text's
        assert (len(cache), cache.reused_blocks) == (stored, reused)  # its keys, the held text's
        held.release.set()
        assert (await asyncio.wait_for(first, WAIT)).status_code == 200


async def test_a_refused_texts_stores_are_kept() -> None:
    """A text refused at admission still leaves its ids for the texts extending it."""
    async with held_gateway(1, Limits(max_in_flight_per_engine=1)) as (gw, held):
        first = asyncio.ensure_future(gw.client.post("/v1/completions", json=body("hold")))
        await asyncio.wait_for(held.arrived.wait(), WAIT)
        refused = await gw.client.post("/v1/completions", json=body("next " * 40))
        assert refused.status_code == 429, refused.text
        held.release.set()
        assert (await asyncio.wait_for(first, WAIT)).status_code == 200
        copied = reused_tokens(gw)
        third = await gw.client.post("/v1/completions", json=body("next " * 40 + "and more"))
        assert third.status_code == 200, third.text
        assert reused_tokens(gw) - copied >= len(PREFIX + "next " * 40)  # the refused text's ids


async def test_a_refused_request_is_recorded_whole() -> None:
    """No attempt goes out (the only engine is at its limit): the record is kept all the same."""
    async with held_gateway(1, Limits(max_in_flight_per_engine=1)) as (gw, held):
        first = asyncio.ensure_future(gw.client.post("/v1/completions", json=ids_body("hold")))
        await asyncio.wait_for(held.arrived.wait(), WAIT)
        refused = await gw.client.post(
            "/v1/completions", json=ids_body("next"), headers={"x-request-id": "no"}
        )
        assert refused.status_code == 429, refused.text
        entry = entry_of(gw, "no")
        assert entry.status == 429 and entry.engine is None and len(entry.decisions) == 1
        assert entry.decisions[0].engine is None
        assert {"tokenize", "hash", "lookup", "score"} <= set(entry.timings_s)
        assert gw.parts.fleet.admission.in_flight(EngineId("e0")) == 1  # the refusal counted nothing
        assert len(gw.parts.models.key_cache) == 2  # its stores were kept
        held.release.set()
        assert (await asyncio.wait_for(first, WAIT)).status_code == 200
        assert len(held.bodies) == 1
        assert msgspec.json.decode(held.bodies[0])["user"] == "hold"
