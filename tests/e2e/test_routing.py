"""RoutingCore: lookups across replicas and variants, candidates with trust, and the scorer's choice.

The fleet's state is fed through its subscriber-consumer seam (`on_batch`/`on_signal`) with the events the
engine stub's scheduler produced for the same prompts, so keys and hits are the engine's own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler
from events.sequence import CaughtUp, Reset
from events.sources import EngineName
from events.wire import KVEventBatch
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.policy.scoring import RouteRequest, Scorer, ScorerSettings
from router.core.policy.trust import Gap, TrustReason, TrustState
from router.core.routing import RoutingCore
from router.links.fleet_links import FleetLinks
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tests.zmq_helpers import wait_until
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import ReportMode

PROMPT = list(range(100, 140))  # 40 tokens: 10 blocks of 4


class Core(RoutingCore):
    """The routing core beside the models that prepare its requests."""

    def __init__(self, fleet: FleetState, models: Models) -> None:
        super().__init__(fleet, Scorer(ScorerSettings()), time.perf_counter)
        self.models = models


Build = Callable[..., Awaitable[tuple[FleetState, Core]]]


def engine(tmp: Path, name: str, ranks: int = 1, **kw: object) -> EngineConfig:
    events = [f"ipc://{tmp}/{name}{r}.pub" for r in range(ranks)]
    return EngineConfig(name=name, url=f"http://{name}:8000", model="m", events=events, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Build]:
    fleets: list[FleetLinks] = []

    async def build(*engines: EngineConfig) -> tuple[FleetState, Core]:
        config = RouterConfig(engines=list(engines), models=[ModelConfig(name="m", block_size=4)])
        models = Models(config)
        fleet = FleetState(config, models.hasher, time.monotonic)
        links = FleetLinks(fleet, models)
        fleets.append(links)
        await links.start()
        for rid in fleet.replicas():
            fleet.on_signal(EngineName(rid), CaughtUp(None))  # nothing to replay: the replicas are fresh
        return fleet, Core(fleet, models)

    yield build
    for links in fleets:
        await links.close()


def serve(
    fleet: FleetState, rid: str, prompt: list[int], block_size: int = 4, rank: int | None = None
) -> None:
    """Run `prompt` to completion on a stub and feed its events to `rid` as that replica's batches."""
    cache = CacheConfig(num_gpu_blocks=64, groups=(GroupSpec(block_size=block_size),))
    sched = Scheduler(EngineCoreConfig(cache=cache))
    sched.submit(prompt, SubmitParams(max_tokens=1))
    out = sched.step()
    fleet.on_batch(EngineName(rid), 0, KVEventBatch(0.0, out.events, rank))


def body(prompt: list[int], **extra: object) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": prompt, **extra})


async def test_a_request_goes_to_the_replica_holding_its_prefix(make: Build, tmp_path: Path) -> None:
    fleet, core = await make(engine(tmp_path, "a"), engine(tmp_path, "b"))
    serve(fleet, "b", PROMPT[:24])
    prepared = core.models.prepare(body(PROMPT), Endpoint.COMPLETIONS)
    decision = core.decide(prepared, RouteRequest(prepared.session_key), now=fleet.clock())
    assert decision.engine == "b" and decision.predicted_cached_tokens == 24
    hits = {c.engine: (c.hit_tokens, c.trusted_hit_tokens, c.uncached_tokens) for c in decision.candidates}
    assert hits == {"a": (0, 0, 40), "b": (24, 24, 16)}
    routed = core.route(prepared, RouteRequest(prepared.session_key), now=fleet.clock())
    assert set(prepared.timings) == {"tokenize", "hash"} and set(routed.timings) == {"lookup", "score"}
    again = core.decide(
        prepared, RouteRequest(prepared.session_key, excluded=frozenset({EngineId("b")})), 0.0
    )
    assert again.engine == "a"
    skip = core.models.prepare(body(PROMPT, prompt_logprobs=1), Endpoint.COMPLETIONS)
    assert all(c.hit_tokens == 0 for c in core.decide(skip, RouteRequest("k"), 0.0).candidates)


async def test_a_stale_replicas_hits_are_not_trusted(make: Build, tmp_path: Path) -> None:
    fleet, core = await make(engine(tmp_path, "a"), engine(tmp_path, "b"))
    serve(fleet, "a", PROMPT)
    serve(fleet, "b", PROMPT[:8])
    now = fleet.clock()
    fleet.replica(EngineId("a")).observe(Gap(now, 5, 7))
    prepared = core.models.prepare(body(PROMPT), Endpoint.COMPLETIONS)
    decision = core.decide(prepared, RouteRequest(prepared.session_key), now)
    a = next(c for c in decision.candidates if c.engine == "a")
    assert (a.hit_tokens, a.trusted_hit_tokens, a.trust.state) == (36, 0, TrustState.STALE)
    assert decision.engine == "b" and decision.predicted_cached_tokens == 8


