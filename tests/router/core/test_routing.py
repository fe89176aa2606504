"""RoutingCore's candidates and predictions against the general construction they shortcut."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal

from hypothesis import given, settings
from hypothesis import strategies as st

from events.sequence import CaughtUp
from events.sources import EngineName
from events.wire import KVEventBatch
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.keys.block_key import KeyHasher
from router.core.lookup.computed_blocks import LookupRequest, ReplicaId, lookup
from router.core.policy.scoring import Candidate, Decision, PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.prepared import Prepared
from router.core.routing import RoutingCore
from router.prepare.engine_variants import resolve_variant
from router.settings.config import EngineConfig, ModelConfig, PolicyConfig, RouterConfig
from tests.event_helpers import block_stored
from tests.router.core.test_fleet_state import prepared

MODEL = ModelConfig(name="m", block_size=4)
NAMES = ("e0", "e1", "e2")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recording(Scorer):
    """A scorer that keeps the candidates it was given."""

    seen: list[Candidate]

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float = 0.0) -> Decision:
        self.seen = list(candidates)
        return super().choose(request, candidates, now)


Policy = Literal["kv", "round_robin", "session"]


def build(policy: Policy, events: bool) -> tuple[FleetState, RoutingCore, Recording, Clock]:
    clock = Clock()
    engines = [
        EngineConfig(name=n, url=f"http://{n}:1", model="m", events=[f"ipc://{n}.pub"] if events else [])
        for n in NAMES
    ]
    config = RouterConfig(engines=engines, models=[MODEL], policy=PolicyConfig(name=policy))
    fleet = FleetState(config, KeyHasher(b"t"), clock)
    for e in engines:
        fleet.add_engine(e, resolve_variant(MODEL, e), clock())
        fleet.on_signal(EngineName(e.name), CaughtUp(None))
    scorer = Recording(ScorerSettings(PolicyName(policy)))
    return fleet, RoutingCore(fleet, scorer, clock), scorer, clock


def general_predict(fleet: FleetState, p: Prepared) -> dict[EngineId, object]:
    """`RoutingCore.predict` as first written: one `lookup` per variant group, whatever the prompt."""
    out: dict[EngineId, object] = {}
    for variant, rids in fleet.variant_groups(p.model):
        keys = p.keys_for(variant.id)
        assert keys is not None
        request = LookupRequest(keys.keys, keys.num_tokens, p.skip_cache)
        results = lookup(fleet.mirror, variant.spec, request, rids)
        out.update((rid, (results[ReplicaId(rid, 0)], keys.num_tokens)) for rid in rids)
    return out


def general_candidates(core: RoutingCore, fleet: FleetState, p: Prepared, now: float) -> list[Candidate]:
    """The candidates as `RoutingCore._candidate` built them, one public call per field."""
    out = []
    for rid, (result, n) in core.predict(p).items():
        candidate = Candidate(
            engine=rid,
            hit_tokens=result.hit_tokens,
            pending_tokens=core.pending_tokens(rid, p, now),
            boundary=result.shared_prefix_boundary,
            warm_tokens=result.fa_warm_tokens,
            prompt_tokens=n,
            trust=fleet.trust(rid, now),
            load=fleet.load.snapshot(rid, now),
            breaker_open=not fleet.breakers.get(rid).available(now),
            at_capacity=fleet.admission.at_capacity(rid),
            cached_blocks=fleet.mirror.blocks(rid),
        )
        out.append(candidate)
    return out


_serial = itertools.count(1)


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(["kv", "round_robin", "session"]), events=st.booleans(),
    stored=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 6)), max_size=4),
    prompts=st.lists(st.tuples(st.integers(0, 24), st.booleans(), st.booleans()), min_size=1, max_size=6),
    breakers=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["fail", "acquire", "success", "wait"])), max_size=6
    ),
)  # fmt: skip
def test_route_builds_the_candidates_and_predictions_of_the_general_path(
    policy: Policy,
    events: bool,
    stored: list[tuple[int, int]],
    prompts: list[tuple[int, bool, bool]],
    breakers: list[tuple[int, str]],
) -> None:
    """Whatever is stored and pending, for prompts of 0 or 1 token (nothing to look up), skipping the
    cache or not, with breakers closed, open, cooled down or probing: `predict` is one `lookup` per
    group, and the candidates scoring sees are those one public call per field builds (pending tokens
    read only where pending prefixes are kept)."""
    fleet, core, scorer, clock = build(policy, events)
    base = [1000 + i for i in range(24)]
    for engine, blocks in stored:
        tokens = base[: 4 * blocks]
        hashes: list[int | bytes] = list(range(1, blocks + 1))
        batch = KVEventBatch(0.0, [block_stored(hashes, tokens, 4)])
        fleet.on_batch(EngineName(NAMES[engine]), 1, batch)
    for step, (n, skip, send) in enumerate(prompts):
        clock.now += 0.01
        for engine, action in breakers[step : step + 1]:
            breaker = fleet.breakers.get(EngineId(NAMES[engine]))
            if action == "fail":
                for _ in range(breaker.failure_threshold):
                    breaker.record_failure(clock.now)
            elif action == "acquire":
                breaker.acquire(clock.now)
            elif action == "success":
                breaker.record_success(clock.now)
            else:
                clock.now += breaker.open_seconds
        p = prepared(fleet, base[:n], skip)
        assert core.predict(p) == general_predict(fleet, p)
        expected = general_candidates(core, fleet, p, clock.now)
        decision = core.route(p, RouteRequest(key="s"), clock.now).decision
        assert scorer.seen == expected
        if send and decision.engine is not None:
            fleet.request_sent(decision.engine, RequestId(f"r{next(_serial)}"), p, clock.now)


def test_a_prompt_with_nothing_to_look_up_keeps_lookups_group_hits() -> None:
    """The shortcut answers what `lookup` would, `group_hits` included (one zero per spec group)."""
    fleet, core, _, _ = build("kv", True)
    for p in (prepared(fleet, []), prepared(fleet, [7]), prepared(fleet, list(range(40)), skip_cache=True)):
        predicted = core.predict(p)
        assert predicted == general_predict(fleet, p)
        assert all(result.group_hits == (0,) for result, _ in predicted.values())


def test_a_replica_removed_and_added_again_is_routed_with_its_new_record_and_breaker() -> None:
    """The replicas' records and breakers routing keeps are forgotten when they leave the fleet: one
    added again under the same name is routed with its new record and closed breaker."""
    fleet, core, scorer, clock = build("kv", True)
    p = prepared(fleet, list(range(24)))
    core.route(p, RouteRequest(key="s"), clock.now)  # every replica's record and breaker kept
    e0 = EngineId(NAMES[0])
    old = fleet.breakers.get(e0)
    for _ in range(old.failure_threshold):
        old.record_failure(clock.now)
    core.route(p, RouteRequest(key="s"), clock.now)
    assert scorer.seen[0].breaker_open
    config = next(e for e in fleet.engines() if e.name == NAMES[0])
    fleet.remove_engine(NAMES[0])
    fleet.add_engine(config, resolve_variant(MODEL, config), clock.now)  # replaying again
    core.route(p, RouteRequest(key="s"), clock.now)
    assert scorer.seen == general_candidates(core, fleet, p, clock.now)
    assert not next(c for c in scorer.seen if c.engine == e0).breaker_open
    assert core._members[e0][0] is fleet.replica(e0)


def test_a_prefix_cached_nowhere_goes_where_the_mirror_holds_the_fewest_blocks() -> None:
    """Idle replicas with no hit tie; the tie goes to the one whose cache the mirror finds emptiest
    (`Candidate.cached_blocks`, read from the mirror), before the hash: a new app's first session is
    not homed beside another app's while a replica holds nothing."""
    fleet, core, _, clock = build("kv", True)
    for name, blocks, first in (("e0", 6, 1000), ("e1", 2, 2000)):
        batch = KVEventBatch(
            0.0, [block_stored(list(range(first, first + blocks)), list(range(first, first + 4 * blocks)), 4)]
        )
        fleet.on_batch(EngineName(name), 1, batch)
    decision = core.route(prepared(fleet, list(range(500, 524))), RouteRequest(key="s"), clock.now).decision
    assert [c.cached_blocks for c in decision.candidates] == [6, 2, 0]
    assert decision.engine == EngineId("e2")
    assert decision.reason.endswith("decided by fewer cached blocks (0)"), decision.reason
