"""FleetState without sockets: batches, link signals and request hooks as plain calls, time passed in.

The pure state is driven exactly as its subscribers and the gateway's flights drive it, with a fake
clock and a fake link: no ZeroMQ context, no event loop.
"""

from __future__ import annotations

import itertools

import msgspec

from events.sequence import CaughtUp, RequestReplay
from events.sequence import Reset as LinkReset
from events.sources import EngineName, EngineStats
from events.wire import BlockStored, KVEventBatch
from router.core.fleet_state import FleetState, ModelReadiness
from router.core.ids import EngineId, RequestId
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, ModelSpec
from router.core.policy.trust import TrustReason, TrustState, TrustTracker
from router.core.prepared import Prepared
from router.core.replica import Replica
from router.prepare.engine_variants import resolve_variant
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tests.event_helpers import block_stored
from tokenization.openai_request import Endpoint

MODEL = ModelConfig(name="m", block_size=4)
E = EngineId("e")
_hashes = itertools.count(1)
_tokens = itertools.count(1000)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeLink:
    """A link whose counters never change; records the verifications asked of it."""

    def __init__(self) -> None:
        self.verified = 0

    def stats(self) -> EngineStats:
        return EngineStats(
            engine="e",
            batches=0,
            events={},
            gaps=0,
            replays=0,
            replay_failures=0,
            resets=0,
            history_lost=0,
            duplicates=0,
            decode_errors=0,
            frame_errors=0,
            consumer_errors=0,
            last_seq=None,
            last_event_time=None,
            stale=False,
            replaying=False,
        )

    def verify(self) -> bool:
        self.verified += 1
        return True


def engine(replay: bool = True) -> EngineConfig:
    replays = ["ipc://e.rep"] if replay else []
    return EngineConfig(name="e", url="http://e:8000", model="m", events=["ipc://e.pub"], replay=replays)


def fleet_of(*engines: EngineConfig) -> tuple[FleetState, Clock]:
    clock = Clock()
    fleet = FleetState(RouterConfig(engines=list(engines), models=[MODEL]), KeyHasher(b"t"), clock)
    for e in engines:
        fleet.add_engine(e, resolve_variant(MODEL, e), clock())
    return fleet, clock


def followed_fleet() -> tuple[FleetState, Clock]:
    """One engine whose start-up replay is over, attached to a fake link."""
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    fleet.attach(E, FakeLink())
    return fleet, clock


def store(n: int) -> BlockStored:
    tokens = [next(_tokens) for _ in range(4 * n)]
    return block_stored([next(_hashes) for _ in range(n)], tokens, 4)


def stored(tokens: list[int]) -> BlockStored:
    """The engine's store of the full blocks of a prompt of `tokens`."""
    n = len(tokens) // 4
    return block_stored([next(_hashes) for _ in range(n)], tokens[: 4 * n], 4)


def prepared(fleet: FleetState, tokens: list[int], skip_cache: bool = False) -> Prepared:
    keys = [int(k) for k in fleet.mirror.hasher.request_keys(tokens, 4)]
    return Prepared(
        model="m",
        endpoint=Endpoint.COMPLETIONS,
        stream=False,
        prompt_tokens=len(tokens),
        keys=keys,
        skip_cache=skip_cache,
        report_mode="incremental",
        session_key="s",
        timings={},
        variant="m",
    )


def status(fleet: FleetState, clock: Clock) -> tuple[TrustState, TrustReason]:
    s = fleet.trust(E, clock())
    return s.state, s.reason


def test_batches_and_signals_drive_the_mirror_and_trust_without_any_socket() -> None:
    fleet, clock = fleet_of(engine())
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT)
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [store(3)]))
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    assert status(fleet, clock)[0] is TrustState.FRESH
    assert fleet.mirror.blocks(E) == 3 and fleet.replica(E).last_seq == 0
    fleet.attach(E, FakeLink())
    fleet.on_signal(EngineName("e"), LinkReset(reason="restart"))
    assert fleet.mirror.blocks(E) == 0 and fleet.replica(E).resets == 1
    assert status(fleet, clock)[1] is TrustReason.REPLAY_IN_FLIGHT  # a link with a replay endpoint