async def test_replicas_of_an_override_variant_are_looked_up_with_their_own_keys(
    make: Build, tmp_path: Path
) -> None:
    fleet, core = await make(engine(tmp_path, "a"), engine(tmp_path, "big", block_size=8))
    serve(fleet, "big", PROMPT, block_size=8)
    serve(fleet, "a", PROMPT[:12])
    prepared = core.models.prepare(body(PROMPT), Endpoint.COMPLETIONS)
    decision = core.decide(prepared, RouteRequest(prepared.session_key), fleet.clock())
    hits = {c.engine: c.hit_tokens for c in decision.candidates}
    assert hits == {"a": 12, "big": 32}  # 40 tokens - 1, in 8-token blocks
    assert decision.engine == "big"


async def test_dp_ranks_are_separate_candidates(make: Build, tmp_path: Path) -> None:
    fleet, core = await make(engine(tmp_path, "dp", ranks=2))
    serve(fleet, "dp/dp1", PROMPT[:32], rank=1)
    prepared = core.models.prepare(body(PROMPT), Endpoint.COMPLETIONS)
    decision = core.decide(prepared, RouteRequest(prepared.session_key), fleet.clock())
    assert {c.engine: c.hit_tokens for c in decision.candidates} == {"dp/dp0": 0, "dp/dp1": 32}
    assert decision.engine == "dp/dp1" and fleet.replica_target(EngineId("dp/dp1")) == ("http://dp:8000", 1)


async def test_a_full_mode_report_is_not_counted_as_a_copy(make: Build, tmp_path: Path) -> None:
    fleet, core = await make(engine(tmp_path, "a"))
    cache = CacheConfig(num_gpu_blocks=64, groups=(GroupSpec(block_size=4),))
    sched = Scheduler(EngineCoreConfig(cache=cache))
    sched.submit(PROMPT[:12], SubmitParams(max_tokens=1))
    fleet.on_batch(EngineName("a"), 0, KVEventBatch(0.0, sched.step().events))
    full = body(PROMPT[:13], vllm_xargs={"kv_cache_report_mode": "full"})
    prepared = core.models.prepare(full, Endpoint.COMPLETIONS)
    fleet.request_sent(EngineId("a"), RequestId("r"), prepared, fleet.clock())

    sched.submit(PROMPT[:13], SubmitParams(max_tokens=1, report_mode=ReportMode.FULL))
    out = sched.step()
    assert len(out.events) == 1  # the report only: the 13th token fills no block
    fleet.on_batch(EngineName("a"), 1, KVEventBatch(0.0, out.events))
    rep = fleet.replica(EngineId("a"))
    assert rep.reports == 1 and fleet.mirror.blocks(rep.id) == 3  # not 6: the report claimed no copies


async def test_a_prefix_just_routed_counts_before_its_events_arrive(make: Build, tmp_path: Path) -> None:
    fleet, core = await make(engine(tmp_path, "a"), engine(tmp_path, "b"))
    first = core.models.prepare(body(PROMPT[:24]), Endpoint.COMPLETIONS)
    now = fleet.clock()
    fleet.request_sent(EngineId("b"), RequestId("r1"), first, now)  # routed, no event seen yet
    sibling = core.models.prepare(body(PROMPT), Endpoint.COMPLETIONS)
    decision = core.decide(sibling, RouteRequest(sibling.session_key), now)
    b = next(c for c in decision.candidates if c.engine == "b")
    assert (b.hit_tokens, b.pending_tokens, b.uncached_tokens) == (0, 24, 16)
    assert decision.engine == "b" and decision.predicted_cached_tokens == 24
    later = fleet.clock() + fleet.config.policy.pending_ttl_s + 1
    assert core.decide(sibling, RouteRequest(sibling.session_key), later).predicted_cached_tokens == 0


async def test_stores_that_never_match_the_routers_keys_mean_a_tokenizer_mismatch(
    make: Build, tmp_path: Path
) -> None:
    fleet, core = await make(engine(tmp_path, "a"), engine(tmp_path, "b"))
    a, b = EngineId("a"), EngineId("b")
    for i in range(3):
        prompt = [t + 1000 * i for t in PROMPT]
        prepared = core.models.prepare(body(prompt), Endpoint.COMPLETIONS)
        now = fleet.clock()
        fleet.request_sent(a, RequestId(f"a{i}"), prepared, now)
        serve(fleet, "a", [t + 1 for t in prompt])  # the engine saw other token ids
        fleet.request_answered(RequestId(f"a{i}"), now)
        fleet.request_finished(a, RequestId(f"a{i}"), now)
        fleet.request_sent(b, RequestId(f"b{i}"), prepared, now)
        serve(fleet, "b", prompt)  # same tokens: its stores carry the router's keys
        fleet.request_answered(RequestId(f"b{i}"), now)
        fleet.request_finished(b, RequestId(f"b{i}"), now)
        unseen = core.models.prepare(body([t + 777 for t in prompt]), Endpoint.COMPLETIONS)
        fleet.request_sent(b, RequestId(f"c{i}"), unseen, now)  # failed: never answered, not judged
        fleet.request_finished(b, RequestId(f"c{i}"), now)
        # stores late (under other keys) until three misses in a row name the cause
        assert fleet.trust(a, now).state is (TrustState.STALE if i == 2 else TrustState.CATCHING_UP)
    status = fleet.trust(a, fleet.clock())
    assert status.reason is TrustReason.TOKENIZER_MISMATCH and "under other keys" in status.detail
    assert fleet.trust(b, fleet.clock()).state is TrustState.FRESH