def test_ready_means_a_healthy_replica_for_every_served_model_trusted_or_not() -> None:
    fleet, clock = fleet_of(engine())
    assert status(fleet, clock)[0] is TrustState.CATCHING_UP  # the start-up replay is in flight
    assert fleet.ready(clock()) and fleet.readiness(clock())["m"] == ModelReadiness(1, 1, 0)
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    assert fleet.readiness(clock())["m"] == ModelReadiness(1, 1, 1)
    for _ in range(fleet.config.breaker.failure_threshold):
        fleet.breakers.get(E).record_failure(clock())
    assert not fleet.ready(clock()) and fleet.readiness(clock())["m"] == ModelReadiness(1, 0, 0)
    clock.now += fleet.config.breaker.open_s  # the breaker lets a probe through: routable again
    assert fleet.ready(clock())
    other = ModelConfig(name="other")  # configured, but no engine serves it
    alone = FleetState(RouterConfig(models=[MODEL, other]), KeyHasher(b"t"), clock)
    assert not alone.ready(clock()) and alone.readiness(clock()) == {
        "m": ModelReadiness(),
        "other": ModelReadiness(),
    }
    alone.add_engine(engine(), resolve_variant(MODEL, engine()), clock())
    assert not alone.ready(clock())  # "other" still has no replica
    assert not FleetState(RouterConfig(), KeyHasher(b"t"), clock).ready(clock())  # nothing to route to


def test_three_requests_whose_first_blocks_never_appear_ask_the_link_to_verify() -> None:
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    link = FakeLink()
    fleet.attach(E, link)
    for i in range(3):
        request = RequestId(f"r{i}")
        fleet.request_sent(E, request, prepared(fleet, list(range(10 * i, 10 * i + 8))), clock())
        fleet.request_answered(request, clock())
        fleet.request_finished(E, request, clock())
    assert link.verified == 1 and fleet.replica(E).verifying
    fleet.on_signal(EngineName("e"), CaughtUp(None))  # the verification replay found no restart
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.TOKENIZER_MISMATCH)


def test_removing_an_engine_forgets_its_replicas() -> None:
    fleet, _ = fleet_of(engine(replay=False))
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [store(2)]))
    assert fleet.remove_engine("e") == [E]
    assert fleet.replicas() == [] and fleet.engines() == [] and fleet.mirror.index == {}
    fleet.on_batch(EngineName("e"), 1, KVEventBatch(0.0, [store(1)]))  # a late batch is ignored


def test_pending_prefixes_are_kept_only_for_policies_that_read_them() -> None:
    from router.settings.config import PolicyConfig

    for policy, ttft_limit, kept in [
        ("kv", 0.0, True), ("session", 0.0, True), ("round_robin", 0.0, False),
        ("least_loaded", 0.0, False), ("random", 0.0, False), ("prefix_approx", 0.0, False),
        ("round_robin", 2.0, True),  # saturation reads the predicted TTFT, pending included
    ]:  # fmt: skip
        clock = Clock()
        config = RouterConfig(
            engines=[engine()],
            models=[MODEL],
            policy=msgspec.convert({"name": policy, "max_predicted_ttft_s": ttft_limit}, PolicyConfig),
        )
        fleet = FleetState(config, KeyHasher(b"t"), clock)
        fleet.add_engine(engine(), resolve_variant(MODEL, engine()), clock())
        fleet.request_sent(E, RequestId("r"), prepared(fleet, list(range(12))), clock())
        assert fleet.pending.holds(E) is kept, policy


SILENCE_S = RouterConfig().policy.trust_silence_s


def sent(fleet: FleetState, clock: Clock, request: str, tokens: list[int], answered: bool = True) -> None:
    fleet.request_sent(E, RequestId(request), prepared(fleet, tokens), clock())
    if answered:
        fleet.request_answered(RequestId(request), clock())


def test_stores_of_an_earlier_request_do_not_end_the_silence_of_a_later_one() -> None:
    """The silence clock runs from the oldest request whose stores the mirror has not seen: a batch
    that brings only an earlier request's stores leaves a later one's missing (before, any delivered
    batch reset the clock, so a pause right after it kept the mirror fresh for good)."""
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    first, second = list(range(10)), list(range(100, 110))
    sent(fleet, clock, "a", first)
    clock.now += 0.1
    sent(fleet, clock, "b", second)
    clock.now += 0.1
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(first)]))  # a's stores; then b's are lost
    clock.now += SILENCE_S - 0.2
    assert status(fleet, clock)[0] is TrustState.FRESH  # b was sent less than silence_s ago
    clock.now += 0.2
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.SILENT)
    assert "sent 5.1s ago" in fleet.trust(E, clock()).detail  # counted from b's send
    fleet.on_batch(EngineName("e"), 1, KVEventBatch(0.0, [stored(second)]))  # b's stores after all
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_a_verification_replay_answered_before_the_last_request_stored_leaves_it_awaited() -> None:
    """test_event_pause's race, step by step: three requests end without their blocks (the engine's
    events are paused), the verification replay is asked, a fourth request is sent, and the replay
    brings the first three requests' stores (held in the engine's buffer) but not the fourth's, which
    the engine computed after answering the replay. The fourth's stores are still missing, so the
    mirror must go stale `silence_s` after it was sent (it stayed fresh for the rest of the pause)."""
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    link = FakeLink()
    fleet.attach(E, link)
    prompts = [list(range(100 * i, 100 * i + 10)) for i in range(4)]
    for i, prompt in enumerate(prompts[:3]):
        sent(fleet, clock, f"r{i}", prompt)
        fleet.request_finished(E, RequestId(f"r{i}"), clock())
        clock.now += 0.01
    assert link.verified == 1
    sent(fleet, clock, "r3", prompts[3])
    fleet.request_finished(E, RequestId("r3"), clock())  # while the verification is in flight
    last_sent = clock()
    clock.now += 0.01
    for seq, prompt in enumerate(prompts[:3]):  # the replay: the held batches of the first three
        fleet.on_batch(EngineName("e"), seq, KVEventBatch(0.0, [stored(prompt)]))
    fleet.on_signal(EngineName("e"), CaughtUp(2))
    # late stores are no cause; the fourth's, answered and still missing, keep the mirror catching up
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.STORES_LATE)
    clock.now = last_sent + SILENCE_S
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.SILENT)
    fleet.on_batch(EngineName("e"), 3, KVEventBatch(0.0, [stored(prompts[3])]))  # events flow again
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_silence_does_not_hide_a_tokenizer_mismatch() -> None:
    """Stores under other keys never end a request's wait, so with slow traffic the mirror is silent
    first; the requests that end meanwhile are still counted, and the verified link names the cause."""
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    link = FakeLink()
    fleet.attach(E, link)
    for i in range(3):
        sent(fleet, clock, f"r{i}", list(range(100 * i, 100 * i + 10)))
        fleet.on_batch(EngineName("e"), i, KVEventBatch(0.0, [store(2)]))  # the engine's own keys
        clock.now += SILENCE_S
        assert status(fleet, clock) == (TrustState.STALE, TrustReason.SILENT)
        fleet.request_finished(E, RequestId(f"r{i}"), clock())
    assert link.verified == 1
    fleet.on_signal(EngineName("e"), CaughtUp(2))
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.TOKENIZER_MISMATCH)