async def test_first_blocks_the_engine_held_unseen_mean_missed_events_not_a_tokenizer_mismatch(
    make: Build, tmp_path: Path
) -> None:
    """The engine answers from blocks it stored in batches the mirror never got: it stores no first
    block for these requests, so the cause is missed events (e.g. an undetected restart)."""
    fleet, core = await make(engine(tmp_path, "a"))
    a = EngineId("a")
    for i in range(3):
        prepared = core.models.prepare(body([t + 1000 * i for t in PROMPT]), Endpoint.COMPLETIONS)
        now = fleet.clock()
        fleet.request_sent(a, RequestId(f"a{i}"), prepared, now)
        fleet.request_answered(RequestId(f"a{i}"), now)  # no stores: the engine had the prompt cached
        fleet.request_finished(a, RequestId(f"a{i}"), now)
        # stores late (none came) until three misses in a row name the cause
        assert fleet.trust(a, now).state is (TrustState.STALE if i == 2 else TrustState.CATCHING_UP)
    status = fleet.trust(a, fleet.clock())
    assert status.reason is TrustReason.UNSEEN_BLOCKS and "never seen stored" in status.detail


def miss_three(fleet: FleetState, core: Core, rid: EngineId) -> list[list[int]]:
    """Three requests end on `rid` without their first block reaching the mirror; their prompts."""
    prompts = [[t + 1000 * i for t in PROMPT] for i in range(3)]
    for i, prompt in enumerate(prompts):
        prepared = core.models.prepare(body(prompt), Endpoint.COMPLETIONS)
        now = fleet.clock()
        fleet.request_sent(rid, RequestId(f"m{i}"), prepared, now)
        fleet.request_answered(RequestId(f"m{i}"), now)
        fleet.request_finished(rid, RequestId(f"m{i}"), now)
    return prompts


async def replaying(make: Build, tmp: Path) -> tuple[FleetState, Core]:
    """A fleet of one engine whose replay endpoint nobody serves: its start-up replay stays in flight."""
    fleet, core = await make(engine(tmp, "a", replay=[f"ipc://{tmp}/a.replay"]))
    subscriber = fleet.replica(EngineId("a")).link
    assert subscriber is not None
    await wait_until(lambda: subscriber.stats().replaying, what="the start-up replay")
    # The link signalled its replay (the replica is catching up): a fresh replica whose link still
    # has a replay in flight, for `verify()` to join, is what these tests need.
    fleet.on_signal(EngineName("a"), CaughtUp(None))
    return fleet, core


async def test_on_a_verified_link_first_blocks_never_seen_are_a_tokenizer_mismatch(
    make: Build, tmp_path: Path
) -> None:
    fleet, core = await replaying(make, tmp_path)
    a = EngineId("a")
    miss_three(fleet, core, a)
    assert fleet.replica(a).verifying  # no verdict until the link's replay ends
    assert fleet.trust(a, fleet.clock()).reason is not TrustReason.TOKENIZER_MISMATCH
    fleet.on_signal(EngineName("a"), CaughtUp(None))  # the replay found the same publisher
    status = fleet.trust(a, fleet.clock())
    assert status.reason is TrustReason.TOKENIZER_MISMATCH and "verified link" in status.detail


async def test_a_restart_found_by_the_verification_is_the_only_cause_named(
    make: Build, tmp_path: Path
) -> None:
    fleet, core = await replaying(make, tmp_path)
    a = EngineId("a")
    miss_three(fleet, core, a)
    fleet.on_signal(EngineName("a"), Reset("restart"))
    fleet.on_signal(EngineName("a"), CaughtUp(None))
    assert (fleet.trust(a, fleet.clock()).reason, fleet.replica(a).resets) == (TrustReason.OK, 1)


async def test_first_blocks_that_were_only_late_are_no_cause(make: Build, tmp_path: Path) -> None:
    fleet, core = await replaying(make, tmp_path)
    a = EngineId("a")
    for prompt in miss_three(fleet, core, a):
        serve(fleet, "a", prompt)  # the stores arrive after the requests ended
    fleet.on_signal(EngineName("a"), CaughtUp(None))
    rep = fleet.replica(a)
    assert (fleet.trust(a, fleet.clock()).state, rep.verifying, rep.missing_keys) == (
        TrustState.FRESH,
        False,
        [],
    )