def test_a_request_that_stored_nothing_is_awaited_no_longer_once_it_is_accounted_for() -> None:
    """A request that ended without an answer computed nothing; one answered without stores (an
    engine error, an eviction) is forgiven when a later request's first block is seen."""
    fleet, clock = fleet_of(engine())
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    sent(fleet, clock, "refused", list(range(10)), answered=False)
    fleet.request_finished(E, RequestId("refused"), clock())
    clock.now += SILENCE_S
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)
    sent(fleet, clock, "error", list(range(100, 110)))
    fleet.request_finished(E, RequestId("error"), clock())
    clock.now += 1.0
    good = list(range(200, 210))
    sent(fleet, clock, "good", good)
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(good)]))
    fleet.request_finished(E, RequestId("good"), clock())
    clock.now += SILENCE_S
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_a_replay_asked_makes_the_mirror_catch_up_before_any_batch_or_scrape() -> None:
    """The link signals each replay it asks (a gap's, a verification's, a retry's): the very next
    trust read (a routing decision's) says so, though no batch arrives and no metrics are scraped
    (before, only `Replica.poll` of the link's counters did, on those two occasions)."""
    fleet, clock = followed_fleet()  # its link's counters say nothing of the replay
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)
    fleet.on_signal(EngineName("e"), RequestReplay(4))
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT)
    clock.now += 60.0
    fleet.on_signal(EngineName("e"), RequestReplay(4))  # the retry of an unanswered one
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT)
    fleet.on_signal(EngineName("e"), CaughtUp(4))
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def expected(paused_for: float, late: bool) -> tuple[TrustState, TrustReason]:
    """The trust of a mirror whose events paused `paused_for` ago while requests flowed."""
    if paused_for >= SILENCE_S:
        return TrustState.STALE, TrustReason.SILENT
    return (TrustState.CATCHING_UP, TrustReason.STORES_LATE) if late else (TrustState.FRESH, TrustReason.OK)


def test_a_conversation_whose_events_pause_goes_silent_though_every_turn_finds_its_first_block() -> None:
    """Every turn of a conversation shares its first block with the first turn, so finding it says
    nothing of the link: the turns whose stores never come stay awaited, and the mirror is silent
    `silence_s` after the first of them was sent, however short each turn is (before, each turn's
    end forgave the earlier ones, the clock restarted at every send, and the mirror stayed fresh
    through the whole pause while its prediction fell behind the engine's hits). Before that, from
    the first turn that ends without its stores, the mirror is catching up (`stores_late`)."""
    fleet, clock = followed_fleet()
    turns = [list(range(10 + 8 * i)) for i in range(12)]  # each turn the last one and 8 tokens more
    sent(fleet, clock, "t0", turns[0])
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(turns[0])]))
    fleet.request_finished(E, RequestId("t0"), clock())
    paused_at = clock()  # the engine's events pause: no turn's stores arrive from here on
    for i, turn in enumerate(turns[1:], 1):
        sent(fleet, clock, f"t{i}", turn)
        clock.now += SILENCE_S / 4  # each turn much shorter than the silence limit
        assert status(fleet, clock) == expected(clock() - paused_at, late=i > 1), i
        fleet.request_finished(E, RequestId(f"t{i}"), clock())
        assert status(fleet, clock) == expected(clock() - paused_at, late=True), i
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.SILENT)
    seq = 1
    for turn in turns[1:]:  # the events resume: every turn's stores, late
        fleet.on_batch(EngineName("e"), seq, KVEventBatch(0.0, [stored(turn)]))
        seq += 1
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_a_later_request_whose_own_stores_were_seen_forgives_an_earlier_one_that_stored_nothing() -> None:
    """An answered request whose blocks never appear (evicted before its end, or never stored) is
    forgiven once a request sent after it ends with its own blocks seen: the link delivered stores
    published after the earlier one's."""
    fleet, clock = followed_fleet()
    sent(fleet, clock, "lost", list(range(100, 110)))
    fleet.request_finished(E, RequestId("lost"), clock())
    clock.now += 1.0
    later = list(range(200, 210))
    sent(fleet, clock, "later", later)
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(later)]))
    clock.now += SILENCE_S
    assert status(fleet, clock) == (TrustState.STALE, TrustReason.SILENT)  # "later" still runs
    fleet.request_finished(E, RequestId("later"), clock())
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def held_then_lost(fleet: FleetState, clock: Clock, prompt: list[int]) -> None:
    """Request "first" of `prompt` stored (batch 0) and ended, then request "lost" answered and ended
    without its stores."""
    sent(fleet, clock, "first", prompt)
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(prompt)]))
    fleet.request_finished(E, RequestId("first"), clock())
    sent(fleet, clock, "lost", list(range(100, 110)))
    fleet.request_finished(E, RequestId("lost"), clock())


def test_a_prompt_already_held_whole_forgives_no_earlier_request_however_it_is_aligned() -> None:
    """A block-aligned prompt whose blocks the mirror holds stores only a copy of its last block (the
    hit stops one token short), which "held" cannot tell from the block: its end proves nothing of
    the link, so an earlier request whose stores are missing stays late (before, it was awaited on
    keys held at send and its end forgave the earlier one: the mirror said fresh while behind)."""
    fleet, clock = followed_fleet()
    held = list(range(300, 316))  # four full blocks, block-aligned
    held_then_lost(fleet, clock, held)
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.STORES_LATE)
    for i, prompt in enumerate([held, held[:12], [*held, 1, 2]]):  # aligned, aligned prefix, unaligned
        sent(fleet, clock, f"again{i}", prompt)
        fleet.request_finished(E, RequestId(f"again{i}"), clock())
        assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.STORES_LATE), i


def test_a_partly_held_prompt_is_awaited_on_its_new_blocks_only() -> None:
    """A turn that extends a held prefix is awaited until its new blocks are seen, and then forgives
    the earlier requests: those blocks were stored after its send."""
    fleet, clock = followed_fleet()
    first = list(range(300, 308))
    held_then_lost(fleet, clock, first)
    turn = [*first, *range(400, 408)]
    sent(fleet, clock, "turn", turn)
    rep = fleet.replica(E)
    assert rep.awaited._by_request[RequestId("turn")].keys == prepared(fleet, turn).keys[2:]
    fleet.on_batch(EngineName("e"), 1, KVEventBatch(0.0, [stored(turn)]))
    fleet.request_finished(E, RequestId("turn"), clock())
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_an_answered_request_whose_stores_are_missing_makes_the_mirror_catch_up_until_they_arrive() -> None:
    """The engine publishes a request's stores before answering it, so once it has ended without them
    the mirror is behind at once (a lost last batch shows no gap until the engine publishes again):
    `stores_late` at the very next decision, not `silence_s` after its send; its stores, arriving
    while an older request still runs, clear it."""
    fleet, clock = followed_fleet()
    sent(fleet, clock, "slow", list(range(100, 110)))  # still running: nothing is due from it yet
    lost = list(range(200, 210))
    sent(fleet, clock, "lost", lost)
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)
    fleet.request_finished(E, RequestId("lost"), clock())
    assert status(fleet, clock) == (TrustState.CATCHING_UP, TrustReason.STORES_LATE)
    fleet.on_batch(EngineName("e"), 0, KVEventBatch(0.0, [stored(lost)]))  # late, not lost after all
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_a_restart_forgets_the_awaited_stores_with_the_view() -> None:
    fleet, clock = followed_fleet()
    sent(fleet, clock, "r", list(range(10)))
    fleet.on_signal(EngineName("e"), LinkReset(reason="restart"))  # the engine's cache is gone with it
    fleet.on_signal(EngineName("e"), CaughtUp(None))
    clock.now += SILENCE_S
    assert status(fleet, clock) == (TrustState.FRESH, TrustReason.OK)


def test_variant_groups_are_the_replicas_of_the_model_by_variant_as_the_engine_set_changes() -> None:
    other = ModelConfig(name="o", block_size=4)
    config = RouterConfig(models=[MODEL, other])
    fleet = FleetState(config, KeyHasher(b"t"), Clock())

    def add(name: str, model: ModelConfig, ranks: int = 1) -> None:
        events = [f"ipc://{name}{r}.pub" for r in range(ranks)]
        cfg = EngineConfig(name=name, url=f"http://{name}:1", model=model.name, events=events)
        fleet.add_engine(cfg, resolve_variant(model, cfg), 0.0)

    def plain(model: str) -> list[tuple[str, list[EngineId]]]:
        out: dict[str, list[EngineId]] = {}
        for rid in fleet.replicas(model):
            out.setdefault(fleet.replica(rid).variant.id, []).append(rid)
        return list(out.items())

    def grouped(model: str) -> list[tuple[str, list[EngineId]]]:
        return [(variant.id, list(rids)) for variant, rids in fleet.variant_groups(model)]

    assert grouped("m") == plain("m") == []
    add("a", MODEL, ranks=2)
    add("x", other)
    assert grouped("m") == plain("m") and len(grouped("m")[0][1]) == 2
    add("b", MODEL)
    assert grouped("m") == plain("m") and grouped("o") == plain("o")
    fleet.remove_engine("a")
    assert grouped("m") == plain("m") == [("m", [EngineId("b")])]
    for variant, rids in fleet.variant_groups("m"):
        assert all(fleet.replica(rid).variant.spec == variant.spec for rid in rids)


def test_a_replica_without_events_awaits_no_stores_and_keeps_no_reports_but_its_pending_prefixes() -> None:
    blind = EngineConfig(name="e", url="http://e:8000", model="m")
    fleet, clock = fleet_of(blind)
    rep = fleet.replica(E)
    before = fleet.trust(E, clock())
    sent(fleet, clock, "a", list(range(10)))
    assert len(rep.awaited) == 0 and rep.pending == {} and fleet.pending.holds(E)
    clock.now += 2 * SILENCE_S
    fleet.request_finished(E, RequestId("a"), clock())
    assert fleet.trust(E, clock()) == before  # stale for want of events, never silent
    assert (before.state, before.reason) == (TrustState.STALE, TrustReason.HISTORY_LOST)


def test_a_replica_with_events_awaits_the_stores_and_keeps_the_reports_of_a_request_sent() -> None:
    fleet, clock = fleet_of(engine())
    rep = fleet.replica(E)
    sent(fleet, clock, "a", list(range(10)))
    assert len(rep.awaited) == 1 and list(rep.pending) == [RequestId("a")]
    fleet.request_finished(E, RequestId("a"), clock())
    assert rep.pending == {}


def test_a_replica_keeps_its_specs_layout_facts() -> None:
    """What the request hooks read of the layout per request is the spec's own, for every kind."""
    for groups in (
        (GroupSpec(),),
        (GroupSpec(block_size=16), GroupSpec(kind="sliding_window", block_size=16, sliding_window=64)),
        (GroupSpec(kind="sliding_window", block_size=32, sliding_window=128),),
    ):
        spec = ModelSpec(groups=groups)
        e = engine()
        variant = resolve_variant(MODEL, e)
        rep = Replica(
            id=E,
            engine=e,
            rank=0,
            variant=msgspec.structs.replace(variant, spec=spec),
            tracker=TrustTracker(1.0),
        )
        assert (rep.unitary, rep.hash_block) == (spec.unitary_full_attention, spec.hash_block_size)


def test_request_hooks_keep_the_same_reports_and_waits_with_or_without_pending_prefixes() -> None:
    """With no pending prefixes to keep (round_robin) the hooks skip the overlay, and only it: the
    awaited stores, first keys and full-mode reports are those kv's hooks keep."""
    from router.settings.config import PolicyConfig

    fleets = []
    for policy in ("kv", "round_robin"):
        clock = Clock()
        config = RouterConfig(engines=[engine()], models=[MODEL], policy=PolicyConfig(name=policy))
        fleet = FleetState(config, KeyHasher(b"t"), clock)
        fleet.add_engine(engine(), resolve_variant(MODEL, engine()), clock())
        for i in range(6):
            clock.now += 0.01
            request = RequestId(f"r{i}")
            fleet.request_sent(E, request, prepared(fleet, list(range(i, i + 4 * i + 3))), clock())
            if i % 2:
                fleet.request_answered(request, clock())
            if i % 3 == 2:
                fleet.request_finished(E, request, clock())
        fleets.append(fleet)
    kv, rr = fleets
    assert kv.pending.size > 0 and rr.pending.size == 0 and not rr.pending.holds(E)
    assert (kv._first_keys, kv._answered_keys) == (rr._first_keys, rr._answered_keys)
    kv_rep, rr_rep = kv.replica(E), rr.replica(E)
    assert (kv_rep.pending, kv_rep.finished) == (rr_rep.pending, rr_rep.finished)
    assert kv_rep.awaited._by_request == rr_rep.awaited._by_request and len(kv_rep.awaited) > 0
